"""Apply Layerwise Offload on a real Dynamic VRAM model: needs CUDA and ComfyUI 0.33.

Skipped on CPU machines (`--cpu` turns Dynamic VRAM off) and on trees without Dynamic VRAM. On a
GPU with the 0.33 tree (TIERED_OFFLOAD_COMFY_ROOT/_PYTHON) core loads the tiny Wan with
ModelPatcherDynamic, and both modes must give core's own result:
- auto: core streams, no engine session, no copy; on a model core laid out before the node ran,
  the node's resident blocks own the lowest VBAR offsets after its run;
- engine: the engine streams a classic twin over the model's own host weights (no reload), whose
  cost is reported; a LoRA change reuses it.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models
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
    """The engine's Wan sessions (models core streams in the node's order are listed apart)."""
    return [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel"
            and (m.get("dynamic_vram") or {}).get("path") != "core streams"]


def ordered_by_node(comfy, blocks: int) -> list[dict]:
    return [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel"
            and (m.get("dynamic_vram") or {}).get("path") == "core streams" and m["blocks"] == blocks]


def test_server_runs_dynamic_vram(comfy):
    assert "DynamicVRAM support detected and enabled" in comfy.log_text()


def test_auto_lets_core_stream_and_matches_core(comfy):
    baseline = latent_sha(comfy.run(sample_workflow("wan21")))
    before = len(wan_sessions(comfy))
    got = latent_sha(comfy.run(sample_workflow("wan21", layerwise=dict(STREAMED, mode="auto"))))
    assert got == baseline
    assert len(wan_sessions(comfy)) == before, "auto on a dynamic model must not start the engine"
    assert "so core streams it" in comfy.log_text()


def test_engine_streams_a_classic_twin_reused_across_lora_changes(comfy):
    wf = sample_workflow("wan21", lora_strength=1.0)
    wf["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    core_full = latent_sha(comfy.run(wf))
    core_half = latent_sha(comfy.run(with_inputs(wf, "lora", strength_model=0.5)))

    engine = sample_workflow("wan21", lora_strength=1.0, layerwise=dict(STREAMED, mode="engine"))
    engine["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    assert latent_sha(comfy.run(engine)) == core_full
    first = wan_sessions(comfy)[-1]
    assert first["dynamic_vram"]["path"] == "twin", first["dynamic_vram"]
    assert first["dynamic_vram"]["shared_bytes"] > 0 and first["dynamic_vram"]["copied_bytes"] > 0

    assert latent_sha(comfy.run(with_inputs(engine, "lora", strength_model=0.5))) == core_half
    second = wan_sessions(comfy)[-1]
    assert second["module_id"] == first["module_id"], "the LoRA change must reuse the twin"
    assert second["dynamic_vram"]["uses"] == first["dynamic_vram"]["uses"] + 1
    assert comfy.log_text().count("cost of engine on a Dynamic VRAM model") >= 2


def test_auto_puts_its_resident_blocks_lowest_on_a_model_core_loaded_first(comfy):
    """Core fixes a weight's VBAR slice at the model's first dynamic load: a model sampled
    before the node ran must still end up with the node's resident blocks at the lowest offsets
    (what comfy-aimdo keeps resident), and the result must stay core's."""
    name = "tiny_wan21_vbar_order.safetensors"
    tiny_models.write_tiny_wan21(comfy.base / "models" / "diffusion_models" / name, layers=4, seed=23)
    core = sample_workflow("wan21")
    core["load"]["inputs"]["unet_name"] = name
    baseline = latent_sha(comfy.run(core))
    node = sample_workflow("wan21", layerwise={"resident_blocks": 2, "prefetch": 1, "mode": "auto"})
    node["load"]["inputs"]["unet_name"] = name
    assert latent_sha(comfy.run(node)) == baseline
    entry = ordered_by_node(comfy, 4)[-1]
    dv = entry["dynamic_vram"]
    assert entry["resident_indices"] == [1, 3] and entry["streamed_indices"] == [0, 2]
    assert dv["order"] == "in force" and dv["relayouts"] >= 1, dv
    spans, rest = dv["vbar_spans"]["blocks"], dv["vbar_spans"]["rest"]
    assert all(spans[i][1] <= rest[0] for i in (1, 3)), dv["vbar_spans"]
    assert all(spans[i][0] >= rest[1] for i in (0, 2)), dv["vbar_spans"]
    assert dv["residency_source"] == "vbar" and dv["core_resident_blocks"] is not None
    # A changed count takes effect on the next run.
    fewer = with_inputs(node, "offload", resident_blocks=1)
    assert latent_sha(comfy.run(fewer)) == baseline
    entry = ordered_by_node(comfy, 4)[-1]
    spans, rest = entry["dynamic_vram"]["vbar_spans"]["blocks"], entry["dynamic_vram"]["vbar_spans"]["rest"]
    assert entry["resident_indices"] == [2] and spans[2][1] <= rest[0]
