"""Transforms (a LoRA merge, say) rewritten into a device copy of a pack, never into the pack.

The host pack always holds the untransformed values: host RAM does not grow with a transform, the
result is the same on every fresh copy, and ``PackedBlock.restore`` always puts the untransformed
weights back. A transform may change between passes (``transform_now``); the streamer's
``refresh_transform`` then copies again what was prefetched with the old one.  A transform must hand back a tensor of the stored layout; these checks refuse one
that would not fit the bytes it is written into.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .layout import BlockLayout, PackedTensor, PackedUnit, same_view
from .plain_writes import plain_writes
from .subclass import PLAIN_TYPES, Flat, flatten, held_tensors

Transform = Callable[[int, str, torch.Tensor], torch.Tensor]


def transform_now(transform: Transform) -> Transform:
    """The transform as it stands now, for a copy queued now and rewritten later (on a copy
    worker): a transform whose result may change between passes (ComfyUI's hook LoRAs: the
    weights depend on which conditioning is sampled) has a ``now()`` that freezes its state;
    any other is itself."""
    now = getattr(transform, "now", None)
    return now() if callable(now) else transform


def transform_units(layout: BlockLayout, buf: torch.Tensor, transform: Transform) -> int:
    """Run ``transform`` over every unit of ``layout`` laid over ``buf`` and write what it returns
    into ``buf``; a wrapper's new context is kept on its unit. Returns how many it rewrote."""
    count = 0
    with plain_writes():
        for u in layout.units:
            entries = [layout.entries[i] for i in u.entries]
            views = [e.view_in(buf) for e in entries]
            versions = [v._version for v in views]
            arg = views[0] if u.spec is None else u.spec.rebuild(views, inference=False)
            out = transform(u.owner[0], u.owner[1], arg)
            if any(v._version != ver for v, ver in zip(views, versions)):
                raise ValueError(f"transform modified {u.label!r} in place; it must return a new tensor")
            if u.spec is None:
                _check_transform_output(out, entries[0])
                if not same_view(out, views[0]):
                    views[0].copy_(out)
                    count += 1
                continue
            if out is arg:
                u.ctx = None
                continue
            flat = _check_wrapped_output(out, u, entries)
            for view, inner in zip(views, flat.inner):
                view.copy_(inner)
            u.ctx = flat.ctx
            count += 1
    return count


def _check_transform_output(out: object, e: PackedTensor) -> None:
    if not isinstance(out, torch.Tensor) or type(out) not in PLAIN_TYPES:
        raise TypeError(f"transform must return a plain torch.Tensor for {e.label!r}, got {type(out).__name__}")
    if out.layout != torch.strided or out.device.type == "meta":
        raise TypeError(f"transform returned a {out.layout} tensor on {out.device} for {e.label!r}")
    if out.shape != e.shape or out.dtype != e.dtype:
        raise ValueError(
            f"transform must keep shape and dtype of {e.label!r}: expected {tuple(e.shape)} {e.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )


def _check_wrapped_output(out: object, u: PackedUnit, entries: Sequence[PackedTensor]) -> Flat:
    """The inner tensors of a transform's wrapper output, checked against the stored layout."""
    spec = u.spec
    if type(out) is not spec.cls:
        raise TypeError(
            f"transform must return a {spec.cls.__name__} for {u.label!r} (like its argument), "
            f"got {type(out).__name__}"
        )
    flat = spec.matches(out)
    if flat is None:
        raise ValueError(
            f"transform must keep the shape and inner tensors of {u.label!r}: expected {tuple(spec.size)} "
            f"over {list(spec.names)}, got {tuple(out.size())} over {list(flatten(out).names)}"
        )
    for name, inner, e in zip(flat.names, flat.inner, entries):
        if type(inner) not in PLAIN_TYPES or inner.size() != e.shape or inner.dtype != e.dtype:
            raise ValueError(
                f"transform must keep shape and dtype of {u.label!r}'s inner tensor {name!r}: expected "
                f"{tuple(e.shape)} {e.dtype}, got {tuple(inner.size())} {inner.dtype}"
            )
    if any(True for _ in held_tensors(flat.ctx)):
        raise TypeError(f"transform output for {u.label!r} keeps a tensor in its flatten context")
    return flat
