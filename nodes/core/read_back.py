"""Blocks that Apply Layerwise Offload streams from the model's own file hold no bytes between
runs (offload_core/host/released.py): before anything else reads a model's weights (core's load,
Model-Level Swap's master), they are read back from the file into fresh RAM.

The file's identity is checked before and after: a file that changed fails that prompt, naming
the file, before a byte of it is used.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ...offload_core.disk.in_place import ModelFileChanged
from ...offload_core.disk.sources import read_back_module, read_back_tensor
from .state import LAYERWISE


def read_back_for(models: Iterable[Any] | None) -> None:
    """Give the released tensors of ``models`` (ModelPatchers) and of their patches their bytes
    (a merge's patches are another model's weights)."""
    try:
        for patcher in models or ():
            diffusion_model = getattr(getattr(patcher, "model", None), "diffusion_model", None)
            if isinstance(diffusion_model, torch.nn.Module):
                session = LAYERWISE.sessions.get(diffusion_model)
                # While the engine runs the model, core's load sees its blocks empty, as it should.
                if session is None or not session.begun:
                    if session is not None:
                        session.read_back()
                    read_back_module(diffusion_model)  # left by an earlier engine of the model
            read_back_patches(getattr(patcher, "patches", None))
    except ModelFileChanged as e:
        raise RuntimeError(f"Apply Layerwise Offload: {e}") from None


def read_back_patches(patches: Any) -> None:
    """Give the released tensors a patcher's weight patches hold (another model's weights, for a
    merge) their bytes."""
    try:
        for value in (patches or {}).values():
            _each_tensor(value, read_back_tensor)
    except ModelFileChanged as e:
        raise RuntimeError(f"Apply Layerwise Offload: {e}") from None


def _each_tensor(value: Any, fn: Callable[[torch.Tensor], None]) -> None:
    if isinstance(value, torch.Tensor):
        fn(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _each_tensor(item, fn)
    elif isinstance(value, dict):
        for item in value.values():
            _each_tensor(item, fn)
