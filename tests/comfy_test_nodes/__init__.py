"""Test-only ComfyUI nodes. Linked into the test server's custom_nodes; never shipped.

- TieredTestConditioning: CONDITIONING of the right shape for a tiny fixture DiT. It reports
  itself as always changed, so every queued prompt really samples again instead of being
  answered from ComfyUI's output cache.
- TieredTestLatentStats: an output node that puts a latent's shape, finiteness and sha256 into
  /history, so tests compare results bit for bit.
- TieredTestLatentBits and TieredTestImageStats: a latent's bits as an image of 0s and 1s (which
  an 8-bit PNG carries exactly, as ComfyUI-Distributed sends a worker's images to its master),
  and an output node with each image's sha256.
- TieredTestBlockReplace: a `dit` block-replace patch on every block, like TeaCache-style nodes
  install; it scales each block's output slightly so its effect shows in the result.
- TieredTestUnsupportedModel: swaps the diffusion model (through an object patch on a clone)
  for a module with no block list, to exercise the "unsupported model" error.
- TieredTestWeightReport: an output node that puts, for every parameter of the diffusion
  model's blocks, its class, whether it is a Parameter, its storage size and dtype, and the
  GGUF attributes (tensor_type, tensor_shape, number of patches) into /history. It takes the
  sampled latent too, so it runs after sampling.
- TieredTestCompileBlocks: torch.compile the way per-block compile nodes (KJNodes) do it:
  each block as a compiled module put in by an object patch, the whole diffusion model put in
  that way, core's compile wrapper with one key per block, or (registry_block_keys) a wrapper of
  its own under core's wrapper key that finds the compiled blocks, when the model runs, in a
  module-level table keyed by the model, with dynamo's guards on transformer_options filtered
  out: how KJNodes' current TorchCompileModelAdvanced registers its per-block compile.
- GET /tiered_test/dynamo_counts: dynamo's counts (graphs compiled, graph breaks met) of the whole
  server so far, read by the differential test before and after each prompt.
- TieredTestCompileCounts: a pass-through that records dynamo's counts (graphs compiled,
  graph breaks met) after every model call of the sampling run that follows, and the wrapper
  table (`transformer_options["wrappers"]`: types and keys) the model is called with; its output
  twin TieredTestCompileReport puts them into /history with the totals and the graphs dynamo
  holds for each block class's forward.

With TIERED_TEST_CORE_WEIGHT_BUDGET=<bytes> in the server's environment, core loads every
diffusion model with that weight budget: its real partial-loading ("lowvram") path, which
--cpu otherwise never takes. With TIERED_TEST_DYNAMO_RECOMPILE_LIMIT=<n>, dynamo keeps up to n
graphs per function (torch's default is 8), set by TieredTestConditioning on the thread that
samples: dynamo's settings are the thread's own.

With TIERED_TEST_FIRST_LINE=<text>, the text is printed when this package loads. ComfyUI's log
buffer (app/logger.py, 0.3.75 and 0.33) fails with "deque index out of range" on a progress line
that comes before any other output, and the sampler's progress bar is the first output of a
server whose log level hides every record (--verbose CRITICAL).
"""
import hashlib
import os
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
import tiny_models  # noqa: E402


class TieredTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model_kind": (sorted(tiny_models.MODELS),),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "tiered_offload/testing"

    @classmethod
    def IS_CHANGED(cls, **_):
        return float("nan")

    def make(self, model_kind, seed):
        limit = os.environ.get("TIERED_TEST_DYNAMO_RECOMPILE_LIMIT")
        if limit:
            import torch._dynamo
            torch._dynamo.config.recompile_limit = int(limit)
        return (tiny_models.make_conditioning(model_kind, seed),)


def tensor_report(t: torch.Tensor) -> dict:
    """Shape, dtype, finiteness and the sha256 of the raw bytes: equal hashes = bit-identical."""
    t = t.detach().cpu().contiguous()
    return {"shape": list(t.shape), "dtype": str(t.dtype), "finite": bool(torch.isfinite(t).all()),
            "sha256": hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()}


