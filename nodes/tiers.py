"""ComfyUI side of the VRAM Tier Manager: tiered loader nodes and the model backend.

Why drop-in "Tiered" loaders rather than patching core's loaders transparently: a transparent
cache means replacing `comfy.sd` loader functions or core node classes at import time, which
changes every workflow of every user silently and breaks whenever core changes those internals.
The tiered loaders subclass the core loader nodes, take exactly the same inputs and call core's
own loading code, so swapping a loader for its tiered twin is the only change a workflow needs,
and its results are identical.

Each tiered loader returns the manager's object for its (file, mtime, options) identity, so a
workflow run again after another one gets its models from RAM instead of disk. A model is in use
from the start of any prompt whose graph contains its loader until that prompt ends.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Callable

import torch

import comfy.model_management
import folder_paths
import nodes as core_nodes

from ..offload_core.tiers import Tier, TierManager, model_id
from . import prompt_lifecycle
from .core_models import loaded_entries, unload_from_core

log = logging.getLogger(__name__)

MANAGER = TierManager()


def _patchers(outputs: tuple) -> list:
    """The ModelPatchers inside a loader's outputs (MODEL, CLIP.patcher, VAE.patcher)."""
    found = []
    for obj in outputs:
        patcher = obj if hasattr(obj, "model_size") else getattr(obj, "patcher", None)
        if patcher is not None:
            found.append(patcher)
    return found


class ComfyModelBackend:
    """Moves one loader's outputs between tiers with core's own load and unload paths.

    Going through `load_models_gpu` and `LoadedModel.model_unload` keeps core's view
    (`current_loaded_models`, free memory) the same as ours. Each step runs under
    `torch.inference_mode()`, as core's prompt worker runs everything: a REST call or the
    preload thread would otherwise move a model outside it, and moving a quantized weight (0.3.75's
    QuantizedTensor) outside it leaves a parameter that core's next prompt cannot `detach()`.
    """

    def __init__(self, load: Callable[[], tuple], size_hint: int) -> None:
        self._load = load
        self._size_hint = size_hint
        self.outputs: tuple | None = None

    @torch.inference_mode()
    def load_from_disk(self) -> None:
        self.outputs = self._load()

    @torch.inference_mode()
    def to_vram(self) -> None:
        comfy.model_management.load_models_gpu(_patchers(self.outputs))

    @torch.inference_mode()
    def to_ram(self) -> None:
        if self.outputs is None:
            return
        for patcher in _patchers(self.outputs):
            unload_from_core(patcher.model)

    @torch.inference_mode()
    def drop(self) -> None:
        """Free the weights even if ComfyUI's output cache still holds these objects.

        The loader node reports itself changed after a drop, so the hollow objects are never
        used again: the next prompt runs the loader, which reloads from disk.
        """
        self.to_ram()
        if self.outputs is not None:
            for patcher in _patchers(self.outputs):
                patcher.model.to(torch.device("meta"))
        self.outputs = None

    def nbytes(self) -> int:
        if self.outputs is None:
            return self._size_hint
        return sum(p.model_size() for p in _patchers(self.outputs))

    def bytes_by_tier(self) -> dict[str, int]:
        if self.outputs is None:
            return {"vram": 0, "ram": 0}
        vram = 0
        host = 0
        for patcher in _patchers(self.outputs):
            size = patcher.model_size()
            loaded = max((lm.model_loaded_memory() for lm in loaded_entries(patcher.model)), default=0)
            vram += loaded
            # With a CPU compute device (--cpu) a "loaded" model still sits in RAM, so all of
            # it counts against the RAM budget.
            host += size if patcher.load_device.type == "cpu" else size - loaded
        return {"vram": vram, "ram": max(0, host)}

    def current_tier(self) -> Tier:
        if self.outputs is None:
            return Tier.DISK
        if any(loaded_entries(p.model) for p in _patchers(self.outputs)):
            return Tier.VRAM
        return Tier.RAM


