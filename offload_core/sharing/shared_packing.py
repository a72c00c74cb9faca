"""Packing blocks into host memory: into the machine's one shared store of their bytes where the
caller asks for it and it can be had, else into memory of this process's own, saying why.

The order of preference: a store in shared memory, then one in a disk folder the server's owner
allows (``HostShare.folders``), then private memory. A private copy is never silent: the reason
goes to the log and to the figures a panel shows (``HostPack.status``).

Joining a store costs no packing, only one read of it: the process compares every byte of the
store with the tensors it loaded itself (``store_key.first_difference``), then points its blocks
at the store's bytes and lets its own go; a store that differs is never joined again. Writing one
packs as a private pack does, block by block (each block's originals go as soon as its bytes are
in the store, so a model is never held twice), into a writable mapping. Device copies come from
the store's read-only mapping; the model's tensors show a copy-on-write one (``store_view``), so
a write in place never reaches the store. Whatever goes wrong part-way hands every block taken
from the store its values back in fresh memory before the store is let go: nothing is lost, and
a reason a private copy cures (no room) packs privately instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..host.packing import PackedBlock
from ..host.pinned import HostStorage, return_freed_ram
from .shared_store import SharedHostStore
from .store_folder import StoreFolder, StoreUnavailable
from .store_key import StoreKey, first_difference, layout_signature

log = logging.getLogger(__name__)

# Store files (``SharedHostStore.identity``) found to hold other bytes than this process loaded:
# never joined again by this process, whatever their header says.
_distrusted: set[tuple[str, int, int]] = set()


@dataclass(frozen=True)
class HostShare:
    """A caller's wish to share: where the bytes come from (``source``: the model file's identity
    and the options it was loaded with, JSON-able) and where stores may live, in order of
    preference (``folders``: shared memory first, then a disk folder)."""

    source: Mapping[str, Any]
    folders: tuple[StoreFolder, ...]


@dataclass
class HostPack:
    """Packs in host memory: the ``storage`` their views come from, the ``store`` it maps (None:
    private memory) and what a person reads about it (``status``)."""

    storage: HostStorage
    store: SharedHostStore | None = None
    why_private: str | None = None  # why the packs are not in a shared store, when they were asked to be
    details: dict[str, Any] = field(default_factory=dict)

    def status(self) -> dict[str, Any]:
        """``shared`` (bool), and where with how many processes, or why not."""
        store = self.store
        if store is None:
            return {"shared": False, "why": self.why_private}
        users = store.users()
        return {"shared": True, "folder": store.folder.path, "kind": store.folder.kind, "file": store.name,
                "bytes": store.file_bytes, "users": users, "created_here": store.created}

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in the packs' memory: the storage, or what a store shows."""
        return self.storage.holds(t) or (self.store is not None and self.store.view.shows(t))

    def release(self) -> None:
        """Free the storage; a store is let go (the last process to let go removes it)."""
        if self.store is not None:
            self.store.release()
        else:
            self.storage.release()


def pack_host(packs: Sequence[PackedBlock], *, pin: bool, ram_budget_bytes: int | None, chunk_bytes: int,
              label: str, share: HostShare | None,
              progress: Callable[[int, int], None] | None = None) -> HostPack:
    """Pack ``packs`` (item ``i`` is ``packs[i]``) into a shared store where ``share`` asks for one
    and it can be had, else into private host storage."""
    why = None
    if share is not None:
        reasons = []
        for folder in share.folders:  # the next folder is tried where one cannot hold the store
            try:
                return _pack_shared(packs, share, folder, pin=pin, ram_budget_bytes=ram_budget_bytes,
                                    chunk_bytes=chunk_bytes, label=label, progress=progress)
            except StoreUnavailable as e:
                reasons.append(str(e))
                log.debug("[tiered offload] %s: not in a shared store in %s: %s", label, folder.path, e)
        why = "; ".join(reasons) or "no folder for shared host stores"
        log.warning("[tiered offload] %s: packed in this process's own memory, not shared with other processes: %s",
                    label, why)
    storage = HostStorage([p.nbytes for p in packs], pin=pin, ram_budget_bytes=ram_budget_bytes,
                          chunk_bytes=chunk_bytes, label=label)
    try:
        for i, p in enumerate(packs):
            p.pack(storage.buffer(i))
            if progress is not None:
                progress(i + 1, len(packs))
    except BaseException:
        _undo(packs, storage)
        raise
    return_freed_ram()  # the originals just given up may sit in the C heap: hand them to the OS
    return HostPack(storage, why_private=why)


def _pack_shared(packs: Sequence[PackedBlock], share: HostShare, folder: StoreFolder, *, pin: bool,
                 ram_budget_bytes: int | None, chunk_bytes: int, label: str,
                 progress: Callable[[int, int], None] | None) -> HostPack:
    total = len(packs)
    waiting = None if progress is None else (lambda: progress(0, total))  # an interrupt ends the wait
    folder.sweep_if_due()  # stores of processes that ended since the last look go first
    store = SharedHostStore.open(folder, lambda spans: StoreKey(share.source, layout_signature(packs, spans)),
                                 [p.nbytes for p in packs], pin=pin, ram_budget_bytes=ram_budget_bytes,
                                 chunk_bytes=chunk_bytes, label=label, waiting=waiting)
    storage = store.storage
    try:
        if not store.writing:
            if store.identity() in _distrusted:
                raise StoreUnavailable(f"the store {store.name} differed from this process's weights before; "
                                       "it is not joined again")
            differs = first_difference(packs, [storage.buffer(i) for i in range(total)])
            if differs is not None:
                _distrusted.add(store.identity())
                raise StoreUnavailable(
                    f"the store {store.name} holds other bytes than this process loaded from the same file "
                    f"(first at {differs}: another loader or ComfyUI version, weights changed in place, or a "
                    "damaged store); it is not joined again")
        for i, p in enumerate(packs):
            if store.writing:
                p.write(store.writable(i))
                store.written(i)
            p.take_host(storage.buffer(i), store.view.shown(i))
            if progress is not None:
                progress(i + 1, total)
        if store.writing:
            store.finish()
    except BaseException:
        _undo(packs, storage, store)
        raise
    return_freed_ram()
    log.info("[tiered offload] %s: %s %s in %s (%s, shared with every process of this user that loads the same file)",
             label, "packed into" if store.created else "mapped", store.name, folder.path, folder.kind)
    return HostPack(storage, store)


def _undo(packs: Sequence[PackedBlock], storage: HostStorage, store: SharedHostStore | None = None) -> None:
    """Give every block packed so far its values back in fresh memory, then free what held them."""
    try:
        for p in packs:
            if p.host is not None:
                p.restore(keep_host=False)
    finally:
        if store is not None:
            store.release()
        else:
            storage.release()
