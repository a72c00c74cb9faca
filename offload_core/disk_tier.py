"""The disk tier of one streamer: its settings, and the steps the streamer takes through it.

When the host RAM the engine may use for weights (``cap_bytes``) is smaller than the packed
model, every pack lives on disk (the model's own file where its bytes match, else a spill file:
see disk.py) and the streamed units come in through a host cache of at most ``cap_bytes`` (see
host_cache.py). Resident units and the tensors every block shares are read once per attach and
uploaded to the device in cache-entry-sized pieces, so host RAM never holds more than the cache.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .disk import PAGE, DiskStore, ModelFile, align_up, size_text
from .host_cache import CacheTooSmallError, DiskTelemetry, HostCache
from .packing import PackedBlock
from .pinned import HostStorage

log = logging.getLogger(__name__)

# Entry size when no unit is streamed: the cache then only stages resident uploads.
STAGING_BYTES = 64 << 20
CPU_ALIGN = 64  # torch's CPU allocator alignment


@dataclass(frozen=True)
class DiskOptions:
    """``cap_bytes``: host RAM for the streamed weights (the cache); ``workers``: read threads;
    ``spill_dir``: where the spill file goes; ``model_file``: the model's own file, or a callable
    that finds it when the packs are first placed (then the tensors hold their base weights)."""

    cap_bytes: int
    workers: int = 2
    spill_dir: str = field(default_factory=tempfile.gettempdir)
    model_file: ModelFile | Callable[[], ModelFile | None] | None = None

    def __post_init__(self) -> None:
        for name in ("cap_bytes", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.spill_dir, str) or not self.spill_dir:
            raise ValueError(f"spill_dir must be a folder path, got {self.spill_dir!r}")


class DiskTier:
    """The store and cache of one streamer, created at its first attach over the cap."""

    def __init__(self, options: DiskOptions, device: torch.device, pin: bool,
                 ram_budget_bytes: int | None) -> None:
        self.options = options
        self.device = device
        self._pin = pin
        self._ram_budget = ram_budget_bytes
        self.telemetry = DiskTelemetry()
        self.store: DiskStore | None = None
        self.cache: HostCache | None = None
        self.placed_from_file = 0
        self.placed_spilled = 0
        self.model_file: ModelFile | None = None  # found at the first placement

    @property
    def placed(self) -> bool:
        return self.store is not None

    def wanted(self, packed_bytes: int) -> bool:
        """Whether the packs go to disk: only when they do not fit the RAM cap."""
        return packed_bytes > self.options.cap_bytes

    # ---------------------------------------------------------------- cache
    def _sizing(self, order: Sequence[int], unit_bytes: dict[int, int], nslots: int,
                largest_pack: int) -> tuple[int, int, int]:
        """(entry bytes, entries, read-ahead depth) for this run; refuses a cap that is too small."""
        cap = self.options.cap_bytes
        if order:
            entry = align_up(max(unit_bytes[u] for u in order), PAGE)
            # Every slot's copy in flight plus one unit read ahead, unless every streamed unit fits.
            need = min(nslots + 1, len(order))
        else:
            entry = align_up(max(PAGE, min(largest_pack, STAGING_BYTES, cap)), PAGE)
            need = 1
        count = cap // entry
        if count < need:
            raise CacheTooSmallError(cap, entry, need)
        depth = max(1, min(self.options.workers, count - need + 1))
        return entry, count, depth

    def check(self, order: Sequence[int], unit_bytes: dict[int, int], nslots: int, largest_pack: int) -> None:
        """Refuse, before anything moves, a cap that cannot hold what streaming needs at once."""
        self._sizing(order, unit_bytes, nslots, largest_pack)

    def open_cache(self, order: Sequence[int], unit_bytes: dict[int, int], nslots: int,
                   largest_pack: int) -> None:
        """Make the cache fit this run's streamed units (kept from the last run when it does)."""
        entry, count, depth = self._sizing(order, unit_bytes, nslots, largest_pack)
        cache = self.cache
        if cache is not None and (cache.entry_bytes != entry or cache.count != count):
            cache.close()
            self.cache = cache = None
        if cache is None:
            self.cache = HostCache(self.store, unit_bytes, order, entry_bytes=entry, count=count,
                                   workers=self.options.workers, depth=depth,
                                   pin=self._pin and self.device.type == "cuda",
                                   ram_budget_bytes=self._ram_budget, device=self.device,
                                   telemetry=self.telemetry)
        else:
            cache.set_order(order, depth)

    # ---------------------------------------------------------------- placing
    def place(self, packs: Sequence[PackedBlock], progress: Callable[[int, int], None] | None) -> int:
        """Put every pack on disk (see DiskStore.place); returns how many packs held tensors."""
        src = self.options.model_file
        if callable(src) and not isinstance(src, ModelFile):
            src = src()
        self.model_file = src
        # A CPU device computes on the host maps between runs: they must be aligned like the
        # allocator's memory (64 bytes) for the same results. A GPU copies them first.
        store = DiskStore(self.options.spill_dir, src, align=CPU_ALIGN if self.device.type == "cpu" else 1)
        self.store = store
        largest = align_up(max((p.nbytes for p in packs), default=0), PAGE)
        scratch = HostStorage([largest, largest], pin=False, ram_budget_bytes=0)
        count = 0
        try:
            a, b = scratch.buffer(0), scratch.buffer(1)
            for i, p in enumerate(packs):
                if p.entries:
                    kind = store.place(i, p, a, b)
                    count += 1
                    if kind == "file":
                        self.placed_from_file += p.nbytes
                    else:
                        self.placed_spilled += p.nbytes
                if progress is not None:
                    progress(i + 1, len(packs))
        finally:
            scratch.release()
        store.finish()
        log.info("disk stream: %s of blocks read from the model's own file%s, %s spilled",
                 size_text(self.placed_from_file), f" ({os.path.basename(src.path)})" if src else "",
                 size_text(self.placed_spilled))
        return count

    def upload(self, index: int, nbytes: int, dst: torch.Tensor) -> None:
        """Copy pack ``index`` from disk into device memory ``dst`` through one cache entry."""
        entry, buf = self.cache.borrow()
        cuda = self.device.type == "cuda"
        try:
            for start in range(0, nbytes, buf.numel()):
                n = self.store.read(index, buf, start, buf.numel())
                dst[start : start + n].copy_(buf[:n], non_blocking=cuda)
                if cuda:  # the entry is read into again for the next piece
                    torch.cuda.current_stream(self.device).synchronize()
        finally:
            self.cache.give_back(entry)

    # ---------------------------------------------------------------- figures
    def cached_units(self) -> set[int]:
        return self.cache.cached_units() if self.cache is not None else set()

    def figures(self) -> dict[str, Any]:
        store, cache = self.store, self.cache
        model = self.model_file
        return {
            "active": store is not None,
            "cap_bytes": self.options.cap_bytes,
            "workers": self.options.workers,
            "spill_dir": self.options.spill_dir,
            "model_file": model.path if model is not None else None,
            "model_file_error": store.model_file_error if store is not None else None,
            "file_bytes": self.placed_from_file,
            "spill_bytes": store.spill_bytes if store is not None else 0,
            "cache_bytes": cache.nbytes if cache is not None else 0,
            "cache_entries": cache.count if cache is not None else 0,
            "cache_entry_bytes": cache.entry_bytes if cache is not None else 0,
            "cache_pinned_bytes": cache.pinned_bytes if cache is not None else 0,
        }

    def source_of(self, index: int) -> str | None:
        return self.store.source_of(index) if self.store is not None else None

    def close(self) -> None:
        """Free the cache and close the store; module tensors keep their maps of the bytes."""
        cache, store = self.cache, self.store
        self.cache = self.store = None
        self.model_file = None
        self.placed_from_file = self.placed_spilled = 0
        try:
            if cache is not None:
                cache.close()
        finally:
            if store is not None:
                store.close()
