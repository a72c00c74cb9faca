"""LayerwiseStreamer on CPU: bit-equality, residency, accounting, robustness, lifecycle."""

from __future__ import annotations

import copy

import pytest
import torch
from toy_models import KwargsBlock, ToyDiT, assert_restored, inputs, snapshot

from offload_core import LayerwiseStreamer, pinned_bytes

GRID = [
    # depth, resident, prefetch
    (6, 0, 1),
    (6, 0, 2),
    (6, 2, 1),
    (6, 3, 2),
    (6, 6, 1),  # all resident
    (6, 0, 10),  # prefetch deeper than the stack
    (5, 1, 4),  # every streamed block gets its own slot
    (1, 0, 1),  # one block, streamed
    (1, 1, 1),  # one block, resident
    (1, 0, 3),
]


def _bound_checker(model: ToyDiT, st: LayerwiseStreamer) -> list[int]:
    """Pre-hooks that assert the device-bytes bound at every block; returns the list they append to."""
    seen: list[int] = []

    def check(i: int):
        def hook(module, args, kwargs):
            tel = st.telemetry
            assert tel.materialized_bytes <= st.bound_bytes(), (i, tel.snapshot())
            assert tel.device_alloc_bytes <= st.bound_bytes(), (i, tel.snapshot())
            seen.append(i)

        return hook

    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(check(i), with_kwargs=True)
    return seen


@pytest.mark.parametrize("depth,resident,prefetch", GRID)
def test_bit_identical_across_settings(depth, resident, prefetch):
    model = ToyDiT(depth=depth)
    x, t = inputs()
    x2, t2 = inputs(seed=7)
    with torch.no_grad():
        ref_c, ref_u = model(x, t), model(x2, t2)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=resident, prefetch=prefetch)
    assert len(st.resident_indices) == resident
    assert sorted(st.resident_indices + st.streamed_indices) == list(range(depth))
    seen = _bound_checker(model, st)
    st.attach()
    for i in st.streamed_indices:  # released until their turn
        assert model.blocks[i].qkv._parameters["weight"] is None
        assert model.blocks[i]._buffers["gate8"] is None
    with torch.no_grad():
        for _ in range(3):  # several steps, each with a cond and an uncond pass (wrap-around)
            assert torch.equal(model(x, t), ref_c)
            assert torch.equal(model(x2, t2), ref_u)
    assert len(seen) == 6 * depth
    snap = st.telemetry.snapshot()
    assert snap["peak_materialized_bytes"] <= st.bound_bytes() == snap["bound_bytes"]
    assert snap["peak_device_alloc_bytes"] <= st.bound_bytes()
    assert snap["sync_fallbacks"] == 0 and snap["order_misses"] == 0
    n_streamed = len(st.streamed_indices)
    slots = min(prefetch + 1, n_streamed)
    if n_streamed and slots == n_streamed:
        assert snap["copies"] == n_streamed  # everything fits in the ring: copied once, then reused
    elif n_streamed:
        assert snap["copies"] == slots + 6 * n_streamed  # warm-up window + one copy per block run
    st.detach()
    assert_restored(model, before, keys)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref_c)


def test_shared_parameter_stays_resident():
    model = ToyDiT(depth=4)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1)
    shared = model.blocks[0].shared_scale
    st.attach()
    assert all(b.shared_scale is shared for b in model.blocks)
    assert st.block_states() == ["in_flight", "in_flight", "streamed", "streamed"]
    x, t = inputs()
    with torch.no_grad():
        model(x, t)
    for b in model.blocks:  # released blocks lose their own tensors, never the shared one
        assert b._parameters["shared_scale"] is shared and shared.numel() == 32
        assert b._parameters["modulation"] is None
    st.close()


