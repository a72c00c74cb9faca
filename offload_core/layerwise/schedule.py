"""One attach's device side: resident buffers, the slot ring, the block hooks and their hot path.

Made at each attach from the plan and dropped at detach. Resident units (and the shared pack) are
copied once into device buffers of their own; streamed units go through a ring of slots: while
unit ``j`` runs, the next ``prefetch`` streamed units are copied on a side stream, one copy per
unit. After a unit runs its module tensors are dropped; the slot is reused once an event says its
last reader finished. At the end of a pass the first units of the next pass are already being
fetched (wrap-around).

Units that run out of the expected order (block caches that skip, a block run twice, a retry
after an exception) are still served: the window re-centres on the unit that actually runs and,
if its bytes are not in a slot, it is loaded right away. That is counted (``sync_fallbacks``,
``order_misses``), never fatal.

A transform (a LoRA merge) rewrites the device copies, never the host pack: the resident buffers
once here, each streamed unit's slot right after its copy lands.

The compute stream is whatever stream is current when a block runs: it waits for the resident
upload (an event recorded here) and for each slot's copy (per-slot events), so neither has to be
the stream attach ran on. Streams, events and copies go through the device's ordering
(``offload_core/ordering.py``): on a plain CPU they order nothing and copies are synchronous.

The hooks call straight into this object's methods (``_on_enter`` and ``_on_exit``, each wrapped
once in ``_timed``): the hot path is those methods, ``_fill`` and ``_copy_in``. A picture of a
pass (``device/timeline.py``) is recorded when ``telemetry.timeline`` is set at ``start``: the
hooks are then wrapped once more (``_recording``); otherwise the hot path has no trace of it
beyond the ring's one check per copy.

torch.compile: the hooks of streamed units run eagerly, outside any compiled graph
(``device/hooks.py``), so each streamed block's forward is a graph of its own whose weights are
graph inputs, read from whichever slot the hook bound: the same graph serves every slot and every
pass, because a unit's views lie at the same offsets, with the same strides and dtypes, in every
slot. A CUDA graph captured over a streamed block is refused in its hook (``_refuse_capture``).
The resident units' wait stays traceable and does nothing in a graph, so a model with every
block resident keeps one whole graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..blocks.phases import hooked_modules
from ..device.hooks import BlockHooks
from ..device.slots import SlotRing
from ..device.telemetry import Telemetry
from ..device.timeline import Timeline
from ..disk.cache_ring import CacheRing
from ..disk.tier import DiskTier
from ..host.packing import Transform
from ..host.pinned import HostStorage
from ..ordering import Event, for_device
from .plan import StreamPlan

log = logging.getLogger(__name__)


class DeviceSchedule:
    """The device memory and hooks of one attach of ``plan``'s units on ``device``.

    ``disk`` is the disk tier when the packs live on disk (resident units are uploaded from it and
    slots are fed from its cache), ``bounce`` the staging buffer of a host pack that is not all
    pinned. ``start`` allocates and installs, ``stop`` removes the hooks and closes the ring,
    ``release`` gives the resident buffers back; both are safe after a ``start`` that failed
    part-way.
    """

    def __init__(self, plan: StreamPlan, device: torch.device, telemetry: Telemetry,
                 transform: Transform | None, disk: DiskTier | None, bounce: HostStorage | None,
                 compiled: bool = False) -> None:
        self.device = device
        self._compiled = compiled
        self._ordering = for_device(device)
        self._current_stream = self._ordering.current_stream  # the compute stream, asked for per unit
        self.telemetry = telemetry
        self.blocks = plan.blocks
        self.units = plan.units
        self.granularity = plan.granularity
        self.resident_indices = plan.resident_indices
        self.streamed_indices = plan.streamed_indices
        self._bound_bytes = plan.bound_bytes()
        self._packs = plan.packs
        self._shared = plan.shared
        self._pos = plan.pos
        self._nslots = plan.nslots
        self._slot_bytes = plan.slot_bytes
        self._transform = transform
        self._disk = disk
        self._bounce = bounce
        self._hooks: list[BlockHooks] = []
        self._ring: SlotRing | None = None
        self._resident_bufs: list[torch.Tensor] = []
        self._resident_ready: Event | None = None  # resident upload done
        self._resident_waited: set[int] = set()  # compute streams that already wait for it
        self._slot_of: dict[int, int] = {}  # streamed unit -> slot it holds (in flight or running)
        self._running: int | None = None
        self._expected = 0  # position in streamed_indices of the unit expected next
        self._view_cache: dict[tuple[int, int], list[torch.Tensor]] = {}

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Upload the resident units, allocate the slots, install the hooks, start the first copies."""
        tel = self.telemetry
        disk = self._disk
        ordering = self._ordering
        resident = [(i, self._packs[i]) for i in self.resident_indices] + [(len(self._packs), self._shared)]
        for index, p in resident:
            if not p.entries:
                continue
            label = f"resident unit {index}" if index < len(self._packs) else "shared tensors"
            buf = ordering.buffer(p.nbytes, label)
            self._resident_bufs.append(buf)
            tel.add_device_alloc(p.nbytes)
            if disk is not None:
                disk.upload(index, p.nbytes, buf)
            else:
                ordering.copy(buf, p.host)
            if self._transform is not None:  # queued behind the copy on the same stream
                tel.transforms += p.apply_transform(buf, self._transform)
            p.bind(p.views(buf, transformed=self._transform is not None))
            tel.add_materialized(p.nbytes)
        tel.bound_bytes = self._bound_bytes
        if self._resident_bufs:  # without an upload, compute has nothing to wait for
            self._resident_ready = ordering.event()
            self._resident_ready.record(ordering.current_stream())
            # Phases: a block's own tensors are resident, and it may read them before any phase.
            waits = [(i, self.blocks[i]) for i in self.resident_indices] if self.granularity == "block" \
                else list(enumerate(self.blocks))
            self._hooks.append(BlockHooks(waits, self._on_enter_resident, eager=False))  # never waits on the host
        if not self.streamed_indices:
            return
        if disk is not None:
            self._ring = CacheRing(self.device, self._nslots, self._slot_bytes, tel, disk.cache, disk.telemetry)
        else:
            self._ring = SlotRing(self.device, self._nslots, self._slot_bytes, tel, bounce=self._bounce,
                                  worker=self._transform is not None)
        for i in self.streamed_indices:
            self._packs[i].release()
        hooks = (self._on_enter, self._on_exit, self._on_block_enter, self._on_block_exit)
        if tel.timeline is not None:  # chosen once per attach: while off, no hook looks for it
            hooks = self._recording(tel.timeline)
        enter, leave, block_enter, block_exit = (self._timed(h) for h in hooks)
        # Outside compiled graphs only where a compile runs: keeping a hook out of dynamo's trace
        # costs a few microseconds per call, which an eager run need not pay.
        eager = self._compiled
        if self.granularity == "block":
            self._hooks.append(
                BlockHooks([(i, self.blocks[i]) for i in self.streamed_indices], enter, leave, eager=eager)
            )
        else:
            # A phase starts when any module inside it is called and ends when the next one starts
            # or its block returns.
            members = [(i, m) for i in self.streamed_indices for m in hooked_modules(self.units[i])]
            self._hooks.append(BlockHooks(members, enter, eager=eager))
            streamed_blocks = sorted({self.units[i].block for i in self.streamed_indices})
            self._hooks.append(BlockHooks([(b, self.blocks[b]) for b in streamed_blocks],
                                          block_enter, block_exit, eager=eager))
        self._fill()
        # A copy worker (the disk tier's, or the staging of pageable packs) may still be issuing the
        # copies queued so far, transforms included. A transform binds its unit's tensors while it
        # runs, and what the caller does after attach (ComfyUI's model load) must find every
        # streamed unit empty. A failed copy is raised when its unit is entered.
        self._ring.wait_issued()

    def stop(self) -> None:
        """Remove the hooks and close the slot ring (waiting for its copies)."""
        for hooks in self._hooks:
            hooks.remove()
        self._hooks = []
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def release(self) -> None:
        """Forget the slots' contents and give the resident buffers back, with their count."""
        self._slot_of = {}
        self._running = None
        self._view_cache = {}
        self._transform = None
        self._resident_ready = None
        self.telemetry.add_device_alloc(-sum(b.numel() for b in self._resident_bufs))
        self._resident_bufs = []

    def in_flight_units(self) -> set[int]:
        """Streamed units that hold a slot now (copying, ready or running)."""
        return set(self._slot_of)

    # ---------------------------------------------------------------- hot path
    def _timed(self, hook: Callable[[int], None]) -> Callable[[int], None]:
        """``hook`` with its time on the sampling thread added to the telemetry's host waits.

        A trace by torch.compile reaches it only when the attach was not told of a compile (its
        hooks are then traceable): refused there, before a clock or a weight move is traced."""
        tel = self.telemetry

        def timed(i: int) -> None:
            if torch.compiler.is_compiling():
                self._refuse_trace(i)
            start = time.perf_counter()
            try:
                hook(i)
            finally:
                tel.host_wait_s += time.perf_counter() - start

        return timed

    def _recording(self, timeline: Timeline) -> tuple[Callable[[int], None], ...]:
        """The four hooks, each telling ``timeline`` where a unit's wait and compute begin and end.

        A unit's wait is its whole enter hook (on CUDA, the compute stream's wait for the slot
        between two events; on the host, the hook's time, the way ``host_wait_s`` counts it);
        its compute runs from there to its exit, or to the next unit's wait for a phase ended by
        the next one. Not while a CUDA graph captures: the plain hook refuses that, and a mark
        there would be no graph op."""
        on_enter, on_exit, on_block_enter, on_block_exit = (
            self._on_enter, self._on_exit, self._on_block_enter, self._on_block_exit)
        pos, units, cuda = self._pos, self.units, self.device.type == "cuda"

        def enter(i: int) -> None:
            if self._running == i or (cuda and torch.cuda.is_current_stream_capturing()):
                on_enter(i)
                return
            timeline.wait_begins(i, first=pos[i] == 0)
            on_enter(i)
            timeline.compute_begins(i)

        def leave(i: int) -> None:
            timeline.compute_ends(i)
            on_exit(i)

        def block_enter(b: int) -> None:
            running = self._running
            if running is not None and units[running].block != b:
                timeline.compute_ends(running)
            on_block_enter(b)

        def block_exit(b: int) -> None:
            running = self._running
            if running is not None and units[running].block == b:
                timeline.compute_ends(running)
            on_block_exit(b)

        return enter, leave, block_enter, block_exit

    def _on_enter_resident(self, i: int) -> None:
        # torch.cuda.graph synchronizes the device before capture starts, so the upload is
        # complete there, and a wait on an event from outside a capture would break it.
        # Dynamo cannot trace the wait; a compiled region runs on the stream attach used.
        if torch.compiler.is_compiling() or (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        self._await_resident()

    def _await_resident(self) -> None:
        """Make the current (compute) stream wait for the resident upload, once per stream."""
        ready = self._resident_ready
        if ready is None:
            return
        stream = self._current_stream()
        if stream.cuda_stream not in self._resident_waited:
            stream.wait_event(ready)
            self._resident_waited.add(stream.cuda_stream)

    def _refuse_trace(self, i: int) -> None:
        raise RuntimeError(
            f"block {i} is streamed by the layerwise offload engine, and torch.compile is tracing "
            "its hooks: the engine was attached for eager runs. Attach with compiled=True (Apply "
            "Layerwise Offload does so when it sees the compile), which keeps the hooks outside "
            "compiled graphs.")

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

    def _on_enter(self, i: int) -> None:
        if self._running == i:  # another module of the phase that is running
            return
        self._refuse_capture(i)
        self._await_resident()
        if self._running is not None:  # the previous phase ends here (or a block whose exit never ran)
            self._on_exit(self._running)
        pos = self._pos[i]
        retarget = pos != self._expected
        if retarget:
            self.telemetry.order_misses += 1
            self._expected = pos
        if i not in self._slot_of:
            self.telemetry.sync_fallbacks += 1
            log.debug("unit %d was not prefetched; loading it now", i)
            retarget = True
        if retarget:
            self._fill()
        slot = self._slot_of[i]
        try:
            self._ring.wait_ready(slot)
        except BaseException:  # its copy failed: the slot holds nothing, the next entry loads it again
            self._unreserve(i)
            raise
        views = self._view_cache.get((i, slot))
        if views is None:
            views = self._view_cache[(i, slot)] = self._packs[i].views(
                self._ring.buffers[slot], transformed=self._transform is not None)
        self._packs[i].bind(views)
        self._running = i

    def _on_exit(self, i: int) -> None:
        if self._running != i:
            return
        self._finish(i)
        self._expected = (self._pos[i] + 1) % len(self.streamed_indices)
        self._fill()

    def _on_block_enter(self, b: int) -> None:
        """Phases: a block starts; the running phase of another block ends here at the latest."""
        running = self._running
        if running is not None and self.units[running].block != b:
            self._on_exit(running)

    def _on_block_exit(self, b: int) -> None:
        """Phases: the block returned (or raised), so its running phase is over."""
        running = self._running
        if running is not None and self.units[running].block == b:
            self._on_exit(running)

    def _finish(self, i: int) -> None:
        self._ring.mark_free(self._slot_of[i])
        self._packs[i].release()
        self._unreserve(i)
        self._running = None

    def _fill(self) -> None:
        """Reserve slots for the next ``slots`` streamed blocks, copying only what is not there yet."""
        order = self.streamed_indices
        window = [order[(self._expected + d) % len(order)] for d in range(self._nslots)]
        wanted = set(window)
        for b in [b for b in self._slot_of if b not in wanted and b != self._running]:
            self._unreserve(b)
        taken = set(self._slot_of.values())
        for b in window:
            if b in self._slot_of:
                continue
            free = [s for s in range(self._nslots) if s not in taken]
            if not free:
                break
            holds = self._ring.holds
            slot = next((s for s in free if holds[s] == b), None)
            if slot is None:
                slot = next((s for s in free if holds[s] not in wanted), free[0])
                self._copy_in(slot, b)
            self._slot_of[b] = slot
            taken.add(slot)
            self.telemetry.add_materialized(self._packs[b].nbytes)

    def _copy_in(self, slot: int, b: int) -> None:
        if isinstance(self._ring, CacheRing):
            self._ring.copy_unit(slot, b, self._packs[b].nbytes, self._prepare(b))
        else:
            self._ring.copy_in(slot, self._packs[b].host, b, self._prepare(b))

    def _prepare(self, b: int) -> Callable[[torch.Tensor], None] | None:
        """The step that applies this attach's transform to block ``b``'s fresh slot copy."""
        transform = self._transform
        if transform is None:
            return None
        pack, tel = self._packs[b], self.telemetry

        def prepare(slot: torch.Tensor) -> None:
            tel.transforms += pack.apply_transform(slot, transform)

        return prepare

    def _unreserve(self, b: int) -> None:
        del self._slot_of[b]
        self.telemetry.add_materialized(-self._packs[b].nbytes)
