"""The stream model's checker can fail: per hazard, the engine with one wait or one record taken
out (monkeypatched), or a slot overwritten early, and the model naming the buffer, both
operations and their streams. Each scenario first runs unchanged and must leave the model quiet,
so the mutation is what trips it.

The hazards (tests/unit/stream_model.py): a read not ordered after the last write, a write not
ordered after a read, a free or unpin of memory still in use, a host access without a
synchronize of the stream that last touched the memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from stream_model import ModelEvent, StreamModel, installed
from toy_models import ToyDiT, inputs

from offload_core import HostStorage, LayerwiseStreamer
from offload_core.device.slots import SlotRing
from offload_core.device.telemetry import Telemetry
from offload_core.disk.host_cache import Lease
from offload_core.disk.tier import DiskOptions
from offload_core.ordering import for_device

CPU = torch.device("cpu")
Scenario = Callable[[StreamModel, pytest.MonkeyPatch, bool], object]


def _checked(scenario: Scenario, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[str]]:
    """The scenario run unchanged (the model stays quiet), then mutated: what it returned and
    the model's report of the mutated run."""
    for mutated in (False, True):
        model = StreamModel(seed=7, strict=False)
        with monkeypatch.context() as patches, installed(model, patches):
            result = scenario(model, patches, mutated)
        if not mutated:
            assert model.violations == [], model.violations
    return result, model.violations


def _named(violations: list[str], *parts: str) -> str:
    """The first report naming every one of ``parts``."""
    found = [v for v in violations if all(p in v for p in parts)]
    assert found, f"no report names {parts}: {violations[:5]}"
    return found[0]


def _streamed(model: StreamModel, monkeypatch: pytest.MonkeyPatch, mutate: Callable[[LayerwiseStreamer], None] | None,
              *, pin: bool = True, hold: bool = False) -> bool:
    """One pass of a toy model with every block but one streamed; whether it gave the right
    output. ``mutate`` gets the attached streamer; ``hold`` keeps the copy stream's copies back
    until the pass is over (a slow link)."""
    net = ToyDiT(depth=4, dim=64)
    ref = copy.deepcopy(net)
    x, t = inputs(tokens=8)
    with torch.no_grad():
        want = ref(x, t)
    st = LayerwiseStreamer(net.blocks, CPU, resident=1, prefetch=1, pin=pin)
    try:
        with torch.no_grad():
            if hold:
                with model.hold():
                    st.attach()
                    if mutate is not None:
                        mutate(st)
                    out = net(x, t)
            else:
                st.attach()
                if mutate is not None:
                    mutate(st)
                out = net(x, t)
                out = net(x, t)
    finally:
        st.close()
    return torch.equal(out, want)


