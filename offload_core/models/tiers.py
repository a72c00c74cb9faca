"""Process-wide VRAM / RAM / disk tier manager for whole models.

Switching workflows makes ComfyUI read the same checkpoints from disk again and again, while a
copy parked in RAM comes back many times faster. This module keeps the bookkeeping and the policy:
where each model lives, which one goes down a tier when room is needed, and which ones must never
move because they are in use. It does not know what a model is: each model comes with a backend
that moves its bytes, so the manager works the same for ComfyUI models and for test modules.

Eviction goes down one tier at a time. VRAM pressure parks models in RAM (their RAM master stays,
so coming back is a host-to-device copy); RAM pressure drops parked models to disk. A model that is
acquired and not yet released is never moved down, and a load that cannot fit because everything
else is in use or pinned is refused with ``TierCapacityError`` before anything is moved, instead of
running the machine out of memory.

Locking: every tier change runs under one re-entrant lock, with the backend called while holding
it, so loads and evictions never interleave and a request that arrives during a load simply waits.
A backend must therefore never call back into the manager. Listeners are called after the lock is
released, and ``snapshot`` reads a copy published when a move starts and when each change ends, so
a status request never waits for a load and can see which model is moving.

Identity: a model file that changed on disk is a different model (``model_id`` covers its
``file_version``: inode, size and time stamps, the change time included, which no one can put back).
Entries registered with the same ``source`` supersede each other: the older one is forgotten as
soon as no job uses it, so RAM never holds two versions of one file and new bytes never appear
under an old id.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import psutil
import torch

from ..units import size_text

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_RAM_RESERVE_BYTES = 2 << 30  # the OS, ComfyUI's own tensors, activations
DEFAULT_VRAM_RESERVE_BYTES = 1 << 30  # latents, VAE decode, attention workspace
# No budget or reserve is larger than this: beyond any machine, and it keeps every figure the
# manager publishes a small JSON number.
MAX_BUDGET_BYTES = 4096 * GiB


class Tier(str, Enum):
    """Where a model's weights live; ordered VRAM > RAM > DISK."""

    VRAM = "vram"
    RAM = "ram"
    DISK = "disk"


_RANK = {Tier.DISK: 0, Tier.RAM: 1, Tier.VRAM: 2}
# One step down or up the ladder: the backend method that performs it and the log wording.
_STEPS = {
    (Tier.DISK, Tier.RAM): ("load_from_disk", "loaded from disk into RAM"),
    (Tier.RAM, Tier.VRAM): ("to_vram", "moved to VRAM"),
    (Tier.VRAM, Tier.RAM): ("to_ram", "parked in RAM"),
    (Tier.RAM, Tier.DISK): ("drop", "dropped to disk"),
}


class TierError(RuntimeError):
    """Base of the manager's refusals; each subclass maps to one HTTP status in the REST layer."""


class UnknownModelError(TierError, LookupError):
    """No model is registered under that id (404)."""


class ModelInUseError(TierError):
    """The model is acquired by a running job, so it must not move (409)."""


class ModelPinnedError(TierError):
    """The model is pinned, so it must not be dropped to disk (409)."""


class TierCapacityError(TierError):
    """The model cannot fit: what would have to move is in use or pinned, or it is too large."""


class SourceGoneError(TierError):
    """The model's source file is gone, so it cannot be loaded from disk (REST: 404)."""


class SourceChangedError(TierError):
    """The source file changed since this id was registered, or a newer id superseded it (409).

    Loading it would put new bytes under the old identity, so it is refused and the stale
    entry is forgotten; the model's loader registers the file again under its new id.
    """


class SourceUnreadableError(TierError):
    """The source file exists but is not a model the backend can read (corrupt, wrong kind) (422)."""


