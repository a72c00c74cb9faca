"""A ring of preallocated device byte slots fed from host packs.

Why owned slots ordered by events: addresses and memory stay fixed (no
caching-allocator churn, no fragmentation), and a slot is overwritten only after
an event recorded behind its last reader, on the GPU, with no host sync.  All
slot writes happen on one side stream, all reads on the compute stream (the
caller's current stream, looked up outside any side-stream context).  On CPU the
same calls are plain synchronous copies, so scheduling is testable without CUDA.
"""

from __future__ import annotations

import torch

from .telemetry import Telemetry


def resolve_device(device: torch.device | str) -> torch.device:
    """A usable compute device with an explicit index, or a ValueError saying why not."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device {dev} is not supported; use a cpu or cuda device")
    return dev


class SlotRing:
    """``count`` device buffers of ``nbytes`` each, with copy-in / ready / free ordering."""

    def __init__(self, device: torch.device, count: int, nbytes: int, telemetry: Telemetry) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.nbytes = nbytes
        self._tel = telemetry
        with torch.inference_mode(False):
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
        telemetry.add_device_alloc(count * nbytes)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            # Fresh slot memory may be recycled from tensors that queued compute work still reads.
            self.stream.wait_stream(torch.cuda.current_stream(device))
            self._ready = [torch.cuda.Event() for _ in range(count)]
            self._free = [torch.cuda.Event() for _ in range(count)]

    def copy_in(self, slot: int, host: torch.Tensor) -> None:
        """One copy of a whole packed block into ``slot``, after the slot's last reader is done."""
        n = host.numel()
        dst = self.buffers[slot][:n]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self._free[slot])  # no-op until the slot has had a reader
                dst.copy_(host, non_blocking=True)
                self._ready[slot].record(self.stream)
        else:
            dst.copy_(host)
        self._tel.record_copy(n)

    def wait_ready(self, slot: int) -> None:
        """Make the compute stream wait (GPU-side) for the slot's last copy."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        stalls = self._tel.stalls
        if stalls is None:
            compute.wait_event(self._ready[slot])
            return
        pair = stalls.begin(compute)
        compute.wait_event(self._ready[slot])
        stalls.end(pair, compute)

    def mark_free(self, slot: int) -> None:
        """Record that every compute work queued so far is the slot's last reader."""
        if self.cuda:
            self._free[slot].record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Wait for in-flight work, then give the memory back."""
        self.synchronize()
        self._tel.add_device_alloc(-len(self.buffers) * self.nbytes)
        self.buffers = []
