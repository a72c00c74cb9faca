"""Where each disk-streamed unit's bytes come from: the model's own file, or the engine's spill file.

A unit is read in place from the model's file (in_place.py) when the caller names the file and
where each of the unit's tensors is in it (``ModelFileMap``, from the file's header), and each
tensor is plain and contiguous with the file's byte count. The loaded tensors are the file's
bytes only if nothing changed them on the way (a cast, a conversion) and the file did not change
since it was loaded, and neither can be known from metadata, so the unit is ``checking`` until
its first read: the bytes read from the file are compared with the loaded tensors, which are kept
until then. Equal, the unit is ``file`` and its tensors are released for good (host/released.py:
between runs the module's objects show empty placeholders that say where their bytes are); not
equal, it is written to the spill file from the loaded tensors then and there (``spill``). A
unit the file cannot serve is written to the spill file at placement, as before; only those units
cost disk space and writes.

The file's identity is checked after every pass (the host cache's first unit) and at the end of
every run (``check``); a unit read from a file that changed fails the run, naming the file.

Between runs nothing of a ``file`` unit is in RAM. Whoever runs the model without the engine
first asks for its tensors back (``read_back``): they are read from the file into fresh memory,
the file's identity checked before and after; the next attach lets go of them again
(``drop_loaded``).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..files.file_identity import version_unreliable
from ..host.layout import empty_at_phase
from ..host.packing import PackedBlock
from ..host.pinned import HostStorage, return_freed_ram
from ..host.released import Released, note, note_of, released
from ..host.tensor_refs import tensor_refs
from ..units import size_text
from .in_place import FileSlice, ModelFile, ModelFileChanged, ModelFileMap, Piece, Run, UnitRead, plan_read
from ..alignment import PAGE, align_up
from ..files.raw_io import raw_bytes
from .store import SPILL_ALIGN, DiskStore

log = logging.getLogger(__name__)

FILE, CHECKING, SPILL = "file", "checking", "spill"


@dataclass(eq=False)
class _Unit:
    kind: str
    read: UnitRead | None = None
    file: ModelFile | None = None
    slices: dict[int, FileSlice] = field(default_factory=dict)  # entry -> its bytes in the file
    loaded: bool = False  # FILE: read back into RAM for a run without the engine

def _objects(pack: PackedBlock) -> dict[int, torch.Tensor]:
    """Entry index -> the tensor object whose data the entry is (plain tensors only)."""
    return {b.entry: b.obj for b in pack.binding.bindings if b.entry is not None}


def _empty(e) -> torch.Tensor:
    """The placeholder a released entry's object shows."""
    with torch.inference_mode(e.inference):
        return torch.empty(0, dtype=e.dtype, device=e.device)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor object over ``t``'s memory: a loaded tensor being checked must outlive its
    object's emptying, and some subclasses' ``detach`` returns the object itself (GGUF's)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat uint8 tensors hold the same bytes, compared in the widest words both
    allow (eight times faster than byte by byte on a 64 MiB unit)."""
    if a.numel() != b.numel():
        return False
    for width, dtype in _WIDE:
        if a.numel() % width == 0 and a.data_ptr() % width == 0 and b.data_ptr() % width == 0:
            return torch.equal(a.view(dtype), b.view(dtype))
    return torch.equal(a, b)


def _same(pack: PackedBlock, pieces: Sequence[Piece], buf: torch.Tensor) -> bool:
    """Whether the bytes read into ``buf`` equal the pack's loaded tensors at ``pieces``."""
    for p in pieces:
        if not p.nbytes:
            continue
        e = next(x for x in pack.entries if x.offset <= p.dst < x.offset + x.nbytes)
        start = p.dst - e.offset
        if not _equal_bytes(buf[p.src : p.src + p.nbytes], raw_bytes(e.original)[start : start + p.nbytes]):
            return False
    return True


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expect = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


def _release(pack: PackedBlock, u: _Unit) -> None:
    """The unit's tensors are the file's bytes: let go of the loaded copies for good."""
    objs = _objects(pack)
    for k, e in enumerate(pack.entries):
        found = Released(e.dtype, e.shape, e.stride, e.device, e.phase, e.inference, u.slices[k])
        note(objs[k], found)
        e.original = found.empty()
    u.kind = FILE


def _unreliable(path: str, checked: dict[str, str | None]) -> str | None:
    """Why ``path`` is not read in place where it lies (file_identity.version_unreliable), said
    once per file (``checked`` remembers); None where it is."""
    if path not in checked:
        checked[path] = version_unreliable(path)
        if checked[path] is not None:
            log.info("[tiered offload] disk stream: %s is not read in place: %s; its units go to the spill file",
                     path, checked[path])
    return None if checked[path] is None else "a model file whose changes cannot be seen where it lies"


class DiskSources:
    """The disk homes of one streamer's packs: ``place`` decides each one's (see the module
    docstring), ``read_unit`` / ``read_chunks`` read them, ``check`` watches the model's file,
    ``read_back`` hands released tensors their bytes again, ``close`` lets go of every file."""

    def __init__(self, spill_dir: str, file_map: ModelFileMap | None) -> None:
        self.spill = DiskStore(spill_dir)
        self._map = file_map
        self._files: dict[tuple[int, int], ModelFile] = {}  # (device, inode) -> the open file
        self._units: dict[int, _Unit] = {}
        self._packs: dict[int, PackedBlock] = {}
        self._why: Counter[str] = Counter()  # why units went to the spill file
        self._checked: dict[str, str | None] = {}  # model file -> why its version proves nothing there
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- placing
    def plan(self, packs: Sequence[PackedBlock]) -> None:
        """Choose each pack's home from metadata, opening the model's file (nothing is written)."""
        for i, p in enumerate(packs):
            if p.entries:
                self._packs[i] = p
                self._units[i] = self._choose(p)

    def _choose(self, pack: PackedBlock) -> _Unit:
        objs = _objects(pack)
        why = None
        if any(u.spec is not None for u in pack.layout.units):
            why = "quantized tensors the loader converted"
        slices: dict[int, FileSlice] = {}
        for k, e in enumerate(pack.entries):
            if why is not None:
                break
            noted = note_of(objs.get(k))
            if noted is not None and isinstance(noted.source, FileSlice):
                slices[k] = noted.source
                continue
            found = self._map.tensors.get(e.owner) if self._map is not None else None
            if self._map is None:
                why = "no model file is known"
            elif found is None:
                why = "tensors the model file does not hold"
            elif (found[1] != e.nbytes or found[2] not in (None, e.dtype) or e.device.type != "cpu"
                  or not _contiguous(e.shape, e.stride)):
                why = "tensors loaded in another dtype or layout than the file's"
            else:
                slices[k] = FileSlice(self._map.path, (), found[0], found[1])
        paths = {s.path for s in slices.values()}
        if why is None and len(paths) > 1:
            why = "tensors from more than one file"
        if why is None and paths:
            why = _unreliable(next(iter(paths)), self._checked)
        if why is not None:
            self._why[why] += 1
            self._read_back_entries(pack, objs)
            return _Unit(SPILL)
        empty = [released(objs.get(k)) is not None for k in range(len(pack.entries))]
        path = paths.pop()
        was = next((s for k, s in slices.items() if empty[k]), None)  # released by an earlier engine
        try:
            file = self._open(path, was)
        except ModelFileChanged:
            raise
        except OSError as e:  # the loaded tensors are all there: they go to the spill file
            log.warning("[tiered offload] disk stream: %s cannot be read (%s); its units go to the spill file", path, e)
            self._why["a model file that cannot be read"] += 1
            return _Unit(SPILL)
        slices = {k: FileSlice(s.path, s.version or file.version, s.offset, s.nbytes, file)
                  for k, s in slices.items()}
        if all(empty):
            stale = next((s for s in slices.values() if s.version != file.version), None)
            if stale is not None:
                file.check(stale.version)
            kind = FILE
        else:
            if any(empty):  # a mix: the released ones get their bytes back, then all are checked
                self._read_back_entries(pack, objs)
                pack.restore(keep_host=False)
            for e in pack.entries:  # kept apart from the objects, which the run empties
                e.original = _alias(e.original)
            kind = CHECKING
        read = plan_read([(s.offset, s.nbytes, pack.entries[k].offset) for k, s in slices.items()])
        return _Unit(kind, read, file, slices)

    def _open(self, path: str, was: FileSlice | None) -> ModelFile:
        """The open file a unit reads: that of the tensors an earlier engine released (``was``),
        which may no longer be the one ``path`` names, else the one ``path`` names now."""
        file = was.opened if was is not None else None
        if file is not None:
            file.check(was.version)
        else:
            file = next((f for f in self._files.values() if f.path == path and not f.closed), None)
            if file is None:
                file = ModelFile(path, was.version if was is not None else None)
            elif was is not None:
                file.check(was.version)
        self._files.setdefault(file.version[:2], file)
        return file

    def place(self, progress: Callable[[int, int], None] | None, total: int) -> int:
        """Write the packs the model's file cannot serve to the spill file and bind maps of them
        (also when a write or the progress callback raises); returns how many packs were placed."""
        spilled = {i: p for i, p in self._packs.items() if self._units[i].kind == SPILL}
        largest = align_up(max((p.nbytes for p in spilled.values()), default=0), PAGE)
        self.spill.planned_bytes = sum(align_up(p.nbytes, SPILL_ALIGN) for p in spilled.values())
        scratch = HostStorage([largest], pin=False, ram_budget_bytes=0)
        written: dict[int, PackedBlock] = {}
        try:
            buf = scratch.buffer(0) if spilled else None
            for i in range(total):
                if i in spilled:
                    self.spill.write(i, spilled[i], buf)
                    written[i] = spilled[i]
                if progress is not None:
                    progress(i + 1, total)
        finally:
            try:
                self.spill.bind(written)
            finally:
                scratch.release()
        self._log()
        return len(self._packs)

    def _log(self) -> None:
        by_kind = {kind: [i for i, u in self._units.items() if u.kind == kind] for kind in (FILE, CHECKING, SPILL)}
        in_place = by_kind[FILE] + by_kind[CHECKING]
        if in_place:
            nbytes = sum(self._packs[i].nbytes for i in in_place)
            files = ", ".join(sorted({f.path for f in self._files.values()}))
            log.info("[tiered offload] disk stream: %d of %d units (%s) are read in place from %s, no copy written%s",
                     len(in_place), len(self._units), size_text(nbytes), files,
                     f"; {len(by_kind[CHECKING])} are checked against the loaded weights at their first read"
                     if by_kind[CHECKING] else "")
        if by_kind[SPILL]:
            why = "; ".join(f"{n} for {reason}" for reason, n in sorted(self._why.items()))
            log.info("[tiered offload] disk stream: %d units (%s) are written to a spill file (%s), %s in all",
                     len(by_kind[SPILL]), size_text(sum(self._packs[i].nbytes for i in by_kind[SPILL])), why,
                     size_text(self.spill.spill_bytes))
        else:
            log.info("[tiered offload] disk stream: no spill file: nothing written to disk")

    # ---------------------------------------------------------------- reading
    def buffer_bytes(self, i: int) -> int:
        """Host bytes a read of unit ``i`` needs."""
        u, padded = self._units[i], align_up(self._packs[i].nbytes, PAGE)
        if u.kind == SPILL:
            return padded
        return u.read.buffer_bytes if u.kind == FILE else max(u.read.buffer_bytes, padded)

    def read_unit(self, i: int, dst: torch.Tensor) -> tuple[int, tuple[Piece, ...] | None]:
        """Read unit ``i`` into ``dst``: (bytes read, where its tensors are in ``dst``; None for
        the packed layout). A unit being checked is compared with its loaded tensors here."""
        u = self._units[i]
        if u.kind == SPILL:
            return self.spill.read(i, dst), None
        n = u.file.read(u.read, dst)
        if u.kind == CHECKING and not self._settle(i, _same(self._packs[i], u.read.pieces, dst)):
            return self.spill.read(i, dst), None
        return n, u.read.pieces

    def read_chunks(self, i: int, buf: torch.Tensor) -> Iterator[list[Piece]]:
        """Unit ``i`` in pieces that fit ``buf``, read into it one chunk at a time: each list says
        where the chunk's bytes go in the packed layout (copy them out before the next chunk)."""
        u, pack = self._units[i], self._packs[i]
        if u.kind != SPILL:
            same = True
            for run, pieces in self._chunks(u, buf.numel()):
                u.file.read(u.read, buf, [run])
                if u.kind == CHECKING:
                    same = same and _same(pack, pieces, buf)
                yield pieces
            if u.kind != CHECKING or self._settle(i, same):
                return
        for start in range(0, pack.nbytes, buf.numel()):
            n = self.spill.read(i, buf, start, buf.numel())
            yield [Piece(0, start, n)]

    def _chunks(self, u: _Unit, size: int) -> Iterator[tuple[Run, list[Piece]]]:
        """The unit's runs cut into reads of at most ``size`` bytes, each with the parts of the
        pieces it holds (their ``src`` counted from the read's start)."""
        step = max(PAGE, size // PAGE * PAGE)
        for run in u.read.runs:
            for cut in range(0, run.length, step):
                length = min(step, run.length - cut)
                lo, hi = run.at + cut, run.at + cut + length
                parts = []
                for p in u.read.pieces:
                    a, b = max(lo, p.src), min(hi, p.src + p.nbytes)
                    if a < b:
                        parts.append(Piece(a - lo, p.dst + a - p.src, b - a))
                yield Run(run.start + cut, length, 0, min(length, max(0, run.needed - cut))), parts

    def _settle(self, i: int, same: bool) -> bool:
        """After a checking unit's read: release its tensors if every byte read equals the loaded
        ones (True), else write it to the spill file from them (False)."""
        with self._lock:
            u = self._units[i]
            if u.kind != CHECKING:
                return u.kind == FILE
            if same:
                _release(self._packs[i], u)
            else:
                log.warning("[tiered offload] disk stream: unit %d's bytes in %s differ from the loaded weights; it is "
                            "written to the spill file instead", i, u.file.path)
                self._why["bytes that differ from the model file's"] += 1
                self.spill.write_late(i, self._packs[i])
                self._units[i] = _Unit(SPILL)
            settled = all(x.kind != CHECKING for x in self._units.values())
        if settled:  # the loaded copies just let go may sit in the C heap: hand them to the OS
            return_freed_ram()
        return same

    def check(self) -> None:
        """Raise ModelFileChanged if a model file read from changed since it was opened."""
        for file in list(self._files.values()):
            file.check()

    # ---------------------------------------------------------------- giving back
    def read_back(self) -> int:
        """Read every released unit back into fresh memory and hand its tensors over (the model
        runs without the engine next); returns how many units."""
        count = 0
        for i, u in self._units.items():
            with self._lock:
                if u.kind != FILE or u.loaded:
                    continue
                pack = self._packs[i]
                storage = HostStorage([u.read.buffer_bytes], pin=False, ram_budget_bytes=0)
                try:
                    buf = storage.buffer(0)
                    u.file.check()
                    u.file.read(u.read, buf)
                    u.file.check()
                    at = {e.offset: e for e in pack.entries}
                    for p in u.read.pieces:
                        e = at[p.dst]
                        e.original = e.fresh_copy(
                            buf[p.src : p.src + p.nbytes].view(e.dtype).as_strided(e.shape, e.stride))
                finally:
                    storage.release()
                pack.restore(keep_host=False)
                u.loaded = True
                count += 1
        return count

    def drop_loaded(self) -> None:
        """At an attach, before anything binds the blocks: the copies ``read_back`` made are let go
        (their objects show the placeholders again) and handed back to the OS."""
        dropped = False
        with self._lock:
            for i, u in self._units.items():
                if u.kind == FILE and u.loaded:
                    for e in self._packs[i].entries:
                        e.original = _empty(e)
                    self._packs[i].restore(keep_host=False)
                    u.loaded, dropped = False, True
        if dropped:
            return_freed_ram()

    @staticmethod
    def _read_back_entries(pack: PackedBlock, objs: dict[int, torch.Tensor]) -> None:
        read_back_pack(pack, objs)

    # ---------------------------------------------------------------- figures
    def kinds(self) -> dict[int, str]:
        """Pack index -> FILE, CHECKING or SPILL."""
        return {i: u.kind for i, u in self._units.items()}

    def figures(self) -> dict:
        in_place = [i for i, u in self._units.items() if u.kind != SPILL]
        return {
            "model_files": sorted({f.path for f in self._files.values()}),
            "direct": all(f.direct for f in self._files.values()) if self._files else None,
            "file_units": len(in_place),
            "file_bytes": sum(self._packs[i].nbytes for i in in_place),
            "checking_units": sum(u.kind == CHECKING for u in self._units.values()),
            "spill_units": len(self._units) - len(in_place),
            "spill_bytes": self.spill.spill_bytes,
            "spill_written_bytes": self.spill.written_bytes,
            "spill_reasons": dict(self._why),
        }

    def drop_cached_pages(self) -> None:
        """Ask the OS to forget the files' cached pages (a benchmark's cold state)."""
        self.spill.drop_cached_pages()
        for file in self._files.values():
            file.drop_cached_pages()

    def close(self) -> None:
        """Close the spill file and let go of the model files, once. Call it once no read runs
        (the cache closed): a unit released by a read that ended after the last hand-back gives
        its objects the empty placeholders now, so no loaded copy outlives the engine. A model file
        stays open while notes of released tensors refer to it (they are read from it later)."""
        for i, u in self._units.items():
            if u.kind == FILE:
                self._packs[i].restore(keep_host=False, skip_reassigned=True)
        self._files = {}
        self.spill.close()


def read_released(found: Released) -> torch.Tensor:
    """A released tensor's values, read from its file into fresh memory (its strides, address
    phase and inference-ness); ModelFileChanged if the file is no longer the version noted."""
    source = found.source
    if not isinstance(source, FileSlice):
        raise RuntimeError("a released tensor without a file to read it from")
    file = source.opened if source.opened is not None else ModelFile(source.path, source.version)
    file.check(source.version)
    with torch.inference_mode(found.inference):
        flat = empty_at_phase(source.nbytes, found.phase)
    file.read_range(source.offset, flat)
    with torch.inference_mode(found.inference):
        return flat.view(found.dtype).as_strided(found.shape, found.stride)


def read_back_pack(pack: PackedBlock, objs: dict[int, torch.Tensor] | None = None) -> int:
    """Give the released tensors of ``pack`` their values back as its originals, read from the
    model's file into fresh memory (a pack about to be spilled, checked or packed into RAM needs
    them); the module's objects get them at the pack's next hand-back. Returns how many."""
    objs = _objects(pack) if objs is None else objs
    count = 0
    for k, e in enumerate(pack.entries):
        found = released(objs.get(k))
        if found is not None:
            e.original = read_released(found)
            count += 1
    return count


def read_back_tensor(t: torch.Tensor) -> bool:
    """Give a released tensor its bytes back from the model's file, in fresh memory; True if it
    was released. Its note stays (an engine built later knows where the bytes came from, and
    checks them at their first read) but lets go of the open file: a model that runs from RAM
    holds no file open, so a model file deleted since gives its space back."""
    found = released(t)
    if found is None:
        return False
    t.data = read_released(found)
    found.source = replace(found.source, opened=None)
    return True


def read_back_module(module: torch.nn.Module) -> int:
    """Give every released tensor of ``module`` its bytes back (``read_back_tensor``: the model
    runs without an engine next); returns how many."""
    return sum(read_back_tensor(t) for _, t in tensor_refs(module))
