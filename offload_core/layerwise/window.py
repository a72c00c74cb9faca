"""The streaming window of one attach: which streamed units hold a device slot, and their copies.

Streamed units go through a ring of slots: while unit ``j`` runs, the next ``prefetch`` streamed
units are copied on a side stream, one copy per unit. After a unit runs its module tensors are
dropped; the slot is reused once an event says its last reader finished. At the end of a pass the
first units of the next pass are already being fetched (wrap-around).

Units that run out of the expected order (block caches that skip, a block run twice, a retry
after an exception) are still served: the window re-centres on the unit that actually runs and,
if its bytes are not in a slot, it is loaded right away. That is counted (``sync_fallbacks``,
``order_misses``), never fatal. A slot copied over before its unit ran (a call that skipped the
unit: skip-layer guidance's extra call, a block cache) was a copy for nothing: counted too
(``unused_copies``, ``unused_copy_bytes``). The copies the last pass of a run makes for a next
pass that never comes are not: that is prefetch across steps.

A transform (a LoRA merge) rewrites each streamed unit's slot right after its copy lands, never
the host pack. The compute stream waits for each slot's copy (per-slot events, in the ring), so
it need not be the stream attach ran on.

torch.compile: the hooks that call into the window run eagerly, outside any compiled graph
(``device/hooks.py``), so each streamed block's forward is a graph of its own whose weights are
graph inputs, read from whichever slot ``enter`` bound: the same graph serves every slot and every
pass, because a unit's views lie at the same offsets, with the same strides and dtypes, in every
slot. A CUDA graph captured over a streamed block is refused in ``enter``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..device.slots import SlotRing
from ..device.telemetry import Telemetry
from ..disk.cache_ring import CacheRing
from ..host.packing import Transform
from ..host.transform import transform_now
from .plan import StreamPlan

log = logging.getLogger(__name__)


class StreamWindow:
    """The window of ``plan``'s streamed units over ``ring``: the hooks' hot path.

    One class on purpose: ``enter`` and ``exit`` run on the sampling thread around every streamed
    unit, and the window's state (who holds which slot, who runs, who is expected next, the cached
    views per slot) is read and written by every step of them, ``fill`` included. Split further,
    each step would pay an attribute lookup or a call more per unit for nothing a reader gains.
    ``await_resident`` is the resident upload's wait, which the first streamed unit on a stream
    also needs.
    """

    def __init__(self, plan: StreamPlan, ring: SlotRing, device: torch.device, telemetry: Telemetry,
                 transform: Transform | None, await_resident: Callable[[], None]) -> None:
        self.ring = ring
        self.device = device
        self.telemetry = telemetry
        self.units = plan.units
        self.streamed_indices = plan.streamed_indices
        self._packs = plan.packs
        self._pos = plan.pos
        self._nslots = plan.nslots
        self._transform = transform
        self._await_resident = await_resident
        self._slot_of: dict[int, int] = {}  # streamed unit -> slot it holds (in flight or running)
        self._unrun: dict[int, int] = {}  # slot -> the unit copied into it that has not run yet
        self.running: int | None = None  # the unit whose weights are bound now
        self._expected = 0  # position in streamed_indices of the unit expected next
        self._view_cache: dict[tuple[int, int], list[torch.Tensor]] = {}

    def in_flight(self) -> set[int]:
        """Streamed units that hold a slot now (copying, ready or running)."""
        return set(self._slot_of)

    def close(self) -> None:
        """Close the slot ring (waiting for its copies)."""
        self.ring.close()

    def release(self) -> None:
        """Forget the slots' contents: the cached views keep the slots' memory alive, and the
        transform its factors, for as long as anything still holds the window (a hook kept by a
        compiled graph's cache)."""
        self._slot_of = {}
        self._unrun = {}
        self.running = None
        self._view_cache = {}
        self._transform = None

    # ---------------------------------------------------------------- hot path
    def _refuse_capture(self, i: int) -> None:
        """Streamed blocks re-point their weights at a different slot on every pass: a captured
        CUDA graph would keep reading whatever the first pass's slot holds later."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"block {i} is streamed by the layerwise offload engine and cannot be captured in a CUDA "
                "graph: its weights move between device slots on every pass. Capture without the engine, "
                "keep every block resident, or compile each block with torch.compile's default mode "
                "(inductor without CUDA graphs), which streamed blocks keep."
            )

    def enter(self, i: int) -> None:
        """Unit ``i`` starts: compute waits for its slot, and its modules are bound to the slot."""
        if self.running == i:  # another module of the phase that is running
            return
        self._refuse_capture(i)
        self._await_resident()
        if self.running is not None:  # the previous phase ends here (or a block whose exit never ran)
            self.exit(self.running)
        pos = self._pos[i]
        retarget = pos != self._expected
        if retarget:
            self.telemetry.order_misses += 1
            self._expected = pos
        if i not in self._slot_of:
            self.telemetry.sync_fallbacks += 1
            log.debug("[tiered offload] unit %d was not prefetched; loading it now", i)
            retarget = True
        if retarget:
            self.fill()
        slot = self._slot_of[i]
        self._unrun.pop(slot, None)
        try:
            self.ring.wait_ready(slot)
        except BaseException:  # its copy failed: the slot holds nothing, the next entry loads it again
            self._unreserve(i)
            raise
        views = self._view_cache.get((i, slot))
        if views is None:
            views = self._view_cache[(i, slot)] = self._packs[i].views(
                self.ring.buffers[slot], transformed=self._transform is not None)
        self._packs[i].bind(views)
        self.running = i

    def exit(self, i: int) -> None:
        """Unit ``i`` ended: its slot is free behind its last reader, and the window moves on."""
        if self.running != i:
            return
        self._finish(i)
        self._expected = (self._pos[i] + 1) % len(self.streamed_indices)
        self.fill()

    def block_enter(self, b: int) -> None:
        """Phases: a block starts; the running phase of another block ends here at the latest."""
        running = self.running
        if running is not None and self.units[running].block != b:
            self.exit(running)

    def block_exit(self, b: int) -> None:
        """Phases: the block returned (or raised), so its running phase is over."""
        running = self.running
        if running is not None and self.units[running].block == b:
            self.exit(running)

    def _finish(self, i: int) -> None:
        self.ring.mark_free(self._slot_of[i])
        self._packs[i].release()
        self._unreserve(i)
        self.running = None

    def fill(self) -> None:
        """Reserve slots for the next ``slots`` streamed blocks, copying only what is not there yet."""
        order = self.streamed_indices
        window = [order[(self._expected + d) % len(order)] for d in range(self._nslots)]
        wanted = set(window)
        for b in [b for b in self._slot_of if b not in wanted and b != self.running]:
            self._unreserve(b)
        taken = set(self._slot_of.values())
        for b in window:
            if b in self._slot_of:
                continue
            free = [s for s in range(self._nslots) if s not in taken]
            if not free:
                break
            holds = self.ring.holds
            slot = next((s for s in free if holds[s] == b), None)
            if slot is None:
                slot = next((s for s in free if holds[s] not in wanted), free[0])
                self._copy_in(slot, b)
            self._slot_of[b] = slot
            taken.add(slot)
            self.telemetry.add_materialized(self._packs[b].nbytes)

    def _copy_in(self, slot: int, b: int) -> None:
        skipped = self._unrun.get(slot)
        if skipped is not None:  # copied over before it ran
            self.telemetry.unused_copies += 1
            self.telemetry.unused_copy_bytes += self._packs[skipped].nbytes
        self._unrun[slot] = b
        if isinstance(self.ring, CacheRing):
            self.ring.copy_unit(slot, b, self._packs[b].nbytes, self._prepare(b))
        else:
            self.ring.copy_in(slot, self._packs[b].host, b, self._prepare(b))

    def _prepare(self, b: int) -> Callable[[torch.Tensor], None] | None:
        """The step that applies this attach's transform to block ``b``'s fresh slot copy."""
        transform = self._transform
        if transform is None:
            return None
        pack, tel = self._packs[b], self.telemetry
        transform = transform_now(transform)  # as it stands when the copy is queued

        def prepare(slot: torch.Tensor) -> None:
            tel.transforms += pack.apply_transform(slot, transform)

        return prepare

    def refresh(self) -> int:
        """Between two passes, after the transform changed (``transform_now``): the slots that
        hold a unit copied and rewritten with the old one are copied again; the running unit,
        if any, keeps its slot. Returns how many units are copied again."""
        stale = [b for b in self._slot_of if b != self.running]
        for b in stale:
            self._unreserve(b)
        running_slot = self._slot_of.get(self.running) if self.running is not None else None
        for s in range(self._nslots):
            if s != running_slot:
                self.ring.holds[s] = None  # no slot's bytes may be taken for the new transform's
        self._view_cache = {}
        self.fill()
        return len(stale)

    def _unreserve(self, b: int) -> None:
        del self._slot_of[b]
        self.telemetry.add_materialized(-self._packs[b].nbytes)
