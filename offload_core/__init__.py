"""Weight offload engine: layerwise streaming, whole-module swap and the tiers of whole models.

Depends only on torch, safetensors, psutil and the standard library (never on ComfyUI). Its rooms,
each importing only the ones listed after it: files/ (a file's bytes and identity), host/ (packs in
host RAM: units), sharing/ (the machine's one host copy: host, units), blocks/ (what a model's
blocks and phases are: host), device/ (device slots, residency, hooks: host, units), disk/ (the
spill file and its RAM cache: files, host, device, units), layerwise/ (the streamer: every room
above), models/ (whole models: files, host, sharing, units); any room may import ordering.py (the device-ordering
seam: streams, events, asynchronous copies), and host/, disk/ and layerwise/ alignment.py (byte
alignment, without torch). ARCHITECTURE.md at the pack's root draws the house.

This module is the public API: the names below, resolved lazily so importing the package costs
nothing until something is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LayerwiseStreamer": "layerwise.streamer",
    "ModuleSwap": "models.swap",
    "PackedBlock": "host.packing",
    "PackedTensor": "host.layout",
    "TensorRef": "host.tensor_refs",
    "tensor_refs": "host.tensor_refs",
    "check_packable": "host.layout",
    "wrappers_to_inference": "host.subclass",
    "HostStorage": "host.pinned",
    "HostShare": "sharing.shared_packing",
    "StoreFolder": "sharing.store_folder",
    "pinned_bytes": "host.pinned",
    "pin_cap": "host.pinned",
    "set_pin_accounting": "host.pinned",
    "available_ram_bytes": "host.pinned",
    "Telemetry": "device.telemetry",
    "BlockHooks": "device.hooks",
    "spread_evenly": "device.residency",
    "plan_residency": "device.residency",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .device.hooks import BlockHooks
    from .device.residency import plan_residency, spread_evenly
    from .device.telemetry import Telemetry
    from .host.layout import PackedTensor, check_packable
    from .host.packing import PackedBlock
    from .host.pinned import (
        HostStorage,
        available_ram_bytes,
        pin_cap,
        pinned_bytes,
        set_pin_accounting,
    )
    from .sharing.shared_packing import HostShare
    from .sharing.store_folder import StoreFolder
    from .host.subclass import wrappers_to_inference
    from .host.tensor_refs import TensorRef, tensor_refs
    from .layerwise.streamer import LayerwiseStreamer
    from .models.swap import ModuleSwap


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
