"""The stream model on a virtual clock: a device with a link rate, compute that takes given times,
and a disk with a read rate, for the planner's tests on a CPU.

It is the stream model (stream_model.py: CUDA's ordering rules, checked) with time added the way
a GPU spends it, in milliseconds:

- each stream has a clock: work queued on it starts when the stream is free, when the thread that
  queued it got there, and after every event it was told to wait for; a copy takes its bytes over
  the link rate, ``spend(ms)`` (what a test block calls as its compute) takes ``ms``;
- an event is stamped with its stream's time when recorded (never earlier than the host that
  recorded it); ``elapsed_time`` is the difference of two stamps;
- each host thread has a clock too: it moves where the thread waits for the device (a synchronize
  of a stream or an event) and where it waits for another thread (``host_caught_up``: the engine
  hands a stamp with each job, read and copy it passes between its threads); the engine's host
  clock (``offload_core.ordering.host_clock``) reads it;
- a disk read takes its bytes over the disk rate, one read after another.

Nothing else takes time: issuing work, a hook's Python, a lock. So the times it gives depend only
on the order of the work the engine issued, not on how busy the machine running the test is, and
a test can hold the engine's measurements and the planner's predictions to them.

What runs in real time is the model's own (copies on side streams run late on worker threads).
Disk reads may also be held for real time in proportion to their virtual length
(``read_sleep``): the disk cache decides what to evict from which reads have ended, so a disk that
is slow on the virtual clock must be slow to the cache's threads as well.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from stream_model import ModelEvent, ModelStream, StreamModel, installed


class TimedStreamModel(StreamModel):
    """The stream model with a link of ``link_bytes_per_ms`` and a disk of ``disk_bytes_per_ms``;
    ``read_sleep``: real seconds a read is held per virtual millisecond it takes."""

    def __init__(self, link_bytes_per_ms: float, disk_bytes_per_ms: float | None = None, *,
                 read_sleep: float = 0.0, seed: int = 0) -> None:
        super().__init__(seed=seed, max_delay_s=0.0001)
        self.link = link_bytes_per_ms
        self.disk = disk_bytes_per_ms
        self.read_sleep = read_sleep
        self._clocks = threading.local()
        self._disk_lock = threading.Lock()
        self.disk_free = 0.0
        self.default.vt = 0.0

    # ------------------------------------------------------------------ clocks
    def now(self) -> float:
        """The calling thread's clock, in ms."""
        return getattr(self._clocks, "t", 0.0)

    def _advance(self, t: float) -> None:
        if t > self.now():
            self._clocks.t = t

    def host_clock(self) -> float:
        return self.now() / 1000.0

    def host_caught_up(self, stamp: float) -> None:
        self._advance(stamp * 1000.0)

    def device_time(self) -> float:
        """Where the default (compute) stream's queued work ends, in ms."""
        with self._cond:
            return self.default.vt

    def spend(self, ms: float) -> None:
        """``ms`` of compute on the calling thread's current stream (a test block's forward)."""
        stream = self.current_stream()
        with self._cond:
            stream.vt = max(stream.vt, self.now()) + ms

    # ------------------------------------------------------------------ the seam, timed
    def stream(self, label: str) -> ModelStream:
        stream = super().stream(label)
        stream.vt = 0.0
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream()
        with self._cond:
            stream.vt = max(stream.vt, self.now()) + src.numel() * src.element_size() / self.link
        super().copy(dst, src)

    def _record(self, event: ModelEvent, stream: ModelStream | None) -> None:
        stream = stream if stream is not None else self.current_stream()
        super()._record(event, stream)
        with self._cond:
            event.vt = max(stream.vt, self.now())

    def _wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        super()._wait_event(stream, event)
        if event.vc is not None:
            with self._cond:
                stream.vt = max(stream.vt, event.vt)

    def _sync_stream(self, stream: ModelStream, what: str) -> None:
        super()._sync_stream(stream, what)
        self._advance(stream.vt)

    def _sync_event(self, event: ModelEvent) -> None:
        super()._sync_event(event)
        if event.vc is not None:
            self._advance(event.vt)

    def _elapsed(self, start: ModelEvent, end: ModelEvent) -> float:
        before = len(self.violations)
        super()._elapsed(start, end)  # checks that the host synchronized both
        return 0.0 if len(self.violations) > before else end.vt - start.vt

    def disk_read(self, read, store, i: int, dst: torch.Tensor, start: int, length: int | None) -> int:
        with self._disk_lock:  # one read after another, on both clocks
            n = super().disk_read(read, store, i, dst, start, length)
            begin = max(self.now(), self.disk_free)
            self.disk_free = begin + n / self.disk
            self._advance(self.disk_free)
            if self.read_sleep:
                time.sleep(n / self.disk * self.read_sleep)
        return n


@contextlib.contextmanager
def timed_installed(model: TimedStreamModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[TimedStreamModel]:
    """``model`` installed as the CPU device's ordering (see stream_model.installed); the test
    fails if the engine broke an ordering rule."""
    with installed(model, monkeypatch):
        yield model
    assert not model.violations, "\n".join(model.violations)
