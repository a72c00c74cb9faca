"""Apply Layerwise Offload through a real ComfyUI server: results never change.

Every test compares the latent sha256 of a workflow with the node against the same workflow
without it. The server runs with pinned OMP_NUM_THREADS, so equal hashes mean bit-identical.
"""
import time

import pytest

from comfy_server import ComfyServer
from conftest import BLOCK0_LORA, SECOND_WAN
from workflows import latent_sha, sample_workflow, with_inputs

SETTINGS = [
    {"resident_blocks": 0, "prefetch": 1},
    {"resident_blocks": 1, "prefetch": 1},
    {"resident_blocks": 0, "prefetch": 8},   # deeper than the stack
    {"resident_blocks": -1, "vram_budget_gb": 1.0, "prefetch": 2},  # budget-derived: all resident
]


def layerwise_state(comfy, model_class):
    models = [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == model_class]
    assert models, comfy.get("/offload/layerwise")
    return models[-1]


@pytest.mark.parametrize("kind,model_class", [("wan21", "WanModel"),
                                              ("sd3", "OpenAISignatureMMDITWrapper"),
                                              ("hunyuan_video", "HunyuanVideo")])
def test_offload_is_bit_identical_across_settings(comfy, kind, model_class):
    baseline = latent_sha(comfy.run(sample_workflow(kind)))
    for settings in SETTINGS:
        got = latent_sha(comfy.run(sample_workflow(kind, layerwise=settings)))
        assert got == baseline, (kind, settings)
        state = layerwise_state(comfy, model_class)
        telemetry = state["telemetry"]
        # The engine really streamed, and never held more on the device than its bound.
        if settings.get("resident_blocks", -1) == 0:
            assert state["streamed_indices"] == list(range(state["blocks"]))
            assert telemetry["copies"] > 0 and telemetry["bytes_copied"] > 0
        assert 0 < telemetry["peak_materialized_bytes"] <= state["bound_bytes"], state
    # A later prompt without the node runs the model exactly as core would.
    assert latent_sha(comfy.run(sample_workflow(kind))) == baseline


