"""The engine on a GPU: equality, VRAM bound, no device-to-host traffic, ordering under delays,
pinning, transforms on device copies, side tensors without host waits, staged pageable copies,
streams, capture refusal, shared pin budget, kept packs taken back from the device.

Every test whose mechanism exists on a CPU runs there too (``device`` is a parameter): the CPU
run keeps the test in step with the engine's API, so it cannot rot where CI has no GPU. The
``model`` run takes the engine's CUDA path on a CPU under the stream model
(tests/unit/stream_model.py): copy stream, events, staging, pinned packs, copies that land late,
and every hand-over of a buffer between streams checked against CUDA's rules. The CUDA run
shows what only CUDA can (real streams and pinning, the profiler's copy kinds, device memory).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from toy_models import ToyDiT, assert_restored, bits, inputs, snapshot

from offload_core import HostStorage, LayerwiseStreamer, ModuleSwap, pinned_bytes, set_pin_accounting
from offload_core.disk.tier import DiskOptions
from offload_core.host.side_tensors import SideTensors
from offload_core.host.staging import PIECE_BYTES
from offload_core.ordering import for_device, host_registrar

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", "model", pytest.param("cuda", marks=cuda_only)]
ASYNC_DEVICES = ["model", pytest.param("cuda", marks=cuda_only)]  # copies that run after their call
ROOT = Path(__file__).resolve().parents[2]


def _dev(name: str) -> torch.device:
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def _models(dev: torch.device, depth: int = 6, dim: int = 128, blocks_on_device: bool = False
            ) -> tuple[ToyDiT, ToyDiT]:
    """The model to stream (everything but the blocks on the device) and a fully resident twin."""
    model = ToyDiT(depth=depth, dim=dim)
    ref = copy.deepcopy(model).to(dev)
    for m in (model.embed, model.cond, model.head):
        m.to(dev)
    if blocks_on_device:
        model.blocks.to(dev)
    return model, ref


def _inputs(dev: torch.device, tokens: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x, t = inputs(tokens=tokens, seed=seed)
    return x.to(dev), t.to(dev)


def _delay(rng: random.Random, stream: torch.cuda.Stream | None = None) -> None:
    """Hold a CUDA stream (the current one by default) for a random while. A CPU has nothing to
    hold: every copy and every block runs to its end before the next starts."""
    if stream is None:
        torch.cuda._sleep(rng.randrange(0, 2_000_000))
        return
    with torch.cuda.stream(stream):
        torch.cuda._sleep(rng.randrange(0, 2_000_000))


def _synced(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resident,prefetch", [(0, 1), (0, 2), (2, 1), (3, 3), (6, 1), (0, 10)])
def test_bit_identical(device, resident, prefetch):
    dev = _dev(device)
    model, ref_model = _models(dev)
    x, t = _inputs(dev)
    x2, t2 = _inputs(dev, seed=7)  # the "uncond" pass of each step
    with torch.no_grad():
        ref_c, ref_u = ref_model(x, t), ref_model(x2, t2)
    before, keys = snapshot(model), list(model.state_dict())
    base_pinned = pinned_bytes()
    st = LayerwiseStreamer(model.blocks, dev, resident=resident, prefetch=prefetch)
    st.attach()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x, t), ref_c)
            assert torch.equal(model(x2, t2), ref_u)
    snap = st.telemetry.snapshot(wait=True)
    assert snap["sync_fallbacks"] == 0 and snap["peak_materialized_bytes"] <= st.bound_bytes()
    host = st.host_bytes()
    if device != "cpu":
        assert 0 < host["pinned"] <= 1.05 * host["packed"] + 2 * 4096, host
    else:
        assert host["pinned"] == 0 and host["pageable"] >= host["packed"], host
    st.detach()
    assert pinned_bytes() == base_pinned
    assert_restored(model, before, keys)


@pytest.mark.parametrize("device", DEVICES)
def test_resident_model_is_freed_and_restored_on_its_device(device):
    dev = _dev(device)
    model, ref_model = _models(dev, depth=6, dim=256, blocks_on_device=True)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    _synced(dev)
    used = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    st = LayerwiseStreamer(model.blocks, dev, resident=0, prefetch=1)
    st.attach()
    if dev.type == "cuda":
        freed = used - torch.cuda.memory_allocated(dev)
        assert freed >= st.packed_bytes - st.bound_bytes() - (1 << 20)  # originals left the GPU
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.detach(keep_pack=True)
    assert_restored(model, before, keys)  # back on their device, same objects, same bits
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()
    assert_restored(model, before, keys)


@cuda_only
def test_peak_memory_within_bound():
    dev = _dev("cuda")
    model, ref_model = _models(dev, depth=8, dim=512)
    x, t = _inputs(dev, tokens=32)
    weights = sum(p.numel() * p.element_size() for p in ref_model.blocks.state_dict().values())
    with torch.no_grad():
        ref_model(x, t)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        ref_model(x, t)
        activations = torch.cuda.max_memory_allocated(dev) - start
    del ref_model
    torch.cuda.empty_cache()
    for resident, prefetch in [(0, 1), (2, 2)]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        st = LayerwiseStreamer(model.blocks, dev, resident=resident, prefetch=prefetch)
        st.attach()
        with torch.no_grad():
            for _ in range(2):
                model(x, t)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev) - base
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


def _pageable_to_device(names: list[str]) -> list[str]:
    return [n for n in names if "Pageable -> Device" in n]


@cuda_only
def test_profiler_sees_device_to_host_and_pageable_copies():
    """The controls for the checks below: a real device-to-host copy, and a copy to the device
    from pageable memory, are seen by the names they are looked for by."""
    dev = _dev("cuda")
    assert _device_to_host(_profiled_event_names(lambda: torch.ones(1 << 20, device=dev).cpu()))
    pageable = torch.ones(1 << 20)
    assert _pageable_to_device(_profiled_event_names(lambda: pageable.to(dev, non_blocking=True)))


@cuda_only
def test_no_device_to_host_copies_while_streaming():
    dev = _dev("cuda")
    model, ref_model = _models(dev, depth=6, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=2)
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


@pytest.mark.parametrize("device", DEVICES)
def test_ordering_under_random_delays(device):
    """Slow compute must not let the copy stream overwrite a slot in use, and slow copies must be waited for."""
    dev = _dev(device)
    model, ref_model = _models(dev, depth=6, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    rng = random.Random(0)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=2)
    st.attach()

    def slow_compute(module, args, kwargs):
        if dev.type == "cuda":
            _delay(rng)  # after the engine's pre-hook: weights are bound

    for b in model.blocks:
        b.register_forward_pre_hook(slow_compute, with_kwargs=True)
    ring = st._schedule._window.ring
    copy_in = ring.copy_in

    def slow_copy(slot, host, tag, prepare=None):
        if dev.type == "cuda":  # the model delays its copies by itself
            _delay(rng, ring.stream)
        copy_in(slot, host, tag, prepare)

    ring.copy_in = slow_copy
    with torch.no_grad():
        for i in range(14):  # over 64 waits: the stall timer folds its backlog in on the way
            out = model(x, t, order=[0, 1, 4, 5] if i % 5 == 4 else None)  # streamed blocks skipped too
            if i % 5 != 4:
                assert torch.equal(out, ref), f"pass {i}"
    if dev.type == "cuda":
        assert st.telemetry.snapshot(wait=True)["compute_wait_s"] > 0
    st.close()


@pytest.mark.parametrize("device", DEVICES)
def test_exception_and_out_of_order_recover(device):
    dev = _dev(device)
    model, ref_model = _models(dev, depth=6, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
        ref_order = ref_model(x, t, order=[0, 3, 1, 2, 5])
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, dev, resident=0, prefetch=1)
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


@pytest.mark.parametrize("device", ASYNC_DEVICES)
def test_pinned_storage_counts_and_budget_fallback(device, caplog):
    pinned = for_device(_dev(device)).is_pinned
    base = pinned_bytes()
    hs = HostStorage([3 << 20, 5 << 20], pin=True, chunk_bytes=4 << 20)
    a, b = hs.buffer(0), hs.buffer(1)
    assert pinned(a) and pinned(b)
    assert pinned_bytes() - base == hs.pinned_bytes <= 1.05 * (8 << 20)
    hs.release()
    assert pinned_bytes() == base
    with caplog.at_level(logging.WARNING, logger="offload_core.host.pinned"):
        capped = HostStorage([1 << 20], pin=True, ram_budget_bytes=0)
        assert not pinned(capped.buffer(0))
    assert "cap" in caplog.text
    capped.release()
    assert pinned_bytes() == base


@cuda_only
def test_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """Registering a range twice fails (cudaErrorHostMemoryAlreadyRegistered) and leaves an error
    behind; the engine clears it, so the next kernel launch does not raise it."""
    from offload_core.host.pinned import _register

    hs = HostStorage([1 << 20], pin=True)
    buf = hs.buffer(0)
    assert hs.is_pinned(0)
    assert not _register(host_registrar(), buf.data_ptr(), 1 << 20, "a second registration")
    out = torch.ones(4, device="cuda") + 1
    torch.cuda.synchronize()
    assert out.sum().item() == 8.0
    hs.release()


@pytest.mark.parametrize("device", DEVICES)
def test_module_swap_round_trip_without_device_to_host(device):
    """The owner moves the module to the device (reading the master) and back; parking takes the
    device copies back by re-pointing, with no device-to-host copy."""
    dev = _dev(device)
    model, ref_model = _models(dev, depth=3, dim=128)
    for m in (model.embed, model.cond, model.head):
        m.to("cpu")
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    swap = ModuleSwap(model, pin=True)
    swap.note_reader(dev)
    tiers = swap.bytes_by_tier()
    if device != "cpu":
        assert tiers["pinned"] > 0 and tiers["pageable"] == 0, tiers
    else:
        assert tiers["pinned"] == 0 and tiers["pageable"] == swap.nbytes, tiers
    model.to(dev)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    if dev.type == "cuda":
        assert not _device_to_host(_profiled_event_names(swap.park))
    else:
        swap.park()
    assert model.blocks[0].qkv.weight.device.type == "cpu"
    assert swap.bytes_by_tier() == tiers
    model.to(dev)
    with torch.no_grad():
        assert torch.equal(bits(model(x, t)), bits(ref))
    swap.park()
    swap.close()
    assert_restored(model, before, keys)


@cuda_only
def test_module_swap_close_creates_no_context_on_other_gpus():
    """Freeing a master waits only for the devices that read it: run in a fresh process, a master
    used on GPU 0 leaves GPU 1 without a CUDA context."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests" / "unit")!r}]
        from toy_models import ToyDiT
        from offload_core import ModuleSwap
        model = ToyDiT(depth=2)
        swap = ModuleSwap(model, pin=True)
        swap.note_reader(torch.device("cuda", 0))
        model.to("cuda:0")
        swap.park()
        swap.close()
        print(torch._C._cuda_hasPrimaryContext(1))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("device", DEVICES)
