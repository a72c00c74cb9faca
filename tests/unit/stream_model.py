"""A model of CUDA's stream ordering: the engine's GPU code path run on a CPU, and checked.

Installed with ``offload_core.ordering.install_model`` (the ``stream_model`` fixture of
tests/unit/conftest.py), it is the CPU device's ordering and the page-locker of host memory, so
the engine takes the path it takes on a GPU: a copy stream, events, staging and copy workers,
pinned packs. It follows CUDA's rules:

- a stream runs its work in the order it was queued; an event captures the work queued on its
  stream when it is recorded; ``wait_event`` and ``wait_stream`` order all later work of a stream
  after that; the host waits only where it synchronizes: a stream, an event, the device, or
  implicitly by reading a value out of device memory (``.item()``, ``torch.equal``) on the
  current stream (device memory: watched buffers, and any tensor on a side stream, where only
  device work is issued);
- that order is kept as vector clocks: each stream counts its work and knows how far into every
  other stream's work it is ordered; the host knows how far each stream's work has completed.

It tracks the device buffers the engine makes through the seam (slots, resident buffers, side
tensors) and the host memory it page-locks (packs, the staging bounce buffer, the disk cache, the
side tensors' host copy): per byte range, the last write and the reads since, with their stream
and position. Torch ops are seen by a dispatch mode on every thread that issues the engine's
work (the test's, and each worker inside ``on(stream)``), non-blocking copies by the seam. It
reports, naming the buffer, both operations and their streams:

- ``unordered read``: a read not ordered after the last write;
- ``unordered write``: a write not ordered after the last write or a read since;
- ``free while in use``: a device buffer freed (its last tensor gone) while an access by another
  stream is not ordered before the allocation stream's next work (the caching allocator hands
  the memory to that stream's next allocation), or host memory unpinned while a copy may still
  read it;
- ``host access without synchronize``: the host reads device memory, writes pinned host memory,
  or reads an event's time, with no synchronize of the stream that last touched it before;
- ``write of read-only memory``: anything writes host memory page-locked as read-only (a host
  store other processes share: on a GPU machine that write would crash the process, or change
  every process's weights).

What runs: work on the default stream runs on the calling thread. Copies queued on a side stream
run later, on that stream's worker thread, each after a seeded random delay, so a read the
engine forgot to order reads stale bytes; ordered work waits for them (an op on a side stream
waits for its queued copies, a wait on an event for the copies the event covers). ``hold()``
keeps every side stream's copies back until it ends.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import mmap
import os
import random
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload_core.disk.in_place import ModelFile
from offload_core.disk.store import DiskStore
from offload_core.ordering import install_model

# Ops that hand a value of device memory to the host: on CUDA they synchronize the current stream.
_HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero"}
# Ops that change what a tensor is, never the bytes it shows.
_METADATA = {"set_", "set_data", "resize_", "detach_", "_version", "requires_grad_", "_has_same_storage_numel"}
_TORCH_DIR = os.path.dirname(torch.__file__)
_SKIPPED_FILES = (_TORCH_DIR, os.path.abspath(__file__), contextlib.__file__)
_ids = itertools.count(1)


class StreamOrderError(AssertionError):
    """The engine broke one of CUDA's ordering rules (the message says which, where, by whom)."""


@dataclass
class _Access:
    lo: int
    hi: int
    stream: ModelStream | None  # None: the host
    pos: int
    op: str
    write: bool


class _Buffer:
    """Memory the model watches: ``device`` memory made through the seam, or pinned host memory."""

    def __init__(self, label: str, base: int, nbytes: int, device: bool, stream: ModelStream | None,
                 read_only: bool = False) -> None:
        self.label, self.base, self.nbytes, self.device = label, base, nbytes, device
        self.stream = stream  # the allocation stream of device memory
        self.read_only = read_only  # host memory page-locked as read-only (a shared host store)
        self.accesses: list[_Access] = []


