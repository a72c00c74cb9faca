"""Apply Layerwise Offload on a model that core runs with Dynamic VRAM (ComfyUI 0.15 and later):
what both modes share, and the `engine` mode.

Core streams such a model itself: every weight gets a slice of a per-model virtual address range
(the VBAR), and under VRAM pressure comfy-aimdo keeps the lowest addresses resident and gives up
the highest first. `auto` lets core stream and only orders that range (dynamic_cooperation.py).

`engine` runs the pack's own streamer, which needs a classic patcher: it hides the blocks from
core's load and hands them back after the run, and core's dynamic load would take hidden blocks
for tiny weights and drop their VBAR slices. It cannot run on the dynamic model's own nn.Module
either: that module carries core's per-weight Dynamic VRAM state (slices, residency signatures,
LoRA functions applied at cast time, backups shared with every clone), which a classic load next
to it would read as its own (a LoRA applied twice) or leave stale (an old VRAM copy taken for
current). So the engine gets a twin: a new BaseModel built by core's own constructor from the
model's config, over the dynamic model's host tensors (`load_state_dict(assign=True)`): no read
from disk, and the blocks' tensors are the dynamic model's own (the engine packs them once, as on
any model). The weights outside the blocks are copied: core's classic load may pin them in place,
which must never be done to a file mapping (core's Dynamic VRAM loader maps the model file). The
twin is made once per model and kept for every later clone of it (a LoRA change, other settings)
through core's `clone(model_override=...)`, and freed with the model.

Where the twin cannot be built (a model with no config, a state dict that does not round-trip),
the engine falls back to core's `clone(disable_dynamic=True)`: one reload from disk and a full copy
in RAM until the engine packs the blocks, said in the log and in the report.

Every check the engine makes runs on the model as given before any copy, so a model the node
refuses costs nothing.
"""
from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

import comfy.model_patcher

from ...offload_core.blocks.discovery import find_blocks
from ...offload_core.layerwise.streamer import LayerwiseStreamer
from ..core import state

log = logging.getLogger(__name__)

MODES = ("auto", "engine")
UNITS_ATTR = "get_dynamic_vram__units"
_MIB = 1 << 20
_GIB = 1 << 30


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
    dynamic model have the layout, dtypes and sizes of a classic one, so a model this refuses
    would be refused on a classic patcher too; this way the refusal costs nothing.
    """
    diffusion_model = patcher.get_model_object("diffusion_model")
    found = find_blocks(diffusion_model)
    planner = LayerwiseStreamer(list(found.blocks), "cpu", **streamer_kwargs)
    return BlockPlan(type(diffusion_model).__name__, found.layout, tuple(found.paths),
                     tuple(planner.resident_indices), tuple(planner.streamed_indices))


@dataclass
class _Delegate:
    """The classic patcher's model for one dynamic model, kept for every later clone of it."""

    override: tuple | None  # core's (model, backups) for clone(model_override=...)
    path: str  # "twin" or "classic copy"
    shared_bytes: int  # the dynamic model's host bytes the classic model uses as they are
    copied_bytes: int  # bytes copied for it (a twin's weights outside the blocks; a full reload)
    seconds: float
    reason: str | None = None  # why there is no twin
    uses: int = 0

    def report(self) -> dict[str, Any]:
        return {"path": self.path, "shared_bytes": self.shared_bytes,
                "copied_bytes": self.copied_bytes, "seconds": self.seconds, "uses": self.uses,
                "reason": self.reason, "cost": self.cost()}

    def cost(self) -> str:
        if self.path == "twin":
            return (f"engine on a Dynamic VRAM model: no reload; a classic twin over the model's "
                    f"own host weights ({binary_bytes(self.shared_bytes)} shared, "
                    f"{binary_bytes(self.copied_bytes)} outside the blocks copied), built in "
                    f"{self.seconds:.2f} s")
        return (f"engine on a Dynamic VRAM model: a second copy of the model in RAM "
                f"({binary_bytes(self.copied_bytes)}) until the engine packs its blocks, read "
                f"once from disk in {self.seconds:.1f} s ({self.reason}); mode auto lets core "
                "stream it without a copy")

    def close(self) -> None:
        self.override = None


class TwinUnavailable(Exception):
    """The dynamic model cannot be rebuilt over its own host tensors; the message says why."""


def _clone_accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.clone).parameters
    except (TypeError, ValueError):
        return False


def host_state(model) -> dict[str, torch.Tensor]:
    """The dynamic model's weights as they are in host memory: its state dict, with core's host
    originals in place of the weights its dynamic load put on the device outright (small weights,
    buffers), which it keeps in the patcher's backups."""
    state = model.model.state_dict()
    for key, backup in getattr(model, "backup", {}).items():
        if key in state:
            state[key] = backup.weight
    for key, buffer in getattr(model, "backup_buffers", {}).items():
        if key in state:
            state[key] = buffer
    off_host = [k for k, t in state.items() if t.device.type != "cpu"]
    if off_host:
        raise TwinUnavailable(f"{len(off_host)} weights are not in host memory (e.g. {off_host[0]})")
    return state


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without one storage
        return None


