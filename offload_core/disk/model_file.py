"""The model's own file as the disk home of streamed units: read in place, never mapped, watched.

Why read it in place: when a unit's loaded tensors are the file's bytes (no cast, no quantized
conversion, no transform), every byte the engine would write to a spill file is already on disk.
Reading it there costs no disk space, no write and no wait for one before the first step.

Why ``pread`` and never a memory map: the file belongs to the user, who may re-download it, copy
another model over it or delete it at any moment. A mapped page past a truncation is SIGBUS,
which kills ComfyUI and its queue; a page of a file overwritten in place silently changes under
the running model. A read past the end is a short read, which is an error naming the file.

Why the identity (``file_version``: device, inode, size, modification and change time in ns):
a pread of a file overwritten in place returns the new bytes without complaint. The identity is
taken when the file is opened and checked again after every pass and at the end of every run; a
file replaced, truncated or overwritten in place fails the run with ``ModelFileChanged`` before
its result is used. The change time moves with every write and with every attempt to put the
modification time back, so no one can change the bytes and keep the identity. It moves with a
chmod, a chown or a hard link too, which change no byte: whether only that happened is the one
rule of host/file_identity.py (``same_bytes``), which reads back the ranges read here before
(each digested at its first read, ``note_read``) and fails the run only where they differ.

How a unit is read: its tensors' byte ranges in the file (from the file's header, by the caller)
are merged into a few runs where they lie close together, each run widened to the file system's
block so it can be read with ``O_DIRECT`` (past the page cache, which a model the size of the RAM
would otherwise flush) straight into page-aligned host memory. The bytes then sit in file order;
``Piece`` says where each tensor's bytes are in the read buffer and where they go in the unit's
packed layout, so the device copy puts each where the engine's views expect it.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat as stat_mod
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..host.file_identity import content_may_differ, file_version, note_read, same_bytes
from ..units import size_text
from .raw_io import PAGE, DiskReadError, align_down, align_up, memview, open_direct, read_at, read_into

log = logging.getLogger(__name__)

RUN_GAP = PAGE  # tensors this close in the file are read as one run (the gap read and dropped)


MAX_HEADER = 100 << 20  # a larger safetensors header is a damaged file, not a model


def safetensors_tensors(path: str) -> dict[str, tuple[int, int, str]]:
    """Every tensor of a safetensors file by key, from its header alone (no tensor byte is
    read): (byte offset in the file, byte count, the file's dtype name). ValueError for a file
    that is not one."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        head = read_at(fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file: a header of {n} bytes")
        header = json.loads(read_at(fd, n, 8).decode("utf-8"))
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not an object")
    out = {}
    for key, info in header.items():
        if key == "__metadata__" or not isinstance(info, dict):
            continue
        start, end = info.get("data_offsets", (0, -1))
        if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and 8 + n + end <= size:
            out[key] = (8 + n + start, end - start, str(info.get("dtype")))
    return out


# GGML tensor types: id -> (name, values per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1),
    25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes


class _Cursor:
    """Sequential reads of a file's header through pread, in pieces (no map of the file)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size, self.pos = fd, size, 0
        self._buf, self._at = b"", 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise ValueError("ends inside its header")
        if not self._at <= self.pos or self.pos + n > self._at + len(self._buf):
            self._at, self._buf = self.pos, read_at(self.fd, max(n, 1 << 20), self.pos)
        out = self._buf[self.pos - self._at : self.pos - self._at + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            inner, count = self.u32(), self.u64()
            if inner in _GGUF_SCALARS:
                self.take(_GGUF_SCALARS[inner] * count)
            else:
                for _ in range(count):
                    self.skip_value(inner)
        elif kind in _GGUF_SCALARS:
            self.take(_GGUF_SCALARS[kind])
        else:
            raise ValueError(f"an unknown value type {kind}")


def gguf_tensors(path: str) -> dict[str, tuple[int, int | None, str]]:
    """Every tensor of a GGUF file by name, from its header alone: (byte offset in the file, byte
    count (None for a type not in GGML_TYPES), type name). ValueError for a file that is not one."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        cur = _Cursor(fd, os.fstat(fd).st_size)
        try:
            if cur.take(4) != b"GGUF":
                raise ValueError("no GGUF magic")
            version = cur.u32()
            if version < 2:
                raise ValueError(f"version {version} is not read here")
            count, kvs = cur.u64(), cur.u64()
            alignment = 32
            for _ in range(kvs):
                key, kind = cur.string(), cur.u32()
                if key == b"general.alignment" and kind == 4:
                    alignment = cur.u32() or 32
                else:
                    cur.skip_value(kind)
            infos = []
            for _ in range(count):
                name = cur.string().decode("utf-8")
                dims = [cur.u64() for _ in range(cur.u32())]
                kind, offset = cur.u32(), cur.u64()
                infos.append((name, dims, kind, offset))
        except ValueError as e:
            raise ValueError(f"{path} is not a GGUF file this can read: {e}") from None
        start = align_up(cur.pos, alignment)
    finally:
        os.close(fd)
    out = {}
    for name, dims, kind, offset in infos:
        values = 1
        for d in dims:
            values *= d
        known = GGML_TYPES.get(kind)
        nbytes = values // known[1] * known[2] if known is not None else None
        out[name] = (start + offset, nbytes, known[0] if known is not None else f"type {kind}")
    return out