class ModelStream:
    """A stream of the model: its vector clock, and its queue of copies not run yet."""

    def __init__(self, model: StreamModel, label: str, inline: bool) -> None:
        self._model = model
        self.label = label
        self.cuda_stream = next(_ids)
        self.vc: dict[int, int] = {self.cuda_stream: 0}
        self.inline = inline  # its work runs on the issuing thread (the default stream)
        self.issued = 0  # items queued for the worker, in all
        self.done = 0  # items the worker finished
        self.items: deque = deque()
        self.stamps: list[ModelEvent] = []  # timing events waiting for the worker to reach them
        self.thread: threading.Thread | None = None

    def wait_event(self, event: ModelEvent) -> None:
        self._model._wait_event(self, event)

    def wait_stream(self, stream: ModelStream) -> None:
        event = ModelEvent(self._model, timing=False)
        event.record(stream)
        self._model._wait_event(self, event)

    def synchronize(self) -> None:
        self._model._sync_stream(self, "stream synchronize")

    def __repr__(self) -> str:
        return f"stream '{self.label}'"


class ModelEvent:
    """An event of the model: the clock of its stream when recorded, and where its work ends."""

    def __init__(self, model: StreamModel, timing: bool) -> None:
        self._model = model
        self.timing = timing
        self.vc: dict[int, int] | None = None  # None until recorded
        self.stream: ModelStream | None = None
        self.ticket = 0
        self.time: float | None = None

    def record(self, stream: ModelStream | None = None) -> None:
        self._model._record(self, stream)

    def synchronize(self) -> None:
        self._model._sync_event(self)

    def query(self) -> bool:
        return self._model._query(self)

    def elapsed_time(self, end: ModelEvent) -> float:
        return self._model._elapsed(self, end)


class _Watch(TorchDispatchMode):
    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self._model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._model._op(func, args, kwargs)
        return func(*args, **kwargs)


