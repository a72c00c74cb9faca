"""The pack's ComfyUI side: thin adapters over offload_core, the nodes (V3 schema), and the server
wiring.

ARCHITECTURE.md at the pack's root says which module does what. Process-wide state lives in
state.py; node modules import it, never each other's registries. The nodes are `io.ComfyNode`
classes of ComfyUI's versioned `comfy_api.v0_0_2` (not `latest`, which ComfyUI documents as
unstable), handed to ComfyUI by `TieredOffloadExtension` through the root's `comfy_entrypoint`.
"""
import logging

from comfy_api.v0_0_2 import ComfyExtension, io

from . import managed_models, preload, prompt_lifecycle, routes, tiered_loaders
from .core_pins import install as share_pinned_budget_with_core
from .layerwise import ApplyLayerwiseOffload
from .swap import ModelLevelSwap
from .tier_manager_node import VRAMTierManager

log = logging.getLogger(__name__)

share_pinned_budget_with_core()

NODES: tuple[type[io.ComfyNode], ...] = (
    ApplyLayerwiseOffload,
    ModelLevelSwap,
    *tiered_loaders.LOADERS.values(),
    VRAMTierManager,
)


class TieredOffloadExtension(ComfyExtension):
    """What ComfyUI asks the pack for at start-up: its node classes."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


def install() -> None:
    """Server-side wiring, once at start-up: the REST routes and panel events, then a prompt's
    models held from its start and released when it ends, then the preload (which never fails
    the pack's import)."""
    routes.register()
    prompt_lifecycle.install()
    prompt_lifecycle.on_prompt_start(tiered_loaders.hold_graph)
    prompt_lifecycle.on_prompt_end(managed_models.release_prompt)
    try:
        preload.preload_from_settings()
    except Exception:
        log.exception("tiered offload: preload failed; the models load on first use instead")
