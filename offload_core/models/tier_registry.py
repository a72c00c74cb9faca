"""The models the tier manager knows, behind its one lock, and what it tells the world of them.

Every tier change runs under one re-entrant lock, with the backend called while holding it, so
loads and evictions never interleave and a request that arrives during a load simply waits. When
the outermost hold ends, the entries are published for status requests, the lock is released and
only then are the queued events delivered (tier_events.py), so a listener may call back into the
manager.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..units import size_text
from .tier_entries import Entry
from .tier_errors import UnknownModelError

TIER_WORDS = {"vram": "in VRAM", "ram": "in RAM", "disk": "on disk"}  # a tier, as the logs say it
from .tier_events import TierEvents

logger = logging.getLogger(__name__)


class TierRegistry:
    """The entries by id, their order of use, the lock that guards them and the events about them.

    ``add``, ``remove``, ``touch``, ``entries``, ``with_source``, ``publish`` and ``events`` are
    used with the lock held (``locked``); ``get``, ``published`` and the listener calls are not.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._entries: dict[str, Entry] = {}
        self._use_seq = 0
        self.events = TierEvents()

    @contextmanager
    def locked(self, *, wait: bool = True) -> Iterator[bool]:
        """Hold the lock and yield True; on leaving the outermost level publish the state, release
        the lock, then notify. With ``wait=False`` yield False at once if another thread holds it."""
        if not self._lock.acquire(blocking=wait):
            yield False
            return
        events: list[dict[str, Any]] = []
        try:
            self._depth += 1
            try:
                yield True
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.publish()
                    events = self.events.take()
        finally:
            self._lock.release()
            self.events.deliver(events)

    def get(self, key: str) -> Entry:
        """The entry for ``key``; read-only use, fields change under the lock."""
        entry = self._entries.get(key)
        if entry is None:
            raise UnknownModelError(f"unknown model id {key!r}")
        return entry

    def known(self, key: str) -> Entry | None:
        """The entry for ``key``, or None."""
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        """Every entry, in the order they were registered."""
        return list(self._entries.values())

    def with_source(self, source: str | None) -> list[Entry]:
        """The entries registered with ``source`` (none for None): versions of one file."""
        return [e for e in self._entries.values() if source is not None and e.source == source]

    def add(self, entry: Entry) -> None:
        """Track a new entry as just used, and announce it."""
        self._entries[entry.id] = entry
        self.touch(entry)
        self.events.announce("register", entry, reason="register")
        logger.info("[tiered offload] tier manager: now manages %s '%s' (%s), %s, %s", entry.kind, entry.name, entry.id,
                    size_text(entry.total_bytes), TIER_WORDS.get(entry.tier.value, entry.tier.value))

    def remove(self, entry: Entry, reason: str) -> None:
        """Stop tracking an entry whose memory is released already, and announce it."""
        del self._entries[entry.id]
        self.events.announce("forget", entry, reason=reason)
        logger.info("[tiered offload] forgot %s '%s' (%s) (%s)", entry.kind, entry.name, entry.id, reason)

    def clear(self) -> None:
        """Stop tracking every entry (their memory released already) and every listener."""
        self._entries.clear()
        self.events.forget_listeners()

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` the most recently used."""
        self._use_seq += 1
        entry.use_order = self._use_seq
        entry.last_used = time.time()

    def publish(self) -> None:
        """Copy the entries for status requests (also while a move is under way)."""
        self.events.publish(self._entries.values())

    def published(self) -> list[dict[str, Any]]:
        """The entries as last published, the caller's to change; never waits for the lock."""
        return self.events.published()

    def subscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            self.events.subscribe(fn)

    def unsubscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            self.events.unsubscribe(fn)
