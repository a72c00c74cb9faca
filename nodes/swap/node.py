"""Model-Level Swap: the diffusion model and the text encoder take turns on the GPU.

Each model's base weights become one host master, pinned where the budget allows
(offload_core.swap.ModuleSwap), and the module's tensors live in it. Core still does every load
itself, so LoRA and other weight patches are merged exactly as core merges them; it just reads
the weights from pinned memory. Going out costs nothing: the guard on the root module's `.to()`
takes the device copies back by re-pointing the tensors at the master when core moves the model
to the host (`unpatch_model`), after core has put its base weights back.

Why the master is always the base weights: core merges a LoRA into new tensor objects and keeps
the base ones as its backup. The master is built only after core has unloaded the model (which
restores those backups), and parking never touches a slot that holds a merged weight, so a LoRA
can neither be lost (parked over) nor leak into the master and from there into later prompts.

Turns: a PREPARE_SAMPLING wrapper unloads the text encoder through core before the diffusion
model is loaded; an injection on the encoder's patcher (core injects on every load for encoding,
also for a clone of an already loaded encoder, where ON_LOAD does not fire) unloads the diffusion
model through core. Unloading through core (`LoadedModel.model_unload`) keeps
`current_loaded_models` and core's free-memory figures true.

One host copy: where the model runs on the CPU, a master is kept in the machine's shared store of
its file's bytes where sharing is on (core/host_sharing.py), so every ComfyUI process that swaps
the same model maps one copy. The model's tensors then show a copy-on-write mapping of the store,
so a write in place (a hook LoRA) stays this process's own. On a GPU the master stays this
process's own and page-locked: core copies the module's own tensors, and copy-on-write pages cannot
be page-locked without copying them. A
diffusion model whose blocks already live in Apply Layerwise Offload's kept pack (an earlier
workflow streamed it) leaves them there: its master holds the rest, and the pack, which takes the
blocks back when core moves the model out, stays valid.

Not given a master: a model with Apply Layerwise Offload before this node (the engine already
keeps its blocks in pinned RAM; the other order is refused by that node, since the blocks would be
held twice); a model that newer ComfyUI runs with Dynamic VRAM (core keeps it in host memory
itself and never calls the module's `.to()`); a patcher that merges weights in place
(`weight_inplace_update`), which would write merged values into the master. Those still take
turns through core.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

import comfy.patcher_extension
from comfy_api.v0_0_2 import io

from ...offload_core.models.swap import ModuleSwap
from ..core import host_moves, host_sharing, prompt_lifecycle
from ..core.read_back import read_back_for
from ..core.models import is_dynamic, loaded_entries, unified_memory, unload_from_core
from ..core.state import LAYERWISE, LAYERWISE_KEY, SWAP_KEY, SWAP_MEMBERS

log = logging.getLogger(__name__)


def _patched_keys(patcher) -> list[str]:
    """Keys whose base weight core holds in its backup because a merged weight sits in the module."""
    return list(getattr(patcher, "backup", {}) or {})


class SwapMember:
    """One model's base-weight master and the guard on its root module's `.to()`."""

    def __init__(self, patcher, name: str, kind: str, share_host_memory: bool = True) -> None:
        module = patcher.model
        # Core restores every base weight from its backup when it unloads the model: only then
        # does the module hold what the master must hold. Blocks an earlier Apply Layerwise
        # Offload run streamed from the model's file hold no bytes until they are read back.
        unload_from_core(module)
        read_back_for([patcher])
        if _patched_keys(patcher):
            raise RuntimeError(
                f"Model-Level Swap: {name} still holds merged weights after ComfyUI unloaded it "
                f"({len(_patched_keys(patcher))} keys); refusing to take it as a master")
        self.name = name
        self.kind = kind  # "diffusion model" or "text encoder": the words the panel's cards use
        self.share, self.share_why = host_sharing.share_for(module, share_host_memory)
        if self.share is not None and patcher.load_device.type != "cpu":
            # Core copies the module's own tensors to the device. From a shared store they could only
            # show a copy-on-write mapping (a write in place must never reach the store), which is
            # not page-locked: every turn would be a slower, pageable copy.
            self.share, self.share_why = None, (
                "a master on a GPU stays page-locked and this process's own: core copies the model's own "
                "tensors, and a shared store could hand them over only unpinned")
        host_sharing.check_unchanged(self.share, "Model-Level Swap")
        self.swap = ModuleSwap(module, share=self.share, skip=_kept_pack_test(module))
        # Core copies from the master on the model's load device (ComfyUI's partial load does it
        # asynchronously, per layer): the master waits for that device before it goes.
        self.swap.note_reader(patcher.load_device)
        self.closed = False
        self.turns = 0
        self.turn_prompt: str | None = None  # the prompt of the last turn
        self.parks = 0
        self.tensors_taken_back = 0
        # Only a weak reference: the module must still be freed (and this member closed) when
        # ComfyUI drops the model. The guard on its `.to()` holds this member weakly.
        self._module_ref = weakref.ref(module)
        host_moves.watch(module, SWAP_KEY, self._park_before_host_move)

    def _park_before_host_move(self, module: torch.nn.Module) -> None:
        if not layerwise_active(module):
            self.park()

    def park(self) -> None:
        if self.closed:
            return
        taken = self.swap.park()
        if taken:
            self.parks += 1
            self.tensors_taken_back += taken
            log.info("[tiered offload] Model-Level Swap: %s parked, %d tensors re-pointed at its master, no "
                     "device-to-host copy", self.name, taken)

    def close(self) -> None:
        """Hand the original tensors back. Core unloads the model first, so the module holds its
        base weights, which is what the master hands back."""
        if self.closed:
            return
        module = self._module_ref()
        if module is not None:
            unload_from_core(module)
            host_moves.unwatch(module, SWAP_KEY)
            self.swap.park()
        self.closed = True
        self.swap.close()

    def report(self) -> dict[str, Any]:
        module = self._module_ref()
        on_device = module is not None and bool(loaded_entries(module))
        store = self.swap.host_store() if self.share is not None else {"shared": False, "why": self.share_why}
        # Core caches the model with its master: a later prompt without this node runs it from the
        # master too, and the master's RAM stays until the model is unloaded. The card says so.
        earlier = self.turn_prompt is not None and self.turn_prompt != prompt_lifecycle.current_prompt_id()
        return {"name": self.name, "kind": self.kind, "loaded_by_core": on_device, "turns": self.turns,
                "held_from_earlier_prompt": earlier,
                "parks": self.parks, "tensors_taken_back": self.tensors_taken_back,
                "in_layerwise_pack": self.swap.skipped, "host_store": store,
                "bytes": {"master": self.swap.nbytes, **self.swap.bytes_by_tier()}}


def _kept_pack_test(module: torch.nn.Module):
    """Whether a tensor of ``module`` lives in Apply Layerwise Offload's kept pack of its blocks
    (None without one): the master leaves those where they are instead of holding them twice."""
    diffusion_model = getattr(module, "diffusion_model", None)
    session = LAYERWISE.sessions.get(diffusion_model) if diffusion_model is not None else None
    return session.streamer.shows_kept_pack if session is not None else None


def _member(patcher, kind: str, share_host_memory: bool) -> SwapMember:
    module = patcher.model
    return SWAP_MEMBERS.get_or_create(
        module, lambda: SwapMember(patcher, type(module).__name__, kind, share_host_memory))


def layerwise_active(module: torch.nn.Module) -> bool:
    """Apply Layerwise Offload owns the blocks during sampling; they are not the master's then."""
    diffusion_model = getattr(module, "diffusion_model", None)
    return diffusion_model is not None and LAYERWISE.is_active(diffusion_model)


