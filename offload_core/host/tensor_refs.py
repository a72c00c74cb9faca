"""The places a module keeps its tensors: one ``_parameters`` or ``_buffers`` slot each.

A pack binds slots, not names: the same tensor object may sit in several slots (tied weights), and
the same module under several paths; each slot is named once, by the first path that reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class TensorRef:
    """One place that holds a tensor: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module: nn.Module
    kind: str  # "param" or "buffer"
    attr: str
    block: int  # block the path is relative to; -1 when there is none
    path: str  # dotted name inside that block

    @property
    def table(self) -> dict:
        return self.module._parameters if self.kind == "param" else self.module._buffers

    @property
    def label(self) -> str:
        return f"block {self.block}: {self.path}" if self.block >= 0 else self.path


def tensor_refs(module: nn.Module, block: int = -1) -> list[tuple[TensorRef, torch.Tensor]]:
    """Every parameter and buffer slot under ``module``, each slot once."""
    out: list[tuple[TensorRef, torch.Tensor]] = []
    seen: set[tuple[int, str, str]] = set()
    for mpath, m in module.named_modules(remove_duplicate=False):
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for attr, t in table.items():
                if t is None or (id(m), kind, attr) in seen:
                    continue
                seen.add((id(m), kind, attr))
                path = f"{mpath}.{attr}" if mpath else attr
                out.append((TensorRef(m, kind, attr, block, path), t))
    return out


def tables_under(module: nn.Module) -> frozenset[int]:
    """The ids of the tables (``_parameters``, ``_buffers``) of ``module`` and every module under
    it: what ``module.to()`` moves. ``PackedBlock.reclaim`` takes back only the slots in them."""
    return frozenset(id(table) for m in module.modules() for table in (m._parameters, m._buffers))
