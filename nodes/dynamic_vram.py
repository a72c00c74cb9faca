"""Apply Layerwise Offload on a model that core runs with Dynamic VRAM (ComfyUI 0.15 and later).

Core streams such a model itself: every weight gets a slice of a per-model virtual address range
(the VBAR), and under VRAM pressure comfy-aimdo keeps the lowest addresses resident and gives up
the highest first. `ModelPatcherDynamic.load` hands out those addresses in the order of
`get_dynamic_vram__units()` on the model if it has one: the first list's modules first, then
everything else (small weights, then the largest first), then the second list's modules.

So the node has two ways to serve such a model:
- `auto` sets that function as an object patch on a clone: the blocks the engine would keep
  resident (spread evenly, within the budget) come first, the blocks it would stream come last.
  Core keeps the node's choice resident and streams the rest; nothing is copied or reloaded.
- `engine` runs the pack's own streamer on a classic copy of the model (core's
  `clone(disable_dynamic=True)`, which reloads the file). That is a second copy in RAM and one
  read from disk, so it is said in the log and in the report. The copy is made once per
  underlying model and kept for later clones of it (a LoRA change, other settings), and freed
  with the model. The engine cannot take the blocks of the dynamic model itself: core's load
  would drop their VBAR slices every time the engine hid the blocks (see the README).

Every check the engine makes runs on the model as given before any copy, so a model the node
refuses costs nothing.
"""
from __future__ import annotations

import inspect
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..offload_core.discovery import find_blocks
from ..offload_core.per_module import PerModule
from ..offload_core.streamer import LayerwiseStreamer

log = logging.getLogger(__name__)

MODES = ("auto", "engine")
UNITS_ATTR = "get_dynamic_vram__units"
_MIB = 1 << 20
_GIB = 1 << 30


def is_dynamic(patcher) -> bool:
    """Whether core runs this patcher with Dynamic VRAM (`is_dynamic()` exists from 0.15 on)."""
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"Apply Layerwise Offload: mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def binary_bytes(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / _MIB:.1f} MiB"


@dataclass(frozen=True)
class BlockPlan:
    """What the engine would do with a model's blocks, decided without touching their bytes."""

    model_class: str
    layout: str
    paths: tuple[str, ...]
    resident: tuple[int, ...]
    streamed: tuple[int, ...]


def plan_blocks(patcher, streamer_kwargs: dict[str, Any]) -> BlockPlan:
    """Run the engine's checks (block discovery, packability, settings) on the model as given.

    The planner reads tensor metadata only: no copy, no allocation, no device. The blocks of a
    dynamic model have the layout, dtypes and sizes of its classic copy, so a model this refuses
    would be refused after a reload too; this way the refusal costs nothing.
    """
    diffusion_model = patcher.get_model_object("diffusion_model")
    found = find_blocks(diffusion_model)
    planner = LayerwiseStreamer(list(found.blocks), "cpu", **streamer_kwargs)
    return BlockPlan(type(diffusion_model).__name__, found.layout, tuple(found.paths),
                     tuple(planner.resident_indices), tuple(planner.streamed_indices))


class ResidencyOrder:
    """`get_dynamic_vram__units` for one model: the node's resident blocks first, its streamed
    blocks last.

    Set as an object patch, so core applies it on its own load and restores the model after.
    It holds the diffusion model weakly: the patch must not keep a dropped model alive.
    """

    def __init__(self, diffusion_model: torch.nn.Module, plan: BlockPlan) -> None:
        self._model = weakref.ref(diffusion_model)
        self.plan = plan

    def __call__(self) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
        model = self._model()
        if model is None:
            return [], []
        blocks = [model.get_submodule(path) for path in self.plan.paths]
        return [blocks[i] for i in self.plan.resident], [blocks[i] for i in self.plan.streamed]


