"""Copies out of pageable host memory that do not hold up the sampling thread.

Why: from pageable memory ``cudaMemcpyAsync`` is not asynchronous for the host.
The driver stages the source through its own pinned buffer and returns only when
the last piece is staged, so a copy issued when a block exits would hold the
sampling thread for the whole transfer, and the GPU would run out of queued work.
Here one worker thread does that staging instead: it copies the source piece by
piece into a small pinned bounce buffer (two halves; a half is refilled only
after the device copy out of it has finished) and issues the device copies on the
copy stream.  The sampling thread only queues the job, and waits on the host only
when it needs a block whose copies have not all been issued yet.

Every copy of one ring goes through the worker once it has one, in submission
order, so the copy stream sees the same order as without staging.  Streams, events
and copies go through the device's ordering (``offload_core/ordering.py``): on a
plain CPU the same code copies synchronously and its events order nothing, which
keeps the piece logic and the error path testable there.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

import torch

from ..ordering import Event, Stream, for_device
from .copy_worker import CopyWorker, Ticket
from .pinned import HostStorage
from .plain_writes import plain_writes

PIECE_BYTES = 16 << 20  # one half of the bounce buffer


class CopyRecorder(Protocol):
    """Where a copy's start and end are marked (the attach's timeline, ``device/timeline.py``)."""

    def mark(self, stream: Stream | None = None) -> Event: ...

    def copied(self, unit: Hashable, start: Event, end: Event, nbytes: int, blocking: bool) -> None: ...


class Stager:
    """A worker thread that copies host ranges into device buffers, through a pinned bounce buffer
    where the source is pageable.

    ``bounce`` holds ``2 * piece_bytes`` bytes of host memory (pinned, or there is
    no point in staging); without one every copy is issued directly (a worker for
    the ``prepare`` steps only).  ``stream`` is the copy stream, of ``device``'s ordering.
    With a ``recorder`` each copy is marked on the copy stream, staged or not.
    """

    def __init__(self, device: torch.device, stream: Stream, bounce: HostStorage | None,
                 piece_bytes: int = PIECE_BYTES, recorder: CopyRecorder | None = None) -> None:
        self.device = device
        self._ordering = for_device(device)
        self._stream = stream
        self._recorder = recorder
        self._piece = piece_bytes
        if bounce is not None:
            buf = bounce.buffer(0)
            if buf.numel() < 2 * piece_bytes:
                raise ValueError(f"the bounce buffer needs {2 * piece_bytes} bytes, got {buf.numel()}")
            bounce.note_reader(device)
            self._halves = [buf[:piece_bytes], buf[piece_bytes : 2 * piece_bytes]]
            self._drained = [self._ordering.event() for _ in range(2)]
        self._worker = CopyWorker("offload-stager", self._copy)

    def submit(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        bounce: bool = True,
        after_free: Event | None = None,
        prepare: Callable[[torch.Tensor], None] | None = None,
        ready: Event | None = None,
        tag: Hashable = None,
    ) -> Ticket:
        """Queue ``dst.copy_(src)`` (uint8, same size), then ``prepare(dst)``, then record ``ready``.

        The copy stream first waits for ``after_free``; everything runs on that
        stream, so ``ready`` covers the copy and whatever ``prepare`` queued.
        Without ``bounce`` (a pinned ``src``, or a stager without a bounce buffer)
        the copy is issued directly, still in submission order. ``tag`` names the
        copy to the recorder.
        """
        if dst.numel() != src.numel():
            raise ValueError(f"staged copy of {src.numel()} bytes into {dst.numel()}")
        return self._worker.submit(dst, src, bounce, after_free, prepare, ready, tag)

    def record(self, recorder: CopyRecorder | None) -> None:
        """Mark the copies issued from now on with ``recorder`` (None: no more marks)."""
        self._recorder = recorder

    def close(self) -> None:
        """Let queued jobs finish, then stop the worker."""
        self._worker.close()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, bounce: bool, after_free: Event | None,
              prepare: Callable[[torch.Tensor], None] | None, ready: Event | None, tag: Hashable) -> None:
        stream, recorder = self._stream, self._recorder
        with plain_writes(), self._ordering.on(stream):
            if after_free is not None:
                stream.wait_event(after_free)
            start = recorder.mark(stream) if recorder is not None else None
            if bounce:
                self._pieces(dst, src)
            else:
                self._ordering.copy(dst, src)
            if prepare is not None:
                prepare(dst)
            if recorder is not None:  # a worker's copy: compute waits for it only in wait_ready
                recorder.copied(tag, start, recorder.mark(stream), dst.numel(), blocking=False)
            if ready is not None:
                ready.record(stream)

    def _pieces(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for k, start in enumerate(range(0, src.numel(), self._piece)):
            half, n = k % 2, min(self._piece, src.numel() - start)
            bounce = self._halves[half][:n]
            self._drained[half].synchronize()  # the device copy out of this half is done
            bounce.copy_(src[start : start + n])
            self._ordering.copy(dst[start : start + n], bounce)
            self._drained[half].record(self._stream)
