"""torch.compile (inductor, its default mode) over streamed blocks, on the CPU.

The engine's hooks run outside any compiled graph, so each streamed block's forward is a graph of
its own whose weights are graph inputs, read from whichever slot the hook bound. These tests show
what that promises: a compile of each block gives the same bits with the engine as without it; a
compile of the whole model or at phase granularity is split where the engine's hooks are, and
gives the bits of the same compiled model split there by hooks that do nothing (inductor's results
depend on the split, which is why Apply Layerwise Offload refuses those two over streamed blocks:
nodes/layerwise/compiled_models.py); every pass after the first reuses the graphs (no new graph or
graph break: dynamo's own counters), the only graph breaks the engine adds are its hooks, and a
unit's views look the same to dynamo's guards in every slot. Compiling on a CPU is slow: one small
fp32 model, a handful of compiles, each reused across the cases of its test.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_core import LayerwiseStreamer
from offload_core.disk.tier import DiskOptions

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters

DEPTH = 5
PAGE = 4096  # the spill file's unit of reads
# The only graph breaks the engine may add: dynamo meets its hooks (device/hooks.py), and a break
# met inside the model's block loop makes dynamo run that loop's frame eagerly.
ENGINE_BREAKS = ("offload_enter", "offload_exit", "graph break in loop")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.RMSNorm(dim // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(self.norm_q(q), k, v)
        return self.out(a.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """A DiT block in miniature: modulation of its own, attention, an MLP, norms between."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) * 0.1)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation + cond).chunk(2, dim=1)
        x = x + self.attn(self.norm1(x) * (1 + scale) + shift)
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, depth: int = DEPTH, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, dim)
        self.cond = nn.Linear(4, 2 * dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, c = self.embed(x), self.cond(t).unsqueeze(1).view(x.shape[0], 2, -1)
        for block in self.blocks:
            h = block(h, c)
        return self.head(h)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(2, 16, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(n)]


def split_like_the_engine(model: Net, granularity: str) -> list:
    """Hooks that do nothing, outside any graph, where the engine hooks a streamed model: the
    same compiled model split the same way, without the engine. Returns their handles."""
    from offload_core.blocks.phases import hooked_modules, stream_units
    noop = torch.compiler.disable(lambda module, args, kwargs: None)
    return [m.register_forward_pre_hook(noop, with_kwargs=True, prepend=True)
            for unit in stream_units(list(model.blocks), granularity) for m in hooked_modules(unit)]


def compiled(model: Net, setup: str):
    """The model as a setup compiles it: the whole model, or each block wrapped in its own
    compiled module in the block list (the way per-block compile nodes put it in)."""
    if setup == "whole model":
        return torch.compile(model)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
    return model


def counts() -> dict[str, int]:
    """What dynamo has compiled so far: graphs (a recompile is one more) and graph breaks met."""
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["unimplemented"].values())}


def passes(run, inputs) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
    """Each pass's output and dynamo's counts after it."""
    outs, seen = [], []
    with torch.no_grad():
        for x, t in inputs:
            outs.append(run(x, t))
            seen.append(counts())
    return outs, seen