def test_reclaim_takes_the_blocks_back_from_the_device_without_copying(device):
    """ComfyUI's own load of the model moves our tensor objects to the device between runs;
    reclaiming re-points them at the kept pack with no device-to-host copy, and the next attach
    packs nothing again."""
    dev = _dev(device)
    model, ref_model = _models(dev, depth=4, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=1)
    st.attach()
    st.detach(keep_pack=True)
    packed = st.telemetry.blocks_packed
    params = list(model.blocks.parameters())
    with torch.no_grad():
        for p in params:  # the same objects over device memory (a fresh copy on a CPU)
            p.data = p.data.to(dev, copy=True)
    if dev.type == "cuda":
        taken = []
        assert not _device_to_host(_profiled_event_names(lambda: taken.append(st.reclaim())))
        assert taken == [len(params)]
    else:
        assert st.reclaim() == len(params)
    assert all(p.device.type == "cpu" for p in params)
    st.attach()
    assert st.telemetry.blocks_packed == packed
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()


@cuda_only
def test_pack_views_read_as_pinned():
    """Core's pin_memory trusts is_pinned(): every tensor aliasing the pack must say True, or core
    registers the same pages again and leaves a CUDA error behind."""
    dev = _dev("cuda")
    model, _ = _models(dev, depth=4, dim=128)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=1, host_chunk_bytes=1 << 20)
    st.attach()
    st.detach(keep_pack=True)  # CPU tensors now alias the kept pack
    host = st._store.host
    assert len(host._chunks) > 1 and host.pageable_bytes == 0
    for i in range(len(st._plan.packs) + 1):
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


