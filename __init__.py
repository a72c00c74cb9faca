"""ComfyUI entry point of comfyui-tiered-offload.

ComfyUI imports this file at start-up and survives a failure here (it logs "IMPORT FAILED" with
the traceback), so nothing is caught: a broken install must be loud, not silently half-loaded.
Only the node adapters and their server wiring are imported; the engine loads with them.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, install

WEB_DIRECTORY = "./web"

install()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
