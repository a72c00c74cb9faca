"""Find the repeated block lists of a diffusion model, in the order its forward runs them.

Discovery goes by attribute layout, not by class name, so the engine stays free of ComfyUI
imports and picks up renamed or new model classes that keep a known layout. Run order matters:
prefetching block i+1 while block i computes is only right if i+1 really runs next.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class BlockList:
    """An ordered list of blocks and the dotted path of each, relative to the searched module."""

    layout: str
    paths: tuple[str, ...]
    blocks: tuple[nn.Module, ...]


class UnsupportedModelError(ValueError):
    """The model has no block list the engine knows how to stream."""


# (layout name, attribute names in run order). The first layout whose attributes all exist wins.
LAYOUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("double_blocks+single_blocks (Flux, Flux2, Chroma, HunyuanVideo, HunyuanImage)",
     ("double_blocks", "single_blocks")),
    ("double_stream_blocks+single_stream_blocks (HiDream)",
     ("double_stream_blocks", "single_stream_blocks")),
    ("joint_blocks (SD3 / MMDiT)", ("joint_blocks",)),
    ("blocks+vace_blocks (Wan VACE)", ("blocks", "vace_blocks")),
    ("blocks (Wan 2.1/2.2, Cosmos)", ("blocks",)),
    ("transformer_blocks (LTXV, Qwen-Image)", ("transformer_blocks",)),
    ("layers (Lumina2, Z-Image)", ("layers",)),
    ("input_blocks+middle_block+output_blocks (SD1/SDXL UNet)",
     ("input_blocks", "middle_block", "output_blocks")),
)

# Layout attributes that may be None: UNetModel sets middle_block = None for checkpoints without one.
OPTIONAL_ATTRS = frozenset({"middle_block"})

SUPPORTED_DESCRIPTION = "; ".join(name for name, _ in LAYOUTS) + \
    "; or any model whose largest child is an in-order ModuleList of like blocks"


def uncompiled(module: nn.Module) -> nn.Module:
    """The module torch.compile's wrapper (an OptimizedModule) compiles, or ``module`` itself.

    Per-block compile nodes put such wrappers into a model's block list; the engine hooks and
    packs the block inside, which the wrapper calls, and a weight's path stays the block's own."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def _children_of(attr: str, value: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(value, nn.ModuleList):
        return [(f"{attr}.{i}", uncompiled(m)) for i, m in enumerate(value)]
    if isinstance(value, nn.ModuleDict):  # Cosmos v1 keeps blocks in insertion order by name
        return [(f"{attr}.{k}", uncompiled(m)) for k, m in value.items()]
    return [(attr, uncompiled(value))]


def _vace_order(model: nn.Module, main: list[tuple[str, nn.Module]],
                vace: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Wan VACE runs vace block j right after main block i for each (i, j) in its mapping."""
    mapping = getattr(model, "vace_layers_mapping", None)
    if not isinstance(mapping, dict):
        return main + vace
    order: list[tuple[str, nn.Module]] = []
    for i, item in enumerate(main):
        order.append(item)
        j = mapping.get(i)
        if j is not None and j < len(vace):
            order.append(vace[j])
    used = {mapping[i] for i in mapping if i < len(main)}
    order.extend(v for j, v in enumerate(vace) if j not in used)
    return order


def _unet_layers(items: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The UNet's streamable units are the layers inside each TimestepEmbedSequential.

    UNetModel runs a block through `forward_timestep_embed`, which loops over the block's layers
    and calls each one, never the block itself: hooks on the block would never fire. The layers
    are called, in order, so they are what the engine hooks and streams.
    """
    out: list[tuple[str, nn.Module]] = []
    for path, m in items:
        if isinstance(m, nn.Sequential):
            out.extend((f"{path}.{name}", layer) for name, layer in m.named_children())
        else:
            out.append((path, m))
    return out


def _param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _generic(model: nn.Module) -> BlockList | None:
    """Fallback: the ModuleList holding most parameters, if its items share one class."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList) and len(child) >= 2:
            if len({type(uncompiled(m)) for m in child}) != 1:
                continue
            n = _param_count(child)
            if best is None or n > best[0]:
                best = (n, name, child)
    if best is None:
        return None
    total = _param_count(model)
    if total == 0 or best[0] * 2 < total:
        return None
    items = _children_of(best[1], best[2])
    return BlockList(f"generic ModuleList '{best[1]}'",
                     tuple(p for p, _ in items), tuple(m for _, m in items))


def find_blocks(model: nn.Module) -> BlockList:
    """Return the model's blocks in run order, or raise UnsupportedModelError naming the class."""
    model = uncompiled(model)
    for layout, attrs in LAYOUTS:
        present = [(a, getattr(model, a, None)) for a in attrs]
        if any(not isinstance(v, nn.Module)
               and not (a in OPTIONAL_ATTRS and v is None and hasattr(model, a)) for a, v in present):
            continue
        groups = [_children_of(a, v) for a, v in present if v is not None]
        if layout.startswith("blocks+vace"):
            items = _vace_order(model, groups[0], groups[1])
        elif layout.startswith("input_blocks"):
            items = _unet_layers([item for g in groups for item in g])
        else:
            items = [item for g in groups for item in g]
        if len(items) == 0:
            continue
        return BlockList(layout, tuple(p for p, _ in items), tuple(m for _, m in items))
    generic = _generic(model)
    if generic is not None:
        return generic
    raise UnsupportedModelError(
        f"{type(model).__name__} has no block list that layerwise offload can stream. "
        f"Supported layouts: {SUPPORTED_DESCRIPTION}.")
