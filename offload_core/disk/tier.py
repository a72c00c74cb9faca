"""The disk tier of one streamer: its settings, and the steps the streamer takes through it.

When the host RAM the engine may use for weights (``cap_bytes``) is smaller than the packed
model, every pack lives on disk: read in place from the model's own file where its loaded
tensors are that file's bytes, else in a spill file of the engine's own (sources.py decides), and
the streamed units come in through a host cache of at most ``cap_bytes`` (see host_cache.py).
Resident units and the tensors every block shares are read once per attach and uploaded to the
device in cache-entry-sized pieces, so host RAM never holds more than the cache.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..alignment import PAGE, align_up
from ..host.packing import PackedBlock
from ..ordering import for_device
from .cache_rule import entries_needed
from .host_cache import CacheTooSmallError, DiskTelemetry, HostCache
from .in_place import ModelFileMap
from .sources import DiskSources

# Entry size when no unit is streamed: the cache then only stages resident uploads.
STAGING_BYTES = 64 << 20
# Read threads when the read-ahead is left to the planner: one, as the pipeline model plays the disk
# (one reader at the rate it measured); a second reading beside it slowed the step on the disk
# measured (docs/disk-streaming.md), and the planner sets how far the one reads ahead.
AUTO_READERS = 1



@dataclass(frozen=True)
class DiskOptions:
    """``cap_bytes``: host RAM for the streamed weights (the cache); ``workers``: read threads;
    ``spill_dir``: where the spill file goes; ``model_file``: the model's own file and where the
    blocks' tensors are in it (None: every unit goes to the spill file); ``read_ahead``: units
    read ahead of need (None: one per reader; "auto": the streamer's planner chooses, from one)."""

    cap_bytes: int
    workers: int = 2
    spill_dir: str = field(default_factory=tempfile.gettempdir)
    model_file: ModelFileMap | None = None
    read_ahead: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("cap_bytes", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.spill_dir, str) or not self.spill_dir:
            raise ValueError(f"spill_dir must be a folder path, got {self.spill_dir!r}")
        if self.model_file is not None and not isinstance(self.model_file, ModelFileMap):
            raise ValueError(f"model_file must be None or a ModelFileMap, got {self.model_file!r}")
        ahead = self.read_ahead
        if ahead is not None and ahead != "auto" and (isinstance(ahead, bool) or not isinstance(ahead, int)
                                                      or ahead < 1):
            raise ValueError(f"read_ahead must be None, 'auto' or an int >= 1, got {ahead!r}")


class DiskTier:
    """The store and cache of one streamer, created at its first attach over the cap.

    ``close()`` stops the cache's readers, frees its memory and gives the store's descriptors back;
    it runs once for every placement, whatever retires the engine (see LayerwiseStreamer.detach).
    """

    def __init__(self, options: DiskOptions, device: torch.device, pin: bool,
                 ram_budget_bytes: int | None) -> None:
        self.options = options
        self.device = device
        self._pin = pin
        self._ram_budget = ram_budget_bytes
        self.telemetry = DiskTelemetry()
        self.sources: DiskSources | None = None
        self.cache: HostCache | None = None

    @property
    def placed(self) -> bool:
        return self.sources is not None

    def wanted(self, packed_bytes: int) -> bool:
        """Whether the packs go to disk: only when they do not fit the RAM cap."""
        return packed_bytes > self.options.cap_bytes

    # ---------------------------------------------------------------- cache
    def _sizing(self, order: Sequence[int], unit_bytes: dict[int, int], nslots: int,
                largest_pack: int, read_ahead: int | None = None) -> tuple[int, int, int]:
        """(entry bytes, entries, read-ahead depth) for this run; refuses a cap that is too small.
        The depth is ``read_ahead`` (the planner's), else one unit per reader, as far as the
        entries that streaming does not hold allow."""
        cap = self.options.cap_bytes
        if order:
            entry = align_up(max(unit_bytes[u] for u in order), PAGE)
            need = entries_needed(nslots, len(order))
        else:
            entry = align_up(max(PAGE, min(largest_pack, STAGING_BYTES, cap)), PAGE)
            need = 1
        count = cap // entry
        if count < need:
            raise CacheTooSmallError(cap, entry, need)
        fixed = self.options.read_ahead if isinstance(self.options.read_ahead, int) else None
        depth = max(1, min(read_ahead or fixed or self.options.workers, count - need + 1))
        return entry, count, depth

    def check(self, order: Sequence[int], unit_bytes: dict[int, int], nslots: int, largest_pack: int) -> None:
        """Refuse, before anything moves, a cap that cannot hold what streaming needs at once."""
        self._sizing(order, unit_bytes, nslots, largest_pack)

    def open_cache(self, order: Sequence[int], unit_bytes: dict[int, int], nslots: int,
                   largest_pack: int, read_ahead: int | None = None) -> None:
        """Make the cache fit this run's streamed units (kept from the last run when it does):
        entries hold what a read of each unit needs (its packed bytes, or its spans of the
        model's file)."""
        sources = self.sources
        sources.drop_loaded()
        entry, count, depth = self._sizing(order, unit_bytes, nslots, largest_pack, read_ahead)
        # The cap counts units in their packed size; a unit read in place may take a page or two
        # more of its entry (its spans of the file widened to the file system's blocks).
        kinds = sources.kinds()
        unit_bytes = {i: sources.buffer_bytes(i) if i in kinds else n for i, n in unit_bytes.items()}
        if order:
            entry = max(entry, align_up(max(unit_bytes[u] for u in order), PAGE))
        cache = self.cache
        if cache is not None and (cache.entry_bytes != entry or cache.count != count):
            cache.close()
            self.cache = cache = None
        if cache is None:
            self.cache = HostCache(sources, unit_bytes, order, entry_bytes=entry, count=count,
                                   workers=self.options.workers, depth=depth,
                                   pin=self._pin and for_device(self.device).asynchronous,
                                   ram_budget_bytes=self._ram_budget, device=self.device,
                                   telemetry=self.telemetry)
            self.cache.set_order(order, depth, nslots)
        else:
            cache.set_order(order, depth, nslots)

    # ---------------------------------------------------------------- placing
    def place(self, packs: Sequence[PackedBlock], progress: Callable[[int, int], None] | None) -> int:
        """Give every pack its disk home: the model's own file where it serves, else the spill
        file, whose packs are written now and bound to maps of it (also when a write or the
        progress callback raises); returns how many packs held tensors."""
        sources = DiskSources(self.options.spill_dir, self.options.model_file)
        self.sources = sources
        sources.plan(packs)
        return sources.place(progress, len(packs))

    def upload(self, index: int, nbytes: int, dst: torch.Tensor) -> None:
        """Copy pack ``index`` from disk into device memory ``dst`` through one cache entry."""
        entry, buf = self.cache.borrow()
        ordering = for_device(self.device)
        try:
            for pieces in self.sources.read_chunks(index, buf):
                for p in pieces:
                    ordering.copy(dst[p.dst : p.dst + p.nbytes], buf[p.src : p.src + p.nbytes])
                ordering.current_stream().synchronize()  # the entry is read into again for the next piece
        finally:
            self.cache.give_back(entry)

    def check_files(self) -> None:
        """Raise ModelFileChanged if the model's file changed since it was opened."""
        if self.sources is not None:
            self.sources.check()

    def read_back(self) -> int:
        """Read the units streamed from the model's file back into the module's tensors, for a
        run without the engine; returns how many units."""
        return self.sources.read_back() if self.sources is not None else 0

    # ---------------------------------------------------------------- figures
    def cached_units(self) -> set[int]:
        return self.cache.cached_units() if self.cache is not None else set()

    def unit_sources(self) -> dict[int, str]:
        """Pack index -> where its bytes come from: "file" (the model's own file), "checking"
        (the same, until its first read matches the loaded tensors) or "spill"."""
        return self.sources.kinds() if self.sources is not None else {}

    def _source_list(self) -> list[str | None]:
        kinds = self.unit_sources()
        return [kinds.get(i) for i in range(max(kinds, default=-1) + 1)]

    def figures(self) -> dict[str, Any]:
        sources, cache = self.sources, self.cache
        kinds = sources.figures() if sources is not None else {}
        return {
            "active": sources is not None,
            "cap_bytes": self.options.cap_bytes,
            "workers": self.options.workers,
            "spill_dir": self.options.spill_dir,
            "spill_bytes": kinds.get("spill_bytes", 0),
            "spill_written_bytes": kinds.get("spill_written_bytes", 0),
            "spill_units": kinds.get("spill_units", 0),
            "spill_reasons": kinds.get("spill_reasons", {}),
            "model_files": kinds.get("model_files", []),
            "file_units": kinds.get("file_units", 0),
            "file_bytes": kinds.get("file_bytes", 0),
            "checking_units": kinds.get("checking_units", 0),
            # whether the model file was opened with O_DIRECT (page-aligned runs then pass the page
            # cache by), not whether any read did
            "opened_o_direct": kinds.get("direct"),
            # Per pack (the units in order, then the shared tensors): where its bytes come from.
            "unit_sources": self._source_list(),
            "cache_bytes": cache.nbytes if cache is not None else 0,
            "cache_entries": cache.count if cache is not None else 0,
            "cache_entry_bytes": cache.entry_bytes if cache is not None else 0,
            "cache_pinned_bytes": cache.pinned_bytes if cache is not None else 0,
        }

    def close(self) -> None:
        """Free the cache and close the files, once; module tensors keep their maps of the spill
        file, and those read from the model's file stay released (host/released.py)."""
        cache, sources = self.cache, self.sources
        self.cache = self.sources = None
        try:
            if cache is not None:
                cache.close()
        finally:
            if sources is not None:
                sources.close()
