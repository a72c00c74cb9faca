"""The disk tier on the CPU: the store (a spill file of the engine's own), the host cache, and the
streamer running real torch modules from disk."""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

import pytest
import torch
from toy_models import ToyDiT, assert_restored, bits, inputs, snapshot
from torch import nn

from offload_core.disk.host_cache import CacheTooSmallError, DiskTelemetry, HostCache, _union
from offload_core.disk.sources import DiskSources
from offload_core.disk import store as store_module
from offload_core.disk.store import DiskStore
from offload_core.disk.tier import DiskOptions
from offload_core.host.packing import PackedBlock
from offload_core.host.pinned import HostStorage
from offload_core.host.tensor_refs import tensor_refs
from offload_core.layerwise.streamer import LayerwiseStreamer

PAGE = 4096


def _scratch(nbytes: int) -> tuple[HostStorage, torch.Tensor]:
    size = -(-nbytes // PAGE) * PAGE
    storage = HostStorage([size], pin=False)
    return storage, storage.buffer(0)


def _place(store: DiskStore, modules: list[nn.Module]) -> list[PackedBlock]:
    packs = [PackedBlock(tensor_refs(m, i), index=i) for i, m in enumerate(modules)]
    storage, buf = _scratch(max(p.nbytes for p in packs))
    try:
        for i, p in enumerate(packs):
            store.write(i, p, buf)
    finally:
        store.bind(dict(enumerate(packs)))
        storage.release()
    return packs


def test_store_spills_every_pack_and_hands_back_maps_of_it(tmp_path):
    torch.manual_seed(0)
    modules = [nn.Linear(32, 48) for _ in range(3)]
    want = [snapshot(m) for m in modules]
    store = DiskStore(str(tmp_path / "spill"))
    packs = _place(store, modules)
    assert store.spill_bytes >= sum(p.nbytes for p in packs)
    for m, before in zip(modules, want):  # the same objects, values, dtypes and strides, now maps
        assert_restored(m, before, list(before))
    # A write into the map stays in memory: the spill file keeps the bytes placed.
    with torch.no_grad():
        modules[0].weight.mul_(2)
    # Each pack reads back in its packed layout, whole or by page-aligned ranges.
    for i, pack in enumerate(packs):
        storage, dst = _scratch(pack.nbytes)
        assert store.read(i, dst) == pack.nbytes
        for e, view in zip(pack.entries, pack.views(dst)):
            assert torch.equal(bits(view), want[i][e.owner[1]][1]), (i, e.label)  # the values placed
        half = store.read(i, dst, PAGE, 2 * PAGE)
        assert half == min(2 * PAGE, pack.nbytes - PAGE)
        storage.release()
    store.close()


def test_a_spill_file_that_cannot_be_mapped_is_read_back_into_ram(tmp_path, monkeypatch):
    """The failure is forced (mmap refusing, as it does without address space or with too many
    maps): the module must be whole, with RAM copies of what was written."""
    import mmap
    import types

    import offload_core.disk.store as disk

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    torch.manual_seed(3)
    modules = [nn.Linear(24, 24) for _ in range(2)]
    want = [snapshot(m) for m in modules]
    store = DiskStore(str(tmp_path / "spill"))
    monkeypatch.setattr(disk, "mmap", types.SimpleNamespace(mmap=refuse, ACCESS_COPY=mmap.ACCESS_COPY))
    _place(store, modules)
    for m, before in zip(modules, want):
        assert_restored(m, before, list(before))
    store.close()


def test_a_failed_write_gives_the_pack_its_values_back(tmp_path):
    torch.manual_seed(1)
    modules = [nn.Linear(40, 40), nn.Linear(40, 8)]
    want = [snapshot(m) for m in modules]
    store = DiskStore(str(tmp_path / "spill"))
    packs = [PackedBlock(tensor_refs(m, i), index=i) for i, m in enumerate(modules)]
    storage, buf = _scratch(max(p.nbytes for p in packs))
    store.write(0, packs[0], buf)
    store._spill._fd, real = os.open(os.devnull, os.O_RDONLY), store._spill._fd  # writes now fail
    direct, store._spill._direct = store._spill._direct, None
    with pytest.raises(OSError):
        store.write(1, packs[1], buf)
    os.close(store._spill._fd)
    store._spill._fd, store._spill._direct = real, direct
    store.bind({0: packs[0]})
    storage.release()
    for m, before in zip(modules, want):  # the written pack as maps, the failed one as fresh memory
        assert_restored(m, before, list(before))
    store.close()
    store.close()  # once: a second close gives back nothing


@pytest.mark.parametrize("still_mapped", [False, True])
def test_with_windows_file_rules_the_spill_file_is_deleted_when_the_store_closes(tmp_path, monkeypatch,
                                                                               caplog, still_mapped):
    """Windows cannot delete an open file: the spill file keeps its name while the store holds
    it, and is deleted at the close; one a model still maps (Windows refuses the delete; Linux
    would not, so the refusal is given here) is named in the log, to be deleted later."""
    monkeypatch.setattr(store_module.os, "name", "nt")
    spill = tmp_path / "spill"
    store = DiskStore(str(spill))
    modules = [nn.Linear(16, 16) for _ in range(2)]
    _place(store, modules)
    [kept] = list(spill.iterdir())
    if still_mapped:
        def refuse(path, *args, **kwargs):
            raise PermissionError(32, "The process cannot access the file because it is being used", path)
        monkeypatch.setattr(store_module.os, "unlink", refuse)
    with caplog.at_level("INFO", logger=store_module.log.name):
        store.close()
    assert kept.exists() == still_mapped
    assert (f"the spill file {kept} is still mapped; delete it later" in caplog.text) == still_mapped
    x = torch.randn(2, 16)
    assert torch.equal(modules[0](x), modules[0](x))  # the maps outlive the store's descriptors


@pytest.mark.skipif(os.name == "nt", reason="Windows keeps an open file's name")
def test_the_spill_file_has_no_name_once_open(tmp_path):
    spill = tmp_path / "spill"
    store = DiskStore(str(spill))
    modules = [nn.Linear(16, 16) for _ in range(2)]
    _place(store, modules)
    assert store.spill_bytes > 0
    assert list(spill.iterdir()) == []
    store.close()
    x = torch.randn(2, 16)
    assert torch.equal(modules[0](x), modules[0](x))  # the maps outlive the store's descriptors


def _cache(n: int, entries: int, depth: int, tmp_path: Path):
    modules = [nn.Linear(64, 64) for _ in range(n)]
    sources = DiskSources(str(tmp_path / "spill"), None)
    placed = [PackedBlock(tensor_refs(m, i), index=i) for i, m in enumerate(modules)]
    sources.plan(placed)
    sources.place(None, len(placed))
    sizes = {i: sources.buffer_bytes(i) for i in range(n)}
    tel = DiskTelemetry()
    entry = max(sizes.values())
    cache = HostCache(sources, sizes, list(range(n)), entry_bytes=entry, count=entries, workers=2, depth=depth,
                      pin=False, ram_budget_bytes=None, device=torch.device("cpu"), telemetry=tel)
    return cache, tel, sources, placed


@pytest.mark.parametrize("n,entries,depth", [(6, 4, 1), (6, 4, 2), (10, 5, 1), (12, 6, 2), (6, 6, 1)])
def test_cache_keeps_units_needed_soon_and_hits_on_a_cyclic_order(tmp_path, n, entries, depth):
    """Least-recently-used would never hit on a cyclic order with fewer entries than units; evicting
    the unit needed last keeps entries - depth - 1 units across passes (the rest of the entries
    hold the unit being copied and the read-ahead)."""
    cache, tel, store, placed = _cache(n, entries, depth, tmp_path)
    try:
        for p in range(4):
            tel.reset()
            for u in range(n):
                lease = cache.acquire(u)
                buf = lease.wait()
                pack = placed[u]
                for e, view in zip(pack.entries, pack.views(buf)):
                    assert torch.equal(bits(view), bits(e.original)), (p, u, e.label)
                lease.release()
            hits = tel.snapshot()["cache_hits"]
            if p == 0:
                assert hits == 0  # nothing was read before the first pass
            elif entries >= n:
                assert hits == n
            else:
                assert entries - depth - 1 <= hits < n, (p, hits)
        assert tel.snapshot()["disk_read_errors"] == 0
    finally:
        cache.close()
        store.close()


def test_a_read_in_flight_at_a_reset_counts_whole_in_the_window_where_it_ends():
    """Read-ahead runs across passes, so a run's counters are reset while reads are in flight.
    Such a read counts whole, bytes and time, where it ends; parallel reads count their time once."""
    tel = DiskTelemetry()
    first, second = tel.read_started(), tel.read_started()
    tel.reset()
    tel.read_ended(first, PAGE, True)
    tel.read_ended(second, PAGE, True)
    third = tel.read_started()
    tel.read_ended(third, PAGE, True)
    figures = tel.snapshot()
    assert figures["disk_reads"] == 3 and figures["disk_bytes_read"] == 3 * PAGE
    assert 0 < figures["disk_read_busy_s"] and figures["disk_read_gibps"] > 0
    # Reads side by side are busy time once: the union of their intervals.
    assert _union([(20.0, 21.0), (10.0, 11.0), (10.5, 11.5), (11.5, 12.0)]) == [(10.0, 12.0), (20.0, 21.0)]


def test_a_request_waits_while_every_entry_is_held(tmp_path):
    cache, tel, store, _ = _cache(4, 2, 1, tmp_path)
    try:
        first, second = cache.acquire(0), cache.acquire(1)
        first.wait(), second.wait()
        got = []
        waiter = threading.Thread(target=lambda: got.append(cache.acquire(2).wait() is not None))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not got  # both entries are leased: the third unit waits
        first.release()
        waiter.join(60)
        assert got == [True]
        second.release()
    finally:
        cache.close()
        store.close()


GRID = [  # granularity, resident blocks, prefetch, cache entries
    ("block", 0, 1, 3),
    ("block", 0, 2, 5),
    ("block", 2, 1, 3),
    ("phase", 0, 1, 3),
    ("phase", 0, 3, 6),
    ("phase", 1, 2, 8),
]


def _disk_streamer(model, tmp_path, granularity, resident, prefetch, entries):
    probe = LayerwiseStreamer(model.blocks, "cpu", resident=resident, prefetch=prefetch, granularity=granularity)
    unit = -(-max(probe._plan.packs[i].nbytes for i in probe.streamed_indices) // PAGE) * PAGE
    disk = DiskOptions(cap_bytes=entries * unit, workers=2, spill_dir=str(tmp_path))
    return LayerwiseStreamer(model.blocks, "cpu", resident=resident, prefetch=prefetch, granularity=granularity,
                             disk=disk)


@pytest.mark.parametrize("device", ["cpu", "model"])
@pytest.mark.parametrize("granularity,resident,prefetch,entries", GRID)
def test_streamed_from_disk_bit_identical_and_handed_back(tmp_path, granularity, resident, prefetch, entries, device):
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    st = _disk_streamer(model, tmp_path, granularity, resident, prefetch, entries)
    for run in range(2):
        st.reset_figures()
        st.attach()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x, t), ref)
        figures = st.figures()
        assert figures["disk_reads"] > 0 and figures["order_misses"] == 0 and figures["sync_fallbacks"] == 0
        assert figures["peak_materialized_bytes"] <= st.bound_bytes()
        assert figures["blocks_packed"] == (0 if run else len([p for p in st._plan.packs + [st._plan.shared] if p.entries]))
        assert set(st.unit_states()) <= {"resident", "in_flight", "cached", "disk"}
        st.detach(keep_pack=True)
        assert_restored(model, before, keys)  # the maps hold the same values in the same objects
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()
    assert_restored(model, before, keys)


