"""The per-module registry the ComfyUI adapters keep their engine objects in."""
import gc
import threading

import pytest
import torch.nn as nn

from offload_core.per_module import PerModule


class Thing:
    def __init__(self, tag):
        self.tag = tag
        self.closed = False

    def close(self):
        self.closed = True


def test_reuse_replace_and_failed_create_leave_no_closed_entry():
    reg = PerModule()
    m = nn.Linear(2, 2)
    first = reg.get_or_create(m, lambda: Thing(1))
    assert reg.get_or_create(m, lambda: Thing(2)) is first
    second = reg.get_or_create(m, lambda: Thing(3), reuse=lambda t: False)
    assert first.closed and not second.closed and reg.get(m) is second

    def fail():
        raise ValueError("bad settings")

    with pytest.raises(ValueError):
        reg.get_or_create(m, fail, reuse=lambda t: False)
    assert second.closed and reg.get(m) is None  # never hands out a closed object
    assert reg.get_or_create(m, lambda: Thing(4)).tag == 4


def test_freed_module_closes_its_object_and_id_reuse_is_safe():
    reg = PerModule()
    m = nn.Linear(2, 2)
    thing = reg.get_or_create(m, lambda: Thing(1))
    del m
    gc.collect()
    assert thing.closed and reg.values() == []
    a = nn.Linear(2, 2)
    kept = reg.get_or_create(a, lambda: Thing(2))
    assert reg.discard(a) is kept and kept.closed and reg.get(a) is None


@pytest.mark.parametrize("call", ["get_or_create", "discard", "values"])
def test_a_module_freed_inside_the_registrys_own_call_is_closed_without_a_deadlock(call):
    """The garbage collector may free a module in the middle of the registry's locked section on
    the same thread (here: while another module's object is created, or a reuse check runs).
    Its callback must not wait for the lock that thread holds (a server hung there, in a prompt
    that built a streamer); its object is closed before the call returns."""
    reg = PerModule()
    gone = nn.Linear(2, 2)
    doomed = reg.get_or_create(gone, lambda: Thing("gone"))
    holder = [gone]
    del gone
    other = nn.Linear(2, 2)
    reg.get_or_create(other, lambda: Thing("other"))
    newcomer = nn.Linear(2, 2)

    def free_the_module():
        holder.clear()  # the last reference: its callback runs right here, under the lock

    def run():
        if call == "get_or_create":
            reg.get_or_create(newcomer, lambda: (free_the_module(), Thing("new"))[1])
        elif call == "discard":
            reg.get_or_create(other, lambda: Thing("unused"), reuse=lambda t: (free_the_module(), True)[1])
            reg.discard(other)
        else:
            reg.get_or_create(other, lambda: Thing("unused"), reuse=lambda t: (free_the_module(), True)[1])
            reg.values()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the registry deadlocked on a module freed inside its own call"
    assert doomed.closed
    assert all(t.tag != "gone" for t in reg.values())


def test_a_module_freed_while_the_lock_is_held_is_closed_by_the_next_call():
    reg = PerModule()
    holder = [nn.Linear(2, 2)]
    thing = reg.get_or_create(holder[0], lambda: Thing(1))
    seen = {}

    def free_under_the_lock():
        with reg._lock:  # a call holds the lock: the callback queues, never waits
            holder.clear()
            seen["closed under the lock"] = thing.closed

    worker = threading.Thread(target=free_under_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the callback waited for the lock its own thread held"
    assert seen == {"closed under the lock": False}
    assert reg.values() == [] and thing.closed
