"""GPU-only checks: equality, VRAM bound, no device-to-host traffic, ordering under delays, pinning,
transforms on device copies, staged pageable copies, streams, capture refusal, shared pin budget."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from toy_models import ToyDiT, assert_restored, bits, inputs, snapshot

from offload_core import HostStorage, LayerwiseStreamer, ModuleSwap, pinned_bytes, set_pin_accounting
from offload_core.staging import PIECE_BYTES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else None


def _models(depth: int = 6, dim: int = 128, blocks_on_gpu: bool = False) -> tuple[ToyDiT, ToyDiT]:
    """The model to stream (everything but the blocks on the GPU) and a fully resident twin."""
    model = ToyDiT(depth=depth, dim=dim)
    ref = copy.deepcopy(model).to(DEV)
    for m in (model.embed, model.cond, model.head):
        m.to(DEV)
    if blocks_on_gpu:
        model.blocks.to(DEV)
    return model, ref


def _inputs(tokens: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x, t = inputs(tokens=tokens, seed=seed)
    return x.to(DEV), t.to(DEV)


@pytest.mark.parametrize("resident,prefetch", [(0, 1), (0, 2), (2, 1), (3, 3), (6, 1), (0, 10)])
def test_gpu_bit_identical(resident, prefetch):
    model, ref_model = _models()
    x, t = _inputs()
    x2, t2 = _inputs(seed=7)  # the "uncond" pass of each step
    with torch.no_grad():
        ref_c, ref_u = ref_model(x, t), ref_model(x2, t2)
    before, keys = snapshot(model), list(model.state_dict())
    base_pinned = pinned_bytes()
    st = LayerwiseStreamer(model.blocks, DEV, resident=resident, prefetch=prefetch)
    st.attach()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x, t), ref_c)
            assert torch.equal(model(x2, t2), ref_u)
    snap = st.telemetry.snapshot(wait=True)
    assert snap["sync_fallbacks"] == 0 and snap["peak_materialized_bytes"] <= st.bound_bytes()
    host = st.host_bytes()
    assert 0 < host["pinned"] <= 1.05 * host["packed"] + 2 * 4096, host
    st.detach()
    assert pinned_bytes() == base_pinned
    assert_restored(model, before, keys)


def test_gpu_resident_model_is_freed_and_restored_on_device():
    model, ref_model = _models(depth=6, dim=256, blocks_on_gpu=True)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated(DEV)
    st = LayerwiseStreamer(model.blocks, DEV, resident=0, prefetch=1)
    st.attach()
    freed = used - torch.cuda.memory_allocated(DEV)
    assert freed >= st.packed_bytes - st.bound_bytes() - (1 << 20)  # originals left the GPU
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.detach(keep_pack=True)
    assert_restored(model, before, keys)  # back on the GPU, same objects, same bits
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()
    assert_restored(model, before, keys)


def test_gpu_peak_memory_within_bound():
    model, ref_model = _models(depth=8, dim=512)
    x, t = _inputs(tokens=32)
    weights = sum(p.numel() * p.element_size() for p in ref_model.blocks.state_dict().values())
    with torch.no_grad():
        ref_model(x, t)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(DEV)
        start = torch.cuda.memory_allocated(DEV)
        ref_model(x, t)
        activations = torch.cuda.max_memory_allocated(DEV) - start
    del ref_model
    torch.cuda.empty_cache()
    for resident, prefetch in [(0, 1), (2, 2)]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(DEV)
        base = torch.cuda.memory_allocated(DEV)
        st = LayerwiseStreamer(model.blocks, DEV, resident=resident, prefetch=prefetch)
        st.attach()
        with torch.no_grad():
            for _ in range(2):
                model(x, t)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(DEV) - base
        assert st.bound_bytes() < weights
        assert peak <= st.bound_bytes() + activations + (1 << 20), (peak, st.bound_bytes(), activations)
        st.close()


def _profiled_event_names(fn) -> list[str]:
    """Names of every event the profiler saw while fn ran (copies are named by direction)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def _device_to_host(names: list[str]) -> list[str]:
    return [n for n in names if "DtoH" in n or "Device -> Pageable" in n or "Device -> Pinned" in n]


def test_gpu_profiler_sees_device_to_host_copies():
    """The control for the no-DtoH checks below: a real device-to-host copy is seen."""
    assert _device_to_host(_profiled_event_names(lambda: torch.ones(1 << 20, device=DEV).cpu()))


def test_gpu_no_device_to_host_copies_while_streaming():
    model, ref_model = _models(depth=6, dim=128)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, DEV, resident=1, prefetch=2)
    st.attach()
    with torch.no_grad():
        model(x, t)  # warm-up outside the profile
        torch.cuda.synchronize()
        outs = []
        names = _profiled_event_names(lambda: outs.extend([model(x, t), model(x, t)]))
    out1, out2 = outs
    assert not _device_to_host(names)
    assert [n for n in names if "HtoD" in n], "expected the streamed blocks' host-to-device copies"
    assert torch.equal(out1, ref) and torch.equal(out2, ref)
    st.close()