def _lora_like(model: ToyDiT):
    def transform(block: int, name: str, w: torch.Tensor) -> torch.Tensor:
        if name not in ("qkv.weight", "proj.weight"):
            return w
        g = torch.Generator().manual_seed(block * 7 + len(name))
        return (w.float() + torch.randn(w.shape, generator=g) * 0.05).to(w.dtype)

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for i, b in enumerate(ref.blocks):
            for name, p in b.named_parameters():
                p.copy_(transform(i, name, p))
    return transform, ref


@pytest.mark.parametrize("granularity", ["block", "phase"])
def test_transform_on_device_copies_from_disk(tmp_path, granularity):
    model = ToyDiT(depth=6)
    x, t = inputs()
    transform, merged = _lora_like(model)
    with torch.no_grad():
        want, plain = merged(x, t), model(x, t)
    assert not torch.equal(want, plain)
    st = _disk_streamer(model, tmp_path, granularity, 1, 1, 3)
    st.attach(transform=transform)
    with torch.no_grad():
        assert torch.equal(model(x, t), want) and torch.equal(model(x, t), want)
    assert st.figures()["transforms"] > 0
    st.detach(keep_pack=True)
    st.attach()  # the disk holds base weights: no transform, plain results
    with torch.no_grad():
        assert torch.equal(model(x, t), plain)
    st.close()


