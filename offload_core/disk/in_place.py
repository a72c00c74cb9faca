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
taken when the file is opened and checked on the open descriptor right after every read, so no
byte written during a read reaches compute; a file truncated or overwritten in place fails the
run with ``ModelFileChanged``, naming it, before its result is used. The change time moves with
every write and with every attempt to put the modification time back, so no one can change the
bytes and keep the identity. It moves with a chmod, a chown or a hard link too, which change no
byte: whether only that happened is the one rule of files/file_identity.py (``same_bytes``), which
reads back the ranges read here before (each digested at its first read, ``note_read``) and fails
the run only where they differ. What happens to the name does not matter: a file deleted or
renamed over is still the open inode, with the loaded bytes (ModelFile's docstring).

How a unit is read: its tensors' byte ranges in the file (from the file's header, by the caller)
are merged into a few runs where they lie close together, each run widened to the file system's
block so it can be read with ``O_DIRECT`` (past the page cache, which a model the size of the RAM
would otherwise flush) straight into page-aligned host memory. The bytes then sit in file order;
``Piece`` says where each tensor's bytes are in the read buffer and where they go in the unit's
packed layout, so the device copy puts each where the engine's views expect it.
"""
from __future__ import annotations

import logging
import os
import stat as stat_mod
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..files.file_identity import content_may_differ, file_version, note_read, same_bytes
from ..units import size_text
from ..alignment import PAGE, align_down, align_up
from ..files.raw_io import Descriptors, DiskReadError, memview, open_direct

log = logging.getLogger(__name__)

RUN_GAP = PAGE  # tensors this close in the file are read as one run (the gap read and dropped)


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
    """One tensor's bytes in a model file of a known version; ``opened``: the open file they were
    read from, which a note of a released tensor keeps open (ModelFile's docstring says why)."""

    path: str
    version: tuple[int, ...]
    offset: int
    nbytes: int
    opened: ModelFile | None = field(default=None, compare=False, repr=False)


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
    system allows it (files/raw_io.py: Descriptors), and the version both were opened at (``version``).

    What is read is the open file, whatever later happens to its name: a re-download renamed over
    it or a delete leaves the inode, with exactly the bytes the model was loaded from, to the
    descriptors. So a model keeps running from it (as core's keeps running from its copy in RAM),
    and its disk space is given back when the last thing that may read it lets go: the engine and
    the released tensors' notes (``FileSlice.opened``), i.e. when the model is unloaded. A write
    to the open file itself is what fails it: the descriptors are closed then, and every later
    read raises ModelFileChanged."""

    def __init__(self, path: str, version: tuple[int, ...] | None = None) -> None:
        """Open ``path``; given the ``version`` the caller read from before, a file that is gone
        or another version raises ModelFileChanged."""
        self.path = path
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
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
        direct = open_direct(path, flags)
        if direct is not None and file_version(os.fstat(direct))[:2] != self.version[:2]:
            # Another file took the name between the two opens: read only the one opened first.
            os.close(direct)
            direct = None
        self._io = Descriptors(path, fd, direct)
        self._closer = weakref.finalize(self, self._io.close)
        self._closer.atexit = False  # at exit the OS closes them; a reader may still be in a read
        self._changed: str | None = None  # how the open file changed, once it did
        self._name_noted = False
        if version is not None and version != self.version:
            try:
                self._verify(version)
            except BaseException:
                self.close()
                raise

    @property
    def direct(self) -> bool:
        """Whether reads pass the page cache by (O_DIRECT)."""
        return self._io.direct

    def check(self, version: tuple[int, ...] | None = None) -> None:
        """Raise ModelFileChanged unless the open file still has the bytes it had when opened (and,
        given ``version``, those it had at that version): a version whose change time alone moved
        counts where the ranges read so far read back the same. A name deleted or renamed over
        changes nothing here (one log line says so)."""
        self._verify(self.version if version is None else version)
        if not self._name_noted:
            self._note_name()

    def read(self, plan: UnitRead, dst: torch.Tensor, runs: Sequence[Run] | None = None) -> int:
        """Read ``runs`` (default: all of the plan's) into ``dst`` (page-aligned host memory of
        at least the plan's buffer bytes) at their places; returns the bytes read. A file that
        ends before a run's tensors raises ModelFileChanged, and so does one whose version moved
        by the end of the read (no byte written during a read reaches compute: one fstat, some
        microseconds a unit)."""
        total = 0
        for run in plan.runs if runs is None else runs:
            view = memview(dst[run.at : run.at + run.length])
            got = self._read(view, run.start, dst.data_ptr() + run.at)
            if got < run.needed:
                self._fail(f"ends at byte {run.start + got}, before the tensors at bytes {run.start} to "
                           f"{run.start + run.needed}: it was truncated or replaced")
            self._witness(view[: run.needed], run.start)
            total += got
        self._verify(self.version)
        return total

    def read_range(self, offset: int, dst: torch.Tensor) -> None:
        """Fill ``dst`` (flat uint8 host memory, any address) with the file's bytes from
        ``offset``, through the page cache, then check the version as ``read`` does."""
        got = self._read(memview(dst), offset, None)
        if got < dst.numel():
            self._fail(f"ends at byte {offset + got}, before the tensor at bytes {offset} to "
                       f"{offset + dst.numel()}: it was truncated or replaced")
        self._verify(self.version)

    def _verify(self, want: tuple[int, ...]) -> None:
        """The open file still has the bytes it had at ``want``, or ModelFileChanged (and the
        file is closed). A change of the inode's change time alone is confirmed by its bytes
        (file_identity.same_bytes)."""
        if self._changed is not None:
            raise ModelFileChanged(self.path, self._changed)
        try:
            fd = self._io.fd
            st = os.fstat(fd)
        except OSError as e:
            raise DiskReadError(f"{self.path} cannot be read: {e}") from e
        now = file_version(st)
        if now == want:
            return
        if content_may_differ(want, now) or same_bytes(self.path, want, fd=fd) != now:
            self._fail(_how_changed(want, st))
        self.version = now

    def _fail(self, how: str) -> None:
        """The open file is no longer the model's bytes: close it (nothing can be read from it
        any more) and raise ModelFileChanged, now and at every later read or check."""
        self._changed = how
        self.close()
        raise ModelFileChanged(self.path, how)

    def _note_name(self) -> None:
        """Say once that the name no longer leads to the open file (deleted, or another file
        renamed over it): the model reads on from the open one until it is unloaded."""
        try:
            now = file_version(os.stat(self.path))
        except FileNotFoundError:
            now = None
        except OSError:
            return
        if now is not None and now[:2] == self.version[:2]:
            return
        self._name_noted = True
        log.info("[tiered offload] disk stream: %s %s; the loaded model reads on from the file it was loaded from, "
                 "whose disk space is given back when the model is unloaded", self.path,
                 "was deleted" if now is None else "now names another file")

    def _witness(self, data: memoryview, offset: int) -> None:
        """Digest a range at its first read (file_identity.note_read): what a later change of the
        file's metadata alone is checked against."""
        if not self._io.closed:
            note_read(self._io.fd, self.version, offset, data)

    def _read(self, view: memoryview, offset: int, address: int | None) -> int:
        if self._changed is not None:
            raise ModelFileChanged(self.path, self._changed)
        try:
            return self._io.read([view], offset, aligned=address is not None and address % PAGE == 0)
        except DiskReadError:
            raise
        except OSError as e:
            raise DiskReadError(f"reading {size_text(len(view))} from {self.path} failed: {e}") from e

    def drop_cached_pages(self) -> None:
        """Ask the OS to forget the file's cached pages (a benchmark's cold state)."""
        if not self._io.closed and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._io.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    @property
    def closed(self) -> bool:
        return self._io.closed

    def close(self) -> None:
        """Close the descriptors now, once (else they close when nothing refers to the file)."""
        self._closer()
