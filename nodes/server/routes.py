"""REST routes and websocket events of the pack, under /offload/ (also mirrored under /api/).

Nothing here takes a filesystem path from a request: models are addressed by the manager's id,
and only the Tiered loaders (which resolve names inside ComfyUI's model folders) register them.

Every state-changing route is for this server's own page and for clients that are no web page
(scripts, curl): it takes only `Content-Type: application/json` and refuses a request whose
`Origin` is another origin's or `null` (`state_changing`). ComfyUI's own origin check lets `null`
through (the origin of a sandboxed iframe, a `data:` page, a local file) and looks only at loopback
hosts; without ours a page on any site could change the budgets with a `text/plain` form post.
A JSON body from another origin needs a CORS preflight, which ComfyUI does not grant unless it
was started with `--enable-cors-header`; an origin named there is taken, `*` names none.

The aiohttp event loop serves every route of ComfyUI, `/interrupt` included, so nothing here may
block it: status routes read the manager's published copy and never wait for its lock, and every
action that may move bytes (load, park, evict, budgets that evict) runs in a worker thread, and
only between prompts (`prompt_lifecycle.between_prompts`). Bad
input of any kind gets a 4xx JSON answer with a short message that never echoes the input, and
an event is handed to ComfyUI's websocket only once it is known to encode.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import urllib.parse
from typing import Any, Awaitable, Callable

import psutil
import torch
from aiohttp import web

import comfy.model_management

from ...offload_core.host.pinned import pinned_bytes
from ...offload_core.models.tier_errors import (
    ModelInUseError, ModelPinnedError, SourceChangedError, SourceGoneError, SourceUnreadableError,
    TierCapacityError, TierError, UnknownModelError)
from ..core import budgets, prompt_lifecycle
from ..core.state import LAYERWISE, MANAGER, SWAP_MEMBERS
from ..tiers.managed_models import diffusion_module_ids, release_prompt, sync_tiers
from . import loaded_models, node_help

log = logging.getLogger(__name__)

TIERS_EVENT = "tiered_offload.tiers"
LAYERWISE_EVENT = "tiered_offload.layerwise"
ACTIONS = {"load": MANAGER.load, "park": MANAGER.park, "evict": MANAGER.evict,
           "pin": MANAGER.pin, "unpin": MANAGER.unpin}
MAX_BODY_BYTES = 64 * 1024  # a budgets body is a few dozen bytes
class BadRequest(Exception):
    """A request refused before it reaches the manager: status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# What a request may raise and the status it answers with, the first kind that matches deciding:
# a model's file gone (404), a refusal of the manager or of the prompt running (409), a file that
# cannot be read (422), a bad value (400). An id the route does not know is its own 404
# (``_answer``). Anything else is a bug: logged and answered 500, the server stays up.
ANSWERS: tuple[tuple[type[BaseException], int], ...] = (
    (SourceGoneError, 404), (ModelInUseError, 409), (ModelPinnedError, 409), (TierCapacityError, 409), (SourceChangedError, 409),
    (MemoryError, 409), (torch.OutOfMemoryError, 409), (prompt_lifecycle.PromptRunningError, 409),
    (SourceUnreadableError, 422), (TierError, 409), (ValueError, 400))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _answer(error: BaseException, failed: str, unknown: str = "",
            missing: type[BaseException] = UnknownModelError) -> web.Response:
    """The answer to what a request raised (ANSWERS): ``missing``, the route's error for an id it
    does not know, is a 404 saying ``unknown``; ``failed`` is what a 500 says failed."""
    if isinstance(error, BadRequest):
        return _error(error.status, str(error))
    if isinstance(error, missing):
        return _error(404, unknown)
    status = next((code for kind, code in ANSWERS if isinstance(error, kind)), None)
    if status is None:
        log.exception("[tiered offload] %s failed", failed, exc_info=error)
        return _error(500, f"{failed} failed: {budgets.shorten(error, 300)}")
    return _error(status, str(error))


def _cors_origin() -> str | None:
    """The one origin ComfyUI was told to allow (`--enable-cors-header ORIGIN`); `*` is none."""
    from comfy.cli_args import args

    origin = getattr(args, "enable_cors_header", None)
    return origin.rstrip("/").lower() if isinstance(origin, str) and origin not in ("", "*") else None


