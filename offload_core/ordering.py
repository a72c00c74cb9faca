"""The device-ordering seam: the engine's streams, events, waits, records, current-stream queries,
asynchronous copies and device buffers, and who page-locks host memory.

Why one seam: on a GPU the engine is correct only if its work is ordered across streams (a slot
is read after its copy's event, overwritten after its last reader's event, freed once every
reader is done; a host buffer is rewritten or unpinned only after the copies out of it ran). A
CPU cannot show that order: every copy there ends before the next line. With every ordering call
going through here, the engine has one code path for every device:

- ``CudaOrdering``: torch.cuda's own streams and events, non-blocking copies (what the engine
  did before this seam, call for call);
- ``Ordering`` (the plain host, any device without CUDA): one stream where work ends before the
  call returns, events that only keep the time they were recorded, synchronous copies; nothing
  waits and no thread is added;
- a stream model installed by a test (``install_model``; tests/unit/stream_model.py), which runs
  the same calls on a CPU under CUDA's rules, delays copies on its side streams and checks every
  hand-over of a device buffer.

A device's ordering is looked up once per object that uses it (``for_device``), never on the hot
path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads it (a read-only shared mapping)


class Stream(Protocol):
    """What the engine asks of a stream (``torch.cuda.Stream`` has it)."""

    cuda_stream: int

    def wait_event(self, event: Event) -> None: ...

    def wait_stream(self, stream: Stream) -> None: ...

    def synchronize(self) -> None: ...


class Event(Protocol):
    """What the engine asks of an event (``torch.cuda.Event`` has it)."""

    def record(self, stream: Stream | None = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Event) -> float: ...


class HostRegistrar(Protocol):
    """Page-locks host memory for the device's copies (``cudaHostRegister``)."""

    def register(self, ptr: int, nbytes: int, label: str, read_only: bool = False) -> int:
        """0 once ``nbytes`` at ``ptr`` are page-locked, else the runtime's error code.

        ``read_only``: the memory is a read-only mapping (a host store other processes share),
        which page-locking must not ask to write: that would fail, or copy a private mapping's
        pages."""

    def unregister(self, ptr: int) -> int: ...


class HostStream:
    """The plain host's one stream: work issued on it has ended when the call returns."""

    cuda_stream = 0

    def wait_event(self, event: Event) -> None:
        pass

    def wait_stream(self, stream: Stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostEvent:
    """An event of the plain host: complete as soon as it is recorded."""

    __slots__ = ("time",)

    def __init__(self) -> None:
        self.time = 0.0

    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.time - self.time) * 1000.0


class HostTimingEvent(HostEvent):
    """A plain host's event with timing: it keeps the host clock's time of its record."""

    __slots__ = ()

    def record(self, stream: Stream | None = None) -> None:
        self.time = time.perf_counter()


class _Nothing:
    """The plain host's stream context: there is one stream, always current (a context manager
    cheaper than ``contextlib.nullcontext``, entered once per copy on the hot path)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        return None


_HOST_STREAM = HostStream()
_NOTHING = _Nothing()


class Ordering:
    """The plain host: copies are synchronous, streams and events order nothing because nothing
    is ever in flight. ``asynchronous`` says whether copies may still run after the call that
    issued them (then page-locking, staging and copy workers pay off)."""

    asynchronous = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.key: object = device.type  # names the device among a host storage's readers

    def stream(self, label: str) -> Stream:
        """A side stream (``label`` names it where a checker reports)."""
        return _HOST_STREAM

    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device."""
        return _HOST_STREAM

    def event(self, timing: bool = False) -> Event:
        return HostTimingEvent() if timing else HostEvent()

    def on(self, stream: Stream) -> AbstractContextManager:
        """Make ``stream`` (and this device) current on the calling thread while inside."""
        return _NOTHING

    # ``dst.copy_(src)``, queued on the current stream where copies are asynchronous (on the host,
    # the tensor method itself: no frame of ours on the hot path).
    copy = staticmethod(torch.Tensor.copy_)

    def buffer(self, nbytes: int, label: str) -> torch.Tensor:
        """``nbytes`` of device memory (uint8) that the engine hands between streams."""
        with torch.inference_mode(False):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def synchronize(self) -> None:
        """Wait until all work queued on the device, on any stream, has finished."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether copies of host ``tensor`` to this device can be asynchronous."""
        return False


class CudaOrdering(Ordering):
    """A CUDA device: torch.cuda's streams and events, non-blocking copies."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.key = device.index
        self._streams: dict[str, torch.cuda.Stream] = {}

    def stream(self, label: str) -> torch.cuda.Stream:
        """One side stream per label for the process's life, reused by every attach: torch keeps
        a cuBLAS workspace (32 MiB on recent cards) per thread and stream that ran a matrix
        product, never freed, so a fresh stream per attach would leave one more behind each
        time a merge ran on it. Work of two attaches on one stream is still ordered by events."""
        stream = self._streams.get(label)
        if stream is None:
            stream = self._streams[label] = torch.cuda.Stream(device=self.device)
        return stream

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def on(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return _on_cuda(self.device, stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


@contextlib.contextmanager
def _on_cuda(device: torch.device, stream: torch.cuda.Stream) -> Iterator[None]:
    # The device too: a worker thread's current device is the first GPU until it sets one.
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


class _CudaRegistrar:
    def register(self, ptr: int, nbytes: int, label: str, read_only: bool = False) -> int:
        flags = _REGISTER_PORTABLE | (_REGISTER_READ_ONLY if read_only else 0)
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))


_HOST = Ordering(torch.device("cpu"))
_CUDA_REGISTRAR = _CudaRegistrar()
_cuda: dict[int, CudaOrdering] = {}
_model: Ordering | None = None


def install_model(model: Ordering | None) -> None:
    """Tests only: the CPU device's ordering and host page-locking go through ``model`` (a stream
    model that also implements ``HostRegistrar``) until ``install_model(None)``. Objects keep
    the ordering they were made with."""
    global _model
    _model = model


def for_device(device: torch.device) -> Ordering:
    """The ordering of ``device``: CUDA's, the installed model's for the CPU, else the plain host's."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ordering = _cuda.get(index)
        if ordering is None:
            ordering = _cuda[index] = CudaOrdering(torch.device("cuda", index))
        return ordering
    if device.type == "cpu" and _model is not None:
        return _model
    return _HOST


def host_clock() -> float:
    """Seconds on the host's clock: ``time.perf_counter``, or the installed model's. A timed model
    (tests/unit/timed_streams.py) runs the engine's host side on the virtual clock of its device,
    so what the engine measures there (a disk read, a wait) is what that device would have taken."""
    model = _model
    return time.perf_counter() if model is None else model.host_clock()


def host_caught_up(stamp: float) -> None:
    """The calling thread waited for something another thread did at ``stamp`` (``host_clock``):
    a job it was handed, a read, a copy issued. A real clock is past it already; a timed model
    moves the thread's clock there, which is how a wait between threads takes time in it."""
    model = _model
    if model is not None:
        model.host_caught_up(stamp)


def host_registrar() -> HostRegistrar | None:
    """Who page-locks host memory now: the installed model, else CUDA where it is available."""
    if _model is not None:
        return _model  # type: ignore[return-value]
    return _CUDA_REGISTRAR if torch.cuda.is_available() else None
