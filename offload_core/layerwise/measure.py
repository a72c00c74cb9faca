"""What a measured pass says each unit costs: the pipeline model's inputs (pipeline.Costs), read off
the run's own picture of that pass (device/timeline.py) and its period.

Why from the picture: it already holds what the model needs, on the device's clock, for every
streamed unit: its copy (with its merge) and its bytes, the time compute waited for it, its
compute, its disk read. Only two figures are not in it: the resident blocks' compute (they have
no copy to draw), timed by the tuner around those blocks, and the pass's period from one model
call to the next, timed at the calls.

What was not measured is estimated from what was: the copy of a resident unit from the copy
rate of the streamed ones (or of the resident upload, when nothing streamed), the compute of a
unit not seen from the compute per byte of those seen. Where the same thing was measured before
(an earlier pass with other residents), that measurement stands instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..device.hooks import BlockHooks
from ..device.timeline import Timeline
from ..ordering import Event, for_device
from .pipeline import Costs, DiskCosts
from .plan import StreamPlan


def read_rate(spans: Sequence[dict]) -> float | None:
    """Bytes per ms the disk delivered while it was reading in this pass (overlapping reads count
    once), None without reads."""
    reads = sorted((s["start_ms"], s["end_ms"], s.get("bytes", 0)) for s in spans if s["kind"] == "disk")
    if not reads:
        return None
    busy, reach, nbytes = 0.0, float("-inf"), 0
    for start, end, n in reads:
        nbytes += n
        start = max(start, reach)
        if end > start:
            busy += end - start
            reach = end
    return nbytes / busy if busy > 0 else None


def pass_costs(picture: Mapping, resident_ms: Mapping[int, float], period_ms: float,
               units: Sequence[Mapping], shared_bytes: int, asynchronous: bool, *,
               upload_bytes_per_ms: float | None = None, disk_cap_bytes: int | None = None,
               disk_bytes_per_ms: float | None = None, previous: Costs | None = None) -> Costs | None:
    """The costs of one pass: ``picture`` is ``Timeline.last_pass``, ``resident_ms`` each resident
    block's compute, ``units`` each unit's ``{"block", "bytes"}``; from disk, the RAM cache's size
    and the disk's rate over the run so far (a pass's own reads overlap those of the passes beside
    it), else the rate of this pass's reads. None when the pass says too little (no unit's compute
    at all, or no read from disk yet)."""
    n = len(units)
    sizes = [int(u["bytes"]) for u in units]
    blocks = [int(u["block"]) for u in units]
    compute: list[float | None] = [None] * n
    copy: list[float | None] = [None] * n
    stall = 0.0
    copied_bytes = copied_ms = 0.0
    for s in picture.get("spans", ()):
        u, length = s["unit"], s["end_ms"] - s["start_ms"]
        if s["kind"] == "compute":
            compute[u] = (compute[u] or 0.0) + length
        elif s["kind"] == "copy":
            copy[u] = length
            copied_bytes += sizes[u]
            copied_ms += length
            if s.get("blocking"):  # a copy on the sampling thread: compute waited for all of it
                stall += length
        elif s["kind"] == "wait":
            stall += max(length, 0.0) if asynchronous else max(length, s.get("host_ms", 0.0))
    for block, ms in resident_ms.items():  # a resident block's compute, shared by its units by bytes
        members = [u for u in range(n) if blocks[u] == block and compute[u] is None]
        total = sum(sizes[u] for u in members)
        for u in members:
            compute[u] = ms * (sizes[u] / total if total else 1 / len(members))
    seen = [u for u in range(n) if compute[u] is not None]
    if not seen:
        return None
    per_byte = sum(compute[u] for u in seen) / max(1, sum(sizes[u] for u in seen))
    for u in range(n):
        if compute[u] is None:
            compute[u] = previous.compute_ms[u] if previous is not None else per_byte * sizes[u]
    copy_rate = copied_bytes / copied_ms if copied_ms > 0 else upload_bytes_per_ms
    for u in range(n):
        if copy[u] is None:
            if previous is not None and previous.copy_ms[u] > 0:
                copy[u] = previous.copy_ms[u]
            else:
                copy[u] = sizes[u] / copy_rate if copy_rate else 0.0
    outside = max(0.0, period_ms - sum(compute) - stall)
    disk = None
    if disk_cap_bytes is not None:
        rate = disk_bytes_per_ms or read_rate(picture.get("spans", ()))
        if rate is None and previous is not None and previous.disk is not None:
            rate = previous.disk.bytes_per_ms
        if rate is None:
            return None  # every unit was a hit: the disk's rate is not known yet
        disk = DiskCosts(rate, disk_cap_bytes)
    return Costs(tuple(compute), tuple(copy), tuple(sizes), tuple(blocks), shared_bytes, outside,
                 asynchronous, disk)


class PassMeter:
    """Times the passes of one streamer's ``plan`` on ``device``: a mark where each call of the
    model starts, and, while ``on``, marks around each resident block (the picture has no row for
    them); ``measure`` reads the pass that just ended into its costs.

    ``describe()`` gives each unit's ``{"block", "bytes"}``; ``disk_rate()`` the disk's bytes per ms
    in this run (None before a read)."""

    def __init__(self, plan: StreamPlan, device: torch.device, describe: Callable[[], list[dict]],
                 disk_rate: Callable[[], float | None]) -> None:
        self._plan = plan
        self._ordering = for_device(device)
        self._describe = describe
        self._disk_rate = disk_rate
        self._hooks: BlockHooks | None = None
        self._marks: dict[int, list[Event]] = {}  # resident block -> its marks in this pass
        self._ended: dict[int, list[Event]] = {}  # the same, of the pass that just ended
        self._start: Event | None = None  # where the pass under way started
        self._seen: tuple[int, int] = (0, 0)  # the picture's id and its complete passes, last call
        self._upload_rate: float | None = None  # the link's rate, from resident uploads

    def pass_starts(self, timeline: Timeline | None) -> tuple[Event | None, Event, bool]:
        """A call of the model starts: (the last pass's start, its end, whether ``timeline`` holds
        that pass complete)."""
        mark = self._ordering.event(timing=True)
        mark.record(self._ordering.current_stream())
        previous, self._start = self._start, mark
        self._ended, self._marks = self._marks, {}
        complete = False
        if timeline is not None:
            timeline.close_pass()
            seen = (id(timeline), timeline.completed)
            complete, self._seen = seen != self._seen and seen[0] == self._seen[0], seen
        return previous, mark, complete

    def forget(self) -> None:
        """Nothing is timed from here to the next call (a held setting)."""
        self._start = None

    def measure(self, previous: Event | None, mark: Event, timeline: Timeline | None, complete: bool,
                disk_cap: int | None, known: Costs | None) -> tuple[Costs, float] | None:
        """(costs, period) of the pass from ``previous`` to ``mark``; None when it cannot be read
        (no complete picture of it). Waits for the device to reach ``mark``."""
        if previous is None or timeline is None:
            return None
        mark.synchronize()
        period = previous.elapsed_time(mark)
        picture = timeline.last_pass(self._describe()) if complete else None
        if self._plan.streamed_indices and picture is None:
            return None  # no complete pass since the last call
        upload = timeline.upload_rate()
        if upload is not None:
            self._upload_rate = upload
        resident = {b: sum(e.elapsed_time(x) for e, x in zip(marks[::2], marks[1::2]))
                    for b, marks in self._ended.items() if len(marks) >= 2}
        costs = pass_costs(picture or {}, resident, period, self._describe(), self._plan.shared.nbytes,
                           self._ordering.asynchronous, upload_bytes_per_ms=self._upload_rate,
                           disk_cap_bytes=disk_cap, disk_bytes_per_ms=self._disk_rate() if disk_cap else None,
                           previous=known)
        return None if costs is None else (costs, period)

    def on(self) -> None:
        """Time the resident blocks' compute (again after a new setting: ``off`` first)."""
        if self._hooks is not None:
            return
        p = self._plan
        blocks = sorted({p.units[u].block for u in p.resident_indices}
                        - {p.units[u].block for u in p.streamed_indices})
        if not blocks:
            return
        ordering = self._ordering

        def mark(b: int) -> None:
            if torch.compiler.is_compiling():
                return
            event = ordering.event(timing=True)
            event.record(ordering.current_stream())
            self._marks.setdefault(b, []).append(event)  # this pass's, renewed at each call

        self._hooks = BlockHooks([(b, p.blocks[b]) for b in blocks], mark, mark)

    def off(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._marks = {}
