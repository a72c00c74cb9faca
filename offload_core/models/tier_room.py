"""Room for models in RAM and VRAM: the budgets, the idle models that go to make room, and a
model brought up into the room made for it.

A model that is acquired and not yet released is never moved down, and a load that cannot fit
because everything else is in use or pinned is refused with ``TierCapacityError`` before anything
is moved, instead of running the machine out of memory. Which models go is chosen by eviction.py,
against the budgets of tier_budgets.py; the moves are tier_moves.py's.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psutil

from ..units import size_text
from . import eviction
from .tier_budgets import TierBudgets
from .tier_entries import Entry, Tier
from .tier_errors import TierCapacityError
from .tier_moves import TierMoves
from .tier_registry import TierRegistry

logger = logging.getLogger(__name__)


class TierRoom:
    """Keeps the registry's models within the budgets and the free VRAM.

    ``vram_free_fn`` returns the VRAM free for models in bytes, or None for unlimited. Every
    method but ``budgets`` and ``memory`` runs with the registry's lock held.
    """

    def __init__(self, registry: TierRegistry, moves: TierMoves,
                 vram_free_fn: Callable[[], int | None]) -> None:
        self._registry = registry
        self._moves = moves
        self._vram_free_fn = vram_free_fn
        self._budgets = TierBudgets()

    def budgets(self) -> dict[str, Any]:
        """The current memory policy, as ``TierManager.set_budgets`` takes it."""
        return self._budgets.as_dict()

    def set_budgets(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply budget values checked already (``TierBudgets.check``), announce a change and drop
        idle models over the new budget at once; returns the budgets."""
        before = self.budgets()
        self._budgets.apply(**changes)
        budgets = self.budgets()
        if budgets != before:
            self._registry.events.announce("budgets", None, reason="budgets", budgets=dict(budgets))
            logger.info("[tiered offload] tier budgets: %s", budgets)
        self.drop_over_budget(0, None, strict=False)
        return budgets

    def memory(self, used_by_models: int) -> dict[str, Any]:
        """The machine's RAM and VRAM figures for a status, with the RAM budget they give."""
        vm = psutil.virtual_memory()
        return {
            "ram": {"total": vm.total, "available": vm.available,
                    "budget": self._budgets.ram_budget(used_by_models, vm.available),
                    "used_by_models": used_by_models},
            "vram": {"free": self._vram_free_fn()},
        }

    def bring_up(self, entry: Entry, to: Tier, reason: str) -> None:
        """Raise ``entry`` to at least ``to``, making room first, and count the request."""
        start = entry.tier
        if start is Tier.DISK:
            need = int(entry.backend.nbytes())
            self.drop_over_budget(need, entry, strict=True)
            self._moves.step(entry, Tier.RAM, reason)
        if to is Tier.VRAM and entry.tier is Tier.RAM:
            self.make_room_vram(entry.total_bytes, entry)
            self._moves.step(entry, Tier.VRAM, reason)
        if start is Tier.RAM:
            entry.loads_from_ram += 1
        if start is not Tier.DISK:  # a model loaded on the compute device already: no tier named
            logger.info("[tiered offload] %s '%s' (%s) %s, no disk read (%s)", entry.kind, entry.name, entry.id,
                        "served from its RAM copy" if start is Tier.RAM else "already loaded", reason)
        entry.load_count += 1
        self._registry.touch(entry)

    def enforce_ram_budget(self) -> list[str]:
        """Drop idle, unpinned models to disk while models hold more RAM than the budget; what
        stays over budget is logged. Returns the dropped ids."""
        dropped, excess = self.drop_over_budget(0, None, strict=False)
        if excess > 0:
            logger.warning("[tiered offload] models hold %s more RAM than the budget; the rest are in use, "
                           "pinned, or the disk tier is off", size_text(excess))
        return dropped

    def drop_over_budget(self, need: int, exclude: Entry | None, *,
                         strict: bool) -> tuple[list[str], int]:
        """Drop idle unpinned models until ``need`` more bytes fit in the RAM budget.

        Victims go lowest priority first, parked before those in VRAM, then least recently used;
        a VRAM victim is parked and then dropped. With ``strict`` nothing moves unless the plan
        reaches the budget, and the shortfall raises. Returns the dropped ids and the bytes still
        over budget.
        """
        entries = self._registry.entries()
        used = sum(e.ram_bytes() for e in entries)
        budget = self._budgets.ram_budget(used, psutil.virtual_memory().available)
        excess = used + need - budget
        if excess <= 0:
            return [], 0
        disk_tier = self._budgets.disk_tier
        victims, freed = eviction.ram_victims(entries, excess, exclude, disk_tier)
        if strict and freed < excess:
            raise TierCapacityError(eviction.ram_refusal(entries, exclude, need, budget, used,
                                                         disk_tier))
        for victim in victims:
            self._moves.drop_fully(victim, "ram_budget")
        return [v.id for v in victims], max(excess - freed, 0)

    def make_room_vram(self, need: int, exclude: Entry | None) -> list[str]:
        """Park idle VRAM models, lowest priority then least recently used, until ``need`` fits."""
        free = self._vram_free_fn()
        if free is None:
            return []
        reserve = self._budgets.vram_reserve
        excess = need + reserve - free
        if excess <= 0:
            return []
        entries = self._registry.entries()
        victims, freed = eviction.vram_victims(entries, excess, exclude)
        if freed < excess:
            raise TierCapacityError(eviction.vram_refusal(entries, exclude, need, reserve, free,
                                                          freed))
        for victim in victims:
            self._moves.step(victim, Tier.RAM, "vram_pressure")
        return [v.id for v in victims]
