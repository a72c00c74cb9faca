"""Positional reads and writes between files and host memory: what the spill file and the model's
own file share.

Why positional (``preadv``/``pwrite``) and never a memory map: several reader threads share one
descriptor without a seek between them, and a file that shrinks under a read gives a short read,
which the engine turns into an error naming the file, where a mapped page past the new end would
kill the process with SIGBUS. Where the OS has no positional calls (Windows) a seek and a read run
under a lock. Direct I/O (``O_DIRECT``) takes the page cache out of the way where the file system
allows it; it needs offsets, lengths and buffer addresses in multiples of the logical block, so
callers read page-aligned spans into page-aligned host memory.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading

import torch

from ..alignment import PAGE

log = logging.getLogger(__name__)

_IOV_MAX = 512


class DiskReadError(OSError):
    """A pack could not be read back from disk."""


def memview(t: torch.Tensor) -> memoryview:
    """A writable view of a CPU uint8 tensor's bytes for os.preadv / os.pwrite (no copy)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as flat uint8 bytes in row-major order (its memory when it is
    contiguous, else a copy), a storage subclass's too: what a file holds for it."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.contiguous().reshape(-1).view(torch.uint8)


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


def open_direct(path: str, flags: int) -> int | None:
    """A direct (``O_DIRECT``) descriptor of ``path``, or None where the OS or file system refuses."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct)
    except OSError:  # tmpfs and some overlay file systems refuse O_DIRECT
        return None


class Descriptors:
    """A file's buffered descriptor and, where the file system allows it, a direct one: how the
    spill file and the model's own file are read (and the spill file written).

    A direct descriptor the file system refuses a call on (EINVAL: some refuse O_DIRECT for
    reads they accept to open) is retired, not closed: another thread may be in a call on it, and
    a number closed under it could be the next file's. Every descriptor is closed once, at
    ``close``; a call after it is a DiskReadError, never a read of whatever file took the number."""

    def __init__(self, path: str, fd: int, direct: int | None) -> None:
        self.path = path
        self._fd: int | None = fd
        self._direct = direct
        self._retired: list[int] = []
        self._lock = threading.Lock()

    @property
    def fd(self) -> int:
        """The buffered descriptor; DiskReadError once closed."""
        fd = self._fd
        if fd is None:
            raise DiskReadError(f"{self.path} cannot be read: the engine has closed it")
        return fd

    @property
    def direct(self) -> bool:
        """Whether page-aligned calls pass the page cache by (O_DIRECT)."""
        return self._direct is not None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def read(self, views: list[memoryview], offset: int, aligned: bool) -> int:
        """``read_into`` on the direct descriptor where ``aligned`` allows it, else (or where the
        file system refuses it) on the buffered one; returns the bytes read."""
        direct = self._direct if aligned else None
        if direct is not None:
            try:
                return read_into(direct, views, offset, direct=True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._retire(direct)
        return read_into(self.fd, views, offset)

    def write(self, view: memoryview, offset: int, aligned: bool) -> None:
        """``write_all`` the same way."""
        direct = self._direct if aligned else None
        if direct is not None:
            try:
                return write_all(direct, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._retire(direct)
        write_all(self.fd, view, offset)

    def _retire(self, direct: int) -> None:
        with self._lock:
            if self._direct == direct:
                log.info("[tiered offload] disk stream: %s refuses direct I/O; using the page cache", self.path)
                self._retired.append(direct)
                self._direct = None

    def close(self) -> None:
        """Close every descriptor, once."""
        with self._lock:
            fds = [self._fd, self._direct, *self._retired]
            self._fd, self._direct, self._retired = None, None, []
        for fd in fds:
            if fd is not None:
                os.close(fd)


_seek_lock = threading.Lock()


def read_into(fd: int, views: list[memoryview], offset: int, direct: bool = False) -> int:
    """Read into ``views`` from ``offset`` until they are full or the file ends; returns the bytes
    read (fewer than asked only at the end of the file). ``direct``: ``fd`` is an O_DIRECT
    descriptor, whose read ends short of a block only at the end of the file."""
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        rest = _skip(views, done)
        if hasattr(os, "preadv"):
            got = os.preadv(fd, rest[:_IOV_MAX], offset + done)
        else:
            with _seek_lock:
                os.lseek(fd, offset + done, os.SEEK_SET)
                got = _read_one(fd, rest[0])
        if got <= 0:
            break
        done += got
        if direct and got % PAGE:
            break
    return done


def _read_one(fd: int, view: memoryview) -> int:
    if hasattr(os, "readinto"):
        return os.readinto(fd, view)
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset`` (fewer at the end of the file)."""
    if hasattr(os, "pread"):
        return os.pread(fd, n, offset)
    with _seek_lock:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, n)


def write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "pwrite"):
            done += os.pwrite(fd, view[done:], offset + done)
        else:
            with _seek_lock:
                os.lseek(fd, offset + done, os.SEEK_SET)
                done += os.write(fd, view[done:])
