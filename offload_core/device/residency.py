"""Which blocks stay resident on the compute device, and what that costs.

Why spread residents evenly: a streamed block's copy can hide behind every block
that runs before it is needed, so interleaving resident blocks between streamed
ones gives each transfer more compute to hide behind than bunching them.
"""

from __future__ import annotations

from collections.abc import Sequence


def spread_evenly(n: int, count: int) -> list[int]:
    """``count`` distinct indices in ``range(n)``, centred in equal strides."""
    if not 0 <= count <= n:
        raise ValueError(f"cannot pick {count} of {n} blocks")
    return [(2 * i + 1) * n // (2 * count) for i in range(count)]


def slot_count(prefetch: int, n_streamed: int) -> int:
    """Ring slots: the running block plus ``prefetch`` in flight, never more than are streamed."""
    return min(prefetch + 1, n_streamed)


def bound_bytes(block_bytes: Sequence[int], resident: Sequence[int], shared_bytes: int, prefetch: int) -> int:
    """Most bytes of weights the settings ever put on the compute device: resident + slots."""
    res = set(resident)
    streamed = [b for i, b in enumerate(block_bytes) if i not in res]
    slots = slot_count(prefetch, len(streamed)) * (max(streamed) if streamed else 0)
    return shared_bytes + sum(block_bytes[i] for i in res) + slots


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan_residency(
    block_bytes: Sequence[int],
    shared_bytes: int,
    *,
    resident: int | None,
    vram_budget_bytes: int | None,
    prefetch: int,
) -> list[int]:
    """Resident block indices from either an explicit count or a VRAM budget.

    With a budget, the largest resident count whose exact bound (resident bytes +
    slots + shared) fits is chosen, so ``bound_bytes`` never exceeds the budget.
    """
    n = len(block_bytes)
    _check_int("prefetch", prefetch, 1)
    if resident is not None and vram_budget_bytes is not None:
        raise ValueError("give either resident or vram_budget_bytes, not both")
    if resident is not None:
        _check_int("resident", resident, 0)
        if resident > n:
            raise ValueError(f"resident={resident} but there are only {n} blocks")
        return spread_evenly(n, resident)
    if vram_budget_bytes is None:
        return []
    _check_int("vram_budget_bytes", vram_budget_bytes, 1)
    for count in range(n, -1, -1):
        picked = spread_evenly(n, count)
        if bound_bytes(block_bytes, picked, shared_bytes, prefetch) <= vram_budget_bytes:
            return picked
    need = bound_bytes(block_bytes, [], shared_bytes, prefetch)
    raise ValueError(
        f"vram_budget_bytes={vram_budget_bytes} is too small: streaming every block needs {need} bytes "
        f"({slot_count(prefetch, n)} slots of {max(block_bytes)} bytes + {shared_bytes} shared bytes)"
    )


def fit_budget(requested: int | None, available: int, least: int, most: int) -> int | None:
    """The device budget for the blocks of one run, or None when not even streaming fits.

    ``available`` is what the device has for the blocks once everything else the run needs is
    provided for; ``least`` is the bound with every block streamed, ``most`` with every block
    resident. Auto (``requested`` None) takes what is available, up to ``most``; a requested
    budget is lowered to what is available, because a plan that does not fit fails half-way
    through materializing it.
    """
    budget = min(most, available) if requested is None else min(requested, available)
    return budget if budget >= least else None
