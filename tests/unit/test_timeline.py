"""The picture of a pass (offload_core/device/timeline.py) on a real CPU streamer over real torch
modules: nothing recorded unless asked for, and when asked, one copy, wait and compute per
streamed unit of the last complete pass, in a sane order, with the disk reads of a disk run."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from toy_models import ToyDiT, inputs

from offload_core.device.slots import SlotRing
from offload_core.device.timeline import verdict
from offload_core.disk.tier import DiskOptions
from offload_core.layerwise.streamer import LayerwiseStreamer
from offload_core.ordering import Ordering

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "unit-timeline"
PAGE = 4096


@pytest.fixture
def spill_dir(request):
    """A folder under tests/artifacts/ for one test's spill file, removed afterwards."""
    path = ARTIFACTS / request.node.name.replace("[", "-").replace("]", "")
    path.mkdir(parents=True, exist_ok=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(streamer: LayerwiseStreamer, model: ToyDiT, passes: int) -> torch.Tensor:
    x, t = inputs()
    streamer.attach()
    try:
        with torch.no_grad():
            for _ in range(passes):
                out = model(x, t)
    finally:
        streamer.detach(keep_pack=True)
    return out


def _by_kind(timeline: dict, kind: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for span in timeline["spans"]:
        if span["kind"] == kind:
            out.setdefault(span["unit"], []).append(span)
    return out


def _check_pass(streamer: LayerwiseStreamer, timeline: dict) -> None:
    """One copy, one wait and one compute per streamed unit, each copy before its compute, the
    units in run order, their compute spans one after the other."""
    streamed = streamer.streamed_indices
    assert [u["unit"] for u in timeline["units"]] == streamed
    blocks = {i: streamer.units[i].block for i in streamed}
    assert [u["block"] for u in timeline["units"]] == [blocks[i] for i in streamed]
    copies, waits, computes = (_by_kind(timeline, k) for k in ("copy", "wait", "compute"))
    for kind in (copies, waits, computes):
        assert sorted(kind) == sorted(streamed) and all(len(v) == 1 for v in kind.values())
    previous_end = float("-inf")
    for i in streamed:
        copy, wait, compute = copies[i][0], waits[i][0], computes[i][0]
        assert copy["bytes"] == streamer.describe_units()[i]["bytes"]
        assert copy["start_ms"] <= copy["end_ms"] <= compute["start_ms"]
        assert wait["end_ms"] == compute["start_ms"] and wait["start_ms"] <= wait["end_ms"]
        assert compute["start_ms"] >= previous_end and compute["end_ms"] >= compute["start_ms"]
        assert all(s["block"] == blocks[i] for s in (copy, wait, compute))
        previous_end = compute["end_ms"]
    assert waits[streamed[0]][0]["start_ms"] == 0.0  # the pass starts with its first unit's wait
    assert timeline["pass_ms"] == pytest.approx(previous_end)
    assert timeline["bound_by"] in ("link", "copies", "disk", "compute", "compute_between_copies")


def test_off_by_default_records_nothing():
    model = ToyDiT(depth=4)
    streamer = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1, pin=False)
    try:
        _run(streamer, model, passes=3)
        assert streamer.telemetry.timeline is None
        assert streamer.timeline() is None
    finally:
        streamer.close()


@pytest.mark.parametrize("device", ["cpu", "model"])
@pytest.mark.parametrize("granularity", ["block", "phase"])
def test_records_the_last_complete_pass_of_each_streamed_unit(granularity, device):
    """On a CPU every copy runs on the sampling thread. Under the stream model the pack is
    pageable (pin=False), so every copy is staged by the copy worker, and still on the picture."""
    model = ToyDiT(depth=5)
    x, t = inputs()
    with torch.no_grad():
        reference = model(x, t)
    streamer = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1, pin=False,
                                 granularity=granularity)
    try:
        streamer.record_timeline(True)
        out = _run(streamer, model, passes=3)
        assert torch.equal(out, reference)  # recording changes nothing the blocks compute
        timeline = streamer.timeline()
        assert timeline is not None and timeline["clock"] == ("host" if device == "cpu" else
                                                               "cuda events (disk reads: host clock)")
        _check_pass(streamer, timeline)
        assert not _by_kind(timeline, "disk")  # streaming from RAM reads nothing from disk
        blocking = [s["blocking"] for s in timeline["spans"] if s["kind"] == "copy"]
        assert blocking == [device == "cpu"] * len(blocking)  # CPU copies; staged copies do not block
        # Off again: the next attach records nothing and the recording is dropped.
        streamer.record_timeline(False)
        assert streamer.timeline() is None
        _run(streamer, model, passes=2)
        assert streamer.telemetry.timeline is None and streamer.timeline() is None
    finally:
        streamer.close()


