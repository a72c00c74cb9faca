"""Apply Layerwise Offload's settings: the node's inputs, their ranges, and the checks of values
that reach the node through a link (ComfyUI checks the range of a widget's value only) or as NaN
(which passes it).

Auto is the default for what the engine can measure and plan (offload_core/layerwise/tuning.py):
resident blocks (-1), prefetch (0), disk read-ahead (disk_workers 0) and granularity ("auto").
A number is obeyed, and the panel says what auto would have chosen instead."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...offload_core.blocks.phases import GRANULARITIES
from ...offload_core.layerwise.tuning import AUTO
from ..core import budgets

GIB = 1024 ** 3
MAX_RESIDENT_BLOCKS = 4096
MAX_VRAM_BUDGET_GB = 1024.0
MAX_PREFETCH = 16  # the input's range; what auto tries is the planner's own (PLANNED_PREFETCH)
MAX_HOST_CACHE_GB = 4096.0
MAX_DISK_WORKERS = 16
GRANULARITY_CHOICES = (AUTO, *GRANULARITIES)


@dataclass(frozen=True)
class LayerwiseSettings:
    resident_blocks: int  # -1: auto
    vram_budget_gb: float  # 0: auto
    prefetch: int  # 0: auto
    pin: bool
    host_cache_gb: float = 0.0  # 0: every block packed in RAM; else the RAM cap, disk beyond it
    disk_workers: int = 0  # 0: auto
    granularity: str = AUTO
    spill_dir: str = ""
    share_host_memory: bool = True  # one host copy per machine (core/host_sharing.py)

    def __post_init__(self) -> None:
        """Refuse, naming the input and its range, a value no setting means: another type, NaN,
        an infinity, out of range, or a budget of less than one byte (which would read as 0)."""
        try:
            budgets.whole_number("resident_blocks", self.resident_blocks, -1, MAX_RESIDENT_BLOCKS)
            budgets.gib_bytes("vram_budget_gb", self.vram_budget_gb, maximum=MAX_VRAM_BUDGET_GB,
                              zero_means="0 (auto)")
            budgets.whole_number("prefetch", self.prefetch, 0, MAX_PREFETCH)
            if not isinstance(self.pin, bool):
                raise ValueError("pin must be true or false")
            budgets.gib_bytes("host_cache_gb", self.host_cache_gb, maximum=MAX_HOST_CACHE_GB,
                              zero_means="0 (every block in RAM)")
            budgets.whole_number("disk_workers", self.disk_workers, 0, MAX_DISK_WORKERS)
            if self.granularity not in GRANULARITY_CHOICES:
                raise ValueError(f"granularity must be one of {', '.join(GRANULARITY_CHOICES)}")
            if not isinstance(self.spill_dir, str):
                raise ValueError("spill_dir must be a folder path, or empty")
            if not isinstance(self.share_host_memory, bool):
                raise ValueError("share_host_memory must be true or false")
        except ValueError as e:
            raise ValueError(f"Apply Layerwise Offload: {e}") from None

    def streamer_kwargs(self) -> dict[str, Any]:
        """The residency settings as the streamer takes them (an auto budget plans no resident
        block here; it is decided from the free device memory when a run starts)."""
        prefetch = AUTO if self.auto_prefetch else self.prefetch
        if self.resident_blocks >= 0:
            return {"resident": self.resident_blocks, "prefetch": prefetch, "pin": self.pin}
        return {"resident": AUTO, "vram_budget_bytes": self.requested_budget, "prefetch": prefetch,
                "pin": self.pin}

    @property
    def auto_prefetch(self) -> bool:
        return self.prefetch == 0

    @property
    def auto_read_ahead(self) -> bool:
        return self.disk_workers == 0

    @property
    def auto_granularity(self) -> bool:
        return self.granularity == AUTO

    @property
    def auto_settings(self) -> list[str]:
        """The settings left to auto, by their input names."""
        return [name for name, on in (("resident_blocks", self.resident_blocks < 0),
                                      ("prefetch", self.auto_prefetch),
                                      ("disk_workers", self.auto_read_ahead),
                                      ("granularity", self.auto_granularity)) if on]

    @property
    def requested_budget(self) -> int | None:
        """The budget in bytes, or None for auto."""
        return int(self.vram_budget_gb * GIB) if self.vram_budget_gb > 0 else None
