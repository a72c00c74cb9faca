"""The pack's ComfyUI side, one room per thing a user sees: the node families (`layerwise/`,
`swap/`, `tiers/`), the server (`server/`: the REST routes and panel events), and what they all
share (`core/`: the adapters to ComfyUI's core and the pack's process state), over the engine
(offload_core).

Imports point one way: server -> node families -> core -> engine; no family imports another.
Each room's __init__ says what it holds and may import; ARCHITECTURE.md says which module does
what, and tests/unit/test_package_shape.py holds the rooms to it. This module lists the nodes and
wires the server at start-up, so it may import every room. The nodes are `io.ComfyNode` classes
of ComfyUI's versioned `comfy_api.v0_0_2` (not `latest`, which ComfyUI documents as unstable),
handed to ComfyUI by `TieredOffloadExtension` through the root's `comfy_entrypoint`.
"""
import logging

from comfy_api.v0_0_2 import ComfyExtension, io

from .core import host_sharing, load_records, prompt_lifecycle
from .core.pins import install as share_pinned_budget_with_core
from .layerwise import compile_prompt, core_loads
from .layerwise.node import ApplyLayerwiseOffload
from .server import routes
from .swap.node import ModelLevelSwap
from .tiers import loaders, managed_models, preload
from .tiers.manager_node import VRAMTierManager

log = logging.getLogger(__name__)

share_pinned_budget_with_core()

NODES: tuple[type[io.ComfyNode], ...] = (
    ApplyLayerwiseOffload,
    ModelLevelSwap,
    *loaders.LOADERS.values(),
    VRAMTierManager,
)


class TieredOffloadExtension(ComfyExtension):
    """What ComfyUI asks the pack for at start-up: its node classes."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


def install() -> None:
    """Server-side wiring, once at start-up: the record of which file each model is read from (what
    names its shared host store, and where its streamed blocks may be read in place) and the
    removal of stores that ended processes left, the REST routes and panel events, core's loads of
    models whose streamed blocks stay in their file, then a prompt's models held from its start
    and released when it ends, each posted graph kept for its validation, then the preload (which
    never fails the pack's import)."""
    load_records.install()
    host_sharing.sweep()
    host_sharing.let_go_on_sigterm()
    routes.register()
    core_loads.install()
    prompt_lifecycle.install()
    compile_prompt.install()
    prompt_lifecycle.on_prompt_start(loaders.hold_graph)
    prompt_lifecycle.on_prompt_end(managed_models.release_prompt)
    try:
        preload.preload_from_settings()
    except Exception:
        log.exception("[tiered offload] preload failed; the models load on first use instead")
