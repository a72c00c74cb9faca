"""Core's models as core sees them: its list of loaded models, changed the way core itself does
it, and whether it runs a model with Dynamic VRAM.

Everything that moves a model out of VRAM goes through `LoadedModel.model_unload` and leaves
`current_loaded_models`, so core's free-memory planning always matches what is really loaded.
"""
from __future__ import annotations

import torch

import comfy.model_management


def loaded_entries(module: torch.nn.Module) -> list:
    """Core's LoadedModel entries whose patcher (or a clone of it) holds this module."""
    return [lm for lm in comfy.model_management.current_loaded_models
            if lm.model is not None and lm.model.model is module]


def unload_from_core(module: torch.nn.Module) -> None:
    """Unload every LoadedModel holding this module and drop it from core's list."""
    for lm in loaded_entries(module):
        lm.model_unload()
        if lm in comfy.model_management.current_loaded_models:
            comfy.model_management.current_loaded_models.remove(lm)


def dynamic_vram_on() -> bool:
    """Whether this ComfyUI runs models with Dynamic VRAM at all (0.15 and later on NVIDIA:
    `comfy.memory_management.aimdo_enabled`); False on a tree without it."""
    try:
        import comfy.memory_management
    except ImportError:
        return False
    return bool(getattr(comfy.memory_management, "aimdo_enabled", False))


def is_dynamic(patcher) -> bool:
    """Whether core runs this patcher with Dynamic VRAM (`is_dynamic()` exists from 0.15 on)."""
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def unified_memory(patcher) -> bool:
    """Whether core runs this model on a GPU that shares the host's RAM (Apple silicon's MPS):
    there is no second memory to offload to, so the pack's nodes pass such a model through."""
    device = getattr(patcher, "load_device", None)
    return isinstance(device, torch.device) and device.type == "mps"
