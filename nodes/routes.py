"""REST routes and websocket events of the pack, under /offload/ (also mirrored under /api/).

Nothing here takes a filesystem path from a request: models are addressed by the manager's id,
and only the Tiered loaders (which resolve names inside ComfyUI's model folders) register them.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import psutil
import torch
from aiohttp import web

import comfy.model_management

from ..offload_core.pinned import pinned_bytes
from ..offload_core.tiers import ModelInUseError, ModelPinnedError, TierCapacityError, UnknownModelError
from . import loaded_models
from .layerwise import REGISTRY as LAYERWISE
from .swap import MEMBERS as SWAP_MEMBERS
from .tiers import MANAGER, diffusion_module_ids, sync_tiers

log = logging.getLogger(__name__)

TIERS_EVENT = "tiered_offload.tiers"
LAYERWISE_EVENT = "tiered_offload.layerwise"
ACTIONS = {"load": MANAGER.load, "park": MANAGER.park, "evict": MANAGER.evict,
           "pin": MANAGER.pin, "unpin": MANAGER.unpin}
GIB = 1024 ** 3
BUDGET_FIELDS = {"ram_budget_gb": "ram_budget_bytes", "ram_reserve_gb": "ram_reserve_bytes",
                 "vram_reserve_gb": "vram_reserve_bytes"}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def devices() -> dict[str, Any]:
    device = comfy.model_management.get_torch_device()
    mem = psutil.virtual_memory()
    budgets = MANAGER.budgets()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        vram = {"device": torch.cuda.get_device_name(device), "total": total, "used": total - free,
                "free": free, "reserved": budgets["vram_reserve_bytes"]}
    else:
        vram = {"device": str(device), "total": 0, "used": 0, "free": 0,
                "reserved": budgets["vram_reserve_bytes"]}
    snapshot_ram = MANAGER.snapshot()["ram"]
    return {"vram": vram,
            "ram": {"total": mem.total, "available": mem.available, "pinned": pinned_bytes(),
                    "budget": snapshot_ram["budget"], "used_by_models": snapshot_ram["used_by_models"]}}


def _layerwise_by_model() -> dict[int, dict]:
    return {report["module_id"]: report for report in LAYERWISE.report()}


def tiers_payload() -> dict[str, Any]:
    snapshot = MANAGER.snapshot()
    layerwise = _layerwise_by_model()
    module_ids = diffusion_module_ids()
    for model in snapshot["models"]:
        model["layerwise"] = layerwise.get(module_ids.get(model["id"]))
    return {"models": snapshot["models"], "devices": devices(), "budgets": snapshot["budgets"],
            "loaded": loaded_models.report()}


async def get_tiers(request: web.Request) -> web.Response:
    sync_tiers()
    return web.json_response(tiers_payload())


async def get_layerwise(request: web.Request) -> web.Response:
    """Every layerwise-offloaded model: settings, block states and last run's telemetry."""
    return web.json_response({"models": LAYERWISE.report()})


async def get_swap(request: web.Request) -> web.Response:
    """Models under Model-Level Swap: where each is, and how often it moved."""
    return web.json_response({"members": [m.report() for m in SWAP_MEMBERS.values()]})


async def post_action(request: web.Request) -> web.Response:
    model, action = request.match_info["model"], request.match_info["action"]
    if action not in ACTIONS:
        return _error(400, f"unknown action '{action}'; use one of {', '.join(ACTIONS)}")
    try:
        entry = ACTIONS[action](model)
    except UnknownModelError:
        return _error(404, f"no model with id '{model}'")
    except (ModelInUseError, ModelPinnedError, TierCapacityError) as e:
        return _error(409, str(e))
    sync_tiers()
    return web.json_response({"model": entry.to_dict()})


async def post_budgets(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "body must be a JSON object")
    if not isinstance(body, dict) or not body:
        return _error(400, "body must be a non-empty JSON object with any of: "
                           + ", ".join([*BUDGET_FIELDS, "disk_tier"]))
    unknown = set(body) - set(BUDGET_FIELDS) - {"disk_tier"}
    if unknown:
        return _error(400, f"unknown field(s) {sorted(unknown)}; allowed: "
                           + ", ".join([*BUDGET_FIELDS, "disk_tier"]))
    kwargs: dict[str, Any] = {}
    for field, target in BUDGET_FIELDS.items():
        if field not in body:
            continue
        value = body[field]
        if field == "ram_budget_gb" and value is None:
            kwargs[target] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            return _error(400, f"{field} must be a number of GiB >= 0"
                               + (" or null" if field == "ram_budget_gb" else ""))
        kwargs[target] = int(value * GIB)
    if "disk_tier" in body:
        if not isinstance(body["disk_tier"], bool):
            return _error(400, "disk_tier must be true or false")
        kwargs["disk_tier"] = body["disk_tier"]
    try:
        MANAGER.set_budgets(**kwargs)
    except ValueError as e:
        return _error(400, str(e))
    return web.json_response({"budgets": MANAGER.budgets()})


def register() -> None:
    from server import PromptServer

    server = PromptServer.instance
    routes = server.routes
    routes.get("/offload/tiers")(get_tiers)
    routes.get("/offload/layerwise")(get_layerwise)
    routes.get("/offload/swap")(get_swap)
    routes.post("/offload/models/{model}/{action}")(post_action)
    routes.post("/offload/budgets")(post_budgets)
    loaded_models.register(server, tiers_payload, TIERS_EVENT)

    MANAGER.subscribe(lambda event: server.send_sync(TIERS_EVENT, tiers_payload()))
    LAYERWISE.subscribe(lambda report: server.send_sync(
        LAYERWISE_EVENT, {"model_id": _model_id_of_module(report["module_id"]), "layerwise": report}))


def _model_id_of_module(module_id: int) -> str | None:
    return next((key for key, mid in diffusion_module_ids().items() if mid == module_id), None)
