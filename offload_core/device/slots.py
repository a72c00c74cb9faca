"""A ring of preallocated device byte slots fed from host packs.

Why owned slots ordered by events: addresses and memory stay fixed (no
caching-allocator churn, no fragmentation), and a slot is overwritten only after
an event recorded behind its last reader, on the GPU, with no host sync.  All
slot writes happen on one side stream, all reads on the compute stream (the
caller's current stream, looked up outside any side-stream context).  Streams,
events and copies go through the device's ordering (``offload_core/ordering.py``):
on a plain CPU they order nothing and every copy ends before the next line.

A copy may be followed by a ``prepare`` step on the slot (e.g. a LoRA merge into
the fresh copy).  It runs on the copy stream after the copy and before the slot's
ready event is recorded, so the compute stream never sees the bytes in between.
Where copies are asynchronous, a ring whose copies have a ``prepare`` step issues
them from a worker thread: a merge whose math waits for the device (a norm check,
an ``inverse()``) or reads pageable tensors then holds the worker, not the
sampling thread, and the sampling thread's waits for it are counted
(``staging_waits``).

The ring also keeps each slot's state on the host (empty, loaded, being read)
and refuses a step out of order: the host-side mirror of the event protocol, so
a scheduling mistake fails loudly on a CPU instead of racing on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

import torch

from ..host.copy_worker import Ticket
from ..host.pinned import HostStorage
from ..host.staging import Stager
from ..ordering import for_device
from .telemetry import Telemetry
from .timeline import Timeline

log = logging.getLogger(__name__)

_EMPTY, _LOADED, _READING = "empty", "loaded", "being read"


def resolve_device(device: torch.device | str) -> torch.device:
    """A usable compute device with an explicit index, or a ValueError saying why not."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device {dev} is not supported; use a cpu or cuda device")
    return dev