def _skip_waits(stream, events: list[ModelEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    """``stream`` no longer waits for ``events`` (the engine's wait removed)."""
    wait = stream.wait_event
    monkeypatch.setattr(stream, "wait_event", lambda e: None if any(e is x for x in events) else wait(e))


def _unrecorded(events: list[ModelEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    """``events`` are never recorded (the engine's record removed)."""
    for event in events:
        monkeypatch.setattr(event, "record", lambda stream=None: None)


# ---------------------------------------------------------------- a read not ordered after the write
def test_compute_without_the_wait_for_its_slot_is_named_and_reads_stale_bytes(monkeypatch):
    def scenario(model, patches, mutated):
        mutate = (lambda st: _skip_waits(model.default, st._schedule._window.ring._ready, patches)) if mutated else None
        return _streamed(model, patches, mutate, hold=mutated)  # held, the right order would wait forever

    right, violations = _checked(scenario, monkeypatch)
    assert not right  # the copies were held back: compute read slots they had not reached
    _named(violations, "unordered read: slot", "in ToyBlock.forward (read) on stream 'default'",
           "copy in SlotRing.copy_in (write) on stream 'copy'")


@pytest.mark.parametrize("events,hazard", [("_ready", "unordered read: slot"), ("_free", "unordered write: slot")],
                         ids=["ready", "free"])
def test_a_slot_event_never_recorded_is_named(monkeypatch, events, hazard):
    """Its ready event never recorded, compute's wait orders nothing: its reads are not ordered
    after the copy. Its free event never recorded, the next copy into it is not ordered after
    the reads."""

    def scenario(model, patches, mutated):
        mutate = (lambda st: _unrecorded(getattr(st._schedule._window.ring, events), patches)) if mutated else None
        return _streamed(model, patches, mutate)

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, hazard, "(read) on stream 'default'", "copy in SlotRing.copy_in (write) on stream 'copy'")


def test_a_slot_overwritten_while_its_block_runs_is_named(monkeypatch):
    """A copy into the running block's slot, queued on the copy stream after the block's wait:
    the block's reads are not ordered after it."""

    def scenario(model, patches, mutated):
        def overwrite(st):
            window, ordering = st._schedule._window, for_device(CPU)
            ring = window.ring

            def early(module, args, kwargs):  # after the engine's own pre-hook: the block is bound
                slot = window._slot_of[window.running]
                with ordering.on(ring.stream):
                    ordering.copy(ring.buffers[slot][:64], torch.zeros(64, dtype=torch.uint8))

            for i in st.streamed_indices:
                st.blocks[i].register_forward_pre_hook(early, with_kwargs=True)

        return _streamed(model, patches, overwrite if mutated else None)

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "unordered read: slot", "(read) on stream 'default'", "copy in ", "early (write) on stream 'copy'")


# ---------------------------------------------------------------- a write not ordered after a read
def test_a_copy_that_does_not_wait_for_the_slot_s_last_reader_is_named(monkeypatch):
    def scenario(model, patches, mutated):
        def mutate(st):
            ring = st._schedule._window.ring
            _skip_waits(ring.stream, ring._free, patches)

        return _streamed(model, patches, mutate if mutated else None)

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "unordered write: slot", "copy in SlotRing.copy_in (write) on stream 'copy'",
           "in ToyBlock.forward (read) on stream 'default'")


# ---------------------------------------------------------------- a free or unpin of memory in use
class _NoDeviceSync:
    """An ordering whose device-wide synchronize was taken out."""

    def __init__(self, ordering) -> None:
        self._ordering = ordering

    def __getattr__(self, name: str):
        return getattr(self._ordering, name)

    def synchronize(self) -> None:
        pass


def test_slots_freed_while_a_block_on_another_stream_reads_them_are_named(monkeypatch):
    def scenario(model, patches, mutated):
        ordering = for_device(CPU)
        ring = SlotRing(CPU, 2, 4096, Telemetry())
        if mutated:
            patches.setattr(ring, "_ordering", _NoDeviceSync(ordering))
        ring.copy_in(0, torch.ones(3000, dtype=torch.uint8), "a")
        compute = ordering.stream("compute")
        with ordering.on(compute):
            ring.wait_ready(0)
            ring.buffers[0][:3000].sum()
            ring.mark_free(0)
        ring.close()

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "free while in use: slot 0", "allocated on stream 'default'",
           "aten.sum.default in ", "(read) on stream 'compute'")


def test_resident_buffers_freed_while_compute_on_another_stream_reads_them_are_named(monkeypatch):
    def scenario(model, patches, mutated):
        net = ToyDiT(depth=3, dim=64)
        x, t = inputs(tokens=8)
        # Every block resident (no slot ring), a pageable pack (no unpin that waits for the device).
        st = LayerwiseStreamer(net.blocks, CPU, resident=3, pin=False)
        if mutated:
            patches.setattr(st, "_ordering", _NoDeviceSync(st._ordering))  # detach's synchronize
        st.attach()
        side = for_device(CPU).stream("side")
        with torch.no_grad(), for_device(CPU).on(side):
            net(x, t)
        st.close()

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "free while in use: resident unit", "allocated on stream 'default'", "(read) on stream 'side'")


