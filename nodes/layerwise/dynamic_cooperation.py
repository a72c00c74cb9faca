"""Apply Layerwise Offload's `auto` mode on a model core runs with Dynamic VRAM (0.15 and later).

Core streams such a model itself, and the node only decides the order in which core gives its
weights VRAM: the resident blocks first, then everything outside the blocks, then the streamed
blocks in run order (`get_dynamic_vram__units`, set as an object patch on the node's clone, so
core applies it at its load and restores the model after). Under pressure comfy-aimdo keeps the
lowest addresses and gives up the highest, so that order is the order of residency.

Core fixes a weight's place at the model's first dynamic load, though (vbar_layout.py), so an
order asked for later does nothing by itself: a model sampled before the node ran, or with other
settings, keeps the old one. So at every sampling run, before core's load, the node:
1. plans the resident blocks: the node's count, or as many as the VRAM free once core has made
   room allows (core's own room-making for a dynamic load, plus what comfy-aimdo would evict from
   dynamic models for this one), kept while the settings stay the same; left to `auto`, once a
   run has been timed, the blocks its measurements choose within that room, checked on the next
   run and rolled back if slower (offload_core/layerwise/residency_order.py); a count the user
   fixed stays, its first run timed the same way to say what auto would have kept and the
   difference a step;
2. reads the layout core holds, and where it is not the plan's, hands it back to core
   (`vbar_layout.reset`) so that this load lays it out afresh; where that cannot be done safely it
   says so, plainly, with the way to reload the model;
3. after core's load reads the layout again: whether the node's order is in force, and after the
   run which blocks comfy-aimdo holds resident and which it streams (`/offload/layerwise`, the
   panel).

The node adds no streamer, stream or copy of its own here. While the order is measured, marks
(events on the current stream, no wait) time the blocks of a run's first calls; the hooks that
record them come off after those calls, and once the order holds a run carries none. Where core
prefetches a model's blocks (`comfy/model_prefetch.py`, one block ahead, in the model loops that
call it), the order is what feeds that queue: resident blocks are in VRAM when their turn comes
and the streamed ones are fetched one ahead in run order. Where it does not, core copies each
streamed weight when its layer runs; the order is all the node changes.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

import comfy.model_management

from ...offload_core.device.link import copy_rate
from ...offload_core.device.residency import fit_budget, plan_residency, slot_count, spread_evenly
from ...offload_core.layerwise.measure import CallTimer
from ...offload_core.layerwise.residency_order import CORE_PREFETCH, OrderTuner
from ...offload_core.layerwise.tuning import AUTO
from ..core import state
from ..core.models import is_dynamic, loaded_entries
from ..core.state import DYNAMIC_ORDER_KEY
from . import block_budget, sampling_wrappers, vbar_layout
from .dynamic_vram import UNITS_ATTR, BlockPlan, binary_bytes, plan_blocks

log = logging.getLogger(__name__)

RELOAD_HINT = ("takes effect after the model is reloaded: unload it and clear ComfyUI's cache "
               "(POST /free {\"unload_models\": true, \"free_memory\": true}, or ComfyUI's \"Unload "
               "Models and Execution Cache\"), then run again")


@dataclass(frozen=True)
class OrderSettings:
    """What the node was asked for: a count, or a budget (None: what the card has free)."""

    resident: int | None
    budget_bytes: int | None
    prefetch: int

    @classmethod
    def from_streamer_kwargs(cls, kwargs: dict[str, Any], budget_bytes: int | None) -> "OrderSettings":
        """The node's settings; resident blocks left to auto are ``budget_bytes``' (the node's
        vram_budget_gb; with a fixed count, what auto would have had), and a prefetch left to auto
        counts as core's own, one block ahead, for the room streaming takes (the order's
        measurements weigh the same room)."""
        resident, prefetch = kwargs.get("resident"), kwargs["prefetch"]
        return cls(None if resident == AUTO else resident, budget_bytes,
                   CORE_PREFETCH if prefetch == AUTO else prefetch)


@dataclass(frozen=True)
class Order:
    """Resident blocks (first in VRAM) and streamed blocks (last, in run order) for one load."""

    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    settings: OrderSettings
    budget_bytes: int | None = None


def core_prefetch(diffusion_model: torch.nn.Module) -> bool | None:
    """Whether core prefetches this model's blocks itself: None where this ComfyUI has no block
    prefetch at all (`comfy.model_prefetch.prefetch_queue_pop`, newer than 0.14), else whether the
    model's own code calls it (core adds it family by family)."""
    try:
        prefetch = importlib.import_module("comfy.model_prefetch")
    except ImportError:
        return None
    if not callable(getattr(prefetch, "prefetch_queue_pop", None)):
        return None
    for cls in type(diffusion_model).__mro__:
        if cls.__module__.startswith("torch."):
            break
        try:
            if "prefetch_queue_pop(" in inspect.getsource(cls):
                return True
        except (OSError, TypeError):
            continue
    return False


