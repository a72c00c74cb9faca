"""The disk home of a disk-streamed pack: a spill file of the engine's own.

Why always a file of its own, even when the loaded tensors are the bytes of the model's file:
between runs the modules must hold their weights somewhere (core runs the model without the
engine whenever a prompt does), and a map of a file someone else owns can be pulled away at any
moment. A truncated model file (a re-download, a copy that ran out of disk) turns the next read of
a mapped page into SIGBUS, which kills ComfyUI and its queue; a file overwritten in place changes
the weights under the running model, so results match neither the old file nor the new one. A
copy in RAM would defeat disk streaming. A file that only the engine writes, unlinked as soon as it
is open, can be changed by no one else, so the maps handed back and every unit read during a run
are exactly the bytes the engine placed. The price is disk space (the streamed packs, once) and a
write at the first placement, where the packs are read from the loaded tensors anyway.

Each pack goes to the spill file in the packed layout at a 64 KiB-aligned offset, padded to 4 KiB,
so it comes back with one large read, direct (O_DIRECT, past the page cache) where the file
system allows it. Between runs the modules hold copy-on-write memory maps of those bytes (``mmap``
ACCESS_COPY), one map of the whole file per store: the model stays usable by anyone, costs no RAM
until read, and a write into it never reaches the file. The file goes away with its last
descriptor and map, whatever ends the process.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping

import torch

from ..host.layout import PackedTensor
from ..host.packing import PackedBlock
from ..units import size_text

log = logging.getLogger(__name__)

PAGE = 4096  # direct reads need offsets, lengths and addresses in multiples of the logical block
SPILL_ALIGN = 64 << 10  # a multiple of PAGE and of Windows' mmap granularity
_IOV_MAX = 512


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class DiskReadError(OSError):
    """A pack could not be read back from disk."""


def _memview(t: torch.Tensor) -> memoryview:
    """A writable view of a CPU uint8 tensor's bytes for os.preadv / os.pwrite (no copy)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """The views past their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _open_direct(path: str, flags: int) -> int | None:
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct)
    except OSError:  # tmpfs and some overlay file systems refuse O_DIRECT
        return None


class _Source:
    """The spill file: a buffered descriptor, a direct one where allowed. Positional reads and
    writes where the OS has them (POSIX), otherwise a seek and a read under a lock (Windows)."""

    def __init__(self, path: str, fd: int, direct_fd: int | None) -> None:
        self.path = path
        self.fd: int | None = fd
        self.direct_fd = direct_fd
        self._lock = threading.Lock()

    def read(self, views: list[memoryview], offset: int, aligned: bool) -> None:
        fd = self.direct_fd if aligned and self.direct_fd is not None else self.fd
        try:
            self._read(fd, views, offset)
        except OSError as e:
            if fd == self.fd or e.errno != errno.EINVAL:
                raise
            self._no_direct()
            self._read(self.fd, views, offset)

    def write(self, view: memoryview, offset: int, aligned: bool) -> None:
        fd = self.direct_fd if aligned and self.direct_fd is not None else self.fd
        try:
            self._write(fd, view, offset)
        except OSError as e:
            if fd == self.fd or e.errno != errno.EINVAL:
                raise
            self._no_direct()
            self._write(self.fd, view, offset)

    def _no_direct(self) -> None:
        with self._lock:
            if self.direct_fd is not None:
                log.info("disk stream: %s refuses direct I/O; using the page cache", self.path)
                os.close(self.direct_fd)
                self.direct_fd = None

    def _read(self, fd: int, views: list[memoryview], offset: int) -> None:
        total = sum(len(v) for v in views)
        done = 0
        while done < total:
            rest = _skip(views, done)
            if hasattr(os, "preadv"):
                got = os.preadv(fd, rest[:_IOV_MAX], offset + done)
            else:
                with self._lock:
                    os.lseek(fd, offset + done, os.SEEK_SET)
                    got = os.readinto(fd, rest[0]) if hasattr(os, "readinto") else _read_into(fd, rest[0])
            if got <= 0:
                raise DiskReadError(f"{self.path} ends at byte {offset + done}, before the data")
            done += got

    def _write(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            if hasattr(os, "pwrite"):
                done += os.pwrite(fd, view[done:], offset + done)
            else:
                with self._lock:
                    os.lseek(fd, offset + done, os.SEEK_SET)
                    done += os.write(fd, view[done:])

    def close(self) -> None:
        """Close both descriptors, once: a number closed twice may be another file's by then."""
        with self._lock:
            fds, self.fd, self.direct_fd = (self.fd, self.direct_fd), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)