def test_lora_is_honoured_and_strength_change_repacks_nothing(comfy):
    wf = sample_workflow("wan21", lora_strength=1.0)
    wf["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    plain = latent_sha(comfy.run(sample_workflow("wan21")))
    base_full = latent_sha(comfy.run(wf))
    base_half = latent_sha(comfy.run(with_inputs(wf, "lora", strength_model=0.5)))
    assert len({plain, base_full, base_half}) == 3, "the LoRA must change the result"

    offloaded = sample_workflow("wan21", lora_strength=1.0,
                                layerwise={"resident_blocks": 0, "prefetch": 1})
    offloaded["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    assert latent_sha(comfy.run(offloaded)) == base_full
    assert latent_sha(comfy.run(with_inputs(offloaded, "lora", strength_model=0.5))) == base_half
    # The host pack keeps the base weights and the LoRA is merged into each device copy, so a
    # strength change packs nothing again; only block 0 carries LoRA weights to merge.
    telemetry = layerwise_state(comfy, "WanModel")["telemetry"]
    assert telemetry["blocks_packed"] == 0 and telemetry["transforms"] > 0
    assert latent_sha(comfy.run(offloaded)) == base_full
    # and core's own path is untouched afterwards
    assert latent_sha(comfy.run(sample_workflow("wan21"))) == plain


@pytest.mark.parametrize("settings", [{"resident_blocks": 2, "prefetch": 1},
                                      {"resident_blocks": 1, "prefetch": 1}])
def test_lora_on_resident_blocks_is_merged_once_on_a_fresh_load(comfy, settings):
    """Core's load() merges LoRA into every module it loads in full. Resident blocks already
    carry the engine's merge, so core must leave them alone, also on the prompt that loads the
    model from disk."""
    wf = sample_workflow("wan21", lora_strength=1.0)
    wf["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    base = latent_sha(comfy.run(wf))
    offloaded = sample_workflow("wan21", lora_strength=1.0, layerwise=settings)
    offloaded["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
    comfy.free()  # the next prompt loads the model again, so core's load() runs in full
    assert latent_sha(comfy.run(offloaded)) == base
    assert layerwise_state(comfy, "WanModel")["resident_indices"], "no block stayed resident"
    assert latent_sha(comfy.run(offloaded)) == base
    assert latent_sha(comfy.run(wf)) == base


def test_lora_survives_core_partial_loading_around_offloaded_runs(tmp_path, comfy_base):
    """Core's partial load marks the (empty) streamed modules as cast-at-forward. Those marks must
    not outlive the offloaded run, or core's next load of the same model skips merging its LoRA
    into the blocks."""
    server = ComfyServer(tmp_path / "base", env={"TIERED_TEST_CORE_WEIGHT_BUDGET": "0.1"})
    (server.base / "models").symlink_to(comfy_base / "models", target_is_directory=True)
    server.start()
    try:
        wf = sample_workflow("wan21", lora_strength=1.0)
        wf["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
        offloaded = sample_workflow("wan21", lora_strength=1.0,
                                    layerwise={"resident_blocks": 1, "prefetch": 1})
        offloaded["lora"]["inputs"]["lora_name"] = BLOCK0_LORA
        base = latent_sha(server.run(wf))
        assert "loaded partially" in server.log_text(), "core did not take its partial-load path"
        server.free()
        assert latent_sha(server.run(offloaded)) == base
        assert latent_sha(server.run(wf)) == base
        assert latent_sha(server.run(offloaded)) == base
        assert latent_sha(server.run(with_inputs(wf, "lora", strength_model=0.5))) != base
        assert latent_sha(server.run(wf)) == base
        # Every layout, streamed and resident blocks, beside core's partial load.
        for kind in ("wan21", "sd3", "hunyuan_video"):
            plain = latent_sha(server.run(sample_workflow(kind)))
            for settings in SETTINGS[:2]:
                assert latent_sha(server.run(sample_workflow(kind, layerwise=settings))) == plain
            assert latent_sha(server.run(sample_workflow(kind))) == plain
    finally:
        server.stop()


def test_other_dit_block_replace_patches_are_chained(comfy):
    def patched(layerwise=None):
        wf = sample_workflow("wan21", layerwise=layerwise)
        wf["patch"] = {"class_type": "TieredTestBlockReplace", "inputs": {"model": ["load", 0], "scale": 1.001}}
        target = "offload" if layerwise else "sample"
        wf[target]["inputs"]["model"] = ["patch", 0]
        return wf

    plain = latent_sha(comfy.run(sample_workflow("wan21")))
    with_patch = latent_sha(comfy.run(patched()))
    assert with_patch != plain, "the test patch must change the result"
    assert latent_sha(comfy.run(patched({"resident_blocks": 0, "prefetch": 1}))) == with_patch


def two_stage_workflow(layerwise=None):
    """Wan 2.2 style: a high-noise model for the first steps, a low-noise model after."""
    wf = sample_workflow("wan21", steps=6)
    wf["load_low"] = {"class_type": "UNETLoader",
                      "inputs": {"unet_name": SECOND_WAN, "weight_dtype": "default"}}
    high, low = ["load", 0], ["load_low", 0]
    if layerwise:
        for name, src in (("off_high", high), ("off_low", low)):
            wf[name] = {"class_type": "ApplyLayerwiseOffload",
                        "inputs": {"model": src, "vram_budget_gb": 12.0, "pin": True, **layerwise}}
        high, low = ["off_high", 0], ["off_low", 0]
    common = {"positive": ["pos", 0], "negative": ["neg", 0], "cfg": 3.0,
              "sampler_name": "euler", "scheduler": "simple", "steps": 6, "noise_seed": 42}
    wf["sample"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": high, "latent_image": ["latent", 0], "add_noise": "enable",
        "start_at_step": 0, "end_at_step": 3, "return_with_leftover_noise": "enable"}}
    wf["sample_low"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": low, "latent_image": ["sample", 0], "add_noise": "disable",
        "start_at_step": 3, "end_at_step": 6, "return_with_leftover_noise": "disable"}}
    wf["stats"]["inputs"]["samples"] = ["sample_low", 0]
    return wf


def test_two_samplers_one_workflow(comfy):
    baseline = latent_sha(comfy.run(two_stage_workflow()))
    assert latent_sha(comfy.run(two_stage_workflow({"resident_blocks": 0, "prefetch": 1}))) == baseline
    assert latent_sha(comfy.run(two_stage_workflow({"resident_blocks": 1, "prefetch": 2}))) == baseline


def test_interrupt_mid_sampling_then_rerun_is_identical(comfy):
    slow = sample_workflow("wan21", steps=300, layerwise={"resident_blocks": 0, "prefetch": 1})
    baseline = latent_sha(comfy.run(sample_workflow("wan21", steps=300)))
    prompt_id = comfy.queue(slow)
    deadline = time.time() + 60
    while time.time() < deadline:
        if any(m["active"] for m in comfy.get("/offload/layerwise")["models"]):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the offloaded prompt never started sampling")
    comfy.interrupt()
    entry = comfy.wait(prompt_id)
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds, entry["status"]
    assert not any(m["active"] for m in comfy.get("/offload/layerwise")["models"])
    assert latent_sha(comfy.run(slow)) == baseline
    assert latent_sha(comfy.run(sample_workflow("wan21", steps=300))) == baseline


def test_unsupported_model_fails_clearly_and_server_keeps_serving(comfy):
    wf = sample_workflow("wan21", layerwise={"resident_blocks": 0, "prefetch": 1})
    wf["odd"] = {"class_type": "TieredTestUnsupportedModel", "inputs": {"model": ["load", 0]}}
    wf["offload"]["inputs"]["model"] = ["odd", 0]
    error = comfy.run_expect_error(wf)
    assert error["node_type"] == "ApplyLayerwiseOffload"
    assert "OddDiffusionModel" in error["exception_message"]
    assert "double_blocks" in error["exception_message"]
    assert latent_sha(comfy.run(sample_workflow("wan21"))) is not None


@pytest.mark.parametrize("settings,fragment", [
    ({"resident_blocks": 5, "prefetch": 1}, "resident"),
    ({"resident_blocks": -1, "vram_budget_gb": 0.0001, "prefetch": 2}, "too small"),
])
def test_impossible_settings_fail_clearly(comfy, settings, fragment):
    error = comfy.run_expect_error(sample_workflow("wan21", layerwise=settings))
    assert error["node_type"] == "ApplyLayerwiseOffload"
    assert fragment in error["exception_message"]
    assert latent_sha(comfy.run(sample_workflow("wan21"))) is not None
