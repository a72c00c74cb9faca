"""One model's packed bytes in one file that every process of the user on the machine maps.

Why: every ComfyUI worker on a box (one per GPU) packs its own host copy of the same weights, so
four workers streaming one model hold it four times in RAM. Here the first process that needs the
bytes writes them once into a file in a folder of shared memory (``/dev/shm``) or, where that is
small, in a disk folder the server's owner allows; every process (the writer too) maps it
read-only and page-locks the mapping in its own CUDA context, so the machine holds one copy.

The file: a header page, then each chunk of the storage at a page-aligned offset. Written under
a temporary name (``<digest>.<pid>.part``), renamed to ``<digest>.store`` once complete, and
complete only once the header's mark is written, last: a process killed while packing leaves a
part file that no one ever maps (the next look removes it) and the process waiting for the same
store packs it itself. Each process holds a shared ``flock`` on the file while it maps it; the
last to let go removes it (``store_folder`` says why that is safe with processes that die).

The header also keeps the whole key digest (``store_key``): a store of the same name with another
key or format is never mapped, and one that passes is still compared byte for byte with what the
joining process loaded before it is used (``shared_packing``).

What the model's tensors show is a second, copy-on-write mapping of the same pages (``shown``):
whatever core or another node writes in place lands in pages of this process's own, never in the
store that device copies come from and other processes map.
"""

from __future__ import annotations

import atexit
import json
import logging
import mmap
import os
import struct
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch

from ..units import size_text
from .pinned import DEFAULT_RESERVE_BYTES, HostStorage, available_ram_bytes
from .store_folder import (
    LOCK_SUFFIX,
    PART_SUFFIX,
    STORE_SUFFIX,
    StoreFolder,
    StoreUnavailable,
    check_own_file,
    hold_shared,
    holders,
    no_room,
    try_exclusive,
)
from .store_key import FORMAT_VERSION, StoreKey

log = logging.getLogger(__name__)

_open_stores: weakref.WeakSet[SharedHostStore] = weakref.WeakSet()
_open_lock = threading.Lock()

HEADER = mmap.PAGESIZE
_MAGIC = b"TOSTORE\x01"
_COMPLETE = b"COMPLETE"
_MARK_AT = len(_MAGIC)
_INFO_AT = _MARK_AT + len(_COMPLETE)


