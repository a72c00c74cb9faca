"""The tier manager's models as ComfyUI objects: registering a loader's file, finding the id of a
loader output (or a clone of one), and recording where core holds each model.

A model is identified by its file, the file's version and the loader's options (`model_id`); a
newer version of a file (`file_version`: another inode, size or time stamp) supersedes the old
entry, which is then forgotten.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import folder_paths

from ...offload_core.files.file_identity import file_version, model_id, source_key
from ..core import state
from .backend import ComfyModelBackend, Source, patchers_of


def backends() -> list[tuple[str, ComfyModelBackend]]:
    """(id, backend) of every model the Tiered loaders registered."""
    found = []
    for entry in state.MANAGER.snapshot()["models"]:
        backend = state.MANAGER.get(entry["id"]).backend
        if isinstance(backend, ComfyModelBackend):
            found.append((entry["id"], backend))
    return found


def sync_tiers(*, wait: bool = True) -> None:
    """Record where core really holds each model; core also loads and unloads on its own.

    With `wait=False` (status requests) a model the manager is busy with is left as published.
    """
    for key, backend in backends():
        state.MANAGER.observe(key, backend.current_tier(), wait=wait)


def release_prompt(prompt_id: str | None) -> None:
    """A prompt ended: release the models it held, then record where core left each model."""
    state.PROMPT_HOLDS.release_prompt(prompt_id)
    sync_tiers()


def source_of(kind: str, folder: str, name: str, options: dict[str, Any]) -> Source:
    """The file a loader's inputs name in its model folder, with its manager id and version."""
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
    source = source_of(kind, folder, name, options)
    state.MANAGER.register(source.key, name, ComfyModelBackend(load, source), kind=kind,
                           source=source.source)
    return source.key


def key_of(obj) -> str | None:
    """The manager id of a loader output (MODEL, CLIP or VAE, or a clone of one)."""
    modules = {p.model for p in patchers_of((obj,))}
    for key, backend in backends():
        if backend.outputs is not None and modules & {p.model for p in patchers_of(backend.outputs)}:
            return key
    return None


def diffusion_module_ids() -> dict[str, int]:
    """Manager id → id() of the diffusion nn.Module it holds, to join layerwise reports."""
    out = {}
    for key, backend in backends():
        if backend.outputs is not None:
            for patcher in patchers_of(backend.outputs):
                diffusion_model = getattr(patcher.model, "diffusion_model", None)
                if diffusion_model is not None:
                    out[key] = id(diffusion_model)
    return out