class StreamModel:
    """The CPU device's ordering under CUDA's rules, and the page-locker of host memory.

    ``strict``: a broken rule raises ``StreamOrderError`` where it happens (frees and unpins, seen
    from finalizers and release paths, are only recorded); every one is in ``violations``.
    ``host_syncs`` lists (thread name, what) for every host synchronize, as CUDA's sync debug
    mode would see them; ``events_made`` counts the events made through the seam."""

    asynchronous = True
    key = "stream model"

    def __init__(self, seed: int = 0, max_delay_s: float = 0.001, strict: bool = True) -> None:
        self.device = torch.device("cpu")
        self.strict = strict
        self.violations: list[str] = []
        self.host_syncs: list[tuple[str, str]] = []
        self.events_made = 0
        self._rng = random.Random(seed)
        self._max_delay = max_delay_s
        self._cond = threading.Condition(threading.RLock())
        self._tls = threading.local()
        self._buffers: dict[int, _Buffer] = {}  # storage base pointer -> watched memory
        self._done: dict[int, int] = {}  # stream id -> how far the host knows its work completed
        self._specs: dict[object, list[tuple[int, str, bool]] | None] = {}
        self.default = ModelStream(self, "default", inline=True)
        self._streams = [self.default]
        self._held = False
        self._closed = False

    # ------------------------------------------------------------------ the seam
    def stream(self, label: str) -> ModelStream:
        stream = ModelStream(self, label, inline=False)
        with self._cond:
            self._streams.append(stream)
        return stream

    def current_stream(self) -> ModelStream:
        return getattr(self._tls, "stream", None) or self.default

    def event(self, timing: bool = False) -> ModelEvent:
        with self._cond:
            self.events_made += 1
        return ModelEvent(self, timing)

    @contextlib.contextmanager
    def on(self, stream: ModelStream) -> Iterator[None]:
        previous = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            with self.watch():
                yield
        finally:
            self._tls.stream = previous

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream()
        touches = [hit + (write,) for t, write in ((dst, True), (src, False)) if (hit := self._lookup(t))]
        with self._cond:
            self._apply(stream, f"copy in {_caller()}", touches)
            if not stream.inline:
                self._enqueue(stream, ("copy", _alias(dst), src))
                if not dst.is_inference():  # CUDA counts the write when it is issued
                    torch.autograd.graph.increment_version(dst)
                return
        with self._quiet():
            dst.copy_(src)

    def buffer(self, nbytes: int, label: str) -> torch.Tensor:
        with torch.inference_mode(False):
            if not nbytes:
                return torch.empty(0, dtype=torch.uint8)
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            tensor = torch.frombuffer(region, dtype=torch.uint8)
        buf = _Buffer(label, tensor.data_ptr(), nbytes, device=True, stream=self.current_stream())
        with self._cond:
            self._buffers[buf.base] = buf
        weakref.finalize(region, self._freed, buf)  # when the last tensor over it is gone
        return tensor

    def synchronize(self) -> None:
        for stream in list(self._streams):
            self._sync_stream(stream, "device synchronize")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        hit = self._lookup(tensor)
        return hit is not None and not hit[0].device

    # ------------------------------------------------------------------ page-locking
    def register(self, ptr: int, nbytes: int, label: str, read_only: bool = False) -> int:
        with self._cond:
            self._buffers[ptr] = _Buffer(label, ptr, nbytes, device=False, stream=None, read_only=read_only)
        return 0

    def unregister(self, ptr: int) -> int:
        with self._cond:
            buf = self._buffers.pop(ptr, None)
            if buf is None:
                return 1
            for a in buf.accesses:
                if a.stream is not None and self._done.get(a.stream.cuda_stream, 0) < a.pos:
                    self._report(f"free while in use: {buf.label} [bytes {a.lo}:{a.hi}] unpinned by the host "
                                 f"while {a.op} ({_rw(a.write)}) on {a.stream} at its position {a.pos} is not "
                                 "synchronized", fatal=False)
        return 0

    # ------------------------------------------------------------------ for tests
    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """See the torch ops of the calling thread while inside."""
        if getattr(self._tls, "watching", False):
            yield
            return
        self._tls.watching = True
        try:
            with _Watch(self):
                yield
        finally:
            self._tls.watching = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """No side stream runs a queued copy until this ends (a slow link, made certain)."""
        with self._cond:
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    # The host's clock (``offload_core.ordering.host_clock``): this model keeps real time; a timed
    # one (timed_streams.py) keeps a virtual clock per thread.
    host_clock = staticmethod(time.perf_counter)

    def host_caught_up(self, stamp: float) -> None:
        pass

    def disk_read(self, read, store: DiskStore, i: int, dst: torch.Tensor, start: int, length: int | None) -> int:
        """A disk read into ``dst``: a host write the model cannot see by itself."""
        self.host_write(dst, "disk read in DiskStore.read")
        return read(store, i, dst, start, length)

    def host_write(self, tensor: torch.Tensor, op: str) -> None:
        """The host wrote ``tensor`` outside torch (a disk read into a buffer)."""
        hit = self._lookup(tensor)
        if hit is not None:
            with self._cond:
                self._apply(None, op, [hit + (True,)])

    def close(self) -> None:
        """Run what is queued and stop the workers."""
        with self._cond:
            self._held = False
            self._closed = True
            self._cond.notify_all()
        for stream in self._streams:
            if stream.thread is not None:
                stream.thread.join()

    # ------------------------------------------------------------------ streams and events
    def _record(self, event: ModelEvent, stream: ModelStream | None) -> None:
        stream = stream if stream is not None else self.current_stream()
        with self._cond:
            event.vc, event.stream, event.ticket = dict(stream.vc), stream, stream.issued
            if stream.done >= stream.issued:
                event.time = time.perf_counter()
            else:
                event.time = None
                stream.stamps.append(event)

    def _wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        with self._cond:
            if event.vc is None:  # never recorded: CUDA waits for nothing
                return
            _join(stream.vc, event.vc)
            if self._complete(event):
                return
            if stream.inline:  # its later work runs on this thread: it must find the copies done
                self._cond.wait_for(lambda: self._complete(event))
            else:
                self._enqueue(stream, ("wait", event))

    def _sync_stream(self, stream: ModelStream, what: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: stream.done >= stream.issued)
            _join(self._done, stream.vc)
            self._note_sync(f"{what} of {stream}")

    def _sync_event(self, event: ModelEvent) -> None:
        with self._cond:
            if event.vc is None:
                return
            self._cond.wait_for(lambda: self._complete(event))
            _join(self._done, event.vc)
            self._note_sync(f"event synchronize on {event.stream}")

    def _query(self, event: ModelEvent) -> bool:
        with self._cond:
            if event.vc is None:
                return True
            if not self._complete(event):
                return False
            _join(self._done, event.vc)
            return True

    def _elapsed(self, start: ModelEvent, end: ModelEvent) -> float:
        with self._cond:
            unsynced = [e for e in (start, end)
                        if e.vc is None or not all(self._done.get(k, 0) >= v for k, v in e.vc.items())]
            for event in unsynced:
                self._report(f"host access without synchronize: the time of an event on {event.stream} "
                             f"read in {_caller()} before the host synchronized it")
            return 0.0 if unsynced else (end.time - start.time) * 1000.0

    @staticmethod
    def _complete(event: ModelEvent) -> bool:
        return event.stream is None or event.stream.done >= event.ticket

    def _note_sync(self, what: str) -> None:
        self.host_syncs.append((threading.current_thread().name, what))

    # ------------------------------------------------------------------ side stream workers
    def _enqueue(self, stream: ModelStream, item: tuple) -> None:
        """Queue ``item`` for ``stream``'s worker (called under the lock)."""
        stream.items.append(item)
        stream.issued += 1
        if stream.thread is None:
            stream.thread = threading.Thread(target=self._work, args=(stream,), daemon=True,
                                             name=f"model-{stream.label}-{stream.cuda_stream}")
            stream.thread.start()
        self._cond.notify_all()

    def _work(self, stream: ModelStream) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: (stream.items and not self._held) or (self._closed and not stream.items))
                if not stream.items:
                    return
                item = stream.items[0]
                delay = self._rng.uniform(0.0, self._max_delay)
            if item[0] == "copy":
                time.sleep(delay)
                try:
                    item[1].copy_(item[2])
                except RuntimeError as e:  # a copy the engine queued that torch refuses
                    with self._cond:
                        self.violations.append(f"a queued copy on {stream} failed: {e}")
            else:
                with self._cond:
                    self._cond.wait_for(functools.partial(self._complete, item[1]))
            with self._cond:
                stream.items.popleft()
                stream.done += 1
                now = time.perf_counter()
                for stamped in [e for e in stream.stamps if e.stream is stream and e.ticket <= stream.done]:
                    stamped.time = now
                stream.stamps = [e for e in stream.stamps if e.stream is stream and e.ticket > stream.done]
                self._cond.notify_all()
            del item  # the queued tensors: a buffer is freed when its last one goes

    # ------------------------------------------------------------------ accesses
    def _lookup(self, tensor: torch.Tensor) -> tuple[_Buffer, int, int] | None:
        """The watched memory ``tensor`` shows and the byte range it spans, None if unwatched."""
        try:
            base = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        buf = self._buffers.get(base)
        if buf is None or tensor.numel() == 0:
            return None
        lo = tensor.data_ptr() - base
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
        return buf, lo, lo + span * tensor.element_size()

    def _op(self, func, args: tuple, kwargs: dict) -> None:
        """A torch op on a watched thread: check and note what it touches, then let it run."""
        if getattr(self._tls, "quiet", False):
            return
        spec = self._specs.get(func, False)
        if spec is False:
            spec = self._specs[func] = _spec(func)
        if not spec:
            return
        touches = []
        for index, name, write in spec:
            value = args[index] if index < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and (hit := self._lookup(t)) is not None:
                    touches.append(hit + (write,))
        stream = self.current_stream()
        device = any(buf.device for buf, _, _, _ in touches)
        # A value for the host synchronizes the current stream where the op reads device memory:
        # watched memory, or anything at all on a side stream, where only device work is issued.
        host_read = func._opname in _HOST_READS and (device or not stream.inline)
        if not touches and not host_read:
            return
        op = f"{func} in {_caller()}"
        with self._cond:
            if host_read:
                self._cond.wait_for(lambda: stream.done >= stream.issued)
                _join(self._done, stream.vc)
                self._note_sync(f"{func} on {stream}")
                self._apply(None, op, [(buf, lo, hi, False) for buf, lo, hi, _ in touches])
            elif not device:
                self._apply(None, op, touches)  # the host touches host memory
            else:
                self._cond.wait_for(lambda: stream.done >= stream.issued)  # after the stream's queued copies
                self._apply(stream, op, touches)

    def _apply(self, stream: ModelStream | None, op: str, touches: list[tuple[_Buffer, int, int, bool]]) -> None:
        """Check ``op`` (on ``stream``, or by the host) against each watched range it touches, then
        note it as that range's latest access (called under the lock)."""
        pos = 0
        if stream is not None:
            pos = stream.vc[stream.cuda_stream] = stream.vc[stream.cuda_stream] + 1
        for buf, lo, hi, write in touches:
            if write and buf.read_only:
                self._report(f"write of read-only memory: {buf.label} [bytes {lo}:{hi}]: {op} writes memory "
                             "page-locked as read-only (a shared host store)")
            for a in buf.accesses:
                if a.hi <= lo or a.lo >= hi or not (write or a.write) or self._ordered(a, stream):
                    continue
                if stream is None:
                    self._report(f"host access without synchronize: {buf.label} [bytes {lo}:{hi}]: {op} "
                                 f"({_rw(write)}) by the host is not preceded by a synchronize of {a.stream} "
                                 f"after {a.op} ({_rw(a.write)}) at its position {a.pos}")
                else:
                    self._report(f"unordered {_rw(write)}: {buf.label} [bytes {lo}:{hi}]: {op} ({_rw(write)}) "
                                 f"on {stream} is not ordered after {a.op} ({_rw(a.write)}) on {a.stream} at "
                                 f"its position {a.pos}")
            if write:
                kept = [a for a in buf.accesses if not (lo <= a.lo and a.hi <= hi)]
            else:
                kept = [a for a in buf.accesses if a.write or a.stream is not stream or (a.lo, a.hi) != (lo, hi)]
            kept.append(_Access(lo, hi, stream, pos, op, write))
            buf.accesses = kept

    def _ordered(self, a: _Access, stream: ModelStream | None) -> bool:
        """Whether access ``a`` is done before new work on ``stream`` (None: by the host now)."""
        if a.stream is None:
            return True
        key = a.stream.cuda_stream
        if self._done.get(key, 0) >= a.pos:
            return True
        return stream is not None and stream.vc.get(key, 0) >= a.pos

    def _freed(self, buf: _Buffer) -> None:
        with self._cond:
            if self._buffers.get(buf.base) is buf:
                del self._buffers[buf.base]
            alloc = buf.stream
            for a in buf.accesses:
                if a.stream is None or a.stream is alloc or self._ordered(a, alloc):
                    continue
                self._report(f"free while in use: {buf.label} [bytes {a.lo}:{a.hi}] freed (allocated on {alloc}) "
                             f"while {a.op} ({_rw(a.write)}) on {a.stream} at its position {a.pos} is not "
                             "ordered before the free", fatal=False)

    def _report(self, message: str, fatal: bool = True) -> None:
        self.violations.append(message)
        if fatal and self.strict:
            raise StreamOrderError(message)

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        self._tls.quiet = True
        try:
            yield
        finally:
            self._tls.quiet = False


