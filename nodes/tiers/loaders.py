"""The Tiered loaders: core's UNET, Checkpoint, CLIP and VAE loaders whose models the tier manager
keeps across workflows, and what a prompt's graph of them holds from its start.

Why drop-in "Tiered" loaders rather than patching core's loaders transparently: a transparent
cache means replacing `comfy.sd` loader functions or core node classes at import time, which
changes every workflow of every user silently and breaks whenever core changes those internals.
The tiered loaders (V3 nodes) take their inputs, outputs and description from the core loader
node they mirror, read from it each time the schema is asked for, and call its own loading code,
so swapping a loader for its tiered twin is the only change a workflow needs, and its results are
identical.

Each tiered loader returns the manager's object for its (file, version, options) identity, so a
workflow run again after another one gets its models from RAM instead of disk. A model is in use
from the start of any prompt whose graph contains its loader until that prompt ends
(`hold_graph` at the start, `managed_models.release_prompt` at the end). A loader reports itself
changed (`fingerprint_inputs`) after every drop of its model to disk, so ComfyUI's cache never
serves the emptied objects.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import nodes as core_nodes
from comfy_api.v0_0_2 import io

from ..core import prompt_lifecycle, state
from ..core.budgets import shorten
from .backend import Source
from .managed_models import register_model, source_of

log = logging.getLogger(__name__)


def managed_outputs(key: str) -> tuple:
    """The loader outputs for this id, from whichever tier holds them, held for this prompt."""
    state.MANAGER.wait_ready(key)
    state.PROMPT_HOLDS.hold(key, prompt_lifecycle.current_prompt_id())
    backend = state.MANAGER.get(key).backend
    backend.mend()
    return backend.outputs


def _v3_input(name: str, spec: tuple, optional: bool) -> io.Input:
    """One input of a core (V1) node as the same input in the V3 schema: a list of choices is a
    combo, any other type keeps its name; every option (default, tooltip, advanced, min, max...)
    is passed on as core gives it."""
    kind, options = spec[0], dict(spec[1]) if len(spec) > 1 else {}
    tooltip = options.pop("tooltip", None)
    if isinstance(kind, list):
        made = io.Combo.Input(name, options=list(kind), default=options.pop("default", None),
                              tooltip=tooltip, optional=optional)
    else:
        made = io.Custom(kind).Input(name, tooltip=tooltip, optional=optional)
    made.extra_dict.update(options)
    return made


# `search_aliases` is a schema field of newer ComfyUI (0.33 has it, 0.3.75 does not).
_SCHEMA_FIELDS = {f.name for f in dataclasses.fields(io.Schema)}


class _TieredLoader(io.ComfyNode):
    """Shared body of the Tiered loaders: the inputs, outputs and loading code of the core loader
    `CORE`, read from it whenever the schema is asked for (its file lists change).

    Each loader's `validate_inputs` names only its file input: ComfyUI repeats a refusal once per
    input the method names (and skips its own checks of those), so a missing file is refused at
    queue time once, on that input. Other options are checked by ComfyUI 0.33 at queue time and
    by `execute` on 0.3.75, which checks a V3 node's choices only through validate_inputs."""
    NODE_ID: str
    DISPLAY_NAME: str
    CORE: type  # core's loader node
    LOAD: str  # its loading method
    OUTPUTS: int  # how many of its outputs the tiered loader returns
    KIND: str
    FOLDER: str
    NAME_INPUT: str

    @classmethod
    def define_schema(cls) -> io.Schema:
        core = cls.CORE
        declared = core.INPUT_TYPES()
        inputs = [_v3_input(name, spec, section == "optional")
                  for section in ("required", "optional")
                  for name, spec in declared.get(section, {}).items()]
        tooltips = list(getattr(core, "OUTPUT_TOOLTIPS", None) or ())
        outputs = [io.Custom(kind).Output(tooltip=tooltips[i] if i < len(tooltips) else None)
                   for i, kind in enumerate(core.RETURN_TYPES[:cls.OUTPUTS])]
        extra = {}
        if "search_aliases" in _SCHEMA_FIELDS and getattr(core, "SEARCH_ALIASES", None):
            extra["search_aliases"] = list(core.SEARCH_ALIASES)
        return io.Schema(node_id=cls.NODE_ID, display_name=cls.DISPLAY_NAME,
                         category="tiered_offload/loaders",
                         description=getattr(core, "DESCRIPTION", "") or "",
                         inputs=inputs, outputs=outputs, **extra)

    @classmethod
    def refusal(cls, inputs: dict[str, Any]) -> str | None:
        """What core refuses for its own loader among these inputs, or None: a choice it does
        not offer (a file that is not in the model folder, an unknown option) or a number out
        of its range. A value through a link is None at queue time and is skipped."""
        declared = cls.CORE.INPUT_TYPES()
        for section in ("required", "optional"):
            for name, spec in declared.get(section, {}).items():
                value = inputs.get(name)
                if value is not None:
                    problem = _out_of_spec(name, value, spec)
                    if problem is not None:
                        return f"{cls.DISPLAY_NAME}: {problem}"
        return None

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
        load = functools.partial(_core_load, cls.CORE, cls.LOAD, cls.OUTPUTS, inputs)
        return register_model(cls.KIND, cls.FOLDER, name, options, load)

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        """Differs after every drop to disk (and for a new version of the file), so the loader
        runs again and reloads instead of ComfyUI's cache serving the emptied objects."""
        try:
            key = cls.identity(**inputs).key
            return f"{key}:{state.MANAGER.get(key).backend.generation}"
        except Exception:  # unknown or missing: let the loader run and report it
            return float("nan")

    @classmethod
    def execute(cls, **inputs: Any) -> io.NodeOutput:
        # ComfyUI 0.3.75 checks a V3 node's choices only through validate_inputs, which names
        # only the file; core's loader would take an unknown option as its default.
        problem = cls.refusal(inputs)
        if problem is not None:
            raise ValueError(problem)
        return io.NodeOutput(*managed_outputs(cls.register(**inputs)))


