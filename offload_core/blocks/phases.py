"""Split a block into its phases (self-attention, cross-attention, FFN...) in the order it runs them.

Why phases: a streamed block needs a device slot as large as the block; streamed as its phases,
the slot only needs to hold the largest phase, about a third of a DiT block, at the price of more
and smaller copies. The engine enters a phase when any module inside it is called and leaves it
when the next phase starts or the block returns, so a phase must be a set of modules that the
block's forward calls one after the other, never interleaved with another phase's modules.

Discovery starts from the block's direct children, in registration order: each child that holds
tensors is a candidate, small ones (norms) go with the next candidate, a ModuleList is split into
its items, and a block whose only content is one child is looked into. That order is the run
order for many blocks (Wan, Cosmos v1, the SD UNet's layers), not for all: Flux's double block
calls `img_attn.qkv`, then `txt_attn.qkv`, then `img_attn.proj`. Those families get a table,
keyed by the module paths a block must have (layout, not class names, as in discovery.py), that
lists each phase's modules in run order.

Tensors a block uses itself (Wan's `modulation`, LTXV's `scale_shift_table`) belong to no phase:
the engine keeps them on the device, because the block may read them before, between or after
its phases.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..host.released import true_numel
from ..host.tensor_refs import TensorRef, tensor_refs

# A candidate holding less than this share of its block's bytes joins its neighbour.
SMALL_SHARE = 1 / 8


@dataclass(frozen=True)
class Phase:
    """Modules of one phase, as paths relative to the block ("" is the block itself), in run order."""

    name: str
    paths: tuple[str, ...]
    modules: tuple[nn.Module, ...]


@dataclass(frozen=True)
class PhasePlan:
    """How one block splits: the family table used (or "generic") and its phases in run order."""

    family: str
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class Family:
    """A block layout whose run order registration order does not give.

    ``requires``: module paths that identify the layout. ``phases``: (name, paths) in run order;
    a path the block lacks (an optional module) or whose modules hold no tensors is skipped.
    """

    name: str
    requires: tuple[str, ...]
    phases: tuple[tuple[str, tuple[str, ...]], ...]


FAMILIES: tuple[Family, ...] = (
    Family("Wan / Wan VACE block", ("self_attn", "cross_attn", "ffn"), (
        ("self-attention", ("before_proj", "norm1", "self_attn")),
        ("cross-attention", ("norm3", "cross_attn")),
        ("ffn", ("norm2", "ffn", "after_proj")),
    )),
    Family("double-stream block (Flux, Flux2, Chroma, HunyuanVideo, HunyuanImage)",
           ("img_attn", "txt_attn", "img_mlp", "txt_mlp"), (
        ("attention", ("img_mod", "txt_mod", "img_norm1", "img_attn.qkv", "img_attn.norm",
                       "txt_norm1", "txt_attn.qkv", "txt_attn.norm")),
        ("image out", ("img_attn.proj", "img_norm2", "img_mlp")),
        ("text out", ("txt_attn.proj", "txt_norm2", "txt_mlp")),
    )),
    Family("single-stream block (Flux, Flux2, Chroma, HunyuanVideo, HunyuanImage)",
           ("linear1", "linear2"), (
        ("attention and mlp in", ("modulation", "pre_norm", "linear1", "norm")),
        ("out", ("mlp_act", "linear2")),
    )),
    Family("Qwen-Image block", ("img_mod", "txt_mod", "attn", "img_mlp", "txt_mlp"), (
        ("modulation", ("img_mod", "txt_mod", "img_norm1", "txt_norm1")),
        ("attention", ("attn",)),
        ("image mlp", ("img_norm2", "img_mlp")),
        ("text mlp", ("txt_norm2", "txt_mlp")),
    )),
    Family("SD3 joint block", ("context_block", "x_block"), (
        ("attention in", ("context_block.adaLN_modulation", "context_block.norm1", "context_block.attn.qkv",
                          "context_block.attn.ln_q", "context_block.attn.ln_k",
                          "x_block.adaLN_modulation", "x_block.norm1", "x_block.attn.qkv",
                          "x_block.attn.ln_q", "x_block.attn.ln_k",
                          "x_block.attn2.qkv", "x_block.attn2.ln_q", "x_block.attn2.ln_k")),
        ("context out", ("context_block.attn.proj", "context_block.norm2", "context_block.mlp")),
        ("image out", ("x_block.attn.proj", "x_block.attn2.proj", "x_block.norm2", "x_block.mlp")),
    )),
    Family("HiDream block", ("block.attn1",), (
        ("attention", ("block.adaLN_modulation", "block.norm1_i", "block.norm1_t", "block.attn1")),
        ("image ffn", ("block.norm3_i", "block.ff_i")),
        ("text ffn", ("block.norm3_t", "block.ff_t")),
    )),
    Family("Lumina2 / Z-Image block", ("attention", "feed_forward"), (
        ("attention", ("adaLN_modulation", "attention_norm1", "attention", "attention_norm2")),
        ("ffn", ("ffn_norm1", "feed_forward", "ffn_norm2")),
    )),
    Family("Cosmos Predict2 block", ("self_attn", "cross_attn", "mlp", "adaln_modulation_self_attn"), (
        ("self-attention", ("adaln_modulation_self_attn", "adaln_modulation_cross_attn",
                            "adaln_modulation_mlp", "layer_norm_self_attn", "self_attn")),
        ("cross-attention", ("layer_norm_cross_attn", "cross_attn")),
        ("mlp", ("layer_norm_mlp", "mlp")),
    )),
    Family("attention + cross-attention + FFN block (LTXV)", ("attn1", "attn2", "ff"), (
        ("self-attention", ("norm1", "attn1")),
        ("cross-attention", ("norm2", "attn2")),
        ("ffn", ("norm3", "ff")),
    )),
)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of the distinct parameters and buffers under ``module`` (a tensor the disk tier left
    empty between runs counts with what it really holds)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += true_numel(t) * t.element_size()
    return total


def _get(block: nn.Module, path: str) -> nn.Module | None:
    try:
        found = block.get_submodule(path) if path else block
    except AttributeError:
        return None
    return found if isinstance(found, nn.Module) else None


def _from_family(block: nn.Module, family: Family) -> PhasePlan:
    phases = []
    for name, paths in family.phases:
        kept = [(p, m) for p in paths if (m := _get(block, p)) is not None and tensor_bytes(m) > 0]
        if kept:
            phases.append(Phase(name, tuple(p for p, _ in kept), tuple(m for _, m in kept)))
    return PhasePlan(family.name, tuple(phases))


def _candidates(block: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Tensor-holding children in registration order; a ModuleList or ModuleDict (never called
    itself) gives its items, and a module whose only content is one child is looked into."""
    own = any(True for _ in block.parameters(recurse=False)) or any(True for _ in block.buffers(recurse=False))
    kids = [(f"{prefix}{name}", child) for name, child in block.named_children() if tensor_bytes(child) > 0]
    if not own and len(kids) == 1:
        path, child = kids[0]
        return _candidates(child, f"{path}.")
    out: list[tuple[str, nn.Module]] = []
    for path, child in kids:
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            items = child.items() if isinstance(child, nn.ModuleDict) else enumerate(child)
            out.extend((f"{path}.{key}", item) for key, item in items if tensor_bytes(item) > 0)
        else:
            out.append((path, child))
    return out