def _read_into(fd: int, view: memoryview) -> int:
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def _typed(buf: torch.Tensor, offset: int, e: PackedTensor) -> torch.Tensor:
    """Entry ``e``'s values at ``offset`` of ``buf``, typed and strided as the original, an
    inference tensor if the original was one."""
    with torch.inference_mode(e.inference):
        return buf[offset : offset + e.nbytes].view(e.dtype).as_strided(e.shape, e.stride)


class DiskStore:
    """The spill file of one streamer: writing packs, binding maps of them, reading them back.

    ``write(i, pack, scratch)`` puts pack ``i`` in the spill file and leaves its module tensors
    unset; ``bind(packs)`` then hands every written pack's tensors copy-on-write maps of their
    bytes (see the module docstring). ``read(i, dst, start, length)`` reads a byte range of the
    pack's packed layout into ``dst`` (page-aligned host memory). ``close()`` gives back the
    descriptors, once; the maps the modules hold keep the file's bytes until they are let go.
    """

    def __init__(self, spill_dir: str) -> None:
        self._spill_dir = spill_dir
        self._spill: _Source | None = None
        self._spill_path: str | None = None
        self._spill_end = 0
        self._places: dict[int, tuple[int, int]] = {}  # pack -> (offset, padded length)
        self._nbytes: dict[int, int] = {}
        self._closed = False

    # ---------------------------------------------------------------- figures
    @property
    def spill_bytes(self) -> int:
        """Size of the spill file (padding included)."""
        return self._spill_end

    def __contains__(self, i: int) -> bool:
        return i in self._places

    # ---------------------------------------------------------------- placing
    def write(self, i: int, pack: PackedBlock, scratch: torch.Tensor) -> None:
        """Write pack ``i`` to the spill file; its module tensors stay unset until ``bind``.

        ``scratch`` is a page-aligned host buffer of at least the pack's padded size, reused for
        the next pack, so nothing may read it through the module afterwards. If the write fails,
        the tensors get fresh memory with their values back before the error propagates, so the
        module is always whole.
        """
        if self._closed:
            raise RuntimeError("the disk store is closed")
        off_host = next((e for e in pack.entries if e.device.type != "cpu"), None)
        if off_host is not None:
            raise ValueError(f"disk streaming hands the tensors back as maps of host files, so they must "
                             f"be on the CPU when first attached; {off_host.label} is on {off_host.device}")
        pack.pack(scratch)  # the tensors' values in the packed layout; originals are let go
        try:
            self._places[i] = self._write_spill(pack, scratch)
            self._nbytes[i] = pack.nbytes
        except BaseException:
            self._places.pop(i, None)
            pack.restore(keep_host=False)  # fresh memory from the scratch copy
            raise
        pack.release()

    def _open_spill(self) -> _Source:
        if self._spill is None:
            os.makedirs(self._spill_dir, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="tiered-offload-", suffix=".spill", dir=self._spill_dir)
            direct = _open_direct(path, os.O_RDWR)
            self._spill = _Source(path, fd, direct)
            self._spill_path = path
            if os.name != "nt":
                os.unlink(path)  # gone with the last descriptor and map, whatever ends the process
            log.info("disk stream: spill file opened in %s (deleted when the engine lets go of it)", self._spill_dir)
        return self._spill

    def _write_spill(self, pack: PackedBlock, scratch: torch.Tensor) -> tuple[int, int]:
        spill = self._open_spill()
        padded = align_up(pack.nbytes, PAGE)
        free = shutil.disk_usage(self._spill_dir).free
        if padded > free:
            raise OSError(f"no room for the spill file in {self._spill_dir}: {size_text(padded)} more "
                          f"needed, {size_text(free)} free")
        scratch[pack.nbytes : padded].zero_()
        offset = align_up(self._spill_end, SPILL_ALIGN)
        spill.write(_memview(scratch[:padded]), offset, aligned=scratch.data_ptr() % PAGE == 0)
        self._spill_end = offset + padded
        return offset, padded

    def bind(self, packs: Mapping[int, PackedBlock]) -> None:
        """Hand the tensors of written packs copy-on-write maps of their bytes, all from one map
        of the spill file (one descriptor and one mapping, however many packs). Where the file
        cannot be mapped (no address space, too many maps), the packs are read back into RAM
        instead, so the module is whole either way."""
        if not packs:
            return
        try:
            region = mmap.mmap(self._spill.fd, self._spill_end, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            log.warning("disk stream: the spill file cannot be mapped (%s); its packs are read back into RAM", e)
            for i, pack in packs.items():
                with torch.inference_mode(False):
                    buf = torch.empty(self._places[i][1], dtype=torch.uint8)
                self.read(i, buf)
                self._bind_pack(pack, buf, 0)
            return
        with torch.inference_mode(False):
            whole = torch.frombuffer(region, dtype=torch.uint8)
        for i, pack in packs.items():
            self._bind_pack(pack, whole, self._places[i][0])

    @staticmethod
    def _bind_pack(pack: PackedBlock, buf: torch.Tensor, offset: int) -> None:
        for e in pack.entries:
            if e.original is None:
                e.original = _typed(buf, offset + e.offset, e)
        pack.restore(keep_host=False)

    def finish(self) -> None:
        """Log what placing cost on disk."""
        if self._spill_end:
            log.info("disk stream: the spill file in %s holds %s", self._spill_dir, size_text(self._spill_end))

    # ---------------------------------------------------------------- reading
    def read(self, i: int, dst: torch.Tensor, start: int = 0, length: int | None = None) -> int:
        """Read bytes [start, start + length) of pack ``i``'s layout into ``dst``; returns bytes read.

        ``start`` must be a multiple of PAGE; ``dst`` holds the range rounded up to PAGE.
        """
        spill = self._spill
        if spill is None:
            raise DiskReadError(f"pack {i} cannot be read back from {self._spill_path}: the store is closed")
        offset, padded = self._places[i]
        n = self._nbytes[i]
        length = n - start if length is None else min(length, n - start)
        if length <= 0:
            return 0
        span = min(align_up(length, PAGE), padded - start)
        aligned = start % PAGE == 0 and dst.data_ptr() % PAGE == 0 and span % PAGE == 0
        try:
            spill.read([_memview(dst[:span])], offset + start, aligned)
        except OSError as e:
            raise DiskReadError(f"reading {size_text(length)} back from {self._spill_path} failed: {e}") from e
        return length

    def drop_cached_pages(self) -> None:
        """Ask the OS to forget the spill file's cached pages, so the next reads come from the disk
        (a benchmark's cold state; direct reads pass the page cache by anyway)."""
        spill = self._spill
        if spill is not None and spill.fd is not None and hasattr(os, "posix_fadvise"):
            os.fsync(spill.fd)
            os.posix_fadvise(spill.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Give the descriptors back, once. Maps handed to modules keep their bytes alive."""
        if self._closed:
            return
        self._closed = True
        spill, self._spill = self._spill, None
        if spill is not None:
            spill.close()
        if self._spill_path is not None and os.name == "nt":
            try:
                os.unlink(self._spill_path)
            except OSError:
                log.info("disk stream: the spill file %s is still mapped; delete it later", self._spill_path)
        self._places.clear()
