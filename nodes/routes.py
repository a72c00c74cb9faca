"""REST routes of the pack, under /offload/ (ComfyUI mirrors them under /api/offload/)."""
from __future__ import annotations

from aiohttp import web

from .layerwise import REGISTRY as LAYERWISE


async def layerwise_state(request: web.Request) -> web.Response:
    """Every layerwise-offloaded model: settings, block states and last run's telemetry."""
    return web.json_response({"models": LAYERWISE.report()})


def register() -> None:
    from server import PromptServer

    routes = PromptServer.instance.routes
    routes.get("/offload/layerwise")(layerwise_state)
