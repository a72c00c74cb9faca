"""What a number a user gives the pack means, for every node input and REST field alike.

GiB fields (1 GiB = 1024³ bytes): a finite number from 0 to the field's maximum, where 0 has the
field's own meaning (no cap, auto, no disk) and any other value is at least one byte (the tier
manager's budgets and reserves: a MiB), so a tiny number never becomes a silent 0-byte cap. Counts: whole numbers in the field's range. NaN, the
infinities, booleans and strings are refused, with a message that names the field and its range.
The tier manager's budgets (`ram_budget_gb` 0 or null: no cap) mean the same through the VRAM Tier
Manager node and `POST /offload/budgets`, and a reserve is at most what the machine has (RAM, or
the GPU's memory where there is one). Messages never echo a value that is not already known to be
small: a request can be made of a 10 MB field name or a number with thousands of digits.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...offload_core.models.tier_budgets import MAX_BUDGET_BYTES, ram_total_bytes, vram_total_bytes
from ...offload_core.units import size_text

GIB = 1024 ** 3
ONE_BYTE_GIB = 1 / GIB
# The tier manager's budgets and reserves are RAM and VRAM for whole models: a number under a MiB
# is a slip of the keyboard (0.0000001 GiB is 107 bytes), refused rather than saved.
TIER_SMALLEST = 1024 ** 2
MAX_GIB = MAX_BUDGET_BYTES // GIB
FIELDS = {"ram_budget_gb": "ram_budget_bytes", "ram_reserve_gb": "ram_reserve_bytes",
          "vram_reserve_gb": "vram_reserve_bytes"}
ZERO_MEANS = {"ram_budget_gb": "0 or null (no cap)", "ram_reserve_gb": "0 (no reserve)",
              "vram_reserve_gb": "0 (no reserve)"}
ALLOWED = (*FIELDS, "disk_tier")


def shorten(text: str, limit: int = 48) -> str:
    """A user-supplied string cut to fit in a one-line message."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def gib_range(zero_means: str, maximum: float, smallest: int = 1) -> str:
    if smallest == 1:
        return f"{zero_means}, or from {ONE_BYTE_GIB:.2g} GiB (one byte) to {maximum:g} GiB"
    return f"{zero_means}, or from {smallest / GIB:.2g} GiB ({size_text(smallest)}) to {maximum:g} GiB"


def gib_bytes(field: str, value: Any, *, maximum: float, zero_means: str, smallest: int = 1) -> int:
    """Bytes for a GiB field (0 for 0); ValueError naming the field and its range for anything
    that is not a finite number in it, and for a positive value under ``smallest`` bytes."""
    allowed = gib_range(zero_means, maximum, smallest)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number of GiB: {allowed}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number of GiB, not NaN or Infinity: {allowed}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{field} is out of range: {allowed}")
    nbytes = int(value * GIB)
    if value > 0 and nbytes < smallest:
        raise ValueError(f"{field} is less than {'one byte' if smallest == 1 else size_text(smallest)}: {allowed}")
    return nbytes


def whole_number(field: str, value: Any, lowest: int, highest: int) -> int:
    """A count in [lowest, highest]; ValueError naming the field and its range otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= highest:
        raise ValueError(f"{field} must be a whole number from {lowest} to {highest}")
    return value


def gib_to_bytes(field: str, value: Any) -> int | None:
    """Bytes for one of the tier manager's GiB fields; None for "no cap". Raises ValueError naming
    the field."""
    no_cap = field == "ram_budget_gb"
    if no_cap and value is None:
        return None
    if value is None:
        raise ValueError(f"{field} must be a number of GiB: {gib_range(ZERO_MEANS[field], MAX_GIB, TIER_SMALLEST)}")
    nbytes = gib_bytes(field, value, maximum=MAX_GIB, zero_means=ZERO_MEANS[field], smallest=TIER_SMALLEST)
    if no_cap and nbytes == 0:
        return None
    machine = {"ram_reserve_gb": ("this machine's RAM", ram_total_bytes),
               "vram_reserve_gb": ("the GPU's memory", vram_total_bytes)}.get(field)
    if machine is not None:
        what, total = machine[0], machine[1]()
        if total is not None and nbytes > total:
            raise ValueError(f"{field} ({size_text(nbytes)}) is more than {what} ({size_text(total)})")
    return nbytes


def budget_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """`TierManager.set_budgets` arguments for any of the fields; ValueError for anything else."""
    unknown = [name for name in values if name not in ALLOWED]
    if unknown:
        shown = ", ".join(repr(shorten(name)) for name in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ValueError(f"unknown field(s) {shown}{more}; allowed: {', '.join(ALLOWED)}")
    kwargs: dict[str, Any] = {FIELDS[name]: gib_to_bytes(name, value)
                              for name, value in values.items() if name in FIELDS}
    if "disk_tier" in values:
        if not isinstance(values["disk_tier"], bool):
            raise ValueError("disk_tier must be true or false")
        kwargs["disk_tier"] = values["disk_tier"]
    return kwargs
