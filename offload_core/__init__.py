"""Weight offload engine: layerwise streaming and whole-module swap.

Depends only on torch, safetensors, psutil and the standard library (never on
ComfyUI).  Names are resolved lazily so importing the package costs nothing
until something is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LayerwiseStreamer": "streamer",
    "ModuleSwap": "swap",
    "PackedBlock": "packing",
    "PackedTensor": "packing",
    "TensorRef": "packing",
    "tensor_refs": "packing",
    "check_packable": "packing",
    "HostStorage": "pinned",
    "pinned_bytes": "pinned",
    "pin_cap": "pinned",
    "set_pin_accounting": "pinned",
    "available_ram_bytes": "pinned",
    "Telemetry": "telemetry",
    "BlockHooks": "hooks",
    "spread_evenly": "residency",
    "plan_residency": "residency",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .hooks import BlockHooks
    from .packing import PackedBlock, PackedTensor, TensorRef, check_packable, tensor_refs
    from .pinned import (
        HostStorage,
        available_ram_bytes,
        pin_cap,
        pinned_bytes,
        set_pin_accounting,
    )
    from .residency import plan_residency, spread_evenly
    from .streamer import LayerwiseStreamer
    from .swap import ModuleSwap
    from .telemetry import Telemetry


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