def _disk_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("offload-disk")]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("retire", ["close", "detach"])
def test_retiring_a_detached_disk_engine_releases_readers_cache_and_descriptors_once(tmp_path, retire):
    """A disk-placed engine between runs (detached, keeping its pack) is retired by a settings
    change or its model's end (close) or told to free its pack (detach): its readers stop, its
    cache is freed and its descriptors are given back; the module keeps working on the one map of
    the spill file, which is all it holds (its last descriptor goes with that map)."""
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before_fds, before_threads = _fds(), len(_disk_threads())
    st = _disk_streamer(model, tmp_path, "phase", 0, 1, 3)
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.detach(keep_pack=True)
    assert len(_disk_threads()) == before_threads + 2 and st.host_bytes()["cache"] > 0
    getattr(st, retire)() if retire == "close" else st.detach(keep_pack=False)
    assert len(_disk_threads()) == before_threads and st.host_bytes()["cache"] == 0
    assert _fds() <= before_fds + 1  # the whole-file map's own descriptor, held by the module's tensors
    getattr(st, retire)() if retire == "close" else st.detach(keep_pack=False)  # nothing twice
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    if retire == "detach":  # placed again from the maps, into a new spill file
        st.attach()
        with torch.no_grad():
            assert torch.equal(model(x, t), ref)
        st.close()
    assert len(_disk_threads()) == before_threads


