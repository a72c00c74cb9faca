"""Layerwise weight streaming: run a stack of blocks with only some of them on the device.

Each block is packed once into one host buffer (the master, never written back).
Resident blocks are copied to fixed device memory at attach; streamed blocks go
through a ring of ``prefetch + 1`` device slots: while block ``j`` runs, the next
``prefetch`` streamed blocks are copied on a side stream, one copy per block, and
at the end of a pass the first blocks of the next pass are already being fetched.
Blocks must not share tensors with modules outside the block list.

A transform (a LoRA merge) never touches the host master: it rewrites the device
copies, the resident buffers once per attach and each streamed block's slot right
after its copy lands.  Host RAM is one copy of the weights with or without it.

The streamer is the lifecycle (attach, detach, reclaim, close) over five collaborators with one
job each: the plan (plan.py: units, their layouts, residency), the pack store (pack_store.py:
where the packs live between attaches, RAM or disk), the device schedule (schedule.py: one
attach's device memory and hooks, over resident.py's resident units and window.py's hot path,
including blocks that run out of order), the figures (figures.py: states, sizes, counters) and,
for settings left to ``"auto"``, the tuner (tuning.py: measure, plan, apply at a pass boundary,
check, roll back; the schedule is made again around each new setting).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..blocks.phases import stream_units
from ..device.slots import resolve_device
from ..device.telemetry import StallTimer, Telemetry
from ..device.timeline import Timeline
from ..disk.tier import DiskOptions, DiskTier
from ..host.packing import PackedBlock
from ..host.pinned import DEFAULT_CHUNK_BYTES
from ..sharing.shared_packing import HostShare
from ..host.tensor_refs import tables_under
from ..host.transform import Transform
from ..ordering import for_device
from .figures import StreamerFigures
from .pack_store import PackStore
from .pipeline import Setting
from .plan import StreamPlan, check_blocks
from .schedule import DeviceSchedule
from .tuning import AUTO, AutoSettings, ScheduleLost, Tuner

log = logging.getLogger(__name__)

_MiB = 1 << 20


def _check_optional_int(name: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")


def _weak(method: Callable) -> Callable:
    """``method`` of an object, called without keeping the object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            raise RuntimeError("the streamer is gone")
        return bound(*args, **kwargs)

    return call


def _start_read_ahead(disk: DiskTier | None) -> int:
    """Units the disk cache reads ahead before any plan: the options' number; under auto one,
    which leaves the most entries to keep units from step to step; else one per reader."""
    if disk is None:
        return 0
    ahead = disk.options.read_ahead
    return ahead if isinstance(ahead, int) else 1 if ahead == AUTO else disk.options.workers


def _streaming_disk(disk: DiskTier | None, plan: StreamPlan) -> DiskTier | None:
    """The disk tier where the packs go to disk (over its RAM cap); None where they stay in RAM."""
    return disk if disk is not None and (disk.placed or disk.wanted(plan.packed_bytes)) else None