class _StatsNode:
    RETURN_TYPES = ()
    FUNCTION = "stats"
    OUTPUT_NODE = True
    CATEGORY = "tiered_offload/testing"


class TieredTestLatentStats(_StatsNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    def stats(self, samples):
        return {"ui": {"latent_stats": [tensor_report(samples["samples"])]}}


class TieredTestLatentBits:
    """A latent's raw bits as an IMAGE of 0.0 and 1.0 (one bit per channel value, padded to a
    square): an image that survives any 8-bit round trip exactly (ComfyUI-Distributed sends a
    worker's images to the master as PNG), so results compare bit for bit across processes."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "bits"
    CATEGORY = "tiered_offload/testing"

    def bits(self, samples):
        raw = samples["samples"].detach().cpu().contiguous().view(torch.uint8).reshape(-1)
        bits = ((raw.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1).float()
        side = 1
        while side * side * 3 < bits.numel():
            side += 1
        image = torch.zeros(side * side * 3)
        image[:bits.numel()] = bits
        return (image.reshape(1, side, side, 3),)


class TieredTestImageStats(_StatsNode):
    """Output node: the sha256 of each image of a batch (in batch order)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",)}}

    def stats(self, images):
        return {"ui": {"image_stats": [tensor_report(images[i]) for i in range(images.shape[0])]}}


class TieredTestConditioningStats(_StatsNode):
    """Output node: sha256 of an encoded CONDITIONING, to compare text encodes bit for bit."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",)}}

    def stats(self, conditioning):
        return {"ui": {"conditioning_stats": [tensor_report(conditioning[0][0])]}}


class TieredTestBlockReplace:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "scale": ("FLOAT", {"default": 1.001, "min": 0.5, "max": 2.0,
                                                 "step": 0.001})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "tiered_offload/testing"

    def patch(self, model, scale):
        m = model.clone()

        def replace(args, extra):
            out = extra["original_block"](args)
            return {k: (v * scale if k == "img" else v) for k, v in out.items()}

        for i in range(len(m.get_model_object("diffusion_model").blocks)):
            m.set_model_patch_replace(replace, "dit", "double_block", i)
        return (m,)


class OddDiffusionModel(torch.nn.Module):
    """A diffusion model with no block list at all."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class TieredTestUnsupportedModel:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "swap"
    CATEGORY = "tiered_offload/testing"

    def swap(self, model):
        m = model.clone()
        m.add_object_patch("diffusion_model", OddDiffusionModel())
        return (m,)


class TieredTestWeightReport(_StatsNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "samples": ("LATENT",)}}

    def stats(self, model, samples):
        blocks = model.get_model_object("diffusion_model").blocks
        report = {}
        for name, weight in blocks.named_parameters():
            qtype = getattr(weight, "tensor_type", None)
            report[name] = {
                "class": type(weight).__name__, "parameter": isinstance(weight, torch.nn.Parameter),
                "size": list(weight.size()), "dtype": str(weight.dtype),
                "tensor_type": None if qtype is None else getattr(qtype, "name", str(qtype)),
                "tensor_shape": list(getattr(weight, "tensor_shape", [])) or None,
                "patches": len(getattr(weight, "patches", []) or []),
            }
        return {"ui": {"weights": [report]}}


def _torch_compile_kwargs(backend: str, mode: str, fullgraph: bool, dynamic: str) -> dict:
    return {"backend": backend, "mode": None if mode == "default" else mode, "fullgraph": fullgraph,
            "dynamic": {"auto": None, "false": False, "true": True}[dynamic]}


BLOCK_LISTS = ("blocks", "joint_blocks", "double_blocks", "single_blocks")  # Wan, SD3, Flux/HunyuanVideo


# Compiled modules by the model that runs them, for "registry_block_keys" (see below).
_COMPILED_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _registry_compile_wrapper(executor, *args, **kwargs):
    """Puts in, while the model runs, the compiled modules registered for that model."""
    modules = _COMPILED_BY_MODEL.get(executor.class_obj) or {}
    import comfy.utils
    originals = {}
    try:
        for key, module in modules.items():
            originals[key] = comfy.utils.get_attr(executor.class_obj, key)
            comfy.utils.set_attr(executor.class_obj, key, module)
        return executor(*args, **kwargs)
    finally:
        for key, module in originals.items():
            comfy.utils.set_attr(executor.class_obj, key, module)


