"""Core's own loads of a model whose streamed blocks the engine reads from the model's own file.

Between runs those blocks' tensors hold no bytes (offload_core/host/released.py): nothing of them
is in RAM, and nothing maps the user's file, so no change of that file can reach a model between
runs. Core runs a model only after `comfy.model_management.load_models_gpu` (its samplers, a
checkpoint save, a model merge or a LoRA extraction), so that function is wrapped once, and
before it runs, the blocks of every model it is given, and every weight those models' patches
point at (a merge takes another model's weights), are read back from the file into fresh RAM
(`core/read_back.py`). Core then holds them as its own full load would.

Feature-detected: where the function is missing the wrapper is not installed, and the disk tier
is never told the model's file, so streamed blocks go to a spill file instead.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import comfy.model_management

from ..core.read_back import read_back_for

log = logging.getLogger(__name__)

_ATTR = "_tiered_offload_reads_back"


def installed() -> bool:
    """Whether core's loads read released blocks back first (see the module docstring)."""
    return getattr(getattr(comfy.model_management, "load_models_gpu", None), _ATTR, False)


def install() -> bool:
    """Wrap `load_models_gpu` once (over whatever wraps it already); False where it is missing."""
    original = getattr(comfy.model_management, "load_models_gpu", None)
    if not callable(original):
        log.warning("[tiered offload] comfy.model_management.load_models_gpu is missing; disk streaming "
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
