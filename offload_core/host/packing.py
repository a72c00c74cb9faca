"""Pack one block's parameters and buffers into one contiguous byte buffer.

Why: one flat copy per block is what reaches link peak; per-tensor copies pay a
launch and driver cost each.  The layout (dtype groups, 256-byte aligned offsets,
original strides for dense tensors) is planned once from metadata, so the same
typed views can be laid over the host master or over any device slot.

The host pack is the master copy and always holds the untransformed values.
Module tensors keep their original objects (``nn.Parameter`` / buffer) for life;
only their ``.data`` is re-pointed (a wrapper subclass's contents are swapped,
see ``subclass``), so anything holding a reference to a parameter keeps holding
the right object.  A dense tensor gives up its original
storage and is re-pointed at the pack (zero-copy), so a packed model costs 1x
RAM, not 2x; only non-dense tensors (expanded views) keep their original, which
bytes cannot describe.  A transform (e.g. a LoRA merge) is applied to a device
copy of the pack, never to the pack: host RAM does not grow with it, and
``restore`` always puts the untransformed weights back.

Where a tensor starts matters on the CPU too: a CPU kernel's summation order can depend on its
operand's address (the one-row GEMV of a time embedding peels to a 16-byte boundary), and a
checkpoint read from a memory map leaves weights at whatever address modulo 16 the file's
header length gives them.  So a fresh copy of a tensor (``restore``) keeps the original's address
modulo ``PHASE``, and a pack whose module computes straight from the host master
(``keep_address_phase``: the whole-module master on a CPU-only machine) lays its tensors out the
same way; packs for device slots stay aligned, as the device copies core makes are.

Tensors created under ``torch.inference_mode`` (as ComfyUI loads models) are
inference tensors; every tensor bound to such an object is made an inference
tensor too, and every other one a normal tensor, so either kind keeps working
in and out of inference mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .subclass import (
    PLAIN_TYPES,
    WrapperSpec,
    check_storage_subclass,
    class_name,
    flatten,
    held_tensors,
    is_storage_subclass,
    is_wrapper,
    swap,
)

log = logging.getLogger(__name__)

ALIGN = 256
PHASE = 64  # a tensor's address modulo this is kept where the pack keeps address phases (>= any SIMD width)
Transform = Callable[[int, str, torch.Tensor], torch.Tensor]
_placeholders: dict[tuple[torch.dtype, bool], torch.Tensor] = {}


@dataclass(frozen=True, eq=False)
class TensorRef:
    """One place that holds a tensor: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module: nn.Module
    kind: str  # "param" or "buffer"
    attr: str
    block: int  # block the path is relative to; -1 when there is none
    path: str  # dotted name inside that block

    @property
    def table(self) -> dict:
        return self.module._parameters if self.kind == "param" else self.module._buffers

    @property
    def label(self) -> str:
        return f"block {self.block}: {self.path}" if self.block >= 0 else self.path


def tensor_refs(module: nn.Module, block: int = -1) -> list[tuple[TensorRef, torch.Tensor]]:
    """Every parameter and buffer slot under ``module``, each slot once."""
    out: list[tuple[TensorRef, torch.Tensor]] = []
    seen: set[tuple[int, str, str]] = set()
    for mpath, m in module.named_modules(remove_duplicate=False):
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for attr, t in table.items():
                if t is None or (id(m), kind, attr) in seen:
                    continue
                seen.add((id(m), kind, attr))
                path = f"{mpath}.{attr}" if mpath else attr
                out.append((TensorRef(m, kind, attr, block, path), t))
    return out


def tables_under(module: nn.Module) -> frozenset[int]:
    """The ids of the tables (``_parameters``, ``_buffers``) of ``module`` and every module under
    it: what ``module.to()`` moves. ``PackedBlock.reclaim`` takes back only the slots in them."""
    return frozenset(id(table) for m in module.modules() for table in (m._parameters, m._buffers))