def record_slots(st: LayerwiseStreamer, blocks: list[nn.Module]) -> tuple[dict[int, set[int]], list]:
    """Which slots held each streamed block's weights when it ran (seen by a hook after the
    engine's, outside any graph), and the hooks' handles."""
    seen: dict[int, set[int]] = {i: set() for i in st.streamed_indices}
    buffers = st._schedule._window.ring.buffers

    def recorder(i: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            ptr = next(module.parameters()).data_ptr()
            seen[i].update(s for s, b in enumerate(buffers) if b.data_ptr() <= ptr < b.data_ptr() + b.numel())
        return torch.compiler.disable(record)

    return seen, [blocks[i].register_forward_pre_hook(recorder(i), with_kwargs=True) for i in seen]


def fresh_dynamo() -> None:
    dynamo.reset()
    counters.clear()


def block_cache_entries() -> int:
    """Graphs dynamo holds for the blocks' forward (shared by every block: one code object)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(Block.forward.__code__))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    fresh_dynamo()
    yield
    fresh_dynamo()


def streamer(blocks: list[nn.Module], spill_dir=None) -> LayerwiseStreamer:
    """Two resident blocks and three streamed through two slots, so a block lands in the other
    slot on the next pass; with ``spill_dir``, every block streamed from the spill file through a
    cache that holds three units at most (five blocks, two slots)."""
    if spill_dir is None:
        return LayerwiseStreamer(blocks, "cpu", resident=2, prefetch=1)
    probe = LayerwiseStreamer(blocks, "cpu", resident=0, prefetch=1)
    unit = -(-max(probe._plan.packs[i].nbytes for i in probe.streamed_indices) // PAGE) * PAGE
    return LayerwiseStreamer(blocks, "cpu", resident=0, prefetch=1,
                             disk=DiskOptions(cap_bytes=3 * unit, spill_dir=str(spill_dir)))


@pytest.mark.parametrize("setup", ["per-block modules", "whole model"])
def test_streamed_blocks_run_compiled_bit_identical_with_no_recompile_after_the_first_pass(setup, tmp_path):
    inputs = batches(3)
    model = Net()
    run = compiled(model, setup)
    split = split_like_the_engine(model, "block") if setup == "whole model" else []
    reference, ref_counts = passes(run, inputs)
    assert ref_counts[0]["graphs"] >= 1 and ref_counts[-1] == ref_counts[0]
    for handle in split:
        handle.remove()
    blocks = [getattr(b, "_orig_mod", b) for b in model.blocks]

    fresh_dynamo()
    first = None
    for spill_dir in (None, tmp_path):  # from RAM, then from the spill file: the same graphs
        st = streamer(blocks, spill_dir)
        st.attach(compiled=True)
        try:
            assert (st.disk_figures() or {}).get("active", False) == (spill_dir is not None)
            slots, handles = record_slots(st, blocks)
            for _ in range(2):  # a second attach: new slots, the same graphs
                outs, seen = passes(run, inputs)
                assert all(torch.equal(a, b) for a, b in zip(outs, reference)), (setup, spill_dir)
                first = first or seen[0]
                assert first["graphs"] >= 1 and all(s == first for s in seen), (first, seen)
                assert st.telemetry.snapshot()["copies"] > 0
                if handles:  # every streamed block ran from either slot
                    assert all(used == {0, 1} for used in slots.values()), slots
                    for handle in handles:
                        handle.remove()
                    handles = []
                st.detach()
                st.attach(compiled=True)
        finally:
            st.close()
    # Every block ran one compiled graph of its forward, whatever slot held its weights.
    assert block_cache_entries() == 1
    breaks = list(counters["unimplemented"])
    assert all(any(word in reason for word in ENGINE_BREAKS) for reason in breaks), breaks
    if setup != "whole model":
        assert breaks == []  # a block's own compiled call has the engine's hooks outside it


def test_phases_split_a_block_graph_at_its_hooks_and_serve_every_slot():
    """Phases bind their weights when a module of the phase is called, so dynamo breaks each
    block's graph at those calls. The engine serves such graphs right: the same bits as the same
    compiled model split there by hooks that do nothing, and no recompile after the first pass."""
    inputs = batches(3)
    model = Net()
    handles = split_like_the_engine(model, "phase")
    split, _ = passes(torch.compile(model), inputs)
    for h in handles:
        h.remove()

    fresh_dynamo()
    st = LayerwiseStreamer(list(model.blocks), "cpu", resident=0, prefetch=1, granularity="phase")
    st.attach(compiled=True)
    try:
        assert len(st.streamed_indices) > DEPTH
        outs, seen = passes(torch.compile(model), inputs)
        assert all(torch.equal(a, b) for a, b in zip(outs, split))
        assert seen[0]["breaks"] > 0 and all(s == seen[0] for s in seen), seen
        breaks = list(counters["unimplemented"])
        assert all(any(word in reason for word in ENGINE_BREAKS) for reason in breaks), breaks
    finally:
        st.close()


@pytest.mark.parametrize("granularity", ["block", "phase"])
def test_a_unit_looks_the_same_to_guards_in_every_slot(granularity):
    """Dynamo's guards check a weight's shape, strides, dtype and device, and inductor assumes the
    alignment it saw when it compiled: every slot must show a unit at the same offset, with the
    same strides and dtypes, 16-byte aligned, or a graph would recompile per slot."""
    model = Net()
    st = LayerwiseStreamer(list(model.blocks), "cpu", resident=0, prefetch=2, granularity=granularity)
    st.attach()
    try:
        window = st._schedule._window
        buffers = window.ring.buffers
        assert len(buffers) == 3
        for i in st.streamed_indices:
            looks = []
            for buf in buffers:
                views = window._packs[i].views(buf)
                assert all(v.data_ptr() % 16 == 0 for v in views.tensors), i
                looks.append([(v.shape, v.stride(), v.dtype, v.device, v.storage_offset())
                              for v in views.tensors])
            assert looks and all(look == looks[0] for look in looks), i
    finally:
        st.close()


def test_an_attach_not_told_of_a_compile_never_puts_its_hooks_in_a_graph():
    """Keeping the hooks out of dynamo's trace costs a few microseconds per block call, so an
    attach does it only when told of a compile (Apply Layerwise Offload tells it when it finds
    one). A compile it was not told of still never traces a hook into a graph that would keep one
    slot's weights: the hook's first line refuses a trace, which is a graph break there (the hook
    then runs eagerly, with the same bits), and with ``fullgraph`` the compile fails naming what
    to do."""
    inputs = batches(2)
    model = Net()
    run = compiled(model, "per-block modules")
    reference, _ = passes(run, inputs)
    blocks = [getattr(b, "_orig_mod", b) for b in model.blocks]
    fresh_dynamo()
    st = streamer(blocks)
    st.attach()
    try:
        outs, _ = passes(run, inputs)
        assert all(torch.equal(a, b) for a, b in zip(outs, reference))
        assert any("compiled=True" in reason for reason in counters["unimplemented"]), \
            list(counters["unimplemented"])
        for i, block in enumerate(blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
        fresh_dynamo()
        with pytest.raises(Exception, match="compiled=True"):
            passes(model, inputs)
    finally:
        st.close()
