"""The copy worker (host/copy_worker.py) runs its owner's jobs in order and, once closed, keeps
nothing of its owner: the owner (a stager, a disk cache's ring) goes with its last reference, not
at the garbage collector's next pass, since what it holds (maps of a spill file, each with a
descriptor of its own; pinned memory) must be given back when the engine that used it is."""
from __future__ import annotations

import gc
import weakref

import pytest

from offload_core.host.copy_worker import CopyWorker


class Owner:
    """What owns a worker: its job is a method of its own."""

    def __init__(self) -> None:
        self.done: list[int] = []
        self.worker = CopyWorker("test-copy-worker", self.copy)

    def copy(self, i: int) -> None:
        if i < 0:
            raise ValueError("refused")
        self.done.append(i)


def test_jobs_run_in_order_and_a_failure_reaches_its_waiter():
    owner = Owner()
    try:
        tickets = [owner.worker.submit(i) for i in range(5)]
        failed = owner.worker.submit(-1)
        for t in tickets:
            t.wait()
        with pytest.raises(RuntimeError, match="refused"):
            failed.wait()
        assert owner.done == [0, 1, 2, 3, 4]
    finally:
        owner.worker.close()


def test_a_closed_workers_owner_goes_with_its_last_reference():
    gc.disable()
    try:
        owner = Owner()
        owner.worker.submit(1).wait()
        owner.worker.close()
        gone = weakref.ref(owner)
        del owner
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()
