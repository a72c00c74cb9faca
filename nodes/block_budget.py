"""How much device memory the layerwise engine may take for a model's blocks, decided when a
sampling run starts.

Why at the start of a run and not in the node: what is free on the card depends on everything
loaded since the node ran, and on the run itself (the latent's size sets the activations). Why
not simply the user's number: a 12 GiB budget on an 8 GiB card runs out of memory half-way
through the attach, so a budget is clamped to what is left once core has made room and the rest
of sampling (the model's other weights, activations, core's own reserve) is provided for.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import comfy.model_management

from ..offload_core.residency import fit_budget
from ..offload_core.units import size_text
from .core_models import loaded_entries

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DeviceRoom:
    """Device memory as seen when the run starts."""

    free: int  # free once core has made room
    others: int  # what the rest of the run needs: other weights, activations, core's reserve


def choose_budget(model_name: str, requested: int | None, room: DeviceRoom, least: int,
                  most: int) -> int:
    """The engine's byte budget for this run (`fit_budget`), with the refusal and the clamp
    said in the node's own terms."""
    available = room.free - room.others
    budget = fit_budget(requested, available, least, most)
    if budget is None:
        raise ValueError(
            f"Apply Layerwise Offload: {model_name} needs at least {size_text(least)} of GPU memory to "
            f"stream its blocks (prefetch + 1 slots of its largest block), but only "
            f"{size_text(max(available, 0))} is left: {size_text(room.free)} free after ComfyUI made room, "
            f"less {size_text(room.others)} for the model's other weights, activations and ComfyUI's "
            "reserve. Lower prefetch or the resolution, or free GPU memory.")
    if requested is not None and budget < requested:
        log.info("Apply Layerwise Offload: %s: vram_budget_gb %s lowered to %s, what is left on "
                 "the card for its blocks", model_name, size_text(requested), size_text(budget))
    return budget


def device_room(patcher, rest_bytes: int, least: int, noise_shape, conds) -> DeviceRoom:
    """Ask core to make room for at least the smallest plan, then measure what is left.

    Core is asked the way its own sampler would ask (`load_models_gpu`): the model's weights
    outside the blocks that are not loaded yet, the activations it estimates for this latent,
    its inference reserve. The model's own loaded entries are kept loaded.
    """
    mm = comfy.model_management
    device = patcher.load_device
    entries = loaded_entries(patcher.model)
    loaded = min(patcher.model.model_loaded_weight_memory, rest_bytes) if entries else 0
    others = (rest_bytes - loaded) + _activations(patcher, noise_shape, conds) \
        + mm.minimum_inference_memory() + _extra_reserved()
    mm.free_memory(least + others, device, keep_loaded=entries)
    return DeviceRoom(free=int(mm.get_free_memory(device)), others=int(others))


def _activations(patcher, noise_shape, conds) -> int:
    """Core's estimate of the run's activations (its sampler asks for the same)."""
    import comfy.sampler_helpers

    estimate = getattr(comfy.sampler_helpers, "estimate_memory", None)
    if callable(estimate) and noise_shape is not None:
        try:
            return int(estimate(patcher, noise_shape, conds)[0])
        except Exception:  # an estimate is advice; core recomputes it for its own load
            log.debug("Apply Layerwise Offload: no activation estimate", exc_info=True)
    return 0


def _extra_reserved() -> int:
    probe = getattr(comfy.model_management, "extra_reserved_memory", None)
    return int(probe()) if callable(probe) else 0
