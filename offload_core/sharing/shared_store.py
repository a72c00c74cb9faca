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

What the model's tensors show is a second, copy-on-write mapping of the same pages (``view``,
``store_view``): whatever core or another node writes in place lands in pages of this process's
own, never in the store that device copies come from and other processes map.
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
from ..host.pinned import DEFAULT_RESERVE_BYTES, HostStorage, available_ram_bytes
from . import store_folder
from .store_folder import (
    LOCK_SUFFIX,
    PART_SUFFIX,
    STORE_SUFFIX,
    SUPPORTED,
    StoreFolder,
    StoreUnavailable,
    drop_inherited_holds,
    hold_shared,
    holders,
    no_room,
    open_own_file,
    try_exclusive,
    unlock,
)
from .store_key import FORMAT_VERSION, StoreKey
from .store_view import CopyOnWriteView

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
        self.view: CopyOnWriteView | None = None  # what the model's tensors show (``store_view``)
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
        ``waiting``, which may raise to give up) while another process writes the same store, as
        long as it makes progress (``store_folder.LOCK_WAIT_S``). Raises ``StoreUnavailable``
        (``FolderRefused`` too is one) whenever a private copy is the way on: a folder or file that
        is not the user's, no room, a system error opening the files.
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
        self.view = CopyOnWriteView(self.storage, self._offsets, lambda: self._fd)
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
        except OSError as e:
            self._abandon()
            raise StoreUnavailable(f"the store could not be opened in {folder.path} ({e}); this process keeps a "
                                   "private copy") from e
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
            fd = open_own_file(self._dfd, name, os.O_RDONLY, os.path.join(self.folder.path, name))
        except FileNotFoundError:
            return False
        try:
            if try_exclusive(fd):
                log.info("[tiered offload] shared host store %s: no live process held it; removed, packed again", name)
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
        self.folder.check_share(self.file_bytes)
        free = self.folder.free_bytes()
        if free < self.file_bytes:
            raise StoreUnavailable(f"{self.folder.path} has {size_text(free)} free and the store needs "
                                   f"{size_text(self.file_bytes)}")
        left = StoreFolder.remove_parts(self._dfd, self.key.digest)
        if left:
            log.info("[tiered offload] shared host store %s: removed %s, left by a packer that ended before it "
                     "was done",
                     self.name, ", ".join(left))
        self._part = f"{self.key.digest}.{os.getpid()}{PART_SUFFIX}"
        self._fd = open_own_file(self._dfd, self._part, os.O_RDWR | os.O_CREAT | os.O_EXCL,
                                 os.path.join(self.folder.path, self._part))
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
        if self.view is not None:
            self.view.clear()  # a tensor still showing them keeps its own mapping alive
        try:
            if self.storage is not None:
                self.storage.release()
        finally:
            self._abandon()

    @property
    def released(self) -> bool:
        """Whether this process let go of the store (or, in a forked child, never held it)."""
        return self._released

    def inherited_fd(self) -> int | None:
        """In a child forked without exec: the store file's descriptor it inherited, where the
        parent had not let go of the store (None otherwise)."""
        return None if self._released else self._fd

    def forget_in_child(self) -> None:
        """In a child forked without exec, once the inherited descriptors are closed or mapped
        again: the store is the parent's, so nothing is removed or unpinned and the child never
        lets go of it; the folder's descriptor is closed (the lock's was, by the fork handler's first
        step)."""
        self._released = True
        self._part = None
        self._fd = self._lock = None
        if self._dfd is not None:
            dfd, self._dfd = self._dfd, None
            os.close(dfd)

    def let_go_at_exit(self) -> None:
        """The process ends: let go of the files only (the memory goes with the process, and the
        device may be gone already, so nothing is unpinned)."""
        if not self._released:
            self._released = True
            self._abandon()

    def _abandon(self) -> None:
        """Let go of the files: a part file goes (its lock is still ours), a store goes when no
        other process holds it, and so does its lock file when no store is left under its name.
        Never raises: a folder or file removed underneath (a logout that removes the user's IPC
        objects) or a lock another process keeps for ``store_folder.LET_GO_WAIT_S`` leaves the
        files as they are, with one log line (a sweep removes whatever no process holds)."""
        try:
            if self._dfd is None:
                return
            if os.fstat(self._dfd).st_nlink == 0:
                if self._fd is not None:
                    log.info("[tiered offload] shared host store %s: its folder %s was removed while this "
                             "process held it; nothing left to remove", self.name, self.folder.path)
                return
            if self._part is not None:  # our lock is held: no one else can have this part or store
                StoreFolder.remove(self._dfd, self._part)
            elif self._fd is not None:
                if self._lock is None:
                    self._lock = self.folder.lock(self._dfd, self.key.digest,
                                                  bound_s=store_folder.LET_GO_WAIT_S)
                named = _named(self._dfd, self.name)
                if named is None:
                    log.info("[tiered offload] shared host store %s: its file was removed from %s while this "
                             "process held it; nothing left to remove", self.name, self.folder.path)
                elif named == _named(self._fd) and try_exclusive(self._fd):
                    StoreFolder.remove(self._dfd, self.name)
                    log.info("[tiered offload] shared host store %s: the last process let go; removed", self.name)
            if self._lock is not None and _named(self._dfd, self.name) is None:
                StoreFolder.remove(self._dfd, self.key.digest + LOCK_SUFFIX)
        except Exception as e:
            log.warning("[tiered offload] shared host store %s in %s: let go without removing it (%s); the next "
                        "sweep removes it "
                        "once no process holds it", self.key.digest if self.key else "?", self.folder.path, e)
        finally:
            self._part = None
            self._unlock()
            for attr in ("_fd", "_dfd"):
                fd = getattr(self, attr)
                if fd is not None:
                    setattr(self, attr, None)
                    os.close(fd)

    def _unlock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            unlock(lock)


