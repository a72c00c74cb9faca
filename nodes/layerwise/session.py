"""Apply Layerwise Offload's engine session: the streamer bound to one diffusion model, and its run.

How it cooperates with core's ModelPatcher (classic, as in 0.3.75); the node (node.py) calls
`begin` and `account` from its PREPARE_SAMPLING wrapper and `end` from its OUTER_SAMPLE wrapper:
- A PREPARE_SAMPLING wrapper, inside the sampler's OUTER_SAMPLE, first decides the engine's
  device budget (what is free once core has made room for the rest of the run), then hands the
  blocks to the engine *before* core's `load_models_gpu`. The engine releases the streamed
  tensors and hides the resident ones, so core sees those modules as empty: it never loads them
  first, never merges a LoRA into them and counts only what it really placed. After core's load
  the model's loaded-weight figure gets the engine's device bytes (resident blocks and slots), so
  core plans the VAE and text encoders with true numbers; its size figure is the model less its
  blocks plus the engine's bound, so core never unloads the model to find room for blocks it
  does not load.
- LoRA and other weight patches are merged with core's own arithmetic into the device copies:
  the host pack holds base weights only (one host copy, LoRA or not).
- After sampling, and whatever ends it (an error, an interrupt during packing or sampling, a
  refusal), an OUTER_SAMPLE wrapper puts every tensor back and tells core the blocks hold base
  weights again, so a later prompt without this node runs the model exactly as core would. The
  pinned pack is kept for the next run and freed when the model is freed.
- The engine hooks the block modules themselves, so dit block-replace patches of other nodes
  (TeaCache and the like) keep working and chain naturally: they call the original block.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import asdict
from typing import Any

import torch

import comfy.utils

from ...offload_core.blocks.discovery import find_blocks
from ...offload_core.device.telemetry import overlap_efficiency
from ...offload_core.disk.host_cache import CacheTooSmallError
from ...offload_core.disk.in_place import ModelFileChanged
from ...offload_core.layerwise.streamer import LayerwiseStreamer
from ..core import host_moves, host_sharing
from ..core.read_back import read_back_patches
from ..core.state import LAYERWISE, LAYERWISE_KEY
from . import (block_budget, comfy_weights, compile_policy, compiled_models, dynamic_vram, engine_setup,
               granularity, hook_weights)
from .settings import LayerwiseSettings

log = logging.getLogger(__name__)


class LayerwiseSession:
    """The engine bound to one diffusion model (one nn.Module shared by all its clones)."""

    def __init__(self, patcher, settings: LayerwiseSettings) -> None:
        diffusion_model = compiled_models.diffusion_module(patcher)
        found = find_blocks(diffusion_model)
        self.model_class = type(diffusion_model).__name__
        self.layout = found.layout
        self.prefixes = tuple(f"diffusion_model.{p}" for p in found.paths)
        self.blocks = found.blocks
        if settings.resident_blocks > len(self.blocks):
            raise ValueError(
                f"Apply Layerwise Offload: resident_blocks={settings.resident_blocks}, but "
                f"{self.model_class} has {len(self.blocks)} blocks; use at most "
                f"{len(self.blocks)}, or -1 (auto: the run's own timings choose, within vram_budget_gb)")
        self.block_bytes, self.rest_bytes = engine_setup.weights(patcher.model, self.blocks)
        self.device = patcher.load_device
        self.settings = settings
        self.share, self.share_why = engine_setup.host_share(patcher.model, settings)
        self.model_file = engine_setup.find_model_file(settings, patcher.model, self.blocks, self.prefixes,
                                                       self.model_class)
        self.granularity, self.granularity_why = granularity.choose(self.blocks, settings)
        self.streamer = self._make_streamer()
        engine_setup.refuse_budget_below_streaming(settings, self.streamer.bound_range()[0], self.model_class)
        self.module_id = id(diffusion_model)
        self.accounted_bytes = 0
        self.budget_bytes: int | None = None
        self.run_pending = False
        self.run_steps: int | None = None  # the pending run's sampler steps (sampler_steps.py)
        self.begun = False
        self.active = False
        self.started = 0.0
        self.attach_seconds = 0.0
        self.runs = 0
        self.finished_at: float | None = None  # unix time the last sampling run ended
        self.last_run: dict[str, Any] | None = None
        self.last_timeline: dict[str, Any] | None = None  # the last run's picture, if recorded
        self.core_view: dict[str, int] | None = None
        self.block_patches: comfy_weights.BlockPatches | None = None  # this run's, with patches
        self.streamed_hooks: hook_weights.StreamedHooks | None = None  # this run's, with hook LoRAs
        # Core's unload of the model (without this node) moves it to the host with its root's
        # `.to()`, and a partial unload under memory pressure module by module: the kept pack
        # takes the moved module's tensors back first, so nothing is copied back.
        self.model_ref = weakref.ref(patcher.model)  # core's BaseModel: what load records know
        for module in self._watched():
            host_moves.watch(module, LAYERWISE_KEY, self._reclaim_before_host_move)

    def _make_streamer(self) -> LayerwiseStreamer:
        return engine_setup.make_streamer(self.blocks, self.device, self.settings, self.granularity,
                                          self.share, self.model_file)

    def begin(self, patcher, noise_shape=None, conds=None, model_options=None,
              choice: compile_policy.NodeChoice = compile_policy.NodeChoice()) -> None:
        """Plan, hand the blocks over from core, pack and attach. Called before core's load; if
        anything here raises, `end()` (from the sampler's OUTER_SAMPLE) gives core its model back.
        ``choice``: what the node that set up this run chose about compiles."""
        self.run_pending = False
        self._close_block_patches()
        host_sharing.check_unchanged(self.share, "Apply Layerwise Offload")
        keys = [key for prefix, block in zip(self.prefixes, self.blocks) for key in comfy_weights.block_keys(prefix, block)]
        merged = comfy_weights.merged_keys(patcher, self.prefixes, self.blocks)
        # A merge's patches are another model's weights, released if an engine streams that model
        # from its file: the merges into these blocks read them.
        read_back_patches(patcher.patches)
        root = compiled_models.diffusion_module(patcher)
        self.streamed_hooks = hook_weights.StreamedHooks.for_keys(patcher, root, keys)
        merge_bytes = 0
        if merged:
            # The patches' tensors go to the device with each block copy (no host wait in a
            # merge); the device holds one block's at a time, beside the merge's workspace.
            self.block_patches = comfy_weights.BlockPatches(patcher, self.prefixes, self.blocks,
                                                            merged, self.device)
            merge_bytes = self.block_patches.device_bytes + comfy_weights.merge_workspace_bytes(
                patcher, self.prefixes, self.blocks)
        self._plan(patcher, noise_shape, conds, model_options, merge_bytes)
        # A compile this run cannot keep is refused here, before anything moves
        # (compile_policy.py says which and why); resident blocks may be compiled any way.
        streamed = sorted({self.streamer.units[i].block for i in self.streamer.streamed_indices})
        compiled = compile_policy.settle(
            patcher, model_options, choice, model_class=self.model_class, blocks=list(self.blocks),
            prefixes=list(self.prefixes), streamed=streamed,
            resident_blocks=self.settings.resident_blocks, granularity=self.granularity,
            device=self.device)
        self.begun = True
        if hasattr(patcher, "size"):
            # While core loads, the model it sees is the part outside the blocks, which it loads.
            patcher.size = self.rest_bytes
        comfy_weights.hand_over_from_core(patcher, self.prefixes, self.blocks, self.streamer.reclaim)
        transform = comfy_weights.lora_transform(patcher, self.prefixes, merged, self.block_patches,
                                                 self.streamed_hooks) if merged or self.streamed_hooks else None
        self.streamer.reset_figures()
        # A picture of the run only while a panel asks for it: off, the hot path pays nothing.
        self.streamer.record_timeline(LAYERWISE.timeline.wanted())
        self.streamer.run_length(self.run_steps)
        start = time.perf_counter()
        progress = comfy.utils.ProgressBar(len(self.streamer.units) + 1)
        try:
            # The model's call is one pass over the blocks: auto settings are measured and
            # planned at its calls. Not with hook LoRAs on the blocks: core patches the resident
            # ones in place while it samples, which a new setting would upload afresh.
            self.streamer.attach(transform=transform,
                                 progress=lambda done, total: progress.update_absolute(done, total),
                                 compiled=compiled, root=None if self.streamed_hooks else root)
        except CacheTooSmallError as e:
            # Auto started from the most the cache holds: only what it does not own is the user's.
            remedies = "Raise host_cache_gb" if self.settings.auto_prefetch else "Raise host_cache_gb or lower prefetch"
            if self.granularity != "phase":
                remedies += ", or use granularity 'phase' (smaller units)"
            raise ValueError(
                f"Apply Layerwise Offload: host_cache_gb={self.settings.host_cache_gb:g} GiB is too "
                f"small for {self.model_class}: {e}. {remedies}.") from None
        except ModelFileChanged as e:
            raise RuntimeError(f"Apply Layerwise Offload: {e}") from None
        # Until account(), core's load() sees every block as empty: it neither counts nor moves
        # them, and it merges no LoRA into resident blocks that already carry the engine's merge.
        self.streamer.conceal_resident()
        self.active = True
        self.attach_seconds = time.perf_counter() - start
        self.started = time.perf_counter()

    def _plan(self, patcher, noise_shape, conds, model_options, merge_bytes: int) -> None:
        """Resident blocks for this run: the node's count, or the most its budget (or, in auto,
        the card) allows. With the count fixed, that budget is still what the panel's "auto would
        choose" is weighed in, so that it is what a run left to auto would do."""
        fixed = self.settings.resident_blocks >= 0
        least, most = self.streamer.bound_range()
        requested = self.settings.requested_budget
        try:
            if self.device.type == "cpu":
                # The "device" is host RAM: nothing to clamp to. Auto may keep every block resident.
                budget = most if requested is None else requested
            else:
                wanted = most if requested is None else min(requested, most)
                room = block_budget.device_room(patcher, self.rest_bytes, wanted, noise_shape, conds,
                                                model_options, merge_bytes)
                if not fixed and self._fit_granularity(room.for_blocks):
                    least, most = self.streamer.bound_range()
                budget = block_budget.choose_budget(self.model_class, requested, room, least, most)
        except ValueError:
            if not fixed:
                raise
            budget = None  # auto would not fit where the fixed count does: no advice to weigh
        if fixed:
            self.streamer.advise_within(budget)
            self.budget_bytes = None
            return
        self.streamer.replan(vram_budget_bytes=budget)
        self.budget_bytes = budget

    def _fit_granularity(self, room: int) -> bool:
        """Granularity auto: phases from this run on if only phases fit the room left for the
        blocks (the pack is made again, once). Whether the granularity changed."""
        chosen, why = granularity.choose(self.blocks, self.settings, room)
        if chosen == self.granularity:
            return False
        log.info("[tiered offload] Apply Layerwise Offload: %s streams as %s from now on (%s)", self.model_class,
                 chosen, why)
        self.streamer.close()
        self.granularity, self.granularity_why = chosen, why
        self.streamer = self._make_streamer()
        return True

    def account(self, patcher) -> None:
        """Make core's figures for the model true, once core has loaded the rest.

        Core counted none of the concealed blocks, except after a full load, where it counts
        the size it was given. Its own share is at most the model less the blocks; the engine's
        device bytes (resident blocks, slots) come on top of that, in the loaded figure and in
        the size, so that between runs the model's offloaded part is exactly what the engine
        will take again.
        """
        self.streamer.reveal_resident()
        comfy_weights.settle_after_core_load(self.blocks)
        if self.streamed_hooks is not None:  # what core cannot see now, the engine hooks itself
            self.streamed_hooks.take_unseen(self.streamer.refresh_transform)
        model = patcher.model
        self.accounted_bytes = self.streamer.bound_bytes()
        self.streamer.hold_within(self.accounted_bytes)  # a plan within the run keeps core's figures true
        model.model_loaded_weight_memory = min(model.model_loaded_weight_memory,
                                               self.rest_bytes) + self.accounted_bytes
        if hasattr(patcher, "size"):
            patcher.size = self.rest_bytes + self.accounted_bytes

    def step_done(self) -> None:
        """The sampler finished a step of this session's run."""
        if self.active:
            self.streamer.step_done()

    def end(self, patcher) -> None:
        """Give everything back to core, however the run ended. Safe to call more than once."""
        self.run_pending = False
        self.run_steps = None
        if not self.begun:
            self._close_block_patches()  # a refusal while planning
            return
        try:
            if self.active:
                self.last_run = run_figures(self.streamer.figures(wait=True),
                                            time.perf_counter() - self.started,
                                            self.attach_seconds, self.device)
                self.last_timeline = engine_setup.run_timeline(self.streamer, self.model_class)
                self.runs += 1
                self.finished_at = time.time()
        finally:
            self.active = False
            self.begun = False
            try:
                self._detach()
            finally:
                self._close_block_patches()
                model = patcher.model
                model.model_loaded_weight_memory = max(
                    0, model.model_loaded_weight_memory - self.accounted_bytes)
                self.accounted_bytes = 0
                comfy_weights.return_to_core(patcher, self.prefixes, self.blocks)
                self.core_view = {"model_size": int(patcher.model_size()),
                                  "loaded": int(model.model_loaded_weight_memory)}

    def _detach(self) -> None:
        """Give the blocks back; fail the run, naming the file, if the model file the blocks were
        read from changed while they were (the streamer checks once they are back, before the
        result is used)."""
        try:
            self.streamer.detach(keep_pack=True)
        except ModelFileChanged as e:
            raise RuntimeError(f"Apply Layerwise Offload: {e}") from None

    def read_back(self) -> None:
        """Core is about to run the model itself: the blocks read from the model's own file get
        their bytes back in RAM first (between runs they hold none). A file that changed since
        fails that prompt, naming the file, before core reads a byte."""
        if self.begun:
            return
        try:
            count = self.streamer.read_back()
        except ModelFileChanged as e:
            raise RuntimeError(f"Apply Layerwise Offload: {e}") from None
        if count:
            log.info("[tiered offload] Apply Layerwise Offload: %d units of %s read back from the model file for a run "
                     "without the node", count, self.model_class)

    def _watched(self) -> list[torch.nn.Module]:
        """The modules whose own `.to()` core calls: the model's root (while it lives), and any
        module of the blocks (a partial unload moves each module that holds weights)."""
        root = self.model_ref()
        return [*([] if root is None else [root]),
                *(module for block in self.blocks for module in block.modules())]

    def _reclaim_before_host_move(self, module: torch.nn.Module) -> None:
        if self.begun:  # the engine holds the blocks during a run
            return
        taken = self.streamer.reclaim(within=module)
        if not taken:
            return
        if module is self.model_ref():
            log.info("[tiered offload] Apply Layerwise Offload: %s moves to the host: %d block tensors re-pointed "
                     "at the kept pack, with no copy", self.model_class, taken)
        else:  # one of many modules a partial unload moves
            log.debug("[tiered offload] Apply Layerwise Offload: a %s module moves to the host: %d block tensors "
                      "re-pointed at the kept pack, with no copy", self.model_class, taken)

    def _close_block_patches(self) -> None:
        """The run's patches go: the block patches' device tensors, and core gets its hook patches back."""
        hooks, self.streamed_hooks = self.streamed_hooks, None
        if hooks is not None:
            hooks.close()
        if self.block_patches is not None:
            self.block_patches.close()
            self.block_patches = None

    def close(self) -> None:
        for module in self._watched():
            host_moves.unwatch(module, LAYERWISE_KEY)
        self._close_block_patches()
        self.streamer.close()

    def report(self) -> dict[str, Any]:
        return {
            "module_id": self.module_id,
            "model_class": self.model_class,
            "layout": self.layout,
            "device": str(self.device),
            "settings": asdict(self.settings),
            "budget_bytes": self.budget_bytes,
            "block_bytes": self.block_bytes,
            "rest_bytes": self.rest_bytes,
            "core_view": self.core_view,
            "blocks": len(self.blocks),
            "resident_indices": list(self.streamer.resident_indices),
            "streamed_indices": list(self.streamer.streamed_indices),
            "bound_bytes": self.streamer.bound_bytes(),
            "block_states": self.streamer.block_states(),
            "granularity": self.streamer.granularity,
            "granularity_why": self.granularity_why,
            "auto_settings": self.settings.auto_settings,
            "tuning": self.streamer.tuning(),
            "units": self.streamer.describe_units(),
            "unit_states": self.streamer.unit_states(),
            "host": self.streamer.host_bytes(),
            "host_store": self.host_store(),
            "disk": self.streamer.disk_figures(),
            "active": self.active,
            "runs": self.runs,
            "finished_at": self.finished_at,
            "dynamic_vram": dynamic_vram.describe(self.module_id),
            "telemetry": self.streamer.figures() if self.active else self.last_run,
            "timeline": self.last_timeline,
        }

    def host_store(self) -> dict[str, Any] | None:
        """Whether the blocks' host copy is shared with other processes (where, with how many) or
        why not; None before the first pack of a shared one, or while the blocks stream from disk."""
        if self.share is None:
            return {"shared": False, "why": self.share_why}
        return self.streamer.host_store()

    def disk_bytes(self) -> int:
        """Bytes of the model's blocks that are only on disk now (disk streaming), else 0."""
        return self.streamer.host_bytes().get("disk", 0)


def run_figures(snapshot: dict[str, Any], seconds: float, attach_seconds: float,
                device: torch.device) -> dict[str, Any]:
    """The engine's counters plus what a person reads first: rate and overlap of the run.

    `seconds` is sampling time only (from the end of the attach to the end of the run), so
    `gibps` (streamed GiB over that time) and `overlap_efficiency` are not flattered by packing
    and pinning, which `attach_seconds` shows on its own. Overlap is the share of the run in
    which neither compute waited for a copy (`compute_wait_s`) nor the sampling thread sat in the
    engine (`host_wait_s`: a host that waits queues no compute, which the GPU's own waits do
    not show). On CPU copies are synchronous and part of the compute, so overlap is left out
    there rather than shown as a meaningless figure.
    """
    figures = dict(snapshot, seconds=seconds, attach_seconds=attach_seconds)
    figures["gibps"] = snapshot["bytes_copied"] / seconds / 2**30 if seconds > 0 else 0.0
    if device.type != "cpu" and seconds > 0:
        figures["overlap_efficiency"] = overlap_efficiency(snapshot, seconds)
    return figures
