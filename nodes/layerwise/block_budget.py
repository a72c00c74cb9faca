"""How much device memory the layerwise engine may take for a model's blocks, decided when a
sampling run starts.

Why at the start of a run and not in the node: what is free on the card depends on everything
loaded since the node ran, and on the run itself (the latent's size sets the activations). Why
not simply the user's number: a 12 GiB budget on an 8 GiB card runs out of memory half-way
through the attach, so a budget is clamped to what is left.

What is left is computed exactly as core's own sampler computes it for the whole model
(`sampler_helpers._prepare_sampling` → `model_management.load_models_gpu`): what is free once
core has made room, plus what the model already has loaded, less the larger of core's minimum
inference memory (0.8 GiB plus its reserve) and the activations it estimates for the latent
(plus its reserve). That is the most core itself would let the model's weights take; the
engine's blocks get it less the model's other weights, which core loads itself, and less what
merging weight patches (LoRA) into streamed copies needs on the device.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass

import torch

import comfy.model_management

from ...offload_core.device.residency import fit_budget
from ...offload_core.units import size_text
from ..core.models import loaded_entries

log = logging.getLogger(__name__)

MIB = 1024 ** 2


def cached_bytes(nbytes: int, count: int = 1) -> int:
    """What CUDA's caching allocator reserves for ``count`` live allocations of ``nbytes`` each
    on a stream that has nothing cached, and keeps for that stream once they are freed (core
    counts it as free memory then). Up to 1 MiB they share 2 MiB segments, up to 10 MiB 20 MiB
    segments, larger ones each get a segment of their size rounded up to 2 MiB
    (c10/cuda/CUDACachingAllocator.cpp: kSmallSize, kSmallBuffer, kMinLargeAlloc, kLargeBuffer,
    kRoundLarge); a block is a multiple of 512 bytes."""
    if nbytes <= 0 or count <= 0:
        return 0
    block = -(-nbytes // 512) * 512
    if block >= 10 * MIB:
        return count * (-(-block // (2 * MIB)) * 2 * MIB)
    segment = 2 * MIB if block <= MIB else 20 * MIB
    return -(-count // (segment // block)) * segment


def cublas_workspace_bytes(device: torch.device) -> int:
    """The workspace torch's cuBLAS (and, sharing it by default, cuBLASLt) allocates for each
    thread and stream that runs a matrix product on ``device``, and holds as long as the thread
    lives: the merges on the engine's copy stream make one. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return workspace_config_bytes(
        os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        or (os.environ.get("HIPBLAS_WORKSPACE_CONFIG") or os.environ.get("ROCBLAS_WORKSPACE_CONFIG")
            if torch.version.hip else None),
        (props.major, props.minor), getattr(props, "gcnArchName", "") if torch.version.hip else None)


def workspace_config_bytes(config: str | None, capability: tuple[int, int],
                           rocm_arch: str | None = None) -> int:
    """torch's cuBLAS workspace size (aten/src/ATen/cuda/CublasHandlePool.cpp,
    parseChosenWorkspaceSize): the sum of SIZE KiB x COUNT over the ``:SIZE:COUNT`` pairs of
    CUBLAS_WORKSPACE_CONFIG, else its default: 32 MiB on Hopper and Blackwell (compute capability
    9, 10, 12; older torch gives it to 9.0 only, so this errs on the safe side), 4096 KiB x 2 +
    16 KiB x 8 on older cards; on ROCm 32 MiB, 128 MiB on gfx94x/gfx95x."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if rocm_arch is not None:
        return (128 if rocm_arch.startswith(("gfx94", "gfx95")) else 32) * MIB
    return 32 * MIB if capability[0] in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class DeviceRoom:
    """Device memory for the model's weights as core's sampler would see it when the run starts."""

    weights: int  # the most core would let the model's weights take now (its lowvram figure)
    free: int  # free on the device once core has made room
    loaded: int  # what the model already has loaded (core counts it as room)
    kept: int  # what core keeps free beside the weights: its inference minimum or the activations
    rest: int  # the model's weights outside the blocks, which core loads itself
    merge: int  # device memory for merging weight patches into streamed copies (0 without)

    @property
    def for_blocks(self) -> int:
        return self.weights - self.rest - self.merge


def choose_budget(model_name: str, requested: int | None, room: DeviceRoom, least: int,
                  most: int) -> int:
    """The engine's byte budget for this run (`fit_budget`), with the refusal and the clamp
    said in the node's own terms."""
    budget = fit_budget(requested, room.for_blocks, least, most)
    if budget is None:
        merge = f", {size_text(room.merge)} for merging its LoRA" if room.merge else ""
        raise ValueError(
            f"Apply Layerwise Offload: {model_name} needs at least {size_text(least)} of GPU memory to "
            f"stream its blocks (prefetch + 1 slots of its largest block), but only "
            f"{size_text(max(room.for_blocks, 0))} is left: ComfyUI would let the model's weights "
            f"take {size_text(room.weights)} ({size_text(room.free)} free after it made room, "
            f"{size_text(room.loaded)} already loaded, less {size_text(room.kept)} it keeps for "
            f"activations and its reserve), less {size_text(room.rest)} for the model's other "
            f"weights{merge}. Lower prefetch or the resolution, or free GPU memory.")
    if requested is not None and budget < requested:
        log.info("[tiered offload] Apply Layerwise Offload: %s: vram_budget_gb %s lowered to %s, what is left on "
                 "the card for its blocks", model_name, size_text(requested), size_text(budget))
    return budget