def cooperate(model, streamer_kwargs: dict[str, Any]):
    """`auto` on a dynamic model: core streams, in the order of the node's residency plan."""
    plan = plan_blocks(model, streamer_kwargs)
    patcher = model.clone()
    # The class's own method; an instance attribute may be another clone's patch still applied.
    if getattr(type(model.model), UNITS_ATTR, None) is not None:
        log.info("Apply Layerwise Offload (auto): %s defines its own Dynamic VRAM units; core "
                 "streams it in its own order, the node changes nothing", plan.model_class)
        return patcher
    diffusion_model = patcher.get_model_object("diffusion_model")
    patcher.add_object_patch(UNITS_ATTR, ResidencyOrder(diffusion_model, plan))
    log.info("Apply Layerwise Offload (auto): %s runs with Dynamic VRAM, so core streams it; its "
             "VRAM goes first to the %d resident blocks %s and last to the %d streamed ones "
             "(no copy, no reload)", plan.model_class, len(plan.resident), list(plan.resident),
             len(plan.streamed))
    return patcher


@dataclass
class _Delegate:
    """A classic copy of one dynamic model, kept for every later clone of that model."""

    override: tuple | None  # core's (model, backups) for clone(model_override=...)
    model_bytes: int
    load_seconds: float
    uses: int = 0

    def report(self) -> dict[str, Any]:
        return {"path": "classic copy", "extra_ram_bytes": self.model_bytes,
                "reload_seconds": self.load_seconds, "uses": self.uses, "cost": self.cost()}

    def cost(self) -> str:
        return (f"engine on a Dynamic VRAM model: a second copy of the model in RAM "
                f"({binary_bytes(self.model_bytes)}), read once from disk in "
                f"{self.load_seconds:.1f} s; mode auto lets core stream it without a copy")

    def close(self) -> None:
        self.override = None


DELEGATES: PerModule[_Delegate] = PerModule()


def _clone_accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.clone).parameters
    except (TypeError, ValueError):
        return False


def _first_copy(model):
    """The one reload from disk: core rebuilds the model from its loader with Dynamic VRAM off."""
    if not _clone_accepts(model, "disable_dynamic"):
        raise ValueError("Apply Layerwise Offload (engine): this ComfyUI runs the model with "
                         "Dynamic VRAM and offers no classic copy of it; use mode auto.")
    try:
        return model.clone(disable_dynamic=True)
    except RuntimeError as e:  # the loader registered no way to rebuild the model
        raise ValueError(f"Apply Layerwise Offload (engine): no classic copy of this Dynamic VRAM "
                         f"model can be made ({e}); use mode auto, which needs none.") from e


def classic_copy(model, streamer_kwargs: dict[str, Any]):
    """`engine` on a dynamic model: a classic patcher over a copy made once per model.

    Later clones of the same model (a LoRA change, other settings) get a patcher over the same
    copy through core's `clone(model_override=...)`, with their own patches.
    """
    plan_blocks(model, streamer_kwargs)
    reusable = _clone_accepts(model, "model_override")
    entry = DELEGATES.get(model.model) if reusable else None
    if entry is not None and entry.override is not None:
        patcher = model.clone(disable_dynamic=True, model_override=entry.override)
    else:
        start = time.perf_counter()
        patcher = _first_copy(model)
        entry = _Delegate(patcher.get_clone_model_override(), model.model_size(),
                          time.perf_counter() - start)
        if reusable:
            DELEGATES.get_or_create(model.model, lambda: entry, reuse=lambda _old: False)
    entry.uses += 1
    log.warning("Apply Layerwise Offload: cost of %s", entry.cost())
    return patcher


def describe(diffusion_module_id: int) -> dict[str, Any] | None:
    """The cost entry of the classic copy whose diffusion model has this id, if it is one."""
    for entry in DELEGATES.values():
        override = entry.override
        if override is not None and id(override[0].diffusion_model) == diffusion_module_id:
            return entry.report()
    return None
