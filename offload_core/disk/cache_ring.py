"""Device slots fed from the host cache by a copy worker: the disk tier's side of the slot ring.

Why a worker: a unit requested for a slot may still be on its way from disk. Issuing its copy
from the sampling thread would make that thread wait for the disk while the device still has
work queued; here the sampling thread only queues the job, and the worker waits for the read,
issues the copy on the copy stream (after the slot's last reader), runs ``prepare`` (a LoRA
merge into the fresh copy) and records the slot's ready event. The sampling thread waits only
when it enters a unit whose copy has not been issued yet; that wait is the time compute waited
for the disk, and is counted. Copies are issued in request order, like the ring's own.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..device.slots import SlotRing
from ..device.telemetry import Telemetry
from ..host.copy_worker import CopyWorker
from ..host.plain_writes import plain_writes
from ..ordering import host_clock
from .host_cache import DiskTelemetry, HostCache


class CacheRing(SlotRing):
    """A SlotRing whose copies come from ``cache`` leases, issued by one worker thread."""

    def __init__(self, device: torch.device, count: int, nbytes: int, telemetry: Telemetry,
                 cache: HostCache, disk_telemetry: DiskTelemetry) -> None:
        super().__init__(device, count, nbytes, telemetry)
        self._cache = cache
        self._disk_tel = disk_telemetry
        self._worker = CopyWorker("offload-disk-copy", self._copy_job)

    def copy_unit(self, slot: int, unit: int, nbytes: int,
                  prepare: Callable[[torch.Tensor], None] | None = None) -> None:
        """Queue the copy of ``unit`` (``nbytes`` of packed layout) from the cache into ``slot``."""
        if self._state[slot] == "being read":
            raise RuntimeError(f"slot {slot} would be overwritten while a block reads it")
        self.holds[slot], self._state[slot] = None, "empty"
        lease = self._cache.acquire(unit)
        self._tickets[slot] = self._worker.submit(slot, lease, nbytes, prepare)
        self.holds[slot], self._state[slot] = unit, "loaded"
        self._tel.record_copy(nbytes)

    def wait_ready(self, slot: int) -> None:
        ticket = self._tickets.get(slot)
        if ticket is not None and not ticket.done:
            start = host_clock()
            try:
                super().wait_ready(slot)
            finally:
                self._disk_tel.add_wait(host_clock() - start)
            return
        super().wait_ready(slot)

    def _copy_job(self, slot: int, lease, nbytes: int, prepare) -> None:
        try:
            self._copy(slot, lease, nbytes, prepare)
        finally:
            lease.release()  # no-op where the copy released it with its fence

    def _copy(self, slot: int, lease, nbytes: int, prepare) -> None:
        src = lease.wait()
        pieces = lease.pieces
        dst = self.buffers[slot][:nbytes]
        ordering, stream = self._ordering, self.stream
        with plain_writes(), ordering.on(stream):
            stream.wait_event(self._free[slot])  # the slot's last reader is done
            timeline = self._tel.timeline
            start = timeline.mark(stream) if timeline is not None else None
            if pieces is None:  # the packed layout: one copy
                ordering.copy(dst, src[:nbytes])
            else:  # read from the model's file: each tensor to its place in the layout
                for p in pieces:
                    ordering.copy(dst[p.dst : p.dst + p.nbytes], src[p.src : p.src + p.nbytes])
            fence = ordering.event()
            fence.record(stream)
            lease.release(fence)  # the entry may be read into again once the copy has run
            if prepare is not None:
                prepare(dst)
            if timeline is not None:  # a worker's copy: compute waits for it only in wait_ready
                timeline.copied(lease.unit, start, timeline.mark(stream), nbytes, blocking=False)
            self._ready[slot].record(stream)

    def close(self) -> None:
        """Wait for queued copies, stop the worker, give the device memory back."""
        self.synchronize()
        self._worker.close()
        super().close()
