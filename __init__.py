"""ComfyUI entry point of comfyui-tiered-offload.

ComfyUI imports this file at start-up and survives a failure here (it logs "IMPORT FAILED" with
the traceback), so nothing is caught: a broken install must be loud, not silently half-loaded.
Only the node adapters and the routes are imported; the engine loads with them, nothing more.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from .nodes import routes as _routes
from .nodes import tiers as _tiers

WEB_DIRECTORY = "./web"

_routes.register()
_tiers.install()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