def test_a_pass_cut_short_is_not_the_picture():
    """Only a pass in which every streamed unit computed is shown: a run that fails in its first
    pass leaves nothing; one that fails in its second shows the first."""
    model = ToyDiT(depth=4)
    x, t = inputs()
    streamer = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1, pin=False)
    try:
        streamer.record_timeline(True)
        model.blocks[2].fail = True
        with pytest.raises(RuntimeError, match="injected failure"):
            _run(streamer, model, passes=1)
        assert streamer.timeline() is None
        streamer.attach()
        try:
            with torch.no_grad():
                model.blocks[2].fail = False
                model(x, t)
                model.blocks[2].fail = True
                with pytest.raises(RuntimeError, match="injected failure"):
                    model(x, t)
        finally:
            streamer.detach(keep_pack=True)
        _check_pass(streamer, streamer.timeline())
    finally:
        model.blocks[2].fail = False
        streamer.close()


@pytest.mark.parametrize("device", ["cpu", "model"])
@pytest.mark.parametrize("granularity", ["block", "phase"])
def test_a_disk_run_shows_its_reads(spill_dir, granularity, device):
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        reference = model(x, t)
    probe = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1, granularity=granularity)
    unit = -(-max(probe._plan.packs[i].nbytes for i in probe.streamed_indices) // PAGE) * PAGE
    probe.close()
    # A cache of three units for six or more: every pass reads most units again.
    disk = DiskOptions(cap_bytes=3 * unit, workers=1, spill_dir=str(spill_dir))
    streamer = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1, granularity=granularity,
                                 disk=disk)
    try:
        streamer.record_timeline(True)
        out = _run(streamer, model, passes=3)
        assert torch.equal(out, reference)
        timeline = streamer.timeline()
        _check_pass(streamer, timeline)
        copies = _by_kind(timeline, "copy")
        assert not any(s["blocking"] for v in copies.values() for s in v)  # the copy worker's
        reads = _by_kind(timeline, "disk")
        assert reads, "a disk run whose cache holds half the units reads in every pass"
        computes = _by_kind(timeline, "compute")
        for i, spans in reads.items():
            (read,) = spans
            assert read["bytes"] == streamer.describe_units()[i]["bytes"]
            assert read["start_ms"] <= read["end_ms"] <= copies[i][0]["start_ms"] + 1e-6
            assert read["end_ms"] <= computes[i][0]["start_ms"]
        assert timeline["totals"]["disk_busy_ms"] > 0
    finally:
        streamer.close()


def _span(kind, unit, start, end, **extra):
    return {"kind": kind, "unit": unit, "block": unit, "start_ms": start, "end_ms": end, **extra}


