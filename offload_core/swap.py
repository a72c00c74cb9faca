"""Whole-module swap: a packed host master, a few large copies in, nothing copied out.

Why: components that run once per job (text encoders, VAE, a second DiT) are
cheapest to move as a whole, but ``module.to("cpu")`` copies frozen weights back
over the link every time.  Here the host pack is the master: ``load`` sends it
to the device in one copy per part, ``park`` just re-points the tensors at the
host pack and drops the device copy.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .packing import PackedBlock, alias_key, check_packable, tensor_refs
from .pinned import DEFAULT_CHUNK_BYTES, HostStorage, return_freed_ram
from .slots import resolve_device

log = logging.getLogger(__name__)


class ModuleSwap:
    """Keeps ``module``'s weights as a host master and moves them to a device on demand.

    Construction packs the module and leaves it parked: its tensors then live in
    the host pack (on CPU).  Tensors that are not dense (e.g. expanded views) keep
    their original memory and are not moved.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        pin: bool = True,
        ram_budget_bytes: int | None = None,
        part_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
            raise ValueError(f"part_bytes must be an int >= 1, got {part_bytes!r}")
        refs = tensor_refs(module)
        for ref, t in refs:
            check_packable(t, ref.label)
        self._packs = [PackedBlock(items, index=i) for i, items in enumerate(_split(refs, part_bytes))]
        self._host: HostStorage | None = HostStorage(
            [p.nbytes for p in self._packs], pin=pin, ram_budget_bytes=ram_budget_bytes, chunk_bytes=part_bytes
        )
        for i, p in enumerate(self._packs):
            p.pack(self._host.buffer(i))
        return_freed_ram()  # the originals just given up may sit in the C heap: hand them to the OS
        self._device_buf: torch.Tensor | None = None
        self.device: torch.device | None = None
        log.info(
            "module packed: %.1f MiB in %d parts (%.1f MiB pinned)",
            sum(p.nbytes for p in self._packs) / 2**20, len(self._packs), self._host.pinned_bytes / 2**20,
        )  # fmt: skip

    def load(self, device: torch.device | str) -> None:
        """Copy the pack to ``device`` (one copy per part) and point the module at it."""
        dev = resolve_device(device)
        if self._host is None:
            raise RuntimeError("this ModuleSwap is closed")
        if self._device_buf is not None:
            if self.device == dev:
                return
            self.park()
        with torch.inference_mode(False):
            buf = torch.empty(sum(p.nbytes for p in self._packs), dtype=torch.uint8, device=dev)
        self._host.note_reader(dev)
        offset = 0
        for p in self._packs:
            part = buf[offset : offset + p.nbytes]
            part.copy_(p.host, non_blocking=True)
            p.bind(p.views(part))
            offset += p.nbytes
        self._device_buf = buf
        self.device = dev
        log.info("module loaded to %s (%.1f MiB)", dev, buf.numel() / 2**20)

    def park(self) -> bool:
        """Point the module at the host master again and drop any device copy.  No bytes move.

        This also covers tensors that the module's owner moved to a device by itself (a plain
        ``module.to(device)``): their values equal the master, so re-pointing is enough.
        Returns whether anything was off the host.
        """
        if self._host is None:
            raise RuntimeError("this ModuleSwap is closed")
        moved = self._device_buf is not None or any(p.off_host() for p in self._packs)
        if not moved:
            return False
        for p in self._packs:
            p.bind_host()
        log.info("module parked from %s", self.device or "a device it was moved to")
        self._device_buf = None
        self.device = None
        return True

    def close(self) -> None:
        """Give the module its original tensors back (original devices) and free the pack."""
        if self._host is None:
            return
        if self._device_buf is not None and self._device_buf.is_cuda:
            torch.cuda.current_stream(self._device_buf.device).synchronize()
        self._device_buf = None
        self.device = None
        for i, p in enumerate(self._packs):
            p.restore(keep_host=False)
            self._host.release_item(i)  # copy out part by part: never 2x RAM
        self._host.release()
        self._host = None

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes on the load device ("vram", whatever the device) and in pinned / pageable host memory."""
        vram = self._device_buf.numel() if self._device_buf is not None else 0
        if self._host is None:
            return {"vram": vram, "pinned": 0, "pageable": 0}
        pinned = sum(p.nbytes for i, p in enumerate(self._packs) if self._host.is_pinned(i))
        total = sum(p.nbytes for p in self._packs)
        return {"vram": vram, "pinned": pinned, "pageable": total - pinned}


def _split(refs: list, part_bytes: int) -> list[list]:
    """Consecutive groups of about ``part_bytes``; aliases of one tensor always share a group."""
    groups: list[list] = []
    group_of: dict[tuple, int] = {}
    size = part_bytes
    for ref, t in refs:
        key = alias_key(t)
        if key in group_of:
            groups[group_of[key]].append((ref, t))
            continue
        nbytes = t.numel() * t.element_size()
        if not groups or (size + nbytes > part_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append((ref, t))
        group_of[key] = len(groups) - 1
        size += nbytes
    return groups
