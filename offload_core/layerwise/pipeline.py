"""One model of the streaming pipeline: the step time a setting gives, from what a pass costs.

Why one model: the planner (planner.py) chooses a setting by what this model predicts for each
candidate, and the panel shows the same prediction beside what the run measured, with the reason
the model gives. Two models would drift apart, and the panel would explain a choice the planner
did not make.

The pipeline is the engine's own, step by step (window.py, slots.py, cache_ring.py,
host_cache.py), with each step's cost taken from a measured pass (``Costs``):

- Units run in order, each for its compute time; a pass ends with the work outside the units
  (the model's other layers, the sampler), and the next pass follows.
- Resident units only compute. The streamed ones go through ``prefetch + 1`` device slots: when
  a streamed unit's compute is queued, its slot is freed behind it and the copy of the unit
  ``prefetch + 1`` places further in the streamed order goes into it, once the copy stream is
  free and the slot's last reader is done. Compute of a streamed unit waits for its copy.
- On a device whose copies are asynchronous (a GPU) copies run beside compute, one after the
  other on one copy stream; on the plain host they run on the sampling thread, between units.
- From disk, a unit is read into the RAM cache before its copy, by the cache's rule (the entry
  whose unit is needed furthest ahead is reused, read-ahead never evicts a unit needed sooner,
  the units on their way to the slots and those read ahead are never evicted), one read after
  another at the disk's rate; a unit still cached from the previous pass is a hit and is not read
  again. The
  sampling thread waits for a unit whose copy has not been issued yet (cache_ring.py), which is
  what keeps it from running ahead of the disk.

The model runs a few passes from a cold start and takes the mean period of the last two: the
steady state, which is what every later step of a run costs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from ..alignment import PAGE, align_up
from ..device.bounds import bound_by
from ..device.residency import bound_bytes, slot_count
from ..disk.cache_rule import entries_needed, pick_victim, protected_units, read_ahead

PASSES = 6  # passes simulated from a cold start; the last two are the steady state
STEADY = 2  # a steady state may alternate between two passes: their mean is the step
# From disk the cache's state may repeat only every few passes: more passes, and the mean of more.
DISK_PASSES = 10
DISK_STEADY = 4


@dataclass(frozen=True)
class DiskCosts:
    """The disk side of a pass: the read rate and the RAM cache it reads into."""

    bytes_per_ms: float
    cap_bytes: int  # RAM for the cache (host_cache_gb)


@dataclass(frozen=True)
class Costs:
    """What one pass costs, per unit in run order: measured, or estimated from a measured pass.

    ``copy_ms[u]`` is the copy of unit ``u`` into a slot (with a LoRA merge, merge included),
    ``outside_ms`` the compute of a pass outside the units. ``asynchronous``: copies run beside
    compute (a GPU). ``disk``: the units stream from disk through a RAM cache. ``cycle``: the
    costs of the other passes a run's calls alternate with (a cond and an uncond call of other
    shapes): one setting serves them all, so a setting's step is the mean over the cycle."""

    compute_ms: tuple[float, ...]
    copy_ms: tuple[float, ...]
    unit_bytes: tuple[int, ...]
    unit_blocks: tuple[int, ...]
    shared_bytes: int
    outside_ms: float
    asynchronous: bool
    disk: DiskCosts | None = None
    cycle: tuple[Costs, ...] = ()

    @property
    def units(self) -> int:
        return len(self.compute_ms)


@dataclass(frozen=True)
class Setting:
    """One choice of the planner: which units stay resident (sorted unit indices), how many
    streamed units are copied ahead (``prefetch``) and, from disk, how many are read ahead."""

    resident: tuple[int, ...]
    prefetch: int
    read_ahead: int = 0

    def describe(self, costs: Costs) -> dict:
        """JSON-ready: the resident units (and the blocks they make up), prefetch, read-ahead."""
        blocks = sorted({costs.unit_blocks[u] for u in self.resident})
        return {"resident_units": list(self.resident), "resident_blocks": blocks,
                "prefetch": self.prefetch, "read_ahead": self.read_ahead}


@dataclass(frozen=True)
class Prediction:
    """What the model says one steady pass of a setting costs."""

    step_ms: float
    compute_ms: float  # the units' and the outside compute
    stall_ms: float  # compute waiting for copies (or, on the host, the copies themselves)
    disk_stall_ms: float  # of that, waiting for the disk
    copy_busy_ms: float
    device_bytes: int  # resident units, shared tensors and slots
    reads: float = 0  # disk reads per pass (a mean: the cache's state may differ from pass to pass)
    read_bytes: float = 0
    hits: float = 0  # cache hits per pass
    requests: int = 0
    blocking: bool = False  # the copies run on the sampling thread (the plain host)

    @property
    def bound(self) -> str:
        """What bounds the pass, by the picture's own rule (device/bounds.py)."""
        return bound_by(self.compute_ms, self.stall_ms - self.disk_stall_ms, self.disk_stall_ms,
                        blocking=self.blocking)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.requests if self.requests else None


