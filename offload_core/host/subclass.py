"""Tensor subclasses in a pack: which ones round-trip through raw bytes, and how a wrapper is rebuilt.

Three kinds of tensor reach the packer:

- **plain** (``torch.Tensor``, ``nn.Parameter``): its bytes are its values.
- **storage subclasses**: a subclass that does not intercept dispatch (ComfyUI-GGUF's
  ``GGMLTensor``).  Its own storage holds its values (raw quantized bytes for GGUF) and its extra
  state lives in Python attributes on the object (``tensor_type``, ``tensor_shape``, ``patches``).
  The packer keeps the object and re-points only its ``.data``, like a plain tensor, so the class
  and every attribute survive.  One that keeps a tensor as a direct attribute is refused: that
  tensor would not travel with the data.
- **wrapper subclasses** (``__tensor_flatten__`` / ``__tensor_unflatten__``: ComfyUI's
  ``QuantizedTensor`` in 0.3.75 and comfy_kitchen's in 0.33) have no storage of their own: their
  values are their inner tensors (quantized data, scales).  Each inner tensor is packed as its own
  entry, so a quantized weight packs at its quantized size.  The wrapper is rebuilt over views of
  a buffer with ``__tensor_unflatten__`` and bound with ``torch.utils.swap_tensors``, which is what
  ``Module._apply`` does for them (``.data =`` would leave the inner tensors where they are); the
  module keeps its original object.  A wrapper that holds a tensor its flatten does not name, or
  whose flatten context holds one, is refused, because that tensor would not be packed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PLAIN_TYPES = (torch.Tensor, nn.Parameter)
_WALK_DEPTH = 4


def class_name(t: object) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__}"


def is_wrapper(t: torch.Tensor) -> bool:
    """A subclass that keeps its values in inner tensors named by ``__tensor_flatten__``."""
    cls = type(t)
    return cls not in PLAIN_TYPES and hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")


def is_storage_subclass(t: torch.Tensor) -> bool:
    """A subclass whose own storage holds its values: it leaves dispatch to torch."""
    cls = type(t)
    return (
        cls not in PLAIN_TYPES
        and not is_wrapper(t)
        and getattr(cls, "__torch_dispatch__", None) is getattr(torch.Tensor, "__torch_dispatch__", None)
        and not isinstance(t, nn.parameter.UninitializedTensorMixin)
    )


def held_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through dicts, sequences and dataclass fields."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth >= _WALK_DEPTH:
        return
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        values = list(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return
    for value in values:
        yield from held_tensors(value, depth + 1)


def check_storage_subclass(t: torch.Tensor, label: str) -> None:
    for attr, value in vars(t).items():
        if isinstance(value, torch.Tensor):
            raise TypeError(
                f"cannot pack {label!r}: tensor subclass {class_name(t)} keeps a tensor in its attribute "
                f"{attr!r}, which would not travel with its data"
            )


@dataclass(frozen=True, eq=False)
class Flat:
    """One wrapper taken apart: its inner tensors (in flatten order) and its context."""

    names: tuple[str, ...]
    inner: tuple[torch.Tensor, ...]
    ctx: Any


def flatten(t: torch.Tensor) -> Flat:
    names, ctx = t.__tensor_flatten__()
    return Flat(tuple(names), tuple(getattr(t, n) for n in names), ctx)


@dataclass(frozen=True, eq=False)
class WrapperSpec:
    """How to rebuild one wrapper over other inner tensors (a buffer's views of the packed ones)."""

    cls: type
    names: tuple[str, ...]
    ctx: Any
    size: torch.Size
    stride: tuple[int, ...]
    inference: bool
    extra: dict[str, Any]  # attributes of the original that unflatten does not set (``_is_param``)

    @classmethod
    def of(cls, t: torch.Tensor, label: str) -> tuple[WrapperSpec, Flat]:
        """The spec and inner tensors of ``t``, or a TypeError naming its class and what is wrong."""
        flat = flatten(t)
        name = class_name(t)
        for n, inner in zip(flat.names, flat.inner):
            if not isinstance(inner, torch.Tensor) or type(inner) not in PLAIN_TYPES:
                raise TypeError(
                    f"cannot pack {label!r}: inner tensor {n!r} of {name} is a {type(inner).__name__}; "
                    "only plain inner tensors are supported"
                )
        if any(True for _ in held_tensors(flat.ctx)):
            raise TypeError(f"cannot pack {label!r}: the flatten context of {name} holds a tensor")
        named = {id(x) for x in flat.inner}
        stray = [k for k, v in vars(t).items() if any(id(x) not in named for x in held_tensors(v))]
        if stray:
            raise TypeError(
                f"cannot pack {label!r}: {name} holds tensors its __tensor_flatten__ does not name "
                f"(in {', '.join(sorted(stray))})"
            )
        with torch.inference_mode(t.is_inference()):
            rebuilt = type(t).__tensor_unflatten__(dict(zip(flat.names, flat.inner)), flat.ctx, t.size(), t.stride())
        if type(rebuilt) is not type(t) or rebuilt.size() != t.size() or rebuilt.dtype != t.dtype:
            raise TypeError(f"cannot pack {label!r}: {name}.__tensor_unflatten__ does not give back the tensor")
        if any(id(x) not in named for x in held_tensors(vars(rebuilt))):
            raise TypeError(f"cannot pack {label!r}: {name}.__tensor_unflatten__ makes tensors of its own")
        own = vars(rebuilt)
        extra = {k: v for k, v in vars(t).items() if k not in own and not any(True for _ in held_tensors(v))}
        spec = cls(type(t), flat.names, flat.ctx, t.size(), t.stride(), t.is_inference(), extra)
        return spec, flat

    def rebuild(self, inner: Sequence[torch.Tensor], ctx: Any = None, inference: bool | None = None) -> torch.Tensor:
        """A new wrapper over ``inner``; ``ctx`` replaces the original context (a transform's output).

        It is an inference tensor like the original unless ``inference`` says otherwise.
        """
        with torch.inference_mode(self.inference if inference is None else inference):
            w = self.cls.__tensor_unflatten__(
                dict(zip(self.names, inner)), self.ctx if ctx is None else ctx, self.size, self.stride
            )
        vars(w).update(self.extra)
        return w

    def matches(self, t: object) -> Flat | None:
        """The inner tensors of ``t`` if it is a wrapper of this class and size, else None."""
        if type(t) is not self.cls or t.size() != self.size:
            return None
        flat = flatten(t)
        return flat if flat.names == self.names else None


def swap(a: torch.Tensor, b: torch.Tensor, label: str) -> None:
    """Exchange the contents of two tensor objects; each keeps its identity."""
    try:
        torch.utils.swap_tensors(a, b)
    except RuntimeError as e:
        raise RuntimeError(f"cannot bind {label!r}: {e}") from e


def wrappers_to_inference(module: nn.Module) -> int:
    """Make every wrapper parameter and buffer of ``module`` an inference tensor again; returns how many were not.

    Why: ComfyUI loads models under ``torch.inference_mode`` and its prompt worker unloads them
    outside it (``POST /free``). ``Module.to()`` there swaps each wrapper (a QuantizedTensor) for a
    normal tensor, which no code in inference mode can ``detach()`` again: core's LoRA loader
    reads ``state_dict()`` and fails with "Cannot set version_counter for inference tensor". Core
    loads its own models afresh after a ``/free``; a model kept across one is mended with this
    before it is handed out. The same inner tensors are rewrapped and swapped into the same
    object: nothing is copied, and whoever holds the parameter keeps holding it.
    """
    mended = 0
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.is_inference() or not is_wrapper(t):
                    continue
                flat = flatten(t)
                with torch.inference_mode():
                    w = type(t).__tensor_unflatten__(dict(zip(flat.names, flat.inner)), flat.ctx, t.size(), t.stride())
                own = vars(w)
                own.update({k: v for k, v in vars(t).items() if k not in own})
                swap(t, w, name)
                mended += 1
    return mended


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds: a wrapper's inner tensors, not its logical numel x element size."""
    if is_wrapper(t):
        return sum(x.numel() * x.element_size() for x in flatten(t).inner)
    return t.numel() * t.element_size()