def test_kwargs_only_blocks():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([KwargsBlock(16) for _ in range(4)])
    x = torch.randn(3, 16)

    def run():
        h = x
        for b in blocks:
            h = b(x=h, scale=0.5)
        return h

    with torch.no_grad():
        ref = run()
        st = LayerwiseStreamer(blocks, "cpu", prefetch=1)
        st.attach()
        assert torch.equal(run(), ref) and torch.equal(run(), ref)
        st.close()


def test_detach_restores_and_keep_pack_reattach():
    model = ToyDiT(depth=5)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    base = pinned_bytes()
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    st.attach()
    with torch.no_grad():
        model(x, t)
    st.detach(keep_pack=True)
    assert_restored(model, before, keys)
    # unchanged CPU tensors now alias the kept host pack (zero-copy), so RAM stays ~1x
    host_range = [(st._store.host.buffer(i).data_ptr(), st._store.host.buffer(i).numel()) for i in range(6)]
    w = model.blocks[2].qkv.weight
    assert any(lo <= w.data_ptr() < lo + n for lo, n in host_range)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    packed = st.telemetry.blocks_packed
    st.attach()  # the kept pack is still valid: nothing is packed again
    assert st.telemetry.blocks_packed == packed
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.detach(keep_pack=False)
    assert_restored(model, before, keys)
    assert not any(lo <= model.blocks[2].qkv.weight.data_ptr() < lo + n for lo, n in host_range)
    assert pinned_bytes() == base
    st.close()
    with pytest.raises(RuntimeError, match="closed"):
        st.attach()


def test_conceal_resident_hides_every_block_tensor_until_reveal():
    """While concealed, no block holds a tensor (a framework sizing or patching the model sees
    empty blocks); reveal, or a detach while concealed, gives everything back bit for bit."""
    model = ToyDiT(depth=5)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=2, prefetch=1)
    st.attach()
    assert len(st.resident_indices) == 2
    st.conceal_resident()
    assert not list(model.blocks.parameters()) and not model.blocks.state_dict()
    assert list(model.embed.parameters()), "only the blocks are concealed"
    st.reveal_resident()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.conceal_resident()
    st.detach(keep_pack=True)
    assert_restored(model, before, keys)
    st.close()
    with pytest.raises(RuntimeError, match="attached"):
        st.conceal_resident()


def test_reassigned_tensor_forces_fresh_pack():
    model = ToyDiT(depth=3, shared=False)
    x, t = inputs()
    st = LayerwiseStreamer(model.blocks, "cpu", prefetch=1)
    st.attach()
    st.detach(keep_pack=True)
    with torch.no_grad():
        model.blocks[1].mlp_out.weight.data = model.blocks[1].mlp_out.weight.data * 2  # new storage
        ref = model(x, t)
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()


def test_exception_mid_pass_leaves_engine_consistent():
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=2)
    st.attach()
    victim = st.streamed_indices[2]
    model.blocks[victim].fail = True
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        model(x, t)
    assert st._schedule._window.running is None  # the always-call exit hook handed the slot back
    assert st.telemetry.materialized_bytes <= st.bound_bytes()
    model.blocks[victim].fail = False
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
        assert torch.equal(model(x, t), ref)
    st.detach()
    assert_restored(model, before, keys)


@pytest.mark.parametrize(
    "order,fallbacks",
    [
        ([0, 2, 1, 3, 4, 5], True),  # swapped pair
        ([0, 1, 4, 5], True),  # two blocks skipped (block cache)
        ([0, 1, 1, 2, 3, 4, 5], True),  # a block run twice
        ([0, 1, 3, 4, 5], False),  # one skip: block 3 is already in flight, only the order is off
        ([5, 4, 3, 2, 1, 0], True),  # reversed
    ],
)
def test_out_of_order_and_skipped_blocks(order, fallbacks):
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref_order, ref_full = model(x, t, order=order), model(x, t)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1)
    seen = _bound_checker(model, st)
    st.attach()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x, t, order=order), ref_order)
            assert torch.equal(model(x, t), ref_full)
    snap = st.telemetry.snapshot()
    assert snap["order_misses"] > 0
    assert (snap["sync_fallbacks"] > 0) == fallbacks
    assert snap["peak_materialized_bytes"] <= st.bound_bytes()
    assert len(seen) == 2 * (len(order) + 6)
    st.close()


