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
from torch import nn

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


# ------------------------------------------------------------------ passes another streamer runs
MEASURE_CALLS = 4  # calls of the model a run's timing covers: the first is left out, the last kept


def block_costs(block_ms: Sequence[float], block_bytes: Sequence[int], period_ms: float,
                copy_bytes_per_ms: float, asynchronous: bool, streamed: Sequence[int] = ()) -> Costs:
    """The costs of a pass whose weights another streamer moved (core's Dynamic VRAM): each
    block's time from marks around it, the link's rate from a copy timed apart (``link.py``).

    A block the other streamer held resident took only its compute; one it ``streamed`` also
    waited for its weights, so its compute is taken from the resident blocks of its size (a
    model's blocks of one size are one kind: Flux's double or single blocks), else from the
    compute per byte of the resident ones, else (none resident) its time less its copy, which
    is short of its compute by what of the copy hid behind the block before it."""
    n = len(block_ms)
    moved = set(streamed)
    copy = [b / copy_bytes_per_ms if copy_bytes_per_ms > 0 else 0.0 for b in block_bytes]
    kept = [i for i in range(n) if i not in moved]
    per_byte = (sum(block_ms[i] for i in kept) / max(1, sum(block_bytes[i] for i in kept))) if kept else None
    by_size: dict[int, list[float]] = {}
    for i in kept:
        by_size.setdefault(block_bytes[i], []).append(block_ms[i])

    def estimate(i: int) -> float:
        same = by_size.get(block_bytes[i])
        if same:
            return sum(same) / len(same)
        return per_byte * block_bytes[i] if per_byte is not None else max(0.0, block_ms[i] - copy[i])

    compute = [float(block_ms[i]) if i not in moved else estimate(i) for i in range(n)]
    outside = max(0.0, period_ms - sum(block_ms))
    return Costs(tuple(compute), tuple(copy), tuple(int(b) for b in block_bytes), tuple(range(n)), 0,
                 outside, asynchronous)


class CallTimer:
    """Marks where each of the first ``calls`` calls of ``root`` starts and around each of its
    ``blocks``: what a pass costs per block where the engine does not stream the blocks itself
    (core's Dynamic VRAM does, and the node only chooses their order in VRAM).

    The marks are device events recorded on the current stream, so timing adds no wait to the
    run; ``close`` reads them once the run is over. Nothing is marked inside a torch.compile graph
    or while a CUDA graph is captured, and after ``calls`` calls the hooks come off."""

    def __init__(self, device: torch.device, root: nn.Module, blocks: Sequence[nn.Module],
                 calls: int = MEASURE_CALLS) -> None:
        self._ordering = for_device(device)
        self._calls = calls
        self._n = len(blocks)
        self._passes: list[tuple[Event, list[tuple[int, Event]]]] = []
        self._end: Event | None = None
        self._root = root.register_forward_pre_hook(self._call)
        self._hooks: BlockHooks | None = BlockHooks(list(enumerate(blocks)), self._mark, self._mark)

    def _mark_now(self) -> Event:
        event = self._ordering.event(timing=True)
        event.record(self._ordering.current_stream())
        return event

    def _call(self, module: nn.Module, args: tuple) -> None:
        if _not_timed():
            return
        if len(self._passes) >= self._calls:
            self._stop()
            return
        self._passes.append((self._mark_now(), []))

    def _mark(self, index: int) -> None:
        if self._end is None and self._passes and not _not_timed():
            self._passes[-1][1].append((index, self._mark_now()))

    def _stop(self) -> None:
        if self._end is None:
            self._end = self._mark_now()
        self._root.remove()
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def close(self) -> tuple[list[float], float] | None:
        """(each block's time, the period) of the last pass marked whole (later passes are past
        the first calls' costs); None where none was. Removes the hooks."""
        self._stop()
        if not self._passes:
            return None
        self._end.synchronize()
        ends = [start for start, _ in self._passes[1:]] + [self._end]
        for k in range(len(self._passes) - 1, -1, -1):
            start, marks = self._passes[k]
            times = _block_times(marks, self._n)
            if times is not None:
                return times, start.elapsed_time(ends[k])
        return None


def _block_times(marks: Sequence[tuple[int, Event]], n: int) -> list[float] | None:
    """Each block's time from its (enter, exit) marks in one pass; None unless every block ran."""
    open_: dict[int, Event] = {}
    times: list[float | None] = [None] * n
    for index, event in marks:
        if index in open_:
            times[index] = (times[index] or 0.0) + open_.pop(index).elapsed_time(event)
        else:
            open_[index] = event
    if open_ or any(t is None for t in times):
        return None
    return [float(t) for t in times]


def _not_timed() -> bool:
    """Inside a compiled graph or a CUDA graph capture, where an event cannot be recorded."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
