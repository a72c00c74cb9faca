"""How torch.compile would run a patcher's diffusion model, and which of those setups the engine
may stream (docs/torch-compile.md).

The engine's hooks run outside any compiled graph (offload_core/device/hooks.py). A compile of
each block on its own (per-block compile nodes: a wrapper under core's compile key with one
compiled module per block, core's own or KJNodes' TorchCompileModelAdvanced's, or a compiled
module put in for each block by an object patch) then keeps every block's graph whole, with the
weights as graph inputs read from whichever slot the hook bound: the same bits as the same
compiled workflow without the node, no recompile after the first pass
(tests/test_torch_compile.py). Everything else that would compile streamed blocks is refused
(compile_policy.py decides when, and words the messages), with what to choose instead:
- a compile of a module that holds streamed blocks (core's TorchCompileModel compiles the whole
  diffusion model): streaming splits its graph at every streamed block, and inductor's results
  then differ in the last bits from the one graph it compiles without the node;
- granularity `phase`: it splits each block's graph at its phases, with the same effect;
- CUDA graphs (`reduce-overhead`, `max-autotune`, backend `cudagraphs`, the option
  `triton.cudagraphs`): a captured graph keeps reading a streamed block's weights at the slot it
  was captured with;
- what the tests do not cover: another backend, mode or inductor option, `dynamic=True`, inductor's
  `freezing` (weights become constants of the graph), a module inside a block, a module compiled
  in place (`Module.compile()`), settings this module cannot read.
Apart from streaming: core applies no weight patch (LoRA) under a module an object patch compiled,
because its weight names then pass through torch.compile's wrapper (`_orig_mod`), while the engine
merges a block's patches itself; such a run, resident blocks included, is refused too, since it
could not give core's result.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import comfy.patcher_extension
import torch

from ...offload_core.blocks.discovery import uncompiled

# The key of core's TorchCompileModel wrapper, the model option holding its settings and the
# wrapper's own name for what it compiles (comfy_api.torch_helpers.torch_compile).
COMPILE_KEY = "torch.compile"
COMPILE_KWARGS = "torch_compile_kwargs"
COMPILED_MODULES = "compiled_module_dict"
WHOLE_MODEL = "diffusion_model"
# Options torch.compile takes for dynamo, not inductor: they change no graph.
DYNAMO_OPTIONS = frozenset({"guard_filter_fn"})
TESTED_BACKEND = "inductor"
TESTED_MODES = (None, "default")
# KJNodes' current per-block compile node (TorchCompileModelWanVideoV2 is deprecated in its favour).
PER_BLOCK_NODE = "KJNodes' TorchCompileModelAdvanced with compile_transformer_blocks_only on"
PER_BLOCK = f"Compile the blocks one by one instead ({PER_BLOCK_NODE})"
TESTED = (f"Compile the blocks one by one ({PER_BLOCK_NODE}), backend 'inductor' with mode "
          "'default'")


@dataclass(frozen=True)
class CompileSetup:
    """One torch.compile over (part of) the diffusion model: what it compiles, as model paths
    (None: unreadable), and how (``backend`` None: unreadable)."""

    source: str
    keys: tuple[str, ...] | None = None
    backend: str | None = None
    mode: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # inductor options, a mode's included
    fullgraph: bool | None = False
    dynamic: bool | None = None
    by_object_patch: bool = False


def diffusion_module(patcher) -> torch.nn.Module:
    """The patcher's diffusion model, itself even where an object patch put in a compiled
    wrapper of it: the engine's session belongs to the module that holds the blocks."""
    return uncompiled(patcher.get_model_object("diffusion_model"))


def _is_compiled(module: object) -> bool:
    """torch.compile's module wrapper (OptimizedModule)."""
    return isinstance(module, torch.nn.Module) and uncompiled(module) is not module


def compile_setups(patcher, blocks) -> list[CompileSetup]:
    """Every torch.compile that would run the diffusion model or its blocks in this patcher's
    sampling: core's compile wrapper, compiled modules put in by object patches, and modules
    compiled in place."""
    setups = []
    for wrapper in patcher.get_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL, COMPILE_KEY):
        setups.append(_core_setup(wrapper, patcher.model_options.get(COMPILE_KWARGS), patcher.model))
    for key, value in getattr(patcher, "object_patches", {}).items():
        if (key == "diffusion_model" or key.startswith("diffusion_model.")) and _is_compiled(value):
            setups.append(_module_setup(f"a compiled module patched in at {key}", key, value))
    if any(getattr(m, "_compiled_call_impl", None) is not None
           for m in (diffusion_module(patcher), *blocks)):
        setups.append(CompileSetup("a module compiled in place by Module.compile"))
    return setups


