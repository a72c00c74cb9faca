"""Process-wide VRAM / RAM / disk tier manager for whole models: the one door to its parts.

Switching workflows makes ComfyUI read the same checkpoints from disk again and again, while a
copy parked in RAM comes back many times faster. The manager keeps the bookkeeping and applies
the policy: where each model lives, which one goes down a tier when room is needed, and which
ones must never move because they are in use. It does not know what a model is: each model comes
with a backend that moves its bytes (tier_entries.py), so the manager works the same for ComfyUI
models and for test modules.

Its jobs live in their own modules, each below the one that uses it:
- tier_registry.py: the entries, the one lock, and what is published and announced of them;
- tier_moves.py: one step between tiers through a backend, and a model's end (forgotten,
  superseded);
- tier_room.py: the budgets, the idle models that go to make room, and bringing a model up;
- tier_policy.py: a model's policy (pinned, priority), changed on request;
- preloads.py: warming models up in the background, and waiting for it;
- eviction.py, tier_budgets.py, tier_events.py, tier_entries.py, tier_errors.py: the choices,
  figures, events, records and refusals those use (a file's identity: files/file_identity.py).

Locking: every tier change runs under the registry's one re-entrant lock, with the backend called
while holding it, so loads and evictions never interleave and a request that arrives during a load
simply waits. A backend must therefore never call back into the manager. Listeners are called
after the lock is released, and ``snapshot`` reads a copy published when a move starts and when
each change ends, so a status request never waits for a load and can see which model is moving.

Identity: a model file that changed on disk is a different model (files/file_identity.py). Entries
registered with the same ``source`` supersede each other: the older one is forgotten as soon as no
job uses it, so RAM never holds two versions of one file and new bytes never appear under an old
id.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from .preloads import Preloads
from .tier_budgets import (DEFAULT_RAM_RESERVE_BYTES, DEFAULT_VRAM_RESERVE_BYTES, UNSET, TierBudgets, Unset,
                           check_bytes, cuda_free_bytes)
from .tier_entries import Entry, Policy, Tier, TierBackend, as_tier, check_policy
from .tier_errors import ModelInUseError, ModelPinnedError, SourceChangedError
from .tier_moves import TierMoves
from .tier_policy import TierPolicies, checked_policy
from .tier_registry import TierRegistry
from .tier_room import TierRoom


class TierManager:
    """The requests made of the tier manager: registering, using, moving and preloading models,
    setting budgets and policy, and reading status.

    Each request checks its arguments, takes the registry's lock, refuses what must not happen
    (a model in use, superseded or pinned) and hands the work to the part whose job it is. It is
    one class because the ComfyUI side holds one manager for the process (nodes/core/state.py), its
    REST layer maps this class's refusals to HTTP statuses, and every request must run under the
    same lock; nothing outside the manager reaches the parts behind it.

    ``vram_free_fn`` returns the VRAM free for models in bytes, or None for unlimited; the default
    measures the current CUDA device (unlimited without CUDA), tests pass a simulated GPU.
    """

    def __init__(self, *, vram_free_fn: Callable[[], int | None] | None = None,
                 ram_budget_bytes: int | None = None,
                 ram_reserve_bytes: int = DEFAULT_RAM_RESERVE_BYTES,
                 vram_reserve_bytes: int = DEFAULT_VRAM_RESERVE_BYTES,
                 disk_tier: bool = True) -> None:
        self._registry = TierRegistry()
        self._moves = TierMoves(self._registry)
        self._room = TierRoom(self._registry, self._moves, vram_free_fn or cuda_free_bytes)
        self._policies = TierPolicies(self._registry, self._room)
        self._preloads = Preloads()
        self.set_budgets(ram_budget_bytes=ram_budget_bytes, ram_reserve_bytes=ram_reserve_bytes,
                         vram_reserve_bytes=vram_reserve_bytes, disk_tier=disk_tier)

    # ----------------------------------------------------------------------------------------
    # Registration and lookup

    def register(self, key: str, name: str, backend: TierBackend, *, kind: str,
                 tier: Tier | str = Tier.DISK, policy: Policy | None = None,
                 source: str | None = None) -> Entry:
        """Track a model; ``tier`` says where the backend holds it now.

        Registering a known key returns the existing entry unchanged, so adapters can register on
        every prompt without resetting counters or replacing a loaded backend. Entries with the
        same ``source`` (see ``source_key``) and another key are superseded by this one: forgotten
        now if idle, else when their last use ends.
        """
        tier = as_tier(tier, (Tier.VRAM, Tier.RAM, Tier.DISK))
        policy = checked_policy(policy)
        with self._registry.locked():
            entry = self._registry.known(key)
            if entry is not None:
                return entry
            entry = Entry(id=key, name=name, kind=kind, backend=backend, policy=policy, tier=tier,
                          total_bytes=int(backend.nbytes()),
                          bytes_by_tier=dict(backend.bytes_by_tier()), source=source)
            for old in self._registry.with_source(source):
                self._moves.supersede(old, by=entry)
            self._registry.add(entry)
            return entry

    def get(self, key: str) -> Entry:
        """The entry for ``key``; read-only use, fields change under the manager's lock."""
        return self._registry.get(key)

    def forget(self, key: str) -> None:
        """Stop tracking a model, releasing its memory first."""
        with self._registry.locked():
            entry = self.get(key)
            _refuse_in_use(entry, "forget")
            self._moves.forget(entry, "forget")

    def clear(self) -> None:
        """Forget every model, in use or not, and every listener (tests only)."""
        with self._registry.locked():
            for entry in self._registry.entries():
                self._moves.drop_fully(entry, "clear")
            self._registry.clear()

    # ----------------------------------------------------------------------------------------
    # Use by jobs

    def acquire(self, key: str, *, to: Tier | str = Tier.RAM) -> Entry:
        """Bring a model up to at least ``to`` and hold it there until ``release``.

        Room is made first by parking or dropping idle models. If there is no room,
        ``TierCapacityError`` is raised before any other model moves (a model just read from disk
        whose VRAM room is refused stays in RAM). A load running in another thread, a background
        preload included, finishes first, so the same model is never read from disk twice.
        """
        to = as_tier(to, (Tier.VRAM, Tier.RAM))
        with self._registry.locked():
            entry = self.get(key)
            _refuse_superseded(entry, "acquire")
            self._room.bring_up(entry, to, "acquire")
            entry.in_use += 1
            self._registry.events.announce("use", entry, reason="acquire")
            return entry

    def release(self, key: str) -> None:
        """End one use of a model; when the last use ends, idle models over the RAM budget go,
        and a superseded model is forgotten."""
        with self._registry.locked():
            entry = self.get(key)
            if entry.in_use == 0:
                raise ValueError(f"release of '{entry.name}' ({key}) without a matching acquire")
            entry.in_use -= 1
            self._registry.touch(entry)
            self._registry.events.announce("use", entry, reason="release")
            if entry.in_use == 0:
                if entry.superseded:
                    self._moves.forget(entry, "superseded")
                self._room.drop_over_budget(0, None, strict=False)

    @contextmanager
    def using(self, key: str, to: Tier | str = Tier.RAM) -> Iterator[Entry]:
        """``acquire`` for the duration of a ``with`` block."""
        entry = self.acquire(key, to=to)
        try:
            yield entry
        finally:
            self.release(key)

    # ----------------------------------------------------------------------------------------
    # Explicit actions (REST)

    def load(self, key: str) -> Entry:
        """Bring a model into VRAM now (for example before a batch of prompts)."""
        with self._registry.locked():
            entry = self.get(key)
            _refuse_in_use(entry, "load")
            _refuse_superseded(entry, "load")
            self._room.bring_up(entry, Tier.VRAM, "load")
            return entry

    def park(self, key: str) -> Entry:
        """Put a model in RAM: from VRAM by dropping the device copy, from disk by loading it."""
        with self._registry.locked():
            entry = self.get(key)
            _refuse_in_use(entry, "park")
            _refuse_superseded(entry, "park")
            if entry.tier is Tier.VRAM:
                self._moves.step(entry, Tier.RAM, "park")
            else:
                self._room.bring_up(entry, Tier.RAM, "park")
            return entry

    def evict(self, key: str) -> Entry:
        """Drop a model to disk, going down one tier at a time."""
        with self._registry.locked():
            entry = self.get(key)
            _refuse_in_use(entry, "evict")
            if entry.policy.pinned:
                raise ModelPinnedError(
                    f"'{entry.name}' is kept in RAM; turn Keep in RAM off to evict it to disk")
            self._moves.drop_fully(entry, "evict")
            return entry

    def pin(self, key: str) -> Entry:
        """Never drop this model to disk (it may still be parked from VRAM to RAM)."""
        with self._registry.locked():
            entry = self.get(key)
            self._policies.pin(entry)
            return entry

    def unpin(self, key: str, *, drop: bool = True) -> Entry:
        """Let this model be dropped to disk again. With ``drop``, idle models over the RAM budget
        go at once; without it they stay until the next ``enforce_ram_budget`` or release (a
        caller outside the host's model-management thread leaves the drop to it)."""
        with self._registry.locked():
            entry = self.get(key)
            self._policies.unpin(entry, drop=drop)
            return entry

    def set_priority(self, key: str, priority: int) -> Entry:
        """Set the eviction priority: higher stays longer under pressure."""
        check_policy(Policy(priority=priority))
        with self._registry.locked():
            entry = self.get(key)
            self._policies.set_priority(entry, priority)
            return entry

    def observe(self, key: str, tier: Tier | str, *, wait: bool = True) -> bool:
        """Record where a model is after something outside the manager moved it.

        ComfyUI loads models onto the GPU and unloads them on its own; the adapter reports what it
        finds, so budgets and the panel work with real figures. No backend method that moves
        anything is called: the backend's byte figures are re-read and a change of tier is
        announced with reason "observed". Returns whether the tier changed. With ``wait=False``
        nothing is recorded while another thread holds the lock (a status request must not wait
        for a load, and the load publishes fresh figures when it ends).
        """
        tier = as_tier(tier, (Tier.VRAM, Tier.RAM, Tier.DISK))
        with self._registry.locked(wait=wait) as held:
            if not held:
                return False
            return self._moves.observed(self.get(key), tier)

    # ----------------------------------------------------------------------------------------
    # Budgets and room

    def set_budgets(self, *, ram_budget_bytes: int | None | Unset = UNSET,
                    ram_reserve_bytes: int | Unset = UNSET,
                    vram_reserve_bytes: int | Unset = UNSET,
                    disk_tier: bool | Unset = UNSET) -> dict[str, Any]:
        """Change the memory policy; arguments left out keep their value.

        ``ram_budget_bytes`` caps RAM held by models (None: no cap, only available RAM minus the
        reserve; 0 is a cap of zero bytes, so every idle unpinned model goes to disk);
        ``disk_tier=False`` never drops a model to disk on its own. Every value is validated
        before any is applied: bytes are whole numbers up to ``MAX_BUDGET_BYTES``, a RAM reserve
        is at most the machine's RAM and a VRAM reserve at most the GPU's memory. Idle models
        over the new budget are dropped at once.
        """
        changes = {name: value for name, value in (
            ("ram_budget_bytes", ram_budget_bytes), ("ram_reserve_bytes", ram_reserve_bytes),
            ("vram_reserve_bytes", vram_reserve_bytes), ("disk_tier", disk_tier)) if value is not UNSET}
        TierBudgets.check(**changes)
        with self._registry.locked():
            return self._room.set_budgets(changes)

    def budgets(self) -> dict[str, Any]:
        """The current memory policy, as ``set_budgets`` takes it."""
        return self._room.budgets()

    def make_room_vram(self, nbytes: int) -> list[str]:
        """Park idle VRAM models in RAM until ``nbytes`` plus the reserve are free.

        Lowest priority goes first, then least recently used. Returns the parked ids; raises
        ``TierCapacityError`` without parking anything if even parking every idle model is not
        enough.
        """
        check_bytes("nbytes", nbytes)
        with self._registry.locked():
            return self._room.make_room_vram(nbytes, None)

    def enforce_ram_budget(self) -> list[str]:
        """Drop idle, unpinned models to disk while models hold more RAM than the budget.

        Returns the dropped ids. Models in use or pinned stay (all stay with the disk tier off),
        so RAM may remain over budget; that is logged, and later loads are refused until room
        exists.
        """
        with self._registry.locked():
            return self._room.enforce_ram_budget()

    # ----------------------------------------------------------------------------------------
    # Preload

    def preload(self, keys: Iterable[str], tier: Tier | str = Tier.RAM, *,
                background: bool = True) -> threading.Thread | None:
        """Warm models up, by default in a daemon thread (returned, so callers may join it).

        Unknown keys raise here, before anything starts. A load failure is logged with the model's
        name and never raised: the model stays on disk and loads on first use. ``wait_ready``
        tells when a key's preload has finished.
        """
        tier = as_tier(tier, (Tier.VRAM, Tier.RAM))
        models = [(key, self.get(key).name) for key in keys]
        return self._preloads.start(models, lambda key: self._preload_one(key, tier),
                                    background=background)

    def wait_ready(self, key: str, timeout: float | None = None) -> bool:
        """Block until no preload of ``key`` is pending; False if ``timeout`` ran out first."""
        self.get(key)
        return self._preloads.wait(key, timeout)

    def _preload_one(self, key: str, tier: Tier) -> None:
        with self._registry.locked():
            self._room.bring_up(self.get(key), tier, "preload")

    # ----------------------------------------------------------------------------------------
    # Listeners and status

    def subscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(event)`` after every change, from whichever thread made it.

        Every event carries ``type``, ``seq`` (increasing in the order the changes happened;
        delivery from different threads may interleave), ``time`` and ``reason``. Types:
        - "tier": a model moved; ``id``, ``name``, ``kind``, ``old`` and ``new`` (tier values);
          reason is the request that moved it (acquire, load, park, evict, preload, forget,
          superseded, clear), vram_pressure or ram_budget for models moved to make room, or
          observed;
        - "register", "forget": a model became known or was forgotten (``id``, ``name``,
          ``kind``);
        - "use": a job acquired or released a model (reason acquire / release);
        - "policy": pin, unpin or priority changed a model's policy;
        - "budgets": the budgets changed (``budgets``, as ``budgets()`` returns them).
        Nothing is announced for a request that changes nothing. A listener that raises is
        logged and skipped.
        """
        self._registry.subscribe(fn)

    def unsubscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Stop calling ``fn``; unknown listeners are ignored."""
        self._registry.unsubscribe(fn)

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state for the panel, without waiting for a running load."""
        models = self._registry.published()
        used = sum(m["bytes"].get("ram", 0) + m["bytes"].get("pinned", 0) for m in models)
        return {"models": models, "budgets": self.budgets(), **self._room.memory(used)}


def _refuse_in_use(entry: Entry, action: str) -> None:
    if entry.in_use:
        raise ModelInUseError(f"cannot {action} '{entry.name}' ({entry.id}): in use by "
                              f"{entry.in_use} job(s)")


def _refuse_superseded(entry: Entry, action: str) -> None:
    if entry.superseded:
        raise SourceChangedError(
            f"cannot {action} '{entry.name}' ({entry.id}): a newer version of its file is "
            "registered; this one is forgotten when its last use ends")