def _check_plain(t: torch.Tensor, label: str) -> None:
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"cannot pack {label!r}: layout {t.layout} is not strided (sparse or nested)")
    if t.is_quantized:
        raise TypeError(f"cannot pack {label!r}: quantized tensors carry scales outside their bytes")
    if t.device.type == "meta":
        raise ValueError(f"cannot pack {label!r}: it is a meta tensor and has no data")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"cannot pack {label!r}: it has a lazy conj/neg bit; resolve it first")


def _describe(t: torch.Tensor, label: str) -> tuple[WrapperSpec | None, tuple[str, ...], tuple[torch.Tensor, ...]]:
    """How ``t`` packs: (None, ("",), (t,)) for a tensor whose bytes are its values, or a wrapper's
    spec with its inner tensors; raises for anything that does not round-trip."""
    if is_wrapper(t):
        spec, flat = WrapperSpec.of(t, label)
        for name, inner in zip(flat.names, flat.inner):
            _check_plain(inner, f"{label}[{name}]")
        return spec, flat.names, flat.inner
    if type(t) not in PLAIN_TYPES:
        if not is_storage_subclass(t):
            raise TypeError(
                f"cannot pack {label!r}: tensor subclass {class_name(t)} is not supported: it neither keeps "
                "its values in its own storage nor names its inner tensors with __tensor_flatten__"
            )
        check_storage_subclass(t, label)
    _check_plain(t, label)
    return None, ("",), (t,)


def check_packable(t: torch.Tensor, label: str) -> None:
    """Refuse anything whose values would not round-trip faithfully through a flat buffer."""
    _describe(t, label)


def alias_key(t: torch.Tensor) -> tuple:
    """Identity of the memory a tensor shows: equal keys mean the same values, always."""
    if is_wrapper(t):
        return ("wrapped", type(t), *(alias_key(x) for x in flatten(t).inner))
    if t.numel() == 0:
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.size()), t.stride())


def _is_dense(t: torch.Tensor) -> bool:
    """True when the tensor covers exactly numel elements without gaps or overlaps (any order)."""
    if t.is_contiguous():
        return True
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    # size(), not shape: a storage subclass may report another shape (GGUF's logical one)
    return a is b or (
        a.device == b.device
        and a.dtype == b.dtype
        and a.size() == b.size()
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _placeholder(dtype: torch.dtype, inference: bool) -> torch.Tensor:
    """Empty stand-in for released tensors, so a stale reference cannot read another block's bytes."""
    t = _placeholders.get((dtype, inference))
    if t is None:
        with torch.inference_mode(inference):
            t = _placeholders[(dtype, inference)] = torch.empty(0, dtype=dtype)
    return t


def _typed(buf: torch.Tensor, e: PackedTensor) -> torch.Tensor:
    return buf[e.offset : e.offset + e.nbytes].view(e.dtype).as_strided(e.shape, e.stride)


_SMALL_COPY = 4096  # bytes: an inner tensor this small may be an equal copy and still count as ours


@dataclass(eq=False)
class PackedTensor:
    """One unique tensor inside a pack: a plain or storage tensor, or one inner tensor of a wrapper."""

    label: str
    owner: tuple[int, str]  # (block index, path) of the tensor the module sees
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]  # packed strides: the original ones when dense
    device: torch.device  # original device
    dense: bool
    inference: bool  # the original is an inference tensor; everything bound in its place must be too
    phase: int  # the original's address modulo PHASE; fresh copies start there too
    original: torch.Tensor | None  # original kept outside the pack (non-dense only); None: the pack holds it


@dataclass(eq=False)
class _Unit:
    """One tensor as the modules see it: one entry, or a wrapper rebuilt over several."""

    label: str
    owner: tuple[int, str]
    entries: tuple[int, ...]
    spec: WrapperSpec | None  # None: the entry's bytes are the tensor's values
    held: bool = False  # every entry is dense: the pack stands in for the original
    ctx: Any = None  # wrapped: the context a transform gave the device copies (None: the spec's)