def test_copies_of_blocks_a_call_skips_are_counted():
    """Skip-layer guidance's extra call replaces two blocks with a pass-through: the window has
    copied them already (prefetch cannot know), so their slots are copied over before they run.
    Each such copy is counted with its bytes; whole passes, and the copies of the last pass for a
    next one, count nothing."""
    model = ToyDiT(depth=6)
    x, t = inputs()
    skipping = [0, 1, 3, 5]
    with torch.no_grad():
        ref_skip, ref_full = model(x, t, order=skipping), model(x, t)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=2)
    st.attach()
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x, t), ref_full)
            assert st.telemetry.snapshot()["unused_copies"] == 0
            for _ in range(3):
                assert torch.equal(model(x, t), ref_full)
                assert torch.equal(model(x, t, order=skipping), ref_skip)
        snap = st.telemetry.snapshot()
        block = st.describe_units()[0]["bytes"]  # the toy's blocks are all the same size
        assert 3 * 2 <= snap["unused_copies"] <= 3 * 3, snap  # blocks 2 and 4, each skipping pass
        assert snap["unused_copy_bytes"] == snap["unused_copies"] * block
    finally:
        st.close()


def test_inference_mode_attach_and_run_then_restore():
    model = ToyDiT(depth=4)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    with torch.inference_mode():
        st.attach()
        assert torch.equal(model(x, t), ref)
        st.detach()
    assert_restored(model, before, keys)
    for p in model.parameters():
        assert not p.is_inference()
    with torch.no_grad():
        model.blocks[0].qkv.weight.add_(0)  # in-place use outside inference mode still allowed


def _lora_delta(block: int, name: str, salt: int) -> torch.Tensor | None:
    if name not in ("qkv.weight", "proj.weight", "wt"):
        return None
    g = torch.Generator().manual_seed(1000 * salt + 10 * block + len(name))
    return torch.randn(32 if name != "qkv.weight" else 96, 32, generator=g) * 0.05


def _make_transform(salts: dict[int, int], calls: list[int]):
    def transform(block: int, name: str, w: torch.Tensor) -> torch.Tensor:
        calls.append(block)
        d = _lora_delta(block, name, salts[block])
        if d is None:
            return w
        return (w.float() + d).to(w.dtype)

    return transform


def _reference(model: ToyDiT, salts: dict[int, int]) -> ToyDiT:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for i, blk in enumerate(ref.blocks):
            for name, p in blk.named_parameters():
                d = _lora_delta(i, name, salts[i])
                if d is not None:
                    p.copy_((p.float() + d).to(p.dtype))
    return ref


def _kept_outside_pack(st: LayerwiseStreamer) -> int:
    """Bytes of originals the engine keeps beside the host pack."""
    return sum(e.nbytes for p in st._plan.packs + [st._plan.shared] for e in p.entries if e.original is not None)


