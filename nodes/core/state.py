"""The pack's process-wide state on the ComfyUI side, in one place that every node module imports.

What outlives one node call and is shared between the nodes, the routes and the tier manager's
backend lives here and nowhere else: the engine objects bound to models (layerwise sessions,
Dynamic VRAM cooperations and twins, Model-Level Swap masters), the file each model was read
from, the tier manager, which prompt holds which of its models, and the keys the pack registers its wrappers and callbacks under in
core (`comfy.patcher_extension` keys, `host_moves` keys). Node modules never import each other's
registries, so no import circle can form around them.

Imports the engine only, nothing else of nodes/: any module of nodes/ may import this one. The objects held
here are duck-typed (a session has `report()`, `disk_bytes()`, `active`), so this module needs no
node module's classes.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ...offload_core.models.tier_entries import Tier
from ...offload_core.models.tiers import TierManager
from ...offload_core.per_module import PerModule

log = logging.getLogger(__name__)

# The keys the pack registers under in core: wrappers, injections and host-move callbacks.
LAYERWISE_KEY = "tiered_offload.layerwise"  # Apply Layerwise Offload's engine
DYNAMIC_ORDER_KEY = "tiered_offload.dynamic_order"  # Apply Layerwise Offload's auto mode
SWAP_KEY = "tiered_offload.swap"  # Model-Level Swap


class TimelineLease:
    """Whether an open panel wants a picture of the next layerwise runs (``device/timeline.py``).

    A lease, not a switch: the panel renews it while it is open, and it ends on its own when no
    panel has renewed it for ``seconds``, so a browser tab closed without a word does not leave
    recording on. The engine records nothing while it is off; a run decides when it begins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until = 0.0  # time.monotonic() at which the lease ends

    def renew(self, seconds: float) -> None:
        with self._lock:
            self._until = max(self._until, time.monotonic() + seconds)

    def end(self) -> None:
        with self._lock:
            self._until = 0.0

    def wanted(self) -> bool:
        with self._lock:
            return time.monotonic() < self._until


class LayerwiseRegistry:
    """Every model Apply Layerwise Offload handles, one entry per diffusion nn.Module (shared by
    all its clones): the engine's sessions and, on Dynamic VRAM models, the cooperations in which
    core streams in the node's order. Listeners hear each sampling run's report."""

    def __init__(self) -> None:
        self.sessions: PerModule[Any] = PerModule()
        self.cooperations: PerModule[Any] = PerModule()
        self.timeline = TimelineLease()  # whether the sessions' runs record their picture
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def subscribe(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call fn(report) after every sampling run of a layerwise-offloaded model."""
        self._listeners.append(fn)

    def publish_report(self, report: dict[str, Any]) -> None:
        for fn in list(self._listeners):
            try:
                fn(report)
            except Exception:
                log.exception("[tiered offload] Apply Layerwise Offload: report listener failed")

    def discard(self, diffusion_model: torch.nn.Module) -> Any:
        """Close this model's engine (its pinned pack is freed, its tensors handed back)."""
        return self.sessions.discard(diffusion_model)

    def disk_bytes(self, diffusion_model: torch.nn.Module | None) -> int:
        """Bytes of this model's blocks that only the disk holds now (0 without disk streaming)."""
        session = self.sessions.get(diffusion_model) if diffusion_model is not None else None
        return session.disk_bytes() if session is not None else 0

    def host_store(self, diffusion_model: torch.nn.Module | None) -> dict[str, Any] | None:
        """Whether this model's blocks are in a shared host store (its bytes, how many processes
        map it), None without a session."""
        session = self.sessions.get(diffusion_model) if diffusion_model is not None else None
        return session.host_store() if session is not None else None

    def is_active(self, diffusion_model: torch.nn.Module) -> bool:
        """Whether the engine holds this model's blocks right now (a sampling run is on)."""
        session = self.sessions.get(diffusion_model)
        return session is not None and session.active

    def report(self) -> list[dict[str, Any]]:
        """The engine's models, then the Dynamic VRAM models core streams in the node's order."""
        return [s.report() for s in self.sessions.values()] + \
            [c.report() for c in self.cooperations.values()]


class PromptHolds:
    """Which of the tier manager's models each running prompt holds, released when it ends.

    At prompt start every Tiered loader in the prompt's graph is held, before any node runs, so
    a model is never evicted between the prompt's start and its use, even when the loader's
    output comes from ComfyUI's cache. The loader also holds when it runs, in case the graph
    could not be read.
    """

    def __init__(self, manager: TierManager) -> None:
        self._manager = manager
        self._lock = threading.Lock()
        self._held: dict[str | None, list[str]] = {}

    def hold(self, key: str, prompt_id: str | None) -> None:
        with self._lock:
            held = self._held.setdefault(prompt_id, [])
            if key in held:
                return
            held.append(key)
        try:
            self._manager.acquire(key, to=Tier.RAM)
        except Exception:
            with self._lock:
                self._held[prompt_id].remove(key)
            raise

    def release_prompt(self, prompt_id: str | None) -> None:
        with self._lock:
            keys = self._held.pop(prompt_id, [])
        for key in keys:
            self._manager.release(key)


LAYERWISE = LayerwiseRegistry()
# A model's nn.Module -> the file core read it from, with the file's version and the loader's
# options (load_records.py): what names its shared host store. Weak: it goes with the model.
MODEL_FILES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()
# The file a model's loaded tensors were mapped from when it was loaded (ComfyUI-GGUF hands core
# views of its map of the file), as {"files": [[path, version]]}: what lets disk streaming read its
# blocks in place after a run that moved them out of the map. Never names a shared host store.
MAPPED_FILES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()
SWAP_MEMBERS: PerModule[Any] = PerModule()  # root nn.Module -> Model-Level Swap's master
# The dynamic model's nn.Module -> the classic model the engine mode runs on (a twin, or core's
# reloaded copy), kept for every later clone of it.
DYNAMIC_DELEGATES: PerModule[Any] = PerModule()
MANAGER = TierManager()
PROMPT_HOLDS = PromptHolds(MANAGER)