def test_verdict_names_what_compute_waited_for():
    compute = [_span("compute", u, 10 * u + 1, 10 * u + 10) for u in range(3)]
    hidden = [_span("copy", u, 10 * u - 5, 10 * u - 4, bytes=1, blocking=False) for u in range(3)]
    no_wait = [_span("wait", u, 10 * u, 10 * u + 1e-3, host_start_ms=10 * u, host_ms=1e-3) for u in range(3)]
    assert verdict(compute + hidden + no_wait)["bound_by"] == "compute"
    # Compute waits 5 ms per unit for copies that run back to back: the link.
    waits = [_span("wait", u, 10 * u - 5, 10 * u, host_start_ms=10 * u - 5, host_ms=0.1) for u in range(3)]
    result = verdict(compute + hidden + waits)
    assert result["bound_by"] == "link" and result["totals"]["link_wait_ms"] == pytest.approx(15)
    # The same waits, with each unit's read still running when its wait began: the disk.
    reads = [_span("disk", u, 10 * u - 8, 10 * u - 1, bytes=1) for u in range(3)]
    result = verdict(compute + hidden + waits + reads)
    assert result["bound_by"] == "disk" and result["totals"]["disk_wait_ms"] == pytest.approx(15)
    assert result["totals"]["disk_busy_ms"] == pytest.approx(21)
    # A CPU copy on the sampling thread is waited for in full: bound by those copies (a CPU has
    # no link), and by compute where they were brief.
    blocking = [_span("copy", u, 10 * u - 4, 10 * u, bytes=1, blocking=True) for u in range(3)]
    assert verdict(compute + blocking + no_wait)["bound_by"] == "copies"
    brief = [_span("copy", u, 10 * u - 0.1, 10 * u, bytes=1, blocking=True) for u in range(3)]
    assert verdict(compute + brief + no_wait)["bound_by"] == "compute_between_copies"


def test_a_recorded_run_reuses_its_marks_from_pass_to_pass(stream_model):
    """Under the stream model, whose events are counted: a recorded pass takes five marks per
    streamed unit (its copy's two, its wait's, its compute's two); those of a pass no longer shown
    are recorded again, so a long run makes no new events after its first passes (issue 30,
    item 8)."""
    model = ToyDiT(depth=5)
    x, t = inputs()
    streamer = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1, timing=False)
    try:
        streamer.record_timeline(True)
        streamer.attach()
        with torch.no_grad():
            for _ in range(4):
                model(x, t)
            made = stream_model.events_made
            for _ in range(6):
                model(x, t)
        assert stream_model.events_made == made
        streamer.detach(keep_pack=True)
        _check_pass(streamer, streamer.timeline())
    finally:
        streamer.close()


@pytest.mark.parametrize("recording", [False, True], ids=["plain", "recorded"])
def test_the_run_and_the_picture_count_compute_waits_by_one_rule(monkeypatch, recording):
    """What the panel's card shows as "compute waited" (the run's telemetry) and what the picture
    of a pass shows (its verdict's waits) are one quantity, counted alike: over one pass the
    run's figure grows by exactly the pass's. On a CPU that is each unit's wait and each copy,
    which the sampling thread makes itself. A host clock that moves only inside a copy (4 ms) and
    a unit's wait (1 ms) makes both exact, whatever the machine's load."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    copy, wait_ready = Ordering.copy, SlotRing.wait_ready

    def slow_copy(dst, src):
        clock[0] += 0.004
        return copy(dst, src)

    def slow_wait(ring, slot):
        clock[0] += 0.001
        wait_ready(ring, slot)

    monkeypatch.setattr(Ordering, "copy", staticmethod(slow_copy))
    monkeypatch.setattr(SlotRing, "wait_ready", slow_wait)
    model = ToyDiT(depth=5)
    x, t = inputs()
    streamer = LayerwiseStreamer(model.blocks, "cpu", resident=1, prefetch=1)
    try:
        streamer.record_timeline(recording)
        streamer.attach()
        with torch.no_grad():
            model(x, t)
            model(x, t)
            before = streamer.telemetry.snapshot(wait=True)["compute_wait_s"]
            model(x, t)
            after = streamer.telemetry.snapshot(wait=True)["compute_wait_s"]
        streamer.detach(keep_pack=True)
        streamed = len(streamer.streamed_indices)
        assert (after - before) * 1000 == pytest.approx(streamed * (4 + 1))
        if recording:
            totals = streamer.timeline()["totals"]
            assert totals["link_wait_ms"] + totals["disk_wait_ms"] == pytest.approx((after - before) * 1000)
    finally:
        streamer.close()
