"""What names a shared host store: everything that makes its bytes, so equal names mean equal bytes.

A store's name is a digest of its key: where the bytes come from (the model file's identity, the
options it was loaded with: ``source``), how they are laid out (every block's tensors with their
offsets, dtypes, shapes and strides, and how the blocks fall into mapped chunks), what was done
to them (``transform``: the engine packs base weights only, merges run on device copies) and the
engine's store format. A file that changed on disk has another identity (``file_identity``), so
it names another store: old bytes never appear under a new file's name.

The key cannot see what a loader did to the file's bytes in a given process (another ComfyUI
version may convert them differently). So the process that writes a store also writes a sample
of its values (``content_sample``), and every process that joins compares it with the same sample
of its own tensors first: processes that disagree never share.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .packing import PackedBlock
from .subclass import PLAIN_TYPES

FORMAT_VERSION = 1
TRANSFORM = "base weights; merges run on device copies"
_WINDOW = 64  # elements per sampled window
_WINDOWS = 4  # windows per tensor: start, a third, two thirds, end


def layout_signature(packs: Sequence[PackedBlock], chunk_spans: Sequence[int]) -> list[Any]:
    """Where every byte of the packs sits: each pack's size, each of its tensors (label, offset,
    bytes, dtype, shape, strides), its tensors as modules see them, and the chunk spans."""
    return [
        [[p.nbytes, p.layout.keep_address_phase,
          [[e.label, e.offset, e.nbytes, str(e.dtype), list(e.shape), list(e.stride)] for e in p.entries],
          [[u.label, list(u.entries), None if u.spec is None else u.spec.cls.__qualname__]
           for u in p.layout.units]]
         for p in packs],
        list(chunk_spans),
    ]


@dataclass(frozen=True)
class StoreKey:
    """A store's key: ``source`` (what the bytes are read from), ``layout`` (``layout_signature``)."""

    source: Mapping[str, Any]
    layout: list[Any]
    transform: str = TRANSFORM

    @property
    def text(self) -> str:
        """The key as canonical JSON (sorted keys; a value JSON cannot hold by its ``str``)."""
        return json.dumps({"format": FORMAT_VERSION, "source": dict(self.source), "layout": self.layout,
                           "transform": self.transform}, sort_keys=True, default=str)

    @property
    def full_digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def digest(self) -> str:
        """The store's file name: 32 hex digits of ``full_digest`` (which its header keeps whole)."""
        return self.full_digest[:32]


def _windows(t: torch.Tensor) -> torch.Tensor:
    """The sampled elements of ``t`` in logical order, as bytes on the CPU."""
    if type(t) not in PLAIN_TYPES:
        t = t.as_subclass(torch.Tensor)  # a storage subclass: its raw elements, not its own ops
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= _WINDOW * _WINDOWS:
        picked = flat
    else:
        starts = sorted({0, n // 3, 2 * n // 3, n - _WINDOW})
        picked = torch.cat([flat[s:s + _WINDOW] for s in starts])
    return picked.to("cpu").contiguous().view(torch.uint8)


def content_sample(tensors: Iterable[torch.Tensor]) -> str:
    """A digest of a few windows of every tensor's values (in the packs' entry order).

    Cheap (a few hundred bytes per tensor), and loaders that convert a file differently change
    nearly every value, so two processes whose tensors differ disagree here."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in tensors:
            h.update(repr((str(t.dtype), tuple(t.size()))).encode())
            if t.numel():
                h.update(_windows(t).numpy().tobytes())
    return h.hexdigest()


def originals(packs: Sequence[PackedBlock]) -> list[torch.Tensor]:
    """The tensors the packs were laid out from, one per entry (before they are packed)."""
    out = []
    for p in packs:
        for e in p.entries:
            if e.original is None:
                raise RuntimeError(f"block {p.index}: {e.label} is packed already; its original is gone")
            out.append(e.original)
    return out


def packed(packs: Sequence[PackedBlock], buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The packs' tensors over their buffers, one per entry: what ``originals`` gives, once written."""
    return [e.view_in(buf) for p, buf in zip(packs, buffers) for e in p.entries]