def _merged_reference(ref_model: ToyDiT, merge) -> ToyDiT:
    merged = copy.deepcopy(ref_model)
    with torch.no_grad():
        for i, blk in enumerate(merged.blocks):
            for name, p in blk.named_parameters():
                p.copy_(merge(i, name, p))
    return merged


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pin", [True, False])
def test_transform_runs_on_device_copies_under_delays(device, pin):
    """The merge runs on the copy stream after each copy and before the slot is ready: with the
    copy stream slowed at random, compute still only ever sees merged weights. A pageable pack
    (pin=False) goes through the staging worker the same way."""
    dev = _dev(device)
    model, ref_model = _models(dev, depth=6, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = _merged_reference(ref_model, _merge)(x, t)
    base = pinned_bytes()
    rng = random.Random(1)
    st = LayerwiseStreamer(model.blocks, dev, resident=2, prefetch=2, pin=pin)
    st.attach(_merge)
    ring = st._schedule._window.ring
    copy_in = ring.copy_in

    def slow_copy(slot, host, tag, prepare=None):
        if dev.type == "cuda":  # the model delays its copies by itself
            _delay(rng, ring.stream)
        copy_in(slot, host, tag, prepare)

    ring.copy_in = slow_copy
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(x, t), ref)
    ring.wait_issued()  # the next pass's first copies: a copy worker may still be merging them
    snap = st.telemetry.snapshot(wait=True)
    assert snap["transforms"] == 3 * (snap["copies"] + len(st.resident_indices)) and snap["sync_fallbacks"] == 0
    host = st.host_bytes()
    staged = device != "cpu" and not pin
    assert snap["staged_copies"] == (snap["copies"] if staged else 0), snap
    assert host["pageable"] == (0 if device != "cpu" and pin else host["packed"]), host
    st.close()
    assert pinned_bytes() == base


