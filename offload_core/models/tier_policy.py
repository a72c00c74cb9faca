"""A model's policy in the tier manager: whether it is pinned (never dropped to disk) and its
eviction priority, as a user or a node sets them, and what a change lets go.

Why apart from the moves and the room: a policy change moves no byte through a backend. It is
checked, recorded on the entry and announced; only an unpin can let a model go, and that is the
room's budget drop, not a move of its own.
"""
from __future__ import annotations

import logging

from .tier_entries import Entry, Policy, check_policy
from .tier_registry import TierRegistry
from .tier_room import TierRoom

logger = logging.getLogger(__name__)


def checked_policy(policy: Policy | None) -> Policy:
    """A new model's own copy of ``policy`` (the default when None), refused when it is not a
    bool and a whole number; the caller's object is never shared between entries."""
    policy = Policy() if policy is None else Policy(policy.pinned, policy.priority)
    check_policy(policy)
    return policy


class TierPolicies:
    """Changes the policy of one registry's entries; every method runs with its lock held, and
    announces and logs only what changed."""

    def __init__(self, registry: TierRegistry, room: TierRoom) -> None:
        self._registry = registry
        self._room = room

    def pin(self, entry: Entry) -> None:
        if not entry.policy.pinned:
            entry.policy.pinned = True
            self._registry.events.announce("policy", entry, reason="pin")
            logger.info("[tiered offload] tier manager: '%s' (%s) is kept in RAM: it is never evicted to disk "
                        "(it may still be parked from VRAM into RAM)", entry.name, entry.id)

    def unpin(self, entry: Entry, *, drop: bool) -> None:
        """Unpin; with ``drop``, idle models over the RAM budget go at once."""
        if entry.policy.pinned:
            entry.policy.pinned = False
            self._registry.events.announce("policy", entry, reason="unpin")
            logger.info("[tiered offload] tier manager: '%s' (%s) is no longer kept in RAM: it may be evicted "
                        "to disk again",
                        entry.name, entry.id)
        if drop:
            self._room.drop_over_budget(0, None, strict=False)

    def set_priority(self, entry: Entry, priority: int) -> None:
        """``priority`` must have passed ``check_policy`` (before the lock was taken)."""
        if entry.policy.priority != priority:
            entry.policy.priority = priority
            self._registry.events.announce("policy", entry, reason="priority")
            logger.info("[tiered offload] priority of '%s' (%s) set to %d", entry.name, entry.id, priority)