def build_twin(model) -> tuple[torch.nn.Module, int, int]:
    """A new BaseModel like the dynamic model's, over its host tensors: (twin, shared, copied).

    Built the way core's loader builds a model (`model_config.get_model`), then given the host
    tensors themselves (`assign=True`, strict: the same class and config give the same keys).
    Block tensors are shared, the rest copied (see the module docstring).
    """
    base = model.model
    config = getattr(base, "model_config", None)
    if not callable(getattr(config, "get_model", None)):
        raise TwinUnavailable("the model has no model_config to build it from")
    state = host_state(model)
    prefix = "diffusion_model."
    twin = config.get_model({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, "")
    if type(twin) is not type(base) or type(getattr(twin, "diffusion_model", None)) is not \
            type(base.diffusion_model):
        raise TwinUnavailable(f"its config builds a {type(twin).__name__}, not a {type(base).__name__}")
    try:
        twin.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise TwinUnavailable(f"its state dict does not load back: {str(e)[:200]}") from None
    twin.train(base.training)
    block_prefixes = tuple(f"{prefix}{p}." for p in find_blocks(twin.diffusion_model).paths)
    shared = copied = 0
    with torch.no_grad():
        for name, module in twin.named_modules():
            for table in (module._parameters, module._buffers):
                for attr, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    key = f"{name}.{attr}" if name else attr
                    if key.startswith(block_prefixes):
                        source = state.get(key)
                        same = source is not None and _storage_ptr(tensor) is not None and \
                            _storage_ptr(tensor) == _storage_ptr(source)
                        if same:
                            shared += tensor.nbytes
                        else:
                            copied += tensor.nbytes
                        continue
                    fresh = tensor.detach().clone()
                    table[attr] = torch.nn.Parameter(fresh, requires_grad=False) \
                        if isinstance(tensor, torch.nn.Parameter) else fresh
                    copied += fresh.nbytes
    return twin, shared, copied


def _twin_delegate(model) -> tuple[Any, _Delegate]:
    start = time.perf_counter()
    twin, shared, copied = build_twin(model)
    holder = comfy.model_patcher.ModelPatcher(twin, load_device=model.load_device,
                                              offload_device=model.offload_device,
                                              size=model.model_size())
    override = holder.get_clone_model_override()
    patcher = model.clone(disable_dynamic=True, model_override=override)
    return patcher, _Delegate(override, "twin", shared, copied, time.perf_counter() - start)


def _reload_delegate(model, reason: str) -> tuple[Any, _Delegate]:
    """The fallback: core rebuilds the model from its loader with Dynamic VRAM off."""
    start = time.perf_counter()
    try:
        patcher = model.clone(disable_dynamic=True)
    except RuntimeError as e:  # the loader registered no way to rebuild the model
        raise ValueError(f"Apply Layerwise Offload (engine): no classic copy of this Dynamic VRAM "
                         f"model can be made ({reason}; {e}); use mode auto, which needs none.") from e
    return patcher, _Delegate(patcher.get_clone_model_override(), "classic copy", 0,
                              model.model_size(), time.perf_counter() - start, reason)


def classic_delegate(model, streamer_kwargs: dict[str, Any]):
    """`engine` on a dynamic model: a classic patcher over a twin made once per model.

    Later clones of the same model (a LoRA change, other settings) get a patcher over the same
    twin through core's `clone(model_override=...)`, with their own patches.
    """
    plan_blocks(model, streamer_kwargs)
    if not (_clone_accepts(model, "disable_dynamic") and _clone_accepts(model, "model_override")):
        raise ValueError("Apply Layerwise Offload (engine): this ComfyUI runs the model with "
                         "Dynamic VRAM and offers no classic patcher for it; use mode auto.")
    entry = state.DYNAMIC_DELEGATES.get(model.model)
    if entry is not None and entry.override is not None:
        patcher = model.clone(disable_dynamic=True, model_override=entry.override)
    else:
        try:
            patcher, entry = _twin_delegate(model)
        except TwinUnavailable as e:
            log.warning("[tiered offload] Apply Layerwise Offload (engine): no twin of %s over its own weights: %s; "
                        "falling back to a reload from disk", type(model.model).__name__, e)
            patcher, entry = _reload_delegate(model, f"no twin: {e}")
        state.DYNAMIC_DELEGATES.get_or_create(model.model, lambda: entry, reuse=lambda _old: False)
    patcher.weight_inplace_update = False  # never write into host tensors the twin shares
    entry.uses += 1
    log.log(logging.INFO if entry.path == "twin" else logging.WARNING,
            "[tiered offload] Apply Layerwise Offload: cost of %s", entry.cost())
    return patcher


def describe(diffusion_module_id: int) -> dict[str, Any] | None:
    """The cost entry of the twin (or reloaded copy) whose diffusion model has this id, if any."""
    for entry in state.DYNAMIC_DELEGATES.values():
        override = entry.override
        if override is not None and id(override[0].diffusion_model) == diffusion_module_id:
            return entry.report()
    return None
