"""Warming models up ahead of use, and which preloads are still pending, so a first use can wait
for one instead of reading the same file from disk a second time.

A preload's failure is logged with the model's name and never raised: the model stays where it
was and loads on first use.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Preloads:
    """Runs preloads and counts the pending ones per model id (a model may be named by more than
    one preload)."""

    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()
        self._done = threading.Condition()

    def start(self, models: list[tuple[str, str]], load: Callable[[str], None], *,
              background: bool) -> threading.Thread | None:
        """Call ``load(key)`` for each (key, name) of ``models``, in order, in a daemon thread
        (returned, so callers may join it) or, without ``background``, before returning."""
        with self._done:
            self._pending.update(key for key, _name in models)
        if not background:
            self._run(models, load)
            return None
        thread = threading.Thread(target=self._run, args=(models, load), name="tier-preload",
                                  daemon=True)
        thread.start()
        return thread

    def wait(self, key: str, timeout: float | None = None) -> bool:
        """Block until no preload of ``key`` is pending; False if ``timeout`` ran out first."""
        with self._done:
            return self._done.wait_for(lambda: self._pending[key] == 0, timeout)

    def _run(self, models: list[tuple[str, str]], load: Callable[[str], None]) -> None:
        for key, name in models:
            try:
                load(key)
            except Exception:
                logger.exception("[tiered offload] preload of '%s' (%s) failed; it loads on first use instead",
                                 name, key)
            finally:
                self._finish(key)

    def _finish(self, key: str) -> None:
        """One preload of ``key`` is over, however it ended."""
        with self._done:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]
            self._done.notify_all()
