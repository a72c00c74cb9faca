"""A picture of one pass of the streamed units: when each unit's copy ran, when compute waited
for it and how long, when it computed, and its disk read when the packs live on disk.

Why: the counters (``Telemetry``) say how much a run waited in all, not why. Laid out on a time
axis, the spans of one pass show at a glance whether a run was bound by the copy link (compute
waits for copies that run back to back), by the disk (the waits end where reads end) or by
compute (copies finish early and nothing waits).

Why recording is off unless asked for: the hot path (a block hook) must not pay for a picture
nobody looks at. A ``Timeline`` in ``Telemetry.timeline`` when an attach starts is what turns
recording on: the attach then installs recording hooks around the plain ones; without one it
installs the plain hooks, and the slot ring checks it once per copy.

Why one pass: a pass (one call of the model over its blocks; a sampling step makes one or more)
repeats the same pattern, and one is enough to see it. The recorder keeps the pass under way and
the last complete one, so its memory is bounded by a few spans per streamed unit; the marks of a
pass no longer kept (and of a copy noted again before its unit computed) are recorded again, so
a long recorded run makes no new events after its first passes.

Clocks: marks on the streams are events of the device's ordering (``offload_core/ordering.py``;
on CUDA, CUDA events with timing enabled) recorded where the work is queued, and resolved to
times only in ``last_pass``, after the run (never a host sync on the hot path); disk reads, which
the host does, keep the host clock, aligned to the pass start as the host saw it. On a plain CPU
an event keeps the ``time.perf_counter`` of its record. The host clock is the seam's
(``ordering.host_clock``): a timed model of a device runs it on its virtual time.

A unit's copy and disk read are attached to the pass in which the unit computes, not the one in
which they were issued: the first units of a pass are fetched while the previous pass runs, so
their spans start before the pass does (negative times).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ordering import Event, Stream, for_device, host_clock
from .bounds import bound_by


Mark = Event  # timing enabled


@dataclass
class _Pass:
    """The spans of one pass, with its origin on both clocks."""

    origin: Mark  # the mark of the first unit's wait: time 0
    host_origin: float
    spans: list[tuple] = field(default_factory=list)  # (kind, unit, start, end, extra)
    units: list[int] = field(default_factory=list)  # units in the order they computed


class Timeline:
    """Records the spans of the streamed units' passes on ``device``; ``last_pass`` resolves the
    last complete one. Copies and reads are noted from worker threads, compute from the sampling
    thread: the pending spans are under a lock."""

    def __init__(self, device: torch.device, streamed: int) -> None:
        self._ordering = for_device(device)
        self.device = device
        self.streamed = streamed  # a pass is complete when this many units computed in it
        self._lock = threading.Lock()
        self._copies: dict[int, tuple] = {}  # unit -> its latest copy not yet in a pass
        self._reads: dict[int, tuple] = {}  # unit -> its latest disk read not yet in a pass
        self._current: _Pass | None = None
        self._last: _Pass | None = None
        self._wait: tuple[Mark, float] | None = None  # the running unit's wait start
        self._compute: tuple[int, Mark] | None = None  # the running unit and its compute start
        self._spare: list[Mark] = []  # marks nothing refers to any more, to be recorded again (popped
        # and extended in one step each, never read otherwise)
        self.completed = 0  # complete passes so far (a caller that closes passes counts them)
        self._uploads: list[tuple[Mark, Mark, int]] = []  # the resident units' copies at attach

    # ------------------------------------------------------------- marks
    def mark(self, stream: Stream | None = None) -> Mark:
        """A point in time: an event recorded on ``stream`` (or the current stream)."""
        try:
            event = self._spare.pop()  # one step under the GIL: no lock for the hot path
        except IndexError:
            event = self._ordering.event(timing=True)
        event.record(stream if stream is not None else self._ordering.current_stream())
        return event

    # ------------------------------------------------------------- copy and disk threads
    def copied(self, unit: int, start: Mark, end: Mark, nbytes: int, blocking: bool) -> None:
        """Unit ``unit``'s copy into its slot ran from ``start`` to ``end``; ``blocking`` when it
        ran on the sampling thread (a CPU copy), so compute waited for all of it."""
        with self._lock:
            replaced = self._copies.get(unit)
            self._copies[unit] = (start, end, nbytes, blocking)
            if replaced is not None:  # never shown: its unit did not compute since
                self._spare.extend(replaced[:2])

    def uploaded(self, start: Mark, end: Mark, nbytes: int) -> None:
        """A resident unit's ``nbytes`` were copied to the device between ``start`` and ``end``."""
        self._uploads.append((start, end, nbytes))

    def upload_rate(self) -> float | None:
        """Bytes per ms of the resident units' copies (the link's rate with nothing beside it),
        None without any. Resolves the marks, waiting for them."""
        nbytes = sum(n for _, _, n in self._uploads)
        ms = sum(self._ms(start, end) for start, end, _ in self._uploads)
        return nbytes / ms if nbytes and ms > 0 else None

    def read(self, unit: int, start: float, end: float, nbytes: int) -> None:
        """Unit ``unit``'s bytes were read from disk from ``start`` to ``end`` (``host_clock``)."""
        with self._lock:
            self._reads[unit] = (start, end, nbytes)

    # ------------------------------------------------------------- sampling thread
    def wait_begins(self, unit: int, first: bool) -> None:
        """The sampling thread is about to wait for ``unit``'s slot; ``first`` starts a pass."""
        mark, host = self.mark(), host_clock()
        computing = self._compute
        if computing is not None:  # a phase ended by the next one's entry ends here
            self._compute = None
            if self._current is not None:
                self._current.spans.append(("compute", computing[0], computing[1], mark, None))
        if first or self._current is None:
            dropped = self._close_pass()
            self._current = _Pass(origin=mark, host_origin=host)
            if dropped is not None:
                self._recycle(dropped)
        self._wait = (mark, host)

    def compute_begins(self, unit: int) -> None:
        """``unit``'s slot is ready for compute: its wait ends and its compute starts."""
        mark, host = self.mark(), host_clock()
        current, wait = self._current, self._wait
        if current is None or wait is None:
            self._spare.append(mark)
            return
        self._wait = None
        with self._lock:
            copy = self._copies.pop(unit, None)
            read = self._reads.pop(unit, None)
        if read is not None:
            current.spans.append(("disk", unit, read[0], read[1], {"bytes": read[2]}))
        if copy is not None:
            current.spans.append(("copy", unit, copy[0], copy[1], {"bytes": copy[2], "blocking": copy[3]}))
        current.spans.append(("wait", unit, wait[0], mark, {"host_start": wait[1], "host_end": host}))
        current.units.append(unit)
        self._compute = (unit, mark)

    def compute_ends(self, unit: int) -> None:
        """``unit``'s compute is queued up to here (its exit hook, or the next phase's entry)."""
        compute, current = self._compute, self._current
        if compute is None or compute[0] != unit or current is None:
            return
        self._compute = None
        current.spans.append(("compute", unit, compute[1], self.mark(), None))

    def close_pass(self) -> None:
        """The model's call is over (a caller that sees where calls start says so): the pass under
        way ends here, and the next streamed unit's wait starts the next one, whichever unit it is."""
        dropped = self._close_pass()
        if dropped is not None:
            self._recycle(dropped)

    def _close_pass(self) -> _Pass | None:
        """End the pass under way; returns the pass no longer kept (the one before a complete
        pass, or this one cut short)."""
        current, self._current = self._current, None
        if current is None or len(set(current.units)) < self.streamed:
            return current
        dropped, self._last = self._last, current
        self.completed += 1
        return dropped

    def _recycle(self, dropped: _Pass) -> None:
        """Give ``dropped``'s marks to ``mark`` again, except those a kept pass shares: the only
        mark two passes share is the one where a pass's last phase ends and the next pass
        starts, a pass's origin and its predecessor's last span's end."""
        kept = {id(m) for p in (self._current, self._last) if p is not None
                for m in [p.origin] + [span[3] for span in p.spans[-1:]]}
        marks = {id(m): m for m in _marks(dropped) if id(m) not in kept}
        self._spare.extend(marks.values())

    # ------------------------------------------------------------- after the run
    def last_pass(self, describe: Sequence[dict]) -> dict[str, Any] | None:
        """The last complete pass as JSON-ready figures, or None if no pass completed.

        ``describe[unit]`` is the unit's ``{"block", "name", "bytes"}``. Resolves CUDA events,
        waiting for them: call it after the run, never from a block hook."""
        current = self._current
        if current is not None and len(set(current.units)) >= self.streamed:
            chosen = current  # the run ended after a whole pass: that pass is the last one
        else:
            chosen = self._last
        if chosen is None:
            return None
        spans = [self._resolve(chosen, kind, unit, start, end, extra, describe[unit])
                 for kind, unit, start, end, extra in chosen.spans]
        computes = [s for s in spans if s["kind"] == "compute"]
        pass_ms = max(s["end_ms"] for s in computes) if computes else 0.0
        order = list(dict.fromkeys(chosen.units))
        return {
            "clock": "cuda events (disk reads: host clock)" if self._ordering.asynchronous else "host",
            "pass_ms": pass_ms,
            "units": [{"unit": u, "block": describe[u]["block"], "name": describe[u]["name"],
                       "bytes": describe[u]["bytes"]} for u in order],
            "spans": spans,
            **verdict(spans),
        }

    def _resolve(self, chosen: _Pass, kind: str, unit: int, start: Mark, end: Mark,
                 extra: dict | None, unit_info: dict) -> dict[str, Any]:
        if kind == "disk":  # host clock on any device
            start_ms = (start - chosen.host_origin) * 1000.0
            end_ms = (end - chosen.host_origin) * 1000.0
        else:
            start_ms, end_ms = self._ms(chosen.origin, start), self._ms(chosen.origin, end)
        span = {"kind": kind, "unit": unit, "block": unit_info["block"],
                "start_ms": start_ms, "end_ms": max(start_ms, end_ms)}
        if kind == "wait":
            span["host_start_ms"] = (extra["host_start"] - chosen.host_origin) * 1000.0
            span["host_ms"] = (extra["host_end"] - extra["host_start"]) * 1000.0
        elif extra is not None:
            span.update(extra)
        return span

    def _ms(self, origin: Mark, mark: Mark) -> float:
        mark.synchronize()
        origin.synchronize()
        return origin.elapsed_time(mark)