def _skip_transformer_options(guard_entries):
    return [("transformer_options" not in entry.name) for entry in guard_entries]


class TieredTestCompileBlocks:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "how": (["blocks_by_object_patch", "model_by_object_patch", "core_wrapper_block_keys",
                     "registry_block_keys"],),
            "backend": (["inductor", "cudagraphs", "eager"],),
            "mode": (["default", "reduce-overhead", "max-autotune-no-cudagraphs"],),
            "fullgraph": ("BOOLEAN", {"default": False}),
            "dynamic": (["auto", "false", "true"],),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "compile"
    CATEGORY = "tiered_offload/testing"

    def compile(self, model, how, backend, mode, fullgraph, dynamic):
        m = model.clone()
        kwargs = _torch_compile_kwargs(backend, mode, fullgraph, dynamic)
        diffusion_model = m.get_model_object("diffusion_model")
        blocks = {f"diffusion_model.{name}.{i}": block for name in BLOCK_LISTS
                  if isinstance(getattr(diffusion_model, name, None), torch.nn.ModuleList)
                  for i, block in enumerate(getattr(diffusion_model, name))}
        if how == "core_wrapper_block_keys":
            from comfy_api.torch_helpers import set_torch_compile_wrapper
            set_torch_compile_wrapper(model=m, keys=list(blocks), **kwargs)
        elif how == "registry_block_keys":
            import comfy.patcher_extension
            if kwargs["mode"] is None:
                kwargs["options"] = {"guard_filter_fn": _skip_transformer_options}
            m.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "torch.compile")
            _COMPILED_BY_MODEL[m.model] = {key: torch.compile(block, **kwargs)
                                           for key, block in blocks.items()}
            m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "torch.compile",
                                   _registry_compile_wrapper)
            m.model_options["torch_compile_kwargs"] = kwargs
        elif how == "model_by_object_patch":
            m.add_object_patch("diffusion_model", torch.compile(diffusion_model, **kwargs))
        else:
            for key, block in blocks.items():
                m.add_object_patch(key, torch.compile(getattr(block, "_orig_mod", block), **kwargs))
        return (m,)


PASS_COUNTS: list = []  # dynamo's counts after each model call of the current sampling run
WRAPPER_TABLES: list = []  # the wrapper table the model was called with, at each call


