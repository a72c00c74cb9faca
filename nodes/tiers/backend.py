"""The tier manager's backend for ComfyUI models: one loader's outputs moved between tiers by core.

The manager (offload_core/models/tiers.py) decides where each model lives; a backend moves the
bytes. Here that is always core's own load and unload path, so core's view
(`current_loaded_models`, its free-memory figures) stays the same as the manager's.

Dropping a model to disk frees its weights even though ComfyUI's output cache still holds the
loader's objects: the objects are emptied (moved to the meta device), and `generation` moves on
with every drop, which the Tiered loader's `fingerprint_inputs` carries (loaders.py), so no prompt
is ever handed the emptied objects: the loader runs again and reloads, or fails the prompt with the
manager's clear refusal.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

import comfy.model_management

from ...offload_core.host.subclass import wrappers_to_inference
from ...offload_core.files.file_identity import file_version
from ...offload_core.models.tier_entries import Tier
from ...offload_core.models.tier_errors import (
    SourceChangedError, SourceGoneError, SourceUnreadableError, TierError)
from ..core import budgets, state
from ..core.models import loaded_entries, unload_from_core

log = logging.getLogger(__name__)

# Errors that say nothing about the file: they pass through a load unchanged.
_NOT_THE_FILE = (comfy.model_management.InterruptProcessingException, MemoryError,
                 torch.OutOfMemoryError, TierError)


def patchers_of(outputs: tuple) -> list:
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
    state.SWAP_MEMBERS.discard(module)
    diffusion_model = getattr(module, "diffusion_model", None)
    if isinstance(diffusion_model, torch.nn.Module):
        state.LAYERWISE.discard(diffusion_model)


def _counted_elsewhere(module: torch.nn.Module) -> int:
    """Bytes of a model's host copy that other processes count too: a shared host store (of its
    blocks, or of its Model-Level Swap master) is counted once per machine, each of the N
    processes that map it counting 1/N of it."""
    stores = [state.LAYERWISE.host_store(getattr(module, "diffusion_model", None))]
    member = state.SWAP_MEMBERS.get(module)
    if member is not None:
        stores.append(member.swap.host_store())
    excess = 0
    for store in stores:
        users = (store or {}).get("users") or 1
        if store and store.get("shared") and users > 1:
            excess += store["bytes"] - store["bytes"] // users
    return excess


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
    part of the loader's `fingerprint_inputs`, so emptied objects are never served from ComfyUI's cache.
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

    def mend(self) -> None:
        """Before the outputs are handed out again: quantized weights that core's prompt worker
        moved outside inference mode (`/free`) become inference tensors again, or core's next
        LoRA loader cannot read the model (see `wrappers_to_inference`)."""
        for patcher in patchers_of(self.outputs or ()):
            mended = wrappers_to_inference(patcher.model)
            if mended:
                log.info("[tiered offload] '%s': %d quantized tensors rewrapped for inference mode "
                         "(core unloaded the model outside it)", self.source.name, mended)

    @torch.inference_mode()
    def to_vram(self) -> None:
        comfy.model_management.load_models_gpu(patchers_of(self.outputs))

    @torch.inference_mode()
    def to_ram(self) -> None:
        if self.outputs is None:
            return
        for patcher in patchers_of(self.outputs):
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
        for patcher in patchers_of(outputs or ()):
            try:
                _release_engines(patcher.model)
                patcher.model.to(torch.device("meta"))
            except Exception:
                log.exception("[tiered offload] could not empty '%s' on its drop; its memory is "
                              "freed when ComfyUI lets go of the objects", self.source.name)

    def nbytes(self) -> int:
        if self.outputs is None:
            return self.source.size
        return sum(p.model_size() for p in patchers_of(self.outputs))

    def bytes_by_tier(self) -> dict[str, int]:
        """Each byte once: on the compute device ("vram"), in host memory ("ram"), or, for blocks
        that Apply Layerwise Offload streams from disk, only on disk ("disk"). Host bytes in a
        store shared with other processes count this process's share (``_counted_elsewhere``)."""
        if self.outputs is None:
            return {"vram": 0, "ram": 0}
        vram = 0
        host = 0
        disk = 0
        for patcher in patchers_of(self.outputs):
            size = patcher.model_size()
            on_disk = min(size, state.LAYERWISE.disk_bytes(getattr(patcher.model, "diffusion_model", None)))
            disk += on_disk
            elsewhere = _counted_elsewhere(patcher.model)
            if patcher.load_device.type == "cpu":
                # --cpu: a model core "loaded" still sits in RAM and counts against its budget.
                host += max(0, size - on_disk - elsewhere)
                continue
            loaded = max((lm.model_loaded_memory() for lm in loaded_entries(patcher.model)),
                         default=0)
            vram += loaded
            host += max(0, size - loaded - on_disk - elsewhere)
        return {"vram": vram, "ram": host, "disk": disk} if disk else {"vram": vram, "ram": host}

    def current_tier(self) -> Tier:
        if self.outputs is None:
            return Tier.DISK
        if any(loaded_entries(p.model) for p in patchers_of(self.outputs)):
            return Tier.VRAM
        return Tier.RAM