def test_gpu_ordering_under_random_delays():
    """Slow compute must not let the copy stream overwrite a slot in use, and slow copies must be waited for."""
    model, ref_model = _models(depth=6, dim=128)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    rng = random.Random(0)
    st = LayerwiseStreamer(model.blocks, DEV, resident=1, prefetch=2)
    st.attach()

    def slow_compute(module, args, kwargs):
        torch.cuda._sleep(rng.randrange(0, 2_000_000))  # after our pre-hook: weights are bound

    for b in model.blocks:
        b.register_forward_pre_hook(slow_compute, with_kwargs=True)
    ring = st._ring
    copy_in = ring.copy_in

    def slow_copy(slot, host, *args):
        with torch.cuda.stream(ring.stream):
            torch.cuda._sleep(rng.randrange(0, 2_000_000))
        copy_in(slot, host, *args)

    ring.copy_in = slow_copy
    with torch.no_grad():
        for i in range(12):
            out = model(x, t, order=[0, 1, 4, 5] if i % 5 == 4 else None)  # streamed blocks skipped too
            if i % 5 != 4:
                assert torch.equal(out, ref), f"pass {i}"
    assert st.telemetry.snapshot(wait=True)["compute_wait_s"] > 0
    st.close()


def test_gpu_exception_and_out_of_order_recover():
    model, ref_model = _models(depth=6, dim=128)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
        ref_order = ref_model(x, t, order=[0, 3, 1, 2, 5])
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, DEV, resident=0, prefetch=1)
    st.attach()
    model.blocks[3].fail = True
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        model(x, t)
    model.blocks[3].fail = False
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
        assert torch.equal(model(x, t, order=[0, 3, 1, 2, 5]), ref_order)
        assert torch.equal(model(x, t), ref)
    assert st.telemetry.sync_fallbacks > 0
    st.detach()
    assert_restored(model, before, keys)


def test_gpu_pinned_storage_counts_and_budget_fallback(caplog):
    base = pinned_bytes()
    hs = HostStorage([3 << 20, 5 << 20], pin=True, chunk_bytes=4 << 20)
    a, b = hs.buffer(0), hs.buffer(1)
    assert a.is_pinned() and b.is_pinned()
    assert pinned_bytes() - base == hs.pinned_bytes <= 1.05 * (8 << 20)
    hs.release()
    assert pinned_bytes() == base
    with caplog.at_level(logging.WARNING, logger="offload_core.pinned"):
        capped = HostStorage([1 << 20], pin=True, ram_budget_bytes=0)
        assert not capped.buffer(0).is_pinned()
    assert "cap" in caplog.text
    capped.release()
    assert pinned_bytes() == base


def test_gpu_module_swap_round_trip_without_device_to_host():
    model, ref_model = _models(depth=3, dim=128)
    for m in (model.embed, model.cond, model.head):
        m.to("cpu")
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    swap = ModuleSwap(model, pin=True)
    tiers = swap.bytes_by_tier()
    assert tiers["vram"] == 0 and tiers["pinned"] > 0 and tiers["pageable"] == 0
    swap.load(DEV)
    assert swap.bytes_by_tier()["vram"] == tiers["pinned"]
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    assert not _device_to_host(_profiled_event_names(swap.park))
    assert swap.bytes_by_tier()["vram"] == 0
    assert model.blocks[0].qkv.weight.device.type == "cpu"
    swap.load(DEV)
    with torch.no_grad():
        assert torch.equal(bits(model(x, t)), bits(ref))
    swap.close()
    assert_restored(model, before, keys)


def test_gpu_pack_views_read_as_pinned():
    """Core's pin_memory trusts is_pinned(): every tensor aliasing the pack must say True, or core
    registers the same pages again and leaves a CUDA error behind."""
    model, _ = _models(depth=4, dim=128)
    st = LayerwiseStreamer(model.blocks, DEV, resident=1, prefetch=1, host_chunk_bytes=1 << 20)
    st.attach()
    st.detach(keep_pack=True)  # CPU tensors now alias the kept pack
    host = st._host
    assert len(host._chunks) > 1 and host.pageable_bytes == 0
    for i in range(len(st._packs) + 1):
        assert host.buffer(i).numel() == 0 or host.buffer(i).is_pinned(), i
    dense = [t for t in [*model.blocks.parameters(), *model.blocks.buffers()] if t.stride()[0] != 0]
    assert dense and all(t.is_pinned() for t in dense)
    st.close()


