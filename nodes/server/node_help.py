"""Each node's help page in the user's language, with no failed request before it.

The frontend asks for a custom node's help at /extensions/<pack folder>/docs/<Node>/<locale>.md
and, where that is missing, at docs/<Node>.md (both frontends the pack is tested with:
nodeHelpService.ts). The pack ships English as docs/<Node>.md and Chinese as docs/<Node>/zh.md,
so an English (or any other language's) help view would log a 404 before the fallback. This route,
matched before ComfyUI's static files of the extension, answers the first request: the page in
that language where the pack has it, else the English page. Only the pack's own node names and
plain locale names are taken; anything else is a 404, as the static route would answer.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from aiohttp import web

# The folder in custom_nodes/ as ComfyUI imported it (a link there is not followed: the frontend
# names the pack by the link).
PACK_ROOT = Path(os.path.abspath(__file__)).parents[2]
DOCS = PACK_ROOT / "web" / "docs"
_NAME = re.compile(r"^[A-Za-z0-9_]{1,80}$")
_LOCALE = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?$")


def help_page(node: str, locale: str) -> Path | None:
    """The help file to serve for ``node`` in ``locale``; None for what the pack does not have."""
    if not _NAME.match(node) or not _LOCALE.match(locale):
        return None
    english = DOCS / f"{node}.md"
    if not english.is_file():
        return None
    local = DOCS / node / f"{locale}.md"
    return local if local.is_file() else english


async def get_help(request: web.Request) -> web.StreamResponse:
    page = help_page(request.match_info["node"], request.match_info["locale"])
    if page is None:
        raise web.HTTPNotFound()
    return web.FileResponse(page, headers={"Content-Type": "text/markdown; charset=utf-8"})


def register(routes: web.RouteTableDef) -> None:
    """Add the route for the folder the pack is installed in (the name the frontend uses)."""
    routes.get(f"/extensions/{PACK_ROOT.name}/docs/{{node}}/{{locale}}.md")(get_help)