def test_a_read_error_fails_the_pass_clearly_and_the_model_stays_whole(tmp_path):
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    st = _disk_streamer(model, tmp_path, "block", 0, 1, 3)
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    spill = st._store.disk.sources.spill._spill
    os.close(spill._fd)  # every later read of the spill file fails with a real OS error
    spill._fd = os.open(os.devnull, os.O_RDONLY)
    if spill._direct is not None:
        os.close(spill._direct)
        spill._direct = None
    with torch.no_grad(), pytest.raises(RuntimeError, match="back from .*spill"):
        for _ in range(3):
            model(x, t)
    assert st.figures()["disk_read_errors"] > 0
    st.detach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # the maps were never the problem
    st.close()


def test_a_cache_too_small_is_refused_before_anything_moves(tmp_path):
    model = ToyDiT(depth=6)
    before, keys = snapshot(model), list(model.state_dict())
    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=2,
                           disk=DiskOptions(cap_bytes=PAGE, spill_dir=str(tmp_path)))
    with pytest.raises(CacheTooSmallError, match="disk streaming needs 4 at once"):  # 3 slots + 1 read ahead
        st.attach()
    assert not st.attached and list(tmp_path.iterdir()) == []
    assert_restored(model, before, keys)


def test_auto_prefetch_starts_from_what_a_small_cache_holds(tmp_path):
    """A cache of three units: prefetch 2 (3 slots + 1 read ahead) would not fit, so auto starts at
    1 where a fixed 2 is refused; the run is right."""
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    fixed = _disk_streamer(model, tmp_path / "fixed", "block", 0, 2, 3)
    with pytest.raises(CacheTooSmallError, match="needs 4 at once"):
        fixed.attach()
    st = _disk_streamer(model, tmp_path / "auto", "block", 0, "auto", 3)
    st.attach()
    assert st._plan.rules.prefetch == 1
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x, t), ref)
    st.close()


def test_a_model_that_fits_the_cap_stays_in_ram(tmp_path):
    model = ToyDiT(depth=4)
    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1,
                           disk=DiskOptions(cap_bytes=1 << 30, spill_dir=str(tmp_path)))
    st.attach()
    assert not st.disk_figures()["active"] and set(st.unit_states()) <= {"streamed", "in_flight"}
    st.close()


@pytest.mark.parametrize("kwargs,message", [
    ({"cap_bytes": 0}, "cap_bytes must be an int >= 1"),
    ({"cap_bytes": 1 << 20, "workers": 0}, "workers must be an int >= 1"),
    ({"cap_bytes": 1 << 20, "spill_dir": ""}, "spill_dir must be a folder path"),
])
def test_disk_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiskOptions(**kwargs)
