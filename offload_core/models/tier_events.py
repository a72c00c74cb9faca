"""What the tier manager tells the world: events for its listeners and the state a status reads.

Events are queued while the manager's lock is held and delivered once it is released, so a
listener may call back into the manager. The published state is a copy made when a move starts
and when each change ends: a status request reads it without waiting for a load, and can see
which model is moving.
"""
from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from .tier_entries import Entry

logger = logging.getLogger(__name__)


class TierEvents:
    """The manager's listeners, its queue of undelivered events and its published entries.

    ``subscribe``, ``unsubscribe``, ``announce``, ``publish`` and ``take`` are called with the
    manager's lock held; ``deliver`` after it is released.
    """

    def __init__(self) -> None:
        self._seq = 0
        self._pending: list[dict[str, Any]] = []
        self._listeners: tuple[Callable[[dict[str, Any]], None], ...] = ()
        self._published: tuple[dict[str, Any], ...] = ()

    def subscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._listeners = (*self._listeners, fn)

    def unsubscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._listeners = tuple(f for f in self._listeners if f != fn)

    def forget_listeners(self) -> None:
        self._listeners = ()

    def announce(self, kind: str, entry: Entry | None, *, reason: str, **fields: Any) -> None:
        """Queue an event, numbered in the order the changes happened."""
        self._seq += 1
        event = {"type": kind, "seq": self._seq, "time": time.time(), "reason": reason}
        if entry is not None:
            event.update(id=entry.id, name=entry.name, kind=entry.kind)
        event.update(fields)
        self._pending.append(event)

    def take(self) -> list[dict[str, Any]]:
        """The events queued so far, to be delivered once the lock is released."""
        events, self._pending = self._pending, []
        return events

    def deliver(self, events: list[dict[str, Any]]) -> None:
        """Hand each event to every listener, in order; a listener that raises is logged and skipped."""
        for event in events:
            for fn in self._listeners:
                try:
                    fn(dict(event))
                except Exception:
                    logger.exception("[tiered offload] tier listener %r failed on event %d", fn, event["seq"])

    def publish(self, entries: Iterable[Entry]) -> None:
        """Take a copy of the entries for status requests."""
        self._published = tuple(e.to_dict() for e in entries)

    def published(self) -> list[dict[str, Any]]:
        """A deep copy of the last published entries, the caller's to change."""
        return copy.deepcopy(list(self._published))