def _marks(p: _Pass) -> list[Mark]:
    """The events a pass refers to (disk reads keep host times, not events)."""
    return [p.origin] + [m for kind, _, start, end, _ in p.spans if kind != "disk" for m in (start, end)]


def verdict(spans: Sequence[dict]) -> dict[str, Any]:
    """What bound the pass, from its spans: totals per kind and ``bound_by``.

    Compute waited for the link when it waited on a copy (a wait, or a copy that ran on the
    sampling thread outside a wait, which counts whole), for the disk when the unit's read was
    still running as the wait began (a wait measured on the GPU is the GPU's; a host that waited
    is counted where it waited longer). The run's ``Telemetry.compute_wait_s`` counts by the
    same rule. A pass whose waits are under a tenth of its compute time is bound by compute
    ("compute_between_copies" where the copies ran on the sampling thread, between the blocks);
    one whose copies ran on the sampling thread and took longer is bound by those copies
    ("copies": a CPU has no link).
    """
    compute = sum(s["end_ms"] - s["start_ms"] for s in spans if s["kind"] == "compute")
    copy_busy = _busy([s for s in spans if s["kind"] == "copy"])
    disk_busy = _busy([s for s in spans if s["kind"] == "disk"])
    read_end = {s["unit"]: s["end_ms"] for s in spans if s["kind"] == "disk"}
    waits = [(s["start_ms"], s["end_ms"]) for s in spans if s["kind"] == "wait"]
    link_wait = disk_wait = 0.0
    for s in spans:
        if s["kind"] == "copy" and s.get("blocking"):
            if not any(start <= s["start_ms"] and s["end_ms"] <= end for start, end in waits):
                link_wait += s["end_ms"] - s["start_ms"]
        elif s["kind"] == "wait":
            waited = max(s["end_ms"] - s["start_ms"], s["host_ms"])
            if read_end.get(s["unit"], float("-inf")) > s["host_start_ms"]:
                disk_wait += waited
            else:
                link_wait += waited
    # Copies that ran on the sampling thread (a CPU, which has no link to wait on) were not
    # hidden: compute waited for each.
    blocking = any(s["kind"] == "copy" and s.get("blocking") for s in spans)
    bound = bound_by(compute, link_wait, disk_wait, blocking=blocking)
    return {"totals": {"compute_ms": compute, "copy_busy_ms": copy_busy, "disk_busy_ms": disk_busy,
                       "link_wait_ms": link_wait, "disk_wait_ms": disk_wait},
            "bound_by": bound}


def _busy(spans: Sequence[dict]) -> float:
    """The time covered by ``spans`` (overlapping spans count once)."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s["start_ms"]):
        start, end = max(s["start_ms"], reach), s["end_ms"]
        if end > start:
            total += end - start
            reach = end
    return total
