"""The VRAM / RAM / disk tier manager, driven by real torch modules loaded from safetensors files.

The GPU is simulated: ``to_vram`` makes a separate device copy of the module and checks it fits a
fixed capacity, so parking and eviction decisions are observable on CPU. RAM is checked against
the manager's explicit budget the same way: a backend refuses to load past it, so a wrong decision
shows up as an error, not as a silent overcommit.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import threading
import time

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from offload_core.files.file_identity import file_version, model_id, source_key
from offload_core.models.tier_budgets import MAX_BUDGET_BYTES, ram_total_bytes
from offload_core.models.tier_entries import Policy, Tier
from offload_core.models.tier_errors import (
    ModelInUseError, ModelPinnedError, SourceChangedError, SourceGoneError, TierCapacityError,
    UnknownModelError)
from offload_core.models.tiers import TierManager

WIDTH = 32
DEPTH = 2
JOIN_S = 60  # generous bound for "no deadlock"; never a timing assertion


def _build(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class Machine:
    """A simulated host and GPU with hard capacities, shared by the backends of one test."""

    def __init__(self, ram_cap: int, vram_cap: int) -> None:
        self.ram_cap = ram_cap
        self.vram_cap = vram_cap
        self.backends: list[LinearStack] = []

    def ram_used(self) -> int:
        return sum(b.bytes_by_tier()["ram"] for b in self.backends)

    def vram_free(self) -> int:
        return self.vram_cap - sum(b.bytes_by_tier()["vram"] for b in self.backends)


class LinearStack:
    """TierBackend over an nn.Linear stack stored in a safetensors file."""

    def __init__(self, machine: Machine, path, seed: int, fail_loads: int = 0,
                 gate: threading.Event | None = None) -> None:
        torch.manual_seed(seed)
        save_file({k: v.contiguous() for k, v in _build(WIDTH, DEPTH).state_dict().items()},
                  str(path))
        self.machine = machine
        self.path = path
        self.size = sum(t.numel() * t.element_size() for t in load_file(str(path)).values())
        self.module: nn.Module | None = None
        self.device_copy: nn.Module | None = None
        self.fail_loads = fail_loads
        self.source_error: Exception | None = None  # what the next load_from_disk raises
        self.gate = gate
        self.started = threading.Event()
        self.disk_reads = 0
        machine.backends.append(self)

    def load_from_disk(self) -> None:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(JOIN_S)
        assert self.module is None, "loaded twice"
        if self.source_error is not None:
            error, self.source_error = self.source_error, None
            raise error
        if self.fail_loads:
            self.fail_loads -= 1
            raise OSError(f"simulated read error on {self.path.name}")
        if self.machine.ram_used() + self.size > self.machine.ram_cap:
            raise MemoryError("simulated host OOM: the manager overcommitted RAM")
        module = _build(WIDTH, DEPTH)
        module.load_state_dict(load_file(str(self.path)))
        self.module = module
        self.disk_reads += 1

    def to_vram(self) -> None:
        assert self.module is not None and self.device_copy is None
        if self.machine.vram_free() < self.size:
            raise torch.OutOfMemoryError("simulated CUDA OOM: the manager overcommitted VRAM")
        self.device_copy = copy.deepcopy(self.module)

    def to_ram(self) -> None:
        assert self.device_copy is not None
        self.device_copy = None

    def drop(self) -> None:
        assert self.module is not None and self.device_copy is None
        self.module = None

    def nbytes(self) -> int:
        return self.size

    def bytes_by_tier(self) -> dict[str, int]:
        return {"vram": self.size if self.device_copy is not None else 0,
                "ram": self.size if self.module is not None else 0}

    def actual_tier(self) -> Tier:
        if self.device_copy is not None:
            return Tier.VRAM
        return Tier.RAM if self.module is not None else Tier.DISK

    def run(self, x: torch.Tensor) -> torch.Tensor:
        module = self.device_copy if self.device_copy is not None else self.module
        assert module is not None, "used while on disk"
        with torch.no_grad():
            return module(x)


X = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def rig(tmp_path):
    """A factory of (manager, machine, backends) with capacities counted in models."""
    def make(n: int, *, ram_models: float = 10, vram_models: float = 10, **kwargs):
        probe = LinearStack(Machine(0, 0), tmp_path / "probe.safetensors", 0)
        machine = Machine(int(probe.size * ram_models), int(probe.size * vram_models))
        manager = TierManager(vram_free_fn=machine.vram_free, vram_reserve_bytes=0,
                              ram_budget_bytes=machine.ram_cap, **kwargs)
        backends = []
        for i in range(n):
            backend = LinearStack(machine, tmp_path / f"m{i}.safetensors", seed=100 + i)
            manager.register(f"m{i}", f"model {i}", backend, kind="diffusion")
            backends.append(backend)
        return manager, machine, backends
    return make


def tier_events(manager: TierManager) -> list[dict]:
    """Subscribe and collect only the tier moves (other event types are tested on their own)."""
    events: list[dict] = []
    manager.subscribe(lambda event: events.append(event) if event["type"] == "tier" else None)
    return events


def _consistent(manager: TierManager, backends) -> None:
    for i, backend in enumerate(backends):
        entry = manager.get(f"m{i}")
        assert entry.tier is backend.actual_tier(), entry.id
        assert entry.in_use >= 0


def test_switching_back_comes_from_ram_bit_identical(rig):
    manager, _, (a, b) = rig(2, vram_models=1.5)
    with manager.using("m0", to=Tier.VRAM):
        first = a.run(X)
    with manager.using("m1", to=Tier.VRAM):  # parks A to make room on the GPU
        b.run(X)
    assert manager.get("m0").tier is Tier.RAM
    with manager.using("m0", to=Tier.VRAM) as entry:
        again = a.run(X)
    assert (entry.loads_from_disk, entry.loads_from_ram, entry.load_count) == (1, 1, 2)
    assert a.disk_reads == 1
    assert torch.equal(first, again)
    with manager.using("m0", to=Tier.VRAM):  # found loaded: the third part of the count
        pass
    counts = next(m for m in manager.snapshot()["models"] if m["id"] == "m0")
    assert (counts["load_count"], counts["loads_from_disk"], counts["loads_from_ram"],
            counts["loads_already_loaded"]) == (3, 1, 1, 1)
    assert manager.get("m1").tier is Tier.RAM
    _consistent(manager, [a, b])


def test_ram_budget_drops_lru_to_disk_and_reload_is_identical(rig):
    manager, machine, (a, b) = rig(2, ram_models=1.5)
    with manager.using("m0"):
        first = a.run(X)
    with manager.using("m1"):
        b.run(X)
    assert manager.get("m0").tier is Tier.DISK and manager.get("m1").tier is Tier.RAM
    assert machine.ram_used() <= machine.ram_cap
    with manager.using("m0") as entry:
        again = a.run(X)
    assert entry.loads_from_disk == 2 and entry.loads_from_ram == 0
    assert torch.equal(first, again)
    assert manager.get("m1").tier is Tier.DISK
    _consistent(manager, [a, b])


def test_lowering_the_budget_drops_idle_models_now(rig):
    manager, _, backends = rig(3)
    for key in ("m0", "m1", "m2"):
        manager.park(key)
    manager.set_budgets(ram_budget_bytes=backends[0].size * 2)
    assert [manager.get(k).tier for k in ("m0", "m1", "m2")] == [Tier.DISK, Tier.RAM, Tier.RAM]
    assert manager.enforce_ram_budget() == []


def test_in_use_model_is_never_evicted(rig):
    manager, _, (a, b) = rig(2, ram_models=1.5, vram_models=1.5)
    events = tier_events(manager)
    manager.acquire("m0", to=Tier.VRAM)
    for action in (manager.evict, manager.park, manager.load, manager.forget):
        with pytest.raises(ModelInUseError, match="model 0"):
            action("m0")
    with pytest.raises(TierCapacityError, match="in use"):
        manager.acquire("m1")
    with pytest.raises(TierCapacityError, match="in use"):
        manager.make_room_vram(a.size)
    assert manager.get("m0").tier is Tier.VRAM and manager.get("m0").in_use == 1
    entry_b = manager.get("m1")
    assert (entry_b.tier, entry_b.in_use, entry_b.loads_from_disk) == (Tier.DISK, 0, 0)
    assert b.disk_reads == 0
    assert [e["id"] for e in events] == ["m0", "m0"]  # only A's own disk->ram->vram
    manager.release("m0")
    with pytest.raises(ValueError, match="without a matching acquire"):
        manager.release("m0")
    with manager.using("m1") as entry:
        assert entry.tier is Tier.RAM
    assert manager.get("m0").tier is Tier.DISK  # parked, then dropped, one tier at a time
    assert [(e["old"], e["new"], e["reason"]) for e in events[2:4]] == [
        ("vram", "ram", "ram_budget"), ("ram", "disk", "ram_budget")]
    _consistent(manager, [a, b])


def test_model_larger_than_the_budget_is_refused(rig):
    manager, _, (a,) = rig(1, ram_models=0.5)
    with pytest.raises(TierCapacityError, match="larger than the whole RAM budget"):
        manager.acquire("m0")
    assert manager.get("m0").tier is Tier.DISK and a.module is None


def test_priority_and_pinned_policy_under_ram_pressure(rig):
    manager, _, backends = rig(4, ram_models=2.5)
    manager.set_priority("m0", 5)
    for key in ("m0", "m1", "m2"):  # m0 is least recently used but outranks m1
        manager.park(key)
    assert [manager.get(k).tier for k in ("m0", "m1", "m2")] == [Tier.RAM, Tier.DISK, Tier.RAM]

    manager.set_priority("m0", 0)
    manager.pin("m0")  # still least recently used, but pinned: m2 goes instead
    manager.park("m3")
    assert [manager.get(k).tier for k in ("m0", "m2", "m3")] == [Tier.RAM, Tier.DISK, Tier.RAM]
    with pytest.raises(ModelPinnedError, match="turn Keep in RAM off"):
        manager.evict("m0")

    with manager.using("m3"):
        with pytest.raises(TierCapacityError, match=r"'model 0' \(pinned\).*'model 3' \(in use\)"):
            manager.acquire("m1")
    assert manager.get("m1").tier is Tier.DISK
    manager.unpin("m0")
    manager.evict("m0")
    assert manager.get("m0").tier is Tier.DISK
    _consistent(manager, backends)


def test_priority_orders_vram_parking_and_pinned_does_not_hold_vram(rig):
    manager, _, backends = rig(3, vram_models=2.5)
    manager.set_priority("m0", 1)
    for key in ("m0", "m1", "m2"):
        manager.load(key)
    assert [manager.get(k).tier for k in ("m0", "m1", "m2")] == [Tier.VRAM, Tier.RAM, Tier.VRAM]
    manager.pin("m2")  # pinned guards against disk only
    manager.load("m1")
    assert [manager.get(k).tier for k in ("m0", "m1", "m2")] == [Tier.VRAM, Tier.VRAM, Tier.RAM]
    assert manager.make_room_vram(backends[0].size * 2) == ["m1", "m0"]
    assert all(manager.get(k).tier is Tier.RAM for k in ("m0", "m1", "m2"))
    _consistent(manager, backends)


def test_disk_tier_off_refuses_instead_of_dropping(rig):
    manager, _, backends = rig(2, ram_models=1.5, disk_tier=False)
    manager.park("m0")
    with pytest.raises(TierCapacityError, match="disk tier is off"):
        manager.acquire("m1")
    assert manager.get("m0").tier is Tier.RAM and manager.get("m1").tier is Tier.DISK
    manager.set_budgets(disk_tier=True)
    with manager.using("m1"):
        pass
    assert manager.get("m0").tier is Tier.DISK
    _consistent(manager, backends)


def _reference(backend: LinearStack) -> torch.Tensor:
    module = _build(WIDTH, DEPTH)
    module.load_state_dict(load_file(str(backend.path)))
    with torch.no_grad():
        return module(X)


def test_preload_then_concurrent_acquire_loads_once(rig):
    manager, _, (a,) = rig(1)
    a.gate = threading.Event()
    preload = manager.preload(["m0"], Tier.VRAM)
    assert a.started.wait(JOIN_S)
    assert manager.wait_ready("m0", timeout=0.05) is False  # the gated load cannot have finished

    snapshots = []  # the panel reads state while the load holds the lock
    reader = threading.Thread(target=lambda: snapshots.append(manager.snapshot()))
    reader.start()
    reader.join(JOIN_S)
    assert not reader.is_alive() and snapshots[0]["models"][0]["tier"] == "disk"

    outputs = []

    def prompt() -> None:
        assert manager.wait_ready("m0", timeout=JOIN_S)
        with manager.using("m0", to=Tier.VRAM):
            outputs.append(a.run(X))

    user = threading.Thread(target=prompt)
    user.start()
    a.gate.set()
    preload.join(JOIN_S)
    user.join(JOIN_S)
    assert not preload.is_alive() and not user.is_alive()
    entry = manager.get("m0")
    assert (entry.loads_from_disk, a.disk_reads, entry.load_count) == (1, 1, 2)
    assert entry.tier is Tier.VRAM and entry.in_use == 0
    assert torch.equal(outputs[0], _reference(a))


def test_failed_preload_is_logged_and_model_stays_usable(rig, caplog):
    manager, _, (a, b) = rig(2)
    a.fail_loads = 2
    with caplog.at_level(logging.ERROR, logger="offload_core.models.preloads"):
        manager.preload(["m0", "m1"]).join(JOIN_S)
        assert manager.preload(["m0"], background=False) is None
    assert caplog.text.count("preload of 'model 0' (m0) failed") == 2
    assert "simulated read error" in caplog.text
    assert manager.get("m0").tier is Tier.DISK and manager.get("m1").tier is Tier.RAM
    assert manager.wait_ready("m0", timeout=JOIN_S)
    with manager.using("m0") as entry:
        assert torch.equal(a.run(X), _reference(a))
    assert entry.loads_from_disk == 1
    with pytest.raises(UnknownModelError):
        manager.preload(["m1", "nope"])


def test_threads_acquire_release_evict_without_deadlock(rig):
    manager, machine, backends = rig(4, ram_models=2.5, vram_models=1.5)
    references = {f"m{i}": _reference(b) for i, b in enumerate(backends)}
    events = tier_events(manager)
    errors = []
    outcomes = {"used": 0, "capacity": 0, "in_use": 0}
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait(JOIN_S)
            for _ in range(40):
                i = rng.randrange(4)
                key, action = f"m{i}", rng.random()
                try:
                    if action < 0.6:
                        with manager.using(key, to=rng.choice([Tier.RAM, Tier.VRAM])) as entry:
                            assert entry.in_use >= 1
                            assert torch.equal(backends[i].run(X), references[key])
                        outcomes["used"] += 1
                    elif action < 0.8:
                        manager.evict(key)
                    elif action < 0.9:
                        manager.park(key)
                    else:
                        json.dumps(manager.snapshot())
                except TierCapacityError:
                    outcomes["capacity"] += 1
                except ModelInUseError:
                    outcomes["in_use"] += 1
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    assert outcomes["used"] > 0
    _consistent(manager, backends)
    assert all(manager.get(f"m{i}").in_use == 0 for i in range(4))
    assert machine.ram_used() <= machine.ram_cap and machine.vram_free() >= 0
    tiers = {f"m{i}": "disk" for i in range(4)}
    for event in sorted(events, key=lambda e: e["seq"]):
        assert event["old"] == tiers[event["id"]]
        assert abs(["disk", "ram", "vram"].index(event["new"])
                   - ["disk", "ram", "vram"].index(event["old"])) == 1
        tiers[event["id"]] = event["new"]
    assert tiers == {f"m{i}": manager.get(f"m{i}").tier.value for i in range(4)}


def test_listeners_see_every_tier_change_and_a_raising_one_is_isolated(rig, caplog):
    manager, _, (a, b) = rig(2, ram_models=1.5)
    events = []
    outside_lock = []

    def broken(event: dict) -> None:
        raise RuntimeError("listener bug")

    def calls_back(event: dict) -> None:
        # Another thread taking the manager's lock finishes only if listeners run unlocked.
        worker = threading.Thread(target=manager.set_priority, args=("m1", 0))
        worker.start()
        worker.join(JOIN_S)
        outside_lock.append(not worker.is_alive())

    for fn in (broken, events.append, calls_back):
        manager.subscribe(fn)
    with caplog.at_level(logging.ERROR, logger="offload_core.models.tier_events"):
        manager.load("m0")
        with manager.using("m1"):
            pass
    assert [(e["type"], e["id"], e.get("old"), e.get("new"), e["reason"]) for e in events] == [
        ("tier", "m0", "disk", "ram", "load"), ("tier", "m0", "ram", "vram", "load"),
        ("tier", "m0", "vram", "ram", "ram_budget"), ("tier", "m0", "ram", "disk", "ram_budget"),
        ("tier", "m1", "disk", "ram", "acquire"), ("use", "m1", None, None, "acquire"),
        ("use", "m1", None, None, "release")]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert {e["name"] for e in events} == {"model 0", "model 1"}
    # The callback's set_priority(m1, 0) changed nothing, so it announced nothing.
    assert all(outside_lock) and len(outside_lock) == 7
    assert caplog.text.count("tier listener") == 7 and "listener bug" in caplog.text
    manager.unsubscribe(events.append)
    manager.evict("m1")
    assert len(events) == 7
    _consistent(manager, [a, b])


def test_policy_budget_and_registry_changes_are_announced(rig, tmp_path):
    manager, machine, _ = rig(1)
    events = []
    manager.subscribe(events.append)
    manager.pin("m0")
    manager.pin("m0")  # no change, no event
    manager.unpin("m0")
    manager.set_priority("m0", 5)
    manager.set_budgets(disk_tier=False)
    manager.set_budgets(disk_tier=False)
    manager.register("m1", "model 1", LinearStack(machine, tmp_path / "x.safetensors", 9),
                     kind="vae")
    manager.forget("m1")
    assert [(e["type"], e.get("id"), e["reason"]) for e in events] == [
        ("policy", "m0", "pin"), ("policy", "m0", "unpin"), ("policy", "m0", "priority"),
        ("budgets", None, "budgets"), ("register", "m1", "register"), ("forget", "m1", "forget")]
    assert events[3]["budgets"] == manager.budgets()
    assert json.loads(json.dumps(events)) == events


@pytest.mark.parametrize("kwargs, message", [
    ({"ram_budget_bytes": -1}, "ram_budget_bytes must be >= 0"),
    ({"ram_budget_bytes": "8G"}, "ram_budget_bytes must be a whole number of bytes or null"),
    ({"ram_reserve_bytes": 1.5e9}, "ram_reserve_bytes must be a whole number of bytes"),
    ({"ram_reserve_bytes": None}, "ram_reserve_bytes must be a whole number of bytes"),
    ({"vram_reserve_bytes": True}, "vram_reserve_bytes must be a whole number of bytes"),
    ({"disk_tier": "yes"}, "disk_tier must be true or false"),
    ({"ram_budget_bytes": 1 << 30, "disk_tier": 1}, "disk_tier must be true or false"),
])
def test_bad_budgets_raise_value_error_and_change_nothing(kwargs, message):
    manager = TierManager(vram_free_fn=lambda: None)
    before = manager.budgets()
    with pytest.raises(ValueError, match=message):
        manager.set_budgets(**kwargs)
    assert manager.budgets() == before


@pytest.mark.parametrize("kwargs, message", [
    ({"ram_budget_bytes": MAX_BUDGET_BYTES + 1}, "ram_budget_bytes must be at most"),
    ({"ram_budget_bytes": 10 ** 4294}, "ram_budget_bytes must be at most"),
    ({"ram_reserve_bytes": -10 ** 4294}, "ram_reserve_bytes must be >= 0"),
    ({"vram_reserve_bytes": MAX_BUDGET_BYTES * 2}, "vram_reserve_bytes must be at most"),
    ({"ram_reserve_bytes": ram_total_bytes() + 1}, "is more than this machine's RAM"),
])
def test_impossible_budgets_are_refused_with_a_short_message(kwargs, message):
    manager = TierManager(vram_free_fn=lambda: None)
    before = manager.budgets()
    with pytest.raises(ValueError, match=message) as refused:
        manager.set_budgets(**kwargs)
    assert len(str(refused.value)) < 200
    assert manager.budgets() == before
    json.dumps(manager.snapshot())  # every published figure stays a small JSON number


def test_bad_constructor_and_policy_values_raise_value_error(rig):
    with pytest.raises(ValueError, match="vram_reserve_bytes must be >= 0"):
        TierManager(vram_reserve_bytes=-1)
    manager, _, _ = rig(1)
    with pytest.raises(ValueError, match="priority must be a whole number"):
        manager.set_priority("m0", "high")
    with pytest.raises(ValueError, match="tier must be one of vram, ram"):
        manager.acquire("m0", to=Tier.DISK)
    assert manager.budgets()["ram_budget_bytes"] is not None
    assert manager.set_budgets(ram_budget_bytes=None)["ram_budget_bytes"] is None


def test_unknown_key_raises_unknown_model_error(rig):
    manager, _, _ = rig(1)
    actions = [manager.acquire, manager.release, manager.load, manager.park, manager.evict,
               manager.pin, manager.unpin, manager.forget, manager.get, manager.wait_ready,
               lambda key: manager.set_priority(key, 1)]
    for action in actions:
        with pytest.raises(UnknownModelError, match="unknown model id 'nope'"):
            action("nope")


def test_register_is_idempotent_and_forget_releases_memory(rig, tmp_path):
    manager, machine, (a,) = rig(1)
    again = LinearStack(machine, tmp_path / "other.safetensors", seed=7)
    assert manager.register("m0", "renamed", again, kind="vae") is manager.get("m0")
    assert manager.get("m0").name == "model 0"
    manager.load("m0")
    manager.forget("m0")
    assert a.actual_tier() is Tier.DISK
    with pytest.raises(UnknownModelError):
        manager.get("m0")
    ready = LinearStack(machine, tmp_path / "ready.safetensors", seed=8)
    ready.load_from_disk()
    entry = manager.register("r", "ready", ready, kind="clip", tier="ram",
                             policy=Policy(pinned=True, priority=3))
    assert entry.tier is Tier.RAM and entry.bytes_by_tier["ram"] == ready.size
    with manager.using("r") as entry:
        assert entry.loads_from_ram == 1 and entry.loads_from_disk == 0
    manager.clear()
    assert manager.snapshot()["models"] == [] and ready.actual_tier() is Tier.DISK


def test_observe_records_moves_made_outside_the_manager(rig):
    manager, _, (a, b) = rig(2, vram_models=1.5)
    events = tier_events(manager)
    manager.park("m0")
    a.to_vram()  # what ComfyUI does on its own when it samples
    assert manager.observe("m0", "vram") is True
    assert manager.observe("m0", Tier.VRAM) is False
    entry = manager.get("m0")
    assert entry.bytes_by_tier["vram"] == a.size and entry.loads_from_disk == 1
    last = events[-1]
    assert (last["old"], last["new"], last["reason"]) == ("ram", "vram", "observed")
    manager.load("m1")  # the observed copy is what gets parked for room
    assert manager.get("m0").tier is Tier.RAM and a.actual_tier() is Tier.RAM
    _consistent(manager, [a, b])


def test_listeners_of_an_observed_move_run_outside_the_lock(rig):
    """An observation announces its move after releasing the lock, as every other change does, so
    a listener may wait for another thread that calls the manager."""
    manager, _, (a,) = rig(1)
    manager.park("m0")
    outside_lock = []

    def calls_back(event: dict) -> None:
        if event["reason"] == "observed":
            worker = threading.Thread(target=manager.set_priority, args=("m0", 1))
            worker.start()
            worker.join(JOIN_S)
            outside_lock.append(not worker.is_alive())

    manager.subscribe(calls_back)
    a.to_vram()
    assert manager.observe("m0", Tier.VRAM) is True
    assert outside_lock == [True] and manager.get("m0").policy.priority == 1


def test_snapshot_is_json_and_has_the_documented_shape(rig):
    manager, _, (a, b) = rig(2)
    manager.load("m0")
    manager.acquire("m1")
    snap = json.loads(json.dumps(manager.snapshot()))
    assert set(snap) == {"models", "budgets", "ram", "vram"}
    assert set(snap["budgets"]) == {"ram_budget_bytes", "ram_reserve_bytes", "vram_reserve_bytes",
                                    "disk_tier"}
    assert set(snap["ram"]) == {"total", "available", "budget", "used_by_models"}
    assert snap["ram"]["used_by_models"] == a.size + b.size
    assert snap["ram"]["budget"] <= manager.budgets()["ram_budget_bytes"]
    m0, m1 = snap["models"]
    assert set(m0) == {"id", "name", "kind", "tier", "bytes", "total_bytes", "last_used",
                       "load_count", "loads_from_disk", "loads_from_ram", "loads_already_loaded", "in_use",
                       "moving", "policy"}
    assert (m0["tier"], m0["bytes"], m0["total_bytes"]) == ("vram", {"vram": a.size, "ram": a.size},
                                                           a.size)
    assert (m1["tier"], m1["in_use"], m1["policy"]) == ("ram", 1, {"keep_in_ram": False, "priority": 0})
    manager.release("m1")


def test_model_id_tracks_file_identity_and_options(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    stat = path.stat()
    version = file_version(stat)
    options = {"dtype": "fp16", "weight_dtype": torch.float8_e4m3fn}
    base = model_id(path, version, options)
    assert len(base) == 16
    assert base == model_id(str(path), file_version(path.stat()), dict(reversed(options.items())))
    os.utime(path, ns=(stat.st_mtime_ns + 10**9, stat.st_mtime_ns + 10**9))
    assert model_id(path, file_version(path.stat()), options) != base
    assert model_id(path, version, {**options, "dtype": "bf16"}) != base
    assert model_id(tmp_path / "other.safetensors", version, options) != base


def test_a_file_version_moves_on_with_every_write_even_with_its_time_stamp_put_back(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64)}, str(path))
    before = path.stat()
    time.sleep(0.05)  # a coarse change-time clock must tick (no timing is asserted)
    with open(path, "r+b") as f:  # the same size, in place
        f.seek(-8, os.SEEK_END)
        f.write(b"\x01" * 8)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert file_version(after) != file_version(before)
    renamed = tmp_path / "new.safetensors"
    save_file({"w": torch.zeros(64)}, str(renamed))
    os.utime(renamed, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(renamed, path)
    assert file_version(path.stat()) not in (file_version(before), file_version(after))


def test_a_newer_version_of_a_file_supersedes_the_old_entry(rig, tmp_path):
    manager, machine, (old,) = rig(1)
    manager.forget("m0")
    manager.register("v1", "model", old, kind="diffusion", source="file-a")
    manager.load("v1")
    v2 = LinearStack(machine, tmp_path / "v2.safetensors", seed=200)
    manager.register("v2", "model", v2, kind="diffusion", source="file-a")
    # The idle old version is forgotten at once: RAM holds one version of the file.
    assert old.actual_tier() is Tier.DISK
    with pytest.raises(UnknownModelError):
        manager.get("v1")
    # An old version in use stays until its job ends, but nothing new may use it.
    manager.acquire("v2")
    v3 = LinearStack(machine, tmp_path / "v3.safetensors", seed=300)
    manager.register("v3", "model", v3, kind="diffusion", source="file-a")
    assert manager.get("v2").superseded and v2.actual_tier() is Tier.RAM
    for action in (manager.acquire, manager.park):
        with pytest.raises((SourceChangedError, ModelInUseError)):
            action("v2")
    manager.release("v2")
    with pytest.raises(UnknownModelError):
        manager.get("v2")
    assert v2.actual_tier() is Tier.DISK
    assert [m["id"] for m in manager.snapshot()["models"]] == ["v3"]
    # Another source is another model.
    other = LinearStack(machine, tmp_path / "other.safetensors", seed=400)
    manager.register("o", "other", other, kind="diffusion", source="file-b")
    assert {m["id"] for m in manager.snapshot()["models"]} == {"v3", "o"}


def test_source_errors_on_load_leave_a_consistent_manager(rig):
    manager, _, (a, b) = rig(2)
    a.source_error = SourceGoneError("model 0's file is gone")
    with pytest.raises(SourceGoneError):
        manager.load("m0")
    assert manager.get("m0").tier is Tier.DISK and manager.get("m0").moving is None
    assert manager.snapshot()["models"][0]["moving"] is None
    with manager.using("m0"):  # the file is back: the same id loads
        assert torch.equal(a.run(X), _reference(a))
    # A changed file under an old id is never loaded: the entry is forgotten instead.
    b.source_error = SourceChangedError("model 1's file changed")
    with pytest.raises(SourceChangedError):
        manager.acquire("m1")
    with pytest.raises(UnknownModelError):
        manager.get("m1")
    assert b.disk_reads == 0 and b.actual_tier() is Tier.DISK


def test_a_status_read_during_a_load_sees_the_move_and_never_waits(rig):
    manager, _, (a,) = rig(1)
    a.gate = threading.Event()
    loader = threading.Thread(target=manager.load, args=("m0",))
    loader.start()
    assert a.started.wait(JOIN_S)
    # The load holds the lock: the published state says what is moving, and an observation
    # that must not wait gives up instead of blocking.
    seen = manager.snapshot()["models"][0]
    assert seen["moving"] == {"from": "disk", "to": "ram", "reason": "load"}
    observed = []
    reader = threading.Thread(target=lambda: observed.append(
        manager.observe("m0", Tier.RAM, wait=False)))
    reader.start()
    reader.join(JOIN_S)
    assert not reader.is_alive() and observed == [False]
    a.gate.set()
    loader.join(JOIN_S)
    assert not loader.is_alive()
    final = manager.snapshot()["models"][0]
    assert final["moving"] is None and final["tier"] == "vram"


def test_source_key_ignores_mtime_but_not_path_or_options(tmp_path):
    path = tmp_path / "model.safetensors"
    assert source_key(path, {"a": 1}) == source_key(str(path), {"a": 1})
    assert source_key(path, {"a": 1}) != source_key(path, {"a": 2})
    assert source_key(path, {"a": 1}) != source_key(tmp_path / "other", {"a": 1})