def cache_shape(costs: Costs, streamed: Sequence[int], nslots: int) -> tuple[int, int, int]:
    """(entry bytes, entries, units it must hold at once) of the disk cache for these streamed
    units, as the disk tier sizes it (tier.py): entries of the largest streamed unit."""
    if costs.disk is None or not streamed:
        return 0, 0, 0
    entry = align_up(max(costs.unit_bytes[u] for u in streamed), PAGE)
    return entry, costs.disk.cap_bytes // entry, entries_needed(nslots, len(streamed))


def most_read_ahead(costs: Costs, streamed: Sequence[int], nslots: int) -> int:
    """The deepest read-ahead the cache leaves room for (0: the setting does not fit the cache)."""
    _, count, need = cache_shape(costs, streamed, nslots)
    return max(0, count - need + 1) if count >= need else 0


def predict(costs: Costs, setting: Setting) -> Prediction:
    """The steady pass of ``setting``: its period and what fills it (over a cycle of passes, the
    mean pass; the device memory of the largest)."""
    if costs.cycle:
        each = [_predict_one(c, setting) for c in (replace(costs, cycle=()), *costs.cycle)]
        n = len(each)
        return Prediction(*(sum(getattr(p, f) for p in each) / n for f in _MEAN_FIELDS[:5]),
                          max(p.device_bytes for p in each),
                          *(sum(getattr(p, f) for p in each) / n for f in _MEAN_FIELDS[5:]),
                          requests=max(p.requests for p in each), blocking=each[0].blocking)
    return _predict_one(costs, setting)


_MEAN_FIELDS = ("step_ms", "compute_ms", "stall_ms", "disk_stall_ms", "copy_busy_ms", "reads", "read_bytes", "hits")


def _predict_one(costs: Costs, setting: Setting) -> Prediction:
    resident = set(setting.resident)
    streamed = [u for u in range(costs.units) if u not in resident]
    nslots = slot_count(setting.prefetch, len(streamed))
    device = bound_bytes(costs.unit_bytes, setting.resident, costs.shared_bytes, setting.prefetch)
    compute = sum(costs.compute_ms) + costs.outside_ms
    if not streamed:
        return Prediction(compute, compute, 0.0, 0.0, 0.0, device)
    if costs.disk is not None:
        return _DiskPass(costs, streamed, nslots, setting.read_ahead, device).run()
    copy_busy = sum(costs.copy_ms[u] for u in streamed)
    if not costs.asynchronous:  # every copy on the sampling thread, between units
        return Prediction(compute + copy_busy, compute, copy_busy, 0.0, copy_busy, device, blocking=True)
    step, stall = _ram_async(costs, streamed, resident, nslots)
    return Prediction(step, compute, stall, 0.0, copy_busy, device)