class _PromptUses:
    """Which managed models each running prompt holds, released when it ends.

    At prompt start every Tiered loader in the prompt's graph is held, before any node runs, so
    a model is never evicted between the prompt's start and its use, even when the loader's
    output comes from ComfyUI's cache. The loader also holds when it runs, in case the graph
    could not be read.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str | None, list[str]] = {}

    def hold(self, key: str, prompt_id: str | None = None) -> None:
        prompt_id = prompt_id if prompt_id is not None else prompt_lifecycle.current_prompt_id()
        with self._lock:
            held = self._held.setdefault(prompt_id, [])
            if key in held:
                return
            held.append(key)
        try:
            MANAGER.acquire(key, to=Tier.RAM)
        except Exception:
            with self._lock:
                self._held[prompt_id].remove(key)
            raise

    def hold_graph(self, prompt_id: str, graph: dict) -> None:
        for node in graph.values():
            loader = NODE_CLASS_MAPPINGS.get(node.get("class_type")) if isinstance(node, dict) else None
            if loader is None or not issubclass(loader, _TieredLoader):
                continue
            try:
                key, _ = loader.identity(**node.get("inputs", {}))
                MANAGER.get(key)
            except Exception:  # a link, a missing file or a new model: its loader will hold it
                continue
            self.hold(key, prompt_id)

    def release_prompt(self, prompt_id: str | None) -> None:
        with self._lock:
            keys = self._held.pop(prompt_id, [])
        for key in keys:
            MANAGER.release(key)
        sync_tiers()


PROMPT_USES = _PromptUses()


def _backends() -> list[tuple[str, ComfyModelBackend]]:
    """(id, backend) of every model the Tiered loaders registered."""
    found = []
    for entry in MANAGER.snapshot()["models"]:
        backend = MANAGER.get(entry["id"]).backend
        if isinstance(backend, ComfyModelBackend):
            found.append((entry["id"], backend))
    return found


def sync_tiers() -> None:
    """Record where core really holds each model; core also loads and unloads on its own."""
    for key, backend in _backends():
        MANAGER.observe(key, backend.current_tier())


def _identity(kind: str, folder: str, name: str, options: dict[str, Any]) -> tuple[str, str]:
    path = folder_paths.get_full_path_or_raise(folder, name)
    return model_id(path, os.stat(path).st_mtime_ns, {"kind": kind, **options}), path


def register_model(kind: str, folder: str, name: str, options: dict[str, Any],
                   load: Callable[[], tuple]) -> str:
    """Make the manager know this loader identity (on disk until first use); return its id."""
    key, path = _identity(kind, folder, name, options)
    MANAGER.register(key, name, ComfyModelBackend(load, os.path.getsize(path)), kind=kind)
    return key


def managed_outputs(key: str) -> tuple:
    """The loader outputs for this id, from whichever tier holds them, held for this prompt."""
    MANAGER.wait_ready(key)
    PROMPT_USES.hold(key)
    return MANAGER.get(key).backend.outputs


def key_of(obj) -> str | None:
    """The manager id of a loader output (MODEL, CLIP or VAE, or a clone of one)."""
    modules = {p.model for p in _patchers((obj,))}
    for key, backend in _backends():
        if backend.outputs is not None and modules & {p.model for p in _patchers(backend.outputs)}:
            return key
    return None


def diffusion_module_ids() -> dict[str, int]:
    """Manager id → id() of the diffusion nn.Module it holds, to join layerwise reports."""
    out = {}
    for key, backend in _backends():
        if backend.outputs is not None:
            for patcher in _patchers(backend.outputs):
                diffusion_model = getattr(patcher.model, "diffusion_model", None)
                if diffusion_model is not None:
                    out[key] = id(diffusion_model)
    return out


class _TieredLoader:
    """Shared body of the Tiered loaders: same inputs as the core loader they subclass."""
    KIND: str
    FOLDER: str
    NAME_INPUT: str
    FUNCTION = "load_tiered"
    CATEGORY = "tiered_offload/loaders"

    @classmethod
    def _split(cls, inputs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        options = dict(inputs)
        return options.pop(cls.NAME_INPUT), options

    @classmethod
    def identity(cls, **inputs: Any) -> tuple[str, str]:
        """(manager id, file path) of these inputs."""
        name, options = cls._split(inputs)
        return _identity(cls.KIND, cls.FOLDER, name, options)

    @classmethod
    def register(cls, **inputs: Any) -> str:
        name, options = cls._split(inputs)
        return register_model(cls.KIND, cls.FOLDER, name, options,
                              lambda: tuple(cls.core_load(cls(), **inputs)))

    @classmethod
    def IS_CHANGED(cls, **inputs):
        """Differs once the model was dropped to disk, so the loader runs again and reloads."""
        try:
            key, _ = cls.identity(**inputs)
            return f"{key}:{MANAGER.get(key).loads_from_disk}"
        except Exception:  # unknown or missing: let the loader run and report it
            return float("nan")

    def load_tiered(self, **inputs: Any) -> tuple:
        return managed_outputs(type(self).register(**inputs))


class TieredUNETLoader(_TieredLoader, core_nodes.UNETLoader):
    """UNETLoader whose model is kept by the tier manager across workflows."""
    KIND, FOLDER, NAME_INPUT = "diffusion_model", "diffusion_models", "unet_name"

    def core_load(self, **inputs):
        return self.load_unet(**inputs)


class TieredCheckpointLoader(_TieredLoader, core_nodes.CheckpointLoaderSimple):
    """CheckpointLoaderSimple whose model, CLIP and VAE are kept by the tier manager."""
    KIND, FOLDER, NAME_INPUT = "checkpoint", "checkpoints", "ckpt_name"

    def core_load(self, **inputs):
        return self.load_checkpoint(**inputs)[:3]


class TieredCLIPLoader(_TieredLoader, core_nodes.CLIPLoader):
    """CLIPLoader whose text encoder is kept by the tier manager."""
    KIND, FOLDER, NAME_INPUT = "clip", "text_encoders", "clip_name"

    def core_load(self, **inputs):
        return self.load_clip(**inputs)


class TieredVAELoader(_TieredLoader, core_nodes.VAELoader):
    """VAELoader whose VAE is kept by the tier manager."""
    KIND, FOLDER, NAME_INPUT = "vae", "vae", "vae_name"

    def core_load(self, **inputs):
        return self.load_vae(**inputs)


class VRAMTierManager:
    """Set the tier manager's budgets and a model's policy from inside a workflow."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "ram_budget_gb": ("FLOAT", {
                    "default": 0.0, "min": 0.0, "max": 4096.0, "step": 0.5,
                    "tooltip": "Cap on RAM held by parked models; 0 means only the reserve "
                               "below limits it. Over budget, the least recently used idle "
                               "model drops to disk."}),
                "ram_reserve_gb": ("FLOAT", {
                    "default": 4.0, "min": 0.0, "max": 1024.0, "step": 0.5,
                    "tooltip": "RAM always left free for ComfyUI and the system."}),
                "vram_reserve_gb": ("FLOAT", {
                    "default": 1.0, "min": 0.0, "max": 1024.0, "step": 0.25,
                    "tooltip": "VRAM kept free when the manager loads models itself."}),
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
        gib = 1024 ** 3
        MANAGER.set_budgets(
            ram_budget_bytes=int(ram_budget_gb * gib) if ram_budget_gb > 0 else None,
            ram_reserve_bytes=int(ram_reserve_gb * gib),
            vram_reserve_bytes=int(vram_reserve_gb * gib), disk_tier=disk_tier)
        for obj in (model, clip, vae):
            if obj is None:
                continue
            key = key_of(obj)
            if key is None:
                raise ValueError(
                    f"VRAM Tier Manager: the connected {type(obj).__name__} was not loaded by a "
                    "Tiered loader, so the manager does not track it. Use Tiered UNET / "
                    "Checkpoint / CLIP / VAE Loader.")
            (MANAGER.pin if keep_in_ram else MANAGER.unpin)(key)
            MANAGER.set_priority(key, priority)
        return (model, clip, vae)


