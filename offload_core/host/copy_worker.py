"""One worker thread that issues copies in the order they were queued, and the ticket a caller
waits on for each.

Why one: copies whose source is not ready for an asynchronous copy (pageable memory staged through
a pinned bounce buffer; a unit read from disk into the RAM cache) must be issued off the sampling
thread, in order, each followed by whatever rewrites its slot (a LoRA merge). Staging and the disk
cache's ring both need exactly that; their jobs differ, the worker does not.

Each job carries the queuer's host clock and the worker catches up with it before it runs
(``ordering.host_caught_up``), and the ticket carries the worker's clock back to whoever waits on
it: the timed stream model's host clocks then follow the hand-over, as a real host's time does.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from ..ordering import host_caught_up, host_clock


class Ticket:
    """The host-side state of one queued copy: done once all of its device work is issued."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self._at = 0.0  # when the job was done, on the host clock

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the job's work is issued; re-raise what the job raised."""
        self._done.wait()
        host_caught_up(self._at)
        if self.error is not None:
            raise RuntimeError(f"a staged copy failed: {self.error}") from self.error

    def finish(self, error: BaseException | None = None) -> None:
        """The worker is done with the job (``error``: what it raised)."""
        self.error = error
        self._at = host_clock()
        self._done.set()


class CopyWorker:
    """Runs ``job(*args)`` for each ``submit(*args)``, one after another on its own thread
    (``name``), and finishes each one's ticket with what it raised, if anything."""

    def __init__(self, name: str, job: Callable[..., None]) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The job (a bound method of the worker's owner) is held by the thread alone, which lets
        # go of it when it ends: held here too, owner and worker would form a cycle, and the
        # owner's buffers (maps of a spill file, pinned memory) would wait for the garbage
        # collector after close instead of going at once.
        self._thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=True)
        self._thread.start()

    def submit(self, *args: Any) -> Ticket:
        ticket = Ticket()
        self._jobs.put((ticket, host_clock(), args))
        return ticket

    def close(self) -> None:
        """Let queued jobs finish, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self, job: Callable[..., None]) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            ticket, queued, args = item
            host_caught_up(queued)
            try:
                job(*args)
            except BaseException as e:  # reported to the thread that waits for this copy
                ticket.finish(e)
            else:
                ticket.finish()
