"""Where one block's tensors sit in one contiguous byte buffer, planned once from metadata.

Why: one flat copy per block is what reaches link peak; per-tensor copies pay a launch and driver
cost each.  The layout (dtype groups, 256-byte aligned offsets, original strides for dense
tensors) is planned from the tensors' metadata alone, so the same typed views can be laid over the
host master or over any device slot.  Only what round-trips through raw bytes is laid out: plain
tensors, storage subclasses and the inner tensors of wrapper subclasses (``subclass``).

Where a tensor starts matters on the CPU too: a CPU kernel's summation order can depend on its
operand's address (the one-row GEMV of a time embedding peels to a 16-byte boundary), and a
checkpoint read from a memory map leaves weights at whatever address modulo 16 the file's
header length gives them.  So a fresh copy of a tensor (``PackedTensor.fresh_copy``) keeps the
original's address modulo ``PHASE``, and a layout for a module that computes straight from the host
master (``keep_address_phase``: the whole-module master on a CPU-only machine) places its tensors
the same way; layouts for device slots stay aligned, as the device copies core makes are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..alignment import align_up
from .released import released, stand_in_note
from .subclass import (
    PLAIN_TYPES,
    WrapperSpec,
    check_storage_subclass,
    class_name,
    flatten,
    is_storage_subclass,
    is_wrapper,
)
from .tensor_refs import TensorRef

ALIGN = 256
PHASE = 64  # a tensor's address modulo this is kept where the pack keeps address phases (>= any SIMD width)


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
    spec with its inner tensors; raises for anything that does not round-trip. A tensor the disk
    tier released (its bytes are in the model's file) is described by a meta stand-in of what it
    really is (``released``)."""
    note = released(t)
    if note is not None:
        return None, ("",), (note.stand_in(),)
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
    if t.numel() == 0 or t.device.type == "meta":  # a meta tensor is a released tensor's stand-in
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.size()), t.stride())


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` show the same memory as the same typed view."""
    # size(), not shape: a storage subclass may report another shape (GGUF's logical one)
    return a is b or (
        a.device == b.device
        and a.dtype == b.dtype
        and a.size() == b.size()
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


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


def empty_at_phase(nbytes: int, phase: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Fresh uint8 tensor of ``nbytes`` whose first byte sits at ``phase`` modulo ``PHASE``."""
    raw = torch.empty(nbytes + PHASE, dtype=torch.uint8, device=device)
    start = (phase - raw.data_ptr()) % PHASE
    return raw[start : start + nbytes]


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

    def view_in(self, buf: torch.Tensor) -> torch.Tensor:
        """This tensor's typed view over ``buf`` (a 1-D uint8 buffer laid out by the same layout)."""
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).as_strided(self.shape, self.stride)

    def fresh_copy(self, src: torch.Tensor) -> torch.Tensor:
        """Fresh tensor holding ``src``'s values with the original's device, strides,
        inference-ness and address modulo ``PHASE`` (so CPU kernels sum it in the original's order)."""
        with torch.inference_mode(self.inference):
            out = empty_at_phase(self.nbytes, self.phase, self.device).view(self.dtype).as_strided(
                self.shape, self.stride)
            out.copy_(src)
        return out


@dataclass(eq=False)
class PackedUnit:
    """One tensor as the modules see it: one entry, or a wrapper rebuilt over several."""

    label: str
    owner: tuple[int, str]
    entries: tuple[int, ...]
    spec: WrapperSpec | None  # None: the entry's bytes are the tensor's values
    held: bool = False  # every entry is dense: the pack stands in for the original
    ctx: Any = None  # wrapped: the context a transform gave the device copies (None: the spec's)


class BlockLayout:
    """The memory a block's tensors show, once each (``entries``, grouped by dtype, each at its
    offset in a buffer of ``nbytes``), and the tensors as the modules see them (``units``).

    Aliases are laid out once: tensors that show the same memory are one unit, and wrappers that
    share an inner tensor share its entry.  ``item_units`` names, for each item the layout was
    planned from, the unit it shows.
    """

    def __init__(self, items: Sequence[tuple[TensorRef, torch.Tensor]], index: int, *,
                 keep_address_phase: bool) -> None:
        """``keep_address_phase``: place each tensor at its original address modulo ``PHASE`` in a
        buffer that starts on an ``ALIGN`` boundary (at most ``PHASE`` - 1 bytes of padding each)."""
        described = [_describe(t, ref.label) for ref, t in items]
        self.index = index
        self.keep_address_phase = keep_address_phase

        firsts: list[tuple[str, tuple[int, str], torch.Tensor]] = []
        entry_of: dict[tuple, int] = {}
        unit_of: dict[tuple, int] = {}
        self.units: list[PackedUnit] = []
        self.item_units: list[int] = []
        for (ref, t), (spec, names, inner) in zip(items, described):
            key = alias_key(t)
            if key not in unit_of:
                idx = []
                for name, x in zip(names, inner):
                    k = alias_key(x)
                    if k not in entry_of:
                        entry_of[k] = len(firsts)
                        firsts.append((f"{ref.label}[{name}]" if name else ref.label, (ref.block, ref.path), x))
                    idx.append(entry_of[k])
                unit_of[key] = len(self.units)
                self.units.append(PackedUnit(ref.label, (ref.block, ref.path), tuple(idx), spec))
            self.item_units.append(unit_of[key])

        rank: dict[torch.dtype, int] = {}
        for _, _, t in firsts:
            rank.setdefault(t.dtype, len(rank))
        order = sorted(range(len(firsts)), key=lambda i: (rank[firsts[i][2].dtype], i))
        new_pos = {old: new for new, old in enumerate(order)}

        self.entries: list[PackedTensor] = []
        offset = 0
        for old in order:
            label, owner, t = firsts[old]
            note = stand_in_note(t)  # a released tensor: its phase, device and kind are noted
            dense = _is_dense(t)
            phase = t.data_ptr() % PHASE if note is None else note.phase
            phase -= phase % t.element_size()  # a typed view must start on its element size
            offset = align_up(offset, ALIGN) + (phase if keep_address_phase else 0)
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
                    device=t.device if note is None else note.device,
                    dense=dense,
                    inference=t.is_inference() if note is None else note.inference,
                    phase=phase,
                    original=t.detach() if note is None else note.empty(),
                )
            )
            offset += nbytes
        self.nbytes = align_up(offset, ALIGN)
        for u in self.units:
            u.entries = tuple(new_pos[i] for i in u.entries)
            u.held = all(self.entries[i].dense for i in u.entries)

    def check_buffer(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(
                f"block {self.index}: need a 1-D uint8 buffer of >= {self.nbytes} bytes, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )

    def typed_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """A typed view per entry over ``buf``, each an inference tensor where its original was."""
        self.check_buffer(buf)
        tensors = []
        for e in self.entries:
            with torch.inference_mode(e.inference):
                tensors.append(e.view_in(buf))
        return tensors