def _named(dfd: int, name: str | None = None) -> tuple[int, int] | None:
    """The device and inode of ``name`` in the folder ``dfd`` (of the open file ``dfd`` without a
    name), None when there is no such file."""
    try:
        st = os.fstat(dfd) if name is None else os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def let_go_of_all() -> None:
    """Let go of every store this process still maps: the last process to end removes each one.
    Runs at interpreter exit; a host application that ends on a signal calls it first."""
    with _open_lock:
        stores = list(_open_stores)
    for store in stores:
        try:
            store.let_go_at_exit()
        except Exception:
            log.exception("[tiered offload] shared host store: could not let go of %s at exit", store.folder.path)


def _let_go_in_child() -> None:
    """After a fork without exec, in the child: let go of every store the parent maps, so a child
    that outlives its parent does not keep the parent's stores held (a flock belongs to the open
    file, which parent and child share). The child's mappings stay readable (``drop_inherited_holds``)."""
    global _open_lock
    _open_lock = threading.Lock()  # another thread of the parent may have held it: it is gone here
    stores = [s for s in list(_open_stores) if not s.released]
    fds = [fd for fd in (s.inherited_fd() for s in stores) if fd is not None]
    try:
        if fds:
            drop_inherited_holds(fds)
    except Exception as e:
        log.warning("[tiered offload] shared host store: a forked child could not map its stores from files "
                    "of its own (%s); their descriptors are closed, their mappings kept", e)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
    for store in stores:
        store.forget_in_child()


def _in_forked_child() -> None:
    """After a fork without exec, in the child, in this order: the lock files the parent held are
    closed first, so that none stays locked by the child whatever happens next; then every store
    the parent maps is let go of (its mappings kept readable)."""
    store_folder.close_lock_files_in_child()
    _let_go_in_child()


# The sharing room's only process hooks, one for a fork and one for the end, registered once,
# when the room is first imported (its __init__ imports this module).
atexit.register(let_go_of_all)
if SUPPORTED:
    os.register_at_fork(after_in_child=_in_forked_child)
