"""One attach's device side: the resident units and the streaming window, wired to the blocks.

Made at each attach from the plan and dropped at detach. Two parts hold the device memory: the
resident units (``resident.py``: copied once into device buffers of their own) and the streaming
window over the slot ring (``window.py``: the hot path that binds each streamed unit to a slot
and copies the next ones in). This module makes them, installs the block hooks that call into
them, and takes them down again.

The hooks call straight into the window's methods (``StreamWindow.enter`` and ``exit``, each
wrapped once in ``_timed``): the hot path is those methods, ``fill`` and ``_copy_in``. A picture
of a pass (``device/timeline.py``) is recorded when ``telemetry.timeline`` is set at ``start``:
the hooks are then wrapped once more (``_recording``); otherwise the hot path has no trace of it
beyond the ring's one check per copy.

torch.compile: the hooks of streamed units run eagerly, outside any compiled graph
(``device/hooks.py``), only where the attach is told of a compile (``compiled``): keeping a hook
out of dynamo's trace costs a few microseconds per call, which an eager run need not pay. An
attach not told of a compile refuses a trace on its hooks' first line (``_refuse_trace``). The
resident units' wait stays traceable and does nothing in a graph, so a model with every block
resident keeps one whole graph.
"""

from __future__ import annotations

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
from ..ordering import for_device
from .plan import StreamPlan
from .resident import ResidentUnits
from .window import StreamWindow


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
        self.telemetry = telemetry
        self._plan = plan
        self._transform = transform
        self._disk = disk
        self._bounce = bounce
        self._hooks: list[BlockHooks] = []  # the resident units' wait
        self._streamed_hooks: list[BlockHooks] = []
        self._resident = ResidentUnits(plan, device, for_device(device), telemetry, transform, disk)
        self._window: StreamWindow | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Upload the resident units, allocate the slots, install the hooks, start the first copies."""
        plan, tel, disk, resident = self._plan, self.telemetry, self._disk, self._resident
        resident.upload()
        tel.bound_bytes = plan.bound_bytes()
        tel.peak_bound_bytes = max(tel.peak_bound_bytes, tel.bound_bytes)
        if resident.uploaded:  # without an upload, compute has nothing to wait for
            # Phases: a block's own tensors are resident, and it may read them before any phase.
            waits = [(i, plan.blocks[i]) for i in plan.resident_indices] if plan.granularity == "block" \
                else list(enumerate(plan.blocks))
            self._hooks.append(BlockHooks(waits, resident.enter, eager=False))  # never waits on the host
        if not plan.streamed_indices:
            return
        if disk is not None:
            ring = CacheRing(self.device, plan.nslots, plan.slot_bytes, tel, disk.cache, disk.telemetry)
        else:
            ring = SlotRing(self.device, plan.nslots, plan.slot_bytes, tel, bounce=self._bounce,
                            worker=self._transform is not None)
        self._window = window = StreamWindow(plan, ring, self.device, tel, self._transform, resident.wait)
        for i in plan.streamed_indices:
            plan.packs[i].release()
        self._install_streamed_hooks(window)
        window.fill()
        # A copy worker (the disk tier's, or the staging of pageable packs) may still be issuing the
        # copies queued so far, transforms included. A transform binds its unit's tensors while it
        # runs, and what the caller does after attach (ComfyUI's model load) must find every
        # streamed unit empty. A failed copy is raised when its unit is entered.
        ring.wait_issued()

    def stop(self) -> None:
        """Remove the hooks and close the slot ring (waiting for its copies)."""
        for hooks in self._hooks + self._streamed_hooks:
            hooks.remove()
        self._hooks, self._streamed_hooks = [], []
        if self._window is not None:
            self._window.close()

    def release(self) -> None:
        """Forget the slots' contents and give the resident buffers back, with their count."""
        if self._window is not None:
            self._window.release()
            self._window = None
        self._transform = None
        self._resident.release()

    def record(self, timeline: Timeline | None) -> None:
        """Between two passes: record the next passes into ``timeline`` (None: stop recording). The
        streamed hooks are installed again, with or without the marks; nothing else changes."""
        self.telemetry.timeline = timeline
        window = self._window
        if window is None:
            return
        for hooks in self._streamed_hooks:
            hooks.remove()
        self._streamed_hooks = []
        window.ring.record(timeline)
        self._install_streamed_hooks(window)

    def refresh_transform(self) -> int:
        """Between two passes, the transform changed (``host.transform.transform_now``): streamed
        units prefetched with the old one are copied again (resident units are the changer's to
        rewrite in place). Returns how many."""
        return self._window.refresh() if self._window is not None else 0

    def in_flight_units(self) -> set[int]:
        """Streamed units that hold a slot now (copying, ready or running)."""
        return self._window.in_flight() if self._window is not None else set()

    # ---------------------------------------------------------------- hooks
    def _install_streamed_hooks(self, window: StreamWindow) -> None:
        """The window's steps as hooks on the streamed units' modules (and, for phases, on their
        blocks), timed, and recorded when the attach records a timeline."""
        plan, timeline = self._plan, self.telemetry.timeline
        hooks = (window.enter, window.exit, window.block_enter, window.block_exit)
        if timeline is not None:  # chosen once per attach: while off, no hook looks for it
            hooks = self._recording(window, timeline)
        enter = self._timed_wait(hooks[0], window)
        leave, block_enter, block_exit = (self._timed(h) for h in hooks[1:])
        eager = self._compiled
        if plan.granularity == "block":
            self._streamed_hooks.append(
                BlockHooks([(i, plan.blocks[i]) for i in plan.streamed_indices], enter, leave, eager=eager)
            )
        else:
            # A phase starts when any module inside it is called and ends when the next one starts
            # or its block returns.
            members = [(i, m) for i in plan.streamed_indices for m in hooked_modules(plan.units[i])]
            self._streamed_hooks.append(BlockHooks(members, enter, eager=eager))
            streamed_blocks = sorted({plan.units[i].block for i in plan.streamed_indices})
            self._streamed_hooks.append(BlockHooks([(b, plan.blocks[b]) for b in streamed_blocks],
                                          block_enter, block_exit, eager=eager))

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

    def _timed_wait(self, hook: Callable[[int], None], window: StreamWindow) -> Callable[[int], None]:
        """The enter hook, timed like the others, and the unit's wait measured for
        ``Telemetry.compute_wait_s``: between two events on the compute stream (with the
        sampling thread's time beside it) where copies are asynchronous, else the sampling
        thread's time, copies made inside it included. Another module of the phase that runs
        waits for nothing, as the picture of a pass counts it; nor does a CUDA graph's capture,
        which the hook refuses."""
        tel, stalls = self.telemetry, self.telemetry.stalls
        ordering = for_device(self.device)
        current, synchronous, cuda = ordering.current_stream, not ordering.asynchronous, self.device.type == "cuda"

        def enter(i: int) -> None:
            if torch.compiler.is_compiling():
                self._refuse_trace(i)
            waits = window.running != i and not (cuda and torch.cuda.is_current_stream_capturing())
            start = time.perf_counter()
            stream = current() if waits and stalls is not None else None  # compute's, for the hook
            pair = stalls.begin(stream) if stream is not None else None
            tel.in_wait = waits and synchronous
            try:
                hook(i)
            finally:
                tel.in_wait = False
                host = time.perf_counter() - start
                tel.host_wait_s += host
                if waits:
                    tel.wait_host_s += host
                    if pair is not None:
                        stalls.end(pair, stream, host)
                    elif synchronous:
                        tel.sync_wait_s += host

        return enter

    def _recording(self, window: StreamWindow, timeline: Timeline) -> tuple[Callable[[int], None], ...]:
        """The window's four steps, each telling ``timeline`` where a unit's wait and compute begin
        and end.

        A unit's wait is its whole enter hook (on CUDA, the compute stream's wait for the slot
        between two events; on the host, the hook's time, the way ``host_wait_s`` counts it);
        its compute runs from there to its exit, or to the next unit's wait for a phase ended by
        the next one. Not while a CUDA graph captures: the plain hook refuses that, and a mark
        there would be no graph op."""
        on_enter, on_exit, on_block_enter, on_block_exit = (
            window.enter, window.exit, window.block_enter, window.block_exit)
        pos, units, cuda = self._plan.pos, self._plan.units, self.device.type == "cuda"

        def enter(i: int) -> None:
            if window.running == i or (cuda and torch.cuda.is_current_stream_capturing()):
                on_enter(i)
                return
            timeline.wait_begins(i, first=pos[i] == 0)
            on_enter(i)
            timeline.compute_begins(i)

        def leave(i: int) -> None:
            timeline.compute_ends(i)
            on_exit(i)

        def block_enter(b: int) -> None:
            running = window.running
            if running is not None and units[running].block != b:
                timeline.compute_ends(running)
            on_block_enter(b)

        def block_exit(b: int) -> None:
            running = window.running
            if running is not None and units[running].block == b:
                timeline.compute_ends(running)
            on_block_exit(b)

        return enter, leave, block_enter, block_exit

    def _refuse_trace(self, i: int) -> None:
        raise RuntimeError(
            f"block {i} is streamed by the layerwise offload engine, and torch.compile is tracing "
            "its hooks: the engine was attached for eager runs. Attach with compiled=True (Apply "
            "Layerwise Offload does so when it sees the compile), which keeps the hooks outside "
            "compiled graphs.")
