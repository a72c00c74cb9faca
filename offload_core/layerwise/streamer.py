"""Layerwise weight streaming: run a stack of blocks with only some of them on the device.

Each block is packed once into one host buffer (the master, never written back).
Resident blocks are copied to fixed device memory at attach; streamed blocks go
through a ring of ``prefetch + 1`` device slots: while block ``j`` runs, the next
``prefetch`` streamed blocks are copied on a side stream, one copy per block.
After a block runs its module tensors are dropped; the slot is reused once an
event says its last reader finished.  At the end of a pass the first blocks of
the next pass are already being fetched (wrap-around).

Blocks that run out of the expected order (block caches that skip, a block run
twice, a retry after an exception) are still served: the window re-centres on
the block that actually runs and, if its bytes are not in a slot, it is loaded
right away.  That is counted (``sync_fallbacks``, ``order_misses``), never fatal.

Tensors shared *between* blocks stay resident: streaming them with one block
would pull them out from under the other block, and copying them with every
block would re-send the same bytes; they are also usually small (tied norms).
Blocks must not share tensors with modules outside the block list.

A transform (a LoRA merge) never touches the host master: it rewrites the device
copies, the resident buffers once per attach and each streamed block's slot right
after its copy lands.  Host RAM is one copy of the weights with or without it.

On CUDA the compute stream is whatever stream is current when a block runs: it
waits for the resident upload (an event recorded at attach) and for each slot's
copy (per-slot events), so neither has to be the stream attach ran on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..blocks.phases import hooked_modules, own_refs, stream_units, unit_refs
from ..device.hooks import BlockHooks
from ..device.residency import bound_bytes, plan_residency, slot_count
from ..device.slots import SlotRing, resolve_device
from ..device.telemetry import StallTimer, Telemetry
from ..disk.cache_ring import CacheRing
from ..disk.tier import DiskOptions, DiskTier
from ..host.packing import PackedBlock, Transform, alias_key, check_packable, tensor_refs
from ..host.pinned import DEFAULT_CHUNK_BYTES, HostStorage, return_freed_ram
from ..host.staging import PIECE_BYTES

log = logging.getLogger(__name__)

_MiB = 1 << 20


def _check_blocks(blocks: Sequence[nn.Module]) -> list[nn.Module]:
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty: there is nothing to stream")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise ValueError(f"blocks[{i}] is a {type(b).__name__}, not an nn.Module")
    index = {id(b): i for i, b in enumerate(blocks)}
    if len(index) != len(blocks):
        raise ValueError("the same module appears more than once in blocks")
    for i, b in enumerate(blocks):
        for sub in b.modules():
            if sub is not b and id(sub) in index:
                raise ValueError(f"blocks[{index[id(sub)]}] is nested inside blocks[{i}]")
    return blocks


def _check_optional_int(name: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")


class LayerwiseStreamer:
    """Streams the weights of ``blocks`` (run in this order each pass) onto ``device``."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        *,
        resident: int | None = None,
        vram_budget_bytes: int | None = None,
        prefetch: int = 1,
        pin: bool = True,
        ram_budget_bytes: int | None = None,
        host_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timing: bool = True,
        granularity: str = "block",
        disk: DiskOptions | None = None,
    ) -> None:
        self.blocks = _check_blocks(blocks)
        self.device = resolve_device(device)
        self.granularity = granularity
        self.units = stream_units(self.blocks, granularity)
        if disk is not None and not isinstance(disk, DiskOptions):
            raise ValueError(f"disk must be None or DiskOptions, got {disk!r}")
        if not isinstance(pin, bool):
            raise ValueError(f"pin must be a bool, got {pin!r}")
        _check_optional_int("ram_budget_bytes", ram_budget_bytes, 0)
        if isinstance(host_chunk_bytes, bool) or not isinstance(host_chunk_bytes, int) or host_chunk_bytes < 1:
            raise ValueError(f"host_chunk_bytes must be an int >= 1, got {host_chunk_bytes!r}")
        self._settings = {"resident": resident, "vram_budget_bytes": vram_budget_bytes, "prefetch": prefetch}
        self._pin = pin
        self._ram_budget = ram_budget_bytes
        self._chunk_bytes = host_chunk_bytes
        self.telemetry = Telemetry()
        if self.device.type == "cuda" and timing:
            self.telemetry.stalls = StallTimer()
        self._host: HostStorage | None = None
        self._disk = DiskTier(disk, self.device, pin, ram_budget_bytes) if disk is not None else None
        self._bounce: HostStorage | None = None  # pinned staging buffer, kept with the pack if it has pageable blocks
        self._hooks: list[BlockHooks] = []
        self._ring: SlotRing | None = None
        self._transform: Transform | None = None
        self._resident_bufs: list[torch.Tensor] = []
        self._resident_ready: torch.cuda.Event | None = None  # resident upload done (CUDA)
        self._resident_waited: set[int] = set()  # compute streams that already wait for it
        self._slot_of: dict[int, int] = {}  # streamed unit -> slot it holds (in flight or running)
        self._running: int | None = None
        self._expected = 0  # position in streamed_indices of the unit expected next
        self._attached = False
        self._closed = False
        self._plan()

    # ----------------------------------------------------------------- planning
    def _plan(self) -> None:
        """Layout of every unit (a block, or a phase of one) from live metadata (no data moves),
        then residency. Indices of packs, residency and slots are unit indices; with block
        granularity a unit is a block."""
        refs = [unit_refs(u) for u in self.units]
        owners: dict[tuple, set[int]] = {}
        for i, items in enumerate(refs):
            for ref, t in items:
                check_packable(t, ref.label)
                owners.setdefault(alias_key(t), set()).add(i)
        own: list[tuple] = []
        if self.granularity != "block":  # tensors a block uses itself stay on the device
            for b, block in enumerate(self.blocks):
                own += own_refs(block, b, [u for u in self.units if u.block == b])
            for ref, t in own:
                check_packable(t, ref.label)
        shared = {k for k, s in owners.items() if len(s) > 1} | {alias_key(t) for _, t in own}
        self._packs = [
            PackedBlock([(r, t) for r, t in items if alias_key(t) not in shared], index=i)
            for i, items in enumerate(refs)
        ]
        self._shared = PackedBlock(
            [(r, t) for items in [*refs, own] for r, t in items if alias_key(t) in shared], index=-1)
        self._plan_residency()
        self._signature = self._current_signature()
        if shared:
            log.info("%d tensors are shared between units or used by their blocks themselves; they stay "
                     "resident", len(self._shared.entries))

    def _plan_residency(self) -> None:
        sizes = [p.nbytes for p in self._packs]
        settings = self._settings
        if self.granularity != "block" and settings["resident"] is not None:
            # A resident count is in blocks: every phase of the picked blocks stays.
            block_sizes = [sum(sizes[u] for u, unit in enumerate(self.units) if unit.block == b)
                           for b in range(len(self.blocks))]
            blocks = set(plan_residency(block_sizes, self._shared.nbytes, **settings))
            self.resident_indices = [u for u, unit in enumerate(self.units) if unit.block in blocks]
        else:
            self.resident_indices = plan_residency(sizes, self._shared.nbytes, **settings)
        res = set(self.resident_indices)
        self.streamed_indices: list[int] = [i for i in range(len(self.units)) if i not in res]
        self._pos = {b: j for j, b in enumerate(self.streamed_indices)}
        self._slot_bytes = max((sizes[i] for i in self.streamed_indices), default=0)
        self._nslots = slot_count(settings["prefetch"], len(self.streamed_indices))

    def replan(self, *, resident: int | None = None, vram_budget_bytes: int | None = None) -> None:
        """Choose the resident blocks again, e.g. from the device memory free when a run starts.

        Only while detached. The packs do not depend on residency, so a kept pack stays valid.
        """
        if self._attached:
            raise RuntimeError("replan() needs a detached streamer")
        old = self._settings
        self._settings = dict(old, resident=resident, vram_budget_bytes=vram_budget_bytes)
        try:
            self._plan_residency()
        except BaseException:
            self._settings = old
            self._plan_residency()
            raise

    def bound_range(self) -> tuple[int, int]:
        """The bound with every block streamed (the least device memory streaming can work in)
        and with every block resident (the most the engine can use)."""
        sizes = [p.nbytes for p in self._packs]
        prefetch = self._settings["prefetch"]
        return (bound_bytes(sizes, [], self._shared.nbytes, prefetch),
                bound_bytes(sizes, range(len(sizes)), self._shared.nbytes, prefetch))

    def _current_signature(self) -> list[list[tuple[int, str, str, int]]]:
        """Which tensor objects sit in which slots of each block: detects added or replaced tensors."""
        return [
            [(id(ref.module), ref.kind, ref.attr, id(t)) for ref, t in tensor_refs(b, i)]
            for i, b in enumerate(self.blocks)
        ]

    @property
    def packed_bytes(self) -> int:
        """Bytes of the host master (all blocks plus shared tensors)."""
        return sum(p.nbytes for p in self._packs) + self._shared.nbytes

    def bound_bytes(self) -> int:
        """Most weight bytes the settings ever place on the compute device: resident + slots."""
        sizes = [p.nbytes for p in self._packs]
        return bound_bytes(sizes, self.resident_indices, self._shared.nbytes, self._settings["prefetch"])

    def unit_states(self) -> list[str]:
        """Per unit: 'resident' (on the device), 'in_flight' (in a device slot), 'cached' (in the
        host cache), 'disk' (only on disk) or 'streamed' (in the host pack)."""
        res = set(self.resident_indices)
        disk = self._disk is not None and self._disk.placed
        cached = self._disk.cached_units() if disk else set()
        return [
            "resident" if i in res else "in_flight" if self._attached and i in self._slot_of
            else "cached" if i in cached else "disk" if disk else "streamed"
            for i in range(len(self.units))
        ]

    def block_states(self) -> list[str]:
        """Per block, the state of its units (``unit_states``); a block whose phases are in several
        places shows the nearest to the device."""
        rank = ("resident", "in_flight", "cached", "streamed", "disk")
        states = self.unit_states()
        out = ["disk"] * len(self.blocks)
        for unit, state in zip(self.units, states):
            if rank.index(state) < rank.index(out[unit.block]):
                out[unit.block] = state
        return out

    def describe_units(self) -> list[dict]:
        """Each unit: its block, name and bytes."""
        return [{"block": u.block, "name": u.name, "bytes": p.nbytes} for u, p in zip(self.units, self._packs)]

    def host_bytes(self) -> dict[str, int]:
        """Host master size, the tensors in it without alignment padding (a quantized weight's
        inner tensors), and how much of it is page-locked; with disk streaming, what the host
        cache holds and what lives on disk."""
        host = self._host
        out = {
            "packed": self.packed_bytes,
            "tensors": sum(p.tensor_bytes for p in self._packs) + self._shared.tensor_bytes,
            "pinned": host.pinned_bytes if host else 0,
            "pageable": host.pageable_bytes if host else 0,
        }
        disk = self._disk
        if disk is not None:
            figures = disk.figures()
            cached = disk.cached_units()
            out.update(cache=figures["cache_bytes"], cache_pinned=figures["cache_pinned_bytes"],
                       disk=self.packed_bytes - sum(self._packs[i].nbytes for i in cached) if disk.placed else 0)
        return out

    def disk_figures(self) -> dict | None:
        """The disk tier's settings and sizes, None without one."""
        return self._disk.figures() if self._disk is not None else None

    def reset_figures(self) -> None:
        """Zero the counters (the engine's and the disk tier's), e.g. at the start of a run."""
        self.telemetry.reset()
        if self._disk is not None:
            self._disk.telemetry.reset()

    def figures(self, wait: bool = False) -> dict:
        """The telemetry snapshot, with the disk tier's counters when there is one."""
        out = self.telemetry.snapshot(wait=wait)
        if self._disk is not None:
            out.update(self._disk.telemetry.snapshot())
        return out

    @property
    def attached(self) -> bool:
        return self._attached

    # ---------------------------------------------------------------- lifecycle
    def attach(self, transform: Transform | None = None,
               progress: Callable[[int, int], None] | None = None) -> None:
        """Pack (unless a kept pack is still valid), pin, upload residents, allocate slots, install hooks.

        ``transform(block_index, name, view)`` may rewrite a tensor, e.g. to merge a
        LoRA in: it gets the typed *device* view of one tensor and returns a tensor of
        the same shape and dtype, which is written into the view (returning the view
        itself leaves it alone).  It runs on every fresh device copy: the resident
        buffers here, a streamed block's slot after each copy into it.  The host pack
        always keeps the untransformed values, so changing the transform between
        attaches re-packs nothing.  ``progress(done, total)`` is called as blocks are
        packed, because packing and pinning a large model takes seconds.
        """
        if self._closed:
            raise RuntimeError("this streamer is closed")
        if self._attached:
            raise RuntimeError("already attached; call detach() first")
        packs = self._packs + [self._shared]
        if self._host is not None:  # a re-wrap of the same memory leaves the kept pack valid
            adopted = sum(p.adopt() for p in packs)
            if adopted:
                log.info("%d block tensors were re-wrapped over the kept pack; it stays valid", adopted)
        if self._current_signature() != self._signature or not all(p.is_current() for p in packs):
            if self._has_pack():
                log.info("block tensors were re-assigned since the pack was kept; packing from scratch")
                self._free_pack()
            self._plan()
        packed = None
        try:
            packed = self._pack(progress)
            self._transform = transform
            self._materialize()
        except BaseException:
            # A complete pack outlives a failed upload (out of device memory, a merge that
            # failed): the next attach needs no re-pack and no re-pin. A pack cut short is freed.
            self._teardown(keep_pack=packed is not None)
            raise
        self._attached = True
        host = self.host_bytes()
        where = (f"on disk through a {host['cache'] / _MiB:.1f} MiB host cache" if self._disk_active()
                 else f"host {host['packed'] / _MiB:.1f} MiB ({host['pinned'] / _MiB:.1f} MiB pinned)")
        log.info(
            "attached %d blocks as %d %s units (%d resident, %d streamed) to %s: %d slots x %.1f MiB, "
            "bound %.1f MiB, %s, %d units packed, %s",
            len(self.blocks), len(self.units), self.granularity, len(self.resident_indices),
            len(self.streamed_indices), self.device, self._nslots, self._slot_bytes / _MiB,
            self.bound_bytes() / _MiB, where, packed,
            "transform on device copies" if transform is not None else "no transform",
        )  # fmt: skip

    def _disk_active(self) -> bool:
        """Whether the packs live on disk (the disk tier has placed them)."""
        return self._disk is not None and self._disk.placed

    def _has_pack(self) -> bool:
        """Whether a pack (in host RAM or on disk) is kept from an earlier attach."""
        return self._host is not None or self._disk_active()

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
        return [self._packs[i] for i in self.resident_indices] + [self._shared]

    def reclaim(self) -> int:
        """Re-point every block tensor that still shows the kept pack's values at the pack, moving
        no bytes; returns how many tensors were elsewhere.

        Only while detached. Whoever ran the blocks in between (ComfyUI's own load of the same
        model) may have moved our tensor objects to a device, or back to fresh host memory by a
        copy; an object of ours still holds the base values there (computed weights, a merged
        LoRA, go into new objects), so re-pointing it keeps the pack valid and the copy can go,
        instead of packing and pinning the whole model again next attach. Slots holding anything
        else are left alone. Packs the disk tier keeps on disk are not in RAM to point at.
        """
        if self._attached:
            raise RuntimeError("reclaim() needs a detached streamer")
        if self._host is None:
            return 0
        return sum(p.reclaim() for p in self._packs + [self._shared] if p.host is not None)

    def detach(self, keep_pack: bool = False) -> None:
        """Remove hooks, free device memory, give every tensor back bit-for-bit.

        ``keep_pack`` keeps the host master for the next ``attach`` (unchanged CPU
        tensors then alias it); otherwise it is freed and tensors get fresh memory, or, for packs
        on disk, keep their maps of the spill file while the disk tier's readers, cache and
        descriptors are released.
        """
        if self._attached:
            self._teardown(keep_pack)
            log.info("detached (%s the host pack)", "keeping" if keep_pack else "freeing")
        elif not keep_pack and self._has_pack():
            self._free_pack()

    def close(self) -> None:
        """Detach and free everything; the streamer cannot be attached again."""
        self.detach(keep_pack=False)
        self._closed = True

    def _pack(self, progress: Callable[[int, int], None] | None) -> int:
        """Pack every unit into fresh host storage (or, over the disk tier's RAM cap, onto disk)
        unless a valid pack is kept; returns units packed."""
        packs = self._packs + [self._shared]
        if self._disk is not None and (self._disk.placed or self._disk.wanted(self.packed_bytes)):
            return self._pack_on_disk(packs, progress)
        if self._host is not None:
            if progress is not None:
                progress(len(packs), len(packs))
            return 0
        cuda = self.device.type == "cuda"
        if cuda:
            # Taken before the pack, so pinning the pack up to the cap still leaves room for it.
            self._bounce = HostStorage([2 * PIECE_BYTES], pin=True, ram_budget_bytes=self._ram_budget)
            self._bounce.buffer(0)
        self._host = HostStorage(
            [p.nbytes for p in packs],
            pin=self._pin and cuda,  # page-locking only speeds up H2D copies
            ram_budget_bytes=self._ram_budget,
            chunk_bytes=self._chunk_bytes,
        )  # fmt: skip
        count = 0
        for i, p in enumerate(packs):
            p.pack(self._host.buffer(i))
            count += bool(p.entries)
            if progress is not None:
                progress(i + 1, len(packs))
        return_freed_ram()  # the originals just given up may sit in the C heap: hand them to the OS
        if cuda:
            self._settle_bounce()
        self.telemetry.blocks_packed += count
        return count

    def _pack_on_disk(self, packs: list[PackedBlock], progress: Callable[[int, int], None] | None) -> int:
        """Disk tier: place every pack on disk once (kept across attaches), then size the host cache
        for this run's streamed units. The cache's size is checked before anything moves."""
        disk = self._disk
        sizes = {i: p.nbytes for i, p in enumerate(packs)}
        order = list(self.streamed_indices)
        largest = max(sizes.values(), default=0)
        count = 0
        if disk.placed:
            if progress is not None:
                progress(len(packs), len(packs))
        else:
            disk.check(order, sizes, self._nslots, largest)
            count = disk.place(packs, progress)
            return_freed_ram()
            self.telemetry.blocks_packed += count
        disk.open_cache(order, sizes, self._nslots, largest)
        return count

    def _settle_bounce(self) -> None:
        """Keep the staging buffer only if a streamed block's pack is pageable and the buffer is pinned.

        Why stage at all: a copy from pageable memory returns only once the driver has
        staged all of it, so it would hold the sampling thread at every block exit.
        Why not refuse ``pin=False`` on CUDA instead: the pack also turns pageable when
        pinning would exceed the cap, and a model that does not fit the cap must still run.
        """
        bounce, self._bounce = self._bounce, None
        pageable = sum(self._packs[i].nbytes for i in self.streamed_indices if not self._host.is_pinned(i))
        if not pageable:
            bounce.release()
        elif not bounce.is_pinned(0):
            bounce.release()
            log.warning("%.1f MiB of streamed blocks are in pageable RAM and no staging buffer could be pinned: "
                        "their copies will hold up the sampling thread", pageable / _MiB)
        else:
            self._bounce = bounce
            log.info("%.1f MiB of streamed blocks are in pageable RAM: their copies are staged through a "
                     "%.0f MiB pinned buffer by a worker thread", pageable / _MiB, bounce.total_bytes / _MiB)

    def _materialize(self) -> None:
        tel = self.telemetry
        disk = self._disk if self._disk_active() else None
        if disk is None:
            self._host.note_reader(self.device)
        resident = [(i, self._packs[i]) for i in self.resident_indices] + [(len(self._packs), self._shared)]
        for index, p in resident:
            if not p.entries:
                continue
            with torch.inference_mode(False):
                buf = torch.empty(p.nbytes, dtype=torch.uint8, device=self.device)
            self._resident_bufs.append(buf)
            tel.add_device_alloc(p.nbytes)
            if disk is not None:
                disk.upload(index, p.nbytes, buf)
            else:
                buf.copy_(p.host, non_blocking=True)
            if self._transform is not None:  # queued behind the copy on the same stream
                tel.transforms += p.apply_transform(buf, self._transform)
            p.bind(p.views(buf, transformed=self._transform is not None))
            tel.add_materialized(p.nbytes)
        tel.bound_bytes = self.bound_bytes()
        self._slot_of = {}
        self._running = None
        self._expected = 0
        if self.device.type == "cuda":
            self._resident_ready = torch.cuda.Event()
            self._resident_ready.record(torch.cuda.current_stream(self.device))
            self._resident_waited = set()
            # Phases: a block's own tensors are resident, and it may read them before any phase.
            waits = [(i, self.blocks[i]) for i in self.resident_indices] if self.granularity == "block" \
                else list(enumerate(self.blocks))
            self._hooks.append(BlockHooks(waits, self._on_enter_resident))  # never waits on the host
        if not self.streamed_indices:
            return
        if disk is not None:
            self._ring = CacheRing(self.device, self._nslots, self._slot_bytes, tel, disk.cache, disk.telemetry)
        else:
            self._ring = SlotRing(self.device, self._nslots, self._slot_bytes, tel, bounce=self._bounce)
        self._view_cache: dict[tuple[int, int], list[torch.Tensor]] = {}
        for i in self.streamed_indices:
            self._packs[i].release()
        enter, leave = self._timed(self._on_enter), self._timed(self._on_exit)
        if self.granularity == "block":
            self._hooks.append(
                BlockHooks([(i, self.blocks[i]) for i in self.streamed_indices], enter, leave)
            )
        else:
            # A phase starts when any module inside it is called and ends when the next one starts
            # or its block returns.
            members = [(i, m) for i in self.streamed_indices for m in hooked_modules(self.units[i])]
            self._hooks.append(BlockHooks(members, enter))
            streamed_blocks = sorted({self.units[i].block for i in self.streamed_indices})
            self._hooks.append(BlockHooks([(b, self.blocks[b]) for b in streamed_blocks],
                                          self._timed(self._on_block_enter), self._timed(self._on_block_exit)))
        self._fill()
        self._settle_copies()

    def _settle_copies(self) -> None:
        """Wait until a copy worker (the disk tier's, or the staging of pageable packs) has issued
        the copies queued so far, transforms included. A transform binds its unit's tensors while
        it runs, and what the caller does after attach (ComfyUI's model load) must find every
        streamed unit empty. A failed copy is raised when its unit is entered."""
        for ticket in list(getattr(self._ring, "_tickets", {}).values()):
            try:
                ticket.wait()
            except RuntimeError:
                pass

    def _teardown(self, keep_pack: bool) -> None:
        """Undo attach from any partial state: hooks, device memory, bindings, and maybe the pack."""
        for hooks in self._hooks:
            hooks.remove()
        self._hooks = []
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self.device.type == "cuda":  # resident uploads and transforms may be on any stream
            torch.cuda.synchronize(self.device)
        keep = keep_pack and self._has_pack()
        try:
            for i, p in enumerate(self._packs + [self._shared]):
                p.restore(keep_host=keep and p.host is not None)
                if not keep and self._host is not None:
                    self._host.release_item(i)
        finally:
            # Even if a restore failed (out of memory copying back to a device), the engine is
            # no longer attached: a later attach re-checks every tensor and packs what changed.
            self._slot_of = {}
            self._running = None
            self._view_cache = {}
            self._transform = None
            self._resident_ready = None
            self.telemetry.add_device_alloc(-sum(b.numel() for b in self._resident_bufs))
            self.telemetry.add_materialized(-self.telemetry.materialized_bytes)
            self._resident_bufs = []
            self._attached = False
        if not keep:
            self._release_host()

    def _free_pack(self) -> None:
        """Drop a kept pack while detached; slots the caller re-assigned meanwhile keep their new tensors."""
        for i, p in enumerate(self._packs + [self._shared]):
            p.restore(keep_host=False, skip_reassigned=True)
            if self._host is not None:
                self._host.release_item(i)
        self._release_host()

    def _release_host(self) -> None:
        for storage in (self._host, self._bounce):
            if storage is not None:
                storage.release()
        self._host = self._bounce = None
        if self._disk is not None:
            self._disk.close()  # the modules keep copy-on-write maps of their bytes on disk

    # ---------------------------------------------------------------- hot path
    def _timed(self, hook: Callable[[int], None]) -> Callable[[int], None]:
        """``hook`` with its time on the sampling thread added to the telemetry's host waits.

        Not while torch.compile traces: a clock is no graph op, and the hook's own refusal must
        be what a trace of a streamed block meets."""
        tel = self.telemetry

        def timed(i: int) -> None:
            if torch.compiler.is_compiling():
                hook(i)
                return
            start = time.perf_counter()
            try:
                hook(i)
            finally:
                tel.host_wait_s += time.perf_counter() - start

        return timed

    def _on_enter_resident(self, i: int) -> None:
        # torch.cuda.graph synchronizes the device before capture starts, so the upload is
        # complete there, and a wait on an event from outside a capture would break it.
        # Dynamo cannot trace the wait; a compiled region runs on the stream attach used.
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return
        self._await_resident()

    def _await_resident(self) -> None:
        """Make the current (compute) stream wait for the resident upload, once per stream."""
        ready = self._resident_ready
        if ready is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream not in self._resident_waited:
            stream.wait_event(ready)
            self._resident_waited.add(stream.cuda_stream)

    def _refuse_untraceable(self, i: int) -> None:
        """Streamed blocks re-point their weights at a different slot on every pass: a traced or
        captured graph would keep reading whatever the first pass's slot holds later."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"block {i} is streamed by the layerwise offload engine and cannot be traced by "
                "torch.compile: its weights move between device slots on every pass. Compile without "
                "the engine, or keep every block resident."
            )
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"block {i} is streamed by the layerwise offload engine and cannot be captured in a CUDA "
                "graph: its weights move between device slots on every pass. Capture without the engine, "
                "or keep every block resident."
            )

    def _on_enter(self, i: int) -> None:
        if self._running == i:  # another module of the phase that is running
            return
        self._refuse_untraceable(i)
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
