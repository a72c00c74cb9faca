"""Moving one model between tiers through its backend, and the end of a model: dropped to disk
and forgotten.

A move is one step down or up the ladder (disk, RAM, VRAM). While the backend works, the
published state shows the move, so a status request answered during a long load says what is
loading. A source file that changed since registration is forgotten, not loaded: its id can never
hold the new bytes. Which model moves, and whether there is room, is decided by the callers.
"""
from __future__ import annotations

import logging
import time

from ..units import size_text
from .tier_entries import Entry, Tier
from .tier_errors import SourceChangedError
from .tier_registry import TierRegistry

logger = logging.getLogger(__name__)

# One step down or up the ladder: the backend method that performs it and the log wording.
# The top tier is the compute device's memory: VRAM on a GPU, RAM where models run on the CPU,
# so the words name the device's role, not its memory.
_STEPS = {
    (Tier.DISK, Tier.RAM): ("load_from_disk", "loaded from disk into RAM"),
    (Tier.RAM, Tier.VRAM): ("to_vram", "loaded onto the compute device"),
    (Tier.VRAM, Tier.RAM): ("to_ram", "parked in RAM"),
    (Tier.RAM, Tier.DISK): ("drop", "dropped to disk"),
}
# A tier as the log names it: where the model is, and how it got there when ComfyUI moved it.
WHERE = {Tier.VRAM: "loaded on the compute device", Tier.RAM: "in RAM", Tier.DISK: "on disk only"}
MOVED_BY_CORE = {Tier.VRAM: "loaded onto the compute device", Tier.RAM: "unloaded into RAM",
                 Tier.DISK: "freed (on disk only)"}


class TierMoves:
    """Steps entries of one registry between tiers; every method runs with its lock held."""

    def __init__(self, registry: TierRegistry) -> None:
        self._registry = registry

    def step(self, entry: Entry, to: Tier, reason: str) -> None:
        """Move one tier up or down through the backend, then record and announce it."""
        method, verb = _STEPS[(entry.tier, to)]
        entry.moving = {"from": entry.tier.value, "to": to.value, "reason": reason}
        self._registry.publish()
        start = time.perf_counter()
        try:
            getattr(entry.backend, method)()
        except SourceChangedError:
            self.forget(entry, "superseded")
            raise
        finally:
            entry.moving = None
        seconds = time.perf_counter() - start
        if entry.tier is Tier.DISK:
            entry.loads_from_disk += 1
            entry.total_bytes = int(entry.backend.nbytes())
        self.record(entry, to, reason)
        logger.info("[tiered offload] %s '%s' (%s) %s (%s, %s, %.2fs)", entry.kind, entry.name, entry.id, verb,
                    reason, size_text(entry.total_bytes), seconds)

    def record(self, entry: Entry, to: Tier, reason: str) -> None:
        """Set the tier, re-read the backend's figures and queue the event for listeners."""
        old = entry.tier
        entry.tier = to
        entry.bytes_by_tier = dict(entry.backend.bytes_by_tier())
        self._registry.events.announce("tier", entry, reason=reason, old=old.value, new=to.value)

    def observed(self, entry: Entry, tier: Tier) -> bool:
        """Record ``tier`` where something outside the manager put the model (no backend move):
        the figures re-read, a change of tier announced with reason "observed". Whether it
        changed."""
        if tier is entry.tier:
            entry.bytes_by_tier = dict(entry.backend.bytes_by_tier())
            return False
        old = entry.tier
        self.record(entry, tier, "observed")
        logger.info("[tiered offload] %s '%s' (%s) %s by ComfyUI itself (the manager had it %s)", entry.kind,
                    entry.name, entry.id, MOVED_BY_CORE[tier], WHERE[old])
        return True

    def drop_fully(self, entry: Entry, reason: str) -> None:
        """Down to disk, one tier at a time."""
        if entry.tier is Tier.VRAM:
            self.step(entry, Tier.RAM, reason)
        if entry.tier is Tier.RAM:
            self.step(entry, Tier.DISK, reason)

    def forget(self, entry: Entry, reason: str) -> None:
        """Release the model's memory and stop tracking it."""
        self.drop_fully(entry, reason)
        self._registry.remove(entry, reason)

    def supersede(self, old: Entry, *, by: Entry) -> None:
        """A newer version of ``old``'s file is registered: forget ``old`` once it is idle."""
        if old.id == by.id or old.superseded:
            return
        old.superseded = True
        logger.info("[tiered offload] %s '%s' (%s) is superseded by %s: its file changed", old.kind, old.name,
                    old.id, by.id)
        if old.in_use == 0:
            self.forget(old, "superseded")
