"""Granularity `auto`: whole blocks, unless only phases fit.

Why not planned pass by pass like the other auto settings: phases and blocks are two layouts of
the host pack, so changing one for the other packs the whole model again (and, from disk, writes
its spill file again). Blocks are the default because they make the fewest, largest copies; a
block is split into its phases only where a whole block cannot stream at all: when the GPU budget
holds fewer than the two slots of the largest block that streaming needs at least, or the host
cache fewer than the three units it must hold at once, and its phases fit.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...offload_core.alignment import PAGE, align_up
from ...offload_core.layerwise.streamer import LayerwiseStreamer
from ...offload_core.units import size_text
from .settings import LayerwiseSettings

BLOCK, PHASE = "block", "phase"


def _least(blocks: Sequence[torch.nn.Module], granularity: str) -> tuple[int, int] | None:
    """(device bytes streaming needs at least, largest unit) with this granularity, read from
    tensor metadata (nothing moves); None where the blocks have no phases the engine can find."""
    try:
        probe = LayerwiseStreamer(list(blocks), "cpu", resident=0, prefetch=1, granularity=granularity,
                                  timing=False)
    except ValueError:
        return None
    return probe.bound_range()[0], max(u["bytes"] for u in probe.describe_units())


def choose(blocks: Sequence[torch.nn.Module], settings: LayerwiseSettings,
           room: int | None = None) -> tuple[str, str]:
    """(granularity, why) for these blocks: the node's, or under auto blocks unless only phases
    fit ``room`` (device bytes for the blocks, None: not known yet) or the host cache."""
    if not settings.auto_granularity:
        return settings.granularity, "set on the node"
    cap = int(settings.host_cache_gb * 1024 ** 3) if settings.host_cache_gb > 0 else None
    block = _least(blocks, BLOCK) if cap is not None or room is not None else None
    if block is None:
        return BLOCK, "whole blocks"
    need = min(3, len(blocks))  # two slots at prefetch 1, and one unit read ahead
    if cap is not None and cap // align_up(block[1], PAGE) < need:
        phase = _least(blocks, PHASE)
        if phase is not None and cap // align_up(phase[1], PAGE) >= need:
            return PHASE, (f"phases: the host cache holds fewer than {need} whole blocks of "
                           f"{size_text(block[1])}")
    if room is not None and block[0] > room:
        phase = _least(blocks, PHASE)
        if phase is not None and phase[0] <= room:
            return PHASE, (f"phases: streaming whole blocks needs {size_text(block[0])} of VRAM, "
                           f"{size_text(room)} is left for the blocks")
    return BLOCK, "whole blocks"