@contextlib.contextmanager
def installed(model: StreamModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[StreamModel]:
    """``model`` as the CPU device's ordering, watching the calling thread and told every disk read
    (a host write it cannot see by itself); on exit, frees of what the caller dropped are checked
    and the workers stop."""
    read = DiskStore.read
    read_file = ModelFile.read

    def told_read(store: DiskStore, i: int, dst: torch.Tensor, start: int = 0, length: int | None = None) -> int:
        return model.disk_read(read, store, i, dst, start, length)

    def told_read_file(file: ModelFile, plan, dst: torch.Tensor, runs=None) -> int:
        model.host_write(dst, "disk read in ModelFile.read")
        return read_file(file, plan, dst, runs)

    monkeypatch.setattr(DiskStore, "read", told_read)
    monkeypatch.setattr(ModelFile, "read", told_read_file)
    install_model(model)
    try:
        with model.watch():
            yield model
    finally:
        install_model(None)
        gc.collect()
        model.close()


def _spec(func) -> list[tuple[int, str, bool]] | None:
    """Per tensor argument of ``func`` that it reads or writes: (position, name, written)."""
    if func.is_view or func._opname in _METADATA or torch.Tag.inplace_view in func.tags:
        return None
    spec = []
    for index, arg in enumerate(func._schema.arguments):
        if "Tensor" not in str(arg.type):
            continue
        info = arg.alias_info
        if info is not None and not info.is_write:
            continue  # an alias of its argument (a view), not an access
        spec.append((sys.maxsize if arg.kwarg_only else index, arg.name, info is not None))
    return spec or None


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory under a version counter of its own: a copy that lands late must not
    look, to the code that issued it, like a write made while it was running."""
    with torch.inference_mode(False):
        alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def _join(into: dict[int, int], clock: dict[int, int]) -> None:
    for key, value in clock.items():
        if into.get(key, 0) < value:
            into[key] = value


def _rw(write: bool) -> str:
    return "write" if write else "read"


def _caller() -> str:
    """The innermost function outside torch and this model: who issued the op."""
    frame = sys._getframe(2)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_SKIPPED_FILES):
            return frame.f_code.co_qualname
        frame = frame.f_back
    return "?"