def test_transform_runs_on_device_copies_and_the_pack_stays_one_copy():
    """A LoRA-like transform gives exactly what merging it into the weights gives (the old host
    bake), costs no host RAM, and a change of LoRA between runs re-packs nothing."""
    model = ToyDiT(depth=6)
    x, t = inputs()
    before, keys = snapshot(model), list(model.state_dict())
    salts1 = {i: 1 for i in range(6)}
    salts2 = {**salts1, 1: 2, 4: 2}
    with torch.no_grad():
        plain = model(x, t)
        lora1 = _reference(model, salts1)(x, t)
        lora2 = _reference(model, salts2)(x, t)
    assert not torch.equal(plain, lora1) and not torch.equal(lora1, lora2)

    st = LayerwiseStreamer(model.blocks, "cpu", resident=2, prefetch=1)
    st.attach()
    host_plain, outside_plain = st._store.host.allocated_bytes, _kept_outside_pack(st)
    st.detach(keep_pack=True)
    master = [st._store.host.buffer(i).clone() for i in range(7)]
    assert outside_plain == sum(e.nbytes for e in st._plan.packs[0].entries if not e.dense) * 6  # bias_exp only

    calls: list[int] = []
    for salts, want in ((salts1, lora1), (salts2, lora2), (salts1, lora1)):
        packed, calls[:] = st.telemetry.blocks_packed, []
        st.attach(_make_transform(salts, calls))
        assert st.telemetry.blocks_packed == packed  # nothing re-packed for a new transform
        assert st._store.host.allocated_bytes == host_plain and _kept_outside_pack(st) == outside_plain
        assert set(calls) >= set(st.resident_indices)  # residents are transformed at attach
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x, t), want)
        assert st.telemetry.transforms > 0
        st.detach(keep_pack=True)
        assert_restored(model, before, keys)  # the originals, never the merged weights
        assert all(torch.equal(st._store.host.buffer(i), m) for i, m in enumerate(master))

    st.attach()  # LoRA removed
    with torch.no_grad():
        assert torch.equal(model(x, t), plain)
    st.close()
    assert_restored(model, before, keys)


def test_compute_never_sees_untransformed_slot_bytes():
    """Every block entry, also out of order and after a slot is reused, sees merged weights."""
    model = ToyDiT(depth=6, shared=False)
    salts = {i: 3 for i in range(6)}
    ref = _reference(model, salts)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=2)
    seen: list[int] = []

    def check(i: int):
        def hook(module, args, kwargs):  # runs after the engine's own pre-hook
            for name in ("qkv.weight", "proj.weight", "wt"):
                got = dict(module.named_parameters())[name]
                assert torch.equal(got, dict(ref.blocks[i].named_parameters())[name]), (i, name)
            seen.append(i)

        return hook

    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(check(i), with_kwargs=True)
    calls: list[int] = []
    st.attach(_make_transform(salts, calls))
    x, t = inputs()
    with torch.no_grad():
        for order in (None, [0, 2, 1, 3, 4, 5], [0, 1, 4, 5], None, [5, 4, 3, 2, 1, 0]):
            model(x, t, order=order)
    assert len(seen) == 6 + 6 + 4 + 6 + 6
    copies, applied = st.telemetry.copies, st.telemetry.transforms
    # one application per transformed tensor of each fresh copy: 3 per streamed copy, 3 per resident
    assert applied == 3 * (copies + len(st.resident_indices))
    st.close()


@pytest.mark.parametrize("device", ["cpu", "model"])  # model: the merge fails on the copy worker
def test_transform_failure_mid_pass_leaves_engine_consistent(device):
    model = ToyDiT(depth=6, shared=False)
    salts = {i: 1 for i in range(6)}
    x, t = inputs()
    with torch.no_grad():
        want = _reference(model, salts)(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    broken = {"block": 4}
    calls: list[int] = []
    inner = _make_transform(salts, calls)

    def flaky(block: int, name: str, w: torch.Tensor) -> torch.Tensor:
        if block == broken["block"]:
            broken["block"] = None
            raise RuntimeError("injected transform failure")
        return inner(block, name, w)

    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1)
    st.attach(flaky)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected transform failure"):
        model(x, t)
    assert st.telemetry.materialized_bytes <= st.bound_bytes()
    with torch.no_grad():
        assert torch.equal(model(x, t), want)
        assert torch.equal(model(x, t), want)
    st.detach()
    assert_restored(model, before, keys)


def test_transform_is_validated():
    model = ToyDiT(depth=2, shared=False)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu")
    with pytest.raises(ValueError, match="shape and dtype.*qkv.weight"):
        st.attach(lambda b, n, w: w[:1] if n == "qkv.weight" else w)
    assert_restored(model, before, keys)
    with pytest.raises(ValueError, match="in place"):
        st.attach(lambda b, n, w: w.mul_(1) if n == "mlp_out.bias" else w)
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        st.attach(lambda b, n, w: w.tolist())
    assert not st.attached
    assert_restored(model, before, keys)