class SlotRing:
    """``count`` device buffers of ``nbytes`` each, with copy-in / ready / free ordering.

    With a ``bounce`` storage every copy goes through a ``Stager`` (a worker thread
    and that pinned bounce buffer), for host packs that are not all page-locked:
    one issuing thread keeps the copies in order; pinned sources skip the bounce.
    ``worker`` (copies with a ``prepare`` step) asks for that thread where copies
    are asynchronous, with or without a bounce buffer.
    """

    def __init__(self, device: torch.device, count: int, nbytes: int, telemetry: Telemetry,
                 bounce: HostStorage | None = None, worker: bool = False) -> None:
        self.device = device
        self._ordering = ordering = for_device(device)
        self._current_stream = ordering.current_stream  # the compute stream, asked for per block
        self.nbytes = nbytes
        self._tel = telemetry
        self.buffers = [ordering.buffer(nbytes, f"slot {k}") for k in range(count)]
        telemetry.add_device_alloc(count * nbytes)
        self.holds: list[Hashable | None] = [None] * count  # what each slot's bytes are
        self._state = [_EMPTY] * count
        self._tickets: dict[int, Ticket] = {}
        self.stream = ordering.stream("copy")
        # Fresh slot memory may be recycled from tensors that queued compute work still reads.
        self.stream.wait_stream(ordering.current_stream())
        self._ready = [ordering.event() for _ in range(count)]
        self._free = [ordering.event() for _ in range(count)]
        # The attach's picture, if one is recorded: copies issued from here or by the copy
        # worker are marked.
        self._timeline = telemetry.timeline
        self._bounce = bounce is not None
        self._stager = None
        if bounce is not None or (worker and ordering.asynchronous):
            self._stager = Stager(device, self.stream, bounce, recorder=self._timeline)

    def copy_in(self, slot: int, host: torch.Tensor, tag: Hashable,
                prepare: Callable[[torch.Tensor], None] | None = None) -> None:
        """One copy of a whole packed block into ``slot`` after its last reader is done, then ``prepare``."""
        if self._state[slot] == _READING:
            raise RuntimeError(f"slot {slot} would be overwritten while a block reads it")
        self.holds[slot], self._state[slot] = None, _EMPTY
        n = host.numel()
        dst = self.buffers[slot][:n]
        if self._stager is not None:
            # part of a pack may be pinned: no bounce needed
            bounce = self._bounce and not self._ordering.is_pinned(host)
            self._tickets[slot] = self._stager.submit(
                dst, host, bounce=bounce, prepare=prepare, after_free=self._free[slot],
                ready=self._ready[slot], tag=tag,
            )  # fmt: skip
            self._tel.staged_copies += bounce
        else:
            stream, ordering = self.stream, self._ordering
            with ordering.on(stream):
                stream.wait_event(self._free[slot])  # no-op until the slot has had a reader
                if self._timeline is not None:
                    self._recorded_copy(dst, host, tag, prepare)
                elif ordering.asynchronous:
                    ordering.copy(dst, host)
                    if prepare is not None:
                        prepare(dst)
                else:  # on this thread: compute waits for all of it
                    start = time.perf_counter()
                    ordering.copy(dst, host)
                    if prepare is not None:
                        prepare(dst)
                    self._tel.copied_on_this_thread(time.perf_counter() - start)
                self._ready[slot].record(stream)
        self.holds[slot], self._state[slot] = tag, _LOADED
        self._tel.record_copy(n)

    def record(self, timeline: Timeline | None) -> None:
        """Mark the copies issued from now on in ``timeline`` (None: no more marks)."""
        self._timeline = timeline
        if self._stager is not None:
            self._stager.record(timeline)

    def _recorded_copy(self, dst: torch.Tensor, host: torch.Tensor, tag: Hashable,
                       prepare: Callable[[torch.Tensor], None] | None) -> None:
        """The copy (and its ``prepare`` step) between two marks on the copy stream (on a plain
        CPU, on this thread, which compute then waits for)."""
        timeline = self._timeline
        start = timeline.mark(self.stream)
        self._ordering.copy(dst, host)
        if prepare is not None:
            prepare(dst)
        end = timeline.mark(self.stream)
        blocking = not self._ordering.asynchronous
        timeline.copied(tag, start, end, host.numel(), blocking=blocking)
        if blocking:
            self._tel.copied_on_this_thread(start.elapsed_time(end) / 1000.0)

    def wait_ready(self, slot: int) -> None:
        """Make the compute stream wait (GPU-side) for the slot's last copy; the slot is then being read."""
        if self._state[slot] != _LOADED:
            raise RuntimeError(f"slot {slot} is read while {self._state[slot]}")
        ticket = self._tickets.pop(slot, None)
        if ticket is not None:
            if not ticket.done:
                self._tel.staging_waits += 1
            try:
                ticket.wait()
            except BaseException:
                self.holds[slot], self._state[slot] = None, _EMPTY
                raise
        self._current_stream().wait_event(self._ready[slot])
        self._state[slot] = _READING

    def mark_free(self, slot: int) -> None:
        """Record that every compute work queued so far is the slot's last reader."""
        if self._state[slot] != _READING:
            raise RuntimeError(f"slot {slot} is released while {self._state[slot]}")
        self._free[slot].record(self._current_stream())
        self._state[slot] = _LOADED

    def wait_issued(self) -> None:
        """Wait until a copy worker (staging, or the disk tier's) has issued every copy queued so
        far. A failed copy is not raised here: its slot's reader meets it in ``wait_ready``."""
        for ticket in list(self._tickets.values()):
            try:
                ticket.wait()
            except RuntimeError:
                pass

    def synchronize(self) -> None:
        """Wait until every queued copy and every compute work queued so far has finished."""
        for slot, ticket in list(self._tickets.items()):
            try:
                ticket.wait()
            except RuntimeError as e:  # nobody needed that block; its next copy starts afresh
                log.debug("[tiered offload] slot %d: %s", slot, e)
                self.holds[slot], self._state[slot] = None, _EMPTY
        self._tickets.clear()
        self.stream.synchronize()
        self._ordering.current_stream().synchronize()

    def close(self) -> None:
        """Wait for in-flight work, then give the memory back."""
        self.synchronize()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        # A block may have read its slot on any stream, not only the two synchronize() waits for:
        # the caching allocator hands freed memory to new work at once.
        self._ordering.synchronize()
        self._tel.add_device_alloc(-len(self.buffers) * self.nbytes)
        self.buffers = []