@dataclass(eq=False)
class _Binding:
    obj: torch.Tensor  # the original Parameter / buffer object, kept for life
    slots: list[tuple[dict, str]]  # module tables that hold it
    unit: int
    ptrs: tuple[int, ...]  # data pointers it showed when we last handed it back (staleness check)
    parked: torch.Tensor | None = None  # wrapped: holds obj's own contents while obj shows a buffer's


@dataclass(eq=False)
class BlockViews:
    """A block laid over one buffer: a typed view per entry and a rebuilt wrapper per wrapped binding."""

    tensors: list[torch.Tensor]
    wrappers: dict[int, torch.Tensor]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]

    def __len__(self) -> int:
        return len(self.tensors)


class PackedBlock:
    """Layout, packing and (re)binding of one block's tensors."""

    def __init__(self, items: Iterable[tuple[TensorRef, torch.Tensor]], index: int = 0, *,
                 keep_address_phase: bool = False) -> None:
        """``keep_address_phase``: place each tensor at its original address modulo ``PHASE`` in a
        buffer that starts on an ``ALIGN`` boundary (at most ``PHASE`` - 1 bytes of padding each)."""
        described = [(ref, t, _describe(t, ref.label)) for ref, t in items]
        self.index = index
        self.host: torch.Tensor | None = None
        self._keep_phase = keep_address_phase

        firsts: list[tuple[str, tuple[int, str], torch.Tensor]] = []
        entry_of: dict[tuple, int] = {}
        unit_of: dict[tuple, int] = {}
        units: list[_Unit] = []
        binding_of: dict[int, _Binding] = {}
        seen_slots: set[tuple[int, str, str]] = set()
        for ref, t, (spec, names, inner) in described:
            slot = (id(ref.module), ref.kind, ref.attr)
            if slot in seen_slots:
                continue
            seen_slots.add(slot)
            key = alias_key(t)
            if key not in unit_of:
                idx = []
                for name, x in zip(names, inner):
                    k = alias_key(x)
                    if k not in entry_of:
                        entry_of[k] = len(firsts)
                        firsts.append((f"{ref.label}[{name}]" if name else ref.label, (ref.block, ref.path), x))
                    idx.append(entry_of[k])
                unit_of[key] = len(units)
                units.append(_Unit(ref.label, (ref.block, ref.path), tuple(idx), spec))
            b = binding_of.get(id(t))
            if b is None:
                b = binding_of[id(t)] = _Binding(t, [], unit_of[key], ())
            b.slots.append((ref.table, ref.attr))

        rank: dict[torch.dtype, int] = {}
        for _, _, t in firsts:
            rank.setdefault(t.dtype, len(rank))
        order = sorted(range(len(firsts)), key=lambda i: (rank[firsts[i][2].dtype], i))
        new_pos = {old: new for new, old in enumerate(order)}

        self.entries: list[PackedTensor] = []
        offset = 0
        for old in order:
            label, owner, t = firsts[old]
            dense = _is_dense(t)
            phase = t.data_ptr() % PHASE
            phase -= phase % t.element_size()  # a typed view must start on its element size
            offset = _align_up(offset, ALIGN) + (phase if keep_address_phase else 0)
            nbytes = t.numel() * t.element_size()
            self.entries.append(
                PackedTensor(
                    label=label,
                    owner=owner,
                    offset=offset,
                    nbytes=nbytes,
                    dtype=t.dtype,
                    shape=t.size(),
                    stride=t.stride() if dense else _contiguous_strides(t.size()),
                    device=t.device,
                    dense=dense,
                    inference=t.is_inference(),
                    phase=phase,
                    original=t.detach(),
                )
            )
            offset += nbytes
        self.nbytes = _align_up(offset, ALIGN)
        for u in units:
            u.entries = tuple(new_pos[i] for i in u.entries)
            u.held = all(self.entries[i].dense for i in u.entries)
        self._units = units
        self._bindings = list(binding_of.values())
        for b in self._bindings:
            b.ptrs = self._ptrs(b.obj, units[b.unit])

    @property
    def num_bindings(self) -> int:
        """Module slots the block's tensors sit in."""
        return sum(len(b.slots) for b in self._bindings)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the packed tensors without alignment padding (a wrapper's inner tensors)."""
        return sum(e.nbytes for e in self.entries)

    def views(self, buf: torch.Tensor, transformed: bool = False) -> BlockViews:
        """The block laid over ``buf`` (host pack or device slot), ready to bind.

        ``transformed``: ``buf`` is a device copy the current transform rewrote, so wrappers it
        changed are rebuilt with the context the transform gave them.
        """
        self._check_buffer(buf)
        tensors = []
        for e in self.entries:
            with torch.inference_mode(e.inference):
                tensors.append(_typed(buf, e))
        wrappers = {}
        for k, b in enumerate(self._bindings):
            u = self._units[b.unit]
            if u.spec is not None:
                wrappers[k] = u.spec.rebuild([tensors[i] for i in u.entries], u.ctx if transformed else None)
        return BlockViews(tensors, wrappers)

    def _check_buffer(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(
                f"block {self.index}: need a 1-D uint8 buffer of >= {self.nbytes} bytes, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )

    def _ptrs(self, obj: torch.Tensor, u: _Unit) -> tuple[int, ...]:
        if u.spec is None:
            return (obj.data_ptr(),)
        flat = u.spec.matches(obj)
        return tuple(x.data_ptr() for x in flat.inner) if flat is not None else ()

    def _shows(self, t: object, u: _Unit, views: BlockViews) -> bool:
        """Whether ``t`` shows the memory of ``views`` for this unit (a wrapper: or small equal
        copies of some inner tensors, see ``_equal_small_copy``)."""
        if u.spec is None:
            return isinstance(t, torch.Tensor) and _same_view(t, views.tensors[u.entries[0]])
        flat = u.spec.matches(t)
        return flat is not None and all(
            _same_view(x, views.tensors[i]) or self._equal_small_copy(x, self.entries[i])
            for x, i in zip(flat.inner, u.entries)
        )

    def _rest(self, b: _Binding) -> None:
        """A wrapped object shows its own contents again (undoes ``_show``)."""
        if b.parked is not None:
            swap(b.obj, b.parked, self._units[b.unit].label)
            b.parked = None

    def _show(self, b: _Binding, wrapper: torch.Tensor) -> None:
        """A wrapped object shows ``wrapper``'s contents until ``_rest``; ``wrapper`` keeps its own."""
        self._rest(b)
        swap(b.obj, wrapper, self._units[b.unit].label)
        b.parked = wrapper

    def _point(self, b: _Binding, k: int, views: BlockViews) -> None:
        """The object shows ``views`` for good (its previous contents are let go)."""
        u = self._units[b.unit]
        if u.spec is None:
            b.obj.data = views.tensors[u.entries[0]]
        else:
            self._rest(b)
            swap(b.obj, views.wrappers[k], u.label)

    def pack(self, host: torch.Tensor) -> None:
        """Write the original values into ``host`` and let the pack stand in for every dense original."""
        if host.device.type != "cpu":
            raise ValueError(f"block {self.index}: the host pack must live on the CPU, got {host.device}")
        self._check_buffer(host)
        if self._keep_phase and host.data_ptr() % PHASE:
            raise ValueError(f"block {self.index}: a host pack that keeps address phases must start on a "
                             f"{PHASE}-byte boundary")
        with torch.no_grad(), torch.inference_mode(False):
            regions = [_typed(host, e) for e in self.entries]  # writable views
            for e, region in zip(self.entries, regions):
                region.copy_(e.original)
            for e in self.entries:  # written in full: only now may originals go
                if e.dense:
                    e.original = None
            bindable = self.views(host)
            for k, b in enumerate(self._bindings):
                u = self._units[b.unit]
                if u.held:
                    self._point(b, k, bindable)
                    b.ptrs = self._ptrs(b.obj, u)
        self.host = host

    def apply_transform(self, buf: torch.Tensor, transform: Transform) -> int:
        """Rewrite the block's values in ``buf`` (a device copy of the pack) through ``transform``.

        ``transform(block_index, name, tensor)`` gets one tensor as the module sees it, over
        ``buf``: a typed view, or for a wrapper subclass a wrapper rebuilt over the views of its
        inner tensors.  It returns a tensor of the same shape and dtype (a wrapper of the same
        class whose inner tensors have the stored shapes and dtypes), which is written into
        ``buf``; returning its argument leaves it as it is.  A wrapper's new context (its
        non-tensor metadata) is kept for the views of this block's device copies.  The pack is
        never touched, so the result is the same on every fresh copy.  While it runs, the block's
        modules are bound to ``buf``: a transform may call a layer's own methods, which read the
        layer's other tensors (a scaled-fp8 layer's scale), and they must see this copy.  The
        bindings are put back as they were afterwards.  Returns how many tensors were rewritten.
        """
        views = self.views(buf)
        saved = [([table.get(attr) for table, attr in b.slots], b.parked, b.obj.data if b.parked is None and
                  self._units[b.unit].spec is None else None) for b in self._bindings]
        try:
            self.bind(views)
            return self._transform_units(buf, transform)
        finally:
            for b, (currents, parked, data) in zip(self._bindings, saved):
                if self._units[b.unit].spec is None:
                    b.obj.data = data
                else:
                    self._rest(b)
                    if parked is not None:
                        self._show(b, parked)
                for (table, attr), current in zip(b.slots, currents):
                    table[attr] = current

    def _transform_units(self, buf: torch.Tensor, transform: Transform) -> int:
        count = 0
        with torch.no_grad(), torch.inference_mode(False):
            for u in self._units:
                entries = [self.entries[i] for i in u.entries]
                views = [_typed(buf, e) for e in entries]
                versions = [v._version for v in views]
                arg = views[0] if u.spec is None else u.spec.rebuild(views, inference=False)
                out = transform(u.owner[0], u.owner[1], arg)
                if any(v._version != ver for v, ver in zip(views, versions)):
                    raise ValueError(f"transform modified {u.label!r} in place; it must return a new tensor")
                if u.spec is None:
                    _check_transform_output(out, entries[0])
                    if not _same_view(out, views[0]):
                        views[0].copy_(out)
                        count += 1
                    continue
                if out is arg:
                    u.ctx = None
                    continue
                flat = _check_wrapped_output(out, u, entries)
                for view, inner in zip(views, flat.inner):
                    view.copy_(inner)
                u.ctx = flat.ctx
                count += 1
        return count

    def bind(self, views: BlockViews) -> None:
        """Point every parameter/buffer of the block at ``views`` (from ``self.views``)."""
        for k, b in enumerate(self._bindings):
            u = self._units[b.unit]
            if u.spec is None:
                b.obj.data = views.tensors[u.entries[0]]
            else:
                self._show(b, views.wrappers[k])
            for table, attr in b.slots:
                table[attr] = b.obj

    def conceal(self) -> None:
        """Unset the block's tensors in their modules, keeping the objects; reveal() sets them back."""
        for b in self._bindings:
            for table, attr in b.slots:
                table[attr] = None

    def reveal(self) -> None:
        for b in self._bindings:
            for table, attr in b.slots:
                table[attr] = b.obj

    def reclaim(self, tables: Collection[int] | None = None) -> int:
        """Point every slot that still shows the master's values back at the master, moving no bytes.

        The owner of the module may have moved our tensor objects elsewhere (to a device, or back
        to fresh host memory by a copy): an object of ours still holds the master's values, because
        owners move objects and put computed weights into new objects, so re-pointing is enough. An
        owner may also have put a new object over the master's own host memory: it gets our object
        back. A slot holding anything else (a weight the owner computed, such as a merged LoRA) is
        left alone. With ``tables`` (``tables_under``) only the tensors held there are taken back:
        an owner that moves one module leaves the others where it counts them. Returns how many
        tensors were not in the master.
        """
        return self._take_back(move_own=True, tables=tables)

    def adopt(self) -> int:
        """Give our object back to every slot where the owner put a new object over the master's
        own memory (a re-wrap: ``set_attr_param``, 0.33's quantized ``_apply``), while our object
        still shows the master. Nothing else changes, so a kept pack stays valid. Returns how many
        slots were given back."""
        return self._take_back(move_own=False)

    def _take_back(self, move_own: bool, tables: Collection[int] | None = None) -> int:
        if self.host is None:
            raise RuntimeError(f"block {self.index} is not packed")
        regions = self.views(self.host)
        count = 0
        for k, b in enumerate(self._bindings):
            u = self._units[b.unit]
            if not u.held or (tables is not None and not any(id(t) in tables for t, _ in b.slots)):
                continue
            currents = [table.get(attr) for table, attr in b.slots]
            shows = b.parked is None and self._shows(b.obj, u, regions)
            if move_own and not shows and any(c is b.obj for c in currents):
                self._point(b, k, regions)
                count += 1
                shows = True
            for (table, attr), current in zip(b.slots, currents):
                if current is None or current is b.obj or not self._shows(current, u, regions):
                    continue
                if not shows and move_own:
                    self._point(b, k, regions)
                    shows = True
                if shows:
                    table[attr] = b.obj
                    count += not move_own
            if move_own or shows:
                b.ptrs = self._ptrs(b.obj, u)
        return count

    def devices(self) -> set[torch.device]:
        """The devices the block's tensor objects are on now."""
        return {b.obj.device for b in self._bindings}

    def release(self) -> None:
        """Drop the block's tensors from its modules; the pack keeps the values.

        A wrapper object goes back to its own contents (the host master's), which are this
        block's values: a stale reference still cannot read another block's bytes.
        """
        for b in self._bindings:
            u = self._units[b.unit]
            if u.spec is None:
                b.obj.data = _placeholder(b.obj.dtype, self.entries[u.entries[0]].inference)
            else:
                self._rest(b)
            for table, attr in b.slots:
                table[attr] = None

    def restore(self, keep_host: bool, skip_reassigned: bool = False) -> None:
        """Hand every original object back with its original values, device, dtype and strides.

        With ``keep_host`` CPU tensors alias the pack (zero-copy) and the pack stays
        valid for the next attach; without it they get fresh unpinned memory
        and the block returns to its unpacked state, so the host buffer may be freed.
        ``skip_reassigned`` (only meaningful while detached) leaves alone any slot the
        caller has re-assigned since, instead of overwriting it with the old values.
        """
        regions = self.views(self.host) if self.host is not None else None
        values: list[torch.Tensor] = []
        with torch.no_grad():
            for i, e in enumerate(self.entries):
                if e.original is not None:
                    val = e.original
                elif keep_host and e.device.type == "cpu":
                    val = regions.tensors[i]
                else:
                    val = _copy_as(regions.tensors[i], e)
                values.append(val)
            for b in self._bindings:
                if skip_reassigned and not self._is_current(b):
                    continue
                u = self._units[b.unit]
                if u.spec is None:
                    b.obj.data = values[u.entries[0]]
                else:
                    self._rest(b)
                    if u.held:
                        swap(b.obj, u.spec.rebuild([values[i] for i in u.entries]), u.label)
                for table, attr in b.slots:
                    table[attr] = b.obj
                b.ptrs = self._ptrs(b.obj, u)
        if not keep_host:
            for e, val in zip(self.entries, values):
                e.original = val
            self.host = None

    def is_current(self) -> bool:
        """False if someone re-assigned a tensor of the block since we last handed it back."""
        return all(self._is_current(b) for b in self._bindings)

    def _is_current(self, b: _Binding) -> bool:
        if any(table.get(attr) is not b.obj for table, attr in b.slots):
            return False
        u = self._units[b.unit]
        if u.spec is None:
            e = self.entries[u.entries[0]]
            return b.obj.data_ptr() == b.ptrs[0] and b.obj.dtype == e.dtype and b.obj.size() == e.shape
        flat = u.spec.matches(b.obj)
        return flat is not None and len(b.ptrs) == len(flat.inner) and all(
            x.data_ptr() == p or self._equal_small_copy(x, self.entries[i])
            for x, p, i in zip(flat.inner, b.ptrs, u.entries)
        )

    def _equal_small_copy(self, t: torch.Tensor, e: PackedTensor) -> bool:
        """A small host tensor with the pack's bytes for ``e`` still shows the pack's values.

        Why: a no-op ``.to()`` of a module rebuilds a wrapper parameter, and both ComfyUI
        QuantizedTensors clone their scales on the way (their ``detach``); the values are the same.
        """
        if self.host is None or t.device.type != "cpu" or t.dtype != e.dtype or t.size() != e.shape:
            return False
        if e.nbytes > _SMALL_COPY:
            return False
        return torch.equal(t.reshape(-1).view(torch.uint8), _typed(self.host, e).reshape(-1).view(torch.uint8))


def empty_at_phase(nbytes: int, phase: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Fresh uint8 tensor of ``nbytes`` whose first byte sits at ``phase`` modulo ``PHASE``."""
    raw = torch.empty(nbytes + PHASE, dtype=torch.uint8, device=device)
    start = (phase - raw.data_ptr()) % PHASE
    return raw[start : start + nbytes]


def _copy_as(src: torch.Tensor, e: PackedTensor) -> torch.Tensor:
    """Fresh tensor holding ``src``'s values with the entry's original device, strides,
    inference-ness and address modulo ``PHASE`` (so CPU kernels sum it in the original's order)."""
    with torch.inference_mode(e.inference):
        out = empty_at_phase(e.nbytes, e.phase, e.device).view(e.dtype).as_strided(e.shape, e.stride)
        out.copy_(src)
    return out


def _check_transform_output(out: object, e: PackedTensor) -> None:
    if not isinstance(out, torch.Tensor) or type(out) not in PLAIN_TYPES:
        raise TypeError(f"transform must return a plain torch.Tensor for {e.label!r}, got {type(out).__name__}")
    if out.layout != torch.strided or out.device.type == "meta":
        raise TypeError(f"transform returned a {out.layout} tensor on {out.device} for {e.label!r}")
    if out.shape != e.shape or out.dtype != e.dtype:
        raise ValueError(
            f"transform must keep shape and dtype of {e.label!r}: expected {tuple(e.shape)} {e.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )


def _check_wrapped_output(out: object, u: _Unit, entries: Sequence[PackedTensor]):
    """The inner tensors of a transform's wrapper output, checked against the stored layout."""
    spec = u.spec
    if type(out) is not spec.cls:
        raise TypeError(
            f"transform must return a {spec.cls.__name__} for {u.label!r} (like its argument), "
            f"got {type(out).__name__}"
        )
    flat = spec.matches(out)
    if flat is None:
        raise ValueError(
            f"transform must keep the shape and inner tensors of {u.label!r}: expected {tuple(spec.size)} "
            f"over {list(spec.names)}, got {tuple(out.size())} over {list(flatten(out).names)}"
        )
    for name, inner, e in zip(flat.names, flat.inner, entries):
        if type(inner) not in PLAIN_TYPES or inner.size() != e.shape or inner.dtype != e.dtype:
            raise ValueError(
                f"transform must keep shape and dtype of {u.label!r}'s inner tensor {name!r}: expected "
                f"{tuple(e.shape)} {e.dtype}, got {tuple(inner.size())} {inner.dtype}"
            )
    if any(True for _ in held_tensors(flat.ctx)):
        raise TypeError(f"transform output for {u.label!r} keeps a tensor in its flatten context")
    return flat
