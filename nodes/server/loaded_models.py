"""Every model ComfyUI has loaded, as the Offload panel lists it, and core's own unload.

The tier manager only knows the models of the Tiered loaders, but a user's workflow loads most
models with core's loaders. Core's `current_loaded_models` is the one list that holds them all,
so the panel's cards start from it: each model with its class, its file where the loader left a
trace of it, its bytes on the compute device and in RAM, and what the pack does with it (streamed
by Apply Layerwise Offload, swapped by Model-Level Swap, kept by the tier manager). Models the
pack still holds in RAM after core let go of them (a layerwise pack, a swap master) are listed
too, so no pinned byte is hidden.

Core's unload (`LoadedModel.model_unload`, what core itself does to make room) is offered only
between prompts: the check and the unload run under the prompt queue's lock, so no prompt can
start in between. A card of a model core let go of is acted on the same way: its unload has the
pack let go of what it still holds (the swap master, the layerwise pack), so every card listed
can be unloaded, and a prompt that runs refuses every one of them alike.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from typing import Any

import torch

import comfy.model_base
import comfy.model_management
import comfy.sd1_clip

from ...offload_core.models.tier_errors import TierError
from ..core import load_records, prompt_lifecycle
from ..core.models import unload_from_core
from ..core.state import LAYERWISE, MANAGER, SWAP_MEMBERS
from ..tiers.managed_models import diffusion_module_ids, key_of

log = logging.getLogger(__name__)

_ids: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_ids_lock = threading.Lock()  # reports run on the prompt worker and on the server's loop
_counter = itertools.count(1)


def _card_id(module: torch.nn.Module) -> str:
    """A short id per model module that is never reused, unlike id()."""
    with _ids_lock:
        found = _ids.get(module)
        if found is None:
            found = _ids[module] = f"core-{next(_counter)}"
        return found


def _find(card_id: str) -> list:
    with _ids_lock:
        return [lm for lm in list(comfy.model_management.current_loaded_models)
                if lm.model is not None and _ids.get(lm.model.model) == card_id]


def _kind(module: torch.nn.Module) -> str:
    if isinstance(module, comfy.model_base.BaseModel):
        return "diffusion model"
    if isinstance(module, comfy.sd1_clip.SD1ClipModel):
        return "text encoder"
    name = f"{type(module).__module__}.{type(module).__name__}".lower()
    return "VAE" if "vae" in name or "autoencoder" in name else "model"


def _file_of(patcher) -> str | None:
    """The file a core loader read, where core recorded it (0.33's `cached_patcher_init`)."""
    init = getattr(patcher, "cached_patcher_init", None)
    if not isinstance(init, tuple) or len(init) < 2 or not init[1]:
        return None
    paths = init[1][0]
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        return None
    return " + ".join(os.path.basename(os.fspath(p)) for p in paths) or None


def _recorded_file(module: torch.nn.Module) -> str | None:
    """The file the pack saw core read ``module`` from (core/load_records.py: core's loaders, and
    the file a GGUF model was mapped from), where core itself records none (0.3.75)."""
    source = load_records.source_of(module) or load_records.mapped_source_of(module)
    if not source:
        return None
    return " + ".join(os.path.basename(path) for path, _ in source["files"]) or None


def _layerwise_by_module() -> dict[int, dict]:
    return {report["module_id"]: report for report in LAYERWISE.report()}


def _card(lm, layerwise: dict[int, dict], tier_names: dict[str, str],
          swapped: list) -> dict[str, Any] | None:
    patcher = lm.model
    if patcher is None:  # core's entry outlived its patcher; core drops it on its next pass
        return None
    module = patcher.model
    diffusion_model = getattr(module, "diffusion_model", None)
    lw = layerwise.pop(id(diffusion_model), None) if diffusion_model is not None else None
    tier_id = key_of(patcher)
    swap = SWAP_MEMBERS.get(module)
    swapped.append(swap)
    return {
        "id": _card_id(module),
        "class": type(module).__name__,
        "network": type(diffusion_model).__name__ if diffusion_model is not None else None,
        "kind": _kind(module),
        "file": tier_names.get(tier_id) or _file_of(patcher) or _recorded_file(module),
        "device": str(lm.device),
        "core": True,
        "bytes": _bytes(lm, lw),
        "tier_id": tier_id,
        "layerwise": lw,
        "swap": swap.report() if swap is not None else None,
    }


def _bytes(lm, lw: dict | None) -> dict[str, int]:
    """Where the model's bytes are: device + ram + disk == total. With a CPU compute device
    (--cpu) what core "loaded" is in RAM.

    A model the engine streams is counted as its blocks (the engine's pack, in RAM or on disk
    only) and the rest core holds: core's own figure then counts the rest and whatever its
    module's tensors point at between runs (views of the pack, the slots), not the model."""
    total = lm.model_memory()
    loaded = min(lm.model_loaded_memory(), total)
    on_gpu = lm.device.type != "cpu"
    if lw is None or (lw.get("dynamic_vram") or {}).get("path") == "core streams":
        device = loaded if on_gpu else 0
        return {"total": total, "device": device, "ram": total - device, "disk": 0,
                "loaded_by_core": loaded}
    blocks, rest = int(lw["block_bytes"]), int(lw["rest_bytes"])
    disk = min(int((lw.get("host") or {}).get("disk", 0)), blocks)
    device = min(loaded, rest) if on_gpu else 0
    return {"total": blocks + rest, "device": device, "ram": blocks + rest - device - disk,
            "disk": disk, "loaded_by_core": loaded, "blocks": blocks, "rest": rest}


def report() -> list[dict[str, Any]]:
    """Core's loaded models, newest first, then what the pack holds for models core let go."""
    layerwise = _layerwise_by_module()
    tier_names = {m["id"]: m["name"] for m in MANAGER.snapshot()["models"]}
    swapped: list = []
    cards = [card for lm in list(comfy.model_management.current_loaded_models)
             if (card := _card(lm, layerwise, tier_names, swapped)) is not None]
    managed = set(diffusion_module_ids().values())  # the tier manager's cards show these
    files = _session_files() if layerwise else {}
    for module_id, lw in layerwise.items():
        if module_id in managed or (lw.get("dynamic_vram") or {}).get("path") == "core streams":
            continue  # the tier manager's card shows it, or core streams it and the pack holds nothing
        cards.append({"id": f"layerwise-{module_id:x}", "class": lw["model_class"],
                      "network": lw["model_class"], "kind": "diffusion model", "file": files.get(module_id),
                      "device": lw["device"], "core": False, "bytes": None, "tier_id": None,
                      "layerwise": lw, "swap": None})
    for member in SWAP_MEMBERS.values():
        if member not in swapped and not member.closed:
            cards.append({"id": _swap_card_id(member), "class": member.name, "network": None,
                          "kind": member.kind, "file": None, "device": "cpu",  # a master lives in host RAM
                          "core": False, "bytes": None, "tier_id": None, "layerwise": None,
                          "swap": member.report()})
    return cards


def _session_files() -> dict[int, str]:
    """The file each streamed model was loaded from, by its diffusion module's id, where the pack
    recorded it: a model core let go of is named by its file, as its card was while loaded."""
    files = {}
    for module, session in LAYERWISE.sessions.items():
        root = session.model_ref()
        name = _recorded_file(root) if root is not None else None
        if name:
            files[id(module)] = name
    return files


def _swap_card_id(member) -> str:
    return f"swap-{id(member):x}"


def _held_by_pack(card_id: str) -> tuple[Any, torch.nn.Module, str] | None:
    """(registry, module, class name) of a card that lists what the pack holds of a model core
    let go of: its Model-Level Swap master or its layerwise pack; None for any other id."""
    if card_id not in {card["id"] for card in report() if not card["core"]}:
        return None
    for module, member in SWAP_MEMBERS.items():
        if _swap_card_id(member) == card_id:
            return SWAP_MEMBERS, module, member.name
    for module, session in LAYERWISE.sessions.items():
        if f"layerwise-{id(module):x}" == card_id:
            return LAYERWISE.sessions, module, session.model_class
    return None


def unload(card_id: str) -> dict[str, Any]:
    """Unload one card of the loaded list, between prompts only: core's own unload of a model
    core holds; for a model core let go of, the pack lets go of what it holds (its pinned master
    or pack is freed, and the model's tensors become ordinary ones again).

    Raises LookupError (unknown id, whether a prompt runs or not) or TierError (a prompt runs:
    PromptRunningError; or the tier manager owns the model).
    """
    if not _find(card_id) and _held_by_pack(card_id) is None:
        raise LookupError(card_id)
    with prompt_lifecycle.between_prompts("an unload"):
        for lm in _find(card_id):
            patcher = lm.model
            if patcher is None:
                continue
            if key_of(patcher) is not None:
                raise TierError("the tier manager keeps this model: use Park or Evict")
            name = type(patcher.model).__name__
            unload_from_core(patcher.model)
            log.info("[tiered offload] %s unloaded through core's unload (panel request)", name)
            return {"id": card_id, "class": name}
        held = _held_by_pack(card_id)
        if held is None:
            raise LookupError(card_id)
        registry, module, name = held
        registry.discard(module)
        log.info("[tiered offload] %s: the pack let go of what it held after ComfyUI unloaded it (panel request)",
                 name)
        return {"id": card_id, "class": name}
