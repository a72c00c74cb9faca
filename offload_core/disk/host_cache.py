"""A bounded RAM cache of packed units read from disk ahead of need, by a few worker threads.

Why a cache with known-order eviction: the units run in the same cyclic order every pass, so the
unit needed furthest in the future is known exactly. Evicting it (Belady's rule) is optimal; on a
cyclic order least-recently-used would evict every unit just before it is needed again and never
hit. Reads run ahead of the copies: when a unit is requested, workers start reading the next
``depth`` units it lacks, each into the entry whose unit is needed last, but only if that one is
needed later than the unit read; so read-ahead never throws out a unit that will be used sooner.
Units that stay cached across passes are hits; the rest cost one disk read each per pass.

Why the choice never depends on the threads' timing: a unit requested may still wait for its read
or its copy out of the cache, and such an entry cannot be reused; which entries those are at a
given moment depends on how fast the disk and the copies went, so a rule that skipped just them
would keep other units from pass to pass, and the hit rate would wander. Instead the last
``in_flight`` units requested (the device slots they go to may still be filling) and the units
read ahead of the cursor are never evicted: a fixed set, given by the order of the requests alone,
and the one a slow disk leaves busy anyway. The hit rate is then what the cache can hold, and the
pipeline model (layerwise/pipeline.py) predicts it.

Entries are equal-sized buffers (the largest streamed unit, rounded to 4 KiB) in one host
storage, page-locked when the pinned budget allows, so reads can be direct and copies to the
device asynchronous. An entry is never overwritten while a copy out of it may still run: a lease
pins it from the request until the copy has been issued, and the copy's fence (a CUDA event) is
waited for by the worker before it reads into the entry again.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..alignment import PAGE
from ..device.timeline import Timeline
from ..host.pinned import HostStorage
from ..ordering import host_caught_up, host_clock
from ..units import size_text
from .cache_rule import NEVER, pick_victim, protected_units, read_ahead
from .in_place import Piece
from .sources import DiskSources

log = logging.getLogger(__name__)

class Fence(Protocol):
    def synchronize(self) -> None: ...


class CacheTooSmallError(ValueError):
    """The RAM cap holds fewer units than disk streaming needs at once."""

    def __init__(self, cap: int, unit_bytes: int, need: int) -> None:
        self.cap, self.unit_bytes, self.need = cap, unit_bytes, need
        super().__init__(
            f"a host cache of {size_text(cap)} holds {cap // unit_bytes} streamed unit(s) of "
            f"{size_text(unit_bytes)}, and disk streaming needs {need} at once ({size_text(need * unit_bytes)})")


class DiskTelemetry:
    """What the disk tier cost in a run: reads, hit rate, read rate and time compute waited.

    The read rate is the bytes of the reads that ended since the last reset over the wall time
    those reads were in flight (the union of their intervals, so parallel reads count once). Each
    read brings its own start: read-ahead runs across passes, so a run's counters are reset while
    reads are in flight, and a read counts whole in the window where it ends.
    """

    _COMPACT_AT = 1024  # intervals kept before they are merged into their union

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.timeline: Timeline | None = None  # the streamer's, while a picture is recorded
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.requests = 0  # streamed units asked of the cache
            self.hits = 0  # of those, served by bytes read in an earlier pass
            self.reads = 0
            self.bytes_read = 0
            self.wait_s = 0.0  # time the sampling thread waited for a read
            self.read_errors = 0
            self._intervals: list[tuple[float, float]] = []  # (start, end) of each read ended

    @staticmethod
    def read_started() -> float:
        """The start of a read, for ``read_ended``."""
        return host_clock()

    def read_ended(self, started: float, nbytes: int, ok: bool) -> None:
        with self._lock:
            if ok:
                self.reads += 1
                self.bytes_read += nbytes
                self._intervals.append((started, host_clock()))
                if len(self._intervals) >= self._COMPACT_AT:
                    self._intervals = _union(self._intervals)
            else:
                self.read_errors += 1

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            busy = sum(end - start for start, end in _union(self._intervals))
            return {
                "cache_requests": self.requests,
                "cache_hits": self.hits,
                "cache_hit_rate": self.hits / self.requests if self.requests else None,
                "disk_reads": self.reads,
                "disk_bytes_read": self.bytes_read,
                "disk_read_busy_s": busy,
                "disk_read_gibps": self.bytes_read / busy / (1 << 30) if busy > 0 else None,
                "disk_wait_s": self.wait_s,
                "disk_read_errors": self.read_errors,
            }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals merged where they overlap, in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


@dataclass(eq=False)
class _Entry:
    unit: int | None = None
    reading: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    leases: int = 0
    served: int = 0  # requests served since the current bytes were read
    fence: Fence | None = None  # the last copy out of this entry
    pieces: tuple[Piece, ...] | None = None  # where the unit's tensors are in it; None: packed layout
    read_at: float = 0.0  # when its read ended (host clock)


class Lease:
    """One request's hold on a cached unit: wait() for its bytes, release() once copied out.

    HostCache's friend, in its file: it reads the one entry it holds and hands it back."""

    def __init__(self, cache: HostCache, entry: int, unit: int) -> None:
        self._cache, self.entry, self.unit = cache, entry, unit
        self._released = False

    def wait(self) -> torch.Tensor:
        """The unit's bytes (a host buffer of the entry's size), once read; raises the read's error."""
        e = self._cache._entries[self.entry]
        e.done.wait()
        host_caught_up(e.read_at)
        if e.error is not None:
            raise e.error
        return self._cache.buffer(self.entry)

    @property
    def pieces(self) -> tuple[Piece, ...] | None:
        """After ``wait``: where each tensor's bytes are in the buffer and go in the packed
        layout (read from the model's file), or None when the buffer holds the packed layout."""
        return self._cache._entries[self.entry].pieces

    def release(self, fence: Fence | None = None) -> None:
        """The copy out of the entry is issued; ``fence`` completes when it has run."""
        if not self._released:
            self._released = True
            self._cache._release(self.entry, fence)