def test_vram_budget_derives_resident_count():
    model = ToyDiT(depth=6)
    probe = LayerwiseStreamer(model.blocks, "cpu", resident=3, prefetch=1)
    budget = probe.bound_bytes()
    st = LayerwiseStreamer(model.blocks, "cpu", vram_budget_bytes=budget, prefetch=1)
    assert len(st.resident_indices) == 3 and st.bound_bytes() <= budget
    assert st.resident_indices == [1, 3, 5]  # spread evenly
    everything = LayerwiseStreamer(model.blocks, "cpu", vram_budget_bytes=10**12)
    assert everything.streamed_indices == []
    minimal = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=2).bound_bytes()
    assert LayerwiseStreamer(model.blocks, "cpu", vram_budget_bytes=minimal, prefetch=2).resident_indices == []
    with pytest.raises(ValueError, match="too small"):
        LayerwiseStreamer(model.blocks, "cpu", vram_budget_bytes=minimal - 1, prefetch=2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"resident": -1}, "resident must be >= 0"),
        ({"resident": 7}, "only 6 blocks"),
        ({"resident": 1.5}, "resident must be an int"),
        ({"resident": 1, "vram_budget_bytes": 10**9}, "not both"),
        ({"prefetch": 0}, "prefetch must be >= 1"),
        ({"prefetch": True}, "prefetch must be an int"),
        ({"vram_budget_bytes": 0}, "vram_budget_bytes must be >= 1"),
        ({"vram_budget_bytes": 10}, "too small"),
        ({"ram_budget_bytes": -5}, "ram_budget_bytes"),
        ({"pin": "yes"}, "pin must be a bool"),
        ({"host_chunk_bytes": 0}, "host_chunk_bytes"),
    ],
)
def test_invalid_settings(kwargs, match):
    model = ToyDiT(depth=6)
    with pytest.raises(ValueError, match=match):
        LayerwiseStreamer(model.blocks, "cpu", **kwargs)


