"""The spill file: the disk home of the units whose bytes the engine must make itself.

A unit streamed from disk is read from the model's own file where its loaded tensors are that
file's bytes (in_place.py, sources.py). The others (a dtype cast at load, a quantized
conversion, a tensor the file does not hold) are written here once, in a file of the engine's
own, unlinked as soon as it is open: no one else can change it, so the maps handed back and every
unit read during a run are exactly the bytes the engine placed, and it goes away with its last
descriptor and map, whatever ends the process. The price is disk space and a write, for those
units only.

Each pack goes to the spill file in the packed layout at a 64 KiB-aligned offset, padded to 4 KiB,
so it comes back with one large read, direct (O_DIRECT, past the page cache) where the file
system allows it. Between runs the modules hold copy-on-write memory maps of those bytes (``mmap``
ACCESS_COPY), one map of the whole file per store, plus one per pack spilled later (a unit whose
file bytes turned out to differ from the loaded ones at their first read): the model stays usable
by anyone, costs no RAM until read, and a write into it never reaches the file.
"""
from __future__ import annotations

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
from ..alignment import PAGE, align_up
from ..files.raw_io import Descriptors, DiskReadError, memview, open_direct, raw_bytes, write_all

log = logging.getLogger(__name__)

SPILL_ALIGN = 64 << 10  # a multiple of PAGE and of Windows' mmap granularity


class SpillWriteError(OSError):
    """The spill file could not take a unit (a full disk, a quota, a file size limit): the message
    names the folder and what the engine needs there, since the OS's own words name neither."""


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
        self._spill: Descriptors | None = None
        self._spill_path: str | None = None
        self._spill_end = 0
        self._places: dict[int, tuple[int, int]] = {}  # pack -> (offset, padded length)
        self._nbytes: dict[int, int] = {}
        self._maps: list[mmap.mmap] = []  # maps of packs spilled after the first placement
        self._lock = threading.Lock()  # late spills come from reader threads
        self._written = 0
        self._closed = False
        self.planned_bytes = 0  # what placing will write, when known: named if a write fails

    # ---------------------------------------------------------------- figures
    @property
    def spill_bytes(self) -> int:
        """Size of the spill file (padding included)."""
        return self._spill_end

    @property
    def written_bytes(self) -> int:
        """Bytes written to the spill file so far (its packs, padded)."""
        return self._written

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

    def _open_spill(self) -> Descriptors:
        if self._spill is None:
            os.makedirs(self._spill_dir, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="tiered-offload-", suffix=".spill", dir=self._spill_dir)
            direct = open_direct(path, os.O_RDWR)
            self._spill = Descriptors(path, fd, direct)
            self._spill_path = path
            if os.name != "nt":
                os.unlink(path)  # gone with the last descriptor and map, whatever ends the process
            log.info("[tiered offload] disk stream: spill file opened in %s (deleted when the engine lets go of it)",
                     self._spill_dir)
        return self._spill

    def _reserve(self, nbytes: int) -> tuple[Descriptors, int, int]:
        """Room for ``nbytes`` at the spill file's end: (file, offset, padded length)."""
        spill = self._open_spill()
        padded = align_up(nbytes, PAGE)
        free = shutil.disk_usage(self._spill_dir).free
        if padded > free:
            raise self._no_room(f"{size_text(free)} free")
        with self._lock:
            offset = align_up(self._spill_end, SPILL_ALIGN)
            self._spill_end = offset + padded
        return spill, offset, padded

    def _no_room(self, why: str, errno_: int = errno.ENOSPC) -> SpillWriteError:
        need = max(self.planned_bytes, self._spill_end)
        return SpillWriteError(
            errno_, f"the spill file in {self._spill_dir} cannot be written ({why}) after "
            f"{size_text(self._written)}; the units the engine must write itself need {size_text(need)} "
            f"there. Free space there, set spill_dir to a folder with room, or set host_cache_gb to 0 "
            f"to keep the model in RAM")

    def _write_spill(self, pack: PackedBlock, scratch: torch.Tensor) -> tuple[int, int]:
        spill, offset, padded = self._reserve(pack.nbytes)
        scratch[pack.nbytes : padded].zero_()
        try:
            spill.write(memview(scratch[:padded]), offset, aligned=scratch.data_ptr() % PAGE == 0)
        except OSError as e:
            raise self._no_room(e.strerror or str(e), e.errno or errno.EIO) from e
        self._written += padded
        return offset, padded

    def write_late(self, i: int, pack: PackedBlock) -> None:
        """Write pack ``i`` from its originals, tensor by tensor, after the first placement (a
        unit read from the model's file whose bytes were not the loaded ones); its originals
        then become copy-on-write maps of what was written. The module's tensors are left as
        they are: they show their values already, and the next hand-back gives them the maps."""
        if self._closed:
            raise RuntimeError("the disk store is closed")
        spill, offset, padded = self._reserve(pack.nbytes)
        try:
            for e in pack.entries:
                write_all(spill.fd, memview(raw_bytes(e.original)), offset + e.offset)
            if padded > pack.nbytes:  # the tail, so the file holds no stale bytes
                write_all(spill.fd, memoryview(bytes(padded - pack.nbytes)), offset + pack.nbytes)
        except OSError as e:
            raise self._no_room(e.strerror or str(e), e.errno or errno.EIO) from e
        self._written += padded
        region = mmap.mmap(spill.fd, padded, offset=offset, access=mmap.ACCESS_COPY)
        with torch.inference_mode(False):
            whole = torch.frombuffer(region, dtype=torch.uint8)
        with self._lock:
            self._places[i] = (offset, padded)
            self._nbytes[i] = pack.nbytes
            self._maps.append(region)
        for e in pack.entries:
            e.original = _typed(whole, e.offset, e)

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
            log.warning("[tiered offload] disk stream: the spill file cannot be mapped (%s); its packs are read "
                        "back into RAM", e)
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
            log.info("[tiered offload] disk stream: the spill file in %s holds %s",
                     self._spill_dir, size_text(self._spill_end))

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
            got = spill.read([memview(dst[:span])], offset + start, aligned)
        except OSError as e:
            raise DiskReadError(f"reading {size_text(length)} back from {self._spill_path} failed: {e}") from e
        if got < span:
            raise DiskReadError(f"reading {size_text(length)} back from {self._spill_path} failed: it ends at "
                                f"byte {offset + start + got}, before pack {i}'s data")
        return length

    def drop_cached_pages(self) -> None:
        """Ask the OS to forget the spill file's cached pages, so the next reads come from the disk
        (a benchmark's cold state; direct reads pass the page cache by anyway)."""
        spill = self._spill
        if spill is not None and not spill.closed and hasattr(os, "posix_fadvise"):
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
                log.info("[tiered offload] disk stream: the spill file %s is still mapped; delete it later",
                         self._spill_path)
        self._places.clear()
        self._maps.clear()  # the tensors over them keep them open
