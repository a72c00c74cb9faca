"""Core's own loads of a model whose streamed blocks the engine reads from the model's own file.

Between runs those blocks' tensors hold no bytes (offload_core/host/released.py): nothing of them
is in RAM, and nothing maps the user's file, so no change of that file can reach a model between
runs. Core runs a model only after `comfy.model_management.load_models_gpu` (its samplers, a
checkpoint save, a model merge or a LoRA extraction), so that function is wrapped once, and
before it runs, the blocks of every model it is given, and every weight those models' patches
point at (a merge takes another model's weights), are read back from the file into fresh RAM:
the file's identity is checked before and after, and a file that changed fails that prompt,
naming the file, before core reads a byte. Core then holds them as its own full load would.

Feature-detected: where the function is missing the wrapper is not installed, and the disk tier
is never told the model's file, so streamed blocks go to a spill file instead.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

import comfy.model_management

from ...offload_core.disk.in_place import ModelFileChanged
from ...offload_core.disk.sources import read_back_module, read_back_tensor
from ..core.state import LAYERWISE

log = logging.getLogger(__name__)

_ATTR = "_tiered_offload_reads_back"


def installed() -> bool:
    """Whether core's loads read released blocks back first (see the module docstring)."""
    return getattr(getattr(comfy.model_management, "load_models_gpu", None), _ATTR, False)


def install() -> bool:
    """Wrap `load_models_gpu` once (over whatever wraps it already); False where it is missing."""
    original = getattr(comfy.model_management, "load_models_gpu", None)
    if not callable(original):
        log.warning("tiered offload: comfy.model_management.load_models_gpu is missing; disk streaming "
                    "writes every streamed block to a spill file")
        return False
    if getattr(original, _ATTR, False):
        return True

    @functools.wraps(original)
    def load_models_gpu(models, *args: Any, **kwargs: Any):
        read_back_for(models)
        return original(models, *args, **kwargs)

    setattr(load_models_gpu, _ATTR, True)
    comfy.model_management.load_models_gpu = load_models_gpu
    return True


def read_back_for(models) -> None:
    """Give the released tensors of ``models`` (ModelPatchers) and of their patches their bytes."""
    try:
        for patcher in models or ():
            diffusion_model = getattr(getattr(patcher, "model", None), "diffusion_model", None)
            if isinstance(diffusion_model, torch.nn.Module):
                session = LAYERWISE.sessions.get(diffusion_model)
                if session is not None:
                    if session.begun:
                        continue  # the engine runs it: core's load sees the blocks empty, as it should
                    session.read_back()
                read_back_module(diffusion_model)  # left by an earlier engine of the model
            _read_back_patches(getattr(patcher, "patches", None))
    except ModelFileChanged as e:
        raise RuntimeError(f"Apply Layerwise Offload: {e}") from None


def _read_back_patches(patches: Any) -> None:
    for value in (patches or {}).values():
        _each_tensor(value, read_back_tensor)


def _each_tensor(value: Any, fn: Callable[[torch.Tensor], None]) -> None:
    if isinstance(value, torch.Tensor):
        fn(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _each_tensor(item, fn)
    elif isinstance(value, dict):
        for item in value.values():
            _each_tensor(item, fn)