class ModelFileChanged(DiskReadError):
    """The model's file is no longer the file the streamed weights were read from."""

    def __init__(self, path: str, how: str) -> None:
        self.path = path
        super().__init__(
            f"the model file {path} {how} while its blocks were streamed from it, so the weights "
            f"read from it can no longer be trusted. Load the model again (free the models and "
            f"node cache, or change the loader's input) to use the file as it is now")


def _how_changed(was: tuple[int, ...], now: os.stat_result | None) -> str:
    if now is None:
        return "was deleted"
    version = file_version(now)
    if version[:2] != was[:2]:
        return "was replaced by another file"
    if version[2] < was[2]:
        return f"was truncated (from {size_text(was[2])} to {size_text(version[2])})"
    if version[3] == was[3]:
        return "was changed in place (its modification time kept or put back; its bytes read back differ)"
    return "was changed in place"


@dataclass(frozen=True)
class FileSlice:
    """One tensor's bytes in a model file of a known version."""

    path: str
    version: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ModelFileMap:
    """A model file and where the streamed tensors are in it: (block index, path inside the
    block) -> (byte offset in the file, byte count, the dtype the file holds it in; None where
    the bytes are the tensor's whatever it is, such as a mapped file's), from the file's header."""

    path: str
    tensors: Mapping[tuple[int, str], tuple[int, int, torch.dtype | None]]


@dataclass(frozen=True)
class Piece:
    """One tensor's bytes: at ``src`` in the read buffer, at ``dst`` in the unit's packed layout."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Run:
    """One read: ``length`` bytes of the file from ``start`` (both block-aligned) into the read
    buffer at ``at``; the tensors in it end ``needed`` bytes in (a shorter read is a truncation)."""

    start: int
    length: int
    at: int
    needed: int


@dataclass(frozen=True)
class UnitRead:
    """How one unit comes out of the model's file: its runs, its pieces, the buffer it needs."""

    runs: tuple[Run, ...]
    pieces: tuple[Piece, ...]
    buffer_bytes: int


def plan_read(extents: Sequence[tuple[int, int, int]], gap: int = RUN_GAP) -> UnitRead:
    """The reads of a unit whose tensors are ``extents``: (file offset, bytes, offset in the
    packed layout) each."""
    order = sorted(extents)
    groups: list[list[tuple[int, int, int]]] = []
    for ext in order:
        if groups and ext[0] <= groups[-1][-1][0] + groups[-1][-1][1] + gap:
            groups[-1].append(ext)
        else:
            groups.append([ext])
    runs, pieces, at = [], [], 0
    for group in groups:
        first = group[0][0]
        last = max(off + n for off, n, _ in group)
        start = align_down(first, PAGE)
        length = align_up(last, PAGE) - start
        runs.append(Run(start, length, at, last - start))
        pieces += [Piece(at + off - start, dst, n) for off, n, dst in group]
        at += length
    return UnitRead(tuple(runs), tuple(pieces), at)


