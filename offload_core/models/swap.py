"""Whole-module master: one packed host copy of a module's weights, and copy-free parking.

Why: components that run once per job (text encoders, VAE, a second DiT) move whole, but
``module.to("cpu")`` copies frozen weights back over the link every time.  Here the host pack is
the master and the module's tensors live in it: whoever moves the module to a device reads the
master (pinned, so at full link speed), and ``park`` takes the device copies back by re-pointing
the tensors at the master, so nothing is ever copied device-to-host.

The master must hold the module's *base* weights: build it only while the module's owner has no
computed weights (merged LoRA and the like) in it.  ``park`` never touches a slot that holds
something other than the master's values, so an owner's merged weights are safe from it.

Two more ways to hold the bytes once: ``share`` keeps the master in the machine's one shared store
of them (``sharing/shared_packing.py``), which every process loading the same file maps; ``skip``
leaves alone tensors that already live in another host master of this process (a layerwise
streamer's kept pack), so the blocks are not copied a second time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..host.layout import alias_key, check_packable
from ..host.packing import PackedBlock
from ..host.pinned import DEFAULT_CHUNK_BYTES, HostStorage
from ..sharing.shared_packing import HostShare, pack_host
from ..host.subclass import tensor_nbytes
from ..host.tensor_refs import tensor_refs

log = logging.getLogger(__name__)


class ModuleSwap:
    """Keeps ``module``'s weights as a host master that the module's tensors point into.

    Construction packs the module: its tensors then live in the host pack (on CPU).  Tensors that
    are not dense (e.g. expanded views) keep their original memory and are never re-pointed, and
    neither are tensors ``skip`` names (they live in another master already).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        pin: bool = True,
        ram_budget_bytes: int | None = None,
        part_bytes: int = DEFAULT_CHUNK_BYTES,
        share: HostShare | None = None,
        skip: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
            raise ValueError(f"part_bytes must be an int >= 1, got {part_bytes!r}")
        refs = tensor_refs(module)
        if skip is not None:
            kept = [(ref, t) for ref, t in refs if not skip(t)]
            self.skipped = len(refs) - len(kept)
            refs = kept
        else:
            self.skipped = 0
        for ref, t in refs:
            check_packable(t, ref.label)
        # Where the model runs on the CPU, core computes from the master itself, so its tensors
        # sit where the originals sat modulo a SIMD width (host/layout.py's notes on address phase);
        # elsewhere core copies each tensor to the device and the phase costs only padding.
        self._packs = [PackedBlock(items, index=i, keep_address_phase=True)
                       for i, items in enumerate(_split(refs, part_bytes))]
        self._packed = pack_host(self._packs, pin=pin, ram_budget_bytes=ram_budget_bytes, chunk_bytes=part_bytes,
                                 label="module master", share=share)
        self._host: HostStorage | None = self._packed.storage
        log.info(
            "[tiered offload] Model-Level Swap: host master of %.1f MiB packed in %d part%s (%.1f MiB page-locked)%s",
            self.nbytes / 2**20, len(self._packs), "" if len(self._packs) == 1 else "s",
            self._host.pinned_bytes / 2**20,
            f"; {self.skipped} tensors another master already holds are not copied" if self.skipped else "",
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes of the host master."""
        return sum(p.nbytes for p in self._packs)

    def note_reader(self, device: torch.device) -> None:
        """Record that the module's owner may copy out of the master asynchronously on ``device``
        (ComfyUI's partial load does, per layer): freeing the master waits for that device."""
        if self._host is None:
            raise RuntimeError("this ModuleSwap is closed")
        self._host.note_reader(device)

    def park(self) -> int:
        """Re-point every tensor that shows the master's values at the master; no bytes move.

        Call it when the module's owner moves it back to the host: tensors the owner had copied to
        a device are taken back for free.  Returns how many tensors were off the host.
        """
        if self._host is None:
            raise RuntimeError("this ModuleSwap is closed")
        self._note_devices()  # the devices the owner copied to read from the master
        return sum(p.reclaim() for p in self._packs)

    def close(self) -> None:
        """Give the module its original tensors back (original devices) and free the pack.

        The module must hold its base weights again (its owner's computed weights removed), since
        every slot gets its original object back with the master's values. Freeing pinned memory
        waits only for the devices that read from it (noted, or seen holding the module's
        tensors): waiting on every GPU would create a CUDA context on each.
        """
        if self._host is None:
            return
        self._note_devices()
        for i, p in enumerate(self._packs):
            p.restore(keep_host=False)
            self._host.release_item(i)  # copy out part by part: never 2x RAM
        self._packed.release()
        self._host = None

    def _note_devices(self) -> None:
        for p in self._packs:
            for device in p.devices():
                self._host.note_reader(device)

    def host_store(self) -> dict[str, Any] | None:
        """Whether the master is in a shared store (where, with how many processes) or why not;
        None once closed, or without a wish to share that was met or refused."""
        if self._host is None:
            return None
        return self._packed.status() if self._packed.store is not None or self._packed.why_private else None

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes of the master in pinned and in pageable host memory."""
        if self._host is None:
            return {"pinned": 0, "pageable": 0}
        pinned = sum(p.nbytes for i, p in enumerate(self._packs) if self._host.is_pinned(i))
        return {"pinned": pinned, "pageable": self.nbytes - pinned}


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
        nbytes = tensor_nbytes(t)
        if not groups or (size + nbytes > part_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append((ref, t))
        group_of[key] = len(groups) - 1
        size += nbytes
    return groups
