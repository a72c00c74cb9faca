"""Model-Level Swap: the diffusion model and the text encoder take turns on the GPU.

Each model's weights become one pinned host master (offload_core.swap.ModuleSwap). Moving a
model in is a few large copies from that master; moving it out re-points its tensors at the
master and drops the GPU copy, so no byte goes back over the link.

How core is kept from fighting it (classic ModelPatcher):
- The root module's `.to()` is guarded: when core unloads the model (`.to(offload device)` in
  `unpatch_model`), the guard parks from the master instead of copying device to host; when core
  moves the whole model to the GPU, the guard loads it with the master's large copies.
- Parking a partner also unloads it through core (`LoadedModel.model_unload`), so
  `current_loaded_models` and core's free-memory figures stay true.
- The diffusion model is brought in by a PREPARE_SAMPLING wrapper before core's
  `load_models_gpu`, which then finds the weights in place. The text encoder's partner is parked
  from an injection on the encoder's patcher: core injects on every load for encoding, also for
  a clone of an already loaded encoder, where ON_LOAD does not fire.
- With Apply Layerwise Offload before it, the engine already keeps the blocks in pinned RAM, so
  only the text encoder gets a master; the model's small non-block rest is left to core. Used the
  other way round (swap first), Apply Layerwise Offload refuses with a message, because the blocks
  would be held in RAM twice.
- A model that newer ComfyUI runs with Dynamic VRAM (`patcher.is_dynamic()`, 0.33 and later) gets
  no master: core already keeps its weights in host memory (file mmap and its own pins), loads
  them per layer and never copies them back, and it never calls the module's `.to()` that the
  guard relies on. A master would re-point tensors core manages. Such a model is only unloaded
  through core when its partner takes its turn.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

import comfy.patcher_extension

from ..offload_core.swap import ModuleSwap
from .core_models import unload_from_core
from .layerwise import REGISTRY as LAYERWISE
from .layerwise import WRAPPER_KEY as LAYERWISE_KEY
from .layerwise import _is_dynamic
from ..offload_core.per_module import PerModule

log = logging.getLogger(__name__)

KEY = "tiered_offload.swap"


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    try:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError, AttributeError):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
    return None if device is None else torch.device(device)


class SwapMember:
    """One model's pinned master and the guard on its root module's `.to()`."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.name = name
        self.swap = ModuleSwap(module)
        self.closed = False
        self.turns = 0
        self.loads = 0
        self.parks = 0
        self.bytes_loaded = 0
        # Only weak references: the guard lives in the module's own __dict__, and the module
        # must still be freed (and this member closed) when ComfyUI drops the model.
        member_ref = weakref.ref(self)
        module_ref = weakref.ref(module)

        def guarded_to(*args: Any, **kwargs: Any):
            target, member = module_ref(), member_ref()
            device = _target_device(args, kwargs)
            if member is not None and device is not None and not layerwise_active(target):
                if device.type == "cpu":
                    member.park()
                else:
                    member.load(device)
            # Packed tensors are in place now, so this moves only what the master does not hold.
            return type(target).to(target, *args, **kwargs)

        module.to = guarded_to
        self._module_ref = module_ref

    def load(self, device: torch.device) -> None:
        if self.closed or self.swap.device == device:
            return
        self.swap.load(device)
        self.loads += 1
        self.bytes_loaded += self.swap.bytes_by_tier()["vram"]
        log.info("Model-Level Swap: %s in on %s from its pinned master", self.name, device)

    def park(self) -> None:
        if self.closed or not self.swap.park():
            return
        self.parks += 1
        log.info("Model-Level Swap: %s parked, no device-to-host copy", self.name)

    def close(self) -> None:
        module = self._module_ref()
        if module is not None:
            module.__dict__.pop("to", None)
        self.closed = True
        self.swap.close()

    def report(self) -> dict[str, Any]:
        return {"name": self.name, "device": None if self.swap.device is None else str(self.swap.device),
                "turns": self.turns, "loads": self.loads, "parks": self.parks, "bytes_loaded": self.bytes_loaded,
                "bytes": self.swap.bytes_by_tier()}


MEMBERS: PerModule[SwapMember] = PerModule()


def _member(module: torch.nn.Module) -> SwapMember:
    return MEMBERS.get_or_create(module, lambda: SwapMember(module, type(module).__name__))


def layerwise_active(module: torch.nn.Module) -> bool:
    """Apply Layerwise Offload owns the blocks during sampling; loading them whole would undo it."""
    diffusion_model = getattr(module, "diffusion_model", None)
    return diffusion_model is not None and LAYERWISE.is_active(diffusion_model)


class _Turns:
    """The two models that take turns. Weak references only: the encoder's patcher must not keep
    the diffusion model alive (or the other way round) after ComfyUI dropped it."""

    def __init__(self, dit_module: torch.nn.Module, te_module: torch.nn.Module) -> None:
        self._dit = weakref.ref(dit_module)
        self._te = weakref.ref(te_module)

    def sampling(self, device: torch.device) -> None:
        self._take_turn(self._dit(), self._te(), device)

    def encoding(self) -> None:
        self._take_turn(self._te(), self._dit(), None)

    @staticmethod
    def _take_turn(incoming: torch.nn.Module | None, outgoing: torch.nn.Module | None,
                   device: torch.device | None) -> None:
        """Unload the outgoing model through core (copy-free if it has a master), bring the other in."""
        if outgoing is not None:
            unload_from_core(outgoing)
            member = MEMBERS.get(outgoing)
            if member is not None:
                member.park()
        member = MEMBERS.get(incoming) if incoming is not None else None
        if member is not None:
            member.turns += 1
            if device is not None and not layerwise_active(incoming):
                member.load(device)


class ModelLevelSwap:
    """The diffusion model and the text encoder take turns on the GPU, from pinned masters."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model; it is parked while text is encoded."}),
            "clip": ("CLIP", {"tooltip": "The text encoder(s); parked while sampling."}),
        }}

    RETURN_TYPES = ("MODEL", "CLIP")
    FUNCTION = "apply"
    CATEGORY = "tiered_offload"
    DESCRIPTION = ("Keeps the diffusion model and the text encoder as pinned host masters and "
                   "lets them take turns on the GPU: full-speed copies in, nothing copied back.")

    def apply(self, model, clip):
        model = model.clone()
        clip = clip.clone()
        dit_module, te_module = model.model, clip.patcher.model
        # A layerwise-offloaded model already keeps its blocks in pinned RAM; a second, whole-
        # model master would hold them twice. Then only the encoder gets a master, and the
        # model's small non-block rest stays with core.
        streamed = bool(model.get_wrappers(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                                           LAYERWISE_KEY))
        if not streamed and not _is_dynamic(model):
            _member(dit_module)
        if not _is_dynamic(clip.patcher):
            _member(te_module)
        for name, patcher in (("diffusion model", model), ("text encoder", clip.patcher)):
            if _is_dynamic(patcher):
                log.info("Model-Level Swap: the %s runs with Dynamic VRAM; core keeps it in host "
                         "memory itself, so it gets no pinned master", name)
        turns = _Turns(dit_module, te_module)

        def prepare_sampling(executor, patcher, *args, **kwargs):
            turns.sampling(patcher.load_device)
            return executor(patcher, *args, **kwargs)

        def on_encoder_load(patcher):
            turns.encoding()

        model.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, KEY)
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, KEY,
                                   prepare_sampling)
        clip.patcher.set_injections(KEY, [comfy.patcher_extension.PatcherInjection(
            inject=on_encoder_load, eject=lambda patcher: None)])
        return (model, clip)
