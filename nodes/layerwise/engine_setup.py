"""The engine a session runs, from the node's settings: what the blocks weigh, where their host
copy lives, where disk streaming reads them, the streamer, and the refusals that come first.

Why apart from the session: these are decided once per model (and again only when granularity
auto changes the units), from the settings and the model alone; the session's own job is the run
(begin, account, end) and what it reports.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

import comfy.model_management

from ...offload_core.disk.in_place import ModelFileMap
from ...offload_core.disk.tier import AUTO_READERS, DiskOptions
from ...offload_core.host.released import released
from ...offload_core.sharing.shared_packing import HostShare
from ...offload_core.layerwise.streamer import LayerwiseStreamer
from ...offload_core.layerwise.tuning import AUTO
from ...offload_core.units import size_text
from ..core import host_sharing
from . import core_loads, file_map, spill_folder
from .settings import GIB, LayerwiseSettings

log = logging.getLogger(__name__)


def weights(model: torch.nn.Module, blocks) -> tuple[int, int]:
    """(the blocks' bytes, the rest's bytes) in core's own count of the model; tensors an earlier
    engine left in the model's file count with what they hold there."""
    held_in_file = sum(note.nbytes for b in blocks for t in [*b.parameters(), *b.buffers()]
                       if (note := released(t)) is not None)
    block_bytes = sum(comfy.model_management.module_size(b) for b in blocks) + held_in_file
    return block_bytes, max(0, comfy.model_management.module_size(model) + held_in_file - block_bytes)


def host_share(model: torch.nn.Module, settings: LayerwiseSettings) -> tuple[HostShare | None, str | None]:
    """One host copy per machine: the pack maps the store of this file's blocks that another
    ComfyUI process made, or makes it for them (core/host_sharing.py); with why not. Disk
    streaming reads the model's own file (or a spill file), not a store: nothing to share."""
    if settings.host_cache_gb > 0:
        return None, "the blocks stream from disk"
    spill_dir = spill_folder.spill_folder(settings.spill_dir) if settings.spill_dir.strip() else None
    return host_sharing.share_for(model, settings.share_host_memory, spill_dir=spill_dir)


def find_model_file(settings: LayerwiseSettings, model: torch.nn.Module, blocks, prefixes: tuple[str, ...],
                    model_class: str) -> ModelFileMap | None:
    """Where disk streaming reads the blocks: the model's own file where it serves (file_map.py
    finds it; core_loads.py reads the blocks back before core runs the model itself), else None
    (the spill file)."""
    if settings.host_cache_gb <= 0 or not core_loads.installed():
        return None
    return file_map.find(model, blocks, prefixes, model_class)


def make_streamer(blocks, device: torch.device, settings: LayerwiseSettings, granularity: str,
                  share: HostShare | None = None, model_file_map: ModelFileMap | None = None) -> LayerwiseStreamer:
    """The engine for the node's settings at ``granularity``; settings left to auto go to its
    tuner, and under auto the disk tier's readers read as far ahead as the tuner says. Disk
    streaming reads ``model_file_map``'s file where it serves, else a spill file."""
    disk = None
    if settings.host_cache_gb > 0:
        auto = settings.auto_read_ahead
        disk = DiskOptions(cap_bytes=int(settings.host_cache_gb * GIB),
                           workers=AUTO_READERS if auto else settings.disk_workers,
                           spill_dir=spill_folder.spill_folder(settings.spill_dir),
                           model_file=model_file_map, read_ahead=AUTO if auto else None)
    rules = settings.streamer_kwargs()  # the one place the node's 0 and -1 become the engine's auto
    return LayerwiseStreamer(list(blocks), device, resident=rules["resident"], prefetch=rules["prefetch"],
                             pin=rules["pin"], granularity=granularity, disk=disk, share=share)


def refuse_budget_below_streaming(settings: LayerwiseSettings, least: int, model_class: str) -> None:
    """Refuse, before anything moves, a vram_budget_gb that cannot hold the slots streaming every
    block needs (``least``)."""
    requested = settings.requested_budget
    if settings.resident_blocks >= 0 or requested is None or requested >= least:
        return
    slots = "2 slots, at prefetch 1," if settings.auto_prefetch else f"prefetch + 1 = {settings.prefetch + 1} slots"
    raise ValueError(
        f"Apply Layerwise Offload: vram_budget_gb={settings.vram_budget_gb:g} GiB is too small for "
        f"{model_class}: streaming every block needs {size_text(least)} ({slots} of its largest "
        f"block), and the budget leaves {size_text(requested)} for them. Raise vram_budget_gb, "
        "lower prefetch, or set 0 for auto.")


def run_timeline(streamer: LayerwiseStreamer, model_class: str) -> dict[str, Any] | None:
    """The run's picture, None unless it was recorded. A picture that cannot be resolved (a CUDA
    event the device refuses to time) is logged and left out: it must never fail the prompt, nor
    keep the model from going back to core."""
    try:
        return streamer.timeline()
    except RuntimeError as e:
        log.warning("[tiered offload] Apply Layerwise Offload: the picture of %s's last run is left out: %s",
                    model_class, e)
        return None
