"""One pinned-memory budget for core and the engine.

Core pins weights of partially loaded models under its own cap
(`comfy.model_management.MAX_PINNED_MEMORY`, counted in `TOTAL_PINNED_MEMORY`; both exist in
0.3.75 and 0.33), and the engine pins its packs under its own. Each ignored the other, so together
they could lock more RAM than the machine has. Here the engine's pinned bytes are added to core's
count, and the engine's cap is what core's cap leaves after core's own pins.

0.3.75 zeroes its count when it unpins its last own tensor, dropping the engine's bytes with it;
the count is repaired at the engine's next report or pin decision, which is as soon as it matters
to the engine. Between the two, core alone may see less than is pinned.
"""
from __future__ import annotations

import logging
import threading

import comfy.model_management as mm

from ...offload_core.host import pinned

log = logging.getLogger(__name__)
GIB = 1024 ** 3
_NAMES = ("TOTAL_PINNED_MEMORY", "MAX_PINNED_MEMORY")


class _CoreCount:
    """The engine's share of core's pinned-memory count."""

    def __init__(self) -> None:
        self._reported = 0  # engine bytes currently included in core's count
        self._lock = threading.Lock()

    def cap(self) -> int | None:
        """Most bytes the engine may hold pinned: core's cap less core's own pins; None if core pins nothing."""
        if mm.MAX_PINNED_MEMORY <= 0:
            return None
        with self._lock:
            self._repair()
            core_own = max(0, mm.TOTAL_PINNED_MEMORY - self._reported)
        return int(mm.MAX_PINNED_MEMORY - core_own)

    def report(self, engine_total: int) -> None:
        """Put the engine's current pinned total into core's count in place of the last one."""
        with self._lock:
            self._repair()
            mm.TOTAL_PINNED_MEMORY = max(0, mm.TOTAL_PINNED_MEMORY + engine_total - self._reported)
            self._reported = engine_total

    def _repair(self) -> None:
        # The count can only be below the engine's share if core reset it (0.3.75 does).
        if mm.TOTAL_PINNED_MEMORY < self._reported:
            mm.TOTAL_PINNED_MEMORY += self._reported


def install() -> bool:
    """Share the pinned budget where this ComfyUI keeps a count; False (engine keeps its own cap) elsewhere.

    Also clear the CUDA error a failed registration leaves the way core does, where core has a
    function for it (0.33's `discard_cuda_async_error`; the engine does the same itself elsewhere).
    """
    discard = getattr(mm, "discard_cuda_async_error", None)
    pinned.set_cuda_error_discard(discard if callable(discard) else None)
    if not all(isinstance(getattr(mm, name, None), (int, float)) for name in _NAMES):
        log.info("[tiered offload] this ComfyUI keeps no pinned-memory count; the engine keeps its own cap")
        return False
    count = _CoreCount()
    pinned.set_pin_accounting(count.cap, count.report)
    if mm.MAX_PINNED_MEMORY > 0:
        log.info("[tiered offload] engine pins share core's pinned-memory cap of %.2f GiB",
                 mm.MAX_PINNED_MEMORY / GIB)
    elif mm.get_torch_device().type == "cpu":
        log.info("[tiered offload] models run on the CPU, so nothing is pinned (pinned RAM only "
                 "speeds up copies to a GPU)")
    else:
        log.info("[tiered offload] ComfyUI pins no memory on this machine (--disable-pinned-memory, "
                 "or a GPU it does not pin for); the engine keeps its own pinned-memory cap")
    return True