class HostCache:
    """``count`` entries of ``entry_bytes`` holding the units of ``order`` read from ``store``,
    ``depth`` units read ahead by ``workers`` threads."""

    def __init__(self, store: DiskSources, unit_bytes: dict[int, int], order: Sequence[int], *,
                 entry_bytes: int, count: int, workers: int, depth: int, pin: bool,
                 ram_budget_bytes: int | None, device: torch.device, telemetry: DiskTelemetry) -> None:
        if workers < 1 or depth < 1 or count < 1 or entry_bytes % PAGE:
            raise ValueError(f"bad cache shape: {count} x {entry_bytes} bytes, {workers} workers, depth {depth}")
        self.entry_bytes = entry_bytes
        self._store = store
        self._unit_bytes = dict(unit_bytes)
        self._tel = telemetry
        self._depth = depth
        self._in_flight = 1
        self._storage = HostStorage([self.entry_bytes] * count, pin=pin, ram_budget_bytes=ram_budget_bytes,
                                    label="disk cache")
        self._storage.note_reader(device)
        self._buffers = [self._storage.buffer(i) for i in range(count)]  # allocates (and pins) now
        self._entries = [_Entry() for _ in range(count)]
        for e in self._entries:
            e.done.set()
        self._where: dict[int, int] = {}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: list[tuple[int, int, int, int, float]] = []  # (priority, seq, entry, unit, queued at)
        self._seq = itertools.count()
        self._closing = False
        self.set_order(order)
        self._threads = [threading.Thread(target=self._worker, name=f"offload-disk-{k}", daemon=True)
                         for k in range(workers)]
        for t in self._threads:
            t.start()
        log.info("[tiered offload] disk stream: host cache of %d x %s (%s), %d read worker(s), read-ahead %d",
                 count, size_text(self.entry_bytes), "pinned" if self.pinned else "pageable", workers, depth)

    # ---------------------------------------------------------------- figures
    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self.count * self.entry_bytes

    @property
    def pinned(self) -> bool:
        return self._storage.pinned_bytes > 0

    @property
    def pinned_bytes(self) -> int:
        return self._storage.pinned_bytes

    def cached_units(self) -> set[int]:
        """Units whose bytes are in RAM now (read complete)."""
        with self._lock:
            return {e.unit for e in self._entries if e.unit is not None and not e.reading and e.error is None}

    def buffer(self, entry: int) -> torch.Tensor:
        return self._buffers[entry]

    # ---------------------------------------------------------------- order
    def set_order(self, order: Sequence[int], depth: int | None = None, in_flight: int | None = None) -> None:
        """The streamed units in run order (a new run may stream another set), the read-ahead, and
        how many requested units may be on their way to the device at once (its slots)."""
        if any(self._unit_bytes.get(u, self.entry_bytes + 1) > self.entry_bytes for u in order):
            raise ValueError("a streamed unit is larger than the cache's entries")
        with self._lock:
            self._order = list(order)
            self._pos = {u: k for k, u in enumerate(self._order)}
            self._cursor = 0
            if depth is not None:
                self._depth = depth
            if in_flight is not None:
                self._in_flight = in_flight

    def _distance(self, unit: int | None) -> float:
        """How far ahead of the cursor ``unit`` is needed next; never (inf) for units not streamed."""
        pos = self._pos.get(unit) if unit is not None else None
        if pos is None:
            return NEVER
        return (pos - self._cursor) % len(self._order)

    # ---------------------------------------------------------------- requests
    def acquire(self, unit: int) -> Lease:
        """Hold ``unit`` in the cache (reading it now if it is not there) and read ahead of it.
        A pass begins with the first unit of the order: the model's file is checked first, so a
        pass that read a file changed under it fails before its result is used."""
        if self._order and unit == self._order[0]:
            self._store.check()
        with self._lock:
            self._cursor = self._pos[unit]
            self._tel.requests += 1
            entry = self._where.get(unit)
            if entry is None:
                entry = self._wait_for_victim(0)
                self._start_read(entry, unit, 0)
            elif self._entries[entry].served:
                self._tel.hits += 1
            e = self._entries[entry]
            e.leases += 1
            e.served += 1
            self._read_ahead()
            return Lease(self, entry, unit)

    def borrow(self) -> tuple[int, torch.Tensor]:
        """A whole entry for a transient use (uploading a resident unit at attach); give_back() it."""
        with self._lock:
            entry = self._wait_for_victim(-1)
            e = self._entries[entry]
            if e.unit is not None:
                del self._where[e.unit]
            e.unit, e.served, e.leases, e.error = None, 0, 1, None
            fence, e.fence = e.fence, None
        if fence is not None:
            fence.synchronize()
        return entry, self._buffers[entry]

    def give_back(self, entry: int, fence: Fence | None = None) -> None:
        self._release(entry, fence)

    def _release(self, entry: int, fence: Fence | None) -> None:
        with self._lock:
            e = self._entries[entry]
            e.leases -= 1
            if fence is not None:
                e.fence = fence
            self._work.notify_all()

    def _wait_for_victim(self, need: float) -> int:
        """An entry for a unit needed ``need`` units ahead, waiting while every entry is leased or
        being read (the copies and reads under way end on their own). Called under the lock."""
        while True:
            entry = self._victim(need)
            if entry is not None:
                return entry
            if self._closing:
                raise RuntimeError("the host cache is closed")
            self._work.wait()

    def _victim(self, need: float) -> int | None:
        """``pick_victim`` over the entries; the protected units are a request's (a transient borrow
        at attach, ``need`` < 0, has nothing in flight to protect)."""
        protected = (protected_units(self._order, self._cursor, self._in_flight, self._depth)
                     if need >= 0 else ())
        return pick_victim(self._entries, need, self._distance, protected)

    def _read_ahead(self) -> None:
        read_ahead(self._order, self._cursor, self._depth, self._where, self._victim, self._start_read)

    def _start_read(self, entry: int, unit: int, priority: int) -> None:
        e = self._entries[entry]
        if e.unit is not None:
            del self._where[e.unit]
        e.unit, e.reading, e.error, e.served = unit, True, None, 0
        e.done = threading.Event()
        self._where[unit] = entry
        heapq.heappush(self._queue, (priority, next(self._seq), entry, unit, host_clock()))
        self._work.notify()

    # ---------------------------------------------------------------- workers
    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._work.wait()
                if self._closing and not self._queue:
                    return
                _, _, entry, unit, queued = heapq.heappop(self._queue)
                e = self._entries[entry]
                fence, e.fence = e.fence, None
            host_caught_up(queued)
            error = None
            nbytes = 0
            started = self._tel.read_started()
            try:
                if fence is not None:
                    fence.synchronize()  # the last copy out of this entry has run
                    started = self._tel.read_started()  # the read starts now, not the wait for the copy
                nbytes, e.pieces = self._store.read_unit(unit, self._buffers[entry])
            except BaseException as exc:  # handed to whoever waits for this unit
                error = exc
                log.error("[tiered offload] disk stream: %s", exc)
            finally:
                self._tel.read_ended(started, nbytes, error is None)
                ended = host_clock()
                timeline = self._tel.timeline
                if timeline is not None and error is None:
                    timeline.read(unit, started, ended, nbytes)
            with self._lock:
                e.reading, e.error, e.read_at = False, error, ended
                if error is not None:
                    del self._where[unit]
                    e.unit = None
                e.done.set()
                self._work.notify_all()

    def close(self) -> None:
        """Drop the reads not started, finish those under way, stop the workers, free the entries."""
        with self._lock:
            for _, _, entry, unit, _ in self._queue:
                e = self._entries[entry]
                del self._where[unit]
                e.unit, e.reading, e.error = None, False, RuntimeError("the host cache was closed")
                e.done.set()
            self._queue.clear()
            self._closing = True
            self._work.notify_all()
        for t in self._threads:
            t.join()
        for e in self._entries:
            if e.fence is not None:
                e.fence.synchronize()
        self._buffers = []
        self._storage.release()
