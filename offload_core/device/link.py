"""The rate of the link from host memory to a device, timed with one copy.

Why a copy of its own: where the engine streams, every copy it makes is timed in the run's
picture, and the link's rate comes from those. Where another streamer moves the weights (core's
Dynamic VRAM), the engine sees only how long each block took, not how long its weights took to
arrive, so the rate that prices a block's copy is measured apart: one copy of ``PROBE_BYTES`` from
pinned host memory (page-locked where the device is a GPU), after one unmeasured copy that takes
the first-use costs.
"""

from __future__ import annotations

import torch

from ..ordering import for_device

PROBE_BYTES = 32 << 20


def copy_rate(device: torch.device, nbytes: int = PROBE_BYTES) -> float | None:
    """Bytes per ms of a host-to-``device`` copy of ``nbytes``; None where it cannot be timed (no
    memory for the buffers)."""
    device = torch.device(device)
    ordering = for_device(device)
    try:
        source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError):
        return None
    source.fill_(1)
    stream = ordering.current_stream()
    target.copy_(source, non_blocking=True)
    start, end = ordering.event(timing=True), ordering.event(timing=True)
    start.record(stream)
    target.copy_(source, non_blocking=True)
    end.record(stream)
    end.synchronize()
    ms = start.elapsed_time(end)
    return nbytes / ms if ms > 0 else None