def _factors(depth: int, dim: int) -> list[list[torch.Tensor]]:
    """Per block, a LoRA's two factors for qkv.weight ([3 dim, dim]), in pageable host memory."""
    g = torch.Generator().manual_seed(5)
    return [[torch.randn(3 * dim, 4, generator=g) * 0.05, torch.randn(4, dim, generator=g) * 0.05]
            for _ in range(depth)]


@pytest.mark.parametrize("device", DEVICES)
def test_side_tensors_reach_the_merge_without_host_waits(device, request):
    """A merge reads its factors from the device, uploaded with the block's copy from pinned
    memory on the copy stream: no copy from pageable memory and no synchronizing call while the
    blocks stream (a pageable upload would hold the host until the copy stream got there)."""
    dev = _dev(device)
    depth, dim = 6, 128
    model, ref_model = _models(dev, depth=depth, dim=dim)
    x, t = _inputs(dev)
    factors = _factors(depth, dim)
    side = SideTensors(factors, dev)

    def merge_with(load):
        def merge(i: int, name: str, w: torch.Tensor) -> torch.Tensor:
            if name != "qkv.weight":
                return w
            up, down = load(i)
            return (w.float() + up.to(w.device, torch.float32) @ down.to(w.device, torch.float32)).to(w.dtype)
        return merge

    with torch.no_grad():
        ref = _merged_reference(ref_model, merge_with(lambda i: factors[i]))(x, t)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=2)
    st.attach(merge_with(side.load))
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # warm-up: every allocation made once
        if dev.type == "cuda":
            torch.cuda.synchronize()
            outs = []

            def passes():
                torch.cuda.set_sync_debug_mode("error")
                try:
                    outs.extend(model(x, t) for _ in range(2))
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            names = _profiled_event_names(passes)
            assert not _pageable_to_device(names), _pageable_to_device(names)[:5]
            assert all(torch.equal(out, ref) for out in outs)
        elif device == "model":  # the model's sync debug mode: what this thread synchronized
            syncs = request.getfixturevalue("stream_model").host_syncs
            seen = len(syncs)
            assert torch.equal(model(x, t), ref) and torch.equal(model(x, t), ref)
            assert [s for s in syncs[seen:] if s[0] == threading.current_thread().name] == []
        else:
            assert torch.equal(model(x, t), ref)
    assert side.uploads >= len(st.streamed_indices)
    st.close()
    side.close()


