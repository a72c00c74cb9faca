"""The disk cache's rule, as plain functions of numbers: which entry a read may reuse, what is
read ahead, how many entries streaming needs at once. The cache (host_cache.py, tier.py) runs it on
its entries; the pipeline model (layerwise/pipeline.py), which imports no torch, plays it in its
simulation: one rule, so the model predicts the cache it models."""
from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

from ..alignment import PAGE, align_up

NEVER = float("inf")  # the distance of a unit not needed again


def entries_needed(nslots: int, streamed: int) -> int:
    """Cache entries disk streaming needs at once: every slot's copy in flight plus one unit read
    ahead, unless every streamed unit fits."""
    return min(nslots + 1, streamed)


def cache_holds(cap_bytes: int, unit_bytes: Sequence[int], nslots: int) -> bool:
    """Whether a host cache of ``cap_bytes`` holds what streaming ``unit_bytes`` (the streamed
    units' packed sizes) through ``nslots`` slots needs at once."""
    if not unit_bytes:
        return True
    return cap_bytes // align_up(max(unit_bytes), PAGE) >= entries_needed(nslots, len(unit_bytes))


def protected_units(order: Sequence[int], cursor: int, in_flight: int, depth: int) -> set[int]:
    """The units no read evicts: the last ``in_flight`` requested (up to the one at ``cursor``)
    and the ``depth`` read ahead of it."""
    n = len(order)
    return ({order[(cursor - j) % n] for j in range(min(in_flight, n))}
            | {order[(cursor + k) % n] for k in range(1, min(depth, n - 1) + 1)})


def pick_victim(entries: Sequence[Any], need: float, distance: Callable[[int], float],
                protected: Container[int]) -> int | None:
    """The entry to reuse for a unit needed ``need`` units ahead: a free one first, else the one
    whose unit is needed last, if that is later than ``need``; never a ``protected`` unit's, nor
    one leased or being read. ``entries`` have ``unit``, ``leases``, ``reading`` (and ``error``)."""
    best, best_d = None, need
    for k, e in enumerate(entries):
        if e.leases or e.reading or e.unit in protected:
            continue
        d = NEVER if e.unit is None or getattr(e, "error", None) is not None else distance(e.unit)
        if d > best_d:
            best, best_d = k, d
    return best


def read_ahead(order: Sequence[int], cursor: int, depth: int, cached: Container[int],
               victim: Callable[[int], int | None], start: Callable[[int, int, int], None]) -> None:
    """Start reading the ``depth`` units after ``cursor`` that are not ``cached``, each into
    ``victim(k)`` for the unit ``k`` ahead, with priority ``k``; stop at the first without one."""
    n = len(order)
    for k in range(1, min(depth, n - 1) + 1):
        unit = order[(cursor + k) % n]
        if unit in cached:
            continue
        entry = victim(k)
        if entry is None:
            return
        start(entry, unit, k)
