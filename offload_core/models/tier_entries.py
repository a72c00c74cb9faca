"""What the tier manager keeps per model: where it lives (``Tier``), its policy, its figures and
counters (``Entry``), and the backend that moves its bytes (``TierBackend``).

The manager does not know what a model is: each model comes with a backend, so it works the same
for ComfyUI models and for test modules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol


class Tier(str, Enum):
    """Where a model's weights live; ordered VRAM > RAM > DISK."""

    VRAM = "vram"
    RAM = "ram"
    DISK = "disk"


RANK = {Tier.DISK: 0, Tier.RAM: 1, Tier.VRAM: 2}


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
            # the rest of the requests found it loaded already: the three parts make the count
            "loads_already_loaded": max(0, self.load_count - self.loads_from_disk - self.loads_from_ram),
            "in_use": self.in_use, "moving": None if self.moving is None else dict(self.moving),
            "policy": {"keep_in_ram": self.policy.pinned, "priority": self.policy.priority},
        }


def as_tier(value: Tier | str, allowed: tuple[Tier, ...]) -> Tier:
    """``value`` as one of the ``allowed`` tiers, or a ValueError naming them."""
    try:
        tier = Tier(value)
    except ValueError:
        tier = None
    if tier not in allowed:
        names = ", ".join(t.value for t in allowed)
        raise ValueError(f"tier must be one of {names}, got {value!r}")
    return tier


def check_policy(policy: Policy) -> None:
    """Refuse a policy that is not a bool and a whole number."""
    if not isinstance(policy.pinned, bool):
        raise ValueError(f"pinned must be true or false, got {policy.pinned!r}")
    if isinstance(policy.priority, bool) or not isinstance(policy.priority, int):
        raise ValueError(f"priority must be a whole number, got {policy.priority!r}")