def _out_of_spec(name: str, value: Any, spec: tuple) -> str | None:
    """Why a widget value is not one a core input takes (core's own checks), or None."""
    kind, options = spec[0], spec[1] if len(spec) > 1 else {}
    if isinstance(kind, list):
        if value in kind:
            return None
        shown = ", ".join(map(str, kind)) if len(kind) <= 20 else f"{len(kind)} choices"
        return f"{name} '{shorten(value)}' is not one of the choices ({shown})"
    if "min" in options and value < options["min"]:
        return f"{name} is smaller than its minimum {options['min']}"
    if "max" in options and value > options["max"]:
        return f"{name} is larger than its maximum {options['max']}"
    return None


def _core_load(core: type, method: str, outputs: int, inputs: dict[str, Any]) -> tuple:
    """Core's own loading code, on a new instance of its loader node, as core runs it."""
    return tuple(getattr(core(), method)(**inputs)[:outputs])


class TieredUNETLoader(_TieredLoader):
    """UNETLoader whose model is kept by the tier manager across workflows."""
    NODE_ID, DISPLAY_NAME = "TieredUNETLoader", "Tiered UNET Loader"
    CORE, LOAD, OUTPUTS = core_nodes.UNETLoader, "load_unet", 1
    KIND, FOLDER, NAME_INPUT = "diffusion_model", "diffusion_models", "unet_name"

    @classmethod
    def validate_inputs(cls, unet_name: str | None = None) -> bool | str:
        return cls.refusal({"unet_name": unet_name}) or True


class TieredCheckpointLoader(_TieredLoader):
    """CheckpointLoaderSimple whose model, CLIP and VAE are kept by the tier manager."""
    NODE_ID, DISPLAY_NAME = "TieredCheckpointLoader", "Tiered Checkpoint Loader"
    CORE, LOAD, OUTPUTS = core_nodes.CheckpointLoaderSimple, "load_checkpoint", 3
    KIND, FOLDER, NAME_INPUT = "checkpoint", "checkpoints", "ckpt_name"

    @classmethod
    def validate_inputs(cls, ckpt_name: str | None = None) -> bool | str:
        return cls.refusal({"ckpt_name": ckpt_name}) or True


class TieredCLIPLoader(_TieredLoader):
    """CLIPLoader whose text encoder is kept by the tier manager."""
    NODE_ID, DISPLAY_NAME = "TieredCLIPLoader", "Tiered CLIP Loader"
    CORE, LOAD, OUTPUTS = core_nodes.CLIPLoader, "load_clip", 1
    KIND, FOLDER, NAME_INPUT = "clip", "text_encoders", "clip_name"

    @classmethod
    def validate_inputs(cls, clip_name: str | None = None) -> bool | str:
        return cls.refusal({"clip_name": clip_name}) or True


class TieredVAELoader(_TieredLoader):
    """VAELoader whose VAE is kept by the tier manager."""
    NODE_ID, DISPLAY_NAME = "TieredVAELoader", "Tiered VAE Loader"
    CORE, LOAD, OUTPUTS = core_nodes.VAELoader, "load_vae", 1
    KIND, FOLDER, NAME_INPUT = "vae", "vae", "vae_name"

    @classmethod
    def validate_inputs(cls, vae_name: str | None = None) -> bool | str:
        return cls.refusal({"vae_name": vae_name}) or True


LOADERS: dict[str, type[_TieredLoader]] = {
    loader.NODE_ID: loader
    for loader in (TieredUNETLoader, TieredCheckpointLoader, TieredCLIPLoader, TieredVAELoader)}


def hold_graph(prompt_id: str, graph: dict) -> None:
    """Hold every known model the graph's Tiered loaders name with constant inputs.

    A model that cannot be held now (its reload is refused) is logged and skipped: its drop
    changed the loader's `fingerprint_inputs`, so the loader runs and fails the prompt with the
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
            log.warning("[tiered offload] prompt %s cannot hold '%s' at its start, its loader "
                        "will report it: %s", prompt_id, name, e)
