"""API-format workflows for the tiny fixture models, with optional pack nodes spliced in."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import example_workflows  # noqa: E402
import tiny_models  # noqa: E402

LORA_FILE = tiny_models.LORAS[next(iter(tiny_models.LORAS))]["filename"]


def sample_workflow(kind: str, *, layerwise: dict[str, Any] | None = None,
                    lora_strength: float | None = None, seed: int = 42, steps: int = 4,
                    cfg: float = 3.0, sampler: str = "euler") -> dict:
    """UNETLoader → [LoRA] → [Apply Layerwise Offload] → KSampler → latent stats."""
    spec = tiny_models.MODELS[kind]
    wf: dict[str, dict] = {
        "load": {"class_type": "UNETLoader",
                 "inputs": {"unet_name": spec["filename"], "weight_dtype": "default"}},
        "pos": {"class_type": "TieredTestConditioning", "inputs": {"model_kind": kind, "seed": 1}},
        "neg": {"class_type": "TieredTestConditioning", "inputs": {"model_kind": kind, "seed": 2}},
        "latent": {"class_type": spec["latent"]["node"], "inputs": dict(spec["latent"]["inputs"])},
        "stats": {"class_type": "TieredTestLatentStats", "inputs": {"samples": ["sample", 0]}},
    }
    model = ["load", 0]
    if lora_strength is not None:
        wf["lora"] = {"class_type": "LoraLoaderModelOnly",
                      "inputs": {"model": model, "lora_name": LORA_FILE,
                                 "strength_model": lora_strength}}
        model = ["lora", 0]
    if layerwise is not None:
        inputs = {"resident_blocks": -1, "vram_budget_gb": 12.0, "prefetch": 2, "pin": True}
        inputs.update(layerwise)
        wf["offload"] = {"class_type": "ApplyLayerwiseOffload", "inputs": {"model": model, **inputs}}
        model = ["offload", 0]
    wf["sample"] = {"class_type": "KSampler",
                    "inputs": {"model": model, "positive": ["pos", 0], "negative": ["neg", 0],
                               "latent_image": ["latent", 0], "seed": seed, "steps": steps,
                               "cfg": cfg, "sampler_name": sampler, "scheduler": "simple",
                               "denoise": 1.0}}
    return wf


def latent_sha(outputs: dict, node: str = "stats") -> str:
    info = outputs[node]["latent_stats"][0]
    assert info["finite"], info
    return info["sha256"]


def with_inputs(wf: dict, node: str, **inputs: Any) -> dict:
    out = copy.deepcopy(wf)
    out[node]["inputs"].update(inputs)
    return out


def streamed_demo() -> dict[str, dict]:
    """The demo workflow with streaming fixed on the node (2 of its 12 blocks resident, prefetch
    2, whole blocks): the panel tests' picture, the same on every machine. The demo itself runs
    the node's defaults, which keep the small demo model whole."""
    wf = example_workflows.demo()
    [node] = [n for n in wf.values() if n["class_type"] == "ApplyLayerwiseOffload"]
    node["inputs"].update(resident_blocks=2, vram_budget_gb=12.0, prefetch=2, disk_workers=2,
                          granularity="block")
    return wf
