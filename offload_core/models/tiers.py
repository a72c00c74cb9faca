"""Process-wide VRAM / RAM / disk tier manager for whole models.

Switching workflows makes ComfyUI read the same checkpoints from disk again and again, while a
copy parked in RAM comes back many times faster. The manager keeps the bookkeeping and applies
the policy: where each model lives, which one goes down a tier when room is needed, and which
ones must never move because they are in use. It does not know what a model is: each model comes
with a backend that moves its bytes (tier_entries.py), so the manager works the same for ComfyUI
models and for test modules.

A model that is acquired and not yet released is never moved down, and a load that cannot fit
because everything else is in use or pinned is refused with ``TierCapacityError`` before anything
is moved, instead of running the machine out of memory. Which models go to make room is chosen by
eviction.py, against the budgets of tier_budgets.py.

Locking: every tier change runs under one re-entrant lock, with the backend called while holding
it, so loads and evictions never interleave and a request that arrives during a load simply waits.
A backend must therefore never call back into the manager. Listeners are called after the lock is
released, and ``snapshot`` reads a copy published when a move starts and when each change ends, so
a status request never waits for a load and can see which model is moving (tier_events.py).

Identity: a model file that changed on disk is a different model (file_identity.py). Entries
registered with the same ``source`` supersede each other: the older one is forgotten as soon as no
job uses it, so RAM never holds two versions of one file and new bytes never appear under an old
id.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from ..units import size_text
from . import eviction
from .preloads import Preloads
from .tier_budgets import (DEFAULT_RAM_RESERVE_BYTES, DEFAULT_VRAM_RESERVE_BYTES, UNSET, TierBudgets, Unset,
                           check_bytes, cuda_free_bytes)
from .tier_entries import Entry, Policy, Tier, TierBackend, as_tier, check_policy
from .tier_errors import (ModelInUseError, ModelPinnedError, SourceChangedError, TierCapacityError,
                          UnknownModelError)
from .tier_events import TierEvents

logger = logging.getLogger(__name__)

# One step down or up the ladder: the backend method that performs it and the log wording.
_STEPS = {
    (Tier.DISK, Tier.RAM): ("load_from_disk", "loaded from disk into RAM"),
    (Tier.RAM, Tier.VRAM): ("to_vram", "moved to VRAM"),
    (Tier.VRAM, Tier.RAM): ("to_ram", "parked in RAM"),
    (Tier.RAM, Tier.DISK): ("drop", "dropped to disk"),
}


class TierManager:
    """Moves registered models between VRAM, RAM and disk under one lock and one policy.

    ``vram_free_fn`` returns the VRAM free for models in bytes, or None for unlimited; the default
    measures the current CUDA device (unlimited without CUDA), tests pass a simulated GPU.
    """

    def __init__(self, *, vram_free_fn: Callable[[], int | None] | None = None,
                 ram_budget_bytes: int | None = None,
                 ram_reserve_bytes: int = DEFAULT_RAM_RESERVE_BYTES,
                 vram_reserve_bytes: int = DEFAULT_VRAM_RESERVE_BYTES,
                 disk_tier: bool = True) -> None:
        self._vram_free_fn = vram_free_fn or cuda_free_bytes
        self._lock = threading.RLock()
        self._depth = 0
        self._entries: dict[str, Entry] = {}
        self._use_seq = 0
        self._events = TierEvents()
        self._preloads = Preloads()
        self._budgets = TierBudgets()
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
        policy = Policy() if policy is None else Policy(policy.pinned, policy.priority)
        check_policy(policy)
        with self._locked():
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            entry = Entry(id=key, name=name, kind=kind, backend=backend, policy=policy, tier=tier,
                          total_bytes=int(backend.nbytes()),
                          bytes_by_tier=dict(backend.bytes_by_tier()), source=source)
            for old in [e for e in self._entries.values() if source is not None
                        and e.source == source]:
                self._supersede(old, by=entry)
            self._entries[key] = entry
            self._touch(entry)
            self._events.announce("register", entry, reason="register")
            logger.info("registered %s '%s' (%s) in %s, %s", kind, name, key, tier.value,
                        size_text(entry.total_bytes))
            return entry

    def get(self, key: str) -> Entry:
        """The entry for ``key``; read-only use, fields change under the manager's lock."""
        entry = self._entries.get(key)
        if entry is None:
            raise UnknownModelError(f"unknown model id {key!r}")
        return entry

    def forget(self, key: str) -> None:
        """Stop tracking a model, releasing its memory first."""
        with self._locked():
            entry = self.get(key)
            self._refuse_in_use(entry, "forget")
            self._forget(entry, "forget")

    def clear(self) -> None:
        """Forget every model, in use or not, and every listener (tests only)."""
        with self._locked():
            for entry in list(self._entries.values()):
                self._drop_fully(entry, "clear")
            self._entries.clear()
            self._events.forget_listeners()

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
        with self._locked():
            entry = self.get(key)
            self._refuse_superseded(entry, "acquire")
            self._bring_up(entry, to, "acquire")
            entry.in_use += 1
            self._events.announce("use", entry, reason="acquire")
            return entry

    def release(self, key: str) -> None:
        """End one use of a model; when the last use ends, idle models over the RAM budget go,
        and a superseded model is forgotten."""
        with self._locked():
            entry = self.get(key)
            if entry.in_use == 0:
                raise ValueError(f"release of '{entry.name}' ({key}) without a matching acquire")
            entry.in_use -= 1
            self._touch(entry)
            self._events.announce("use", entry, reason="release")
            if entry.in_use == 0:
                if entry.superseded:
                    self._forget(entry, "superseded")
                self._drop_over_budget(0, None, strict=False)

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
        with self._locked():
            entry = self.get(key)
            self._refuse_in_use(entry, "load")
            self._refuse_superseded(entry, "load")
            self._bring_up(entry, Tier.VRAM, "load")
            return entry

    def park(self, key: str) -> Entry:
        """Put a model in RAM: from VRAM by dropping the device copy, from disk by loading it."""
        with self._locked():
            entry = self.get(key)
            self._refuse_in_use(entry, "park")
            self._refuse_superseded(entry, "park")
            if entry.tier is Tier.VRAM:
                self._step(entry, Tier.RAM, "park")
            else:
                self._bring_up(entry, Tier.RAM, "park")
            return entry

    def evict(self, key: str) -> Entry:
        """Drop a model to disk, going down one tier at a time."""
        with self._locked():
            entry = self.get(key)
            self._refuse_in_use(entry, "evict")
            if entry.policy.pinned:
                raise ModelPinnedError(
                    f"'{entry.name}' ({key}) is pinned; unpin it before evicting")
            self._drop_fully(entry, "evict")
            return entry

    def pin(self, key: str) -> Entry:
        """Never drop this model to disk (it may still be parked from VRAM to RAM)."""
        with self._locked():
            entry = self.get(key)
            if not entry.policy.pinned:
                entry.policy.pinned = True
                self._events.announce("policy", entry, reason="pin")
                logger.info("pinned '%s' (%s)", entry.name, key)
            return entry

    def unpin(self, key: str, *, drop: bool = True) -> Entry:
        """Let this model be dropped to disk again. With ``drop``, idle models over the RAM budget
        go at once; without it they stay until the next ``enforce_ram_budget`` or release (a
        caller outside the host's model-management thread leaves the drop to it)."""
        with self._locked():
            entry = self.get(key)
            if entry.policy.pinned:
                entry.policy.pinned = False
                self._events.announce("policy", entry, reason="unpin")
                logger.info("unpinned '%s' (%s)", entry.name, key)
            if drop:
                self._drop_over_budget(0, None, strict=False)
            return entry

    def set_priority(self, key: str, priority: int) -> Entry:
        """Set the eviction priority: higher stays longer under pressure."""
        check_policy(Policy(priority=priority))
        with self._locked():
            entry = self.get(key)
            if entry.policy.priority != priority:
                entry.policy.priority = priority
                self._events.announce("policy", entry, reason="priority")
                logger.info("priority of '%s' (%s) set to %d", entry.name, key, priority)
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
        with self._locked(wait=wait) as held:
            if not held:
                return False
            entry = self.get(key)
            if tier is entry.tier:
                entry.bytes_by_tier = dict(entry.backend.bytes_by_tier())
                return False
            old = entry.tier
            self._record(entry, tier, "observed")
            logger.info("%s '%s' (%s) observed in %s, recorded in %s", entry.kind, entry.name,
                        key, tier.value, old.value)
            return True

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
        with self._locked():
            before = self.budgets()
            self._budgets.apply(**changes)
            budgets = self.budgets()
            if budgets != before:
                self._events.announce("budgets", None, reason="budgets", budgets=dict(budgets))
                logger.info("tier budgets: %s", budgets)
            self._drop_over_budget(0, None, strict=False)
            return budgets

    def budgets(self) -> dict[str, Any]:
        """The current memory policy, as ``set_budgets`` takes it."""
        return self._budgets.as_dict()

    def make_room_vram(self, nbytes: int) -> list[str]:
        """Park idle VRAM models in RAM until ``nbytes`` plus the reserve are free.

        Lowest priority goes first, then least recently used. Returns the parked ids; raises
        ``TierCapacityError`` without parking anything if even parking every idle model is not
        enough.
        """
        check_bytes("nbytes", nbytes)
        with self._locked():
            return self._make_room_vram(nbytes, None)

    def enforce_ram_budget(self) -> list[str]:
        """Drop idle, unpinned models to disk while models hold more RAM than the budget.

        Returns the dropped ids. Models in use or pinned stay (all stay with the disk tier off),
        so RAM may remain over budget; that is logged, and later loads are refused until room
        exists.
        """
        with self._locked():
            dropped, excess = self._drop_over_budget(0, None, strict=False)
            if excess > 0:
                logger.warning("models hold %s more RAM than the budget; the rest are in use, "
                               "pinned, or the disk tier is off", size_text(excess))
            return dropped

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
        keys = list(keys)
        names = {key: self.get(key).name for key in keys}
        self._preloads.add(keys)
        if not background:
            self._run_preload(keys, names, tier)
            return None
        thread = threading.Thread(target=self._run_preload, args=(keys, names, tier),
                                  name="tier-preload", daemon=True)
        thread.start()
        return thread

    def wait_ready(self, key: str, timeout: float | None = None) -> bool:
        """Block until no preload of ``key`` is pending; False if ``timeout`` ran out first."""
        self.get(key)
        return self._preloads.wait(key, timeout)

    def _run_preload(self, keys: list[str], names: dict[str, str], tier: Tier) -> None:
        for key in keys:
            try:
                with self._locked():
                    self._bring_up(self.get(key), tier, "preload")
            except Exception:
                logger.exception("preload of '%s' (%s) failed; it loads on first use instead",
                                 names[key], key)
            finally:
                self._preloads.finish(key)

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
        with self._lock:
            self._events.subscribe(fn)

    def unsubscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Stop calling ``fn``; unknown listeners are ignored."""
        with self._lock:
            self._events.unsubscribe(fn)

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state for the panel, without waiting for a running load."""
        models = self._events.published()
        used = sum(m["bytes"].get("ram", 0) + m["bytes"].get("pinned", 0) for m in models)
        vm = psutil.virtual_memory()
        return {
            "models": models,
            "budgets": self.budgets(),
            "ram": {"total": vm.total, "available": vm.available,
                    "budget": self._budgets.ram_budget(used, vm.available), "used_by_models": used},
            "vram": {"free": self._vram_free_fn()},
        }

    # ----------------------------------------------------------------------------------------
    # Internals; all below run with the lock held.

    @contextmanager
    def _locked(self, *, wait: bool = True) -> Iterator[bool]:
        """Hold the lock and yield True; on leaving the outermost level publish the state, release
        the lock, then notify. With ``wait=False`` yield False at once if another thread holds it."""
        if not self._lock.acquire(blocking=wait):
            yield False
            return
        events: list[dict[str, Any]] = []
        try:
            self._depth += 1
            try:
                yield True
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._events.publish(self._entries.values())
                    events = self._events.take()
        finally:
            self._lock.release()
            self._events.deliver(events)

    @staticmethod
    def _refuse_in_use(entry: Entry, action: str) -> None:
        if entry.in_use:
            raise ModelInUseError(f"cannot {action} '{entry.name}' ({entry.id}): in use by "
                                  f"{entry.in_use} job(s)")

    @staticmethod
    def _refuse_superseded(entry: Entry, action: str) -> None:
        if entry.superseded:
            raise SourceChangedError(
                f"cannot {action} '{entry.name}' ({entry.id}): a newer version of its file is "
                "registered; this one is forgotten when its last use ends")

    def _step(self, entry: Entry, to: Tier, reason: str) -> None:
        """Move one tier up or down through the backend, then record and announce it.

        While the backend works, the published snapshot shows the move (``moving``), so a
        status request answered during a long load says what is loading. A source file that
        changed since registration is forgotten: its id can never load the new bytes.
        """
        method, verb = _STEPS[(entry.tier, to)]
        entry.moving = {"from": entry.tier.value, "to": to.value, "reason": reason}
        self._events.publish(self._entries.values())
        start = time.perf_counter()
        try:
            getattr(entry.backend, method)()
        except SourceChangedError:
            self._forget(entry, "superseded")
            raise
        finally:
            entry.moving = None
        seconds = time.perf_counter() - start
        if entry.tier is Tier.DISK:
            entry.loads_from_disk += 1
            entry.total_bytes = int(entry.backend.nbytes())
        self._record(entry, to, reason)
        logger.info("%s '%s' (%s) %s (%s, %s, %.2fs)", entry.kind, entry.name, entry.id, verb,
                    reason, size_text(entry.total_bytes), seconds)

    def _record(self, entry: Entry, to: Tier, reason: str) -> None:
        """Set the tier, re-read the backend's figures and queue the event for listeners."""
        old = entry.tier
        entry.tier = to
        entry.bytes_by_tier = dict(entry.backend.bytes_by_tier())
        self._events.announce("tier", entry, reason=reason, old=old.value, new=to.value)

    def _forget(self, entry: Entry, reason: str) -> None:
        """Release the model's memory and stop tracking it."""
        self._drop_fully(entry, reason)
        del self._entries[entry.id]
        self._events.announce("forget", entry, reason=reason)
        logger.info("forgot %s '%s' (%s) (%s)", entry.kind, entry.name, entry.id, reason)

    def _supersede(self, old: Entry, *, by: Entry) -> None:
        """A newer version of ``old``'s file is registered: forget ``old`` once it is idle."""
        if old.id == by.id or old.superseded:
            return
        old.superseded = True
        logger.info("%s '%s' (%s) is superseded by %s: its file changed", old.kind, old.name,
                    old.id, by.id)
        if old.in_use == 0:
            self._forget(old, "superseded")

    def _bring_up(self, entry: Entry, to: Tier, reason: str) -> None:
        """Raise ``entry`` to at least ``to``, making room first, and count the request."""
        start = entry.tier
        if start is Tier.DISK:
            need = int(entry.backend.nbytes())
            self._drop_over_budget(need, entry, strict=True)
            self._step(entry, Tier.RAM, reason)
        if to is Tier.VRAM and entry.tier is Tier.RAM:
            self._make_room_vram(entry.total_bytes, entry)
            self._step(entry, Tier.VRAM, reason)
        if start is Tier.RAM:
            entry.loads_from_ram += 1
        if start is not Tier.DISK:
            logger.info("%s '%s' (%s) served from %s, no disk read (%s)", entry.kind, entry.name,
                        entry.id, start.value.upper(), reason)
        entry.load_count += 1
        self._touch(entry)

    def _touch(self, entry: Entry) -> None:
        self._use_seq += 1
        entry.use_order = self._use_seq
        entry.last_used = time.time()

    def _drop_fully(self, entry: Entry, reason: str) -> None:
        if entry.tier is Tier.VRAM:
            self._step(entry, Tier.RAM, reason)
        if entry.tier is Tier.RAM:
            self._step(entry, Tier.DISK, reason)

    def _drop_over_budget(self, need: int, exclude: Entry | None, *,
                          strict: bool) -> tuple[list[str], int]:
        """Drop idle unpinned models until ``need`` more bytes fit in the RAM budget.

        Victims go lowest priority first, parked before those in VRAM, then least recently used;
        a VRAM victim is parked and then dropped. With ``strict`` nothing moves unless the plan
        reaches the budget, and the shortfall raises. Returns the dropped ids and the bytes still
        over budget.
        """
        used = sum(e.ram_bytes() for e in self._entries.values())
        budget = self._budgets.ram_budget(used, psutil.virtual_memory().available)
        excess = used + need - budget
        if excess <= 0:
            return [], 0
        disk_tier = self._budgets.disk_tier
        victims, freed = eviction.ram_victims(self._entries.values(), excess, exclude, disk_tier)
        if strict and freed < excess:
            raise TierCapacityError(eviction.ram_refusal(self._entries.values(), exclude, need, budget,
                                                         used, disk_tier))
        for victim in victims:
            self._drop_fully(victim, "ram_budget")
        return [v.id for v in victims], max(excess - freed, 0)

    def _make_room_vram(self, need: int, exclude: Entry | None) -> list[str]:
        """Park idle VRAM models, lowest priority then least recently used, until ``need`` fits."""
        free = self._vram_free_fn()
        if free is None:
            return []
        reserve = self._budgets.vram_reserve
        excess = need + reserve - free
        if excess <= 0:
            return []
        victims, freed = eviction.vram_victims(self._entries.values(), excess, exclude)
        if freed < excess:
            raise TierCapacityError(eviction.vram_refusal(self._entries.values(), exclude, need, reserve,
                                                          free, freed))
        for victim in victims:
            self._step(victim, Tier.RAM, "vram_pressure")
        return [v.id for v in victims]
