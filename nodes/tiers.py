"""ComfyUI side of the VRAM Tier Manager: tiered loader nodes and the model backend.

Why drop-in "Tiered" loaders rather than patching core's loaders transparently: a transparent
cache means replacing `comfy.sd` loader functions or core node classes at import time, which
changes every workflow of every user silently and breaks whenever core changes those internals.
The tiered loaders subclass the core loader nodes, take exactly the same inputs and call core's
own loading code, so swapping a loader for its tiered twin is the only change a workflow needs,
and its results are identical.

Each tiered loader returns the manager's object for its (file, version, options) identity, so a
workflow run again after another one gets its models from RAM instead of disk. A model is in use
from the start of any prompt whose graph contains its loader until that prompt ends. A newer
version of a file (`file_version`: another inode, size or time stamp) supersedes the old entry,
which is then forgotten.

Dropping a model to disk frees its weights even though ComfyUI's output cache still holds the
loader's objects: the objects are emptied (moved to the meta device), and the loader's
`IS_CHANGED` changes with every drop, so no prompt is ever handed the emptied objects: the loader
runs again and reloads, or fails the prompt with the manager's clear refusal.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

import comfy.model_management
import folder_paths
import nodes as core_nodes

from ..offload_core.models.tiers import (
    DEFAULT_RAM_RESERVE_BYTES, DEFAULT_VRAM_RESERVE_BYTES, SourceChangedError, SourceGoneError, SourceUnreadableError, Tier, TierError, TierManager,
    file_version, model_id, source_key)
from . import budgets, prompt_lifecycle, settings_file
from .core_models import loaded_entries, unload_from_core
from .layerwise import REGISTRY as LAYERWISE
from .swap import MEMBERS as SWAP_MEMBERS

log = logging.getLogger(__name__)

MANAGER = TierManager()
# Errors that say nothing about the file: they pass through a load unchanged.
_NOT_THE_FILE = (comfy.model_management.InterruptProcessingException, MemoryError,
                 torch.OutOfMemoryError, TierError)


def _patchers(outputs: tuple) -> list:
    """The ModelPatchers inside a loader's outputs (MODEL, CLIP.patcher, VAE.patcher)."""
    found = []
    for obj in outputs:
        # CLIP and VAE hold theirs as `.patcher`; a VAE has a model_size() of its own too, so
        # a ModelPatcher is known by its model and load device, not by that method.
        patcher = getattr(obj, "patcher", None)
        if patcher is None and hasattr(obj, "model") and hasattr(obj, "load_device"):
            patcher = obj
        if patcher is not None:
            found.append(patcher)
    return found


def _release_engines(module: torch.nn.Module) -> None:
    """Close the pack's engine objects bound to a model's modules before its weights are freed.

    A Model-Level Swap master guards the root module's `.to()` and holds a pinned copy; a
    layerwise session holds the diffusion model's blocks in a pinned pack. Closing them hands the
    original tensors back and frees the packs, so the drop frees every byte the model had.
    """
    SWAP_MEMBERS.discard(module)
    diffusion_model = getattr(module, "diffusion_model", None)
    if isinstance(diffusion_model, torch.nn.Module):
        LAYERWISE.discard(diffusion_model)


@dataclass(frozen=True)
class Source:
    """A loader's file as registered: its manager id, source key, path, version and size."""
    key: str
    source: str
    name: str
    path: str
    version: tuple[int, ...]
    size: int


