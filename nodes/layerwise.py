"""Apply Layerwise Offload: stream a DiT's blocks from pinned RAM during sampling.

How it cooperates with core's ModelPatcher (classic, as in 0.3.75):
- An OUTER_SAMPLE wrapper hands the blocks to the engine *before* core's `load_models_gpu`
  runs. The engine releases the streamed tensors, so core sees those modules as empty: it never
  loads them first and its loaded-bytes figure covers only what it really placed.
- A PREPARE_SAMPLING wrapper adds the engine's device bytes (resident blocks and slots) to the
  model's loaded-weight figure, so core plans the VAE and text encoders with true numbers.
- LoRA and other weight patches are baked into the packed master with core's own math; a block
  is re-packed only when the patches touching it change.
- After sampling (also on error or interrupt) the engine puts every tensor back, so a later
  prompt without this node runs the model exactly as core would. The pinned pack is kept for
  the next run and freed when the model is freed.
- The engine hooks the block modules themselves, so dit block-replace patches of other nodes
  (TeaCache and the like) keep working and chain naturally: they call the original block.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.utils

from ..offload_core.discovery import find_blocks
from ..offload_core.streamer import LayerwiseStreamer
from . import comfy_weights, dynamic_vram
from ..offload_core.per_module import PerModule

log = logging.getLogger(__name__)

WRAPPER_KEY = "tiered_offload.layerwise"
GIB = 1024 ** 3


@dataclass(frozen=True)
class LayerwiseSettings:
    resident_blocks: int
    vram_budget_gb: float
    prefetch: int
    pin: bool

    def streamer_kwargs(self) -> dict[str, Any]:
        if self.resident_blocks >= 0:
            return {"resident": self.resident_blocks, "prefetch": self.prefetch, "pin": self.pin}
        return {"vram_budget_bytes": int(self.vram_budget_gb * GIB), "prefetch": self.prefetch,
                "pin": self.pin}


class LayerwiseSession:
    """The engine bound to one diffusion model (one nn.Module shared by all its clones)."""

    def __init__(self, diffusion_model: torch.nn.Module, device: torch.device,
                 settings: LayerwiseSettings) -> None:
        found = find_blocks(diffusion_model)
        self.model_class = type(diffusion_model).__name__
        self.layout = found.layout
        self.prefixes = tuple(f"diffusion_model.{p}" for p in found.paths)
        self.blocks = found.blocks
        # What the blocks weigh in core's own count of the model (its cached model_size()).
        self.block_bytes = sum(comfy.model_management.module_size(b) for b in self.blocks)
        self.keys = [k for prefix, block in zip(self.prefixes, self.blocks)
                     for k in comfy_weights.block_keys(prefix, block)]
        self.device = device
        self.settings = settings
        self.streamer = LayerwiseStreamer(list(self.blocks), device, **settings.streamer_kwargs())
        self.module_id = id(diffusion_model)
        self.accounted_bytes = 0
        self.started = 0.0
        self.runs = 0
        self.last_run: dict[str, Any] | None = None
        self.active = False

    def begin(self, patcher) -> None:
        comfy_weights.hand_over_from_core(patcher, self.keys, self.blocks)
        fingerprints = [comfy_weights.patch_fingerprint(patcher.patches,
                                                        comfy_weights.block_keys(p, b))
                        for p, b in zip(self.prefixes, self.blocks)]
        transform = None
        if any(fingerprints):
            transform = comfy_weights.lora_transform(patcher, self.prefixes)
        self.streamer.telemetry.reset()
        self.started = time.perf_counter()
        if self.device.type != "cpu":
            # The engine allocates before core's load makes room: ask core to make room first,
            # so cached text encoders or VAEs are evicted rather than the attach running out.
            comfy.model_management.free_memory(self.streamer.bound_bytes(), self.device)
        progress = comfy.utils.ProgressBar(len(self.blocks) + 1)
        self.streamer.attach(transform=transform, fingerprints=fingerprints,
                             progress=lambda done, total: progress.update_absolute(done, total))
        # Until account(), core's load() sees every block as empty: it neither counts nor moves
        # them, and it merges no LoRA into resident blocks that already carry the engine's merge.
        self.streamer.conceal_resident()
        self.active = True

    def account(self, patcher) -> None:
        """Make core's count of the model's device bytes true, once core has loaded the rest.

        Core counted none of the concealed blocks, except after a full load, where it counts
        its cached size of the whole model. Its own share is at most the model less the blocks;
        the engine's device bytes (resident blocks, slots) come on top of that.
        """
        self.streamer.reveal_resident()
        comfy_weights.settle_after_core_load(self.blocks)
        model = patcher.model
        model.model_loaded_weight_memory = min(model.model_loaded_weight_memory,
                                               max(0, patcher.model_size() - self.block_bytes))
        if self.device.type != "cpu":
            self.accounted_bytes = self.streamer.bound_bytes()
            model.model_loaded_weight_memory += self.accounted_bytes

    def end(self, patcher) -> None:
        if self.accounted_bytes:
            patcher.model.model_loaded_weight_memory = max(
                0, patcher.model.model_loaded_weight_memory - self.accounted_bytes)
            self.accounted_bytes = 0
        try:
            self.last_run = run_figures(self.streamer.telemetry.snapshot(wait=True),
                                        time.perf_counter() - self.started, self.device)
            self.runs += 1
        finally:
            self.active = False
            self.streamer.detach(keep_pack=True)
            comfy_weights.return_to_core(patcher, self.blocks)

    def close(self) -> None:
        self.streamer.close()

    def report(self) -> dict[str, Any]:
        return {
            "module_id": self.module_id,
            "model_class": self.model_class,
            "layout": self.layout,
            "device": str(self.device),
            "settings": asdict(self.settings),
            "blocks": len(self.blocks),
            "resident_indices": list(self.streamer.resident_indices),
            "streamed_indices": list(self.streamer.streamed_indices),
            "bound_bytes": self.streamer.bound_bytes(),
            "block_states": self.streamer.block_states(),
            "active": self.active,
            "runs": self.runs,
            "telemetry": self.streamer.telemetry.snapshot() if self.active else self.last_run,
            "dynamic_vram": dynamic_vram.describe(self.module_id),
        }


def run_figures(snapshot: dict[str, Any], seconds: float, device: torch.device) -> dict[str, Any]:
    """The engine's counters plus what a person reads first: rate and overlap of the run.

    `gbps` is streamed bytes over the run's wall time. `overlap_efficiency` is the share of the
    run that compute did not spend waiting for copies; on CPU copies are synchronous and not
    timed, so it is left out there rather than shown as a flattering 100%.
    """
    figures = dict(snapshot, seconds=seconds)
    figures["gbps"] = snapshot["bytes_copied"] / seconds / 1e9 if seconds > 0 else 0.0
    if device.type != "cpu" and seconds > 0:
        figures["overlap_efficiency"] = max(0.0, 1.0 - snapshot["compute_wait_s"] / seconds)
    return figures


class _Registry:
    """One session per diffusion nn.Module (shared by all its clones)."""

    def __init__(self) -> None:
        self._sessions: PerModule[LayerwiseSession] = PerModule()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call fn(report) after every sampling run of a layerwise-offloaded model."""
        self._listeners.append(fn)

    def publish(self, session: LayerwiseSession) -> None:
        report = session.report()
        for fn in list(self._listeners):
            try:
                fn(report)
            except Exception:
                log.exception("layerwise offload: report listener failed")

    def session_for(self, diffusion_model: torch.nn.Module, device: torch.device,
                    settings: LayerwiseSettings) -> LayerwiseSession:
        def same(session: LayerwiseSession) -> bool:
            if session.settings == settings and session.device == device:
                return True
            log.info("Layerwise offload: settings changed for %s, rebuilding the engine",
                     session.model_class)
            return False
        return self._sessions.get_or_create(
            diffusion_model, lambda: LayerwiseSession(diffusion_model, device, settings), same)

    def discard(self, diffusion_model: torch.nn.Module) -> LayerwiseSession | None:
        """Close this model's engine (its pinned pack is freed, its tensors handed back)."""
        return self._sessions.discard(diffusion_model)

    def is_active(self, diffusion_model: torch.nn.Module) -> bool:
        """Whether the engine holds this model's blocks right now (a sampling run is on)."""
        session = self._sessions.get(diffusion_model)
        return session is not None and session.active

    def report(self) -> list[dict[str, Any]]:
        return [s.report() for s in self._sessions.values()]


