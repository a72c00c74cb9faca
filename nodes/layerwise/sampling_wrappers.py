"""The two wrappers Apply Layerwise Offload puts on a model's sampling runs, on either of its paths
(the engine's streaming, and core's own streaming in the node's order): one around the run's
load (PREPARE_SAMPLING, where the node plans and hands over), one around the whole run
(OUTER_SAMPLE, where it takes stock however the run ended). Installed under the path's key, over
whatever an earlier node of the same key put there, next to other packs' wrappers."""
from __future__ import annotations

from typing import Callable

import comfy.patcher_extension

WRAPPER_TYPES = (comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                 comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING)


def install(patcher, key: str, *, around_load: Callable, around_run: Callable) -> None:
    """Put ``around_load`` and ``around_run`` on ``patcher``'s runs under ``key``."""
    for wrapper_type, fn in ((comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, around_load),
                             (comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, around_run)):
        patcher.remove_wrappers_with_key(wrapper_type, key)
        patcher.add_wrapper_with_key(wrapper_type, key, fn)