def _foreign_origin(request: web.Request) -> str | None:
    """Why the request's Origin is not this server's own page, or None when it is (or when there
    is no Origin: a client that is no web page)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    parsed = urllib.parse.urlsplit(origin.strip())
    netloc = parsed.netloc.lower()
    if not netloc or parsed.scheme not in ("http", "https"):
        return "a request from a page with no origin of its own (Origin: null) is refused"
    own = {request.host.lower()}
    forwarded = request.headers.get("X-Forwarded-Host")  # a browser page cannot set it cross-site
    if forwarded:
        own.add(forwarded.split(",")[0].strip().lower())
    if netloc in own or origin.strip().rstrip("/").lower() == _cors_origin():
        return None
    return f"a request from another origin ({budgets.shorten(netloc)}) is refused"


def state_changing(handler: Callable[[web.Request], Awaitable[web.Response]]):
    """Refuse, before ``handler`` runs, a request from another origin's page or a sandboxed one
    (403) and one that is not sent as application/json (415), with or without a body."""
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.Response:
        why = _foreign_origin(request)
        if why is not None:
            log.warning("[tiered offload] %s %s: %s", request.method, budgets.shorten(request.path, 100), why)
            return _error(403, f"{why}: the pack's settings change only from this server's own page "
                               "or a client that is no web page")
        if request.content_type != "application/json":
            return _error(415, "send the request as JSON: Content-Type: application/json")
        return await handler(request)

    return guarded


class _NotANumber(ValueError):
    pass


def _reject_constant(name: str) -> None:
    raise _NotANumber(name)


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object: UTF-8, at most MAX_BODY_BYTES, no NaN or Infinity."""
    charset = request.charset
    if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        raise BadRequest(400, "the body must be JSON in UTF-8; drop the charset or use utf-8")
    too_large = BadRequest(413, f"the body is larger than {MAX_BODY_BYTES // 1024} KiB")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large
    raw = bytearray()
    while chunk := await request.content.read(MAX_BODY_BYTES + 1 - len(raw)):
        raw += chunk  # read() may return part of the body: read up to the end or the limit
        if len(raw) > MAX_BODY_BYTES:
            raise too_large
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except _NotANumber:
        raise BadRequest(400, "NaN and Infinity are not numbers; use finite numbers") from None
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, too deep, too many digits
        raise BadRequest(400, "the body must be a JSON object in valid UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    return body


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a call that may move gigabytes in a worker thread, so the event loop keeps serving."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


def _compute_is_cpu() -> bool:
    return comfy.model_management.get_torch_device().type == "cpu"


def as_shown(model: dict[str, Any], cpu: bool) -> dict[str, Any]:
    """A managed model as the API shows it. The manager's top tier is the compute device; where
    that is the CPU there is no VRAM, and the model ComfyUI loaded there sits in RAM (its bytes
    are counted there): its tier is named "cpu" (the panel's CPU badge), never "vram"."""
    if not cpu:
        return model

    def named(tier: str) -> str:
        return "cpu" if tier == "vram" else tier
    shown = dict(model, tier=named(model["tier"]), bytes={named(k): n for k, n in model["bytes"].items()})
    if model.get("moving"):
        shown["moving"] = {k: named(v) if k in ("from", "to") else v for k, v in model["moving"].items()}
    return shown


def devices() -> dict[str, Any]:
    device = comfy.model_management.get_torch_device()
    mem = psutil.virtual_memory()
    reserved = MANAGER.budgets()["vram_reserve_bytes"]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        vram = {"device": torch.cuda.get_device_name(device), "total": total, "used": total - free,
                "free": free, "reserved": reserved, "unified_memory": False}
    else:  # the CPU, or a GPU that shares the RAM (Apple's mps): no VRAM, so nothing to reserve
        vram = {"device": str(device), "total": 0, "used": 0, "free": 0, "reserved": 0,
                "unified_memory": device.type == "mps"}
    snapshot_ram = MANAGER.snapshot()["ram"]
    return {"vram": vram,
            "ram": {"total": mem.total, "available": mem.available, "pinned": pinned_bytes(),
                    "budget": snapshot_ram["budget"], "used_by_models": snapshot_ram["used_by_models"],
                    "held_by_pack": held_by_pack(snapshot_ram["used_by_models"])}}


def held_by_pack(tier_models: int) -> dict[str, int]:
    """The host RAM the pack holds, by what holds it: the tier manager's models in RAM, Model-Level
    Swap's masters, Apply Layerwise Offload's host packs (in this process or a shared store) and
    its disk tier's caches. What the RAM bar shows as the pack's own, apart from everything else."""
    swap = sum(int(member.report()["bytes"]["master"]) for member in list(SWAP_MEMBERS.values())
               if not member.closed)
    packs = cache = 0
    for report in LAYERWISE.report():
        host = report.get("host") or {}
        packs += int(host.get("pinned", 0)) + int(host.get("pageable", 0))
        cache += int(host.get("cache", 0))
    return {"tier_models": int(tier_models), "swap_masters": swap, "layerwise_packs": packs, "disk_cache": cache}


def _layerwise_by_model() -> dict[int, dict]:
    return {report["module_id"]: report for report in LAYERWISE.report()}


def tiers_payload() -> dict[str, Any]:
    snapshot = MANAGER.snapshot()
    layerwise = _layerwise_by_model()
    module_ids = diffusion_module_ids()
    cpu = _compute_is_cpu()
    models = [dict(as_shown(model, cpu), layerwise=layerwise.get(module_ids.get(model["id"])))
              for model in snapshot["models"]]
    return {"models": models, "devices": devices(), "budgets": snapshot["budgets"],
            "loaded": loaded_models.report()}


async def get_tiers(request: web.Request) -> web.Response:
    """Every managed model; never waits for a load (a busy manager's state is as published)."""
    sync_tiers(wait=False)
    return web.json_response(tiers_payload())


async def get_layerwise(request: web.Request) -> web.Response:
    """Every layerwise-offloaded model: settings, block states and last run's telemetry."""
    return web.json_response({"models": LAYERWISE.report()})


# The panel renews the timeline lease every TIMELINE_RENEW_S while it is open (web/tiered_offload.js);
# twice that without a renewal and recording stops.
TIMELINE_RENEW_S = 30
TIMELINE_LEASE_S = 2 * TIMELINE_RENEW_S


def _timeline_state() -> dict[str, Any]:
    return {"recording": LAYERWISE.timeline.wanted(), "lease_seconds": TIMELINE_LEASE_S}


async def get_timeline(request: web.Request) -> web.Response:
    """The last run's picture of each layerwise-offloaded model that recorded one (see
    offload_core/device/timeline.py): times in ms from the pass start, per streamed unit."""
    timelines = [{"module_id": r["module_id"], "model_id": _model_id_of_module(r["module_id"]),
                  "model_class": r["model_class"], **r["timeline"]}
                 for r in LAYERWISE.report() if r.get("timeline")]
    return web.json_response({**_timeline_state(), "timelines": timelines})


@state_changing
async def post_timeline(request: web.Request) -> web.Response:
    """{"enabled": true} renews the lease on recording the next runs' picture (for
    TIMELINE_LEASE_S); {"enabled": false} ends it."""
    try:
        body = await read_json_object(request)
    except BadRequest as e:
        return _answer(e, "reading the body")
    if set(body) != {"enabled"} or not isinstance(body["enabled"], bool):
        return _error(400, 'the body must be {"enabled": true} or {"enabled": false}')
    if body["enabled"]:
        LAYERWISE.timeline.renew(TIMELINE_LEASE_S)
    else:
        LAYERWISE.timeline.end()
    return web.json_response(_timeline_state())


async def get_swap(request: web.Request) -> web.Response:
    """Models under Model-Level Swap: where each is, and how often it moved."""
    return web.json_response({"members": [m.report() for m in SWAP_MEMBERS.values()]})


MOVES = {"load", "park", "evict"}  # actions that move bytes through core's model management
# An unpin while a prompt ran left RAM over budget: the drops wait for the prompt's end.
_DROPS_AFTER_PROMPT = threading.Event()


def _act(action: str, model: str) -> dict[str, Any]:
    MANAGER.get(model)  # an unknown id is a 404, whether a prompt runs or not
    if action == "unpin":
        entry = _unpin(model)
    else:
        with prompt_lifecycle.between_prompts(action) if action in MOVES else contextlib.nullcontext():
            entry = ACTIONS[action](model)
    sync_tiers()
    return as_shown(entry.to_dict(), _compute_is_cpu())


def _unpin(key: str):
    """Unpin at once. The drops to disk it may make necessary run through core's unload, which is
    the prompt worker's: now when no prompt runs, else when the running prompt ends."""
    try:
        with prompt_lifecycle.between_prompts("a drop to disk"):
            return MANAGER.unpin(key)
    except prompt_lifecycle.PromptRunningError:
        entry = MANAGER.unpin(key, drop=False)
        _DROPS_AFTER_PROMPT.set()
        return entry


def _drops_after_prompt() -> None:
    """On the prompt worker, as a prompt ends: the drops an unpin during it left to now."""
    if _DROPS_AFTER_PROMPT.is_set():
        _DROPS_AFTER_PROMPT.clear()
        MANAGER.enforce_ram_budget()


def _set_budgets(kwargs: dict[str, Any]) -> dict[str, Any]:
    # Lower budgets evict at once, through core.
    with prompt_lifecycle.between_prompts("a budget change"):
        return MANAGER.set_budgets(**kwargs)


@state_changing
async def post_action(request: web.Request) -> web.Response:
    model, action = request.match_info["model"], request.match_info["action"]
    if action not in ACTIONS:
        return _error(400, f"unknown action '{budgets.shorten(action)}'; use one of "
                           f"{', '.join(ACTIONS)}")
    try:
        return web.json_response({"model": await _off_loop(_act, action, model)})
    except Exception as e:
        return _answer(e, action, f"no model with id '{budgets.shorten(model)}'")


@state_changing
async def post_budgets(request: web.Request) -> web.Response:
    """Change the budgets: GiB fields as `core/budgets.py` defines them, and disk_tier."""
    try:
        body = await read_json_object(request)
        if not body:
            raise BadRequest(400, "the body must be a non-empty JSON object with any of: "
                                  + ", ".join(budgets.ALLOWED))
        kwargs = budgets.budget_kwargs(body)
        # A value beyond this machine (a reserve above its RAM) is a ValueError too.
        return web.json_response({"budgets": await _off_loop(_set_budgets, kwargs)})
    except Exception as e:
        return _answer(e, "a budget change")


@state_changing
async def post_unload(request: web.Request) -> web.Response:
    """Core's own unload of a model in the panel's list of loaded models, between prompts."""
    card = request.match_info["card"]
    try:
        done = await _off_loop(loaded_models.unload, card)
        # Core's unload raises no event of its own: tell the open panels.
        push_tiers()
        return web.json_response({"unloaded": done})
    except Exception as e:
        return _answer(e, "an unload", f"no loaded model with id '{budgets.shorten(card)}'", LookupError)


def policy_fields(body: dict[str, Any]) -> tuple[bool | None, int | None]:
    """keep_in_ram and priority from a policy body; ValueError names what is wrong."""
    if not body or set(body) - {"keep_in_ram", "priority"}:
        raise ValueError("the body must be a JSON object with keep_in_ram (true/false) and/or "
                         "priority (a whole number from -100 to 100)")
    keep, priority = body.get("keep_in_ram"), body.get("priority")
    if "keep_in_ram" in body and not isinstance(keep, bool):
        raise ValueError("keep_in_ram must be true or false")
    if "priority" in body:
        budgets.whole_number("priority", priority, -100, 100)
    return keep, priority


def _policy(key: str, keep_in_ram: bool | None, priority: int | None) -> dict[str, Any]:
    entry = MANAGER.get(key)
    if keep_in_ram is not None:
        MANAGER.pin(key) if keep_in_ram else _unpin(key)
    if priority is not None:
        MANAGER.set_priority(key, priority)
    return as_shown(entry.to_dict(), _compute_is_cpu())


@state_changing
async def post_policy(request: web.Request) -> web.Response:
    """A managed model's keep-in-RAM (never dropped to disk) and eviction priority."""
    key = request.match_info["model"]
    try:
        keep, priority = policy_fields(await read_json_object(request))
        return web.json_response({"model": await _off_loop(_policy, key, keep, priority)})
    except Exception as e:
        return _answer(e, "a policy change", f"no model with id '{budgets.shorten(key)}'")


def _send(server, event: str, payload: dict[str, Any]) -> None:
    """Hand an event to ComfyUI's websocket publisher only if it encodes: a payload that fails
    there would end core's publish loop, and with it the server."""
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        log.error("[tiered offload] %s event not sent, it does not encode as JSON: %s", event,
                  budgets.shorten(e, 200))
        return
    server.send_sync(event, payload)


def push_tiers(*_: Any) -> None:
    """Send the tiers event (the full GET /offload/tiers payload) to every open panel."""
    from server import PromptServer

    _send(PromptServer.instance, TIERS_EVENT, tiers_payload())


def register() -> None:
    from server import PromptServer

    server = PromptServer.instance
    routes = server.routes
    routes.get("/offload/tiers")(get_tiers)
    routes.get("/offload/layerwise")(get_layerwise)
    routes.get("/offload/swap")(get_swap)
    routes.get("/offload/timeline")(get_timeline)
    routes.post("/offload/timeline")(post_timeline)
    routes.post("/offload/models/{model}/{action}")(post_action)
    routes.post("/offload/budgets")(post_budgets)
    routes.post("/offload/loaded/{card}/unload")(post_unload)
    routes.post("/offload/policy/{model}")(post_policy)
    node_help.register(routes)

    MANAGER.subscribe(push_tiers)
    # Core's own loads and unloads raise no event: the panel hears of them after each prompt
    # (the prompt's models are released first, so the figures no longer show them in use).
    prompt_lifecycle.on_prompt_end(lambda prompt_id: (release_prompt(prompt_id),
                                                      _drops_after_prompt(), push_tiers()))
    LAYERWISE.subscribe(lambda report: _send(
        server, LAYERWISE_EVENT,
        {"model_id": _model_id_of_module(report["module_id"]), "layerwise": report}))


def _model_id_of_module(module_id: int) -> str | None:
    return next((key for key, mid in diffusion_module_ids().items() if mid == module_id), None)