@pytest.mark.parametrize("device", ASYNC_DEVICES)
def test_partly_pinned_pack_stages_only_its_pageable_blocks(device):
    dev = _dev(device)
    model, ref_model = _models(dev, depth=6, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    probe = LayerwiseStreamer(model.blocks, dev, resident=0, prefetch=1)
    block = probe._plan.packs[0].nbytes
    # Room for the staging buffer (taken first) and about half of the blocks, one per chunk.
    budget = pinned_bytes() + 2 * PIECE_BYTES + 3 * (block + 4096)
    st = LayerwiseStreamer(model.blocks, dev, resident=0, prefetch=1, ram_budget_bytes=budget,
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


@pytest.mark.parametrize("device", ASYNC_DEVICES)
def test_compute_on_another_stream_waits_for_the_resident_upload(device):
    """Resident buffers are uploaded on the stream attach runs on; compute on any other stream must
    wait for that upload (on CUDA held back by a long sleep queued before it; the model checks the
    order itself)."""
    dev = _dev(device)
    ordering = for_device(dev)
    model, ref_model = _models(dev, depth=6, dim=256)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, dev, resident=4, prefetch=1)
    if dev.type == "cuda":
        torch.cuda._sleep(200_000_000)  # the resident copies queue behind this
    st.attach()
    side = ordering.stream("side")  # not ordered after the attach stream: only the engine's event orders it
    with torch.no_grad(), ordering.on(side):
        out = model(x, t)
    ordering.synchronize()
    assert torch.equal(out, ref)
    st.close()


@cuda_only
def test_capture_of_a_streamed_block_is_refused_and_the_engine_recovers():
    dev = _dev("cuda")
    model, ref_model = _models(dev, depth=4, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = ref_model(x, t)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=1)
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


@pytest.mark.parametrize("device", ASYNC_DEVICES)
def test_shared_pin_budget_caps_real_registrations(device):
    pinned = for_device(_dev(device)).is_pinned
    reports: list[int] = []
    base = pinned_bytes()
    try:
        set_pin_accounting(lambda: base + (6 << 20), reports.append)
        hs = HostStorage([4 << 20, 4 << 20], pin=True, chunk_bytes=4 << 20)
        first, second = hs.buffer(0), hs.buffer(1)
        assert pinned(first) and not pinned(second)  # the second would pass the shared cap
        assert reports[-1] == pinned_bytes() == base + (4 << 20)
        hs.release()
        assert reports[-1] == pinned_bytes() == base
    finally:
        set_pin_accounting(None, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pin", [True, False])
def test_phases_with_a_merge_bit_identical_and_reattached(device, pin):
    """Each block's phases stream as units of their own, merged on their device copies; a kept
    pack is attached again and gives the same results."""
    dev = _dev(device)
    model, ref_model = _models(dev, depth=4, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = _merged_reference(ref_model, _merge)(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=2, granularity="phase", pin=pin)
    for _ in range(2):
        st.attach(_merge)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x, t), ref)
        assert st.telemetry.snapshot(wait=True)["sync_fallbacks"] == 0
        st.detach(keep_pack=True)
    st.close()
    assert_restored(model, before, keys)


@pytest.mark.parametrize("device", DEVICES)
def test_disk_ring_with_a_merge_bit_identical(device, tmp_path):
    """Packs on disk come in through the host cache and the copy worker; the merge runs on the
    copy stream after each copy, and a cache entry is read into again only after the copy out of
    it ran (the model is told every disk read)."""
    dev = _dev(device)
    model, ref_model = _models(dev, depth=6, dim=128)
    x, t = _inputs(dev)
    with torch.no_grad():
        ref = _merged_reference(ref_model, _merge)(x, t)
    probe = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=2)
    unit = -(-max(probe._plan.packs[i].nbytes for i in probe.streamed_indices) // 4096) * 4096
    probe.close()
    disk = DiskOptions(cap_bytes=4 * unit, workers=2, spill_dir=str(tmp_path))  # fewer entries than units
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=2, disk=disk)
    st.attach(_merge)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x, t), ref)
    figures = st.figures(wait=True)
    assert figures["disk_reads"] > len(st.streamed_indices) and figures["sync_fallbacks"] == 0
    st.close()


