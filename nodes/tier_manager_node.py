"""The VRAM Tier Manager node: the tier manager's budgets and a model's policy, set in a workflow."""
from __future__ import annotations

from ..offload_core.models.tier_budgets import DEFAULT_RAM_RESERVE_BYTES, DEFAULT_VRAM_RESERVE_BYTES
from . import budgets, state
from .managed_models import key_of


class VRAMTierManager:
    """Set the tier manager's budgets and a model's policy from inside a workflow."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "ram_budget_gb": ("FLOAT", {
                    "default": 0.0, "min": 0.0, "max": 4096.0, "step": 0.5,
                    "tooltip": "Cap in GiB on RAM held by parked models; 0 means only the "
                               "reserve below limits it. Over budget, the least recently used "
                               "idle model drops to disk."}),
                "ram_reserve_gb": ("FLOAT", {
                    "default": DEFAULT_RAM_RESERVE_BYTES / budgets.GIB, "min": 0.0, "max": 1024.0,
                    "step": 0.5,
                    "tooltip": "GiB of RAM always left free for ComfyUI and the system (the "
                               "manager's default without this node too)."}),
                "vram_reserve_gb": ("FLOAT", {
                    "default": DEFAULT_VRAM_RESERVE_BYTES / budgets.GIB, "min": 0.0, "max": 1024.0,
                    "step": 0.25,
                    "tooltip": "GiB of VRAM kept free when the manager loads models itself."}),
                "disk_tier": ("BOOLEAN", {
                    "default": True,
                    "tooltip": "Allow dropping idle models to disk when RAM is over budget."}),
                "keep_in_ram": ("BOOLEAN", {
                    "default": False,
                    "tooltip": "Never drop the connected models to disk."}),
                "priority": ("INT", {
                    "default": 0, "min": -100, "max": 100,
                    "tooltip": "Higher priority models are evicted later."}),
            },
            "optional": {
                "model": ("MODEL", {"tooltip": "Passed through; its policy is set."}),
                "clip": ("CLIP", {"tooltip": "Passed through; its policy is set."}),
                "vae": ("VAE", {"tooltip": "Passed through; its policy is set."}),
            },
        }

    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    FUNCTION = "apply"
    CATEGORY = "tiered_offload"
    DESCRIPTION = ("Budgets and per-model policy of the tier manager. Connect models loaded by "
                   "the Tiered loaders; they pass through unchanged.")

    def apply(self, ram_budget_gb, ram_reserve_gb, vram_reserve_gb, disk_tier, keep_in_ram,
              priority, model=None, clip=None, vae=None):
        try:
            budgets.whole_number("priority", priority, -100, 100)
            if not isinstance(keep_in_ram, bool):
                raise ValueError("keep_in_ram must be true or false")
            state.MANAGER.set_budgets(**budgets.budget_kwargs({
                "ram_budget_gb": ram_budget_gb, "ram_reserve_gb": ram_reserve_gb,
                "vram_reserve_gb": vram_reserve_gb, "disk_tier": disk_tier}))
        except ValueError as e:
            raise ValueError(f"VRAM Tier Manager: {e}") from None
        for obj in (model, clip, vae):
            if obj is None:
                continue
            key = key_of(obj)
            if key is None:
                raise ValueError(
                    f"VRAM Tier Manager: the connected {type(obj).__name__} was not loaded by a "
                    "Tiered loader, so the manager does not track it. Use Tiered UNET / "
                    "Checkpoint / CLIP / VAE Loader.")
            (state.MANAGER.pin if keep_in_ram else state.MANAGER.unpin)(key)
            state.MANAGER.set_priority(key, priority)
        return (model, clip, vae)