class ComfyModelBackend:
    """Moves one loader's outputs between tiers with core's own load and unload paths.

    Going through `load_models_gpu` and `LoadedModel.model_unload` keeps core's view
    (`current_loaded_models`, free memory) the same as ours. `generation` counts drops: it is
    part of the loader's `IS_CHANGED`, so emptied objects are never served from ComfyUI's cache.
    Each step runs under `torch.inference_mode()`, as core's prompt worker runs everything: a
    REST call or the preload thread would otherwise move a model outside it, and moving a
    quantized weight (0.3.75's QuantizedTensor) outside it leaves a parameter that core's next
    prompt cannot `detach()`.
    """

    def __init__(self, load: Callable[[], tuple], source: Source) -> None:
        self._load = load
        self.source = source
        self.outputs: tuple | None = None
        self.generation = 0

    def _check_source(self) -> None:
        """Refuse to load anything but the registered version of the file (checked before and
        after each load, so bytes written meanwhile never get the old id)."""
        try:
            version = file_version(os.stat(self.source.path))
        except FileNotFoundError:
            raise SourceGoneError(f"the file of '{self.source.name}' is gone") from None
        if version != self.source.version:
            raise SourceChangedError(
                f"the file of '{self.source.name}' changed on disk since it was registered as "
                f"{self.source.key}; its loader registers the new version under a new id")

    @torch.inference_mode()
    def load_from_disk(self) -> None:
        self._check_source()
        try:
            outputs = self._load()
        except FileNotFoundError as e:
            raise SourceGoneError(f"the file of '{self.source.name}' is gone: {e}") from e
        except _NOT_THE_FILE:
            raise
        except Exception as e:
            raise SourceUnreadableError(f"'{self.source.name}' cannot be read as a model: "
                                        f"{budgets.shorten(e, 400)}") from e
        self._check_source()  # rewritten while it loaded: these bytes belong to no known id
        self.outputs = outputs

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

        The objects are forgotten and `generation` moves on first, so whatever happens while
        freeing, they are never handed out again: the loader reports itself changed and the next
        prompt runs it, which reloads from disk.
        """
        self.to_ram()
        outputs, self.outputs = self.outputs, None
        self.generation += 1
        for patcher in _patchers(outputs or ()):
            try:
                _release_engines(patcher.model)
                patcher.model.to(torch.device("meta"))
            except Exception:
                log.exception("tiered offload: could not empty '%s' on its drop; its memory is "
                              "freed when ComfyUI lets go of the objects", self.source.name)

    def nbytes(self) -> int:
        if self.outputs is None:
            return self.source.size
        return sum(p.model_size() for p in _patchers(self.outputs))

    def bytes_by_tier(self) -> dict[str, int]:
        """Each byte once: on the compute device ("vram"), in host memory ("ram"), or, for blocks
        that Apply Layerwise Offload streams from disk, only on disk ("disk")."""
        if self.outputs is None:
            return {"vram": 0, "ram": 0}
        vram = 0
        host = 0
        disk = 0
        for patcher in _patchers(self.outputs):
            size = patcher.model_size()
            on_disk = min(size, LAYERWISE.disk_bytes(getattr(patcher.model, "diffusion_model", None)))
            disk += on_disk
            if patcher.load_device.type == "cpu":
                # --cpu: a model core "loaded" still sits in RAM and counts against its budget.
                host += size - on_disk
                continue
            loaded = max((lm.model_loaded_memory() for lm in loaded_entries(patcher.model)),
                         default=0)
            vram += loaded
            host += max(0, size - loaded - on_disk)
        return {"vram": vram, "ram": host, "disk": disk} if disk else {"vram": vram, "ram": host}

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
        """Hold every known model the graph's Tiered loaders name with constant inputs.

        A model that cannot be held now (its reload is refused) is logged and skipped: its drop
        changed the loader's `IS_CHANGED`, so the loader runs and fails the prompt with the
        manager's refusal, and nothing else in the graph goes unheld.
        """
        for node in graph.values():
            loader = NODE_CLASS_MAPPINGS.get(node.get("class_type")) if isinstance(node, dict) else None
            if not isinstance(loader, type) or not issubclass(loader, _TieredLoader):
                continue
            try:
                key = loader.identity(**node.get("inputs", {})).key
                name = MANAGER.get(key).name
            except Exception:  # a link, a missing file or a new model: its loader will hold it
                continue
            try:
                self.hold(key, prompt_id)
            except Exception as e:
                log.warning("tiered offload: prompt %s cannot hold '%s' at its start, its loader "
                            "will report it: %s", prompt_id, name, e)

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


def sync_tiers(*, wait: bool = True) -> None:
    """Record where core really holds each model; core also loads and unloads on its own.

    With `wait=False` (status requests) a model the manager is busy with is left as published.
    """
    for key, backend in _backends():
        MANAGER.observe(key, backend.current_tier(), wait=wait)


def _identity(kind: str, folder: str, name: str, options: dict[str, Any]) -> Source:
    path = folder_paths.get_full_path_or_raise(folder, name)
    stat = os.stat(path)
    options = {"kind": kind, **options}
    version = file_version(stat)
    return Source(key=model_id(path, version, options), source=source_key(path, options),
                  name=name, path=path, version=version, size=stat.st_size)


def register_model(kind: str, folder: str, name: str, options: dict[str, Any],
                   load: Callable[[], tuple]) -> str:
    """Make the manager know this loader identity (on disk until first use); return its id.

    A new version of the file (see `file_version`) supersedes the entry of the old one.
    """
    source = _identity(kind, folder, name, options)
    MANAGER.register(source.key, name, ComfyModelBackend(load, source), kind=kind,
                     source=source.source)
    return source.key


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
    def identity(cls, **inputs: Any) -> Source:
        """The file these inputs name, with its manager id."""
        name, options = cls._split(inputs)
        return _identity(cls.KIND, cls.FOLDER, name, options)

    @classmethod
    def register(cls, **inputs: Any) -> str:
        name, options = cls._split(inputs)
        return register_model(cls.KIND, cls.FOLDER, name, options,
                              lambda: tuple(cls.core_load(cls(), **inputs)))

    @classmethod
    def IS_CHANGED(cls, **inputs):
        """Differs after every drop to disk (and for a new version of the file), so the loader
        runs again and reloads instead of ComfyUI's cache serving the emptied objects."""
        try:
            key = cls.identity(**inputs).key
            return f"{key}:{MANAGER.get(key).backend.generation}"
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
            MANAGER.set_budgets(**budgets.budget_kwargs({
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
            (MANAGER.pin if keep_in_ram else MANAGER.unpin)(key)
            MANAGER.set_priority(key, priority)
        return (model, clip, vae)


def _register_preload_entry(item: Any) -> tuple[str, str]:
    """(manager id, tier) of one preload entry; ValueError or the loader's error if it is bad."""
    if not isinstance(item, dict):
        raise ValueError("an entry must be a JSON object")
    name = item.get("loader")
    loader = NODE_CLASS_MAPPINGS.get(name) if isinstance(name, str) else None
    if not isinstance(loader, type) or not issubclass(loader, _TieredLoader):
        names = [n for n, c in NODE_CLASS_MAPPINGS.items() if issubclass(c, _TieredLoader)]
        raise ValueError(f"loader must be one of {', '.join(names)}")
    inputs = item.get("inputs")
    if not isinstance(inputs, dict):
        raise ValueError("inputs must be a JSON object of the loader's inputs")
    tier = item.get("tier", Tier.RAM.value)
    if tier not in (Tier.RAM.value, Tier.VRAM.value):
        raise ValueError('tier must be "ram" or "vram"')
    return loader.register(**inputs), tier


def _preload_from_config() -> None:
    """Register and warm the models named in the settings file, in the background.

    Format: {"preload": [{"loader": "TieredUNETLoader", "inputs": {...}, "tier": "ram"}]}.
    A bad file or entry, whatever its content, is logged and skipped; start-up never waits for
    or fails on the warm-up.
    """
    try:
        items = settings_file.read().get("preload", [])
        if not isinstance(items, list):
            raise ValueError('expected {"preload": [...]}')
    except (OSError, ValueError) as e:
        log.error("tiered offload: cannot read %s: %s", settings_file.path(), budgets.shorten(e, 300))
        return
    by_tier: dict[str, list[str]] = {}
    for item in items:
        try:
            key, tier = _register_preload_entry(item)
        except Exception as e:
            log.error("tiered offload: skipping preload entry %s: %s",
                      budgets.shorten(repr(item), 300), budgets.shorten(e, 300))
            continue
        by_tier.setdefault(tier, []).append(key)
    for tier, keys in by_tier.items():
        log.info("tiered offload: preloading %d model(s) into %s", len(keys), tier)
        MANAGER.preload(keys, tier, background=True)


def install() -> None:
    """Server-side wiring: hold a prompt's models from its start, release them when it ends,
    and start the preload (which never fails the pack's import)."""
    prompt_lifecycle.install()
    prompt_lifecycle.on_prompt_start(PROMPT_USES.hold_graph)
    prompt_lifecycle.on_prompt_end(PROMPT_USES.release_prompt)
    try:
        _preload_from_config()
    except Exception:
        log.exception("tiered offload: preload failed; the models load on first use instead")


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
