"""Test-only ComfyUI nodes. Linked into the test server's custom_nodes; never shipped.

- TieredTestConditioning: CONDITIONING of the right shape for a tiny fixture DiT. It reports
  itself as always changed, so every queued prompt really samples again instead of being
  answered from ComfyUI's output cache.
- TieredTestLatentStats: an output node that puts a latent's shape, finiteness and sha256 into
  /history, so tests compare results bit for bit.
- TieredTestBlockReplace: a `dit` block-replace patch on every block, like TeaCache-style nodes
  install; it scales each block's output slightly so its effect shows in the result.
- TieredTestUnsupportedModel: swaps the diffusion model (through an object patch on a clone)
  for a module with no block list, to exercise the "unsupported model" error.
- TieredTestWeightReport: an output node that puts, for every parameter of the diffusion
  model's blocks, its class, whether it is a Parameter, its storage size and dtype, and the
  GGUF attributes (tensor_type, tensor_shape, number of patches) into /history. It takes the
  sampled latent too, so it runs after sampling.

With TIERED_TEST_CORE_WEIGHT_BUDGET=<bytes> in the server's environment, core loads every
diffusion model with that weight budget: its real partial-loading ("lowvram") path, which
--cpu otherwise never takes.

With TIERED_TEST_FIRST_LINE=<text>, the text is printed when this package loads. ComfyUI's log
buffer (app/logger.py, 0.3.75 and 0.33) fails with "deque index out of range" on a progress line
that comes before any other output, and the sampler's progress bar is the first output of a
server whose log level hides every record (--verbose CRITICAL).
"""
import hashlib
import os
import sys
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


def _force_core_weight_budget(budget: float) -> None:
    import comfy.model_base
    import comfy.model_management

    load = comfy.model_management.LoadedModel.model_load

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        if isinstance(self.model.model, comfy.model_base.BaseModel):
            lowvram_model_memory = budget
        return load(self, lowvram_model_memory, force_patch_weights)

    comfy.model_management.LoadedModel.model_load = model_load


if os.environ.get("TIERED_TEST_CORE_WEIGHT_BUDGET"):
    _force_core_weight_budget(float(os.environ["TIERED_TEST_CORE_WEIGHT_BUDGET"]))
if os.environ.get("TIERED_TEST_FIRST_LINE"):
    print(os.environ["TIERED_TEST_FIRST_LINE"], flush=True)


NODE_CLASS_MAPPINGS = {
    "TieredTestConditioningStats": TieredTestConditioningStats,
    "TieredTestBlockReplace": TieredTestBlockReplace,
    "TieredTestUnsupportedModel": TieredTestUnsupportedModel,
    "TieredTestConditioning": TieredTestConditioning,
    "TieredTestLatentStats": TieredTestLatentStats,
    "TieredTestWeightReport": TieredTestWeightReport,
}
