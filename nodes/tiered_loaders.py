"""The Tiered loaders: core's UNET, Checkpoint, CLIP and VAE loaders whose models the tier manager
keeps across workflows, and what a prompt's graph of them holds from its start.

Why drop-in "Tiered" loaders rather than patching core's loaders transparently: a transparent
cache means replacing `comfy.sd` loader functions or core node classes at import time, which
changes every workflow of every user silently and breaks whenever core changes those internals.
The tiered loaders subclass the core loader nodes, take exactly the same inputs and call core's
own loading code, so swapping a loader for its tiered twin is the only change a workflow needs,
and its results are identical.

Each tiered loader returns the manager's object for its (file, version, options) identity, so a
workflow run again after another one gets its models from RAM instead of disk. A model is in use
from the start of any prompt whose graph contains its loader until that prompt ends
(`hold_graph` at the start, `managed_models.release_prompt` at the end). A loader reports itself
changed after every drop of its model to disk, so ComfyUI's cache never serves the emptied objects.
"""
from __future__ import annotations

import logging
from typing import Any

import nodes as core_nodes

from . import prompt_lifecycle, state
from .managed_models import register_model, source_of
from .tier_backend import Source

log = logging.getLogger(__name__)


def managed_outputs(key: str) -> tuple:
    """The loader outputs for this id, from whichever tier holds them, held for this prompt."""
    state.MANAGER.wait_ready(key)
    state.PROMPT_HOLDS.hold(key, prompt_lifecycle.current_prompt_id())
    return state.MANAGER.get(key).backend.outputs


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
        return source_of(cls.KIND, cls.FOLDER, name, options)

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
            return f"{key}:{state.MANAGER.get(key).backend.generation}"
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


LOADERS: dict[str, type[_TieredLoader]] = {
    "TieredUNETLoader": TieredUNETLoader,
    "TieredCheckpointLoader": TieredCheckpointLoader,
    "TieredCLIPLoader": TieredCLIPLoader,
    "TieredVAELoader": TieredVAELoader,
}


def hold_graph(prompt_id: str, graph: dict) -> None:
    """Hold every known model the graph's Tiered loaders name with constant inputs.

    A model that cannot be held now (its reload is refused) is logged and skipped: its drop
    changed the loader's `IS_CHANGED`, so the loader runs and fails the prompt with the
    manager's refusal, and nothing else in the graph goes unheld.
    """
    for node in graph.values():
        loader = LOADERS.get(node.get("class_type")) if isinstance(node, dict) else None
        if loader is None:
            continue
        try:
            key = loader.identity(**node.get("inputs", {})).key
            name = state.MANAGER.get(key).name
        except Exception:  # a link, a missing file or a new model: its loader will hold it
            continue
        try:
            state.PROMPT_HOLDS.hold(key, prompt_id)
        except Exception as e:
            log.warning("tiered offload: prompt %s cannot hold '%s' at its start, its loader "
                        "will report it: %s", prompt_id, name, e)