class LayerwiseStreamer(StreamerFigures):
    """Streams the weights of ``blocks`` (run in this order each pass) onto ``device``."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        *,
        resident: int | str | None = None,
        vram_budget_bytes: int | None = None,
        prefetch: int | str = 1,
        pin: bool = True,
        ram_budget_bytes: int | None = None,
        host_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timing: bool = True,
        granularity: str = "block",
        disk: DiskOptions | None = None,
        share: HostShare | None = None,
    ) -> None:
        """``share``: keep the host pack in the machine's one shared store of these bytes, which
        every process streaming the same model maps (``sharing/shared_packing.py``)."""
        blocks = check_blocks(blocks)
        self.device = resolve_device(device)
        units = stream_units(blocks, granularity)
        if disk is not None and not isinstance(disk, DiskOptions):
            raise ValueError(f"disk must be None or DiskOptions, got {disk!r}")
        if not isinstance(pin, bool):
            raise ValueError(f"pin must be a bool, got {pin!r}")
        _check_optional_int("ram_budget_bytes", ram_budget_bytes, 0)
        if isinstance(host_chunk_bytes, bool) or not isinstance(host_chunk_bytes, int) or host_chunk_bytes < 1:
            raise ValueError(f"host_chunk_bytes must be an int >= 1, got {host_chunk_bytes!r}")
        self._ordering = for_device(self.device)
        self.telemetry = Telemetry()
        if self._ordering.asynchronous and timing:
            self.telemetry.stalls = StallTimer(self._ordering)
        self._store = PackStore(self.device, pin=pin, ram_budget_bytes=ram_budget_bytes,
                                chunk_bytes=host_chunk_bytes, disk=disk, telemetry=self.telemetry,
                                share=share)
        self._schedule: DeviceSchedule | None = None
        self._schedule_args: tuple = ()
        self._timeline_wanted = False
        self._attached = False
        self._closed = False
        auto = AutoSettings(resident=resident == AUTO, prefetch=prefetch == AUTO,
                            read_ahead=disk is not None and disk.read_ahead == AUTO)
        self._plan = StreamPlan(blocks, units, granularity, resident=None if auto.resident else resident,
                                vram_budget_bytes=vram_budget_bytes,
                                prefetch=1 if auto.prefetch else prefetch)  # auto: the least it may take
        # With every setting fixed the tuner only says what auto would choose. It calls back through
        # weak references: a streamer dropped is freed at once, with its pack (no cycle to collect).
        self._tuner = Tuner(self._plan, self.device, auto, _weak(self._rebuild), _weak(self.describe_units),
                            functools.partial(_disk_rate, self._store))

    def record_timeline(self, on: bool) -> None:
        """Record (or stop recording) a picture of each pass: copies, waits, compute, disk reads.

        Off by default, because the hot path should do nothing for a picture nobody looks at.
        It takes effect at the next attach, which chooses its hooks once (each attach starts a
        fresh recording while it is on); turning it off while detached drops what was recorded."""
        if not isinstance(on, bool):
            raise ValueError(f"on must be a bool, got {on!r}")
        self._timeline_wanted = on
        if not on and not self._attached:
            self._install_timeline(False)

    def _install_timeline(self, record: bool) -> None:
        timeline = Timeline(self.device, len(self.streamed_indices)) if record else None
        self.telemetry.timeline = timeline
        if self._store.disk is not None:
            self._store.disk.telemetry.timeline = timeline

    def timeline(self) -> dict | None:
        """The last complete pass recorded by ``record_timeline`` (see ``Timeline.last_pass``),
        None when nothing was recorded. Resolves CUDA events, waiting for them: call it after a
        run (or after ``detach``), never from inside a block."""
        timeline = self.telemetry.timeline
        if timeline is None or not self._timeline_wanted:  # the tuner's own recording is not shown
            return None
        return timeline.last_pass(self.describe_units())

    # ---------------------------------------------------------------- lifecycle
    def attach(self, transform: Transform | None = None,
               progress: Callable[[int, int], None] | None = None, *, compiled: bool = False,
               root: nn.Module | None = None) -> None:
        """Pack (unless a kept pack is still valid), pin, upload residents, allocate slots, install hooks.

        ``transform(block_index, name, view)`` may rewrite a tensor, e.g. to merge a
        LoRA in: it gets the typed *device* view of one tensor and returns a tensor of
        the same shape and dtype, which is written into the view (returning the view
        itself leaves it alone).  It runs on every fresh device copy: the resident
        buffers here, a streamed block's slot after each copy into it.  The host pack
        always keeps the untransformed values, so changing the transform between
        attaches re-packs nothing.  ``progress(done, total)`` is called as blocks are
        packed, because packing and pinning a large model takes seconds. ``compiled``: torch.compile
        runs the model (or its blocks); the streamed units' hooks then stay outside compiled
        graphs, which costs a few microseconds per block call that an eager run does not pay. An
        attach without it refuses a trace that reaches its hooks. ``root``: the module whose call
        is one pass over the blocks (the model); with settings left to "auto", the tuner hooks its
        calls to measure the passes and apply new settings between them.
        """
        if self._closed:
            raise RuntimeError("this streamer is closed")
        if self._attached:
            raise RuntimeError("already attached; call detach() first")
        plan, store, tuner = self._plan, self._store, self._tuner
        if tuner is not None:
            disk = _streaming_disk(store.disk, plan)
            start = tuner.attach_setting(plan.rules.vram_budget_bytes, transform is not None,
                                         disk.options.cap_bytes if disk else None, _start_read_ahead(disk))
            if not compiled:  # under a compile the plan the caller checked it against stands
                plan.apply(start.resident, start.prefetch, start.read_ahead or None)
        if adopted := store.adopt(plan):  # a re-wrap of the same memory leaves the kept pack valid
            log.info("[tiered offload] %d block tensors were re-wrapped over the kept pack; it stays valid", adopted)
        store.free_if_written(plan)  # a shared store no longer holds what the model shows
        if not plan.is_current():
            if store.has_pack():
                log.info("[tiered offload] block tensors were re-assigned since the pack was kept; packing from "
                         "scratch")
                store.free(plan)
            plan.lay_out()
        packed = None
        try:
            packed = store.pack(plan, progress)
            on_disk = store.disk_active()
            if not on_disk:
                store.host.note_reader(self.device)
            record = self._timeline_wanted
            if tuner is not None:
                telemetry = self.telemetry
                record = tuner.start(root, lambda: telemetry.timeline, record, compiled)
            self._schedule_args = (transform, compiled)
            self._put_up(record)  # the timeline goes before the first copies, which the first pass waits for
        except BaseException:
            # A complete pack outlives a failed upload (out of device memory, a merge that
            # failed): the next attach needs no re-pack and no re-pin. A pack cut short is freed.
            self._teardown(keep_pack=packed is not None)
            raise
        self._attached = True
        host = self.host_bytes()
        where = (f"on disk through a {host['cache'] / _MiB:.1f} MiB host cache" if store.disk_active()
                 else f"host {host['packed'] / _MiB:.1f} MiB ({host['pinned'] / _MiB:.1f} MiB pinned)")
        log.info(
            "[tiered offload] attached %d blocks as %d %s units (%d resident, %d streamed) to %s: %d slots x %.1f MiB, "
            "bound %.1f MiB, %s, %d units packed, %s",
            len(plan.blocks), len(plan.units), plan.granularity, len(plan.resident_indices),
            len(plan.streamed_indices), self.device, plan.nslots, plan.slot_bytes / _MiB,
            plan.bound_bytes() / _MiB, where, packed,
            "transform on device copies" if transform is not None else "no transform",
        )  # fmt: skip

    def refresh_transform(self) -> int:
        """The transform changed between passes (``transform_now``): see ``DeviceSchedule``'s."""
        return self._schedule.refresh_transform() if self._attached and self._schedule is not None else 0

    def conceal_resident(self) -> None:
        """Unset the resident blocks' tensors (and shared ones) in their modules until
        reveal_resident() or detach.

        Streamed blocks hold no tensors between uses, so a framework that sizes, moves or
        patches module tensors in between (ComfyUI's model load) sees every block as empty and
        leaves it alone. Its own count of device memory then excludes the engine's, which the
        caller adds from bound_bytes(). Nothing may run the blocks until reveal_resident().
        """
        for pack in self._resident_packs("conceal_resident"):
            pack.conceal()

    def reveal_resident(self) -> None:
        for pack in self._resident_packs("reveal_resident"):
            pack.reveal()

    def _resident_packs(self, caller: str) -> list[PackedBlock]:
        if not self._attached:
            raise RuntimeError(f"{caller}() needs an attached streamer")
        return self._plan.resident_packs()

    def reclaim(self, within: nn.Module | None = None) -> int:
        """Re-point every block tensor that still shows the kept pack's values at the pack, moving
        no bytes; returns how many tensors were elsewhere. With ``within``, only the tensors of
        that module and the modules under it: the owner is about to move just that module (a
        partial unload) and still counts the others where they are.

        Only while detached. Whoever ran the blocks in between (ComfyUI's own load of the same
        model) may have moved our tensor objects to a device, or back to fresh host memory by a
        copy; an object of ours still holds the base values there (computed weights, a merged
        LoRA, go into new objects), so re-pointing it keeps the pack valid and the copy can go,
        instead of packing and pinning the whole model again next attach. Slots holding anything
        else are left alone. Packs the disk tier keeps on disk are not in RAM to point at.
        """
        if self._attached:
            raise RuntimeError("reclaim() needs a detached streamer")
        return self._store.reclaim(self._plan, None if within is None else tables_under(within))

    def detach(self, keep_pack: bool = False, check: bool = True) -> None:
        """Remove hooks, free device memory, give every tensor back bit-for-bit.

        ``keep_pack`` keeps the host master for the next ``attach`` (unchanged CPU
        tensors then alias it); otherwise it is freed and tensors get fresh memory, or, for packs
        on disk, keep their maps of the spill file while the disk tier's readers, cache and
        descriptors are released. Then (``check``) a model file read in place is checked:
        ModelFileChanged, naming it, if it changed since it was opened, so the run that read it
        fails before its result is used.
        """
        if self._attached:
            self._teardown(keep_pack)
            log.debug("[tiered offload] detached (%s the host pack)",
                      "keeping" if keep_pack else "freeing")  # under the progress bar
            if check:
                self.check_files()
        elif not keep_pack and self._store.has_pack():
            self._store.free(self._plan)

    def check_files(self) -> None:
        """ModelFileChanged (naming the file) if a model file the disk tier reads in place changed
        since it was opened (``detach`` calls it)."""
        if self._store.disk is not None:
            self._store.disk.check_files()

    def read_back(self) -> int:
        """While detached: give the tensors the disk tier reads from the model's own file (between
        runs they hold no bytes) their values in fresh RAM, for a run without the engine; returns
        how many units. ModelFileChanged if the file changed since they were read from it."""
        if self._attached:
            raise RuntimeError("read_back() needs a detached streamer")
        return self._store.disk.read_back() if self._store.disk is not None else 0

    def close(self) -> None:
        """Detach (unchecked: nothing of it is used any more) and free everything; the streamer
        cannot be attached again."""
        self.detach(keep_pack=False, check=False)
        if self._tuner is not None:
            self._tuner.close()
        self._closed = True

    def _put_up(self, record: bool) -> None:
        """The device schedule of the plan's setting (and a picture of its passes with ``record``)."""
        transform, compiled = self._schedule_args
        store = self._store
        self._install_timeline(record)
        on_disk = store.disk_active()
        self._schedule = DeviceSchedule(self._plan, self.device, self.telemetry, transform,
                                        store.disk if on_disk else None, store.bounce, compiled)
        self._schedule.start()

    def _take_down(self) -> None:
        """The device schedule goes, between two passes: no block runs and every copy has landed."""
        schedule, self._schedule = self._schedule, None
        if schedule is None:
            return
        schedule.stop()
        self._ordering.synchronize()
        for pack in self._plan.resident_packs():
            pack.release()  # nothing may hold the resident buffers once they are given back
        schedule.release()
        self.telemetry.add_materialized(-self.telemetry.materialized_bytes)  # nothing is on the device

    def _rebuild(self, setting: Setting | None, record: bool) -> None:
        """At a pass boundary: the device schedule made again around ``setting`` (None: the same
        one), recorded or not. If it cannot be made (out of memory), the old one is made again and
        the error raised; if that fails too, ScheduleLost."""
        if setting is None:  # only the picture starts or stops: the schedule stays
            self._install_timeline(record)
            self._schedule.record(self.telemetry.timeline)
            return
        plan = self._plan
        old = plan.rules
        self._take_down()
        try:
            plan.apply(setting.resident, setting.prefetch, setting.read_ahead or None)
            self._store.fit_cache(plan)
            self._put_up(record)
        except BaseException:
            self._take_down()
            plan.restore(old)
            try:
                self._store.fit_cache(plan)
                self._put_up(record)
            except BaseException as again:
                raise ScheduleLost(f"the streaming schedule could not be made again: {again}") from again
            raise

    def _teardown(self, keep_pack: bool) -> None:
        """Undo attach from any partial state: hooks, device memory, bindings, and maybe the pack."""
        if self._tuner is not None:
            self._tuner.stop()
        schedule = self._schedule
        if schedule is not None:
            schedule.stop()
        self._ordering.synchronize()  # resident uploads and transforms may be on any stream
        keep = keep_pack and self._store.has_pack()
        try:
            self._store.restore(self._plan, keep)
        finally:
            # Even if a restore failed (out of memory copying back to a device), the engine is
            # no longer attached: a later attach re-checks every tensor and packs what changed.
            if schedule is not None:
                schedule.release()
            self._schedule = None
            self._schedule_args = ()  # the transform holds its model's patches: not past the attach
            self.telemetry.add_materialized(-self.telemetry.materialized_bytes)
            self._attached = False
        if not keep:
            self._store.release()


def _disk_rate(store: PackStore) -> float | None:
    """Bytes per ms the disk tier read at while reading, this run; None before a read."""
    disk = store.disk
    figures = disk.telemetry.snapshot() if disk is not None else {}
    busy = figures.get("disk_read_busy_s")
    return figures["disk_bytes_read"] / busy / 1000.0 if busy else None
