"""Pack one block's parameters and buffers into one contiguous host buffer: the block's host master.

The host pack is the master copy and always holds the untransformed values.  A dense tensor gives
up its original storage and is re-pointed at the pack (zero-copy), so a packed model costs 1x RAM,
not 2x; only non-dense tensors (expanded views) keep their original, which bytes cannot describe.
A fresh copy handed back (``restore``) keeps the original's address phase (``layout``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from .binding import BlockBinding, BlockViews
from .layout import PHASE, BlockLayout, PackedTensor
from .plain_writes import plain_writes
from .tensor_refs import TensorRef
from .transform import Transform, transform_units


class PackedBlock:
    """One block's host master and what the engine does with a block through it.

    The jobs live in their own classes: where each tensor sits in a buffer (``BlockLayout``), the
    module slots pointed at views of a buffer and back (``BlockBinding``) and the rewrite of a
    device copy (``transform_units``).  This class holds the one state they share, the host master
    (``host``), and what needs it: writing it (``pack``), handing the originals back (``restore``),
    taking slots back to it (``reclaim``, ``adopt``) and a transform run with the block bound to the
    copy it rewrites.  The engine handles a block as this one object (plans, stores and schedules
    keep lists of them), so the binding's per-pass calls pass through here as well.
    """

    def __init__(self, items: Iterable[tuple[TensorRef, torch.Tensor]], index: int = 0, *,
                 keep_address_phase: bool = False) -> None:
        """``keep_address_phase``: place each tensor at its original address modulo ``PHASE`` in a
        buffer that starts on an ``ALIGN`` boundary (at most ``PHASE`` - 1 bytes of padding each)."""
        items = list(items)
        self.index = index
        self.host: torch.Tensor | None = None  # the master: what device copies are made from
        self.shown: torch.Tensor | None = None  # the master's bytes as the module's tensors show them
        self.layout = BlockLayout(items, index, keep_address_phase=keep_address_phase)
        self.binding = BlockBinding(items, self.layout)
        self.entries: list[PackedTensor] = self.layout.entries
        self.nbytes = self.layout.nbytes

    @property
    def num_bindings(self) -> int:
        """Module slots the block's tensors sit in."""
        return self.binding.num_slots

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the packed tensors without alignment padding (a wrapper's inner tensors)."""
        return sum(e.nbytes for e in self.entries)

    def views(self, buf: torch.Tensor, transformed: bool = False) -> BlockViews:
        """The block laid over ``buf`` (host pack or device slot), ready to bind (``BlockBinding.views``)."""
        return self.binding.views(buf, transformed)

    def bind(self, views: BlockViews) -> None:
        """Point every parameter/buffer of the block at ``views`` (from ``self.views``)."""
        self.binding.bind(views)

    def release(self) -> None:
        """Drop the block's tensors from its modules; the pack keeps the values (``BlockBinding.release``)."""
        self.binding.release()

    def conceal(self) -> None:
        """Unset the block's tensors in their modules, keeping the objects; reveal() sets them back."""
        self.binding.conceal()

    def reveal(self) -> None:
        self.binding.reveal()

    def devices(self) -> set[torch.device]:
        """The devices the block's tensor objects are on now."""
        return self.binding.devices()

    def is_current(self) -> bool:
        """False if someone re-assigned a tensor of the block since we last handed it back."""
        return self.binding.is_current(self.shown)

    def pack(self, host: torch.Tensor) -> None:
        """Write the original values into ``host`` and let the pack stand in for every dense original."""
        self.write(host)
        self.take_host(host)

    def write(self, buf: torch.Tensor) -> None:
        """Write the original values into ``buf``, pointing nothing at it and keeping the originals:
        a shared host store's bytes are written through one mapping and taken through another
        (``take_host``), read-only."""
        if buf.device.type != "cpu":
            raise ValueError(f"block {self.index}: the host pack must live on the CPU, got {buf.device}")
        self.layout.check_buffer(buf)
        if self.layout.keep_address_phase and buf.data_ptr() % PHASE:
            raise ValueError(f"block {self.index}: a host pack that keeps address phases must start on a "
                             f"{PHASE}-byte boundary")
        with plain_writes():
            for e in self.entries:
                e.view_in(buf).copy_(e.original)

    def take_host(self, host: torch.Tensor, shown: torch.Tensor | None = None) -> None:
        """Let ``host``, which holds the block's values already (written by ``write``, here or in
        another process), stand in for every dense original: the originals go, nothing is copied.

        ``shown``: the same bytes in memory the module's tensors may show and anyone may write (a
        shared store's copy-on-write view, when ``host`` is read-only); by default ``host``."""
        self.layout.check_buffer(host)
        shown = host if shown is None else shown
        self.layout.check_buffer(shown)
        with plain_writes():
            for e in self.entries:  # written in full: only now may originals go
                if e.dense:
                    e.original = None
            self.binding.hold(self.views(shown))
        self.host = host
        self.shown = shown

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
        with self.binding.bound_to(self.views(buf)):
            return transform_units(self.layout, buf, transform)

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
        if self.shown is None:
            raise RuntimeError(f"block {self.index} is not packed")
        return self.binding.take_back(self.shown, move_own, tables)

    def restore(self, keep_host: bool, skip_reassigned: bool = False) -> None:
        """Hand every original object back with its original values, device, dtype and strides.

        With ``keep_host`` CPU tensors alias the pack (zero-copy) and the pack stays
        valid for the next attach; without it they get fresh unpinned memory
        and the block returns to its unpacked state, so the host buffer may be freed.
        ``skip_reassigned`` (only meaningful while detached) leaves alone any slot the
        caller has re-assigned since, instead of overwriting it with the old values.
        """
        regions = self.views(self.shown) if self.shown is not None else None
        values: list[torch.Tensor] = []
        with torch.no_grad():
            for i, e in enumerate(self.entries):
                if e.original is not None:
                    val = e.original
                elif keep_host and e.device.type == "cpu":
                    val = regions.tensors[i]
                else:
                    val = e.fresh_copy(regions.tensors[i])
                values.append(val)
            self.binding.hand_back(values, self.shown, skip_reassigned)
        if not keep_host:
            for e, val in zip(self.entries, values):
                e.original = val
            self.host = self.shown = None