class CopyChain:
    """The one copy stream: a copy starts once it is issued and the copy before it has ended
    (the model's passes, and the costs read off a pass another streamer ran, measure.py)."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def copy(self, issued: float, ms: float) -> float:
        """A copy of ``ms`` issued at ``issued``: when it ends."""
        self.free_at = max(issued, self.free_at) + ms
        return self.free_at


def _ram_async(costs: Costs, streamed: list[int], resident: set[int], nslots: int) -> tuple[float, float]:
    """Passes from RAM on an asynchronous device: (steady period, compute's stall in it)."""
    m = len(streamed)
    copy_ms, compute_ms = costs.copy_ms, costs.compute_ms
    ready: list[float] = []  # per streamed unit in global order (pass * m + position): copy end
    chain = CopyChain()
    for g in range(nslots):  # the attach fills the window
        ready.append(chain.copy(0.0, copy_ms[streamed[g % m]]))
    t = 0.0
    g = 0
    ends: list[float] = []
    stalls: list[float] = []
    for _ in range(PASSES):
        stall = 0.0
        for u in range(costs.units):
            if u in resident:
                t += compute_ms[u]
                continue
            if ready[g] > t:
                stall += ready[g] - t
                t = ready[g]
            t += compute_ms[u]
            # Its slot is free behind its compute: the unit nslots further on is copied into it.
            ready.append(chain.copy(t, copy_ms[streamed[(g + nslots) % m]]))
            g += 1
        t += costs.outside_ms
        ends.append(t)
        stalls.append(stall)
    return (ends[-1] - ends[-1 - STEADY]) / STEADY, sum(stalls[-STEADY:]) / STEADY


# ---------------------------------------------------------------------- disk
@dataclass(eq=False)
class _Entry:
    unit: int | None = None
    reading: bool = False
    leases: int = 0
    served: int = 0
    fence: float = 0.0  # when the last copy out of it ends


@dataclass(order=True)
class _Wake:
    time: float
    seq: int
    process: Iterator = field(compare=False)


class _DiskPass:
    """Passes from disk: the sampling thread, the copy worker and the disk as processes on one
    clock, over the cache's own rule (host_cache.py). A process yields a time to resume at, or a
    condition to wait for (checked again whenever another process has moved)."""

    def __init__(self, costs: Costs, streamed: list[int], nslots: int, read_ahead: int,
                 device_bytes: int) -> None:
        self.costs = costs
        self.order = streamed
        self.pos = {u: k for k, u in enumerate(streamed)}
        self.nslots = nslots
        self.device_bytes = device_bytes
        entry, count, need = cache_shape(costs, streamed, nslots)
        if count < need:
            raise ValueError(f"a cache of {count} entries cannot hold the {need} units streaming needs")
        self.depth = max(1, min(read_ahead or 1, count - need + 1))
        self.entries = [_Entry() for _ in range(count)]
        self.where: dict[int, int] = {}
        self.queue: list[tuple[int, int, int, int]] = []
        self.cursor = 0
        self.now = 0.0
        self._seq = 0
        self._wakes: list[_Wake] = []
        self._blocked: list[tuple[Callable[[], bool], Iterator]] = []
        self.jobs: deque[tuple[int, int]] = deque()  # (global index, unit) for the copy worker
        self.ticket: dict[int, float] = {}  # global index -> when its copy was issued
        self.ready: dict[int, float] = {}  # global index -> when its slot holds it
        self.free: dict[int, float] = {}  # global index -> when its slot's reader is done
        self.copies = CopyChain()
        self.pass_ends: list[float] = []
        self.stalls: list[tuple[float, float]] = []  # per pass: (stall, of it waiting for the disk)
        self.counts: list[list[int]] = []  # per pass: requests, hits, reads, read bytes
        self._pass = 0

    # ------------------------------------------------------------ the clock
    def run(self) -> Prediction:
        for process in (self._sampling(), self._copy_worker(), self._disk()):
            self._schedule(process, 0.0)
        while self._wakes and len(self.pass_ends) < DISK_PASSES:
            wake = heapq.heappop(self._wakes)
            self.now = max(self.now, wake.time)
            self._step(wake.process)
            self._unblock()
        c = self.costs
        compute = sum(c.compute_ms) + c.outside_ms
        ends = self.pass_ends
        step = (ends[-1] - ends[-1 - DISK_STEADY]) / DISK_STEADY
        stall = sum(s for s, _ in self.stalls[-DISK_STEADY:]) / DISK_STEADY
        disk_stall = sum(d for _, d in self.stalls[-DISK_STEADY:]) / DISK_STEADY
        # Each unit that is no hit is read once per pass (read-ahead never evicts a unit needed
        # sooner), wherever its read falls between two passes.
        last = [self.counts[p] for p in range(len(ends) - DISK_STEADY, len(ends))]
        hits = sum(k[1] for k in last) / DISK_STEADY
        misses = len(self.order) - hits
        read_bytes = round(sum(k[3] for k in last) / DISK_STEADY)
        copy_busy = sum(c.copy_ms[u] for u in self.order)
        return Prediction(step, compute, stall, disk_stall, copy_busy, self.device_bytes, misses,
                          read_bytes, hits, len(self.order), blocking=not c.asynchronous)

    def _schedule(self, process: Iterator, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._wakes, _Wake(at, self._seq, process))

    def _step(self, process: Iterator) -> None:
        try:
            kind, value = next(process)
        except StopIteration:
            return
        if kind == "at":
            self._schedule(process, value)
        else:
            self._blocked.append((value, process))

    def _unblock(self) -> None:
        moved = True
        while moved:
            moved = False
            for item in list(self._blocked):
                if item[0]():
                    self._blocked.remove(item)
                    self._step(item[1])
                    moved = True

    def _counts(self) -> list[int]:
        while len(self.counts) <= self._pass:
            self.counts.append([0, 0, 0, 0])
        return self.counts[self._pass]

    # ------------------------------------------------------------ the sampling thread
    def _sampling(self) -> Iterator:
        c, nslots = self.costs, self.nslots
        for g in range(nslots):  # the attach fills the window
            yield from self._request(g)
        host = compute = 0.0  # the sampling thread's clock, and the compute stream's
        g = 0
        while True:
            stall = disk_stall = 0.0
            for u in range(c.units):
                if u not in self.pos:
                    compute = max(compute, host) + c.compute_ms[u]
                    if not c.asynchronous:
                        host = compute
                    continue
                if g not in self.ticket:  # its copy is not issued: the thread waits (cache_ring.py)
                    yield ("until", lambda g=g: g in self.ticket)
                if self.ticket[g] > host:
                    if not c.asynchronous:  # the sampling thread computes: it waits for the disk
                        stall += self.ticket[g] - host
                        disk_stall += self.ticket[g] - host
                    host = self.ticket[g]
                start = max(compute, host)
                if self.ready[g] > start:
                    waited = self.ready[g] - start
                    stall += waited
                    if self.ticket[g] > compute:  # the copy could not be issued before the read ended
                        disk_stall += waited
                    start = self.ready[g]
                compute = start + c.compute_ms[u]
                if not c.asynchronous:
                    host = compute
                self.free[g] = compute
                if host > self.now:
                    yield ("at", host)
                yield from self._request(g + nslots)
                g += 1
            compute = max(compute, host) + c.outside_ms
            if not c.asynchronous:
                host = compute
            self.stalls.append((stall, disk_stall))
            self.pass_ends.append(compute)
            self._pass += 1
            if len(self.pass_ends) >= DISK_PASSES:
                return
            yield ("at", max(host, self.now))

    def _request(self, g: int) -> Iterator:
        """``acquire`` the unit of global index ``g`` (host_cache.py) and queue its copy."""
        unit = self.order[g % len(self.order)]
        self.cursor = self.pos[unit]
        counts = self._counts()
        counts[0] += 1
        entry = self.where.get(unit)
        if entry is None:
            while (entry := self._victim(0)) is None:
                yield ("until", lambda: self._victim(0) is not None)
            self._start_read(entry, unit, 0)
        elif self.entries[entry].served:
            counts[1] += 1
        e = self.entries[entry]
        e.leases += 1
        e.served += 1
        self._read_ahead()
        self.jobs.append((g, entry))

    # ------------------------------------------------------------ the cache's rule
    def _distance(self, unit: int) -> float:
        return (self.pos[unit] - self.cursor) % len(self.order)

    def _victim(self, need: float) -> int | None:
        protected = protected_units(self.order, self.cursor, self.nslots, self.depth)
        return pick_victim(self.entries, need, self._distance, protected)

    def _read_ahead(self) -> None:
        read_ahead(self.order, self.cursor, self.depth, self.where, self._victim, self._start_read)

    def _start_read(self, entry: int, unit: int, priority: int) -> None:
        e = self.entries[entry]
        if e.unit is not None:
            del self.where[e.unit]
        e.unit, e.reading, e.served = unit, True, 0
        self.where[unit] = entry
        self._seq += 1
        heapq.heappush(self.queue, (priority, self._seq, entry, unit))

    # ------------------------------------------------------------ the copy worker
    def _copy_worker(self) -> Iterator:
        c, order = self.costs, self.order
        while True:
            if not self.jobs:
                yield ("until", lambda: bool(self.jobs))
            g, entry = self.jobs.popleft()
            e = self.entries[entry]
            if e.reading:  # lease.wait(): the unit's read
                yield ("until", lambda e=e: not e.reading)
            unit = order[g % len(order)]
            previous = g - self.nslots  # the slot's last reader
            if previous >= 0 and previous not in self.free:
                yield ("until", lambda p=previous: p in self.free)
            slot_free = self.free.get(previous, 0.0)
            if c.asynchronous:
                self.ready[g] = e.fence = self.copies.copy(max(self.now, slot_free), c.copy_ms[unit])
                issued = self.now
            else:  # the worker copies on the host itself
                start = max(self.now, slot_free)
                yield ("at", start + c.copy_ms[unit])
                self.ready[g] = e.fence = issued = self.now
            e.leases -= 1
            self.ticket[g] = issued

    # ------------------------------------------------------------ the disk
    def _disk(self) -> Iterator:
        c = self.costs
        while True:
            if not self.queue:
                yield ("until", lambda: bool(self.queue))
            _, _, entry, unit = heapq.heappop(self.queue)
            e = self.entries[entry]
            start = max(self.now, e.fence)  # the last copy out of the entry has run
            counts = self._counts()
            counts[2] += 1
            counts[3] += c.unit_bytes[unit]
            yield ("at", start + c.unit_bytes[unit] / c.disk.bytes_per_ms)
            e.reading = False