def compiled_modules(wrapper, model) -> dict[str, Any] | None:
    """What a compile wrapper under core's key puts in while the model runs, {model path: compiled
    module}; None where this cannot be read.

    Core's wrapper holds the dict in its closure (`compiled_module_dict`). KJNodes'
    TorchCompileModelAdvanced registers its wrapper under the same key but looks the dict up,
    when the model runs, in a module-level mapping keyed by the model it runs: any mapping the
    wrapper names that has such an entry for this model is read the same way."""
    try:
        found = inspect.getclosurevars(wrapper)
    except TypeError:  # not a plain function
        return None
    modules = found.nonlocals.get(COMPILED_MODULES)
    if _module_table(modules):
        return modules
    for value in found.globals.values():
        if not isinstance(value, (dict, weakref.WeakKeyDictionary)):
            continue
        try:
            entry = value.get(model)
        except TypeError:  # keys the model cannot be compared with
            continue
        if _module_table(entry):
            return entry
    return None


def _module_table(value: object) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) for k in value)


def _core_setup(wrapper, kwargs: dict[str, Any] | None, model=None) -> CompileSetup:
    modules = compiled_modules(wrapper, model)
    keys = tuple(modules) if modules is not None else None
    return setup_from_kwargs(keys, kwargs)


def setup_from_kwargs(keys: tuple[str, ...] | None, kwargs: dict[str, Any] | None) -> CompileSetup:
    """A compile through core's wrapper key, from what it compiles and the torch.compile
    settings it keeps in the model options."""
    source = "through ComfyUI's compile wrapper"
    if not isinstance(kwargs, dict):
        return CompileSetup(source, keys)
    backend, mode = kwargs.get("backend"), kwargs.get("mode")
    options = {k: v for k, v in (kwargs.get("options") or {}).items() if k not in DYNAMO_OPTIONS}
    if backend == TESTED_BACKEND and mode not in TESTED_MODES:
        import torch._inductor
        options = {**torch._inductor.list_mode_options(mode), **options}
    return CompileSetup(source, keys, _backend_name(backend), mode, options,
                        bool(kwargs.get("fullgraph")), kwargs.get("dynamic"))


def _module_setup(source: str, key: str, module: torch.nn.Module) -> CompileSetup:
    """Read the backend torch.compile gave an OptimizedModule; unreadable where torch moved it."""
    ctx = getattr(module, "dynamo_ctx", None)
    try:
        from torch._dynamo.eval_frame import innermost_backend
        backend = innermost_backend(ctx.callback)
    except (ImportError, AttributeError):
        return CompileSetup(source, (key,), by_object_patch=True)
    name = getattr(backend, "compiler_name", None) or _backend_name(backend)
    options = {k: v for k, v in (getattr(backend, "config", None) or {}).items()
               if k not in DYNAMO_OPTIONS}
    return CompileSetup(source, (key,), name, None, options, getattr(ctx, "fullgraph", None),
                        getattr(backend, "dynamic", None), by_object_patch=True)


def _backend_name(backend: object) -> str | None:
    if backend is None or isinstance(backend, str):
        return backend
    return getattr(backend, "__name__", type(backend).__name__)


# Who a refusal asks to change something (compile_policy.py names that node first): the compile
# node's settings, this node's (a whole-model compile, phases), or a global setting.
CHANGE_COMPILE, CHANGE_OFFLOAD, CHANGE_GLOBAL = "compile", "offload", "global"


@dataclass(frozen=True)
class Refusal:
    """Why the engine cannot run a setup, and what to choose instead. ``whole``: the module path
    of a compile that holds streamed blocks (a whole-model compile), else None."""

    setup: CompileSetup
    change: str
    why: str
    instead: str
    whole: str | None = None


def dropped_patches_refusal(setups: list[CompileSetup], block_paths: list[str],
                            patch_keys) -> Refusal | None:
    """A setup under which core drops weight patches (a LoRA) that the engine would merge into
    blocks: an object patch's compiled module that holds patched block weights."""
    for setup in setups:
        if not setup.by_object_patch or setup.keys is None:
            continue
        for key in setup.keys:
            if any(_within(patch, key) and any(_within(patch, block) for block in block_paths)
                   for patch in patch_keys):
                return Refusal(setup, CHANGE_COMPILE,
                               "ComfyUI applies no weight patch (LoRA) under a module an object "
                               "patch compiled (its weight names then pass through torch.compile's "
                               "wrapper), so its result leaves the LoRA out of these blocks, which "
                               "Apply Layerwise Offload would merge",
                               f"{PER_BLOCK}: ComfyUI applies the LoRA under it")
    return None