REGISTRY = _Registry()


_is_dynamic = dynamic_vram.is_dynamic


def _classic_patcher(model, settings: LayerwiseSettings):
    """A classic ModelPatcher for the engine to stream.

    A classic model gets a plain clone. A model that newer ComfyUI runs with Dynamic VRAM
    (0.15 and later) gets a clone over a classic copy of it, because the engine cannot take the
    blocks of a dynamic model (dynamic_vram.py says why): the copy is made once per model, after
    every check, and its cost is logged and reported. Raises ValueError, before any copy, for a
    model or settings the engine refuses or a model no copy can be made of.
    """
    if not _is_dynamic(model):
        return model.clone()
    return dynamic_vram.classic_copy(model, settings.streamer_kwargs())


class ApplyLayerwiseOffload:
    """Stream the diffusion model's blocks from pinned RAM while earlier blocks compute."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model to stream."}),
            "resident_blocks": ("INT", {
                "default": -1, "min": -1, "max": 4096,
                "tooltip": "Blocks kept on the GPU, spread evenly through the stack. -1 derives "
                           "the number from vram_budget_gb."}),
            "vram_budget_gb": ("FLOAT", {
                "default": 12.0, "min": 0.0, "max": 1024.0, "step": 0.25,
                "tooltip": "GPU memory for the model's blocks (resident blocks plus streaming "
                           "slots) when resident_blocks is -1. 12 GB suits a 24 GB card running "
                           "a 14B video model: the rest is left for activations, VAE and "
                           "text encoders."}),
            "prefetch": ("INT", {
                "default": 2, "min": 1, "max": 16,
                "tooltip": "How many streamed blocks are copied ahead of the one computing. "
                           "Each adds one block-sized GPU slot."}),
            "pin": ("BOOLEAN", {
                "default": True,
                "tooltip": "Keep the block weights in pinned RAM for full-speed async copies. "
                           "Falls back to pageable RAM (slower, logged) if pinning would exceed "
                           "the RAM budget."}),
        }, "optional": {
            "mode": (list(dynamic_vram.MODES), {
                "default": "auto",
                "tooltip": "auto: on a model that ComfyUI runs with Dynamic VRAM (0.15 and later "
                           "on NVIDIA), ComfyUI streams it and keeps this node's resident blocks "
                           "in VRAM first, with no copy; on other models the pack's engine "
                           "streams. engine: always the pack's engine; on a Dynamic VRAM model "
                           "that costs a second copy of the model in RAM and one reload from "
                           "disk (logged and shown in the Offload panel)."}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = "tiered_offload"
    DESCRIPTION = ("Streams the transformer blocks from pinned RAM into a few GPU slots while "
                   "earlier blocks compute. Results are bit-identical to running without it.")

    def apply(self, model, resident_blocks: int, vram_budget_gb: float, prefetch: int, pin: bool,
              mode: str = "auto"):
        settings = LayerwiseSettings(resident_blocks, vram_budget_gb, prefetch, pin)
        if dynamic_vram.check_mode(mode) == "auto" and _is_dynamic(model):
            return (dynamic_vram.cooperate(model, settings.streamer_kwargs()),)
        from . import swap  # swap builds on this module
        # Checked on the input (clones carry its wrappers), so a refusal costs no copy.
        if model.get_wrappers(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, swap.KEY):
            raise ValueError(
                "Apply Layerwise Offload got a model that is already under Model-Level Swap, "
                "which keeps the whole model in pinned RAM; streaming its blocks would hold them "
                "twice. Put Apply Layerwise Offload first, then Model-Level Swap.")
        patcher = _classic_patcher(model, settings)
        # A whole-model master left by an earlier workflow would double the RAM: retire it.
        if swap.MEMBERS.discard(patcher.model) is not None:
            log.info("Apply Layerwise Offload: released the Model-Level Swap master of this model")
        diffusion_model = patcher.get_model_object("diffusion_model")
        # Fail in this node, with the model named, rather than later inside the sampler.
        session = REGISTRY.session_for(diffusion_model, patcher.load_device, settings)
        log.info("Apply Layerwise Offload: %s, %d blocks (%s), %d resident, %d streamed",
                 session.model_class, len(session.blocks), session.layout,
                 len(session.streamer.resident_indices), len(session.streamer.streamed_indices))

        def outer_sample(executor, *args, **kwargs):
            current = executor.class_obj.model_patcher
            live = REGISTRY.session_for(current.get_model_object("diffusion_model"),
                                        current.load_device, settings)
            live.begin(current)
            try:
                return executor(*args, **kwargs)
            finally:
                live.end(current)
                REGISTRY.publish(live)

        def prepare_sampling(executor, model_patcher, *args, **kwargs):
            result = executor(model_patcher, *args, **kwargs)
            live = REGISTRY.session_for(model_patcher.get_model_object("diffusion_model"),
                                        model_patcher.load_device, settings)
            if live.active:
                live.account(model_patcher)
            return result

        for wrapper_type in (comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                             comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING):
            patcher.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
        patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                                     WRAPPER_KEY, outer_sample)
        patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING,
                                     WRAPPER_KEY, prepare_sampling)
        return (patcher,)
