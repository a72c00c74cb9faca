"""Pack one block's parameters and buffers into one contiguous byte buffer.

Why: one flat copy per block is what reaches link peak; per-tensor copies pay a
launch and driver cost each.  The layout (dtype groups, 256-byte aligned offsets,
original strides for dense tensors) is planned once from metadata, so the same
typed views can be laid over the host master or over any device slot.

The host pack is the master copy and always holds the untransformed values.
Module tensors keep their original objects (``nn.Parameter`` / buffer) for life;
only their ``.data`` is re-pointed, so anything holding a reference to a
parameter keeps holding the right object.  A dense tensor gives up its original
storage and is re-pointed at the pack (zero-copy), so a packed model costs 1x
RAM, not 2x; only non-dense tensors (expanded views) keep their original, which
bytes cannot describe.  A transform (e.g. a LoRA merge) is applied to a device
copy of the pack, never to the pack: host RAM does not grow with it, and
``restore`` always puts the untransformed weights back.

Tensors created under ``torch.inference_mode`` (as ComfyUI loads models) are
inference tensors; every tensor bound to such an object is made an inference
tensor too, and every other one a normal tensor, so either kind keeps working
in and out of inference mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

ALIGN = 256
Transform = Callable[[int, str, torch.Tensor], torch.Tensor]
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
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


def check_packable(t: torch.Tensor, label: str) -> None:
    """Refuse anything whose bytes would not round-trip faithfully through a flat buffer."""
    if type(t) not in _PLAIN_TYPES:
        raise TypeError(
            f"cannot pack {label!r}: tensor subclass {type(t).__module__}.{type(t).__qualname__} is not "
            "supported (only plain torch.Tensor and nn.Parameter round-trip through raw bytes)"
        )
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"cannot pack {label!r}: layout {t.layout} is not strided (sparse or nested)")
    if t.is_quantized:
        raise TypeError(f"cannot pack {label!r}: quantized tensors carry scales outside their bytes")
    if t.device.type == "meta":
        raise ValueError(f"cannot pack {label!r}: it is a meta tensor and has no data")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"cannot pack {label!r}: it has a lazy conj/neg bit; resolve it first")


def alias_key(t: torch.Tensor) -> tuple:
    """Identity of the memory a tensor shows: equal keys mean the same values, always."""
    if t.numel() == 0:
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())


def _is_dense(t: torch.Tensor) -> bool:
    """True when the tensor covers exactly numel elements without gaps or overlaps (any order)."""
    if t.is_contiguous():
        return True
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
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
    return a is b or (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
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


@dataclass(eq=False)
class PackedTensor:
    """One unique tensor inside a pack."""

    label: str
    owner: tuple[int, str]  # (block index, path) passed to the transform
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]  # packed strides: the original ones when dense
    device: torch.device  # original device
    dense: bool
    inference: bool  # the original is an inference tensor; everything bound in its place must be too
    original: torch.Tensor | None  # original kept outside the pack (non-dense only); None: the pack holds it


@dataclass(eq=False)
class _Binding:
    table: dict
    attr: str
    obj: torch.Tensor  # the original Parameter / buffer object, kept for life
    entry: int
    ptr: int  # data_ptr the object had when we last handed it back (staleness check)


class PackedBlock:
    """Layout, packing and (re)binding of one block's tensors."""

    def __init__(self, items: Iterable[tuple[TensorRef, torch.Tensor]], index: int = 0) -> None:
        items = list(items)
        for ref, t in items:
            check_packable(t, ref.label)
        self.index = index
        self.host: torch.Tensor | None = None

        unique: dict[tuple, int] = {}
        firsts: list[tuple[TensorRef, torch.Tensor]] = []
        raw_bindings: list[tuple[TensorRef, torch.Tensor, int]] = []
        seen_slots: set[tuple[int, str, str]] = set()
        for ref, t in items:
            slot = (id(ref.module), ref.kind, ref.attr)
            if slot in seen_slots:
                continue
            seen_slots.add(slot)
            key = alias_key(t)
            if key not in unique:
                unique[key] = len(firsts)
                firsts.append((ref, t))
            raw_bindings.append((ref, t, unique[key]))

        rank: dict[torch.dtype, int] = {}
        for _, t in firsts:
            rank.setdefault(t.dtype, len(rank))
        order = sorted(range(len(firsts)), key=lambda i: (rank[firsts[i][1].dtype], i))
        new_pos = {old: new for new, old in enumerate(order)}

        self.entries: list[PackedTensor] = []
        offset = 0
        for old in order:
            ref, t = firsts[old]
            dense = _is_dense(t)
            offset = _align_up(offset, ALIGN)
            nbytes = t.numel() * t.element_size()
            self.entries.append(
                PackedTensor(
                    label=ref.label,
                    owner=(ref.block, ref.path),
                    offset=offset,
                    nbytes=nbytes,
                    dtype=t.dtype,
                    shape=t.shape,
                    stride=t.stride() if dense else _contiguous_strides(t.shape),
                    device=t.device,
                    dense=dense,
                    inference=t.is_inference(),
                    original=t.detach(),
                )
            )
            offset += nbytes
        self.nbytes = _align_up(offset, ALIGN)
        self._bindings = [
            _Binding(ref.table, ref.attr, t, new_pos[e], t.data_ptr()) for ref, t, e in raw_bindings
        ]

    @property
    def num_bindings(self) -> int:
        return len(self._bindings)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of every packed tensor over ``buf`` (host pack or device slot), ready to bind."""
        self._check_buffer(buf)
        out = []
        for e in self.entries:
            with torch.inference_mode(e.inference):
                out.append(_typed(buf, e))
        return out

    def _check_buffer(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(
                f"block {self.index}: need a 1-D uint8 buffer of >= {self.nbytes} bytes, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )

    def pack(self, host: torch.Tensor) -> None:
        """Write the original values into ``host`` and let the pack stand in for every dense original."""
        if host.device.type != "cpu":
            raise ValueError(f"block {self.index}: the host pack must live on the CPU, got {host.device}")
        self._check_buffer(host)
        with torch.no_grad(), torch.inference_mode(False):
            regions = [_typed(host, e) for e in self.entries]  # writable views
            for e, region in zip(self.entries, regions):
                region.copy_(e.original)
            for e in self.entries:  # written in full: only now may originals go
                if e.dense:
                    e.original = None
            bindable = self.views(host)
            for b in self._bindings:
                if self.entries[b.entry].original is None:
                    b.obj.data = bindable[b.entry]
                    b.ptr = b.obj.data_ptr()
        self.host = host

    def apply_transform(self, buf: torch.Tensor, transform: Transform) -> int:
        """Rewrite the block's values in ``buf`` (a device copy of the pack) through ``transform``.

        ``transform(block_index, name, view)`` gets the typed view of one tensor and
        returns a tensor of the same shape and dtype, which is written into the view;
        returning the view itself leaves it as it is.  The pack is never touched, so
        the result is the same on every fresh copy.  While it runs, the block's modules
        are bound to ``buf``: a transform may call a layer's own methods, which read the
        layer's other tensors (a scaled-fp8 layer's scale), and they must see this copy.
        The bindings are put back as they were afterwards.  Returns how many tensors
        were rewritten.
        """
        self._check_buffer(buf)
        saved = [(b.table.get(b.attr), b.obj.data) for b in self._bindings]
        self.bind(self.views(buf))
        count = 0
        try:
            with torch.no_grad(), torch.inference_mode(False):
                for e in self.entries:
                    view = _typed(buf, e)
                    version = view._version
                    out = transform(e.owner[0], e.owner[1], view)
                    if view._version != version:
                        raise ValueError(f"transform modified {e.label!r} in place; it must return a new tensor")
                    _check_transform_output(out, e)
                    if not _same_view(out, view):
                        view.copy_(out)
                        count += 1
        finally:
            for b, (current, data) in zip(self._bindings, saved):
                b.obj.data = data
                b.table[b.attr] = current
        return count

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Point every parameter/buffer of the block at ``views`` (from ``self.views``)."""
        for b in self._bindings:
            b.obj.data = views[b.entry]
            b.table[b.attr] = b.obj

    def conceal(self) -> None:
        """Unset the block's tensors in their modules, keeping the objects; reveal() sets them back."""
        for b in self._bindings:
            b.table[b.attr] = None

    def reveal(self) -> None:
        for b in self._bindings:
            b.table[b.attr] = b.obj

    def reclaim(self) -> int:
        """Point every slot that still shows the master's values back at the master, moving no bytes.

        The owner of the module may have moved our tensor objects elsewhere (to a device, or back
        to fresh host memory by a copy): an object of ours still holds the master's values, because
        owners move objects and put computed weights into new objects, so re-pointing is enough. An
        owner may also have put a new object over the master's own host memory: it gets our object
        back. A slot holding anything else (a weight the owner computed, such as a merged LoRA) is
        left alone. Returns how many tensors were not in the master.
        """
        if self.host is None:
            raise RuntimeError(f"block {self.index} is not packed")
        regions = self.views(self.host)
        moved = 0
        for b in self._bindings:
            if self.entries[b.entry].original is not None:  # not held by the pack
                continue
            region = regions[b.entry]
            current = b.table.get(b.attr)
            if current is b.obj:
                if _same_view(b.obj, region):
                    continue
                b.obj.data = region
                moved += 1
            elif current is not None and _same_view(current, region):
                b.obj.data = region
                b.table[b.attr] = b.obj
            else:
                continue
            b.ptr = b.obj.data_ptr()
        return moved

    def release(self) -> None:
        """Drop the block's tensors from its modules; the pack keeps the values."""
        for b in self._bindings:
            b.obj.data = _placeholder(b.obj.dtype, self.entries[b.entry].inference)
            b.table[b.attr] = None

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
                    val = regions[i]
                else:
                    val = _copy_as(regions[i], e)
                values.append(val)
            for b in self._bindings:
                if skip_reassigned and not self._is_current(b):
                    continue
                b.obj.data = values[b.entry]
                b.table[b.attr] = b.obj
                b.ptr = b.obj.data_ptr()
        if not keep_host:
            for e, val in zip(self.entries, values):
                e.original = val
            self.host = None

    def is_current(self) -> bool:
        """False if someone re-assigned a tensor of the block since we last handed it back."""
        return all(self._is_current(b) for b in self._bindings)

    def _is_current(self, b: _Binding) -> bool:
        obj = b.table.get(b.attr)
        e = self.entries[b.entry]
        return obj is b.obj and obj.data_ptr() == b.ptr and obj.dtype == e.dtype and obj.shape == e.shape


def _copy_as(src: torch.Tensor, e: PackedTensor) -> torch.Tensor:
    """Fresh tensor with the entry's original device, strides and inference-ness holding ``src``'s values."""
    with torch.inference_mode(e.inference):
        out = torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=e.device)
        out.copy_(src)
    return out


def _check_transform_output(out: object, e: PackedTensor) -> None:
    if not isinstance(out, torch.Tensor) or type(out) not in _PLAIN_TYPES:
        raise TypeError(f"transform must return a plain torch.Tensor for {e.label!r}, got {type(out).__name__}")
    if out.layout != torch.strided or out.device.type == "meta":
        raise TypeError(f"transform returned a {out.layout} tensor on {out.device} for {e.label!r}")
    if out.shape != e.shape or out.dtype != e.dtype:
        raise ValueError(
            f"transform must keep shape and dtype of {e.label!r}: expected {tuple(e.shape)} {e.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
