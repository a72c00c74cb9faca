"""Which models go down a tier when room is needed, and what a refusal says when none can.

Eviction goes down one tier at a time. VRAM pressure parks idle models in RAM (their RAM master
stays, so coming back is a host-to-device copy), lowest priority first, then least recently used.
RAM pressure drops idle, unpinned models to disk: lowest priority first, parked before those in
VRAM, then least recently used. A model in use is never chosen. These functions only choose; the
manager moves the models, and refuses before moving any when the choice does not free enough.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..units import size_text
from .tier_entries import RANK, Entry, Tier


def idle(entry: Entry, exclude: Entry | None) -> bool:
    """Not the model the room is for, and used by no job."""
    return entry is not exclude and entry.in_use == 0


def ram_victims(entries: Iterable[Entry], excess: int, exclude: Entry | None,
                disk_tier: bool) -> tuple[list[Entry], int]:
    """The models to drop to disk for ``excess`` bytes of RAM, and the bytes they free (less than
    ``excess`` when not enough can go; none with the disk tier off)."""
    victims: list[Entry] = []
    freed = 0
    if disk_tier:  # a model holding no host memory (all on the GPU) frees none
        candidates = sorted(
            (e for e in entries if idle(e, exclude) and not e.policy.pinned and e.ram_bytes() > 0),
            key=lambda e: (e.policy.priority, RANK[e.tier], e.use_order))
        for victim in candidates:
            if freed >= excess:
                break
            victims.append(victim)
            freed += victim.ram_bytes()
    return victims, freed


def ram_refusal(entries: Iterable[Entry], entry: Entry | None, need: int, budget: int, used: int,
                disk_tier: bool) -> str:
    """Why ``need`` bytes of RAM cannot be made room for."""
    what = f"'{entry.name}' ({entry.id})" if entry is not None else "the request"
    head = (f"{what} needs {size_text(need)} of RAM; the budget is {size_text(budget)} and models "
            f"hold {size_text(used)}")
    if need > budget:
        return f"{head}: it is larger than the whole RAM budget"
    if not disk_tier:
        return f"{head}, and the disk tier is off, so no model is dropped to make room"
    held = [f"'{e.name}' ({'in use' if e.in_use else 'pinned'})"
            for e in entries
            if e is not entry and e.tier is not Tier.DISK and (e.in_use or e.policy.pinned)]
    return f"{head}; what would have to go is in use or pinned: {', '.join(held)}"


def vram_victims(entries: Iterable[Entry], excess: int,
                 exclude: Entry | None) -> tuple[list[Entry], int]:
    """The models to park in RAM for ``excess`` bytes of VRAM, and the bytes they free."""
    candidates = sorted(
        (e for e in entries if idle(e, exclude) and e.tier is Tier.VRAM),
        key=lambda e: (e.policy.priority, e.use_order))
    victims: list[Entry] = []
    freed = 0
    for victim in candidates:
        if freed >= excess:
            break
        victims.append(victim)
        freed += victim.bytes_by_tier.get("vram", 0)
    return victims, freed


def vram_refusal(entries: Iterable[Entry], exclude: Entry | None, need: int, reserve: int,
                 free: int, freed: int) -> str:
    """Why ``need`` bytes of VRAM cannot be made room for."""
    what = f"'{exclude.name}' ({exclude.id})" if exclude is not None else "the request"
    busy = [f"'{e.name}'" for e in entries
            if e is not exclude and e.tier is Tier.VRAM and e.in_use]
    return (f"{what} needs {size_text(need)} of VRAM plus a {size_text(reserve)} reserve; "
            f"{size_text(free)} is free and parking idle models frees only {size_text(freed)}"
            + (f" (in use: {', '.join(busy)})" if busy else ""))
