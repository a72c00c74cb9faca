"""Apply Layerwise Offload, the node: stream a DiT's blocks from pinned RAM during sampling.

It checks its inputs (settings.py) and picks the path. On a model core runs with
Dynamic VRAM, `auto` lets core stream it in the node's order (dynamic_cooperation.py); anywhere
else the pack's engine streams, on a classic patcher (a twin for a Dynamic VRAM model in `engine`
mode: dynamic_vram.py), through one session per diffusion model (session.py), which two
wrappers registered under the pack's key run inside core's sampling: PREPARE_SAMPLING hands the
blocks over before core's load and corrects core's figures after it, OUTER_SAMPLE gives
everything back however the run ends.

The engine hooks the block modules themselves, so dit block-replace patches of other nodes
(TeaCache and the like) keep working and chain naturally: they call the original block.
"""
from __future__ import annotations

import logging

import comfy.patcher_extension
from comfy_api.v0_0_2 import io

from ..core.models import is_dynamic, unified_memory
from ..core.state import LAYERWISE, LAYERWISE_KEY, SWAP_KEY, SWAP_MEMBERS
from . import (compile_policy, compile_prompt, compiled_models, dynamic_cooperation, dynamic_vram,
               sampler_steps, sampling_wrappers, spill_folder)
from .session import LayerwiseSession
from .settings import (GRANULARITY_CHOICES, MAX_DISK_WORKERS, MAX_HOST_CACHE_GB, MAX_PREFETCH,
                       MAX_RESIDENT_BLOCKS, MAX_VRAM_BUDGET_GB, LayerwiseSettings)

log = logging.getLogger(__name__)


def session_for(patcher, settings: LayerwiseSettings) -> LayerwiseSession:
    """The engine session of this patcher's diffusion model (one per nn.Module, shared by all its
    clones), built anew when the settings or the device changed."""
    diffusion_model = compiled_models.diffusion_module(patcher)

    def same(session: LayerwiseSession) -> bool:
        if session.settings == settings and session.device == patcher.load_device:
            return True
        log.info("[tiered offload] Apply Layerwise Offload: settings changed for %s, rebuilding the engine",
                 session.model_class)
        return False
    return LAYERWISE.sessions.get_or_create(
        diffusion_model, lambda: LayerwiseSession(patcher, settings), same)


def _classic_patcher(model, settings: LayerwiseSettings):
    """A classic ModelPatcher for the engine to stream.

    A classic model gets a plain clone. A model that newer ComfyUI runs with Dynamic VRAM
    (0.15 and later) gets a clone over a classic twin of it, sharing its host weights, because
    the engine cannot take the blocks of a dynamic model (dynamic_vram.py says why): the twin is
    made once per model, after every check, and its cost is logged and reported. Raises
    ValueError, before any copy, for a model or settings the engine refuses or a model no
    classic patcher can be made for.
    """
    if not is_dynamic(model):
        return model.clone()
    return dynamic_vram.classic_delegate(model, settings.streamer_kwargs())


def _hide_sampling_wrappers(model_options: dict | None) -> None:
    """Take this node's two wrappers out of a sampling run's model options once core has read
    them (it copies the options and the patcher's wrappers for each run, and reads those two
    wrapper types only where the run starts), so the model sees core's `transformer_options`.
    torch.compile guards on what a compiled graph reads of them: without this, a graph compiled
    in a run with the node fails its guard on the wrapper table in the same prompt without it,
    and compiles again (docs/torch-compile.md#recompiles)."""
    wrappers = ((model_options or {}).get("transformer_options") or {}).get("wrappers")
    if not isinstance(wrappers, dict):
        return
    for wrapper_type in sampling_wrappers.WRAPPER_TYPES:
        by_key = wrappers.get(wrapper_type)
        if isinstance(by_key, dict):
            by_key.pop(LAYERWISE_KEY, None)
            if not by_key:  # as core's run has it without the node (its table stays, empty)
                del wrappers[wrapper_type]


