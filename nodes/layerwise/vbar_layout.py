"""Core's Dynamic VRAM layout of one model: where each weight sits in the model's VBAR, whether
an order is in force, which blocks core holds resident, and how to hand the layout back so that
core's next load lays it out afresh.

What core does (ComfyUI 0.15 and later, read in 0.33's `ModelPatcherDynamic.load`,
`comfy/ops.py`, `comfy/model_prefetch.py` and comfy-aimdo's `model_vbar.py`): each model has one
VBAR per device (`model.dynamic_vbars[device]`), a reserved range of virtual VRAM addresses.
A weight gets a slice of it (`module._v = (vbar, address, size)`) only at a load where it has
none, handed out by a bump allocator that never reuses an address. Under pressure comfy-aimdo
keeps the lowest addresses mapped and gives up the highest first, so the order of the slices is
the order of residency, and it is fixed at the model's first dynamic load.

Core's own way to take a slice back is `vbar_unpin(module._v)` and deleting `_v` (its load does
that to a weight it decides to load outright). Doing that to every weight and dropping the VBAR
itself (its last reference; comfy-aimdo then unmaps its pages and frees the range) returns the
model to the state of one never loaded: core's next load makes a fresh VBAR of the usual size and
gives every weight a slice in the order it is asked for. The address space stays bounded: one
VBAR, never a second range stacked on the first. With every slice goes what core hangs on a
module for it (`SLICE_ATTRS`): a residency signature or a view of the old VRAM left behind could
be taken for valid against the new VBAR.

All of it is private to core and comfy-aimdo, so everything here is feature-detected and refuses
(with the reason) rather than guesses: a layout it cannot read is reported as unknown, and a reset
it cannot do safely is not done.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

# What core's dynamic load and cast path attach to a module for its VBAR slice: the slice, its
# residency signature, views of its VRAM copy, and a unit's span over its modules' slices.
SLICE_ATTRS = ("_v", "_v_signature", "_v_weight", "_v_bias", "_v_block")
# Present only while core is using the slices (a prefetch in flight, a captured CUDA graph; core
# clears both after every node). A reset then would pull VRAM from under them.
BUSY_ATTRS = ("_prefetch", "_v_block_faulted", "_comfy_graph")
# comfy-aimdo's VBAR page (its `fault()` sizes residency signatures by it).
PAGE_BYTES = 32 << 20


def _vbar_module():
    try:
        return importlib.import_module("comfy_aimdo.model_vbar")
    except ImportError:
        return None


def model_vbar(model: torch.nn.Module, device: torch.device) -> Any | None:
    """The model's VBAR on `device`, if core made one."""
    vbars = getattr(model, "dynamic_vbars", None)
    return vbars.get(device) if isinstance(vbars, dict) else None


def _slice_of(module: torch.nn.Module, vbar: Any) -> tuple[int, int] | None:
    """(start, end) of the module's slice, relative to the VBAR's base; None if it has none there."""
    v = module.__dict__.get("_v")
    if not (isinstance(v, tuple) and len(v) == 3 and v[0] is vbar):
        return None
    start = int(v[1]) - int(getattr(vbar, "base_addr", 0))
    return start, start + int(v[2])


@dataclass(frozen=True)
class Layout:
    """Where core put one model's weights in its VBAR, by group: blocks and the rest."""

    blocks: tuple[tuple[tuple[int, int], ...], ...]  # per block: its modules' slices
    rest: tuple[tuple[int, int], ...]  # slices of the modules outside every block

    def empty(self) -> bool:
        return not self.rest and not any(self.blocks)

    def block_spans(self) -> list[list[int] | None]:
        return [[min(s for s, _ in b), max(e for _, e in b)] if b else None for b in self.blocks]

    def rest_span(self) -> list[int] | None:
        return [min(s for s, _ in self.rest), max(e for _, e in self.rest)] if self.rest else None

    def in_order(self, first: Sequence[int], last: Sequence[int]) -> bool:
        """Whether the blocks of `first` own the lowest addresses (in that order), then the rest,
        then the blocks of `last` (in that order): the order core lays out for units
        `(first, last)`. Slices core placed later (a weight that had none) count where they are."""
        rank = {i: (0, k) for k, i in enumerate(first)}
        rank.update({i: (2, k) for k, i in enumerate(last)})
        entries = [(start, rank.get(i, (1, 0))) for i, block in enumerate(self.blocks)
                   for start, _ in block]
        entries += [(start, (1, 0)) for start, _ in self.rest]
        entries.sort()
        return all(a[1] <= b[1] for a, b in zip(entries, entries[1:]))