def test_pinned_memory_unpinned_under_a_queued_copy_is_named(monkeypatch):
    def scenario(model, patches, mutated):
        ordering = for_device(CPU)
        storage = HostStorage([1 << 16], pin=True, label="a pack")
        storage.note_reader(CPU)
        if mutated:
            patches.setattr(storage, "_readers", {})  # release's wait for its readers
        dst = ordering.buffer(1 << 16, "a slot")
        with ordering.on(ordering.stream("copy")):
            ordering.copy(dst, storage.buffer(0))
        storage.release()

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "free while in use: a pack, chunk 0", "unpinned by the host",
           "scenario (read) on stream 'copy'")


# ---------------------------------------------------------------- a host access without synchronize
def test_a_bounce_half_refilled_before_its_copy_ran_is_named(monkeypatch):
    """A pageable pack is staged through the pinned bounce buffer: without the wait for the copy
    out of a half, the worker refills it under that copy."""

    def scenario(model, patches, mutated):
        def mutate(st):
            for event in st._schedule._window.ring._stager._drained:
                patches.setattr(event, "synchronize", lambda: None)

        return _streamed(model, patches, mutate if mutated else None, pin=False)

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "host access without synchronize: staging bounce buffer, chunk 0",
           "in Stager._pieces (write) by the host", "synchronize of stream 'copy'", "copy in Stager._pieces (read)")


def test_a_host_read_of_a_slot_its_stream_never_waited_for_is_named(monkeypatch):
    """A block hands a weight to the host (``.item()`` synchronizes the current stream only): with
    the compute stream's wait for the slot taken out, nothing orders that read after the copy."""

    def scenario(model, patches, mutated):
        def mutate(st):
            if mutated:
                _skip_waits(model.default, st._schedule._window.ring._ready, patches)

            def peek(module, args, kwargs):
                module.qkv.weight[0, 0].item()

            for i in st.streamed_indices:
                st.blocks[i].register_forward_pre_hook(peek, with_kwargs=True)

        return _streamed(model, patches, mutate)

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "host access without synchronize: slot", "aten._local_scalar_dense.default in ",
           "(read) by the host", "synchronize of stream 'copy'", "copy in SlotRing.copy_in (write)")


def test_a_timeline_resolved_without_synchronize_is_named(monkeypatch):
    def scenario(model, patches, mutated):
        net = ToyDiT(depth=4, dim=64)
        x, t = inputs(tokens=8)
        st = LayerwiseStreamer(net.blocks, CPU, resident=1, prefetch=1, timing=False)
        st.record_timeline(True)
        st.attach()
        with torch.no_grad():
            for _ in range(2):
                net(x, t)
        if mutated:
            patches.setattr(ModelEvent, "synchronize", lambda self: None)  # Timeline._ms's waits
        st.timeline()  # resolved while attached, with copies of the next pass queued
        patches.undo()
        st.close()

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "host access without synchronize: the time of an event on stream 'copy'", "Timeline._ms")


def test_a_disk_cache_entry_read_into_under_its_copy_is_named(monkeypatch, tmp_path: Path):
    """Packs on disk: a cache entry is read into again only after the copy out of it ran (its
    fence). Without the fence, the disk read is a host write under that copy."""

    def scenario(model, patches, mutated):
        if mutated:
            release = Lease.release
            patches.setattr(Lease, "release", lambda lease, fence=None: release(lease))
        net = ToyDiT(depth=6, dim=64)
        x, t = inputs(tokens=8)
        probe = LayerwiseStreamer(net.blocks, CPU, resident=0, prefetch=1)
        unit = -(-max(probe._plan.packs[i].nbytes for i in probe.streamed_indices) // 4096) * 4096
        probe.close()
        disk = DiskOptions(cap_bytes=3 * unit, workers=1, spill_dir=str(tmp_path))
        st = LayerwiseStreamer(net.blocks, CPU, resident=0, prefetch=1, disk=disk)
        st.attach()
        with torch.no_grad():
            for _ in range(2):
                net(x, t)
        st.close()

    _, violations = _checked(scenario, monkeypatch)
    _named(violations, "host access without synchronize: disk cache, chunk", "disk read in DiskStore.read (write) by the host",
           "synchronize of stream 'copy'", "copy in CacheRing._copy (read)")
