"""Exact-size host storage for packed weights, page-locked when the budget allows.

Why not ``tensor.pin_memory()``: torch's caching host allocator rounds every
block up to a power of two, so pinning a model that way costs 1.5-2x its size
in RAM and is not returned by ``empty_cache``.  Here each chunk is its own
anonymous memory mapping of the exact size rounded up to a page, registered
whole with ``cudaHostRegister`` (portable: every CUDA context sees it pinned)
and unregistered on release.  The chunk's tensor storage starts exactly at the
mapping, which matters because ``Tensor.is_pinned()`` asks CUDA about the
*storage's* base pointer: a storage starting before the registered range would
read as pageable, and ComfyUI's own ``pin_memory`` would then register the same
pages a second time and leave a CUDA error behind.  Chunks never split an item
(a block), so one block is always one contiguous, uniformly pinned range.  When
pinning is impossible or over budget the memory stays pageable (slower copies,
same results); when even pageable memory would not fit, allocation is refused
before any RAM is touched.

The pinned-memory cap can be shared with a host application that pins memory of
its own (ComfyUI): ``set_pin_accounting`` installs a callable that caps the
engine's pinned bytes and one that is told the engine's total after each change.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import psutil
import torch

from ..alignment import align_up
from ..ordering import HostRegistrar, Ordering, for_device, host_registrar
from ..units import size_text

log = logging.getLogger(__name__)

ALIGN = 256
DEFAULT_CHUNK_BYTES = 512 << 20
DEFAULT_RESERVE_BYTES = 2 << 30
# Share of physical RAM that may be page-locked process-wide when no explicit cap is given
# (``pin_share``). Windows (WDDM) refuses much beyond half of RAM; ComfyUI itself uses 45% there.
PIN_SHARE = 0.9
PIN_SHARE_WINDOWS = 0.45
OS_RELEASE = "/proc/sys/kernel/osrelease"  # "...-microsoft-standard-WSL2" under WSL
PAGE = mmap.PAGESIZE

# Reentrant: an unpin may run inside the section on the same thread (the garbage collector runs
# the finalizer of a storage nobody released at any allocation, the report hook's included).
_lock = threading.RLock()
_pinned_total = 0
_external_cap: Callable[[], int | None] | None = None
_report: Callable[[int], None] | None = None
_discard_cuda_error: Callable[[], None] | None = None


def pinned_bytes() -> int:
    """Bytes currently page-locked by this package, process-wide."""
    return _pinned_total


def set_pin_accounting(cap: Callable[[], int | None] | None, report: Callable[[int], None] | None) -> None:
    """Share the pinned-memory budget with the host application; ``None, None`` stops sharing.

    Why: the application may page-lock memory of its own under its own cap, and two
    caps that ignore each other can together lock more than the machine has.
    ``cap()`` returns the most bytes the engine may hold pinned right now (``None``:
    no limit from the application); it is consulted before every registration, on
    top of the engine's own cap.  ``report(total)`` is called with the engine's
    pinned total at once and after every registration or release, so the
    application can count the engine's pins with its own.
    """
    global _external_cap, _report
    with _lock:
        _external_cap, _report = cap, report
        _tell()


@functools.lru_cache(maxsize=None)
def _under_wsl(os_release: str) -> bool:
    try:
        with open(os_release, encoding="ascii", errors="replace") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def pin_share() -> tuple[float, str]:
    """The share of physical RAM the engine may page-lock, and where it comes from. Under WSL
    page-locked memory is also counted by Windows as the GPU's "shared GPU memory", inside a VM
    whose RAM is itself a share of the machine's, so WSL gets Windows' share."""
    if sys.platform == "win32":
        return PIN_SHARE_WINDOWS, "Windows' share of RAM"
    if _under_wsl(OS_RELEASE):
        return PIN_SHARE_WINDOWS, "Windows' share of the WSL VM's RAM"
    return PIN_SHARE, "the share of RAM"


def pin_cap(ram_budget_bytes: int | None = None) -> int:
    """Most bytes this package may hold page-locked now: the engine's own cap, lowered by the application's."""
    cap = int(pin_share()[0] * psutil.virtual_memory().total) if ram_budget_bytes is None else ram_budget_bytes
    external = None
    if _external_cap is not None:
        try:
            external = _external_cap()
        except Exception:
            log.exception("[tiered offload] the pinned-memory cap hook failed; using the engine's own cap")
    return cap if external is None else max(0, min(cap, int(external)))


def _count_pinned(delta: int) -> None:
    global _pinned_total
    with _lock:
        _pinned_total += delta
        _tell()


def _tell() -> None:
    """Report the pinned total to the application (lock held); its failure must never undo a pin
    or unpin. A count made inside the report (the same thread, reentering) is reported again, so
    the application's last word is the total as it is."""
    total = None
    while _report is not None and total != _pinned_total:
        total = _pinned_total
        try:
            _report(total)
        except Exception:
            log.exception("[tiered offload] the pinned-memory report hook failed")
            return


