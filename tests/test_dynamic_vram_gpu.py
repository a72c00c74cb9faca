"""Apply Layerwise Offload on a real Dynamic VRAM model: needs CUDA and ComfyUI 0.33.

Skipped on CPU machines (`--cpu` turns Dynamic VRAM off) and on trees without Dynamic VRAM. On a
GPU with the 0.33 tree (TIERED_OFFLOAD_COMFY_ROOT/_PYTHON) a server that asks for Dynamic VRAM
loads the tiny Wan with ModelPatcherDynamic (the suite's other servers start classic, see
comfy_server.py), and:
- auto: core streams, no engine session, no copy, so the result is core's Dynamic VRAM run's; on
  a model core laid out before the node ran, the node's resident blocks own the lowest VBAR
  offsets after its run;
- engine: the engine streams a classic twin over the model's own host weights (no reload), whose
  cost is reported, and merges a LoRA as core's classic full load does (in core's LoRA dtype on
  the device, then rounded stochastically to the weight's dtype): its result with a LoRA is the
  classic reference's, a server started with `--disable-dynamic-vram`. Core's Dynamic VRAM run
  merges the LoRA on every cast, in the dtype it casts the weight to (LowVramPatch, for modules
  over 16 KiB, which the tiny Wan's are), without that rounding, so its
  result with a LoRA may differ from both: the test records how it relates (a test property and
  tests/artifacts/.../dynamic_vram_lora.json) and asserts nothing about it. A LoRA change reuses
  the twin.
"""
from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from comfy_server import COMFY_ROOT, ComfyServer
from conftest import ARTIFACTS, BLOCK0_LORA
from workflows import latent_sha, sample_workflow, with_inputs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Dynamic VRAM needs CUDA"),
    pytest.mark.skipif("class ModelPatcherDynamic" not in (COMFY_ROOT / "comfy" / "model_patcher.py").read_text(),
                       reason="this ComfyUI has no Dynamic VRAM"),
]

STREAMED = {"resident_blocks": 1, "prefetch": 1}


def _server(base, comfy_base, *, dynamic_vram: bool) -> ComfyServer:
    server = ComfyServer(base, dynamic_vram=dynamic_vram)
    (server.base / "models").symlink_to(comfy_base / "models", target_is_directory=True)
    return server.start()


@pytest.fixture(scope="module")
def comfy(tmp_path_factory, comfy_base):
    """A server with core's default loading: Dynamic VRAM on a GPU."""
    server = _server(tmp_path_factory.mktemp("dynamic") / "base", comfy_base, dynamic_vram=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def classic(tmp_path_factory, comfy_base):
    """The classic reference: the same tree with `--disable-dynamic-vram`."""
    server = _server(tmp_path_factory.mktemp("classic") / "base", comfy_base, dynamic_vram=False)
    yield server
    server.stop()


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


def test_classic_reference_runs_classic(classic):
    assert "DynamicVRAM support detected and enabled" not in classic.log_text()
    assert "Dynamic vram disabled with argument" in classic.log_text()


def test_engine_with_a_lora_gives_the_classic_result_and_reuses_its_twin(comfy, classic, record_property):
    wf = sample_workflow("wan21", lora_strength=1.0)
    wf["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    half = with_inputs(wf, "lora", strength_model=0.5)
    classic_full, classic_half = latent_sha(classic.run(wf)), latent_sha(classic.run(half))
    assert classic_full != classic_half, "the LoRA's strength must change the result"
    dynamic_full, dynamic_half = latent_sha(comfy.run(wf)), latent_sha(comfy.run(half))

    engine = sample_workflow("wan21", lora_strength=1.0, layerwise=dict(STREAMED, mode="engine"))
    engine["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    engine_full = latent_sha(comfy.run(engine))
    first = wan_sessions(comfy)[-1]
    engine_half = latent_sha(comfy.run(with_inputs(engine, "lora", strength_model=0.5)))
    second = wan_sessions(comfy)[-1]
    # Measured, not assumed: how core's Dynamic VRAM run with a LoRA relates to the classic one.
    relation = {"strength_1.0": {"classic": classic_full, "dynamic": dynamic_full, "engine": engine_full,
                                 "dynamic_equals_classic": dynamic_full == classic_full},
                "strength_0.5": {"classic": classic_half, "dynamic": dynamic_half, "engine": engine_half,
                                 "dynamic_equals_classic": dynamic_half == classic_half}}
    record_property("core_dynamic_lora_vs_classic", relation)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "dynamic_vram_lora.json").write_text(json.dumps(relation, indent=1))

    assert engine_full == classic_full and engine_half == classic_half, relation
    assert first["dynamic_vram"]["path"] == "twin", first["dynamic_vram"]
    assert first["dynamic_vram"]["shared_bytes"] > 0 and first["dynamic_vram"]["copied_bytes"] > 0
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