def test_a_merge_that_waits_for_the_device_runs_on_the_copy_worker(stream_model):
    """Under the stream model: a merge whose math hands a value to the host (OFT's norm check, an
    ``inverse()``) synchronizes the copy stream. Issued from the sampling thread, it would hold
    that thread until the slot's last reader and the copy ran, with no counter seeing it; issued
    by the copy worker, the sampling thread never synchronizes, and when it needs a block whose
    merge is not done yet, that wait is counted (issue 30, item 5)."""
    dev = _dev("model")
    model, ref_model = _models(dev, depth=4, dim=128)
    x, t = _inputs(dev)
    gate, armed = threading.Event(), threading.Event()
    last = 3  # the last block: with prefetch 1 its copy in a pass is issued in that pass

    def checked_merge(i: int, name: str, w: torch.Tensor) -> torch.Tensor:
        if name == "qkv.weight" and w.float().norm().item() <= 0:  # a check the host must see
            raise ValueError("an empty weight")
        if i == last and name == "qkv.weight" and armed.is_set():
            gate.wait()
        return _merge(i, name, w)

    with torch.no_grad():
        ref = _merged_reference(ref_model, _merge)(x, t)
    st = LayerwiseStreamer(model.blocks, dev, resident=1, prefetch=1)  # a pinned pack: no staging
    st.attach(checked_merge)
    syncs = stream_model.host_syncs
    seen = len(syncs)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
        armed.set()

        def open_once_the_sampling_thread_waits() -> None:
            for _ in range(3000):  # it never waits when the merge runs on the sampling thread
                if st.telemetry.staging_waits:
                    break
                time.sleep(0.01)
            gate.set()

        opener = threading.Thread(target=open_once_the_sampling_thread_waits)
        opener.start()
        out = model(x, t)
        opener.join()
    assert torch.equal(out, ref)
    me = threading.current_thread().name
    assert [s for s in syncs[seen:] if s[0] == me] == [], "the sampling thread synchronized"
    assert any(s[0] != me for s in syncs[seen:]), "the merge's own synchronize is not seen"
    snap = st.telemetry.snapshot(wait=True)
    # At least the wait the gate forces (a copy of the pass before may have kept it waiting too).
    assert snap["staging_waits"] >= 1 and snap["staged_copies"] == 0, snap
    st.close()