def dynamo_counts() -> dict:
    """Graphs dynamo compiled (a recompile is one more) and graph breaks it met. Not its frame
    count: frames it only looks at and leaves without a graph count there too, at moments that
    vary from run to run."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["unimplemented"].values())}


class TieredTestCompileCounts:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "count"
    CATEGORY = "tiered_offload/testing"

    @classmethod
    def IS_CHANGED(cls, **_):
        return float("nan")

    def count(self, model):
        import comfy.patcher_extension
        PASS_COUNTS.clear()
        WRAPPER_TABLES.clear()

        def after_each_call(executor, *args, **kwargs):
            options = args[5] if len(args) > 5 else kwargs.get("transformer_options", {})
            WRAPPER_TABLES.append({kind: sorted(table) for kind, table in
                                   (options.get("wrappers") or {}).items()})
            try:
                return executor(*args, **kwargs)
            finally:
                PASS_COUNTS.append(dynamo_counts())

        m = model.clone()
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL,
                               "tiered_test.compile_counts", after_each_call)
        return (m,)


class TieredTestCompileReport(_StatsNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "samples": ("LATENT",)}}

    def stats(self, model, samples):
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.utils import counters
        diffusion_model = model.get_model_object("diffusion_model")
        blocks = [b for name in BLOCK_LISTS for b in (getattr(diffusion_model, name, None) or [])]
        classes = {type(getattr(b, "_orig_mod", b)) for b in blocks}
        report = {"passes": list(PASS_COUNTS), "total": dynamo_counts(),
                  "wrapper_tables": [t for i, t in enumerate(WRAPPER_TABLES) if t not in WRAPPER_TABLES[:i]],
                  "break_reasons": sorted({reason.splitlines()[0] + " | " + reason.splitlines()[1]
                                           for reason in counters["unimplemented"]}),
                  "block_graphs": {cls.__name__: len(_debug_get_cache_entry_list(cls.forward.__code__))
                                   for cls in classes}}
        return {"ui": {"compile_counts": [report]}}


def _force_core_weight_budget(budget: float) -> None:
    import comfy.model_base
    import comfy.model_management

    load = comfy.model_management.LoadedModel.model_load

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        if isinstance(self.model.model, comfy.model_base.BaseModel):
            lowvram_model_memory = budget
        return load(self, lowvram_model_memory, force_patch_weights)

    comfy.model_management.LoadedModel.model_load = model_load


def _serve_dynamo_counts() -> None:
    """GET /tiered_test/dynamo_counts: dynamo's counts of the whole process so far, so a harness
    can tell how many graphs one prompt compiled on each server (tests/differential)."""
    try:
        from aiohttp import web
        from server import PromptServer
    except ImportError:  # imported outside a server
        return
    if getattr(PromptServer, "instance", None) is None:
        return

    @PromptServer.instance.routes.get("/tiered_test/dynamo_counts")
    async def counts(request):
        return web.json_response(dynamo_counts())


_serve_dynamo_counts()
if os.environ.get("TIERED_TEST_CORE_WEIGHT_BUDGET"):
    _force_core_weight_budget(float(os.environ["TIERED_TEST_CORE_WEIGHT_BUDGET"]))
if os.environ.get("TIERED_TEST_FIRST_LINE"):
    print(os.environ["TIERED_TEST_FIRST_LINE"], flush=True)


class TieredTestOnDevice:
    """Clones of a model and a text encoder that core would run on ``device`` (their patchers'
    load device), so a node's branch for a device this machine lacks (Apple's mps) is taken
    without running anything there."""
    RETURN_TYPES = ("MODEL", "CLIP")
    FUNCTION = "move"
    CATEGORY = "tiered_offload/testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "clip": ("CLIP",), "device": ("STRING", {"default": "mps"})}}

    def move(self, model, clip, device):
        model, clip = model.clone(), clip.clone()
        model.load_device = clip.patcher.load_device = torch.device(device)
        return (model, clip)


class TieredTestPassedThrough(_StatsNode):
    """Whether a node handed back the very model and text encoder it was given, and whether
    either carries a wrapper or callback of the pack."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "clip": ("CLIP",), "given_model": ("MODEL",),
                             "given_clip": ("CLIP",)}}

    def stats(self, model, clip, given_model, given_clip):
        def pack_keys(patcher) -> list[str]:
            keys = [k for kinds in patcher.wrappers.values() for k in kinds]
            keys += [k for kinds in patcher.callbacks.values() for k in kinds]
            return sorted(str(k) for k in keys if "tiered" in str(k).lower())
        return {"ui": {"passed_through": [{
            "model": model is given_model, "clip": clip is given_clip,
            "pack_hooks": pack_keys(model) + pack_keys(clip.patcher)}]}}


NODE_CLASS_MAPPINGS = {
    "TieredTestOnDevice": TieredTestOnDevice,
    "TieredTestPassedThrough": TieredTestPassedThrough,
    "TieredTestConditioningStats": TieredTestConditioningStats,
    "TieredTestLatentBits": TieredTestLatentBits,
    "TieredTestImageStats": TieredTestImageStats,
    "TieredTestBlockReplace": TieredTestBlockReplace,
    "TieredTestUnsupportedModel": TieredTestUnsupportedModel,
    "TieredTestConditioning": TieredTestConditioning,
    "TieredTestLatentStats": TieredTestLatentStats,
    "TieredTestWeightReport": TieredTestWeightReport,
    "TieredTestCompileBlocks": TieredTestCompileBlocks,
    "TieredTestCompileCounts": TieredTestCompileCounts,
    "TieredTestCompileReport": TieredTestCompileReport,
}
