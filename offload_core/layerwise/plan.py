"""The streamer's plan: what runs where, decided from tensor metadata alone (no byte moves).

Blocks are cut into units (whole blocks, or each block's phases), and each unit gets the packed
layout of its tensors. Tensors that several units share, or that a block uses itself while its
phases stream, stay resident in a pack of their own: streaming them with one unit would pull them
out from under another, and copying them with every unit would re-send the same bytes. Then
residency: which units stay on the device, which stream through how many slots of what size, and
the device memory that costs. Indices of packs, residency and slots are unit indices; with block
granularity a unit is a block.

The layout holds while the blocks' tensor objects stay the ones it was made from
(``is_current``); residency may be chosen again at any time the streamer is detached, since the
packs do not depend on it, and at a pass boundary while attached (``apply``: the planner's
setting, with the device schedule made again around it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from ..blocks.phases import Unit, own_refs, unit_refs
from ..device.residency import bound_bytes, plan_residency, slot_count
from ..host.layout import alias_key, check_packable
from ..host.packing import PackedBlock
from ..host.tensor_refs import tensor_refs

log = logging.getLogger(__name__)


def check_blocks(blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The blocks as a list, or a ValueError: empty, not modules, repeated or nested."""
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty: there is nothing to stream")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise ValueError(f"blocks[{i}] is a {type(b).__name__}, not an nn.Module")
    index = {id(b): i for i, b in enumerate(blocks)}
    if len(index) != len(blocks):
        raise ValueError("the same module appears more than once in blocks")
    for i, b in enumerate(blocks):
        for sub in b.modules():
            if sub is not b and id(sub) in index:
                raise ValueError(f"blocks[{index[id(sub)]}] is nested inside blocks[{i}]")
    return blocks


@dataclass(frozen=True)
class Rules:
    """What chooses a plan's residency, typed once: the user's rules (a resident count, or a VRAM
    budget the most resident units fit in), or the tuner's choice, which stands for both; the
    units copied ahead; and the units the disk cache reads ahead."""

    resident: int | None = None  # resident blocks (None: as many as ``vram_budget_bytes`` holds)
    vram_budget_bytes: int | None = None
    prefetch: int = 1
    resident_units: tuple[int, ...] | None = None  # the tuner's choice of resident units
    read_ahead: int | None = None  # None: as many units as the cache has readers


