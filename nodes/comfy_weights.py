"""ComfyUI-side weight handling for streamed blocks: LoRA baking and hand-over from core.

Core merges LoRA into a fully loaded weight with `comfy.lora.calculate_weight` on the load device
(in fp32 up to 0.3.x; newer ComfyUI uses `model_management.lora_compute_dtype(device)`, fp16 on
GPUs that favour it) and stochastic-rounds it with a per-key seed. Doing exactly that when packing
makes a streamed block bit-identical to the same block loaded by core.
"""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils

# Newer ComfyUI moved string_to_seed to comfy.utils and left a shim in comfy.model_patcher that
# logs a warning on every call (once per patched key here); 0.3.75 has only the latter.
_string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


def lora_merge_dtype(device: torch.device) -> torch.dtype:
    """The dtype core's `patch_weight_to_device` merges LoRA in on this device."""
    probe = getattr(comfy.model_management, "lora_compute_dtype", None)
    return probe(device) if callable(probe) else torch.float32


def block_keys(prefix: str, block: torch.nn.Module) -> list[str]:
    """State-dict keys of a block's parameters, as ModelPatcher names them."""
    return [f"{prefix}.{name}" for name, _ in block.named_parameters()]


def patch_fingerprint(patches: dict, keys: Sequence[str]) -> Hashable:
    """What decides a block's baked weights: the patch entries touching its keys.

    Entries are (strength_patch, value, strength_model, offset, function); the adapter
    objects are compared by identity, which is stable while the LoRA stays loaded.
    """
    out = []
    for key in keys:
        for entry in patches.get(key, ()):
            strength_patch, value, strength_model, offset, function = entry
            out.append((key, float(strength_patch), id(value), float(strength_model),
                        repr(offset), id(function)))
    return tuple(out)


def lora_transform(patcher, block_prefixes: Sequence[str]) -> Callable:
    """A pack transform that merges the patcher's weight patches like core's full load does."""
    patches = patcher.patches
    device = patcher.load_device
    model = patcher.model
    merge_dtype = lora_merge_dtype(device)

    def transform(block_index: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = f"{block_prefixes[block_index]}.{name}"
        if key not in patches:
            return tensor
        _, set_func, convert_func = comfy.model_patcher.get_key_weight(model, key)
        if set_func is not None:
            raise ValueError(
                f"{key} is a quantized weight with a custom setter and a LoRA patch; layerwise "
                "offload cannot bake that patch faithfully. Keep this block resident or drop the LoRA.")
        work = comfy.model_management.cast_to_device(tensor, device, merge_dtype, copy=True)
        if convert_func is not None:
            work = convert_func(work, inplace=True)
        merged = comfy.lora.calculate_weight(patches[key], work, key)
        merged = comfy.float.stochastic_rounding(
            merged, tensor.dtype, seed=_string_to_seed(key))
        return merged.to(tensor.device)

    return transform


def hand_over_from_core(patcher, keys: Sequence[str], blocks: Sequence[torch.nn.Module]) -> None:
    """Make the streamed blocks pristine and unknown to core before the engine takes them.

    A clone sharing this nn.Module may have merged its LoRA into these weights; core keeps the
    originals in the shared `backup`. Restoring them here (and dropping the backup entries) means
    the engine packs the base weights and no later unpatch writes into a streamed block.
    Lowvram state left by core on these modules would re-apply LoRA at forward, so it is wiped.
    """
    model = patcher.model
    for key in keys:
        if key in patcher.pinned:
            patcher.unpin_weight(key)
        backup = patcher.backup.pop(key, None)
        if backup is not None:
            if backup.inplace_update:
                comfy.utils.copy_to_param(model, key, backup.weight)
            else:
                comfy.utils.set_attr_param(model, key, backup.weight)
    for block in blocks:
        # A run without the node (or a model built on the GPU) may have left blocks on the
        # device. The engine's master lives on the host, and detach hands tensors back where it
        # found them, so they go to core's offload device first.
        block.to(patcher.offload_device)
    _forget_core_marks(blocks, lowvram=True)


def _forget_core_marks(blocks: Sequence[torch.nn.Module], *, lowvram: bool) -> None:
    """Drop core's "patched" mark from every block module, and with ``lowvram`` all its
    partial-load state too (cast-at-forward marks and weight functions)."""
    for block in blocks:
        for module in block.modules():
            if lowvram:
                comfy.model_patcher.wipe_lowvram_weight(module)
            if hasattr(module, "comfy_patched_weights"):
                del module.comfy_patched_weights


def return_to_core(patcher, blocks: Sequence[torch.nn.Module]) -> None:
    """After a run: the blocks are back on the host with their pristine weights. Tell core so.

    Core's partial load may have marked the empty block modules cast-at-forward; left in place,
    that mark makes its next load skip them ("already lowvramed") and run them without its
    patches. And core must not take the model for fully loaded: "lowvram" makes its next load
    of it bring the blocks to the device and merge its patches into them.
    """
    _forget_core_marks(blocks, lowvram=True)
    patcher.model.model_lowvram = True


def settle_after_core_load(blocks: Sequence[torch.nn.Module]) -> None:
    """Undo what core's load() left on the engine's modules: its "patched" mark and any
    LowVramPatch.

    Core loaded the blocks while the engine held their tensors out of sight, so it marked them
    patched with nothing merged. Without the mark a partial unload never moves them, and core's
    next load of the model merges its patches into them again. The engine's weights already
    carry the LoRA merge; a LowVramPatch would apply it twice. Weight wrappers from
    `add_weight_wrapper` are kept: they are meant to run at forward time. `comfy_cast_weights`
    is left alone: the cast path is still right (and needed for fp8 storage) when the weight
    already sits on the compute device.
    """
    _forget_core_marks(blocks, lowvram=False)
    lowvram_patch = comfy.model_patcher.LowVramPatch
    for block in blocks:
        for module in block.modules():
            for attr in ("weight_function", "bias_function"):
                funcs = getattr(module, attr, None)
                if funcs:
                    setattr(module, attr, [f for f in funcs if not isinstance(f, lowvram_patch)])
