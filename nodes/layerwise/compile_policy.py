"""When a torch.compile meets Apply Layerwise Offload: run it, compile its blocks one by one, or
refuse it, decided on the workflow's settings and never on the VRAM free that day
(docs/torch-compile.md).

Whether blocks stream depends, with `resident_blocks` -1 on a GPU, on the VRAM free when sampling
starts. A compile that streamed blocks cannot keep (compiled_models.py) is therefore refused
whenever blocks *may* stream: some stream in this run, or the node picks its resident blocks from
free VRAM. The same workflow then runs, or is refused, every day alike: when it is queued where
the prompt shows the compile node's settings (`queue_refusal`), else before anything moves in its
first run, with the choices named. One choice is this node's `compile_per_block`: a compile of
the whole model through ComfyUI's compile wrapper then compiles each block on its own, with the
same settings, streamed or not, so its result is always that of the per-block compile
(`per_block`).

Refusals raised while sampling show on the sampler: each names first the node to change, by its
title and id as the prompt has them (compile_prompt.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import comfy.model_management
import comfy.patcher_extension

from ..core.models import dynamic_vram_on
from . import compile_prompt, compiled_models
from .compiled_models import CHANGE_COMPILE, CHANGE_OFFLOAD, CompileSetup, Refusal

# A stand-in block path for checks made before the model is known (queue time).
_SOME_BLOCK = f"{compiled_models.WHOLE_MODEL}.blocks.0"


def may_stream(resident_blocks: int, streamed: int, device_type: str) -> bool:
    """Blocks stream in this run, or may in another run of the same workflow: with
    `resident_blocks` -1 on a GPU the node picks them from the VRAM free when sampling starts.
    (On the CPU that choice does not depend on free memory.)"""
    return streamed > 0 or (resident_blocks < 0 and device_type != "cpu")


@dataclass(frozen=True)
class Streaming:
    """What the message says of the blocks: ``streamed`` of ``blocks`` stream now, or (None) the
    count is not known yet; ``resident_blocks`` as set on the node."""

    resident_blocks: int
    streamed: int | None = None
    blocks: int | None = None
    model_class: str = "the model"

    def clause(self) -> str:
        if self.streamed:
            return f"streams {self.streamed} of {self.model_class}'s {self.blocks} blocks"
        if self.resident_blocks == 0:
            return "streams every block (resident_blocks 0)"
        return ("picks the resident blocks from the VRAM free when sampling starts (resident_blocks "
                "-1), so on some runs blocks are streamed and on others not")

    def all_resident(self) -> str:
        count = self.blocks if self.blocks is not None else "the model's block count"
        return f"resident_blocks = {count}"


def message(refusal: Refusal, streaming: Streaming, offload: str, compile_node: str | None,
            per_block_tried: bool = False) -> str:
    """The refusal as the user reads it, the node to change first (``offload``: this node's label;
    ``compile_node``: the compile node's, None where the prompt does not show it)."""
    setup = refusal.setup
    compiler = compile_node or f"torch.compile ({setup.source})"
    if refusal.whole is not None:
        what = (f"{streaming.model_class} whole" if refusal.whole == compiled_models.WHOLE_MODEL
                else f"{refusal.whole} of {streaming.model_class}")
        choices = [f"{streaming.all_resident()} (every block stays on the GPU, and the whole "
                   "graph is kept)", f"in place of {compiler}, {compiled_models.PER_BLOCK_NODE}"]
        if not per_block_tried and convertible(setup):
            choices.insert(0, "compile_per_block on here (each block is then compiled on its own "
                              "with the same settings, streamed or not, and the result is a "
                              "per-block compile's)")
        cannot = (" compile_per_block cannot take this compile over: it is not made through "
                  "ComfyUI's compile wrapper." if per_block_tried else "")
        return (f"{offload}: {compiler} compiles {what}, as one graph, and this node "
                f"{streaming.clause()}: {refusal.why}.{cannot} Choose one: {'; '.join(choices)}.")
    if refusal.change == CHANGE_COMPILE and compile_node is not None:
        return (f"{compile_node}: {refusal.why}, and {offload} {streaming.clause()}. "
                f"{refusal.instead} there, or keep every block resident "
                f"({streaming.all_resident()} on {offload}).")
    keep = f"or keep every block resident ({streaming.all_resident()})"
    if refusal.change == CHANGE_OFFLOAD:  # phases
        return (f"{offload}: {compiler} compiles the blocks of {streaming.model_class} one by one, "
                f"and this node {streaming.clause()}: {refusal.why}. {refusal.instead}, {keep}.")
    return (f"{offload}: {streaming.model_class} is compiled by {compiler}, and this node "
            f"{streaming.clause()}: {refusal.why}. {refusal.instead}, {keep}.")


def convertible(setup: CompileSetup) -> bool:
    """Whether compile_per_block can take this compile over: the whole model, compiled through
    ComfyUI's compile wrapper."""
    return setup.keys == (compiled_models.WHOLE_MODEL,) and not setup.by_object_patch


def lora_message(refusal: Refusal, offload: str, compile_node: str | None,
                 model_class: str) -> str:
    """A compile under which core would leave a LoRA out that the engine would merge: its node
    is the one to change."""
    head = compile_node or (f"{offload}: {model_class} is compiled by torch.compile "
                            f"({refusal.setup.source})")
    return f"{head}: {refusal.why}. {refusal.instead}."


def per_block(patcher, model_options: dict | None, setups: list[CompileSetup],
              block_paths: list[str]) -> list[CompileSetup]:
    """``setups`` with a whole-model compile through core's compile wrapper replaced, for this run
    only, by a compile of each block on its own with the same settings: the wrapper that core's
    helper makes for those keys takes its place in the run's model options (ComfyUI copies them for
    each sampling run). A whole-model compile made another way stays, to be refused."""
    wrappers = ((model_options or {}).get("transformer_options") or {}).get("wrappers") or {}
    apply_model = wrappers.get(comfy.patcher_extension.WrappersMP.APPLY_MODEL) or {}
    kwargs = patcher.model_options.get(compiled_models.COMPILE_KWARGS)
    factory = _wrapper_factory()
    out = []
    for setup in setups:
        if (convertible(setup) and compiled_models.COMPILE_KEY in apply_model
                and isinstance(kwargs, dict) and factory is not None):
            modules = {path: torch.compile(patcher.get_model_object(path), **kwargs)
                       for path in block_paths}
            apply_model[compiled_models.COMPILE_KEY] = [factory(modules)]
            setup = compiled_models.setup_from_kwargs(tuple(block_paths), kwargs)
        out.append(setup)
    return out


def _wrapper_factory():
    """Core's maker of its compile wrapper for given compiled modules, None where it is missing."""
    try:
        from comfy_api.torch_helpers.torch_compile import apply_torch_compile_factory
    except ImportError:
        return None
    return apply_torch_compile_factory


@dataclass(frozen=True)
class NodeChoice:
    """What the node that set up a run chose about compiles: its id in the prompt (None: not
    known) and its compile_per_block input."""

    node_id: str | None = None
    compile_per_block: bool = False


def settle(patcher, model_options: dict | None, choice: NodeChoice, *, model_class: str,
           blocks: list[torch.nn.Module], prefixes: list[str], streamed: list[int],
           resident_blocks: int, granularity: str, device: torch.device) -> bool:
    """Before anything moves: refuse a compile setup this run cannot keep (ValueError, naming the
    node to change first), take a whole-model compile over per block where the node asks, and
    say whether the run compiles (the engine then keeps its hooks outside the graphs).
    ``streamed``: the indices of the blocks this run streams."""
    setups = compiled_models.compile_setups(patcher, blocks)
    if not setups:
        return False
    graph = compile_prompt.running_graph()
    offload = compile_prompt.label(graph, choice.node_id, compile_prompt.OFFLOAD_TITLE)
    nodes = compile_prompt.compile_nodes(graph, choice.node_id)
    compile_node = nodes[-1].label if nodes else None
    refusal = compiled_models.dropped_patches_refusal(setups, prefixes, patcher.patches)
    if refusal is not None:
        raise ValueError(lora_message(refusal, offload, compile_node, model_class))
    if choice.compile_per_block:
        setups = per_block(patcher, model_options, setups, prefixes)
    if not may_stream(resident_blocks, len(streamed), device.type):
        return True
    # Which blocks stream may change from run to run: check the ones that do, or else all.
    paths = [prefixes[b] for b in streamed] or list(prefixes)
    refusal = compiled_models.streaming_refusal(setups, paths, granularity)
    if refusal is not None:
        streaming = Streaming(resident_blocks, len(streamed), len(blocks), model_class)
        raise ValueError(message(refusal, streaming, offload, compile_node,
                                 per_block_tried=choice.compile_per_block))
    return True


def queue_refusal(graph: dict | None, node_id: str | None) -> str | None:
    """The refusal of a compile the node's settings cannot keep, as the posted prompt shows them
    both; None where it shows no such compile, or not enough to tell (a link, another compile
    node, a resident_blocks above 0, whose meaning needs the model's block count, or `auto` where
    ComfyUI may stream the model itself with Dynamic VRAM, whose compiles are ComfyUI's)."""
    compiles = [c for c in compile_prompt.compile_nodes(graph, node_id)
                if c.kwargs is not None and c.whole is not None]
    if not compiles:
        return None
    inputs = graph[node_id].get("inputs", {})
    if inputs.get("mode", "auto") != "engine" and dynamic_vram_on():
        return None  # a Dynamic VRAM model in `auto` is streamed by ComfyUI: decided at run
    resident, granularity = inputs.get("resident_blocks", -1), inputs.get("granularity", "block")
    per_block_on = inputs.get("compile_per_block", False)
    if not isinstance(resident, int) or not isinstance(granularity, str) or \
            not isinstance(per_block_on, bool):
        return None
    if granularity == "auto":  # whole blocks, unless the run finds only phases fit (decided there)
        granularity = "block"
    device = comfy.model_management.get_torch_device()
    if not (resident == 0 or may_stream(resident, 0, device.type)):
        return None
    node = compiles[-1]  # core's wrapper keeps the last compile set: the nearest to the sampler
    keys = (compiled_models.WHOLE_MODEL,) if node.whole and not per_block_on else (_SOME_BLOCK,)
    setup = compiled_models.setup_from_kwargs(keys, node.kwargs)
    refusal = compiled_models.streaming_refusal([setup], [_SOME_BLOCK], granularity)
    if refusal is None:
        return None
    offload = compile_prompt.label(graph, node_id, compile_prompt.OFFLOAD_TITLE)
    return message(refusal, Streaming(resident), offload, node.label)

