"""ComfyUI entry point of comfyui-tiered-offload.

ComfyUI imports this file at start-up and survives a failure here (it logs "IMPORT FAILED" with
the traceback), so nothing is caught: a broken install must be loud, not silently half-loaded.
Only the node adapters and their server wiring are imported; the engine loads with them. The
server wiring is installed at import (ComfyUI 0.3.75 never calls a V3 extension's `on_load`);
the nodes are V3 (`comfy_api.v0_0_2`) and reach ComfyUI through `comfy_entrypoint`, which it
awaits after the import. There is no NODE_CLASS_MAPPINGS: ComfyUI would take it and never ask
the entry point.
"""
try:
    import comfy_api.v0_0_2  # noqa: F401  (the node API the pack's nodes are written against)
except ImportError as e:
    raise ImportError("comfyui-tiered-offload needs a ComfyUI that ships the V3 node API "
                      "comfy_api.v0_0_2 (0.3.75 and later are tested): update ComfyUI") from e

from .nodes import TieredOffloadExtension, install  # noqa: E402

WEB_DIRECTORY = "./web"

install()


async def comfy_entrypoint() -> TieredOffloadExtension:
    return TieredOffloadExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
