"""Where the streamer's packs live between attaches: host RAM, or the disk tier.

A pack is made once and kept (``detach(keep_pack=True)``): in one host storage, pinned up to the
cap (the machine's one shared store of the same bytes where the caller asks to share:
``sharing/shared_packing.py``), or, when the disk tier's RAM cap is smaller than the model, in the
engine's spill file behind a host cache. On a GPU a small pinned staging buffer comes with a host pack that is not all
pinned. Why stage at all: a copy from pageable memory returns only once the driver has staged all
of it, so it would hold the sampling thread at every block exit. Why not refuse ``pin=False`` on
CUDA instead: the pack also turns pageable when pinning would exceed the cap, and a model that
does not fit the cap must still run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import torch

from ..device.telemetry import Telemetry
from ..disk.sources import read_back_pack
from ..disk.tier import DiskOptions, DiskTier
from ..host.packing import PackedBlock
from ..host.pinned import HostStorage, return_freed_ram
from ..sharing.shared_packing import HostPack, HostShare, pack_host
from ..host.staging import PIECE_BYTES
from ..host.subclass import flatten, is_wrapper
from ..ordering import for_device
from .plan import StreamPlan

log = logging.getLogger(__name__)

_MiB = 1 << 20


class PackStore:
    """The host storage (``host``), staging buffer (``bounce``) and disk tier (``disk``) of one
    streamer's packs. Packs are counted in ``telemetry.blocks_packed``."""

    def __init__(self, device: torch.device, *, pin: bool, ram_budget_bytes: int | None,
                 chunk_bytes: int, disk: DiskOptions | None, telemetry: Telemetry,
                 share: HostShare | None = None) -> None:
        if share is not None and not isinstance(share, HostShare):
            raise ValueError(f"share must be None or HostShare, got {share!r}")
        self.device = device
        self._pin = pin
        self._share = share
        self._packed: HostPack | None = None  # the host pack's storage and, where shared, its store
        self._ram_budget = ram_budget_bytes
        self._chunk_bytes = chunk_bytes
        self._telemetry = telemetry
        self.host: HostStorage | None = None
        self.bounce: HostStorage | None = None  # pinned staging buffer, kept with the pack if it has pageable blocks
        self.disk = DiskTier(disk, device, pin, ram_budget_bytes) if disk is not None else None

    def disk_active(self) -> bool:
        """Whether the packs live on disk (the disk tier has placed them)."""
        return self.disk is not None and self.disk.placed

    def has_pack(self) -> bool:
        """Whether a pack (in host RAM or on disk) is kept from an earlier attach."""
        return self.host is not None or self.disk_active()

    def adopt(self, plan: StreamPlan) -> int:
        """Take back tensors that a re-wrap of the kept pack's memory replaced; returns how many."""
        if self.host is None:
            return 0
        return sum(p.adopt() for p in plan.all_packs())

    def reclaim(self, plan: StreamPlan, tables: Collection[int] | None = None) -> int:
        """Re-point block tensors that still show the kept pack's values at it (see the streamer),
        only those held in ``tables`` when given."""
        if self.host is None:
            return 0
        return sum(p.reclaim(tables) for p in plan.all_packs() if p.host is not None)

    # ----------------------------------------------------------------- packing
    def pack(self, plan: StreamPlan, progress: Callable[[int, int], None] | None) -> int:
        """Pack every unit into fresh host storage (or, over the disk tier's RAM cap, onto disk)
        unless a valid pack is kept; returns units packed."""
        packs = plan.all_packs()
        if self.disk is not None and (self.disk.placed or self.disk.wanted(plan.packed_bytes)):
            return self._pack_on_disk(plan, packs, progress)
        if self.host is not None:
            if progress is not None:
                progress(len(packs), len(packs))
            return 0
        if sum(read_back_pack(p) for p in packs):  # released by an earlier engine on disk
            log.info("[tiered offload] tensors an earlier engine streamed from the model's file were read back "
                     "to be packed in RAM")
        asynchronous = for_device(self.device).asynchronous  # copies to a GPU
        if asynchronous:
            # Taken before the pack, so pinning the pack up to the cap still leaves room for it.
            self.bounce = HostStorage([2 * PIECE_BYTES], pin=True, ram_budget_bytes=self._ram_budget,
                                      label="staging bounce buffer")
            self.bounce.buffer(0)
        self._packed = pack_host(packs, pin=self._pin and asynchronous,  # locking speeds up async copies only
                                 ram_budget_bytes=self._ram_budget, chunk_bytes=self._chunk_bytes,
                                 label="host pack", share=self._share, progress=progress)
        self.host = self._packed.storage
        store = self._packed.store
        count = sum(bool(p.entries) for p in packs) if store is None or store.created else 0
        if asynchronous:
            self._settle_bounce(plan)
        self._telemetry.blocks_packed += count
        return count

    def _pack_on_disk(self, plan: StreamPlan, packs: list[PackedBlock],
                      progress: Callable[[int, int], None] | None) -> int:
        """Disk tier: place every pack on disk once (kept across attaches), then size the host cache
        for this run's streamed units. The cache's size is checked before anything moves."""
        disk = self.disk
        sizes = {i: p.nbytes for i, p in enumerate(packs)}
        order = list(plan.streamed_indices)
        largest = max(sizes.values(), default=0)
        count = 0
        if disk.placed:
            if progress is not None:
                progress(len(packs), len(packs))
        else:
            disk.check(order, sizes, plan.nslots, largest)
            count = disk.place(packs, progress)
            return_freed_ram()
            self._telemetry.blocks_packed += count
        disk.open_cache(order, sizes, plan.nslots, largest, plan.rules.read_ahead)
        return count

    def fit_cache(self, plan: StreamPlan) -> None:
        """Size the disk tier's cache again for ``plan``'s streamed units (a new setting at a pass
        boundary); nothing without packs on disk."""
        if not self.disk_active():
            return
        packs = plan.all_packs()
        sizes = {i: p.nbytes for i, p in enumerate(packs)}
        self.disk.open_cache(list(plan.streamed_indices), sizes, plan.nslots, max(sizes.values(), default=0),
                             plan.rules.read_ahead)

    def _settle_bounce(self, plan: StreamPlan) -> None:
        """Keep the staging buffer only if a streamed block's pack is pageable and the buffer is pinned."""
        bounce, self.bounce = self.bounce, None
        pageable = sum(plan.packs[i].nbytes for i in plan.streamed_indices if not self.host.is_pinned(i))
        if not pageable:
            bounce.release()
        elif not bounce.is_pinned(0):
            bounce.release()
            log.warning("[tiered offload] %.1f MiB of streamed blocks are in pageable RAM and no staging "
                        "buffer could be pinned: their copies will hold up the sampling thread", pageable / _MiB)
        else:
            self.bounce = bounce
            log.info("[tiered offload] %.1f MiB of streamed blocks are in pageable RAM: their copies are staged "
                     "through a "
                     "%.0f MiB pinned buffer by a worker thread", pageable / _MiB, bounce.total_bytes / _MiB)

    # ----------------------------------------------------------------- giving back
    def restore(self, plan: StreamPlan, keep: bool) -> None:
        """Give every block tensor back bit-for-bit: pointing at the kept pack with ``keep``,
        else in fresh memory as each host item is released."""
        for i, p in enumerate(plan.all_packs()):
            p.restore(keep_host=keep and p.host is not None)
            if not keep and self.host is not None:
                self.host.release_item(i)

    def free(self, plan: StreamPlan) -> None:
        """Drop a kept pack while detached; slots the caller re-assigned meanwhile keep their new tensors."""
        for i, p in enumerate(plan.all_packs()):
            p.restore(keep_host=False, skip_reassigned=True)
            if self.host is not None:
                self.host.release_item(i)
        self.release()

    def free_if_written(self, plan: StreamPlan) -> int:
        """Free a kept pack in a shared store whose units someone changed in place since (the
        model's tensors show a copy-on-write mapping of it, ``sharing/store_view.py``): the store,
        which device copies come from, no longer holds the model's values; the next pack starts
        from them. Returns how many units were written."""
        if self._packed is None or self._packed.store is None:
            return 0
        written = len(self._packed.store.view.written_items())
        if written:
            log.info("[tiered offload] %d units of the kept pack were written in place since it was kept (the "
                     "shared store holds the old values); packing again from the model's values", written)
            self.free(plan)
        return written

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a wrapper: each of its inner tensors) lies in the kept host pack."""
        if self.host is None:
            return False
        inner = flatten(t).inner if is_wrapper(t) else (t,)
        return bool(inner) and all(self._packed.holds(x) for x in inner)

    def host_store(self) -> dict | None:
        """Whether the host pack is in a shared store (its folder, file, bytes and how many processes
        map it) or why not (``shared``: False, ``why``); None without a host pack or a wish to share."""
        if self._packed is None or (self._share is None and self._packed.store is None):
            return None
        return self._packed.status()

    def release(self) -> None:
        """Free the host storage (let a shared store go) and staging buffer, and close the disk tier."""
        packed, self._packed = self._packed, None
        if packed is not None:
            packed.release()
        if self.bounce is not None:
            self.bounce.release()
        self.host = self.bounce = None
        if self.disk is not None:
            self.disk.close()  # the modules keep copy-on-write maps of their bytes on disk
