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
(an earlier pass with other residents), that measurement stands instead, a copy's scaled by how
much the copies of this pass's streamed units moved since (a link that slowed slows every copy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ..device.hooks import BlockHooks
from ..device.timeline import Timeline
from ..ordering import Event, Ordering, for_device
from .pipeline import Costs, CopyChain, DiskCosts
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
    drift = _copy_drift(copy, previous)
    for u in range(n):
        if copy[u] is None:
            if previous is not None and previous.copy_ms[u] > 0:
                copy[u] = previous.copy_ms[u] * drift
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


def _copy_drift(copy: Sequence[float | None], previous: Costs | None) -> float:
    """How much dearer the copies measured in this pass are than the same units' copies measured
    before: a copy measured before stands for its unit, a unit's own cost (a merge of its own) kept,
    times this, since a link that slowed slows every copy alike, the ones this pass did not make."""
    if previous is None:
        return 1.0
    now = then = 0.0
    for u, ms in enumerate(copy):
        if ms is not None and previous.copy_ms[u] > 0:
            now, then = now + ms, then + previous.copy_ms[u]
    return now / then if now > 0 and then > 0 else 1.0


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

        # Traceable (``eager=False``): the marks do nothing inside a graph by themselves, and a
        # hook kept out of graphs would load torch.compile's machinery (seconds) into a process
        # that never compiles.
        self._hooks = BlockHooks([(b, p.blocks[b]) for b in blocks], mark, mark, eager=False)

    def off(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._marks = {}


class PeriodWatch:
    """The steps of a held setting, watched at the cost of one timing event per call and never
    waiting for the device: a held setting was right in the conditions it was measured in, and a
    link that slows, a host that gets busy or a GPU that clocks down move every step after it.

    Steps are read in pairs (a model whose calls alternate in cost repeats over two calls). The
    first ``BASE_PAIRS`` pairs are the base and its spread; the watch reports the conditions moved
    when ``MOVED_PAIRS`` pairs in a row lie beyond the spread (at least ``tolerance``) on one side."""

    BASE_PAIRS = 2
    MOVED_PAIRS = 2
    MAX_MARKS = 8  # calls the device may run behind before the watch starts over

    def __init__(self, ordering: Ordering, tolerance: float) -> None:
        self._ordering = ordering
        self._tolerance = tolerance
        self._marks: list[Event] = []
        self._periods: list[float] = []
        self._pairs: list[float] = []
        self._beyond: list[float] = []
        self._skip = 0
        self.base: float | None = None

    def restart(self, skip: int) -> None:
        """Watch anew, leaving out the next ``skip`` steps (a schedule just made)."""
        self._marks, self._periods, self._pairs, self._beyond = [], [], [], []
        self._skip = skip
        self.base = None

    def call(self) -> tuple[float, float] | None:
        """A call of the model starts. Returns (the base step, the step now) once the conditions
        moved, else None."""
        mark = self._ordering.event(timing=True)
        mark.record(self._ordering.current_stream())
        self._marks.append(mark)
        if len(self._marks) > self.MAX_MARKS:
            self.restart(0)
            self._marks.append(mark)
        while len(self._marks) >= 2 and self._marks[1].query():
            start = self._marks.pop(0)
            if self._skip > 0:
                self._skip -= 1
                continue
            self._periods.append(start.elapsed_time(self._marks[0]))
            if len(self._periods) == 2:
                moved = self._pair(sum(self._periods) / 2)
                self._periods = []
                if moved is not None:
                    return moved
        return None

    def _pair(self, step: float) -> tuple[float, float] | None:
        if self.base is None:
            self._pairs.append(step)
            if len(self._pairs) == self.BASE_PAIRS:
                self.base = sum(self._pairs) / len(self._pairs)
            return None
        spread = max(abs(p - self.base) for p in self._pairs) / self.base if self.base > 0 else 0.0
        limit = max(self._tolerance, 2 * spread)
        off = step / self.base - 1 if self.base > 0 else 0.0
        if abs(off) <= limit or (self._beyond and (off > 0) != (self._beyond[-1] > self.base)):
            self._beyond = [] if abs(off) <= limit else [step]
            return None
        self._beyond.append(step)
        if len(self._beyond) < self.MOVED_PAIRS:
            return None
        now = sum(self._beyond) / len(self._beyond)
        return self.base, now


# ------------------------------------------------------------------ passes another streamer runs
MEASURE_CALLS = 4  # calls of the model a run's timing covers: the first is left out, the last kept


def block_costs(spans: Sequence[tuple[float, float]], block_bytes: Sequence[int], period_ms: float,
                copy_bytes_per_ms: float, asynchronous: bool, streamed: Sequence[int] = ()) -> Costs:
    """The costs of a pass whose weights another streamer moved (core's Dynamic VRAM): each
    block's ``spans`` (its start and end in the pass, from marks around it), the link's rate
    from a copy timed apart (``link.py``), the blocks the streamer did not hold resident.

    A resident block's time is its compute. A ``streamed`` block's time also holds its wait for
    its weights, which the pipeline model itself says how long was: where copies run beside
    compute (core's prefetch), the copy of a block starts when the block before it starts (core
    fetches one block ahead), once the copy before it has ended, the first one as the call
    begins, and the block computes from when it starts or its copy ends, whichever is later (a
    block that ended before the copy so modelled could have ended had its weights earlier: a
    streamer that fetched ahead across calls; it waited for none); where they do not, the block
    waits for its whole copy. Its compute is the rest of its time."""
    n = len(spans)
    moved = set(streamed)
    copy = [b / copy_bytes_per_ms if copy_bytes_per_ms > 0 else 0.0 for b in block_bytes]
    compute: list[float] = []
    chain = CopyChain()
    for i, (start, end) in enumerate(spans):
        took = end - start
        if i not in moved:
            compute.append(took)
        elif not asynchronous:
            compute.append(max(0.0, took - copy[i]))
        else:
            ready = chain.copy(spans[i - 1][0] if i else 0.0, copy[i])
            if ready >= end:  # it cannot have ended before its weights came: they came earlier
                ready = chain.free_at = start
            compute.append(end - max(start, ready))
    outside = max(0.0, period_ms - sum(end - start for start, end in spans))
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
        # Traceable, as PassMeter's marks: ``_mark`` does nothing inside a graph by itself.
        self._hooks: BlockHooks | None = BlockHooks(list(enumerate(blocks)), self._mark, self._mark, eager=False)

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

    def close(self) -> tuple[list[tuple[float, float]], float] | None:
        """(each block's start and end, from the start of its pass; the period) of the last pass
        marked whole (later passes are past the first calls' costs); None where none was.
        Removes the hooks."""
        self._stop()
        if not self._passes:
            return None
        self._end.synchronize()
        ends = [start for start, _ in self._passes[1:]] + [self._end]
        for k in range(len(self._passes) - 1, -1, -1):
            start, marks = self._passes[k]
            spans = _block_spans(start, marks, self._n)
            if spans is not None:
                return spans, start.elapsed_time(ends[k])
        return None


def _block_spans(start: Event, marks: Sequence[tuple[int, Event]], n: int) -> list[tuple[float, float]] | None:
    """Each block's (first enter, last exit) in one pass, in ms from ``start``; None unless every
    block ran."""
    enters: dict[int, Event] = {}
    exits: dict[int, Event] = {}
    inside: set[int] = set()
    for index, event in marks:
        if index in inside:
            exits[index] = event
            inside.discard(index)
        else:
            enters.setdefault(index, event)
            inside.add(index)
    if inside or len(exits) != n:
        return None
    return [(start.elapsed_time(enters[i]), start.elapsed_time(exits[i])) for i in range(n)]


def _not_timed() -> bool:
    """Inside a compiled graph or a CUDA graph capture, where an event cannot be recorded."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
