"""Apply Layerwise Offload's settings: the node's inputs, their ranges, and the checks of values
that reach the node through a link (ComfyUI checks the range of a widget's value only) or as NaN
(which passes it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...offload_core.blocks.phases import GRANULARITIES
from ..core import budgets

GIB = 1024 ** 3
MAX_RESIDENT_BLOCKS = 4096
MAX_VRAM_BUDGET_GB = 1024.0
MAX_PREFETCH = 16
MAX_HOST_CACHE_GB = 4096.0
MAX_DISK_WORKERS = 16


@dataclass(frozen=True)
class LayerwiseSettings:
    resident_blocks: int
    vram_budget_gb: float  # 0: auto
    prefetch: int
    pin: bool
    host_cache_gb: float = 0.0  # 0: every block packed in RAM; else the RAM cap, disk beyond it
    disk_workers: int = 2
    granularity: str = "block"
    spill_dir: str = ""
    share_host_memory: bool = True  # one host copy per machine (core/host_sharing.py)

    def __post_init__(self) -> None:
        """Refuse, naming the input and its range, a value no setting means: another type, NaN,
        an infinity, out of range, or a budget of less than one byte (which would read as 0)."""
        try:
            budgets.whole_number("resident_blocks", self.resident_blocks, -1, MAX_RESIDENT_BLOCKS)
            budgets.gib_bytes("vram_budget_gb", self.vram_budget_gb, maximum=MAX_VRAM_BUDGET_GB,
                              zero_means="0 (auto)")
            budgets.whole_number("prefetch", self.prefetch, 1, MAX_PREFETCH)
            if not isinstance(self.pin, bool):
                raise ValueError("pin must be true or false")
            budgets.gib_bytes("host_cache_gb", self.host_cache_gb, maximum=MAX_HOST_CACHE_GB,
                              zero_means="0 (every block in RAM)")
            budgets.whole_number("disk_workers", self.disk_workers, 1, MAX_DISK_WORKERS)
            if self.granularity not in GRANULARITIES:
                raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}")
            if not isinstance(self.spill_dir, str):
                raise ValueError("spill_dir must be a folder path, or empty")
            if not isinstance(self.share_host_memory, bool):
                raise ValueError("share_host_memory must be true or false")
        except ValueError as e:
            raise ValueError(f"Apply Layerwise Offload: {e}") from None

    def streamer_kwargs(self) -> dict[str, Any]:
        """The residency settings as the streamer takes them (an auto budget plans no resident
        block here; it is decided from the free device memory when a run starts)."""
        if self.resident_blocks >= 0:
            return {"resident": self.resident_blocks, "prefetch": self.prefetch, "pin": self.pin}
        return {"vram_budget_bytes": self.requested_budget, "prefetch": self.prefetch,
                "pin": self.pin}

    @property
    def requested_budget(self) -> int | None:
        """The budget in bytes, or None for auto."""
        return int(self.vram_budget_gb * GIB) if self.vram_budget_gb > 0 else None
