"""A sampling run's length in steps and the end of each, read from the arguments of core's
OUTER_SAMPLE (``CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, denoise_mask,
callback, ...)``): its sigmas (steps + 1 of them) and the callback core calls after every step.

Why: auto may plan a faster setting part-way through a run, and changing the setting costs a new
device schedule. A run of 4 or 8 steps (a distilled model) may end before the change repays
itself; knowing how many calls the run has left, the engine then keeps the setting for this run
and starts the next one with it. Read on the host from what core already passes: no device
sync, and nothing when the arguments are not core's (the engine then assumes a long run)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SIGMAS, CALLBACK = 3, 5  # their places among outer_sample's positional arguments


def steps_of(args: tuple, kwargs: dict) -> int | None:
    """The run's steps: one fewer than its sigmas (None where they cannot be read)."""
    sigmas = kwargs.get("sigmas", args[SIGMAS] if len(args) > SIGMAS else None)
    try:
        steps = int(sigmas.shape[-1]) - 1
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    return steps if steps > 0 else None


def with_step_ends(args: tuple, kwargs: dict, step_done: Callable[[], None]) -> tuple[tuple, dict]:
    """The arguments with core's step callback wrapped so that ``step_done()`` runs after every
    step, before core's own callback (the preview, the progress bar), which is kept as it was."""
    if "callback" in kwargs:
        callback = kwargs["callback"]
    elif len(args) > CALLBACK:
        callback = args[CALLBACK]
    else:
        return args, kwargs  # not core's signature: nothing to count with

    def stepped(*a: Any, **k: Any) -> Any:
        try:
            step_done()
        except Exception:  # counting steps is advice: never the sampler's failure
            log.exception("[tiered offload] Apply Layerwise Offload: a step's end could not be counted")
        return callback(*a, **k) if callback is not None else None

    if "callback" in kwargs:
        return args, {**kwargs, "callback": stepped}
    return (*args[:CALLBACK], stepped, *args[CALLBACK + 1:]), kwargs
