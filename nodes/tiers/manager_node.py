"""The VRAM Tier Manager node: the tier manager's budgets and a model's policy, set in a workflow."""
from __future__ import annotations

from comfy_api.v0_0_2 import io

from ...offload_core.models.tier_budgets import DEFAULT_RAM_RESERVE_BYTES, DEFAULT_VRAM_RESERVE_BYTES
from ..core import budgets, state
from .managed_models import key_of


class VRAMTierManager(io.ComfyNode):
    """Set the tier manager's budgets and a model's policy from inside a workflow."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VRAMTierManager",
            display_name="VRAM Tier Manager",
            category="tiered_offload",
            description=("Budgets and per-model policy of the tier manager. Connect models loaded "
                         "by the Tiered loaders; they pass through unchanged."),
            inputs=[
                io.Float.Input(
                    "ram_budget_gb", default=0.0, min=0.0, max=4096.0, step=0.5,
                    tooltip="Cap in GiB on RAM held by parked models; 0 means only the reserve "
                            "below limits it. Over budget, the least recently used idle model "
                            "drops to disk."),
                io.Float.Input(
                    "ram_reserve_gb", default=DEFAULT_RAM_RESERVE_BYTES / budgets.GIB, min=0.0,
                    max=1024.0, step=0.5,
                    tooltip="GiB of RAM always left free for ComfyUI and the system (the "
                            "manager's default without this node too)."),
                io.Float.Input(
                    "vram_reserve_gb", default=DEFAULT_VRAM_RESERVE_BYTES / budgets.GIB, min=0.0,
                    max=1024.0, step=0.25,
                    tooltip="GiB of VRAM kept free when the manager loads models itself."),
                io.Boolean.Input(
                    "disk_tier", default=True,
                    tooltip="Allow dropping idle models to disk when RAM is over budget."),
                io.Boolean.Input(
                    "keep_in_ram", default=False,
                    tooltip="Never drop the connected models to disk."),
                io.Int.Input(
                    "priority", default=0, min=-100, max=100,
                    tooltip="Higher priority models are evicted later."),
                io.Model.Input("model", optional=True, tooltip="Passed through; its policy is set."),
                io.Clip.Input("clip", optional=True, tooltip="Passed through; its policy is set."),
                io.Vae.Input("vae", optional=True, tooltip="Passed through; its policy is set."),
            ],
            outputs=[io.Model.Output(), io.Clip.Output(), io.Vae.Output()],
        )

    @classmethod
    def validate_inputs(cls, ram_reserve_gb: float | None = None) -> bool | str:
        """Refuse at queue time, before anything loads, a RAM reserve no setting means: more than
        this machine's RAM, NaN (which ComfyUI's range check lets through), under one byte. Only
        this input is named: ComfyUI repeats a refusal once per input the method names, and
        checks the others' ranges itself (the VRAM reserve against the GPU is checked at run). A
        value through a link is None here and is checked at run."""
        if ram_reserve_gb is None:
            return True
        try:
            budgets.budget_kwargs({"ram_reserve_gb": ram_reserve_gb})
        except ValueError as e:
            return f"VRAM Tier Manager: {e}"
        return True

    @classmethod
    def execute(cls, ram_budget_gb, ram_reserve_gb, vram_reserve_gb, disk_tier, keep_in_ram,
                priority, model=None, clip=None, vae=None) -> io.NodeOutput:
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
        return io.NodeOutput(model, clip, vae)
