"""What a streamer reports: where each unit and block is, what its packs weigh where, and its counters.

Read by people (the panel, logs) and tests, never on the hot path: each figure is computed from
the plan, the pack store and the counters when it is asked for.
"""

from __future__ import annotations

from ..device.telemetry import Telemetry
from .pack_store import PackStore
from .plan import StreamPlan

# Nearest to the device first: a block whose units are in several places shows the first.
_RANK = ("resident", "in_flight", "cached", "streamed", "disk")


def unit_states(plan: StreamPlan, store: PackStore, in_flight: set[int]) -> list[str]:
    """Per unit: 'resident' (on the device), 'in_flight' (in a device slot), 'cached' (in the
    host cache), 'disk' (only on disk) or 'streamed' (in the host pack)."""
    res = set(plan.resident_indices)
    disk = store.disk_active()
    cached = store.disk.cached_units() if disk else set()
    return [
        "resident" if i in res else "in_flight" if i in in_flight
        else "cached" if i in cached else "disk" if disk else "streamed"
        for i in range(len(plan.units))
    ]


def block_states(plan: StreamPlan, states: list[str]) -> list[str]:
    """Per block, the state of its units (``unit_states``); a block whose phases are in several
    places shows the nearest to the device."""
    out = ["disk"] * len(plan.blocks)
    for unit, state in zip(plan.units, states):
        if _RANK.index(state) < _RANK.index(out[unit.block]):
            out[unit.block] = state
    return out


def describe_units(plan: StreamPlan) -> list[dict]:
    """Each unit: its block, name and bytes."""
    return [{"block": u.block, "name": u.name, "bytes": p.nbytes} for u, p in zip(plan.units, plan.packs)]


def host_bytes(plan: StreamPlan, store: PackStore) -> dict[str, int]:
    """Host master size, the tensors in it without alignment padding (a quantized weight's
    inner tensors), and how much of it is page-locked; with disk streaming, what the host
    cache holds and what lives on disk."""
    host = store.host
    out = {
        "packed": plan.packed_bytes,
        "tensors": sum(p.tensor_bytes for p in plan.packs) + plan.shared.tensor_bytes,
        "pinned": host.pinned_bytes if host else 0,
        "pageable": host.pageable_bytes if host else 0,
    }
    disk = store.disk
    if disk is not None:
        figures = disk.figures()
        cached = disk.cached_units()
        out.update(cache=figures["cache_bytes"], cache_pinned=figures["cache_pinned_bytes"],
                   disk=plan.packed_bytes - sum(plan.packs[i].nbytes for i in cached) if disk.placed else 0)
    return out


def reset(telemetry: Telemetry, store: PackStore) -> None:
    """Zero the counters (the engine's and the disk tier's), e.g. at the start of a run."""
    telemetry.reset()
    if store.disk is not None:
        store.disk.telemetry.reset()


def snapshot(telemetry: Telemetry, store: PackStore, wait: bool) -> dict:
    """The telemetry snapshot, with the disk tier's counters when there is one."""
    out = telemetry.snapshot(wait=wait)
    if store.disk is not None:
        out.update(store.disk.telemetry.snapshot())
    return out