PRELOAD_FILE = "tiered_offload.json"


def _preload_from_config() -> None:
    """Register and warm the models named in <user dir>/tiered_offload.json, in the background.

    Format: {"preload": [{"loader": "TieredUNETLoader", "inputs": {...}, "tier": "ram"}]}.
    A bad entry is logged and skipped; start-up never waits for or fails on the warm-up.
    """
    path = os.path.join(folder_paths.get_user_directory(), PRELOAD_FILE)
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            items = json.load(f).get("preload", [])
    except (OSError, ValueError, AttributeError) as e:
        log.error("tiered offload: cannot read %s: %s", path, e)
        return
    by_tier: dict[str, list[str]] = {}
    for item in items:
        try:
            loader = NODE_CLASS_MAPPINGS[item["loader"]]
            key = loader.register(**item["inputs"])
            by_tier.setdefault(item.get("tier", "ram"), []).append(key)
        except Exception as e:
            log.error("tiered offload: skipping preload entry %r: %s", item, e)
    for tier, keys in by_tier.items():
        log.info("tiered offload: preloading %d model(s) into %s", len(keys), tier)
        MANAGER.preload(keys, tier, background=True)


def install() -> None:
    """Server-side wiring: release a prompt's models when it ends, and start the preload."""
    prompt_lifecycle.install()
    prompt_lifecycle.on_prompt_start(PROMPT_USES.hold_graph)
    prompt_lifecycle.on_prompt_end(PROMPT_USES.release_prompt)
    _preload_from_config()


NODE_CLASS_MAPPINGS = {
    "TieredUNETLoader": TieredUNETLoader,
    "TieredCheckpointLoader": TieredCheckpointLoader,
    "TieredCLIPLoader": TieredCLIPLoader,
    "TieredVAELoader": TieredVAELoader,
    "VRAMTierManager": VRAMTierManager,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "TieredUNETLoader": "Tiered UNET Loader",
    "TieredCheckpointLoader": "Tiered Checkpoint Loader",
    "TieredCLIPLoader": "Tiered CLIP Loader",
    "TieredVAELoader": "Tiered VAE Loader",
    "VRAMTierManager": "VRAM Tier Manager",
}