def prefetch_statement(model_class: str, prefetch: bool | None) -> str:
    if prefetch:
        return (f"core prefetches {model_class}'s blocks one ahead in run order: the resident "
                "blocks are in VRAM when their turn comes and the streamed ones are fetched one "
                "ahead; the node adds no streamer of its own")
    where = ("this ComfyUI has no block prefetch" if prefetch is None
             else f"this ComfyUI does not prefetch {model_class}'s blocks")
    return (f"{where}: core copies each streamed weight when its layer runs, on its own offload "
            "streams; the node only sets the VRAM order and adds no streamer or copy, so "
            "nothing competes with core's copies")


class Cooperation:
    """The node's order for one diffusion model (one nn.Module shared by its clones), and what
    core made of it."""

    def __init__(self, diffusion_model: torch.nn.Module, plan: BlockPlan) -> None:
        self._model = weakref.ref(diffusion_model)
        self.module_id = id(diffusion_model)
        self.model_class = plan.model_class
        self.layout_name = plan.layout
        self.paths = plan.paths
        self.block_bytes = [comfy.model_management.module_size(b) for b in self.blocks()]
        self.rest_bytes = max(0, comfy.model_management.module_size(diffusion_model)
                              - sum(self.block_bytes))
        self.prefetch = core_prefetch(diffusion_model)
        self.order: Order | None = None
        self.laid_out: Order | None = None  # the order core's layout was last made in for the node
        self.served = False  # core asked for the units during the current load
        self.in_force: bool | None = None
        self.message: str | None = None
        self.relayouts = 0
        self.released_bytes = 0
        self.runs = 0
        self.device = ""
        self.finished_at: float | None = None
        self.spans: dict[str, Any] | None = None
        self.core_states: list[str] | None = None
        # `auto` resident blocks: the order measured and checked run by run (residency_order.py)
        self.tuner: OrderTuner | None = None
        self.tuner_for: tuple[OrderSettings, str] | None = None
        self.timer: CallTimer | None = None
        self.run_key: tuple | None = None
        self.link_bytes_per_ms: float | None = None

    def blocks(self) -> list[torch.nn.Module]:
        model = self._model()
        return [] if model is None else [model.get_submodule(p) for p in self.paths]

    def units(self) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
        """`get_dynamic_vram__units`: the resident blocks first, the streamed blocks last."""
        blocks = self.blocks()
        if not blocks or self.order is None:
            return [], []
        self.served = True
        return [blocks[i] for i in self.order.resident], [blocks[i] for i in self.order.streamed]

    # --------------------------------------------------------------------------------- a run
    def before_load(self, patcher, settings: OrderSettings, noise_shape, conds) -> None:
        """Plan this run's order and make sure core's load will lay it out (or say why not)."""
        device = patcher.load_device
        self.device = str(device)
        self.served = False
        self.run_key = tuple(int(d) for d in noise_shape) if noise_shape is not None else ()
        blocks = self.blocks()
        layout = vbar_layout.read(patcher.model, device, blocks)
        kept = self.laid_out
        if (settings.resident is None and kept is not None and kept.settings == settings
                and layout is not None and layout.in_order(kept.resident, kept.streamed)):
            # A budget's plan stands while its settings do: laying the model out again for a
            # block more or less would drop all of its VRAM pages for that margin.
            self.order = kept
        else:
            self.order = self._plan(patcher, settings, noise_shape, conds)
        if settings.resident is None:
            self.order = self._measured_order(settings, device)
        else:
            self._advise(patcher, settings, noise_shape, conds, device)
        if layout is None or layout.empty() or layout.in_order(self.order.resident,
                                                               self.order.streamed):
            self.message = None
            return
        ours = kept is not None and layout.in_order(kept.resident, kept.streamed)
        earlier = ("core's own order" if not ours else "the node's, with other settings"
                   if kept.settings != settings else "the node's, before this run's measurements")
        loaded = _vbar_loaded(patcher.model, device)
        reason = vbar_layout.reset(patcher.model, device)
        if reason is None:
            self.relayouts += 1
            self.released_bytes = loaded
            self.message = None
            log.info("[tiered offload] Apply Layerwise Offload (auto): %s's VRAM order was fixed by an earlier load "
                     "(%s); handed back to core, which lays it out in the node's order on this "
                     "load: %s of its VRAM pages released, copied in again from RAM as they are "
                     "used", self.model_class, earlier, binary_bytes(loaded))
        else:
            count = len(self.order.resident)
            self.message = (f"{self.model_class}: order already fixed by an earlier load "
                            f"({earlier}); the node's order ({count} resident "
                            f"block{'' if count == 1 else 's'} first) {RELOAD_HINT}. Not laid out "
                            f"again now: {reason}.")
            log.warning("[tiered offload] Apply Layerwise Offload (auto): %s", self.message)

    def _plan(self, patcher, settings: OrderSettings, noise_shape, conds) -> Order:
        n = len(self.block_bytes)
        if settings.resident is not None:
            resident = spread_evenly(n, settings.resident)
            budget = None
        else:
            budget = self._budget(patcher, settings, noise_shape, conds)
            resident = self._rule_order(budget, settings.prefetch)
            log.info("[tiered offload] Apply Layerwise Offload (auto): %s: %d of %d blocks resident first, from %s "
                     "of VRAM for its blocks", self.model_class, len(resident), n,
                     binary_bytes(budget or 0))
        streamed = [i for i in range(n) if i not in set(resident)]
        return Order(tuple(resident), tuple(streamed), settings, budget)

    def _rule_order(self, budget: int | None, prefetch: int) -> list[int]:
        """As many blocks as ``budget`` holds beside streaming's room, spread evenly."""
        return [] if budget is None else plan_residency(self.block_bytes, 0, resident=None,
                                                        vram_budget_bytes=budget, prefetch=prefetch)

    def _advise(self, patcher, settings: OrderSettings, noise_shape, conds, device: torch.device) -> None:
        """A count the user fixed stays as it is; the first run of each latent shape is measured
        all the same, so that the report can say what auto would have kept first, with the VRAM
        auto would have had, and what that would save or cost a step."""
        self._tuner_for(settings, device, fixed=True)
        budget, rule = None, []
        if self.tuner.wants_timing(self.run_key):
            auto = replace(settings, resident=None)
            budget = self._budget(patcher, auto, noise_shape, conds, say=False)
            rule = self._rule_order(budget, auto.prefetch)
        self.tuner.advise(self.run_key, budget, rule, self.order.resident)

    def _tuner_for(self, settings: OrderSettings, device: torch.device, fixed: bool) -> None:
        """The tuner of these settings on this device (a new one, measuring afresh, when they
        change: a fixed count and auto never share one, their settings differing)."""
        if self.tuner is None or self.tuner_for != (settings, str(device)):
            asynchronous = torch.device(device).type == "cuda" and bool(self.prefetch)
            self.tuner = OrderTuner(self.block_bytes, asynchronous=asynchronous, fixed=fixed)
            self.tuner_for = (settings, str(device))

    def _measured_order(self, settings: OrderSettings, device: torch.device) -> Order:
        """The budget's order, or the one the run's measurements chose within the same budget."""
        order = self.order
        self._tuner_for(settings, device, fixed=False)
        resident = self.tuner.order(self.run_key, order.budget_bytes, order.resident)
        if resident == tuple(sorted(order.resident)):
            return order
        report = self.tuner.report() or {}
        log.info("[tiered offload] Apply Layerwise Offload (auto): %s: measured order, block%s %s first in VRAM (%s)",
                 self.model_class, "" if len(resident) == 1 else "s",
                 ", ".join(map(str, resident)) or "none", report.get("reason"))
        chosen = set(resident)
        return Order(resident, tuple(i for i in range(len(self.block_bytes)) if i not in chosen),
                     settings, order.budget_bytes)

    def start_timing(self, patcher) -> None:
        """Mark the blocks of this run's first calls where the order is still measured: once the
        tuner holds an order, a run carries no hook of the node's."""
        if self.tuner is None or self.timer is not None or not self.tuner.wants_timing(self.run_key):
            return
        model = self._model()
        if model is not None:
            self.timer = CallTimer(patcher.load_device, model, self.blocks())

    def _take_timing(self, patcher) -> None:
        """The run's figures into the tuner (the hooks come off first, whatever happens)."""
        timer, self.timer = self.timer, None
        if timer is None:
            return
        timed = timer.close()
        if timed is None or self.tuner is None or self.order is None:
            return
        if self.link_bytes_per_ms is None:
            self.link_bytes_per_ms = copy_rate(patcher.load_device)
        if not self.link_bytes_per_ms:
            return
        states = self.core_states
        streamed = ([i for i, s in enumerate(states) if s != "resident"] if states
                    else list(self.order.streamed))
        spans, period_ms = timed
        self.tuner.measured(self.run_key, spans, period_ms, self.link_bytes_per_ms, streamed)

    def _budget(self, patcher, settings: OrderSettings, noise_shape, conds, say: bool = True) -> int | None:
        """Bytes of VRAM for resident blocks this run, or None when not even streaming fits
        (every block then goes last; core streams them all). ``say``: log what the budget does to
        this run (not where it only sizes what auto would have done)."""
        least = slot_count(settings.prefetch, len(self.block_bytes)) * max(self.block_bytes)
        most = sum(self.block_bytes)
        available = room_for_blocks(patcher, self.rest_bytes, least, noise_shape, conds)
        budget = fit_budget(settings.budget_bytes, available, least, most)
        if not say:
            return budget
        if budget is None:
            log.info("[tiered offload] Apply Layerwise Offload (auto): %s: %s left for its blocks, less than the "
                     "%s that streaming them takes; no block is kept resident, core streams them "
                     "all", self.model_class, binary_bytes(max(available, 0)), binary_bytes(least))
        elif settings.budget_bytes is not None and budget < settings.budget_bytes:
            log.info("[tiered offload] Apply Layerwise Offload (auto): %s: vram_budget_gb lowered to %s, what is "
                     "left for its blocks", self.model_class, binary_bytes(budget))
        return budget

    def after_load(self, patcher) -> None:
        """Whether core laid the model out in the node's order (None: it cannot be read)."""
        layout = vbar_layout.read(patcher.model, patcher.load_device, self.blocks())
        if layout is None or layout.empty() or self.order is None:
            self.in_force, self.spans = None, None
            return
        self.in_force = layout.in_order(self.order.resident, self.order.streamed)
        if self.in_force and self.served:
            self.laid_out = self.order
        self.spans = {"blocks": layout.block_spans(), "rest": layout.rest_span()}

    def after_run(self, patcher) -> None:
        try:
            layout = vbar_layout.read(patcher.model, patcher.load_device, self.blocks())
            self.core_states = (vbar_layout.residency(patcher.model, patcher.load_device, layout)
                                if layout is not None else None)
        finally:
            self._take_timing(patcher)
        self.runs += 1
        self.finished_at = time.time()

    # ------------------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        order = self.order
        planned = ["resident" if order is not None and i in order.resident else "streamed"
                   for i in range(len(self.block_bytes))]
        states = self.core_states or planned
        in_force = self.in_force
        return {
            "module_id": self.module_id,
            "model_class": self.model_class,
            "layout": self.layout_name,
            "device": self.device,
            "blocks": len(self.block_bytes),
            "block_bytes": sum(self.block_bytes),
            "rest_bytes": self.rest_bytes,
            "resident_indices": list(order.resident) if order else [],
            "streamed_indices": list(order.streamed) if order else [],
            "block_states": states,
            "budget_bytes": order.budget_bytes if order else None,
            "bound_bytes": None,
            "granularity": "block",
            "auto_settings": ["resident"] if self.tuner is not None and not self.tuner.fixed else [],
            "tuning": self.tuner.report() if self.tuner is not None else None,
            "active": False,
            "runs": self.runs,
            "finished_at": self.finished_at,
            "telemetry": None,
            "dynamic_vram": {
                "path": "core streams",
                "order": ("not loaded yet" if in_force is None and self.runs == 0 else
                          "unknown" if in_force is None else
                          "in force" if in_force else "fixed by an earlier load"),
                "order_in_force": in_force,
                "message": self.message,
                "relayouts": self.relayouts,
                "released_bytes": self.released_bytes,
                "core_resident_blocks": ([i for i, s in enumerate(self.core_states) if s == "resident"]
                                         if self.core_states else None),
                "core_streamed_blocks": ([i for i, s in enumerate(self.core_states) if s != "resident"]
                                         if self.core_states else None),
                "residency_source": "vbar" if self.core_states else "plan",
                "vbar_spans": self.spans,
                "core_prefetch": self.prefetch,
                "streaming": prefetch_statement(self.model_class, self.prefetch),
            },
        }

    def close(self) -> None:
        pass


