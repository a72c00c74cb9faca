"""Where a disk-streamed pack's bytes live: the model's own safetensors file, or a spill file.

Why the model's own file first: when the tensors a framework loaded are that file's bytes (no
dtype cast on load, no merged patch), every block is already on disk in full, so streaming needs no
extra disk space and no write. Whether they are is never assumed: when a pack is first placed,
its tensors are packed into a scratch buffer, the file's bytes for the same tensors are read into
another, and only a byte-for-byte match makes the file the pack's source. Anything else (a cast,
a conversion, a file that changed, names the file does not have) is written once to a spill file
in the packed layout, each pack at a 64 KiB-aligned offset and padded to 4 KiB, so it comes back
with one large read, direct (O_DIRECT, past the page cache) where the file system allows it.

Between runs the modules hold copy-on-write memory maps of those bytes (``mmap`` ACCESS_COPY): the
model stays usable by anyone, costs no RAM until read, and a write into it never reaches the file.
The spill file is unlinked as soon as it is open, so it vanishes with the process whatever happens.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .packing import PackedBlock, PackedTensor

log = logging.getLogger(__name__)

PAGE = 4096  # direct reads need offsets, lengths and addresses in multiples of the logical block
SPILL_ALIGN = 64 << 10  # a multiple of PAGE and of Windows' mmap granularity
_MiB = 1 << 20
_GiB = 1 << 30
MAX_HEADER = 100 << 20
_IOV_MAX = 512

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def size_text(n: float) -> str:
    """Bytes in binary units for log lines and messages: GiB, MiB, or KiB below 1 MiB."""
    if n >= _GiB:
        return f"{n / _GiB:.2f} GiB"
    return f"{n / _MiB:.1f} MiB" if n >= _MiB else f"{n / 1024:.0f} KiB"


class DiskReadError(OSError):
    """A pack could not be read back from disk: the file is gone, truncated or unreadable."""


@dataclass(frozen=True)
class TensorInFile:
    """One tensor of a safetensors file: absolute byte offset, size, dtype and shape."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_index(path: str) -> dict[str, TensorInFile]:
    """Every tensor of a safetensors file by key, from its header only (no tensor bytes are read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its header")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file: header of {n} bytes")
        header = json.loads(f.read(n).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not an object")
    base = 8 + n
    out: dict[str, TensorInFile] = {}
    for key, info in header.items():
        if key == "__metadata__" or not isinstance(info, dict):
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        start, end = info.get("data_offsets", (0, -1))
        if dtype is None or not 0 <= start <= end or base + end > size:
            continue  # a dtype torch cannot hold, or bad offsets: never a source
        out[key] = TensorInFile(base + start, end - start, dtype, tuple(info.get("shape", ())))
    return out


@dataclass(frozen=True)
class ModelFile:
    """The model's own safetensors file and the key each engine tensor has in it.

    ``key_of(block, path)`` names the tensor at ``path`` inside block ``block`` (the owner a
    PackedTensor records) as the file does, or returns None when it cannot tell.
    """

    path: str
    key_of: Callable[[int, str], str | None]


@dataclass(frozen=True)
class _Extent:
    file_offset: int
    length: int
    dest: int  # offset inside the pack's packed layout


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
    """One file the store reads (and for a spill, writes): a buffered descriptor, a direct one
    where allowed. Positional reads and writes where the OS has them (POSIX), otherwise a seek and
    a read under a lock (Windows)."""

    def __init__(self, path: str, fd: int, direct_fd: int | None) -> None:
        self.path = path
        self.fd = fd
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
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


def _read_into(fd: int, view: memoryview) -> int:
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def _typed(buf: torch.Tensor, offset: int, e: PackedTensor) -> torch.Tensor:
    """Entry ``e``'s values at ``offset`` of ``buf``, typed and strided as the original, an
    inference tensor if the original was one."""
    with torch.inference_mode(e.inference):
        return buf[offset : offset + e.nbytes].view(e.dtype).as_strided(e.shape, e.stride)


def _contiguous(e: PackedTensor) -> bool:
    expect, ok = 1, True
    for size, stride in zip(reversed(e.shape), reversed(e.stride)):
        if size != 1 and stride != expect:
            ok = False
        expect *= size
    return ok


class DiskStore:
    """The disk home of every pack of one streamer: placement, reads and detached views.

    ``place(i, pack, scratch, check)`` moves pack ``i`` to disk (see the module docstring) and
    binds its module tensors to copy-on-write maps of those bytes. The model's own file is used
    only where each tensor starts at a multiple of ``align`` bytes: CPU kernels pick their code
    path by the address of a weight, so a host that computes on the maps itself (a CPU device)
    must see them aligned as the allocator would place them, or its results change in the last
    bits. ``read(i, dst, start, length)``
    reads a byte range of the pack's packed layout into ``dst`` (page-aligned host memory).
    """

    def __init__(self, spill_dir: str, model_file: ModelFile | None = None, align: int = 1) -> None:
        self._spill_dir = spill_dir
        self._model = model_file
        self._align = align
        self._index: dict[str, TensorInFile] | None = None
        self._model_src: _Source | None = None
        self._model_map: torch.Tensor | None = None
        self._spill: _Source | None = None
        self._spill_path: str | None = None
        self._spill_end = 0
        self._places: dict[int, tuple[str, object]] = {}  # pack -> ("file", extents) | ("spill", (offset, padded))
        self._nbytes: dict[int, int] = {}
        self.model_file_error: str | None = None
        if model_file is not None:
            try:
                self._index = read_safetensors_index(model_file.path)
            except (OSError, ValueError, UnicodeDecodeError) as e:
                self.model_file_error = str(e)
                log.info("disk stream: %s cannot be a source: %s", model_file.path, e)

    # ---------------------------------------------------------------- figures
    @property
    def file_bytes(self) -> int:
        """Bytes of packs read from the model's own file."""
        return sum(self._nbytes[i] for i, (kind, _) in self._places.items() if kind == "file")

    @property
    def spill_bytes(self) -> int:
        """Size of the spill file (padding included)."""
        return self._spill_end

    @property
    def model_path(self) -> str | None:
        return self._model.path if self._model is not None else None

    def source_of(self, i: int) -> str | None:
        """"file" (the model's own file), "spill", or None if pack ``i`` is not on disk."""
        place = self._places.get(i)
        return place[0] if place is not None else None

    def __contains__(self, i: int) -> bool:
        return i in self._places

    # ---------------------------------------------------------------- placing
    def _extents(self, pack: PackedBlock) -> list[_Extent] | None:
        """Where the model's file holds each of the pack's tensors, or None if it holds not all."""
        if self._index is None or not pack.entries:
            return None
        out = []
        for e in pack.entries:
            key = self._model.key_of(*e.owner)
            found = self._index.get(key) if key is not None else None
            if found is None or found.dtype != e.dtype or found.shape != tuple(e.shape) \
                    or found.nbytes != e.nbytes or not _contiguous(e) \
                    or found.offset % max(self._align, e.dtype.itemsize):
                return None
            out.append(_Extent(found.offset, e.nbytes, e.offset))
        return out

    def _model_source(self) -> _Source:
        if self._model_src is None:
            path = self._model.path
            self._model_src = _Source(path, os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0)), None)
        return self._model_src

    def place(self, i: int, pack: PackedBlock, scratch: torch.Tensor, check: torch.Tensor) -> str:
        """Put pack ``i`` on disk and bind its tensors to maps of it; returns "file" or "spill".

        ``scratch`` and ``check`` are page-aligned host buffers of at least the pack's padded size.
        If anything fails after the pack took the tensors, they get fresh memory with their
        values back before the error propagates, so the module is always whole.
        """
        off_host = next((e for e in pack.entries if e.device.type != "cpu"), None)
        if off_host is not None:
            raise ValueError(f"disk streaming hands the tensors back as maps of host files, so they must "
                             f"be on the CPU when first attached; {off_host.label} is on {off_host.device}")
        extents = self._extents(pack)
        pack.pack(scratch)  # the tensors' values in the packed layout; originals are let go
        try:
            kind = "spill"
            if extents is not None and self._matches(pack, extents, scratch, check):
                kind = "file"
                self._places[i] = ("file", extents)
            else:
                self._places[i] = ("spill", self._write_spill(pack, scratch))
            self._nbytes[i] = pack.nbytes
            self._bind_maps(i, pack)
        except BaseException:
            self._places.pop(i, None)
            pack.restore(keep_host=False)  # fresh memory from the scratch copy
            raise
        return kind

    def _matches(self, pack: PackedBlock, extents: list[_Extent], scratch: torch.Tensor,
                 check: torch.Tensor) -> bool:
        self._read_extents(extents, check, 0, pack.nbytes)
        return all(torch.equal(scratch[e.offset : e.offset + e.nbytes], check[e.offset : e.offset + e.nbytes])
                   for e in pack.entries)

    def _open_spill(self) -> _Source:
        if self._spill is None:
            os.makedirs(self._spill_dir, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="tiered-offload-", suffix=".spill", dir=self._spill_dir)
            direct = _open_direct(path, os.O_RDWR)
            self._spill = _Source(path, fd, direct)
            self._spill_path = path
            if os.name != "nt":
                os.unlink(path)  # gone with the last descriptor and map, whatever ends the process
            log.info("disk stream: spill file in %s (deleted when the engine lets go of it)", self._spill_dir)
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

    def _bind_maps(self, i: int, pack: PackedBlock) -> None:
        """Hand the pack's tensors copy-on-write maps of their bytes on disk (see ``views``)."""
        for e, view in zip(pack.entries, self.views(i, pack)):
            if e.original is None:
                e.original = view
        pack.restore(keep_host=False)

    def finish(self) -> None:
        """Log what placing cost on disk."""
        if self._spill_end:
            log.info("disk stream: the spill file in %s holds %s", self._spill_dir, size_text(self._spill_end))

    # ---------------------------------------------------------------- views
    def views(self, i: int, pack: PackedBlock) -> list[torch.Tensor]:
        """Per tensor of pack ``i``: a copy-on-write map of its bytes on disk, typed as the original."""
        kind, where = self._places[i]
        if kind == "spill":
            offset, padded = where
            region = mmap.mmap(self._spill.fd, padded, offset=offset, access=mmap.ACCESS_COPY)
            with torch.inference_mode(False):
                buf = torch.frombuffer(region, dtype=torch.uint8)
            return [_typed(buf, e.offset, e) for e in pack.entries]
        whole = self._whole_model_map()
        return [_typed(whole, x.file_offset, e) for e, x in zip(pack.entries, where)]

    def _whole_model_map(self) -> torch.Tensor:
        if self._model_map is None:
            src = self._model_source()
            region = mmap.mmap(src.fd, 0, access=mmap.ACCESS_COPY)
            with torch.inference_mode(False):
                self._model_map = torch.frombuffer(region, dtype=torch.uint8)
        return self._model_map

    # ---------------------------------------------------------------- reading
    def padded_nbytes(self, i: int) -> int:
        return align_up(self._nbytes[i], PAGE)

    def read(self, i: int, dst: torch.Tensor, start: int = 0, length: int | None = None) -> int:
        """Read bytes [start, start + length) of pack ``i``'s layout into ``dst``; returns bytes read.

        ``start`` must be a multiple of PAGE; ``dst`` holds the range rounded up to PAGE. The gaps
        between tensors in the layout are left as they are.
        """
        kind, where = self._places[i]
        n = self._nbytes[i]
        length = n - start if length is None else min(length, n - start)
        if length <= 0:
            return 0
        try:
            if kind == "spill":
                offset, padded = where
                span = min(align_up(length, PAGE), padded - start)
                aligned = start % PAGE == 0 and dst.data_ptr() % PAGE == 0 and span % PAGE == 0
                self._spill.read([_memview(dst[:span])], offset + start, aligned)
            else:
                self._read_extents(where, dst, start, length)
        except OSError as e:
            source = self._spill_path if kind == "spill" else self._model.path
            raise DiskReadError(f"reading {size_text(length)} back from {source} failed: {e}") from e
        return length

    def _read_extents(self, extents: list[_Extent], dst: torch.Tensor, start: int, length: int) -> None:
        """Read the parts of ``extents`` inside [start, start + length) of the layout into ``dst``
        (offset by ``start``); runs that lie back to back in the file go in one preadv."""
        end = start + length
        parts = []
        for x in extents:
            lo, hi = max(x.dest, start), min(x.dest + x.length, end)
            if lo < hi:
                parts.append((x.file_offset + lo - x.dest, hi - lo, lo - start))
        parts.sort()
        src = self._model_source()
        run: list[memoryview] = []
        run_start = run_end = -1
        for file_offset, n, dest in parts:
            view = _memview(dst[dest : dest + n])
            if run and file_offset == run_end and len(run) < _IOV_MAX:
                run.append(view)
                run_end += n
                continue
            if run:
                src.read(run, run_start, aligned=False)
            run, run_start, run_end = [view], file_offset, file_offset + n
        if run:
            src.read(run, run_start, aligned=False)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the descriptors. Maps handed to modules keep their bytes alive on their own."""
        for src in (self._model_src, self._spill):
            if src is not None:
                src.close()
        if self._spill_path is not None and os.name == "nt":
            try:
                os.unlink(self._spill_path)
            except OSError:
                log.info("disk stream: the spill file %s is still mapped; delete it later", self._spill_path)
        self._model_src = self._spill = None
        self._model_map = None
        self._places.clear()
