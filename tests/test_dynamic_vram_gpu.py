"""Apply Layerwise Offload on a real Dynamic VRAM model: needs CUDA and ComfyUI 0.33.

Skipped on CPU machines (`--cpu` turns Dynamic VRAM off) and on trees without Dynamic VRAM. On a
GPU with the 0.33 tree (TIERED_OFFLOAD_COMFY_ROOT/_PYTHON) core loads the tiny Wan with
ModelPatcherDynamic, and both modes must give core's own result:
- auto: core streams, no engine session, no copy;
- engine: the engine streams a classic copy whose cost is reported; a LoRA change reuses it.
"""
from __future__ import annotations

import pytest
import torch

from comfy_server import COMFY_ROOT
from conftest import BLOCK0_LORA
from workflows import latent_sha, sample_workflow, with_inputs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Dynamic VRAM needs CUDA"),
    pytest.mark.skipif("class ModelPatcherDynamic" not in (COMFY_ROOT / "comfy" / "model_patcher.py").read_text(),
                       reason="this ComfyUI has no Dynamic VRAM"),
]

STREAMED = {"resident_blocks": 1, "prefetch": 1}


def wan_sessions(comfy) -> list[dict]:
    return [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel"]


def test_server_runs_dynamic_vram(comfy):
    assert "DynamicVRAM support detected and enabled" in comfy.log_text()


def test_auto_lets_core_stream_and_matches_core(comfy):
    baseline = latent_sha(comfy.run(sample_workflow("wan21")))
    before = len(wan_sessions(comfy))
    got = latent_sha(comfy.run(sample_workflow("wan21", layerwise=dict(STREAMED, mode="auto"))))
    assert got == baseline
    assert len(wan_sessions(comfy)) == before, "auto on a dynamic model must not start the engine"
    assert "so core streams it" in comfy.log_text()


def test_engine_streams_a_classic_copy_reused_across_lora_changes(comfy):
    wf = sample_workflow("wan21", lora_strength=1.0)
    wf["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    core_full = latent_sha(comfy.run(wf))
    core_half = latent_sha(comfy.run(with_inputs(wf, "lora", strength_model=0.5)))

    engine = sample_workflow("wan21", lora_strength=1.0, layerwise=dict(STREAMED, mode="engine"))
    engine["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    assert latent_sha(comfy.run(engine)) == core_full
    first = wan_sessions(comfy)[-1]
    assert first["dynamic_vram"]["path"] == "classic copy"
    assert first["dynamic_vram"]["extra_ram_bytes"] > 0

    assert latent_sha(comfy.run(with_inputs(engine, "lora", strength_model=0.5))) == core_half
    second = wan_sessions(comfy)[-1]
    assert second["module_id"] == first["module_id"], "the LoRA change must reuse the copy"
    assert second["dynamic_vram"]["uses"] == first["dynamic_vram"]["uses"] + 1
    assert comfy.log_text().count("cost of engine on a Dynamic VRAM model") >= 2
