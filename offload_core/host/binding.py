"""A block's module slots bound to views of a buffer: the host master, a device slot, or nothing.

Module tensors keep their original objects (``nn.Parameter`` / buffer) for life; only their
``.data`` is re-pointed (a wrapper subclass's contents are swapped, see ``subclass``), so anything
holding a reference to a parameter keeps holding the right object.  ``bind`` and ``release`` run
per block per pass on the sampling thread: they touch only the objects and their slots.

Tensors created under ``torch.inference_mode`` (as ComfyUI loads models) are inference tensors;
every tensor bound to such an object is made an inference tensor too (``BlockLayout.typed_views``,
the placeholders here), and every other one a normal tensor, so either kind keeps working in and
out of inference mode.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .layout import BlockLayout, PackedTensor, PackedUnit, same_view
from .subclass import swap
from .tensor_refs import TensorRef

_SMALL_COPY = 4096  # bytes: an inner tensor this small may be an equal copy and still count as ours
_placeholders: dict[tuple[torch.dtype, bool], torch.Tensor] = {}


def _placeholder(dtype: torch.dtype, inference: bool) -> torch.Tensor:
    """Empty stand-in for released tensors, so a stale reference cannot read another block's bytes."""
    t = _placeholders.get((dtype, inference))
    if t is None:
        with torch.inference_mode(inference):
            t = _placeholders[(dtype, inference)] = torch.empty(0, dtype=dtype)
    return t


def _equal_small_copy(t: torch.Tensor, e: PackedTensor, host: torch.Tensor | None) -> bool:
    """A small host tensor with the pack's bytes for ``e`` still shows the pack's values.

    Why: a no-op ``.to()`` of a module rebuilds a wrapper parameter, and both ComfyUI
    QuantizedTensors clone their scales on the way (their ``detach``); the values are the same.
    """
    if host is None or t.device.type != "cpu" or t.dtype != e.dtype or t.size() != e.shape:
        return False
    if e.nbytes > _SMALL_COPY:
        return False
    return torch.equal(t.reshape(-1).view(torch.uint8), e.view_in(host).reshape(-1).view(torch.uint8))


@dataclass(eq=False)
class BlockViews:
    """A block laid over one buffer: a typed view per entry and a rebuilt wrapper per wrapped binding."""

    tensors: list[torch.Tensor]
    wrappers: dict[int, torch.Tensor]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]

    def __len__(self) -> int:
        return len(self.tensors)


@dataclass(eq=False)
class TensorBinding:
    """One tensor object of the block and the module slots that hold it."""

    obj: torch.Tensor  # the original Parameter / buffer object, kept for life
    slots: list[tuple[dict, str]]  # module tables that hold it
    unit: int
    entry: int | None  # plain: the one entry whose view becomes its .data; None: a wrapper
    ptrs: tuple[int, ...]  # data pointers it showed when we last handed it back (staleness check)
    parked: torch.Tensor | None = None  # wrapped: holds obj's own contents while obj shows a buffer's