def file_version(st: os.stat_result) -> tuple[int, ...]:
    """What moves on whenever a file's bytes may have changed: its device and inode (a new file
    renamed over the name), its size, its modification time, and its inode change time. The last
    is why a version cannot be faked: a write moves it on, and so does putting the modification
    time back (``touch -d``, ``cp -p``), since that changes the inode too."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def model_id(source_path: str | os.PathLike[str], version: tuple[int, ...], options: Mapping[str, Any]) -> str:
    """A short stable id for a model file loaded with given options.

    The id covers the resolved path, the file's version (``file_version``) and the load options
    (JSON with sorted keys, non-JSON values by ``str``), so a re-saved file or a different dtype is
    a different model and never reuses a stale parked copy.
    """
    identity = json.dumps(
        {"path": os.path.realpath(os.fspath(source_path)), "version": [int(v) for v in version],
         "options": dict(options)},
        sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def source_key(source_path: str | os.PathLike[str], options: Mapping[str, Any]) -> str:
    """What ``model_id`` covers except the file's version: one key for every version of a file
    loaded with the same options, so a newer version can supersede the older one."""
    identity = json.dumps(
        {"path": os.path.realpath(os.fspath(source_path)), "options": dict(options)},
        sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


class TierBackend(Protocol):
    """Moves one model's bytes; the manager decides when.

    Methods are called with the manager's lock held, one at a time, and must not call back into
    the manager. A method that raises must leave the model where it was.
    """

    def load_from_disk(self) -> None:
        """Materialize the model in RAM from its source file.

        Raises ``SourceGoneError``, ``SourceChangedError`` or ``SourceUnreadableError`` when the
        file cannot give this model, so callers can tell a bad file from a full machine.
        """

    def to_vram(self) -> None:
        """Put a device copy on the GPU; the RAM master stays."""

    def to_ram(self) -> None:
        """Drop the device copy; the RAM master stays."""

    def drop(self) -> None:
        """Release the RAM master; the next use loads from disk again."""

    def nbytes(self) -> int:
        """Size of the model in bytes, known also while it is on disk."""

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes held now, by kind of memory: "vram", "ram" and optionally "pinned"."""


@dataclass
class Policy:
    """Per-model eviction policy set from the panel."""

    pinned: bool = False  # never dropped to disk (may still be parked from VRAM to RAM)
    priority: int = 0  # higher is evicted later; ties go least recently used first