def _cgroup_available() -> int | None:
    """Headroom under a cgroup v2 memory limit (containers), which psutil ignores."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError):
        return None


def available_ram_bytes() -> int:
    """RAM that can still be allocated: the smaller of the OS and cgroup views."""
    avail = psutil.virtual_memory().available
    cg = _cgroup_available()
    return avail if cg is None else min(avail, cg)


def set_cuda_error_discard(discard: Callable[[], None] | None) -> None:
    """Use the host application's way of clearing a CUDA error (ComfyUI's
    ``discard_cuda_async_error``); ``None`` goes back to the engine's own."""
    global _discard_cuda_error
    _discard_cuda_error = discard


def _clear_cuda_error() -> None:
    """A failed runtime call leaves an error that torch's next kernel-launch check would raise.

    Cleared the way ComfyUI clears it: a tiny kernel and a synchronize on the current device,
    whose error is the one left behind and is dropped. Through torch, so the error is read from
    the CUDA runtime torch itself uses (a second copy of the runtime opened by name would keep
    errors of its own).
    """
    if _discard_cuda_error is not None:
        _discard_cuda_error()
        return
    try:
        torch.ones(1, dtype=torch.uint8, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass  # that is the error being dropped; the failed call already reported it


def _register(registrar: HostRegistrar, ptr: int, nbytes: int, label: str, read_only: bool) -> bool:
    if registrar.register(ptr, nbytes, label, read_only=read_only) == 0:
        return True
    _clear_cuda_error()
    return False


def _unregister(registrar: HostRegistrar, ptr: int) -> None:
    err = registrar.unregister(ptr)
    if err != 0:
        _clear_cuda_error()
        log.warning("[tiered offload] cudaHostUnregister(0x%x) failed with CUDA error %d", ptr, err)


def _map(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a fresh anonymous mapping: page-aligned, and its storage starts there.

    The mapping is unmapped when the last tensor over it is gone (the storage holds
    the ``mmap`` object), so a view kept elsewhere never points at freed memory.
    Private on POSIX: a shared anonymous mapping would be counted as shared memory.
    """
    if os.name == "nt":
        region = mmap.mmap(-1, nbytes)
    else:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with torch.inference_mode(False):
        return torch.frombuffer(region, dtype=torch.uint8)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim")
    except (OSError, AttributeError):
        return None


def return_freed_ram() -> bool:
    """Hand memory that the C heap keeps after frees back to the OS; False where that is not possible.

    Why: once glibc has raised its mmap threshold (it does after any freed mid-size
    block, as every model load has), tensors of up to 32 MiB come from the heap, and
    freeing them after packing leaves their pages with the process: RSS then shows the
    pack plus the freed originals.  ``malloc_trim(0)`` gives those free pages back.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class ChunkBacking(Protocol):
    """Where a storage's chunks live instead of fresh private memory: a shared host store's file.

    ``map_chunk(index, span)`` returns a uint8 tensor of ``span`` bytes whose storage starts at a
    page-aligned mapping of its own (pinning asks about a storage's base pointer), and is called
    once per chunk, on its first use. ``read_only``: the mapping refuses writes, and page-locking
    must not ask to write. Mapping takes no new memory (whoever made the bytes kept the reserve).
    """

    read_only: bool

    def map_chunk(self, index: int, span: int) -> torch.Tensor: ...


@dataclass
class _Chunk:
    items: list[int]  # indices of the items that live in this chunk
    nbytes: int
    data: torch.Tensor | None = None  # uint8 view of exactly nbytes at the start of its own mapping
    pinned_len: int = 0  # bytes registered with CUDA (the page-rounded mapping), 0 if pageable
    registrar: HostRegistrar | None = None  # who registered them
    done: set[int] = field(default_factory=set)  # items the owner no longer needs


def _drop_chunk(c: _Chunk) -> None:
    if c.pinned_len and c.data is not None:
        _unregister(c.registrar, c.data.data_ptr())
        _count_pinned(-c.pinned_len)
    c.pinned_len = 0
    c.data = None


def _drop(chunks: list[_Chunk], readers: dict[object, Ordering]) -> None:
    """Unpin and free ``chunks`` once the devices that copied out of them (``readers``) are done.

    Also the finalizer of a storage nobody released: it must not reference the owning HostStorage.
    """
    if any(c.pinned_len for c in chunks):
        for ordering in readers.values():
            ordering.synchronize()
    for c in chunks:
        _drop_chunk(c)


class HostStorage:
    """Host memory for a list of byte items (packed blocks), grouped into chunks.

    Chunks are allocated lazily, on the first ``buffer(i)`` of one of their items,
    so a caller that frees its original tensors as it packs never holds two full
    copies of a model at once.  ``ram_budget_bytes`` caps page-locked bytes
    process-wide (default: a share of physical RAM), lowered by the application's
    cap when one is shared (``set_pin_accounting``); beyond it chunks stay pageable.
    ``reserve_bytes`` of RAM are always left free: a chunk that would eat into them
    is refused with ``MemoryError`` before anything is allocated.  ``label`` says what
    the storage holds, where a checker of device ordering names its memory.  ``backing``: the
    chunks are mappings of a shared host store's file (``shared_store``) instead of fresh memory.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        *,
        pin: bool = True,
        ram_budget_bytes: int | None = None,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        label: str = "host storage",
        backing: ChunkBacking | None = None,
    ) -> None:
        if any(s < 0 for s in sizes):
            raise ValueError("item sizes must be >= 0")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if ram_budget_bytes is not None and ram_budget_bytes < 0:
            raise ValueError(f"ram_budget_bytes must be >= 0, got {ram_budget_bytes}")
        self._pin = pin
        self._label = label
        self._backing = backing
        self._cap = ram_budget_bytes
        self._reserve = reserve_bytes
        self._pinned_here = 0
        self._pin_refused = False
        # The orderings of the devices that copies out of this storage ran on, by device key.
        self._readers: dict[object, Ordering] = {}
        self._chunks: list[_Chunk] = []
        self._where: list[tuple[int, int]] = []  # item -> (chunk index, offset)
        for i, size in enumerate(sizes):
            cur = self._chunks[-1] if self._chunks else None
            start = align_up(cur.nbytes, ALIGN) if cur else 0
            if cur is None or (cur.items and start + size > chunk_bytes):
                cur = _Chunk(items=[], nbytes=0)
                self._chunks.append(cur)
                start = 0
            cur.items.append(i)
            cur.nbytes = start + size
            self._where.append((len(self._chunks) - 1, start))
        self._sizes = list(sizes)
        self._finalizer = weakref.finalize(self, _drop, self._chunks, self._readers)
        self._finalizer.atexit = False  # at exit the process frees everything; CUDA may be gone

    @property
    def num_items(self) -> int:
        return len(self._sizes)

    def chunk_of(self, i: int) -> int:
        """The chunk item ``i`` lives in."""
        return self._where[i][0]

    def item_span(self, i: int) -> tuple[int, int]:
        """Where item ``i`` sits in its chunk: (offset, bytes)."""
        return self._where[i][1], self._sizes[i]

    @property
    def chunk_spans(self) -> list[int]:
        """Each chunk's bytes rounded up to a page: what it maps."""
        return [align_up(c.nbytes, PAGE) for c in self._chunks]

    @property
    def total_bytes(self) -> int:
        """Bytes of all chunks, allocated or not."""
        return sum(c.nbytes for c in self._chunks)

    @property
    def allocated_bytes(self) -> int:
        return sum(c.nbytes for c in self._chunks if c.data is not None)

    @property
    def pinned_bytes(self) -> int:
        """Bytes this storage holds page-locked (page-rounded)."""
        return self._pinned_here

    @property
    def pageable_bytes(self) -> int:
        return sum(c.nbytes for c in self._chunks if c.data is not None and not c.pinned_len)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in this storage (a view of one of its buffers)."""
        if t.device.type != "cpu" or not t.numel():
            return False
        ptr = t.data_ptr()
        for c in self._chunks:
            if c.data is not None and c.data.numel() and c.data.data_ptr() <= ptr < c.data.data_ptr() + c.nbytes:
                return True
        return False

    def is_pinned(self, i: int) -> bool:
        return bool(self._chunks[self._where[i][0]].pinned_len)

    def buffer(self, i: int) -> torch.Tensor:
        """uint8 tensor of exactly ``sizes[i]`` bytes, allocating its chunk on first use."""
        ci, off = self._where[i]
        chunk = self._chunks[ci]
        if chunk.data is None:
            self._allocate(ci, chunk)
        assert chunk.data is not None
        return chunk.data[off : off + self._sizes[i]]

    def _allocate(self, ci: int, chunk: _Chunk) -> None:
        n = chunk.nbytes
        span = align_up(n, PAGE)
        backing = self._backing
        headroom = available_ram_bytes() - self._reserve
        if span > headroom and backing is None:
            raise MemoryError(
                f"host storage chunk {ci} needs {size_text(span)} but only {size_text(max(headroom, 0))} "
                f"are available after keeping {size_text(self._reserve)} in reserve; refusing to allocate"
            )
        # An empty chunk (a block with no tensors) has nothing to map or register; both refuse size 0.
        if not span:
            with torch.inference_mode(False):
                chunk.data = torch.empty(0, dtype=torch.uint8)
            return
        chunk.data = (_map(span) if backing is None else backing.map_chunk(ci, span))[:n]
        registrar = self._pin_registrar(span)
        if registrar is not None:
            read_only = backing is not None and backing.read_only
            if _register(registrar, chunk.data.data_ptr(), span, f"{self._label}, chunk {ci}", read_only):
                chunk.pinned_len = span
                chunk.registrar = registrar
                self._pinned_here += span
                _count_pinned(span)
            else:
                self._refuse_pin(f"cudaHostRegister failed for a {size_text(span)} chunk")

    def _pin_registrar(self, span: int) -> HostRegistrar | None:
        """Who pins ``span`` more bytes, or None where they stay pageable."""
        if not self._pin or self._pin_refused:
            return None
        registrar = host_registrar()
        if registrar is None:  # no GPU: there is no copy to a GPU to speed up, nothing to say
            self._pin_refused = True
            log.debug("[tiered offload] host storage: no CUDA device, so nothing is pinned")
            return None
        cap = pin_cap(self._cap)
        if pinned_bytes() + span > cap:
            self._refuse_pin(
                f"pinning {size_text(span)} more would exceed the pinned-RAM cap of {size_text(cap)} "
                f"({size_text(pinned_bytes())} pinned by the engine; "
                f"{self._cap_words()})"
            )
            return None
        return registrar

    def _cap_words(self) -> str:
        """Where the cap comes from, as the refusal says it."""
        if self._cap is not None:
            return "the cap given to this storage"
        share, where = pin_share()
        return f"{share:.0%}, {where}, lowered by ComfyUI's own count where it keeps one"

    def _refuse_pin(self, why: str, level: int = logging.WARNING) -> None:
        self._pin_refused = True
        log.log(level, "[tiered offload] host storage: %s; remaining chunks stay pageable (correct but slower copies)",
                why)

    def release_item(self, i: int) -> None:
        """Mark item ``i`` unused; its chunk is freed once all of its items are.

        Lets an owner copy a model out of the pack piece by piece without ever
        holding the pack and the copy in full at the same time.
        """
        ci, _ = self._where[i]
        chunk = self._chunks[ci]
        chunk.done.add(i)
        if len(chunk.done) == len(chunk.items):
            self._release([chunk])

    def release(self) -> None:
        """Unregister and drop every chunk; views still held elsewhere become plain pageable memory."""
        self._release(self._chunks)

    @property
    def readers(self) -> frozenset[object]:
        """The devices that release waits for (a CUDA device by its index)."""
        return frozenset(self._readers)

    def note_reader(self, device: torch.device) -> None:
        """Record that asynchronous copies out of this storage may run on ``device``.

        Release waits for those devices before it unlocks a range, so no copy still
        in flight reads memory that is no longer pinned (or no longer mapped).
        """
        ordering = for_device(device)
        if ordering.asynchronous:
            self._readers[ordering.key] = ordering

    def _release(self, chunks: list[_Chunk]) -> None:
        self._pinned_here -= sum(c.pinned_len for c in chunks)
        _drop(chunks, self._readers)
