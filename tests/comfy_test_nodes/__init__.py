"""Test-only ComfyUI nodes. Linked into the test server's custom_nodes; never shipped.

- TieredTestConditioning: CONDITIONING of the right shape for a tiny fixture DiT. It reports
  itself as always changed, so every queued prompt really samples again instead of being
  answered from ComfyUI's output cache.
- TieredTestLatentStats: an output node that puts a latent's shape, finiteness and sha256 into
  /history, so tests compare results bit for bit.
"""
import hashlib
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


class TieredTestLatentStats:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    RETURN_TYPES = ()
    FUNCTION = "stats"
    OUTPUT_NODE = True
    CATEGORY = "tiered_offload/testing"

    def stats(self, samples):
        t = samples["samples"].detach().cpu().contiguous()
        info = {
            "shape": list(t.shape),
            "dtype": str(t.dtype),
            "finite": bool(torch.isfinite(t).all()),
            "sha256": hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest(),
        }
        return {"ui": {"latent_stats": [info]}}


NODE_CLASS_MAPPINGS = {
    "TieredTestConditioning": TieredTestConditioning,
    "TieredTestLatentStats": TieredTestLatentStats,
}
