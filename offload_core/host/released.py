"""Tensor objects the engine left empty between runs, and what each really is.

A tensor whose bytes the disk tier reads in place from the model's own file needs no copy of its
own between runs: its module slot keeps the same object, which shows an empty placeholder, as a
streamed block's tensors do while a run is on (so whoever moves or sizes the module between runs
moves nothing and finds nothing to patch), and the object carries a ``Released`` note: its dtype,
shape, strides, address phase, inference-ness, and where its bytes are (``source``, the disk
tier's). A later layout of the block (an engine built anew after a settings change) reads the
tensor's metadata from the note, through a meta stand-in; whoever needs the values (a run of the
model without the engine) reads them back from the source first.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

_NOTE = "_tiered_offload_released"


@dataclass(eq=False)
class Released:
    """What an emptied tensor object is: ``source`` says where its bytes are (opaque here)."""

    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    device: torch.device
    phase: int
    inference: bool
    source: Any
    _stand_in: weakref.ref | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()

    def empty(self) -> torch.Tensor:
        """The placeholder the object shows: no bytes, the right dtype and inference-ness."""
        with torch.inference_mode(self.inference):
            return torch.empty(0, dtype=self.dtype, device=self.device)

    def stand_in(self) -> torch.Tensor:
        """A meta tensor with the object's true dtype, shape and strides: one per note while
        anything holds it (a layout finds a tensor's aliases by it). The note keeps it weakly:
        stand-in and note referring to each other would be a cycle, and a note let go of would
        keep its source (an open model file) until the garbage collector's next pass."""
        t = self._stand_in() if self._stand_in is not None else None
        if t is None:
            with torch.inference_mode(self.inference):
                t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
            t.__dict__[_NOTE] = self
            self._stand_in = weakref.ref(t)
        return t


def note(obj: torch.Tensor, released: Released) -> None:
    """Mark ``obj`` as the released tensor ``released`` describes."""
    obj.__dict__[_NOTE] = released


def note_of(obj: object) -> Released | None:
    """The note of a tensor object the engine released, if it carries one (whatever it shows now)."""
    return getattr(obj, "__dict__", {}).get(_NOTE) if isinstance(obj, torch.Tensor) else None


def released(obj: object) -> Released | None:
    """The note of ``obj`` if it shows the empty placeholder now (its bytes are elsewhere)."""
    found = note_of(obj)
    if found is None or obj.device.type == "meta" or obj.numel() or not found.nbytes:
        return None
    return found


def true_numel(t: torch.Tensor) -> int:
    """Elements ``t`` really has: those of its note's shape while it is released."""
    found = released(t)
    return torch.Size(found.shape).numel() if found is not None else t.numel()


def stand_in_note(t: torch.Tensor) -> Released | None:
    """The note a meta stand-in was made from (None for any other tensor)."""
    return note_of(t) if t.device.type == "meta" else None