class StreamPlan:
    """The units of ``blocks``, their packs (``packs``, one per unit, and ``shared``), and which
    units are resident (``resident_indices``) or streamed (``streamed_indices``, in run order,
    through ``nslots`` device slots of ``slot_bytes``)."""

    def __init__(self, blocks: list[nn.Module], units: list[Unit], granularity: str, *,
                 resident: int | None, vram_budget_bytes: int | None, prefetch: int) -> None:
        self.blocks = blocks
        self.units = units
        self.granularity = granularity
        self.rules = Rules(resident, vram_budget_bytes, prefetch)
        self.lay_out()

    # ------------------------------------------------------------------ layout
    def lay_out(self) -> None:
        """Layout of every unit from live metadata (no data moves), then residency."""
        refs = [unit_refs(u) for u in self.units]
        owners: dict[tuple, set[int]] = {}
        for i, items in enumerate(refs):
            for ref, t in items:
                check_packable(t, ref.label)
                owners.setdefault(alias_key(t), set()).add(i)
        own: list[tuple] = []
        if self.granularity != "block":  # tensors a block uses itself stay on the device
            for b, block in enumerate(self.blocks):
                own += own_refs(block, b, [u for u in self.units if u.block == b])
            for ref, t in own:
                check_packable(t, ref.label)
        shared = {k for k, s in owners.items() if len(s) > 1} | {alias_key(t) for _, t in own}
        self.packs = [
            PackedBlock([(r, t) for r, t in items if alias_key(t) not in shared], index=i)
            for i, items in enumerate(refs)
        ]
        self.shared = PackedBlock(
            [(r, t) for items in [*refs, own] for r, t in items if alias_key(t) in shared], index=-1)
        self.place()
        self._signature = self._current_signature()
        if shared:
            log.info("[tiered offload] %d tensors are shared between units or used by their blocks "
                     "themselves; they stay resident", len(self.shared.entries))

    def all_packs(self) -> list[PackedBlock]:
        """Every unit's pack, then the shared one (the order of the host storage's items)."""
        return self.packs + [self.shared]

    def _current_signature(self) -> list[list[tuple[int, str, str, int]]]:
        """Which tensor objects sit in which slots of each block: detects added or replaced tensors."""
        return [
            [(id(ref.module), ref.kind, ref.attr, id(t)) for ref, t in tensor_refs(b, i)]
            for i, b in enumerate(self.blocks)
        ]

    def is_current(self) -> bool:
        """Whether the blocks still hold the tensor objects (and views) this layout was made from."""
        return self._current_signature() == self._signature and all(p.is_current() for p in self.all_packs())

    @property
    def packed_bytes(self) -> int:
        """Bytes of the host master (all blocks plus shared tensors)."""
        return sum(p.nbytes for p in self.packs) + self.shared.nbytes

    # --------------------------------------------------------------- residency
    def place(self) -> None:
        """Resident and streamed units, and the slots streaming needs, from the rules."""
        sizes = [p.nbytes for p in self.packs]
        r = self.rules
        rules = {"resident": r.resident, "vram_budget_bytes": r.vram_budget_bytes, "prefetch": r.prefetch}
        if r.resident_units is not None:
            chosen = sorted(set(r.resident_units))
            if any(not 0 <= u < len(self.units) for u in chosen):
                raise ValueError(f"resident units {chosen} are not units of this plan ({len(self.units)})")
            self.resident_indices = chosen
        elif self.granularity != "block" and r.resident is not None:
            # A resident count is in blocks: every phase of the picked blocks stays.
            block_sizes = [sum(sizes[u] for u, unit in enumerate(self.units) if unit.block == b)
                           for b in range(len(self.blocks))]
            blocks = set(plan_residency(block_sizes, self.shared.nbytes, **rules))
            self.resident_indices = [u for u, unit in enumerate(self.units) if unit.block in blocks]
        else:
            self.resident_indices = plan_residency(sizes, self.shared.nbytes, **rules)
        res = set(self.resident_indices)
        self.streamed_indices: list[int] = [i for i in range(len(self.units)) if i not in res]
        self.pos = {b: j for j, b in enumerate(self.streamed_indices)}
        self.slot_bytes = max((sizes[i] for i in self.streamed_indices), default=0)
        self.nslots = slot_count(r.prefetch, len(self.streamed_indices))

    def replan(self, *, resident: int | None, vram_budget_bytes: int | None) -> None:
        """Choose the resident units again; the old choice stands if the new rules are refused."""
        self.restore(replace(self.rules, resident=resident, vram_budget_bytes=vram_budget_bytes,
                             resident_units=None))

    def apply(self, resident_units: Sequence[int], prefetch: int, read_ahead: int | None) -> None:
        """The planner's setting: these units resident, ``prefetch`` units copied ahead, ``read_ahead``
        read ahead from disk; the old rules stand if these are refused."""
        self.restore(replace(self.rules, resident_units=tuple(resident_units), prefetch=prefetch,
                             read_ahead=read_ahead))

    def restore(self, rules: Rules) -> None:
        """Residency from ``rules`` (ones saved from ``rules`` earlier, or new ones); the old rules
        stand if these are refused."""
        old = self.rules
        self.rules = rules
        try:
            self.place()
        except BaseException:
            self.rules = old
            self.place()
            raise

    def resident_packs(self) -> list[PackedBlock]:
        """The packs that stay on the device while attached: resident units and the shared one."""
        return [self.packs[i] for i in self.resident_indices] + [self.shared]

    def bound_range(self) -> tuple[int, int]:
        """The bound with every block streamed (the least device memory streaming can work in)
        and with every block resident (the most the engine can use)."""
        sizes = [p.nbytes for p in self.packs]
        prefetch = self.rules.prefetch
        return (bound_bytes(sizes, [], self.shared.nbytes, prefetch),
                bound_bytes(sizes, range(len(sizes)), self.shared.nbytes, prefetch))

    def bound_bytes(self) -> int:
        """Most weight bytes the settings ever place on the compute device: resident + slots."""
        sizes = [p.nbytes for p in self.packs]
        return bound_bytes(sizes, self.resident_indices, self.shared.nbytes, self.rules.prefetch)