class _Turns:
    """The two models that take turns. Weak references only: the encoder's patcher must not keep
    the diffusion model alive (or the other way round) after ComfyUI dropped it."""

    def __init__(self, dit_module: torch.nn.Module, te_module: torch.nn.Module) -> None:
        self._dit = weakref.ref(dit_module)
        self._te = weakref.ref(te_module)

    def sampling(self) -> None:
        self._take_turn(self._dit(), self._te())

    def encoding(self) -> None:
        self._take_turn(self._te(), self._dit())

    @staticmethod
    def _take_turn(incoming: torch.nn.Module | None, outgoing: torch.nn.Module | None) -> None:
        """Unload the outgoing model through core (copy-free where it has a master); core then
        loads the incoming one, from its master where it has one."""
        member = SWAP_MEMBERS.get(incoming) if incoming is not None else None
        if member is not None:  # a shared master of a file that changed is refused before anything moves
            host_sharing.check_unchanged(member.share, "Model-Level Swap")
        if outgoing is not None:
            unload_from_core(outgoing)
        if member is not None:
            member.turns += 1
            member.turn_prompt = prompt_lifecycle.current_prompt_id()


def _master_refusal(patcher) -> str | None:
    """Why this patcher gets no master, or None."""
    if is_dynamic(patcher):
        return "runs with Dynamic VRAM; core keeps it in host memory itself"
    if getattr(patcher, "weight_inplace_update", False):
        return "merges weight patches in place, which would write into the master"
    return None


