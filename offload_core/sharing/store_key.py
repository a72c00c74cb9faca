"""What names a shared host store: everything that makes its bytes, so equal names mean equal bytes.

A store's name is a digest of its key: where the bytes come from (the model file's identity, the
options it was loaded with: ``source``), how they are laid out (every block's tensors with their
offsets, dtypes, shapes and strides, and how the blocks fall into mapped chunks), what was done
to them (``transform``: the engine packs base weights only, merges run on device copies) and the
engine's store format. A file that changed on disk has another identity (``file_identity``), so
it names another store: old bytes never appear under a new file's name.

The key cannot see what a loader did to the file's bytes in a given process (another ComfyUI
version may convert them differently), nor a store's bytes changed after it was written. So a
process that joins a store compares every byte of it with the tensors it loaded itself
(``first_difference``) before it lets its own go: processes that disagree never share.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..host.packing import PackedBlock
from ..host.subclass import PLAIN_TYPES

FORMAT_VERSION = 2
TRANSFORM = "base weights; merges run on device copies"


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


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width on the CPU: compared bit for bit (a NaN
    equals itself, -0.0 differs from 0.0)."""
    if type(t) not in PLAIN_TYPES:
        t = t.as_subclass(torch.Tensor)  # a storage subclass: its raw elements, not its own ops
    t = t.detach()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t.view(_SAME_SIZE_INT[t.element_size()]).to("cpu")


def first_difference(packs: Sequence[PackedBlock], buffers: Sequence[torch.Tensor]) -> str | None:
    """The label of the first tensor whose bytes in ``buffers`` (one per pack, laid out by its
    layout) differ from the pack's original, or None when every byte agrees.

    Why every byte: a store another process wrote is trusted only where this process checked it
    against what it loaded itself; a sample would miss one changed element, or a flipped byte."""
    with torch.no_grad():
        for p, buf in zip(packs, buffers):
            for e in p.entries:
                if e.original is None:
                    raise RuntimeError(f"block {p.index}: {e.label} is packed already; its original is gone")
                if e.nbytes and not torch.equal(_as_bits(e.view_in(buf)), _as_bits(e.original)):
                    return e.label
    return None
