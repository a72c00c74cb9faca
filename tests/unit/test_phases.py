"""Phase discovery: the family tables, discovery from a block's children, and stream units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.blocks.phases import FAMILIES, find_phases, own_refs, stream_units, unit_refs


def test_family_tables_never_nest_one_member_inside_another():
    """A member inside another member would put its tensors in two phases (then both stay resident)."""
    for family in FAMILIES:
        paths = [p for _, members in family.phases for p in members]
        assert len(paths) == len(set(paths)), family.name
        for a in paths:
            assert not any(b != a and b.startswith(a + ".") for b in paths), (family.name, a)
        assert all(any(p == r or p.startswith(r + ".") for p in paths) for r in family.requires), family.name


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) + self.k(x) * self.v(x))


class WanLike(nn.Module):
    """Wan's layout: the table applies; `modulation` is the block's own tensor."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.self_attn = Attn(d)
        self.norm3 = nn.LayerNorm(d)
        self.cross_attn = Attn(d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.modulation = nn.Parameter(torch.randn(1, 3, d))

    def forward(self, x):
        m = self.modulation.sum(1)
        x = x + self.self_attn(self.norm1(x) + m)
        x = x + self.cross_attn(self.norm3(x))
        return x + self.ffn(self.norm2(x)) * m


def test_wan_layout_uses_its_table_and_keeps_own_tensors_out():
    block = WanLike()
    plan = find_phases(block)
    assert plan.family.startswith("Wan")
    assert [p.name for p in plan.phases] == ["self-attention", "cross-attention", "ffn"]
    assert [p.paths for p in plan.phases] == [("self_attn",), ("norm3", "cross_attn"), ("ffn",)]
    units = stream_units([block, WanLike()], "phase")
    assert [(u.block, u.name) for u in units] == [(b, n) for b in range(2)
                                                  for n in ("self-attention", "cross-attention", "ffn")]
    own = own_refs(block, 0, units[:3])
    assert [r.path for r, _ in own] == ["modulation"]
    names = [r.path for r, _ in unit_refs(units[1])]
    assert names == ["norm3.weight", "norm3.bias", "cross_attn.q.weight", "cross_attn.q.bias",
                     "cross_attn.k.weight", "cross_attn.k.bias", "cross_attn.v.weight", "cross_attn.v.bias",
                     "cross_attn.o.weight", "cross_attn.o.bias"]
    assert all(r.block == 0 for r, _ in unit_refs(units[1]))


class Generic(nn.Module):
    """No table matches: a small norm before a big layer, a ModuleList, a small tail."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(d)
        self.big = nn.Linear(d, d)
        self.stack = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.unused_act = nn.GELU()
        self.tail = nn.LayerNorm(d)

    def forward(self, x):
        x = self.big(self.pre(x))
        for layer in self.stack:
            x = layer(x)
        return self.tail(self.unused_act(x))


def test_generic_discovery_groups_small_children_and_splits_module_lists():
    plan = find_phases(Generic())
    assert plan.family == "generic (direct children)"
    assert [p.paths for p in plan.phases] == [("pre", "big"), ("stack.0",), ("stack.1", "tail")]
    assert [p.name for p in plan.phases] == ["big", "stack.0", "stack.1"]


def test_generic_discovery_looks_into_a_lone_child_and_falls_back_to_one_phase():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Generic()

    plan = find_phases(Wrapper())
    assert [p.paths for p in plan.phases] == [("inner.pre", "inner.big"), ("inner.stack.0",),
                                             ("inner.stack.1", "inner.tail")]
    single = find_phases(nn.Linear(8, 8))
    assert single.family == "generic (one phase)" and [p.paths for p in single.phases] == [("",)]


def test_stream_units_by_block_and_bad_granularity():
    blocks = [WanLike(), Generic()]
    units = stream_units(blocks, "block")
    assert [(u.block, u.name, u.roots[0][0]) for u in units] == [(0, "block", ""), (1, "block", "")]
    with pytest.raises(ValueError, match="granularity must be one of block, phase"):
        stream_units(blocks, "layer")
