"""Which models a background preload has yet to warm up, so a first use can wait for it instead of
reading the same file from disk a second time."""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class Preloads:
    """Pending preloads per model id, counted: a model may be named by more than one preload."""

    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()
        self._done = threading.Condition()

    def add(self, keys: Iterable[str]) -> None:
        with self._done:
            self._pending.update(keys)

    def finish(self, key: str) -> None:
        """One preload of ``key`` is over, however it ended."""
        with self._done:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]
            self._done.notify_all()

    def wait(self, key: str, timeout: float | None = None) -> bool:
        """Block until no preload of ``key`` is pending; False if ``timeout`` ran out first."""
        with self._done:
            return self._done.wait_for(lambda: self._pending[key] == 0, timeout)
