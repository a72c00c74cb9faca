"""Callbacks run right before a module is moved to the host with its own `.to()`.

Core moves a whole model off the device with the root module's `.to()` (`unpatch_model`, on
every unload, after it has put its base weights back), and under memory pressure moves modules
one by one (`partially_unload`, each module's `.to()`). The pack's host copies of a model's
weights (Model-Level Swap's master, Apply Layerwise Offload's kept pack) re-point the module's
tensors at themselves first, so `.to()` finds them on the host and copies nothing back, and the
host copy stays the module's memory. Both may watch one module, so its `.to()` is wrapped once
and runs every callback registered for it, with the module being moved.

The wrapper lives in the module's own `__dict__` and holds the module and the callbacks weakly:
it keeps neither a model nor an owner alive.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

_CALLBACKS = "_tiered_offload_host_moves"


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    try:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError, AttributeError):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
    return None if device is None else torch.device(device)


def watch(module: torch.nn.Module, key: str, callback: Callable[[torch.nn.Module], Any]) -> None:
    """Call ``callback(module)`` before every ``module.to(<cpu>)``; replaces an earlier one under
    ``key``.

    The callback is held weakly (a bound method through its owner), so its owner must be kept
    alive elsewhere; a failing callback is logged and the move goes on.
    """
    callbacks = module.__dict__.get(_CALLBACKS)
    if callbacks is None:
        callbacks = module.__dict__[_CALLBACKS] = {}
        module_ref = weakref.ref(module)

        def guarded_to(*args: Any, **kwargs: Any):
            target = module_ref()
            device = _target_device(args, kwargs)
            if device is not None and device.type == "cpu":
                for name, ref in list(target.__dict__.get(_CALLBACKS, {}).items()):
                    fn = ref()
                    if fn is None:
                        continue
                    try:
                        fn(target)
                    except Exception:
                        log.exception("[tiered offload] %s failed before a move to the host", name)
            # Tensors a callback put back on the host are there already; this moves the rest.
            return type(target).to(target, *args, **kwargs)

        module.to = guarded_to
    callbacks[key] = weakref.WeakMethod(callback) if inspect.ismethod(callback) else weakref.ref(callback)


def unwatch(module: torch.nn.Module, key: str) -> None:
    """Forget ``key``'s callback; the module's own `.to()` is back once none is left."""
    callbacks = module.__dict__.get(_CALLBACKS)
    if callbacks is None:
        return
    callbacks.pop(key, None)
    if not callbacks:
        module.__dict__.pop(_CALLBACKS, None)
        module.__dict__.pop("to", None)
