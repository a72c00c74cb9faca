"""The tier manager's memory policy: the RAM cap, the reserves, whether models may go to disk, and
the machine's figures they are checked against.

A RAM budget is what models may hold: the available RAM plus what models hold now less the
reserve, capped by the explicit budget. Every value is checked before any is applied: bytes are
whole numbers up to ``MAX_BUDGET_BYTES``, a RAM reserve is at most the machine's RAM and a VRAM
reserve at most the GPU's memory.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

import psutil
import torch

from ..units import size_text

GiB = 1 << 30
DEFAULT_RAM_RESERVE_BYTES = 2 << 30  # the OS, ComfyUI's own tensors, activations
DEFAULT_VRAM_RESERVE_BYTES = 1 << 30  # latents, VAE decode, attention workspace
# No budget or reserve is larger than this: beyond any machine, and it keeps every figure the
# manager publishes a small JSON number.
MAX_BUDGET_BYTES = 4096 * GiB


class Unset(Enum):
    """A budget argument left out (None is a value: no RAM cap)."""
    UNSET = 0


UNSET = Unset.UNSET


def cuda_free_bytes() -> int | None:
    """Free VRAM on the current device as torch can use it, or None (unlimited) without CUDA.

    Memory torch has cached but not allocated counts as free: parking a model returns its blocks
    to torch's cache, not to the driver.
    """
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def check_bytes(name: str, value: object, *, allow_none: bool = False,
                limit: int | None = None) -> None:
    """Refuse anything but a whole number of bytes in [0, limit]; messages never echo a huge value."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        what = "a whole number of bytes" + (" or null" if allow_none else "")
        raise ValueError(f"{name} must be {what}, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0")
    if limit is not None and value > limit:
        raise ValueError(f"{name} must be at most {limit} bytes ({size_text(limit)})")


def ram_total_bytes() -> int:
    """Physical RAM of this machine: no reserve can be larger."""
    return int(psutil.virtual_memory().total)


def vram_total_bytes() -> int | None:
    """Memory of the current CUDA device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


class TierBudgets:
    """The current memory policy, as ``TierManager.set_budgets`` takes it."""

    def __init__(self) -> None:
        self.ram_cap: int | None = None
        self.ram_reserve = DEFAULT_RAM_RESERVE_BYTES
        self.vram_reserve = DEFAULT_VRAM_RESERVE_BYTES
        self.disk_tier = True

    @staticmethod
    def check(*, ram_budget_bytes: int | None | Unset = UNSET, ram_reserve_bytes: int | Unset = UNSET,
              vram_reserve_bytes: int | Unset = UNSET, disk_tier: bool | Unset = UNSET) -> None:
        """Refuse, with a ValueError naming it, any value given that is not a budget."""
        if ram_budget_bytes is not UNSET:
            check_bytes("ram_budget_bytes", ram_budget_bytes, allow_none=True,
                        limit=MAX_BUDGET_BYTES)
        if ram_reserve_bytes is not UNSET:
            check_bytes("ram_reserve_bytes", ram_reserve_bytes, limit=MAX_BUDGET_BYTES)
            if ram_reserve_bytes > ram_total_bytes():
                raise ValueError(f"ram_reserve_bytes ({size_text(ram_reserve_bytes)}) is more than this "
                                 f"machine's RAM ({size_text(ram_total_bytes())})")
        if vram_reserve_bytes is not UNSET:
            check_bytes("vram_reserve_bytes", vram_reserve_bytes, limit=MAX_BUDGET_BYTES)
            vram_total = vram_total_bytes()
            if vram_total is not None and vram_reserve_bytes > vram_total:
                raise ValueError(f"vram_reserve_bytes ({size_text(vram_reserve_bytes)}) is more than "
                                 f"the GPU's memory ({size_text(vram_total)})")
        if disk_tier is not UNSET and not isinstance(disk_tier, bool):
            raise ValueError(f"disk_tier must be true or false, got {type(disk_tier).__name__}")

    def apply(self, *, ram_budget_bytes: int | None | Unset = UNSET, ram_reserve_bytes: int | Unset = UNSET,
              vram_reserve_bytes: int | Unset = UNSET, disk_tier: bool | Unset = UNSET) -> None:
        """Set the values given (checked already); the others keep theirs."""
        if ram_budget_bytes is not UNSET:
            self.ram_cap = ram_budget_bytes
        if ram_reserve_bytes is not UNSET:
            self.ram_reserve = ram_reserve_bytes
        if vram_reserve_bytes is not UNSET:
            self.vram_reserve = vram_reserve_bytes
        if disk_tier is not UNSET:
            self.disk_tier = disk_tier

    def as_dict(self) -> dict[str, Any]:
        return {"ram_budget_bytes": self.ram_cap, "ram_reserve_bytes": self.ram_reserve,
                "vram_reserve_bytes": self.vram_reserve, "disk_tier": self.disk_tier}

    def ram_budget(self, used: int, available: int) -> int:
        """min(available RAM + RAM models hold - reserve, explicit cap), never negative."""
        budget = available + used - self.ram_reserve
        if self.ram_cap is not None:
            budget = min(budget, self.ram_cap)
        return max(budget, 0)
