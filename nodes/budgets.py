"""What the tier manager's GiB budget fields mean, for the VRAM Tier Manager node and REST alike.

One meaning everywhere: `ram_budget_gb` 0 (or null) means no cap, so only the available RAM less
the reserve limits the models, exactly as the node's widget documents it. Every field is a finite
number of GiB (1 GiB = 1024³ bytes) from 0 to the manager's sane maximum, and a reserve is at most
what the machine has (RAM, or the GPU's memory where there is one). Both ways in refuse the same
values with the same message, in the names the user typed. Messages never echo a value that is
not already known to be small: a request can be made of a 10 MB field name or a number with
thousands of digits.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..offload_core.tiers import MAX_BUDGET_BYTES, ram_total_bytes, vram_total_bytes

GIB = 1024 ** 3
MAX_GIB = MAX_BUDGET_BYTES // GIB
FIELDS = {"ram_budget_gb": "ram_budget_bytes", "ram_reserve_gb": "ram_reserve_bytes",
          "vram_reserve_gb": "vram_reserve_bytes"}
ALLOWED = (*FIELDS, "disk_tier")


def shorten(text: str, limit: int = 48) -> str:
    """A user-supplied string cut to fit in a one-line message."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def gib_to_bytes(field: str, value: Any) -> int | None:
    """Bytes for one GiB field; None for "no cap". Raises ValueError naming the field."""
    no_cap = field == "ram_budget_gb"
    if no_cap and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number of GiB" + (" or null" if no_cap else ""))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number of GiB, not NaN or Infinity")
    if not 0 <= value <= MAX_GIB:
        raise ValueError(f"{field} must be from 0 to {MAX_GIB} GiB")
    if no_cap and value == 0:
        return None
    nbytes = int(value * GIB)
    machine = {"ram_reserve_gb": ("this machine's RAM", ram_total_bytes),
               "vram_reserve_gb": ("the GPU's memory", vram_total_bytes)}.get(field)
    if machine is not None:
        what, total = machine[0], machine[1]()
        if total is not None and nbytes > total:
            raise ValueError(f"{field} ({value:g} GiB) is more than {what} "
                             f"({total / GIB:.1f} GiB)")
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
