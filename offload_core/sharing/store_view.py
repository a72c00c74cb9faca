"""What the model's tensors show of a shared host store: a private, copy-on-write mapping of it.

Why a second mapping: whatever the pack hands to ComfyUI or another node may be written in place
(core's hook LoRAs patch weights through ``copy_to_param``; any ``add_()``). A write into the
store's read-only mapping would kill the process, and a write into a shared one would change
every worker's weights. A private mapping of the same file shares the store's pages until one is
written; then that page alone becomes this process's, and the store, which device copies come
from and other processes map, stays as it was. ``written_items`` finds such pages, so the engine
can tell when the store no longer holds what the model shows. Pinning this mapping would unshare
every page, so it stays pageable (the engine copies from the store's pinned mapping instead).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch

from ..host.pinned import HostStorage


class CopyOnWriteView:
    """Copy-on-write mappings of a store file's chunks, made on first use: ``storage`` says where
    each item lies, ``offsets`` where each chunk starts in the file, ``fd`` the open file."""

    def __init__(self, storage: HostStorage, offsets: list[int], fd: Callable[[], int | None]) -> None:
        self._storage = storage
        self._offsets = offsets
        self._fd = fd
        self._chunks: dict[int, torch.Tensor] = {}

    def shown(self, item: int) -> torch.Tensor:
        """Item ``item``'s bytes in its chunk's copy-on-write mapping."""
        storage = self._storage
        chunk = storage.chunk_of(item)
        data = self._chunks.get(chunk)
        if data is None:
            span = -(-storage.chunk_spans[chunk] // mmap.PAGESIZE) * mmap.PAGESIZE
            with torch.inference_mode(False):
                if not span:
                    data = torch.empty(0, dtype=torch.uint8)
                else:
                    region = mmap.mmap(self._fd(), span, flags=mmap.MAP_PRIVATE,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=self._offsets[chunk])
                    data = torch.frombuffer(region, dtype=torch.uint8)
            self._chunks[chunk] = data
        start, size = storage.item_span(item)
        return data[start:start + size]

    def shows(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie in one of the mappings."""
        if t.device.type != "cpu" or not t.numel():
            return False
        ptr = t.data_ptr()
        return any(d.numel() and d.data_ptr() <= ptr < d.data_ptr() + d.numel() for d in self._chunks.values())

    def written_items(self) -> list[int]:
        """Items whose bytes here were written since they were mapped and now differ from the
        store's. Pages are looked up in ``/proc/self/pagemap`` (a written page is this process's
        own, no longer the file's), so only items with written pages are compared; where the
        system does not say, every mapped item is."""
        storage = self._storage
        out = []
        for item in range(storage.num_items):
            if storage.chunk_of(item) not in self._chunks:
                continue
            view = self.shown(item)
            if view.numel() and _own_pages(view) and not torch.equal(view, storage.buffer(item)):
                out.append(item)
        return out

    def clear(self) -> None:
        """Let go of the mappings (a tensor still showing one keeps it alive)."""
        self._chunks.clear()


# The top byte of a /proc/self/pagemap entry -> 1 for a page of the process's own: present (bit 63)
# or swapped (62), and neither a page of the file nor shared (61).
_OWN_PAGE = bytes(1 if b & 0xC0 and not b & 0x20 else 0 for b in range(256))


def own_pages(start: int, end: int) -> bytes | None:
    """One byte per page from ``start`` to ``end`` (page-aligned addresses): 1 where the page is
    this process's own copy (written since a private file mapping was made), else 0; None where
    ``/proc/self/pagemap`` cannot be read."""
    page = mmap.PAGESIZE
    count = (end - start) // page
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            f.seek(8 * (start // page))
            raw = f.read(8 * count)
    except OSError:
        return None
    if len(raw) != 8 * count:
        return None
    return raw[7::8].translate(_OWN_PAGE)  # little-endian: byte 7 of each entry holds bits 56-63


def _own_pages(view: torch.Tensor) -> bool:
    """Whether any page under ``view`` is this process's own copy; True where the system does not
    say, so the caller compares bytes instead of trusting that nothing changed."""
    page = mmap.PAGESIZE
    first = view.data_ptr() // page * page
    end = (view.data_ptr() + view.numel() - 1) // page * page + page
    flags = own_pages(first, end)
    return flags is None or 1 in flags