def test_invalid_blocks_and_device():
    model = ToyDiT(depth=2)
    with pytest.raises(ValueError, match="empty"):
        LayerwiseStreamer([], "cpu")
    with pytest.raises(ValueError, match="more than once"):
        LayerwiseStreamer([model.blocks[0], model.blocks[0]], "cpu")
    with pytest.raises(ValueError, match="nested"):
        LayerwiseStreamer([model.blocks[0], model.blocks[0].qkv], "cpu")
    with pytest.raises(ValueError, match="not an nn.Module"):
        LayerwiseStreamer([model.blocks[0], "block"], "cpu")
    with pytest.raises(ValueError, match="not supported"):
        LayerwiseStreamer(model.blocks, "meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            LayerwiseStreamer(model.blocks, "cuda")


class _Tagged(torch.Tensor):
    """A tensor subclass the engine cannot pack faithfully: it keeps a tensor beside its data."""


def test_unpackable_tensor_is_named_and_module_untouched():
    model = ToyDiT(depth=3)
    model.blocks[1].mlp_in.weight = torch.nn.Parameter(
        torch.randn(64, 32, dtype=torch.bfloat16).as_subclass(_Tagged), requires_grad=False
    )
    model.blocks[1].mlp_in.weight.scale = torch.ones(())
    before, keys = snapshot(model), list(model.state_dict())
    with pytest.raises(TypeError, match=r"block 1: mlp_in\.weight.*_Tagged"):
        LayerwiseStreamer(model.blocks, "cpu")
    assert_restored(model, before, keys)


def test_block_states_and_attach_twice():
    model = ToyDiT(depth=4)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    assert st.block_states() == ["streamed", "streamed", "resident", "streamed"]
    st.attach()
    assert st.block_states() == ["in_flight", "in_flight", "resident", "streamed"]
    with pytest.raises(RuntimeError, match="already attached"):
        st.attach()
    st.close()
    assert st.block_states() == ["streamed", "streamed", "resident", "streamed"]


def test_model_built_in_inference_mode():
    """ComfyUI loads weights under inference_mode: parameters are inference tensors."""
    with torch.inference_mode():
        model = ToyDiT(depth=5)
        x, t = inputs()
        ref = model(x, t)
        before, keys = snapshot(model), list(model.state_dict())
    assert model.blocks[0].qkv.weight.is_inference()
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    for keep in (True, False):
        st.attach(lambda b, n, w: w * 1 if n == "proj.weight" else w)
        with torch.inference_mode():
            assert torch.equal(model(x, t), ref) and torch.equal(model(x, t), ref)
        st.detach(keep_pack=keep)
        with torch.inference_mode():
            assert_restored(model, before, keys)
            assert torch.equal(model(x, t), ref)
    assert all(p.is_inference() for p in model.parameters())


def test_telemetry_snapshot_is_json_and_resets():
    import json

    model = ToyDiT(depth=3)
    st = LayerwiseStreamer(model.blocks, "cpu", prefetch=1)
    st.attach()
    x, t = inputs()
    with torch.no_grad():
        model(x, t)
    snap = json.loads(json.dumps(st.telemetry.snapshot(wait=True)))
    # On a CPU the sampling thread makes the copies, so compute waited for them.
    assert snap["copies"] > 0 and snap["bytes_copied"] > 0 and snap["compute_wait_s"] > 0.0
    st.telemetry.reset()
    snap = st.telemetry.snapshot()
    assert snap["copies"] == 0 and snap["peak_materialized_bytes"] == snap["materialized_bytes"] > 0
    assert snap["compute_wait_s"] == snap["host_wait_s"] == snap["wait_host_s"] == 0.0
    st.close()
    assert st.telemetry.snapshot()["materialized_bytes"] == 0


def test_transform_sees_the_block_bound_to_the_copy_it_rewrites():
    """A transform may call the layer's own methods, which read the layer's other tensors (a
    scaled-fp8 layer's scale): while it runs, the block's modules show the very copy it
    rewrites, resident or streamed, and afterwards they are as they were."""
    model = ToyDiT(depth=4, shared=False)
    x, t = inputs()
    scale = 0.5

    def reference():
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for block in ref.blocks:
                block.qkv.weight.add_(block.qkv.bias.sum() * scale)
        return ref

    with torch.no_grad():
        want = reference()(x, t)
    seen: list[bool] = []

    def transform(block: int, name: str, view: torch.Tensor) -> torch.Tensor:
        if name != "qkv.weight":
            return view
        layer = model.blocks[block].qkv
        seen.append(layer.weight.data_ptr() == view.data_ptr())
        return view + layer.bias.sum() * scale  # the layer's other tensor, read through the module

    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    st.attach(transform)
    with torch.no_grad():
        assert torch.equal(model(x, t), want)
    assert seen and all(seen), seen
    streamed = st.streamed_indices[0]
    assert model.blocks[streamed].qkv._parameters["weight"] is None  # released again after
    st.close()


def test_host_side_waits_are_counted_and_lower_the_overlap():
    """Time the sampling thread spends in the engine (here a slow merge of each streamed copy, as
    a merge that waits for a pageable upload would be) is counted, and the overlap figure takes
    it off like the GPU's own waits: a stalled host cannot read as full overlap."""
    import time

    from offload_core.device.telemetry import overlap_efficiency

    model = ToyDiT(depth=4, shared=False)
    x, t = inputs()
    slept: list[float] = []
    attached = {"done": False}

    def slow_merge(block: int, name: str, w: torch.Tensor) -> torch.Tensor:
        if name == "qkv.weight" and attached["done"]:
            start = time.perf_counter()
            time.sleep(0.005)
            slept.append(time.perf_counter() - start)
        return w

    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1)
    st.attach(slow_merge)
    attached["done"] = True
    with torch.no_grad():
        for _ in range(3):
            model(x, t)
    snap = st.telemetry.snapshot()
    assert slept and snap["host_wait_s"] >= sum(slept)
    assert overlap_efficiency(snap, 10 * snap["host_wait_s"]) < 1.0
    assert overlap_efficiency({"compute_wait_s": 1.0, "host_wait_s": 2.0}, 10.0) == pytest.approx(0.7)
    st.telemetry.reset()
    assert st.telemetry.snapshot()["host_wait_s"] == 0.0
    st.close()