@dataclass(eq=False)
class Entry:
    """One registered model. Fields change only under the manager's lock."""

    id: str
    name: str
    kind: str
    backend: TierBackend
    policy: Policy
    tier: Tier = Tier.DISK
    total_bytes: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    last_used: float = field(default_factory=time.time)
    use_order: int = 0  # orders least-recently-used; wall-clock times can tie
    load_count: int = 0  # requests served (acquire, load, park from disk, preload)
    loads_from_disk: int = 0  # times the source file was read
    loads_from_ram: int = 0  # requests served from a parked RAM copy
    in_use: int = 0
    source: str | None = None  # entries with one source are versions of one file (source_key)
    superseded: bool = False  # a newer version is registered: forgotten when its last use ends
    moving: dict[str, str] | None = None  # the move under way: {"from", "to", "reason"}

    def ram_bytes(self) -> int:
        """Host memory the model holds now, pageable and pinned."""
        return self.bytes_by_tier.get("ram", 0) + self.bytes_by_tier.get("pinned", 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view for the REST panel."""
        return {
            "id": self.id, "name": self.name, "kind": self.kind, "tier": self.tier.value,
            "bytes": dict(self.bytes_by_tier), "total_bytes": self.total_bytes,
            "last_used": self.last_used, "load_count": self.load_count,
            "loads_from_disk": self.loads_from_disk, "loads_from_ram": self.loads_from_ram,
            "in_use": self.in_use, "moving": None if self.moving is None else dict(self.moving),
            "policy": {"pinned": self.policy.pinned, "priority": self.policy.priority},
        }


class _Unset(Enum):
    UNSET = 0


_UNSET = _Unset.UNSET


def cuda_free_bytes() -> int | None:
    """Free VRAM on the current device as torch can use it, or None (unlimited) without CUDA.

    Memory torch has cached but not allocated counts as free: parking a model returns its blocks
    to torch's cache, not to the driver.
    """
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def _check_bytes(name: str, value: object, *, allow_none: bool = False,
                 limit: int | None = None) -> None:
    """Refuse anything but a whole number of bytes in [0, limit]; messages never echo a huge value."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        what = "a whole number of bytes" + (" or null" if allow_none else "")
        raise ValueError(f"{name} must be {what}, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0")
    if limit is not None and value > limit:
        raise ValueError(f"{name} must be at most {limit} bytes ({size_text(limit)})")


def ram_total_bytes() -> int:
    """Physical RAM of this machine: no reserve can be larger."""
    return int(psutil.virtual_memory().total)


def vram_total_bytes() -> int | None:
    """Memory of the current CUDA device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _as_tier(value: Tier | str, allowed: tuple[Tier, ...]) -> Tier:
    try:
        tier = Tier(value)
    except ValueError:
        tier = None
    if tier not in allowed:
        names = ", ".join(t.value for t in allowed)
        raise ValueError(f"tier must be one of {names}, got {value!r}")
    return tier


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
        self._pending_events: list[dict[str, Any]] = []
        self._seq = 0
        self._use_seq = 0
        self._published: tuple[dict[str, Any], ...] = ()
        self._listeners: tuple[Callable[[dict[str, Any]], None], ...] = ()
        self._preloads: Counter[str] = Counter()
        self._preload_done = threading.Condition()
        self._ram_cap: int | None = None
        self._ram_reserve = DEFAULT_RAM_RESERVE_BYTES
        self._vram_reserve = DEFAULT_VRAM_RESERVE_BYTES
        self._disk_tier = True
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
        tier = _as_tier(tier, (Tier.VRAM, Tier.RAM, Tier.DISK))
        policy = Policy() if policy is None else Policy(policy.pinned, policy.priority)
        self._check_policy(policy)
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
            self._announce("register", entry, reason="register")
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
            self._listeners = ()

    # ----------------------------------------------------------------------------------------
    # Use by jobs

    def acquire(self, key: str, *, to: Tier | str = Tier.RAM) -> Entry:
        """Bring a model up to at least ``to`` and hold it there until ``release``.

        Room is made first by parking or dropping idle models. If there is no room,
        ``TierCapacityError`` is raised before any other model moves (a model just read from disk
        whose VRAM room is refused stays in RAM). A load running in another thread, a background
        preload included, finishes first, so the same model is never read from disk twice.
        """
        to = _as_tier(to, (Tier.VRAM, Tier.RAM))
        with self._locked():
            entry = self.get(key)
            self._refuse_superseded(entry, "acquire")
            self._bring_up(entry, to, "acquire")
            entry.in_use += 1
            self._announce("use", entry, reason="acquire")
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
            self._announce("use", entry, reason="release")
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
                self._announce("policy", entry, reason="pin")
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
                self._announce("policy", entry, reason="unpin")
                logger.info("unpinned '%s' (%s)", entry.name, key)
            if drop:
                self._drop_over_budget(0, None, strict=False)
            return entry

    def set_priority(self, key: str, priority: int) -> Entry:
        """Set the eviction priority: higher stays longer under pressure."""
        self._check_policy(Policy(priority=priority))
        with self._locked():
            entry = self.get(key)
            if entry.policy.priority != priority:
                entry.policy.priority = priority
                self._announce("policy", entry, reason="priority")
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
        tier = _as_tier(tier, (Tier.VRAM, Tier.RAM, Tier.DISK))
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            with self._locked():
                entry = self.get(key)
                if tier is entry.tier:
                    entry.bytes_by_tier = dict(entry.backend.bytes_by_tier())
                    return False
                old = entry.tier
                self._record(entry, tier, "observed")
                logger.info("%s '%s' (%s) observed in %s, recorded in %s", entry.kind, entry.name,
                            key, tier.value, old.value)
                return True
        finally:
            self._lock.release()

    # ----------------------------------------------------------------------------------------
    # Budgets and room

    def set_budgets(self, *, ram_budget_bytes: int | None | _Unset = _UNSET,
                    ram_reserve_bytes: int | _Unset = _UNSET,
                    vram_reserve_bytes: int | _Unset = _UNSET,
                    disk_tier: bool | _Unset = _UNSET) -> dict[str, Any]:
        """Change the memory policy; arguments left out keep their value.

        ``ram_budget_bytes`` caps RAM held by models (None: no cap, only available RAM minus the
        reserve; 0 is a cap of zero bytes, so every idle unpinned model goes to disk);
        ``disk_tier=False`` never drops a model to disk on its own. Every value is validated
        before any is applied: bytes are whole numbers up to ``MAX_BUDGET_BYTES``, a RAM reserve
        is at most the machine's RAM and a VRAM reserve at most the GPU's memory. Idle models
        over the new budget are dropped at once.
        """
        if ram_budget_bytes is not _UNSET:
            _check_bytes("ram_budget_bytes", ram_budget_bytes, allow_none=True,
                         limit=MAX_BUDGET_BYTES)
        if ram_reserve_bytes is not _UNSET:
            _check_bytes("ram_reserve_bytes", ram_reserve_bytes, limit=MAX_BUDGET_BYTES)
            if ram_reserve_bytes > ram_total_bytes():
                raise ValueError(f"ram_reserve_bytes ({size_text(ram_reserve_bytes)}) is more than this "
                                 f"machine's RAM ({size_text(ram_total_bytes())})")
        if vram_reserve_bytes is not _UNSET:
            _check_bytes("vram_reserve_bytes", vram_reserve_bytes, limit=MAX_BUDGET_BYTES)
            vram_total = vram_total_bytes()
            if vram_total is not None and vram_reserve_bytes > vram_total:
                raise ValueError(f"vram_reserve_bytes ({size_text(vram_reserve_bytes)}) is more than "
                                 f"the GPU's memory ({size_text(vram_total)})")
        if disk_tier is not _UNSET and not isinstance(disk_tier, bool):
            raise ValueError(f"disk_tier must be true or false, got {type(disk_tier).__name__}")
        with self._locked():
            before = self.budgets()
            if ram_budget_bytes is not _UNSET:
                self._ram_cap = ram_budget_bytes
            if ram_reserve_bytes is not _UNSET:
                self._ram_reserve = ram_reserve_bytes
            if vram_reserve_bytes is not _UNSET:
                self._vram_reserve = vram_reserve_bytes
            if disk_tier is not _UNSET:
                self._disk_tier = disk_tier
            budgets = self.budgets()
            if budgets != before:
                self._announce("budgets", None, reason="budgets", budgets=dict(budgets))
                logger.info("tier budgets: %s", budgets)
            self._drop_over_budget(0, None, strict=False)
            return budgets

    def budgets(self) -> dict[str, Any]:
        """The current memory policy, as ``set_budgets`` takes it."""
        return {"ram_budget_bytes": self._ram_cap, "ram_reserve_bytes": self._ram_reserve,
                "vram_reserve_bytes": self._vram_reserve, "disk_tier": self._disk_tier}

    def make_room_vram(self, nbytes: int) -> list[str]:
        """Park idle VRAM models in RAM until ``nbytes`` plus the reserve are free.

        Lowest priority goes first, then least recently used. Returns the parked ids; raises
        ``TierCapacityError`` without parking anything if even parking every idle model is not
        enough.
        """
        _check_bytes("nbytes", nbytes)
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
        tier = _as_tier(tier, (Tier.VRAM, Tier.RAM))
        keys = list(keys)
        names = {key: self.get(key).name for key in keys}
        with self._preload_done:
            self._preloads.update(keys)
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
        with self._preload_done:
            return self._preload_done.wait_for(lambda: self._preloads[key] == 0, timeout)

    def _run_preload(self, keys: list[str], names: dict[str, str], tier: Tier) -> None:
        for key in keys:
            try:
                with self._locked():
                    self._bring_up(self.get(key), tier, "preload")
            except Exception:
                logger.exception("preload of '%s' (%s) failed; it loads on first use instead",
                                 names[key], key)
            finally:
                with self._preload_done:
                    self._preloads[key] -= 1
                    if self._preloads[key] <= 0:
                        del self._preloads[key]
                    self._preload_done.notify_all()

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
            self._listeners = (*self._listeners, fn)

    def unsubscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Stop calling ``fn``; unknown listeners are ignored."""
        with self._lock:
            self._listeners = tuple(f for f in self._listeners if f != fn)

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state for the panel, without waiting for a running load."""
        models = copy.deepcopy(list(self._published))
        used = sum(m["bytes"].get("ram", 0) + m["bytes"].get("pinned", 0) for m in models)
        vm = psutil.virtual_memory()
        return {
            "models": models,
            "budgets": self.budgets(),
            "ram": {"total": vm.total, "available": vm.available,
                    "budget": self._ram_budget(used, vm.available), "used_by_models": used},
            "vram": {"free": self._vram_free_fn()},
        }

    # ----------------------------------------------------------------------------------------
    # Internals; all below run with the lock held.

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock; on leaving the outermost level publish the state and notify."""
        events: list[dict[str, Any]] = []
        try:
            with self._lock:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                    if self._depth == 0:
                        self._publish()
                        events, self._pending_events = self._pending_events, []
        finally:
            for event in events:
                for fn in self._listeners:
                    try:
                        fn(dict(event))
                    except Exception:
                        logger.exception("tier listener %r failed on event %d", fn, event["seq"])

    @staticmethod
    def _check_policy(policy: Policy) -> None:
        if not isinstance(policy.pinned, bool):
            raise ValueError(f"pinned must be true or false, got {policy.pinned!r}")
        if isinstance(policy.priority, bool) or not isinstance(policy.priority, int):
            raise ValueError(f"priority must be a whole number, got {policy.priority!r}")

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

    def _publish(self) -> None:
        self._published = tuple(e.to_dict() for e in self._entries.values())

    def _step(self, entry: Entry, to: Tier, reason: str) -> None:
        """Move one tier up or down through the backend, then record and announce it.

        While the backend works, the published snapshot shows the move (``moving``), so a
        status request answered during a long load says what is loading. A source file that
        changed since registration is forgotten: its id can never load the new bytes.
        """
        method, verb = _STEPS[(entry.tier, to)]
        entry.moving = {"from": entry.tier.value, "to": to.value, "reason": reason}
        self._publish()
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

    def _announce(self, kind: str, entry: Entry | None, *, reason: str, **fields: Any) -> None:
        """Queue an event for the listeners, delivered when the outermost lock level ends."""
        self._seq += 1
        event = {"type": kind, "seq": self._seq, "time": time.time(), "reason": reason}
        if entry is not None:
            event.update(id=entry.id, name=entry.name, kind=entry.kind)
        event.update(fields)
        self._pending_events.append(event)

    def _record(self, entry: Entry, to: Tier, reason: str) -> None:
        """Set the tier, re-read the backend's figures and queue the event for listeners."""
        old = entry.tier
        entry.tier = to
        entry.bytes_by_tier = dict(entry.backend.bytes_by_tier())
        self._announce("tier", entry, reason=reason, old=old.value, new=to.value)

    def _forget(self, entry: Entry, reason: str) -> None:
        """Release the model's memory and stop tracking it."""
        self._drop_fully(entry, reason)
        del self._entries[entry.id]
        self._announce("forget", entry, reason=reason)
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

    def _idle(self, entry: Entry, exclude: Entry | None) -> bool:
        return entry is not exclude and entry.in_use == 0

    def _ram_budget(self, used: int, available: int) -> int:
        """min(available RAM + RAM models hold - reserve, explicit cap), never negative."""
        budget = available + used - self._ram_reserve
        if self._ram_cap is not None:
            budget = min(budget, self._ram_cap)
        return max(budget, 0)

    def _drop_over_budget(self, need: int, exclude: Entry | None, *,
                          strict: bool) -> tuple[list[str], int]:
        """Drop idle unpinned models until ``need`` more bytes fit in the RAM budget.

        Victims go lowest priority first, parked before those in VRAM, then least recently used;
        a VRAM victim is parked and then dropped. With ``strict`` nothing moves unless the plan
        reaches the budget, and the shortfall raises. Returns the dropped ids and the bytes still
        over budget.
        """
        used = sum(e.ram_bytes() for e in self._entries.values())
        budget = self._ram_budget(used, psutil.virtual_memory().available)
        excess = used + need - budget
        if excess <= 0:
            return [], 0
        victims: list[Entry] = []
        freed = 0
        if self._disk_tier:  # a model holding no host memory (all on the GPU) frees none
            candidates = sorted(
                (e for e in self._entries.values()
                 if self._idle(e, exclude) and not e.policy.pinned and e.ram_bytes() > 0),
                key=lambda e: (e.policy.priority, _RANK[e.tier], e.use_order))
            for victim in candidates:
                if freed >= excess:
                    break
                victims.append(victim)
                freed += victim.ram_bytes()
        if strict and freed < excess:
            raise TierCapacityError(self._ram_refusal(exclude, need, budget, used))
        for victim in victims:
            self._drop_fully(victim, "ram_budget")
        return [v.id for v in victims], max(excess - freed, 0)

    def _ram_refusal(self, entry: Entry | None, need: int, budget: int, used: int) -> str:
        what = f"'{entry.name}' ({entry.id})" if entry is not None else "the request"
        head = (f"{what} needs {size_text(need)} of RAM; the budget is {size_text(budget)} and models "
                f"hold {size_text(used)}")
        if need > budget:
            return f"{head}: it is larger than the whole RAM budget"
        if not self._disk_tier:
            return f"{head}, and the disk tier is off, so no model is dropped to make room"
        held = [f"'{e.name}' ({'in use' if e.in_use else 'pinned'})"
                for e in self._entries.values()
                if e is not entry and e.tier is not Tier.DISK and (e.in_use or e.policy.pinned)]
        return f"{head}; what would have to go is in use or pinned: {', '.join(held)}"

    def _make_room_vram(self, need: int, exclude: Entry | None) -> list[str]:
        """Park idle VRAM models, lowest priority then least recently used, until ``need`` fits."""
        free = self._vram_free_fn()
        if free is None:
            return []
        excess = need + self._vram_reserve - free
        if excess <= 0:
            return []
        candidates = sorted(
            (e for e in self._entries.values() if self._idle(e, exclude) and e.tier is Tier.VRAM),
            key=lambda e: (e.policy.priority, e.use_order))
        victims: list[Entry] = []
        freed = 0
        for victim in candidates:
            if freed >= excess:
                break
            victims.append(victim)
            freed += victim.bytes_by_tier.get("vram", 0)
        if freed < excess:
            what = f"'{exclude.name}' ({exclude.id})" if exclude is not None else "the request"
            busy = [f"'{e.name}'" for e in self._entries.values()
                    if e is not exclude and e.tier is Tier.VRAM and e.in_use]
            raise TierCapacityError(
                f"{what} needs {size_text(need)} of VRAM plus a {size_text(self._vram_reserve)} reserve; "
                f"{size_text(free)} is free and parking idle models frees only {size_text(freed)}"
                + (f" (in use: {', '.join(busy)})" if busy else ""))
        for victim in victims:
            self._step(victim, Tier.RAM, "vram_pressure")
        return [v.id for v in victims]