class ModelLevelSwap(io.ComfyNode):
    """The diffusion model and the text encoder take turns on the GPU, from pinned masters."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ModelLevelSwap",
            display_name="Model-Level Swap",
            category="tiered_offload",
            description=("Keeps the diffusion model and the text encoder as pinned host masters and "
                         "lets them take turns on the GPU: loads read pinned memory, nothing is "
                         "copied back when a model goes out."),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model; it is parked while text is encoded."),
                io.Clip.Input("clip", tooltip="The text encoder(s); parked while sampling."),
                io.Boolean.Input(
                    "share_host_memory", default=True, optional=True,
                    tooltip="Share each master with every other ComfyUI process on this machine "
                            "that loads the same model file (workers of a multi-GPU setup): one "
                            "copy in shared memory instead of one per process, where the model runs "
                            "on the CPU (on a GPU each process keeps a page-locked master of its own, "
                            "for fast turns). Off: this process keeps its own."),
            ],
            outputs=[io.Model.Output(), io.Clip.Output()],
        )

    @classmethod
    def execute(cls, model, clip, share_host_memory: bool = True) -> io.NodeOutput:
        if unified_memory(model) and unified_memory(clip.patcher):
            log.info("[tiered offload] Model-Level Swap: the models run on %s, whose GPU shares the RAM: no turns to "
                     "take, both pass through unchanged", model.load_device)
            return io.NodeOutput(model, clip)
        model = model.clone()
        clip = clip.clone()
        # A layerwise-offloaded model already keeps its blocks in pinned RAM; a second, whole-
        # model master would hold them twice. Then only the encoder gets a master, and the
        # model's small non-block rest stays with core.
        streamed = bool(model.get_wrappers(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                                           LAYERWISE_KEY))
        for name, patcher, wanted in (("diffusion model", model, not streamed),
                                      ("text encoder", clip.patcher, True)):
            why = _master_refusal(patcher)
            if why is not None:
                log.info("[tiered offload] Model-Level Swap: the %s gets no pinned master: it %s", name, why)
            elif wanted:
                _member(patcher, name, share_host_memory)
        turns = _Turns(model.model, clip.patcher.model)

        def prepare_sampling(executor, patcher, *args, **kwargs):
            turns.sampling()
            return executor(patcher, *args, **kwargs)

        def on_encoder_load(patcher):
            turns.encoding()

        model.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, SWAP_KEY)
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, SWAP_KEY,
                                   prepare_sampling)
        clip.patcher.set_injections(SWAP_KEY, [comfy.patcher_extension.PatcherInjection(
            inject=on_encoder_load, eject=lambda patcher: None)])
        return io.NodeOutput(model, clip)
