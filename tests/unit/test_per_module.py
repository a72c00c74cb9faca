"""The per-module registry the ComfyUI adapters keep their engine objects in."""
import gc

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