class ModelFile:
    """One model file opened for reading: a buffered descriptor, a direct one where the file
    system allows it, and the version both were opened at (``version``)."""

    def __init__(self, path: str, version: tuple[int, ...] | None = None) -> None:
        """Open ``path``; given the ``version`` the caller read from before, a file that is gone
        or another version raises ModelFileChanged."""
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if version is None:
                raise
            raise ModelFileChanged(path, "was deleted") from None
        try:
            st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode):
                raise DiskReadError(f"{path} is not a regular file; its blocks cannot be read from it")
        except BaseException:
            os.close(fd)
            raise
        self.version = file_version(st)
        self._fd: int | None = fd
        self._direct: int | None = open_direct(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        if self._direct is not None and file_version(os.fstat(self._direct))[:2] != self.version[:2]:
            # Another file took the name between the two opens: read only the one opened first.
            os.close(self._direct)
            self._direct = None
        self._retired: list[int] = []  # direct descriptors no longer read, closed with the file
        self._lock = threading.Lock()
        if version is not None and version != self.version and same_bytes(path, version) != self.version:
            self.close()
            raise ModelFileChanged(path, _how_changed(version, st))

    @property
    def direct(self) -> bool:
        """Whether reads pass the page cache by (O_DIRECT)."""
        return self._direct is not None

    def check(self, version: tuple[int, ...] | None = None) -> None:
        """Raise ModelFileChanged unless the name still leads to the file opened, with the bytes
        it had when opened (and, given ``version``, the bytes it had at that version): a version
        whose change time alone moved counts where the ranges read so far read back the same."""
        want = self.version if version is None else version
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if now is not None and file_version(now) == want:
            current = want
        else:
            current = same_bytes(self.path, want) if now is not None else None
            if current is None:
                raise ModelFileChanged(self.path, _how_changed(want, now))
            self.version = current
        fd = self._fd
        if fd is not None and file_version(os.fstat(fd)) != current:
            raise ModelFileChanged(self.path, _how_changed(want, os.fstat(fd)))

    def read(self, plan: UnitRead, dst: torch.Tensor, runs: Sequence[Run] | None = None) -> int:
        """Read ``runs`` (default: all of the plan's) into ``dst`` (page-aligned host memory of
        at least the plan's buffer bytes) at their places; returns the bytes read. A file that
        ends before a run's tensors raises ModelFileChanged."""
        total = 0
        for run in plan.runs if runs is None else runs:
            view = memview(dst[run.at : run.at + run.length])
            got = self._read_run(view, run.start, dst.data_ptr() + run.at)
            if got < run.needed:
                raise ModelFileChanged(self.path, f"ends at byte {run.start + got}, before the tensors "
                                                  f"at bytes {run.start} to {run.start + run.needed}: it "
                                                  f"was truncated or replaced")
            self._witness(view[: run.needed], run.start)
            total += got
        self._still_read_at_version()
        return total

    def _still_read_at_version(self) -> None:
        """Right after a read: the open file still has the bytes it had when opened, so no byte
        written during the read reaches compute (one fstat, some microseconds a unit). A name
        renamed over or deleted does not matter here: the open inode is what was read. A change of
        the inode's change time alone is confirmed by its bytes (file_identity.same_bytes)."""
        fd = self._fd
        if fd is None:
            raise DiskReadError(f"{self.path} cannot be read: the engine has closed it")
        st = os.fstat(fd)
        now = file_version(st)
        if now == self.version:
            return
        if content_may_differ(self.version, now) or same_bytes(self.path, self.version) != now:
            raise ModelFileChanged(self.path, _how_changed(self.version, st))
        self.version = now

    def _witness(self, data: memoryview, offset: int) -> None:
        """Digest a range at its first read (file_identity.note_read): what a later change of the
        file's metadata alone is checked against."""
        fd = self._fd
        if fd is not None:
            note_read(fd, self.version, offset, data)

    def _read_run(self, view: memoryview, offset: int, address: int) -> int:
        fd = self._direct if address % PAGE == 0 else None
        if fd is not None:
            try:
                return read_into(fd, [view], offset, direct=True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise DiskReadError(f"reading {size_text(len(view))} from {self.path} failed: {e}") from e
                self._no_direct()
        fd = self._fd
        if fd is None:
            raise DiskReadError(f"{self.path} cannot be read: the engine has closed it")
        try:
            return read_into(fd, [view], offset)
        except OSError as e:
            raise DiskReadError(f"reading {size_text(len(view))} from {self.path} failed: {e}") from e

    def _no_direct(self) -> None:
        """Reads go through the page cache from now on. The direct descriptor stays open until
        ``close``: another reader may be in a read on it, and a number closed under it could be
        reused by the next file opened."""
        with self._lock:
            if self._direct is not None:
                log.info("disk stream: %s refuses direct reads; reading it through the page cache", self.path)
                self._retired.append(self._direct)
                self._direct = None

    def drop_cached_pages(self) -> None:
        """Ask the OS to forget the file's cached pages (a benchmark's cold state)."""
        fd = self._fd
        if fd is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close both descriptors, once."""
        with self._lock:
            fds, self._fd, self._direct = (self._fd, self._direct, *self._retired), None, None
            self._retired = []
        for fd in fds:
            if fd is not None:
                os.close(fd)
