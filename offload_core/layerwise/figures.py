"""What a streamer reports: where each unit and block is, what its packs weigh where, and its counters.

Read by people (the panel, logs) and tests, never on the hot path: each figure is computed from
the plan, the pack store and the counters when it is asked for.
"""

from __future__ import annotations

import torch
from torch import nn

from ..blocks.phases import Unit
from ..device.telemetry import Telemetry
from .pack_store import PackStore
from .pipeline import Setting
from .plan import StreamPlan
from .schedule import DeviceSchedule
from .tuning import Tuner

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


class StreamerFigures:
    """What a streamer shows of its plan and its run: the figures above over its plan, pack store,
    schedule and counters, and the tuner's report. The streamer's own class is the lifecycle."""

    _plan: StreamPlan
    _store: PackStore
    _schedule: DeviceSchedule | None
    _tuner: Tuner | None
    _attached: bool
    telemetry: Telemetry

    # ----------------------------------------------------------------- the plan
    @property
    def blocks(self) -> list[nn.Module]:
        return self._plan.blocks

    @property
    def units(self) -> list[Unit]:
        """The streamed units: the blocks, or each block's phases (``granularity``)."""
        return self._plan.units

    @property
    def granularity(self) -> str:
        return self._plan.granularity

    @property
    def resident_indices(self) -> list[int]:
        return self._plan.resident_indices

    @property
    def streamed_indices(self) -> list[int]:
        return self._plan.streamed_indices

    def replan(self, *, resident: int | None = None, vram_budget_bytes: int | None = None) -> None:
        """Choose the resident blocks again, e.g. from the device memory free when a run starts.

        Only while detached. The packs do not depend on residency, so a kept pack stays valid.
        """
        if self._attached:
            raise RuntimeError("replan() needs a detached streamer")
        self._plan.replan(resident=resident, vram_budget_bytes=vram_budget_bytes)

    def hold_within(self, nbytes: int) -> None:
        """Until detach, a new auto setting takes at most ``nbytes`` of device memory: what the
        caller has told its memory manager the model holds (the bound at its load)."""
        if self._tuner is not None:
            self._tuner.run_cap = nbytes

    def advise_within(self, nbytes: int | None) -> None:
        """With settings fixed, what auto would choose is weighed within ``nbytes`` of device
        memory: the budget a run left to auto would have had (None: the fixed setting's own)."""
        if self._tuner is not None:
            self._tuner.advice_budget = nbytes

    def run_length(self, steps: int | None) -> None:
        """The sampler's steps in the run about to start (None: not known). Auto changes a setting
        within a run only where the calls the run has left repay the change; otherwise the next
        run starts with it."""
        if self._tuner is not None:
            self._tuner.run_length(steps)

    def step_done(self) -> None:
        """The sampler finished one step of the run (how many calls a step makes follows)."""
        if self._tuner is not None:
            self._tuner.step_done()

    def use(self, setting: Setting) -> None:
        """Stream with ``setting`` (the planner's terms: resident units, prefetch, disk read-ahead)
        from the next attach. Only while detached."""
        if self._attached:
            raise RuntimeError("use() needs a detached streamer")
        self._plan.apply(setting.resident, setting.prefetch, setting.read_ahead or None)

    def bound_range(self) -> tuple[int, int]:
        """The bound with every block streamed (the least device memory streaming can work in)
        and with every block resident (the most the engine can use)."""
        return self._plan.bound_range()

    @property
    def packed_bytes(self) -> int:
        """Bytes of the host master (all blocks plus shared tensors)."""
        return self._plan.packed_bytes

    def bound_bytes(self) -> int:
        """Most weight bytes the settings ever place on the compute device: resident + slots."""
        return self._plan.bound_bytes()

    # ----------------------------------------------------------------- figures
    def unit_states(self) -> list[str]:
        """Per unit: 'resident' (on the device), 'in_flight' (in a device slot), 'cached' (in the
        host cache), 'disk' (only on disk) or 'streamed' (in the host pack)."""
        in_flight = self._schedule.in_flight_units() if self._attached else set()
        return unit_states(self._plan, self._store, in_flight)

    def block_states(self) -> list[str]:
        """Per block, the state of its units (``unit_states``); a block whose phases are in several
        places shows the nearest to the device."""
        return block_states(self._plan, self.unit_states())

    def describe_units(self) -> list[dict]:
        """Each unit: its block, name and bytes."""
        return describe_units(self._plan)

    def host_bytes(self) -> dict[str, int]:
        """Host master size, the tensors in it without alignment padding, how much of it is
        page-locked; with disk streaming, what the host cache holds and what lives on disk."""
        return host_bytes(self._plan, self._store)

    def shows_kept_pack(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shows this streamer's kept host pack while detached: another host master of
        the same module need not copy it."""
        return not self._attached and self._store.holds(t)

    def host_store(self) -> dict | None:
        """Whether the host pack is in a shared store, or why not (``PackStore.host_store``)."""
        return self._store.host_store()

    def disk_figures(self) -> dict | None:
        """The disk tier's settings and sizes, None without one."""
        disk = self._store.disk
        return disk.figures() if disk is not None else None

    def reset_figures(self) -> None:
        """Zero the counters (the engine's and the disk tier's), e.g. at the start of a run."""
        reset(self.telemetry, self._store)

    def figures(self, wait: bool = False) -> dict:
        """The telemetry snapshot, with the disk tier's counters when there is one."""
        return snapshot(self.telemetry, self._store, wait)

    def tuning(self) -> dict | None:
        """What the auto settings chose, predicted and measured, and why (``Tuner.report``)."""
        return self._tuner.report() if self._tuner is not None else None

    @property
    def attached(self) -> bool:
        return self._attached