def _delta(i: int, name: str, w: torch.Tensor) -> torch.Tensor | None:
    if name not in ("qkv.weight", "proj.weight", "wt"):
        return None
    g = torch.Generator(device=w.device).manual_seed(100 * i + len(name))
    return torch.randn(w.shape, generator=g, device=w.device) * 0.05


def _merge(i: int, name: str, w: torch.Tensor) -> torch.Tensor:
    d = _delta(i, name, w)
    return w if d is None else (w.float() + d).to(w.dtype)


def _merged_reference(ref_model: ToyDiT) -> ToyDiT:
    merged = copy.deepcopy(ref_model)
    with torch.no_grad():
        for i, blk in enumerate(merged.blocks):
            for name, p in blk.named_parameters():
                p.copy_(_merge(i, name, p))
    return merged


@pytest.mark.parametrize("pin", [True, False])
def test_gpu_transform_runs_on_device_copies_under_delays(pin):
    """The merge runs on the copy stream after each copy and before the slot is ready: with the
    copy stream slowed at random, compute still only ever sees merged weights. A pageable pack
    (pin=False) goes through the staging worker the same way."""
    model, ref_model = _models(depth=6, dim=128)
    x, t = _inputs()
    with torch.no_grad():
        ref = _merged_reference(ref_model)(x, t)
    base = pinned_bytes()
    rng = random.Random(1)
    st = LayerwiseStreamer(model.blocks, DEV, resident=2, prefetch=2, pin=pin)
    st.attach(_merge)
    ring = st._ring
    copy_in = ring.copy_in

    def slow_copy(slot, host, *args):
        with torch.cuda.stream(ring.stream):
            torch.cuda._sleep(rng.randrange(0, 2_000_000))
        copy_in(slot, host, *args)

    ring.copy_in = slow_copy
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(x, t), ref)
    snap = st.telemetry.snapshot(wait=True)
    assert snap["transforms"] == 3 * (snap["copies"] + len(st.resident_indices)) and snap["sync_fallbacks"] == 0
    host = st.host_bytes()
    assert snap["staged_copies"] == (0 if pin else snap["copies"]), snap
    assert host["pageable"] == (0 if pin else host["packed"]), host
    st.close()
    assert pinned_bytes() == base


def test_gpu_partly_pinned_pack_stages_only_its_pageable_blocks():
    model, ref_model = _models(depth=6, dim=128)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    probe = LayerwiseStreamer(model.blocks, DEV, resident=0, prefetch=1)
    block = probe._packs[0].nbytes
    # Room for the staging buffer (taken first) and about half of the blocks, one per chunk.
    budget = pinned_bytes() + 2 * PIECE_BYTES + 3 * (block + 4096)
    st = LayerwiseStreamer(model.blocks, DEV, resident=0, prefetch=1, ram_budget_bytes=budget,
                           host_chunk_bytes=block)
    st.attach()
    host = st.host_bytes()
    assert host["pinned"] > 0 and host["pageable"] > 0, host
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x, t), ref)
    snap = st.telemetry.snapshot(wait=True)
    assert 0 < snap["staged_copies"] < snap["copies"], snap
    st.close()


def test_gpu_compute_on_another_stream_waits_for_the_resident_upload():
    """Resident buffers are uploaded on the stream attach runs on; compute on any other stream must
    wait for that upload (here held back by a long sleep queued before it)."""
    model, ref_model = _models(depth=6, dim=256)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, DEV, resident=4, prefetch=1)
    torch.cuda._sleep(200_000_000)  # the resident copies queue behind this
    st.attach()
    side = torch.cuda.Stream(DEV)  # not ordered after the attach stream: only the engine's event orders it
    with torch.no_grad(), torch.cuda.stream(side):
        out = model(x, t)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    st.close()


def test_gpu_capture_of_a_streamed_block_is_refused_and_the_engine_recovers():
    model, ref_model = _models(depth=4, dim=128)
    x, t = _inputs()
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, DEV, resident=1, prefetch=1)
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # warm-up, as capture needs
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                model(x, t)
        torch.cuda.synchronize()
        assert torch.equal(model(x, t), ref)
    st.close()


def test_gpu_shared_pin_budget_caps_real_registrations():
    reports: list[int] = []
    base = pinned_bytes()
    try:
        set_pin_accounting(lambda: base + (6 << 20), reports.append)
        hs = HostStorage([4 << 20, 4 << 20], pin=True, chunk_bytes=4 << 20)
        first, second = hs.buffer(0), hs.buffer(1)
        assert first.is_pinned() and not second.is_pinned()  # the second would pass the shared cap
        assert reports[-1] == pinned_bytes() == base + (4 << 20)
        hs.release()
        assert reports[-1] == pinned_bytes() == base
    finally:
        set_pin_accounting(None, None)