def device_room(patcher, rest_bytes: int, wanted: int, noise_shape, conds, model_options=None,
                merge_bytes: int = 0) -> DeviceRoom:
    """Ask core to make room the way its sampler would, then compute what it would leave.

    ``wanted``: the most the engine would take for the blocks this run. Core is asked to free
    what the model (its rest, those blocks, the merge workspace) and the other models of the
    run still need on the device, plus its inference memory, as `load_models_gpu` asks; the
    model's own loaded entries are kept. The models core loads with it (ControlNets and the
    like) are counted as loaded before it, as 0.33 orders them (0.3.75's order is a set's).
    """
    mm = comfy.model_management
    device = patcher.load_device
    extras, extra_inference = _additional_models(patcher, conds, model_options)
    kept, extra_mem = kept_beside_weights(patcher, noise_shape, conds, extra_inference)
    inference = mm.minimum_inference_memory()
    loaded = int(patcher.loaded_size())
    extra_weights = sum(_not_loaded(m, device) for m in extras)
    to_place = max(0, rest_bytes + wanted + merge_bytes - loaded) + extra_weights
    mm.free_memory(to_place * 1.1 + extra_mem, device, keep_loaded=loaded_entries(patcher.model))
    free = int(mm.get_free_memory(device))
    current = free + loaded - extra_weights  # load_models_gpu's current_free_mem for this model
    ratio = getattr(mm, "MIN_WEIGHT_MEMORY_RATIO", 0.0)
    weights = max(0, current - kept, min(current * ratio, current - inference))
    return DeviceRoom(weights=math.floor(weights), free=free, loaded=loaded, kept=math.ceil(kept),
                      rest=rest_bytes, merge=merge_bytes)


def kept_beside_weights(patcher, noise_shape, conds, extra_inference: int = 0) -> tuple[float, float]:
    """What core's `load_models_gpu` keeps free beside the weights (its minimum_memory_required)
    and what it frees for the run (its extra_mem): the larger of its minimum inference memory
    (which already holds the reserve) and the activations it estimates plus the reserve."""
    mm = comfy.model_management
    need, need_least = _activations(patcher, noise_shape, conds)
    inference = mm.minimum_inference_memory()
    reserve = mm.extra_reserved_memory()
    return (max(inference, need_least + extra_inference + reserve),
            max(inference, need + extra_inference + reserve))


def _activations(patcher, noise_shape, conds) -> tuple[float, float]:
    """Core's estimate of the run's activations: for the batch with its uncond pass, and for the
    smallest batch (what core keeps free beside the weights)."""
    import comfy.sampler_helpers

    estimate = getattr(comfy.sampler_helpers, "estimate_memory", None)
    if callable(estimate) and noise_shape is not None:
        try:
            need, least = estimate(patcher, noise_shape, conds or {})
            return need, least
        except Exception:  # an estimate is advice; core recomputes it for its own load
            log.debug("[tiered offload] Apply Layerwise Offload: no activation estimate", exc_info=True)
    return 0, 0


def _additional_models(patcher, conds, model_options) -> tuple[list, int]:
    """The models core's sampler loads with this one, and the inference memory they add."""
    import comfy.sampler_helpers as helpers

    models, inference = [], 0
    from_conds = getattr(helpers, "get_additional_models", None)
    if callable(from_conds) and conds:
        models, inference = from_conds(conds, patcher.model_dtype())
        models = list(models)
    from_options = getattr(helpers, "get_additional_models_from_model_options", None)
    if callable(from_options):
        models += from_options(model_options)
    nested = getattr(patcher, "get_nested_additional_models", None)
    if callable(nested):
        models += nested()
    for m in list(models):
        patch_models = getattr(m, "model_patches_models", None)
        models += patch_models() if callable(patch_models) else []
    own = getattr(patcher, "model_patches_models", None)
    models += own() if callable(own) else []
    return [m for m in dict.fromkeys(models) if m is not patcher], int(inference)


def _not_loaded(model, device) -> int:
    """Bytes of an additional model core still has to place on ``device``."""
    if getattr(model, "load_device", None) != device:
        return 0
    size = getattr(model, "model_size", None)
    loaded = getattr(model, "loaded_size", None)
    return max(0, int(size()) - int(loaded())) if callable(size) and callable(loaded) else 0
