"""Counters that make the streaming engine's cost visible.

Why: offload engines fail quietly (hidden stalls, silent fallbacks, VRAM creeping
past the plan).  These counters let tests assert the plan is kept and let a UI
show what a run really cost.  Stalls are measured on both sides: on the GPU with
CUDA events, resolved lazily so measuring never adds a host sync to the hot path,
and on the host as the time the sampling thread spends in the engine's hooks, so
a host that waits (and leaves the GPU without queued work) cannot hide either.
"""

from __future__ import annotations

import threading
from typing import Any

from ..ordering import Event, Ordering, Stream
from .timeline import Timeline


class StallTimer:
    """Times how long compute waited for each streamed unit, where copies are asynchronous: the
    compute stream's time between two events of ``ordering`` around the unit's wait, or the
    sampling thread's time in that wait where it was longer (a host that waits leaves the device
    without queued work). The picture of a pass counts a wait the same way (``timeline.verdict``).

    Locked because a UI thread may read it while the sampling thread records.
    """

    def __init__(self, ordering: Ordering) -> None:
        self._ordering = ordering
        self._pending: list[tuple[Event, Event, float]] = []
        self._spare: list[tuple[Event, Event]] = []
        self._lock = threading.Lock()
        self.total_s = 0.0

    def begin(self, stream: Stream) -> tuple[Event, Event]:
        with self._lock:
            pair = self._spare.pop() if self._spare else None
        if pair is None:
            pair = (self._ordering.event(timing=True), self._ordering.event(timing=True))
        pair[0].record(stream)
        return pair

    def end(self, pair: tuple[Event, Event], stream: Stream, host_s: float) -> None:
        """The wait begun with ``pair`` ended; the sampling thread spent ``host_s`` in it."""
        pair[1].record(stream)
        with self._lock:
            self._pending.append((pair[0], pair[1], host_s))
            backlog = len(self._pending) > 64
        if backlog:
            self.collect(wait=False)

    def collect(self, wait: bool) -> None:
        """Fold finished pairs into ``total_s``; with ``wait`` also the unfinished ones."""
        with self._lock:
            keep = []
            for start, end, host_s in self._pending:
                if wait:
                    end.synchronize()
                elif not end.query():
                    keep.append((start, end, host_s))
                    continue
                self.total_s += max(start.elapsed_time(end) / 1000.0, host_s)
                self._spare.append((start, end))
            self._pending = keep