def read(model: torch.nn.Module, device: torch.device,
         blocks: Sequence[torch.nn.Module]) -> Layout | None:
    """The layout core holds for `model` on `device`; None if it has no VBAR there."""
    vbar = model_vbar(model, device)
    if vbar is None:
        return None
    owner = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    per_block: list[list[tuple[int, int]]] = [[] for _ in blocks]
    rest: list[tuple[int, int]] = []
    for module in model.modules():
        span = _slice_of(module, vbar)
        if span is None:
            continue
        i = owner.get(id(module))
        (rest if i is None else per_block[i]).append(span)
    return Layout(tuple(tuple(sorted(b)) for b in per_block), tuple(sorted(rest)))


def residency(model: torch.nn.Module, device: torch.device, layout: Layout) -> list[str] | None:
    """Per block, what comfy-aimdo holds of it now: "resident" (every page mapped), "partial",
    or "streamed" (none: copied in when it runs); None where the VBAR cannot say
    (`get_residency` is comfy-aimdo 0.4 and later)."""
    vbar = model_vbar(model, device)
    probe = getattr(vbar, "get_residency", None)
    if not callable(probe):
        return None
    try:
        pages = probe()
    except Exception:  # a report must never fail a run
        log.debug("[tiered offload] Apply Layerwise Offload: no VBAR residency", exc_info=True)
        return None
    states = []
    for span in layout.block_spans():
        if span is None:
            states.append("resident")  # nothing of it is streamed: core loaded it outright
            continue
        flags = [pages[p] & 1 if p < len(pages) else 0
                 for p in range(span[0] // PAGE_BYTES, (span[1] - 1) // PAGE_BYTES + 1)]
        states.append("resident" if all(flags) else "partial" if any(flags) else "streamed")
    return states


def reset(model: torch.nn.Module, device: torch.device) -> str | None:
    """Take back every VBAR slice of `model` on `device` and drop the VBAR, so that core's next
    load lays the model out afresh in the order it is then given. Returns None when done, else
    why it was not done (nothing is changed then, unless comfy-aimdo failed part-way: below).

    Call it only between runs, before core's load. The checks come first; the change itself is
    what core's own load does to a weight it loads outright, once per weight, then the VBAR goes.
    If a step fails part-way, the weights done so far simply have no slice, which core's next
    load gives them (at the end of the old VBAR, which is then kept): a state core makes itself.
    comfy-aimdo 0.6 says when it could not hand a slice back (its `unpin` raises; 0.4 returns
    nothing either way): the reset stops there, in that state, and says so.
    """
    vbars = getattr(model, "dynamic_vbars", None)
    vbar = vbars.get(device) if isinstance(vbars, dict) else None
    if vbar is None:
        return "core has not laid the model out on this device"
    aimdo = _vbar_module()
    unpin = getattr(aimdo, "vbar_unpin", None)
    if not callable(unpin):
        return "this ComfyUI's comfy-aimdo has no vbar_unpin"
    modules = list(model.modules())
    for module in modules:
        if any(attr in module.__dict__ for attr in BUSY_ATTRS):
            return "core is using the model's VRAM slices (a prefetch or a CUDA graph is live)"
        v = module.__dict__.get("_v")
        if v is not None and _slice_of(module, vbar) is None:
            return "a weight of the model holds a slice of another VBAR"
        unknown = [a for a in module.__dict__ if a.startswith("_v_") and a not in SLICE_ATTRS
                   and a not in BUSY_ATTRS]
        if unknown:  # a newer core's state of a slice, which a reset would leave stale
            return f"core keeps VBAR state this node does not know ({unknown[0]})"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    handed_back = 0
    for module in modules:
        v = module.__dict__.get("_v")
        if v is not None:
            try:
                unpin(v)
            except RuntimeError as e:
                return (f"comfy-aimdo could not hand a weight's VRAM slice back ({e}); the model "
                        f"keeps its VBAR, and the {handed_back} slices handed back before it are "
                        "given anew at core's next load")
            handed_back += 1
        for attr in SLICE_ATTRS:
            module.__dict__.pop(attr, None)
    del vbars[device]
    return None