class BlockBinding:
    """The block's tensor objects in their module slots, pointed at views of a buffer and back."""

    def __init__(self, items: Sequence[tuple[TensorRef, torch.Tensor]], layout: BlockLayout) -> None:
        self._layout = layout
        self._units = layout.units
        self._entries = layout.entries
        binding_of: dict[int, TensorBinding] = {}
        seen_slots: set[tuple[int, str, str]] = set()
        for (ref, t), unit in zip(items, layout.item_units):
            slot = (id(ref.module), ref.kind, ref.attr)
            if slot in seen_slots:
                continue
            seen_slots.add(slot)
            b = binding_of.get(id(t))
            if b is None:
                u = self._units[unit]
                b = binding_of[id(t)] = TensorBinding(t, [], unit, u.entries[0] if u.spec is None else None, ())
            b.slots.append((ref.table, ref.attr))
        self.bindings = list(binding_of.values())
        for b in self.bindings:
            b.ptrs = self._ptrs(b.obj, self._units[b.unit])

    @property
    def num_slots(self) -> int:
        """Module slots the block's tensors sit in."""
        return sum(len(b.slots) for b in self.bindings)

    def views(self, buf: torch.Tensor, transformed: bool = False) -> BlockViews:
        """The block laid over ``buf`` (host pack or device slot), ready to bind.

        ``transformed``: ``buf`` is a device copy the current transform rewrote, so wrappers it
        changed are rebuilt with the context the transform gave them.
        """
        tensors = self._layout.typed_views(buf)
        wrappers = {}
        for k, b in enumerate(self.bindings):
            u = self._units[b.unit]
            if u.spec is not None:
                wrappers[k] = u.spec.rebuild([tensors[i] for i in u.entries], u.ctx if transformed else None)
        return BlockViews(tensors, wrappers)

    def bind(self, views: BlockViews) -> None:
        """Point every parameter/buffer of the block at ``views`` (from ``self.views``)."""
        tensors = views.tensors
        for k, b in enumerate(self.bindings):
            if b.entry is not None:
                b.obj.data = tensors[b.entry]
            else:
                self._show(b, views.wrappers[k])
            for table, attr in b.slots:
                table[attr] = b.obj

    def release(self) -> None:
        """Drop the block's tensors from its modules; the pack keeps the values.

        A wrapper object goes back to its own contents (the host master's), which are this
        block's values: a stale reference still cannot read another block's bytes.
        """
        entries = self._entries
        for b in self.bindings:
            if b.entry is not None:
                b.obj.data = _placeholder(b.obj.dtype, entries[b.entry].inference)
            else:
                self._rest(b)
            for table, attr in b.slots:
                table[attr] = None

    def conceal(self) -> None:
        """Unset the block's tensors in their modules, keeping the objects; reveal() sets them back."""
        for b in self.bindings:
            for table, attr in b.slots:
                table[attr] = None

    def reveal(self) -> None:
        for b in self.bindings:
            for table, attr in b.slots:
                table[attr] = b.obj

    @contextmanager
    def bound_to(self, views: BlockViews) -> Iterator[None]:
        """The block bound to ``views`` for the ``with`` body; every slot and object as it was after."""
        saved = [([table.get(attr) for table, attr in b.slots], b.parked,
                  b.obj.data if b.parked is None and b.entry is not None else None) for b in self.bindings]
        try:
            self.bind(views)
            yield
        finally:
            for b, (currents, parked, data) in zip(self.bindings, saved):
                if b.entry is not None:
                    b.obj.data = data
                else:
                    self._rest(b)
                    if parked is not None:
                        self._show(b, parked)
                for (table, attr), current in zip(b.slots, currents):
                    table[attr] = current

    def hold(self, views: BlockViews) -> None:
        """Let the views of the host master stand in for every tensor the pack holds, for good."""
        for k, b in enumerate(self.bindings):
            u = self._units[b.unit]
            if u.held:
                self._point(b, k, views)
                b.ptrs = self._ptrs(b.obj, u)

    def hand_back(self, values: Sequence[torch.Tensor], host: torch.Tensor | None, skip_reassigned: bool) -> None:
        """Every object shows ``values`` (one per entry) and sits in its slots again; with
        ``skip_reassigned`` an object the caller re-assigned since is left alone."""
        for b in self.bindings:
            if skip_reassigned and not self._is_current(b, host):
                continue
            u = self._units[b.unit]
            if b.entry is not None:
                b.obj.data = values[b.entry]
            else:
                self._rest(b)
                if u.held:
                    swap(b.obj, u.spec.rebuild([values[i] for i in u.entries]), u.label)
            for table, attr in b.slots:
                table[attr] = b.obj
            b.ptrs = self._ptrs(b.obj, u)

    def take_back(self, host: torch.Tensor, move_own: bool, tables: Collection[int] | None) -> int:
        """The slots that show the master ``host``'s values get our objects back (``PackedBlock.reclaim``
        with ``move_own``, ``PackedBlock.adopt`` without)."""
        regions = self.views(host)
        count = 0
        for k, b in enumerate(self.bindings):
            u = self._units[b.unit]
            if not u.held or (tables is not None and not any(id(t) in tables for t, _ in b.slots)):
                continue
            currents = [table.get(attr) for table, attr in b.slots]
            shows = b.parked is None and self._shows(b.obj, u, regions, host)
            if move_own and not shows and any(c is b.obj for c in currents):
                self._point(b, k, regions)
                count += 1
                shows = True
            for (table, attr), current in zip(b.slots, currents):
                if current is None or current is b.obj or not self._shows(current, u, regions, host):
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
        return {b.obj.device for b in self.bindings}

    def is_current(self, host: torch.Tensor | None) -> bool:
        """False if someone re-assigned a tensor of the block since we last handed it back."""
        return all(self._is_current(b, host) for b in self.bindings)

    def _is_current(self, b: TensorBinding, host: torch.Tensor | None) -> bool:
        if any(table.get(attr) is not b.obj for table, attr in b.slots):
            return False
        if b.entry is not None:
            e = self._entries[b.entry]
            # An empty object we handed back (its bytes are in the model's file) is ours as well.
            shape_ok = b.obj.size() == e.shape or (b.obj.numel() == 0 and b.ptrs[0] == 0 and e.nbytes > 0)
            return b.obj.data_ptr() == b.ptrs[0] and b.obj.dtype == e.dtype and shape_ok
        u = self._units[b.unit]
        flat = u.spec.matches(b.obj)
        return flat is not None and len(b.ptrs) == len(flat.inner) and all(
            x.data_ptr() == p or _equal_small_copy(x, self._entries[i], host)
            for x, p, i in zip(flat.inner, b.ptrs, u.entries)
        )

    @staticmethod
    def _ptrs(obj: torch.Tensor, u: PackedUnit) -> tuple[int, ...]:
        if u.spec is None:
            return (obj.data_ptr(),)
        flat = u.spec.matches(obj)
        return tuple(x.data_ptr() for x in flat.inner) if flat is not None else ()

    def _shows(self, t: object, u: PackedUnit, views: BlockViews, host: torch.Tensor) -> bool:
        """Whether ``t`` shows the memory of ``views`` for this unit (a wrapper: or small equal
        copies of some inner tensors, see ``_equal_small_copy``)."""
        if u.spec is None:
            return isinstance(t, torch.Tensor) and same_view(t, views.tensors[u.entries[0]])
        flat = u.spec.matches(t)
        return flat is not None and all(
            same_view(x, views.tensors[i]) or _equal_small_copy(x, self._entries[i], host)
            for x, i in zip(flat.inner, u.entries)
        )

    def _rest(self, b: TensorBinding) -> None:
        """A wrapped object shows its own contents again (undoes ``_show``)."""
        if b.parked is not None:
            swap(b.obj, b.parked, self._units[b.unit].label)
            b.parked = None

    def _show(self, b: TensorBinding, wrapper: torch.Tensor) -> None:
        """A wrapped object shows ``wrapper``'s contents until ``_rest``; ``wrapper`` keeps its own."""
        self._rest(b)
        swap(b.obj, wrapper, self._units[b.unit].label)
        b.parked = wrapper

    def _point(self, b: TensorBinding, k: int, views: BlockViews) -> None:
        """The object shows ``views`` for good (its previous contents are let go)."""
        if b.entry is not None:
            b.obj.data = views.tensors[b.entry]
        else:
            self._rest(b)
            swap(b.obj, views.wrappers[k], self._units[b.unit].label)