def streaming_refusal(setups: list[CompileSetup], streamed_paths: list[str],
                      granularity: str) -> Refusal | None:
    """The first setup that the engine cannot keep while it streams the blocks at
    ``streamed_paths``, or None if it keeps them all."""
    for setup in setups:
        refusal = _refusal(setup, streamed_paths, granularity)
        if refusal is not None:
            return refusal
    return None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def _refusal(setup: CompileSetup, streamed: list[str], granularity: str) -> Refusal | None:
    if setup.keys is None or setup.backend is None:
        return Refusal(setup, CHANGE_COMPILE,
                       "Apply Layerwise Offload cannot read what it compiles or how, so it cannot "
                       "tell whether its graphs follow weights that move between GPU slots", TESTED)
    keys = [k for k in setup.keys if any(_within(k, s) or _within(s, k) for s in streamed)]
    if not keys:
        return None  # it compiles nothing that streams
    holder = next((k for k in keys if not any(k == s for s in streamed) and
                   any(_within(s, k) for s in streamed)), None)
    if holder is not None:
        return Refusal(setup, CHANGE_OFFLOAD,
                       "streaming splits that graph at every streamed block (the engine's hooks "
                       "run between blocks, outside any graph), and inductor's results then differ "
                       "in the last bits from the one graph it compiles without streaming",
                       PER_BLOCK, whole=holder)
    inside = next((k for k in keys if k not in streamed), None)
    if inside is not None:
        return Refusal(setup, CHANGE_COMPILE, f"it compiles {inside}, a part of a streamed block, "
                                              "which has not been tested with streamed blocks",
                       TESTED)
    return settings_refusal(setup, granularity)


def settings_refusal(setup: CompileSetup, granularity: str) -> Refusal | None:
    """What in a compile of each streamed block on its own the engine cannot keep, if anything."""
    cuda_graphs = _cuda_graphs(setup)
    if cuda_graphs:
        change = CHANGE_GLOBAL if cuda_graphs.startswith("inductor's global") else CHANGE_COMPILE
        return Refusal(setup, change, f"{cuda_graphs} captures CUDA graphs, which keep reading a "
                                      "streamed block's weights at the GPU slot it was captured with",
                       "Choose backend 'inductor' with mode 'default' (no CUDA graphs)")
    if setup.backend != TESTED_BACKEND:
        return Refusal(setup, CHANGE_COMPILE,
                       f"backend '{setup.backend}' has not been tested with streamed blocks",
                       "Choose backend 'inductor' with mode 'default'")
    if setup.options:
        mode = f" (mode '{setup.mode}')" if setup.mode else ""
        return Refusal(setup, CHANGE_COMPILE,
                       f"inductor options {', '.join(sorted(setup.options))}{mode} have not been "
                       "tested with streamed blocks", "Choose backend 'inductor' with mode 'default'")
    if setup.fullgraph is None:
        return Refusal(setup, CHANGE_COMPILE, "Apply Layerwise Offload cannot read whether it asks "
                                              "for one whole graph", TESTED)
    if setup.dynamic not in (None, False):
        return Refusal(setup, CHANGE_COMPILE, "dynamic=True has not been tested with streamed blocks",
                       "Compile with dynamic off (None or False)")
    if granularity != "block":
        return Refusal(setup, CHANGE_OFFLOAD,
                       f"granularity '{granularity}' splits each streamed block's compiled graph at "
                       "its phases, and inductor's results then differ in the last bits from the "
                       "same compiled model without Apply Layerwise Offload", "Use granularity 'block'")
    if _inductor_config("freezing"):
        return Refusal(setup, CHANGE_GLOBAL, "inductor's global config sets freezing, which makes "
                                             "the weights constants of the graph",
                       "Turn inductor's freezing off")
    return None


def _cuda_graphs(setup: CompileSetup) -> str | None:
    """What in the setup captures CUDA graphs, in the words a user chose it by; None if nothing."""
    if setup.backend == "cudagraphs":
        return "backend 'cudagraphs'"
    if setup.options.get("triton.cudagraphs"):
        return f"mode '{setup.mode}'" if setup.mode else \
            "the inductor option triton.cudagraphs (modes 'reduce-overhead' and 'max-autotune')"
    if setup.backend == TESTED_BACKEND and _inductor_config("triton.cudagraphs"):
        return "inductor's global config triton.cudagraphs"
    return None


def _inductor_config(name: str) -> bool:
    """A global inductor setting another node may have turned on (read only once a compile is found)."""
    from torch._inductor import config
    value: Any = config
    for part in name.split("."):
        value = getattr(value, part, False)
    return bool(value)