def _vbar_loaded(model: torch.nn.Module, device: torch.device) -> int:
    vbar = vbar_layout.model_vbar(model, device)
    probe = getattr(vbar, "loaded_size", None)
    try:
        return int(probe()) if callable(probe) else 0
    except Exception:  # a figure for a log line
        return 0


def room_for_blocks(patcher, rest_bytes: int, least: int, noise_shape, conds) -> int:
    """VRAM for the model's blocks this run, once core has made room as for a dynamic load.

    Core's dynamic load unloads other (classic) models to make room, never dynamic ones:
    comfy-aimdo evicts their pages on demand, the least recently loaded first, and this model is
    about to become the most recent. So what is free, plus what dynamic models hold on the
    device (this one included), less the weights outside the blocks and what core keeps free
    beside the weights (`block_budget.kept_beside_weights`, as its load computes it), is what
    the blocks can have.
    """
    mm = comfy.model_management
    device = patcher.load_device
    kept, _ = block_budget.kept_beside_weights(patcher, noise_shape, conds)
    others = rest_bytes + int(kept)
    keep = loaded_entries(patcher.model)
    if "for_dynamic" in inspect.signature(mm.free_memory).parameters:
        mm.free_memory(least + others, device, keep_loaded=keep, for_dynamic=True)
    free = int(mm.get_free_memory(device))
    evictable = 0
    for lm in list(mm.current_loaded_models):
        if lm.model is not None and lm.device == device and is_dynamic(lm.model):
            evictable += int(lm.model.loaded_size())
    return free + evictable - int(others)