def _generic(block: nn.Module) -> PhasePlan:
    total = tensor_bytes(block)
    groups: list[tuple[str, list[tuple[str, nn.Module]]]] = []  # (main member, members)
    pending: list[tuple[str, nn.Module]] = []
    for path, module in _candidates(block):
        pending.append((path, module))
        if tensor_bytes(module) >= SMALL_SHARE * total:
            groups.append((path, pending))
            pending = []
    if pending:  # small children after the last large one run with it
        if groups:
            groups[-1][1].extend(pending)
        else:
            groups.append((pending[-1][0], pending))
    if len(groups) < 2:
        return PhasePlan("generic (one phase)", (Phase("block", ("",), (block,)),))
    phases = tuple(Phase(main, tuple(p for p, _ in members), tuple(m for _, m in members))
                   for main, members in groups)
    return PhasePlan("generic (direct children)", phases)


def find_phases(block: nn.Module) -> PhasePlan:
    """The block's phases in run order: its family's table, or discovery from its children."""
    for family in FAMILIES:
        if all(_get(block, path) is not None for path in family.requires):
            plan = _from_family(block, family)
            if plan.phases:
                return plan
    return _generic(block)


GRANULARITIES = ("block", "phase")


@dataclass(frozen=True)
class Unit:
    """What the engine streams as one piece: a whole block, or one phase of it."""

    block: int
    name: str
    roots: tuple[tuple[str, nn.Module], ...]  # (path in the block, module); "" is the block itself


def stream_units(blocks: list[nn.Module], granularity: str) -> list[Unit]:
    """The blocks as stream units, in run order: one per block, or one per phase of each block."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if granularity == "block":
        return [Unit(i, "block", (("", b),)) for i, b in enumerate(blocks)]
    units = []
    for i, b in enumerate(blocks):
        for phase in find_phases(b).phases:
            units.append(Unit(i, phase.name, tuple(zip(phase.paths, phase.modules))))
    return units


def unit_refs(unit: Unit) -> list[tuple[TensorRef, torch.Tensor]]:
    """Every tensor slot under the unit's roots, named by its path inside the block."""
    out: list[tuple[TensorRef, torch.Tensor]] = []
    seen: set[tuple[int, str, str]] = set()
    for root_path, root in unit.roots:
        for ref, t in tensor_refs(root, unit.block):
            slot = (id(ref.module), ref.kind, ref.attr)
            if slot in seen:
                continue
            seen.add(slot)
            if root_path:
                ref = replace(ref, path=f"{root_path}.{ref.path}")
            out.append((ref, t))
    return out


def own_refs(block: nn.Module, index: int, units: list[Unit]) -> list[tuple[TensorRef, torch.Tensor]]:
    """The block's tensor slots that none of its units covers: tensors the block uses itself."""
    covered = {(id(r.module), r.kind, r.attr) for u in units for r, _ in unit_refs(u)}
    return [(r, t) for r, t in tensor_refs(block, index) if (id(r.module), r.kind, r.attr) not in covered]


def hooked_modules(unit: Unit) -> list[nn.Module]:
    """Modules whose call enters the unit: every module under its roots, or the block itself for
    a whole-block root (a block is entered by calling it)."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    for path, root in unit.roots:
        for m in ([root] if not path else root.modules()):
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out