def test_reclaim_keeps_a_kept_pack_after_the_blocks_moved_elsewhere():
    """Between attaches the blocks may run elsewhere (ComfyUI's own load moves them to a device and
    its unload copies them back to fresh host memory). Reclaiming re-points them at the kept pack:
    the next attach packs nothing again, and the copies are let go."""
    model = ToyDiT(depth=4)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    st.attach()
    st.detach(keep_pack=True)
    host = st._store.host
    packed = st.telemetry.blocks_packed
    moved = [p for p in model.blocks.parameters()]
    with torch.no_grad():
        for p in moved:  # what a device round trip leaves: the same objects over fresh copies
            p.data = p.data.clone()
    assert st.reclaim() == len(moved)
    assert_restored(model, before, keys)
    ranges = [(host.buffer(i).data_ptr(), host.buffer(i).numel()) for i in range(len(st._plan.packs) + 1)]
    assert all(any(lo <= p.data_ptr() < lo + n for lo, n in ranges) for p in moved)
    assert st.reclaim() == 0
    st.attach()
    assert st.telemetry.blocks_packed == packed and st._store.host is host  # the pack survived
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    with pytest.raises(RuntimeError, match="detached"):
        st.reclaim()
    st.close()


def test_reclaim_within_a_module_takes_back_only_what_that_module_holds():
    """An owner that moves one module (ComfyUI's partial unload) still counts the others where
    they are: reclaiming within the moved module re-points its tensors and no other."""
    model = ToyDiT(depth=4)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    st.attach()
    st.detach(keep_pack=True)
    home = {id(p): p.data_ptr() for p in model.blocks.parameters()}
    with torch.no_grad():
        for p in model.blocks.parameters():  # every block moved elsewhere by its owner
            p.data = p.data.clone()
    moved = next(m for m in model.blocks[2].modules() if list(m.parameters(recurse=False))
                 and m is not model.blocks[2])
    inside = {id(p) for p in moved.parameters()}
    assert st.reclaim(within=moved) == len(inside) > 0
    assert all((p.data_ptr() == home[id(p)]) == (id(p) in inside) for p in model.blocks.parameters())
    assert st.reclaim(within=model.blocks[2]) == sum(1 for _ in model.blocks[2].parameters()) - len(inside)
    st.close()


def test_a_failed_upload_keeps_the_pack_and_a_failed_packing_frees_it():
    """An attach that fails after packing (out of device memory in the resident upload, a merge
    that fails there) keeps the complete pack for the next attach; one that fails while packing
    frees what it packed. Either way the module gets its tensors back."""
    model = ToyDiT(depth=4)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=2, prefetch=1)

    def out_of_memory(block: int, name: str, w: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected: out of memory in the resident upload")

    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        st.attach(out_of_memory)
    assert not st.attached and st._store.host is not None
    assert_restored(model, before, keys)
    packed = st.telemetry.blocks_packed
    st.attach()
    assert st.telemetry.blocks_packed == packed  # nothing packed again
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()

    st = LayerwiseStreamer(model.blocks, "cpu", resident=2, prefetch=1)

    def interrupted(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt("injected: interrupted while packing")

    with pytest.raises(KeyboardInterrupt):
        st.attach(progress=interrupted)
    assert st._store.host is None
    assert_restored(model, before, keys)
    st.close()