class ApplyLayerwiseOffload(io.ComfyNode):
    """Stream the diffusion model's blocks from pinned RAM (or from disk) while earlier blocks compute."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ApplyLayerwiseOffload",
            display_name="Apply Layerwise Offload",
            category="tiered_offload",
            description=("Streams the transformer blocks from pinned RAM into a few GPU slots while "
                         "earlier blocks compute. Results are bit-identical to core loading the "
                         "whole model."),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to stream."),
                io.Int.Input(
                    "resident_blocks", default=-1, min=-1, max=MAX_RESIDENT_BLOCKS,
                    tooltip="Blocks kept on the GPU. -1 is auto: the engine measures each run and "
                            "keeps as many blocks as make it faster, within vram_budget_gb, and "
                            "says why in the Offload panel. A number is kept, spread evenly through "
                            "the stack."),
                io.Float.Input(
                    "vram_budget_gb", default=0.0, min=0.0, max=MAX_VRAM_BUDGET_GB, step=0.25,
                    tooltip="GPU memory in GiB for the model's blocks (resident blocks plus "
                            "streaming slots) when resident_blocks is -1. 0 is auto: whatever the "
                            "card has free once ComfyUI has made room for the rest of the run "
                            "(other weights, activations, its reserve). A larger budget than that "
                            "is lowered to it, with a log line."),
                io.Int.Input(
                    "prefetch", default=0, min=0, max=MAX_PREFETCH,
                    tooltip="How many streamed blocks are copied ahead of the one computing. "
                            "Each adds one block-sized GPU slot. 0 is auto: the engine chooses "
                            "from what each run measures."),
                io.Boolean.Input(
                    "pin", default=True,
                    tooltip="Keep the block weights in pinned RAM for full-speed async copies. "
                            "Falls back to pageable RAM (slower, logged) if pinning would exceed "
                            "the RAM budget."),
                io.Combo.Input(
                    "mode", options=list(dynamic_vram.MODES), default="auto", optional=True,
                    tooltip="auto: on a model that ComfyUI runs with Dynamic VRAM (0.15 and later "
                            "on NVIDIA), ComfyUI streams it and keeps this node's resident blocks "
                            "in VRAM first, checked at every load, with no copy; on other models "
                            "the pack's engine streams. engine: always the pack's engine; on a "
                            "Dynamic VRAM model it runs on a twin of the model over its own host "
                            "weights, with no reload (its cost is logged and shown in the "
                            "Offload panel)."),
                io.Float.Input(
                    "host_cache_gb", default=0.0, min=0.0, max=MAX_HOST_CACHE_GB, step=0.25,
                    optional=True,
                    tooltip="RAM in GiB for the streamed weights. 0 keeps every block packed in "
                            "RAM. When the blocks do not fit, they are read from disk through a "
                            "cache of this size, ahead of need: in place from the model's own file "
                            "where its bytes are what was loaded, else from a spill file written "
                            "once."),
                io.Int.Input(
                    "disk_workers", default=0, min=0, max=MAX_DISK_WORKERS, optional=True,
                    tooltip="Threads reading blocks from disk ahead of need (disk streaming), "
                            "each reading one block ahead. 0 is auto: the engine reads as far "
                            "ahead as keeps the disk busy, and no further, so the cache keeps "
                            "what it can hold from step to step."),
                io.Combo.Input(
                    "granularity", options=list(GRANULARITY_CHOICES), default="auto", optional=True,
                    tooltip="Stream whole blocks, or each block's phases (attention, cross-"
                            "attention, FFN): phases need about a third of the GPU memory per "
                            "slot, at more and smaller copies. auto: whole blocks, unless only "
                            "phases fit the GPU budget or the host cache."),
                io.String.Input(
                    "spill_dir", default="", optional=True,
                    tooltip="Folder for the spill file of blocks that are loaded in another "
                            "dtype or converted, when they do not fit host_cache_gb (blocks of a "
                            "plain or GGUF file are read from the file itself): as large as those "
                            "blocks, written once, gone with the engine. Empty: ComfyUI's temp "
                            "folder."),
                io.Boolean.Input(
                    "compile_per_block", default=False, optional=True,
                    tooltip="When the model comes compiled whole (ComfyUI's TorchCompileModel), "
                            "compile each block on its own instead, with the same settings, "
                            "streamed or not: the workflow then runs the same on any day, and its "
                            "result is that of a per-block compile, which differs from a whole-"
                            "model compile's in the last bits. Off: a whole-model compile runs "
                            "only with every block resident (resident_blocks set to the block "
                            "count), and is refused when blocks may stream."),
                io.Boolean.Input(
                    "share_host_memory", default=True, optional=True,
                    tooltip="Share the blocks' host copy with every other ComfyUI process on this "
                            "machine that streams the same model file (workers of a multi-GPU "
                            "setup): one copy in shared memory instead of one per process. Off: "
                            "this process keeps its own copy."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, model=None) -> bool | str:
        """Refuse at queue time, before anything loads, what the node would refuse at run and the
        posted prompt shows: a spill folder outside the allowed folders, missing or not writable,
        and a torch.compile its settings cannot keep (compile_policy.py). Only `model` is named,
        which is always there: ComfyUI repeats a refusal once per input the method names, and
        checks the other inputs' ranges itself. The node's own inputs are read from the posted
        prompt; a value that comes through a link, or a prompt that was not kept, is checked at
        run."""
        graph = compile_prompt.posted_graph()
        node = (graph or {}).get(cls.hidden.unique_id) if cls.hidden is not None else None
        if not isinstance(node, dict):
            return True
        spill_dir = node.get("inputs", {}).get("spill_dir")
        if isinstance(spill_dir, str):
            try:
                spill_folder.spill_folder(spill_dir)
            except ValueError as e:
                return str(e)
        return compile_policy.queue_refusal(graph, cls.hidden.unique_id) or True

    @classmethod
    def execute(cls, model, resident_blocks: int, vram_budget_gb: float, prefetch: int, pin: bool,
                mode: str = "auto", host_cache_gb: float = 0.0, disk_workers: int = 0,
                granularity: str = "auto", spill_dir: str = "",
                compile_per_block: bool = False, share_host_memory: bool = True) -> io.NodeOutput:
        settings = LayerwiseSettings(resident_blocks, vram_budget_gb, prefetch, pin, host_cache_gb,
                                     disk_workers, granularity, spill_dir, share_host_memory)
        choice = compile_policy.NodeChoice(cls.hidden.unique_id if cls.hidden is not None else None,
                                           bool(compile_per_block))
        if unified_memory(model):
            log.info("[tiered offload] Apply Layerwise Offload: %s runs on %s, whose GPU shares the RAM: nothing to "
                     "offload, the model passes through unchanged", type(model.model).__name__, model.load_device)
            return io.NodeOutput(model)
        if dynamic_vram.check_mode(mode) == "auto" and is_dynamic(model):
            return io.NodeOutput(dynamic_cooperation.cooperate(model, settings.streamer_kwargs(),
                                                               settings.requested_budget))
        # Checked on the input (clones carry its wrappers), so a refusal costs no copy.
        if model.get_wrappers(comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, SWAP_KEY):
            raise ValueError(
                "Apply Layerwise Offload got a model that is already under Model-Level Swap, "
                "which keeps the whole model in pinned RAM; streaming its blocks would hold them "
                "twice. Put Apply Layerwise Offload first, then Model-Level Swap.")
        patcher = _classic_patcher(model, settings)
        # Every check (blocks, packability, settings) runs here, before anything is moved, so
        # a refused model costs nothing and the error names the node.
        session = session_for(patcher, settings)
        # A whole-model master left by an earlier workflow would double the RAM: retire it.
        if SWAP_MEMBERS.discard(patcher.model) is not None:
            log.info("[tiered offload] Apply Layerwise Offload: released the Model-Level Swap master of this model")
        log.info("[tiered offload] Apply Layerwise Offload: %s, %d blocks (%s), %s", session.model_class,
                 len(session.blocks), session.layout,
                 f"{resident_blocks} resident" if resident_blocks >= 0 else
                 f"resident blocks from a {vram_budget_gb:g} GiB budget" if vram_budget_gb > 0
                 else "resident blocks from the memory free when sampling starts")

        def outer_sample(executor, *args, **kwargs):
            current = executor.class_obj.model_patcher
            live = session_for(current, settings)
            live.run_pending = True
            live.run_steps = sampler_steps.steps_of(args, kwargs)
            args, kwargs = sampler_steps.with_step_ends(args, kwargs, live.step_done)
            try:
                return executor(*args, **kwargs)
            finally:
                live.end(current)
                LAYERWISE.publish_report(live.report())

        def prepare_sampling(executor, model_patcher, noise_shape=None, conds=None, *args, **kwargs):
            live = session_for(model_patcher, settings)
            if not live.run_pending:  # not inside this node's sampling run
                return executor(model_patcher, noise_shape, conds, *args, **kwargs)
            live.begin(model_patcher, noise_shape, conds, kwargs.get("model_options"), choice)
            _hide_sampling_wrappers(kwargs.get("model_options"))
            result = executor(model_patcher, noise_shape, conds, *args, **kwargs)
            live.account(model_patcher)
            return result

        sampling_wrappers.install(patcher, LAYERWISE_KEY, around_load=prepare_sampling, around_run=outer_sample)
        return io.NodeOutput(patcher)