class Telemetry:
    """Engine counters; ``snapshot()`` is JSON-serialisable."""

    def __init__(self) -> None:
        self.bound_bytes = 0  # of the device schedule in force
        self.peak_bound_bytes = 0  # the most of any since the last reset (auto settings change it)
        self.materialized_bytes = 0
        self.device_alloc_bytes = 0
        self.stalls: StallTimer | None = None
        # Where copies are synchronous (a plain CPU): whether the sampling thread is inside a
        # unit's wait now, so a copy it makes there is not counted twice.
        self.in_wait = False
        # The picture of a pass, only while someone asked for it: the hot path checks this one
        # attribute and does nothing more while it is None.
        self.timeline: Timeline | None = None
        self.reset()

    def reset(self) -> None:
        """Zero the counters; peaks restart from the current values."""
        self.bytes_copied = 0
        self.copies = 0
        self.sync_fallbacks = 0
        self.order_misses = 0
        # Copies into a slot whose unit never ran before the slot was copied over: the calls
        # skipped it (skip-layer guidance, a block cache) or a new transform replaced it.
        self.unused_copies = 0
        self.unused_copy_bytes = 0
        self.blocks_packed = 0
        self.transforms = 0  # tensors rewritten by the attach's transform, on device copies
        self.staged_copies = 0  # copies that went through the pinned bounce buffer (pageable pack)
        # Times a block was needed before a copy worker had issued its copy (staged, or followed
        # by a merge).
        self.staging_waits = 0
        # Time the sampling thread spent in the engine's block hooks: issuing copies and merges,
        # and waiting wherever the host has to (a copy from pageable memory, a staged or disk
        # copy not yet issued). Compute's own waits are compute_wait_s; this is the host's side.
        self.host_wait_s = 0.0
        # Where copies are synchronous: the waits' time and that of the copies the sampling thread
        # made outside them (compute waits for all of each). See ``compute_wait_s``.
        self.sync_wait_s = 0.0
        self.wait_host_s = 0.0  # the part of host_wait_s spent in units' waits
        self.peak_materialized_bytes = self.materialized_bytes
        self.peak_device_alloc_bytes = self.device_alloc_bytes
        self.peak_bound_bytes = self.bound_bytes
        if self.stalls is not None:
            self.stalls.collect(wait=True)
            self.stalls.total_s = 0.0

    def record_copy(self, nbytes: int) -> None:
        self.bytes_copied += nbytes
        self.copies += 1

    def add_materialized(self, delta: int) -> None:
        self.materialized_bytes += delta
        if self.materialized_bytes > self.peak_materialized_bytes:
            self.peak_materialized_bytes = self.materialized_bytes

    def add_device_alloc(self, delta: int) -> None:
        self.device_alloc_bytes += delta
        if self.device_alloc_bytes > self.peak_device_alloc_bytes:
            self.peak_device_alloc_bytes = self.device_alloc_bytes

    def copied_on_this_thread(self, seconds: float) -> None:
        """A synchronous copy took ``seconds`` of the sampling thread: compute waited for it,
        unless it ran inside a wait, which is counted whole."""
        if not self.in_wait:
            self.sync_wait_s += seconds

    @property
    def compute_wait_s(self) -> float:
        """Time compute waited for streamed units' bytes, by one rule wherever it is shown (the
        panel's card and the picture of a pass, ``timeline.verdict``): each unit's wait (on a
        device with asynchronous copies, the compute stream's or the sampling thread's,
        whichever was longer) plus every copy the sampling thread made itself outside a wait (a
        plain CPU's copies)."""
        return (self.stalls.total_s if self.stalls is not None else 0.0) + self.sync_wait_s

    def snapshot(self, wait: bool = False) -> dict[str, Any]:
        """Current counters.  ``wait=True`` first resolves in-flight stall timings (host sync)."""
        if self.stalls is not None:
            self.stalls.collect(wait=wait)
        return {
            "bytes_copied": self.bytes_copied,
            "copies": self.copies,
            "sync_fallbacks": self.sync_fallbacks,
            "order_misses": self.order_misses,
            "unused_copies": self.unused_copies,
            "unused_copy_bytes": self.unused_copy_bytes,
            "blocks_packed": self.blocks_packed,
            "transforms": self.transforms,
            "staged_copies": self.staged_copies,
            "staging_waits": self.staging_waits,
            "compute_wait_s": self.compute_wait_s,
            "host_wait_s": self.host_wait_s,
            "wait_host_s": self.wait_host_s,
            "materialized_bytes": self.materialized_bytes,
            "peak_materialized_bytes": self.peak_materialized_bytes,
            "device_alloc_bytes": self.device_alloc_bytes,
            "peak_device_alloc_bytes": self.peak_device_alloc_bytes,
            "bound_bytes": self.bound_bytes,
            "peak_bound_bytes": self.peak_bound_bytes,
        }


def overlap_efficiency(snapshot: dict[str, Any], seconds: float) -> float:
    """Share of a run of ``seconds`` in which neither compute waited for a copy nor the sampling
    thread sat in the engine (a host that waits queues no compute, and the GPU's own waits do
    not show that). The sampling thread's time in the waits is part of both figures: counted
    once."""
    if seconds <= 0:
        return 0.0
    busy = snapshot["compute_wait_s"] + snapshot["host_wait_s"] - snapshot.get("wait_host_s", 0.0)
    return max(0.0, 1.0 - busy / seconds)