def cooperate(model, streamer_kwargs: dict[str, Any], budget_bytes: int | None):
    """`auto` on a dynamic model: a clone on which core streams in the node's order.
    ``budget_bytes``: the node's vram_budget_gb in bytes (None: what the card has free)."""
    plan = plan_blocks(model, streamer_kwargs)
    patcher = model.clone()
    # The class's own method; an instance attribute may be another clone's patch still applied.
    if getattr(type(model.model), UNITS_ATTR, None) is not None:
        log.info("[tiered offload] Apply Layerwise Offload (auto): %s defines its own Dynamic VRAM units; core "
                 "streams it in its own order, the node changes nothing", plan.model_class)
        return patcher
    settings = OrderSettings.from_streamer_kwargs(streamer_kwargs, budget_bytes)
    diffusion_model = patcher.get_model_object("diffusion_model")
    coop = state.LAYERWISE.cooperations.get_or_create(diffusion_model, lambda: Cooperation(diffusion_model, plan))
    if coop.order is None and settings.resident is not None:
        coop.order = Order(plan.resident, plan.streamed, settings)
    patcher.add_object_patch(UNITS_ATTR, coop.units)

    def prepare_sampling(executor, model_patcher, noise_shape=None, conds=None, *args, **kwargs):
        live = state.LAYERWISE.cooperations.get(model_patcher.get_model_object("diffusion_model"))
        if live is not None and is_dynamic(model_patcher):
            try:
                live.before_load(model_patcher, settings, noise_shape, conds)
            except Exception:  # the order is advice: core loads the model whatever happens here
                log.exception("[tiered offload] Apply Layerwise Offload (auto): planning the order failed; core "
                              "loads the model in the order it holds")
        result = executor(model_patcher, noise_shape, conds, *args, **kwargs)
        if live is not None:
            try:
                live.after_load(model_patcher)
                live.start_timing(model_patcher)
            except Exception:
                log.exception("[tiered offload] Apply Layerwise Offload (auto): reading the order back failed")
        return result

    def outer_sample(executor, *args, **kwargs):
        current = executor.class_obj.model_patcher
        try:
            return executor(*args, **kwargs)
        finally:
            live = state.LAYERWISE.cooperations.get(current.get_model_object("diffusion_model"))
            if live is not None:
                try:
                    live.after_run(current)
                    state.LAYERWISE.publish_report(live.report())
                except Exception:
                    log.exception("[tiered offload] Apply Layerwise Offload (auto): the run's report failed")

    sampling_wrappers.install(patcher, DYNAMIC_ORDER_KEY, around_load=prepare_sampling, around_run=outer_sample)
    what = (f"{settings.resident} resident block{'s' if settings.resident != 1 else ''}"
            if settings.resident is not None else
            f"the resident blocks a {binary_bytes(settings.budget_bytes)} budget allows"
            if settings.budget_bytes else "as many resident blocks as the VRAM free at each run allows")
    log.info("[tiered offload] Apply Layerwise Offload (auto): %s runs with Dynamic VRAM, so core streams it; the "
             "node orders its VRAM, %s first and the streamed blocks last, checked at every "
             "load; %s", plan.model_class, what, prefetch_statement(plan.model_class, coop.prefetch))
    return patcher