def _readonly_tensor(region: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable": it must not be
        with torch.inference_mode(False):
            return torch.frombuffer(region, dtype=torch.uint8)


class SharedHostStore:
    """A store file mapped by this process: joined complete, or being written here (``writing``).

    ``storage`` is a ``HostStorage`` whose chunks are read-only mappings of the file, pinned as the
    budget allows: packs take their host views from it (``PackedBlock.take_host``). While
    ``writing``, ``writable(i)`` gives item ``i``'s bytes to write, ``written(i)`` says they are,
    and ``finish`` publishes the store; the store's lock is held all that time, so any other
    process that needs it waits. ``release`` lets go; the last process to let go removes the file.
    """

    read_only = True  # the storage's chunks are read-only mappings (``ChunkBacking``)

    def __init__(self, folder: StoreFolder, reserve_bytes: int) -> None:
        self.folder = folder
        self.key: StoreKey | None = None
        self.storage: HostStorage | None = None
        self.writing = False
        self.created = False  # this process wrote the store
        self.file_bytes = 0
        self._reserve = reserve_bytes
        self._dfd: int | None = None
        self._fd: int | None = None  # the store file, with our shared flock on it
        self._lock: int | None = None  # the store's lock file, held while this process writes it
        self._part: str | None = None  # the part file's name while writing
        self._offsets: list[int] = []
        self._writable: dict[int, torch.Tensor] = {}  # chunk -> its writable mapping while writing
        self._shown: dict[int, torch.Tensor] = {}  # chunk -> its copy-on-write mapping (``shown``)
        self._left: dict[int, int] = {}  # chunk -> its items not written yet
        self._released = False

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, folder: StoreFolder, key_for: Callable[[list[int]], StoreKey], sizes: Sequence[int], *,
             pin: bool, ram_budget_bytes: int | None, chunk_bytes: int, label: str,
             reserve_bytes: int = DEFAULT_RESERVE_BYTES,
             waiting: Callable[[], None] | None = None) -> SharedHostStore:
        """Join the complete store for these items, or start writing it (``writing``).

        ``key_for(chunk_spans)`` gives the key once the items' chunks are known. Waits (calling
        ``waiting``, which may raise to give up) while another process writes the same store.
        Raises ``StoreUnavailable`` when a private copy is the way on, ``FolderRefused`` when the
        folder is not the user's.
        """
        self = cls(folder, reserve_bytes)
        self.storage = HostStorage(sizes, pin=pin, ram_budget_bytes=ram_budget_bytes, chunk_bytes=chunk_bytes,
                                   label=f"{label} (shared)", backing=self)
        spans = self.storage.chunk_spans
        self.key = key_for(spans)
        offset = HEADER
        for span in spans:
            self._offsets.append(offset)
            offset += span
        self.file_bytes = offset
        for i in range(self.storage.num_items):
            c = self.storage.chunk_of(i)
            self._left[c] = self._left.get(c, 0) + 1
        with _open_lock:
            _open_stores.add(self)
        try:
            self._dfd = folder.open()
            self._lock = folder.lock(self._dfd, self.key.digest, waiting)
            if self._join():
                self._unlock()
            else:
                self._create()
        except BaseException:
            self._abandon()
            raise
        return self

    def _join(self) -> bool:
        """Under the lock: map the complete store if a live process holds it. A store no one
        holds is what a dead process left: removed, never reused (a disk folder's file may hold
        bytes a crash cut short)."""
        name = self.name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dfd)
        except FileNotFoundError:
            return False
        try:
            check_own_file(fd, os.path.join(self.folder.path, name))
            if try_exclusive(fd):
                log.info("shared host store %s: no live process held it; removed, packed again", name)
                StoreFolder.remove(self._dfd, name)
                os.close(fd)
                return False
            hold_shared(fd)
            self._check_header(fd, name)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def _check_header(self, fd: int, name: str) -> None:
        head = os.pread(fd, HEADER, 0)
        where = os.path.join(self.folder.path, name)
        if head[:len(_MAGIC)] != _MAGIC or head[_MARK_AT:_INFO_AT] != _COMPLETE:
            raise StoreUnavailable(f"{where} is not a complete store")
        (length,) = struct.unpack_from("<I", head, _INFO_AT)
        try:
            info = json.loads(head[_INFO_AT + 4:_INFO_AT + 4 + length])
        except ValueError:
            raise StoreUnavailable(f"{where} has an unreadable header") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION \
                or info.get("key") != self.key.full_digest or os.fstat(fd).st_size != self.file_bytes:
            raise StoreUnavailable(f"{where} holds other bytes than its name says (another format or key)")

    def _create(self) -> None:
        """Under the lock, kept: a part file, its chunks made as they are written."""
        free = self.folder.free_bytes()
        if free < self.file_bytes:
            raise StoreUnavailable(f"{self.folder.path} has {size_text(free)} free and the store needs "
                                   f"{size_text(self.file_bytes)}")
        left = StoreFolder.remove_parts(self._dfd, self.key.digest)
        if left:
            log.info("shared host store %s: removed %s, left by a packer that ended before it was done",
                     self.name, ", ".join(left))
        self._part = f"{self.key.digest}.{os.getpid()}{PART_SUFFIX}"
        self._fd = os.open(self._part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                           dir_fd=self._dfd)
        hold_shared(self._fd)  # held from the start: the store never lacks a holder
        try:
            os.pwrite(self._fd, _MAGIC, 0)  # the file grows as its chunks are made (``writable``)
        except OSError as e:
            if no_room(e):
                raise StoreUnavailable(f"{self.folder.path} refused a new store: {e.strerror}") from None
            raise
        self.writing = True
        self.created = True

    # ------------------------------------------------------------------ writing
    def map_chunk(self, index: int, span: int) -> torch.Tensor:
        """The storage's read-only mapping of chunk ``index`` (``ChunkBacking``)."""
        region = mmap.mmap(self._fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                           offset=self._offsets[index])
        return _readonly_tensor(region)

    def shown(self, item: int) -> torch.Tensor:
        """Item ``item``'s bytes as the model's tensors may show them: a private, copy-on-write
        mapping of its chunk (never pinned).

        Why a second mapping: whatever the pack hands to ComfyUI or another node may be written in
        place (core's hook LoRAs patch weights through ``copy_to_param``; any ``add_()``). A write
        into the read-only mapping kills the process, and a write into a shared one would change
        every worker's weights. Here the pages are the store's own until one is written; then that
        page alone becomes this process's, and the store (the engine's copy source) stays as it
        was (``written_items`` finds such pages). Pinning it would unshare every page, so it stays
        pageable.
        """
        chunk = self.storage.chunk_of(item)
        data = self._shown.get(chunk)
        if data is None:
            span = -(-self.storage.chunk_spans[chunk] // mmap.PAGESIZE) * mmap.PAGESIZE
            with torch.inference_mode(False):
                if not span:
                    data = torch.empty(0, dtype=torch.uint8)
                else:
                    region = mmap.mmap(self._fd, span, flags=mmap.MAP_PRIVATE,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=self._offsets[chunk])
                    data = torch.frombuffer(region, dtype=torch.uint8)
            self._shown[chunk] = data
        start, size = self.storage.item_span(item)
        return data[start:start + size]

    def shows(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in one of the copy-on-write mappings (``shown``)."""
        if t.device.type != "cpu" or not t.numel():
            return False
        ptr = t.data_ptr()
        return any(d.numel() and d.data_ptr() <= ptr < d.data_ptr() + d.numel() for d in self._shown.values())

    def written_items(self) -> list[int]:
        """Items whose copy-on-write bytes (``shown``) were written since they were mapped and now
        differ from the store's: someone changed a weight in place, and the store no longer holds
        what the model shows. Pages are looked up in ``/proc/self/pagemap`` (a written page is this
        process's own, no longer the file's), so only written pages are compared; where the system
        does not say, every item is compared."""
        out = []
        for item in range(self.storage.num_items):
            chunk = self.storage.chunk_of(item)
            if chunk not in self._shown:
                continue
            view = self.shown(item)
            if not view.numel() or not _own_pages(view):
                continue
            if not torch.equal(view, self.storage.buffer(item)):
                out.append(item)
        return out

    def writable(self, item: int) -> torch.Tensor:
        """Item ``item``'s bytes to write, in a writable mapping of its chunk. The chunk's memory is
        made first: ``StoreUnavailable`` when the folder has no room for it, ``MemoryError`` when
        shared memory would eat into the RAM reserve."""
        if not self.writing:
            raise RuntimeError("this store is not being written")
        chunk = self.storage.chunk_of(item)
        data = self._writable.get(chunk)
        span = self.storage.chunk_spans[chunk]
        if data is None and not span:  # a chunk of empty items: nothing to make or map
            with torch.inference_mode(False):
                data = self._writable[chunk] = torch.empty(0, dtype=torch.uint8)
        if data is None:
            if self.folder.in_memory:
                headroom = available_ram_bytes() - self._reserve
                if span > headroom:
                    raise MemoryError(
                        f"shared host store chunk {chunk} needs {size_text(span)} but only "
                        f"{size_text(max(headroom, 0))} are available after keeping {size_text(self._reserve)} "
                        "in reserve; refusing to allocate")
            try:
                os.posix_fallocate(self._fd, self._offsets[chunk], span)
            except OSError as e:
                if no_room(e):
                    raise StoreUnavailable(f"{self.folder.path} ran out of room while the store was written "
                                           f"({e.strerror})") from None
                raise
            region = mmap.mmap(self._fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                               offset=self._offsets[chunk])
            with torch.inference_mode(False):
                data = self._writable[chunk] = torch.frombuffer(region, dtype=torch.uint8)
        start, size = self.storage.item_span(item)
        return data[start:start + size]

    def written(self, item: int) -> None:
        """Item ``item`` is written: a chunk whose items all are loses its writable mapping."""
        chunk = self.storage.chunk_of(item)
        self._left[chunk] -= 1
        if not self._left[chunk]:
            self._writable.pop(chunk, None)

    def finish(self) -> None:
        """Publish the store: header, then the completion mark (last), then its final name."""
        if not self.writing:
            raise RuntimeError("this store is not being written")
        self._writable.clear()
        info = json.dumps({"format": FORMAT_VERSION, "key": self.key.full_digest}).encode()
        if _INFO_AT + 4 + len(info) > HEADER:
            raise RuntimeError("the store's header does not fit its page")
        os.pwrite(self._fd, struct.pack("<I", len(info)) + info, _INFO_AT)
        os.pwrite(self._fd, _COMPLETE, _MARK_AT)
        os.rename(self._part, self.name, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        self._part = None
        self.writing = False
        self._unlock()

    # ------------------------------------------------------------------ figures
    @property
    def name(self) -> str:
        return self.key.digest + STORE_SUFFIX

    def identity(self) -> tuple[str, int, int]:
        """Which store file this is: its key and the file's device and inode (a store written again
        under the same name is another file)."""
        st = os.fstat(self._fd)
        return self.key.full_digest, st.st_dev, st.st_ino

    def users(self) -> int | None:
        """Processes that map this store now (this one included); None where the system does not say."""
        if self._fd is None:
            return 0
        return holders(self._fd)

    # ------------------------------------------------------------------ letting go
    def release(self) -> None:
        """Unpin and unmap, then let go of the file; the last process to let go removes it. A
        store still being written is removed (no other process can have mapped it)."""
        if self._released:
            return
        self._released = True
        self._writable.clear()
        self._shown.clear()  # a tensor still showing them keeps its own mapping alive
        try:
            if self.storage is not None:
                self.storage.release()
        finally:
            self._abandon()

    def let_go_at_exit(self) -> None:
        """The process ends: let go of the files only (the memory goes with the process, and the
        device may be gone already, so nothing is unpinned)."""
        if not self._released:
            self._released = True
            self._abandon()

    def _abandon(self) -> None:
        """Let go of the files: a part file goes (its lock is still ours), a store goes when no
        other process holds it."""
        try:
            if self._fd is not None and self._dfd is not None:
                if self._part is not None:  # our lock is held: no one else can have this part or store
                    StoreFolder.remove(self._dfd, self._part)
                    StoreFolder.remove(self._dfd, self.key.digest + LOCK_SUFFIX)
                    self._part = None
                else:
                    if self._lock is None:
                        self._lock = self.folder.lock(self._dfd, self.key.digest)
                    if try_exclusive(self._fd) and self._still_named():
                        StoreFolder.remove(self._dfd, self.name)
                        StoreFolder.remove(self._dfd, self.key.digest + LOCK_SUFFIX)
                        log.info("shared host store %s: the last process let go; removed", self.name)
        finally:
            self._unlock()
            for attr in ("_fd", "_dfd"):
                fd = getattr(self, attr)
                if fd is not None:
                    setattr(self, attr, None)
                    os.close(fd)

    def _still_named(self) -> bool:
        try:
            named = os.stat(self.name, dir_fd=self._dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    def _unlock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            os.close(lock)


def _own_pages(view: torch.Tensor) -> bool:
    """Whether any page under ``view`` (in a private file mapping) is this process's own copy: a
    present page that is neither the file's nor shared. True where ``/proc/self/pagemap`` cannot
    be read, so the caller compares bytes instead of trusting nothing changed."""
    page = mmap.PAGESIZE
    first = view.data_ptr() // page
    last = (view.data_ptr() + view.numel() - 1) // page
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), 8 * (last - first + 1), 8 * first)
    except OSError:
        return True
    if len(raw) != 8 * (last - first + 1):
        return True
    with torch.inference_mode(False):
        entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    present = entries < 0  # bit 63
    return bool((present & ((entries >> 61) & 1 == 0)).any())


def let_go_of_all() -> None:
    """Let go of every store this process still maps: the last process to end removes each one.
    Runs at interpreter exit; a host application that ends on a signal calls it first."""
    with _open_lock:
        stores = list(_open_stores)
    for store in stores:
        try:
            store.let_go_at_exit()
        except Exception:
            log.exception("shared host store: could not let go of %s at exit", store.folder.path)


atexit.register(let_go_of_all)
