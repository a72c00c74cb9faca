"""Disk streaming and phase granularity through a real ComfyUI server: results never change.

Each test compares the latent sha256 of a workflow with Apply Layerwise Offload against the same
workflow without it (core's full load), LoRA included, and reads what the engine did from
`GET /offload/layerwise`. A host cache is made to hold fewer units than the model has, so the
blocks really come from disk: read in place from the model's own file where the loaded tensors are
its bytes (an fp32 file: nothing is written), from a spill file of the engine's own where they are
not (a bf16 file that the CPU loads as fp32).
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

import tiny_models
from workflows import latent_sha, sample_workflow, with_inputs

PAGE = 4096
GIB = 1 << 30
FP32_WAN = "disk_wan6_fp32.safetensors"
BF16_WAN = "disk_wan6_bf16.safetensors"
WAN6_LORA = "disk_wan6_lora.safetensors"
PHASE = {"resident_blocks": 0, "prefetch": 1, "granularity": "phase"}
BLOCK = {"resident_blocks": 0, "prefetch": 1, "granularity": "block"}


@pytest.fixture(scope="module")
def wan6(comfy_base):
    """Six-block tiny Wans (so a cache can hold fewer blocks than the model): one in fp32 (its
    bytes are what ComfyUI loads), one in bf16 (loaded as fp32 on a CPU), and a LoRA on all six
    blocks."""
    models = comfy_base / "models" / "diffusion_models"
    if not (models / FP32_WAN).exists():
        tiny_models.write_tiny_wan21(models / FP32_WAN, layers=6, seed=61)
    if not (models / BF16_WAN).exists():
        tiny_models.write_tiny_wan21(models / BF16_WAN, layers=6, seed=62, dtype=torch.bfloat16)
    lora = comfy_base / "models" / "loras" / WAN6_LORA
    if not lora.exists():
        tiny_models.write_tiny_wan_lora(lora, model_layers=6, seed=63)
    return models


def engine(comfy, model_class, blocks=None):
    """The engine of the run that is on, else of the run that ended last."""
    models = [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == model_class
              and (blocks is None or m["blocks"] == blocks)]
    assert models, comfy.get("/offload/layerwise")
    return max(models, key=lambda m: (m["active"], m["finished_at"] or 0))


def cache_gb(state, entries):
    """A host cache of ``entries`` of the largest streamed unit, in GiB (what the node takes)."""
    unit = max(state["units"][i]["bytes"] for i in state["streamed_indices"])
    return entries * (-(-unit // PAGE) * PAGE) / GIB


def wan6_workflow(unet, lora=None, layerwise=None, **kw):
    wf = sample_workflow("wan21", lora_strength=lora, layerwise=layerwise, **kw)
    wf["load"]["inputs"]["unet_name"] = unet
    if lora is not None:
        wf["lora"]["inputs"]["lora_name"] = WAN6_LORA
    return wf


def assert_streamed_from_disk(state):
    disk, tel = state["disk"], state["telemetry"]
    assert disk["active"], disk
    # Every unit has a home on disk: the model's own file, or the spill file.
    assert disk["file_bytes"] + disk["spill_bytes"] >= sum(u["bytes"] for u in state["units"]), disk
    assert 0 < disk["cache_bytes"] < state["block_bytes"], "the cache held every block"
    assert tel["disk_reads"] > 0 and tel["disk_bytes_read"] > 0 and tel["disk_read_errors"] == 0, tel
    assert tel["cache_requests"] == tel["copies"] and 0 <= tel["cache_hits"] <= tel["cache_requests"], tel
    assert tel["order_misses"] == 0 and tel["sync_fallbacks"] == 0, tel
    assert 0 < tel["peak_materialized_bytes"] <= tel["peak_bound_bytes"], tel  # of every auto setting
    assert {"disk_read_gibps", "disk_wait_s", "cache_hit_rate"} <= set(tel)


@pytest.mark.parametrize("kind,model_class", [("wan21", "WanModel"),
                                              ("sd3", "OpenAISignatureMMDITWrapper"),
                                              ("hunyuan_video", "HunyuanVideo")])
def test_tiny_models_as_phases_and_from_disk_are_bit_identical(comfy, kind, model_class):
    baseline = latent_sha(comfy.run(sample_workflow(kind)))
    assert latent_sha(comfy.run(sample_workflow(kind, layerwise=PHASE))) == baseline
    phases = engine(comfy, model_class)
    assert phases["granularity"] == "phase" and len(phases["units"]) > phases["blocks"], phases["units"]
    assert phases["telemetry"]["order_misses"] == 0 and phases["telemetry"]["sync_fallbacks"] == 0
    # Phases need smaller slots than blocks: the bound follows the largest phase.
    assert latent_sha(comfy.run(sample_workflow(kind, layerwise=BLOCK))) == baseline
    blocks = engine(comfy, model_class)
    assert phases["bound_bytes"] < blocks["bound_bytes"]
    # From disk, as phases, through a cache of three of them (the model has six or more).
    disk = dict(PHASE, host_cache_gb=cache_gb(phases, 3))
    assert latent_sha(comfy.run(sample_workflow(kind, layerwise=disk))) == baseline
    state = engine(comfy, model_class)
    assert_streamed_from_disk(state)
    assert set(state["unit_states"]) <= {"in_flight", "cached", "disk"}
    # From disk as blocks, all but one kept on the device: one cached block serves every pass.
    one = dict(BLOCK, resident_blocks=blocks["blocks"] - 1, host_cache_gb=cache_gb(blocks, 1))
    assert latent_sha(comfy.run(sample_workflow(kind, layerwise=one))) == baseline
    assert engine(comfy, model_class)["disk"]["active"]
    # A later prompt without the node runs the model exactly as core would.
    assert latent_sha(comfy.run(sample_workflow(kind))) == baseline


@pytest.mark.parametrize("layerwise,entries", [(PHASE, 6), (BLOCK, 4)])
def test_lora_from_disk_is_bit_identical_and_reads_the_models_file_in_place(comfy, wan6, layerwise, entries):
    """The loaded tensors are the fp32 file's bytes: every unit is read from the model's own file
    (checked against the loaded tensors at its first read), nothing is written, and between runs
    the blocks hold no bytes; a prompt without the node gets them back from the file first."""
    plain = latent_sha(comfy.run(wan6_workflow(FP32_WAN)))
    full = latent_sha(comfy.run(wan6_workflow(FP32_WAN, lora=1.0)))
    half = latent_sha(comfy.run(wan6_workflow(FP32_WAN, lora=0.5)))
    assert len({plain, full, half}) == 3, "the LoRA must change the result"
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, layerwise=layerwise))) == plain
    sizes = engine(comfy, "WanModel", blocks=6)
    disk = dict(layerwise, host_cache_gb=cache_gb(sizes, entries))
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, lora=1.0, layerwise=disk))) == full
    state = engine(comfy, "WanModel", blocks=6)
    assert_streamed_from_disk(state)
    assert state["disk"]["model_files"] == [str(wan6 / FP32_WAN)], state["disk"]
    assert state["disk"]["spill_bytes"] == 0 and state["disk"]["spill_written_bytes"] == 0, state["disk"]
    assert state["disk"]["file_units"] == len([k for k in state["disk"]["unit_sources"] if k]), state["disk"]
    assert set(state["disk"]["unit_sources"]) <= {"file", "checking", None}, state["disk"]
    assert state["telemetry"]["transforms"] > 0, "the LoRA was not merged into the device copies"
    assert state["telemetry"]["cache_hits"] > 0, "a cache of several units never hit"
    # Base bytes on disk, LoRA merged on the device: a strength change places nothing again.
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, lora=0.5, layerwise=disk))) == half
    again = engine(comfy, "WanModel", blocks=6)
    assert again["telemetry"]["blocks_packed"] == 0
    assert set(again["disk"]["unit_sources"]) <= {"file", None}, again["disk"]
    # Without the node, core runs the model on the blocks read back from the file.
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, lora=1.0))) == full
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN))) == plain
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, lora=0.5, layerwise=disk))) == half


def test_cast_weights_are_spilled_and_stay_bit_identical(comfy, wan6):
    """A bf16 file that the CPU loads as fp32: the loaded tensors are not the file's bytes, so the
    blocks are written once to a spill file and streamed from there."""
    plain = latent_sha(comfy.run(wan6_workflow(BF16_WAN)))
    full = latent_sha(comfy.run(wan6_workflow(BF16_WAN, lora=1.0)))
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, layerwise=PHASE))) == plain
    disk = dict(PHASE, host_cache_gb=cache_gb(engine(comfy, "WanModel", blocks=6), 4))
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, lora=1.0, layerwise=disk))) == full
    state = engine(comfy, "WanModel", blocks=6)
    assert_streamed_from_disk(state)
    assert state["disk"]["spill_bytes"] >= state["host"]["packed"]
    assert state["disk"]["file_units"] == 0 and state["disk"]["spill_written_bytes"] > 0, state["disk"]
    assert state["disk"]["spill_reasons"] == {
        "tensors loaded in another dtype or layout than the file's": state["disk"]["spill_units"]}, state["disk"]
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, layerwise=disk))) == plain
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN))) == plain


def test_tier_manager_counts_disk_streamed_blocks(comfy, wan6):
    """A Tiered loader's model streamed from disk: the manager's bytes per tier say which bytes
    only the disk holds, and RAM counts the rest (the model outside its blocks, and the cache)."""
    wf = wan6_workflow(FP32_WAN, layerwise=PHASE)
    wf["load"]["class_type"] = "TieredUNETLoader"
    plain = wan6_workflow(FP32_WAN)
    plain["load"]["class_type"] = "TieredUNETLoader"
    reference = latent_sha(comfy.run(plain))
    assert latent_sha(comfy.run(wf)) == reference
    disk = with_inputs(wf, "offload", host_cache_gb=cache_gb(engine(comfy, "WanModel", blocks=6), 3))
    assert latent_sha(comfy.run(disk)) == reference
    state = engine(comfy, "WanModel", blocks=6)
    assert_streamed_from_disk(state)
    model = next(m for m in comfy.get("/offload/tiers")["models"] if m["name"] == FP32_WAN)
    on_disk = model["bytes"]["disk"]
    assert on_disk == state["host"]["disk"] > 0
    assert model["bytes"][comfy.loaded_tier()] + model["bytes"]["ram"] + on_disk == model["total_bytes"]
    assert model["layerwise"]["disk"]["active"]
    assert latent_sha(comfy.run(plain)) == reference


def test_bad_disk_settings_fail_clearly_and_the_server_keeps_serving(comfy, wan6):
    missing = comfy.base / "temp" / "no such folder"
    wf = wan6_workflow(FP32_WAN, layerwise=dict(PHASE, host_cache_gb=0.001, spill_dir=str(missing)))
    refusal = comfy.refused(wf, "offload")   # at queue time (the node's validate_inputs)
    assert "spill_dir" in refusal and "not an existing folder" in refusal, refusal
    tiny = wan6_workflow(FP32_WAN, layerwise=dict(BLOCK, host_cache_gb=0.0001))
    error = comfy.run_expect_error(tiny)
    assert "host_cache_gb=0.0001 GiB is too small" in error["exception_message"], error
    assert "disk streaming needs 3 at once" in error["exception_message"]
    assert "granularity 'phase'" in error["exception_message"]
    error = comfy.run_expect_error(wan6_workflow(FP32_WAN, layerwise=dict(PHASE, host_cache_gb=0.000001)))
    assert "host_cache_gb=1e-06 GiB is too small" in error["exception_message"], error
    assert "granularity" not in error["exception_message"], "phase units are already the smallest"
    plain = latent_sha(comfy.run(wan6_workflow(FP32_WAN)))
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, layerwise=PHASE))) == plain


def test_interrupt_while_streaming_from_disk_then_rerun_is_identical(comfy, wan6):
    # Enough steps that the interrupt, sent within 50 ms of the first disk read, lands mid-sampling
    # (a step takes about 0.2 s here), few enough that the four runs stay short.
    slow_plain = wan6_workflow(FP32_WAN, lora=1.0, steps=40)
    reference = latent_sha(comfy.run(slow_plain))
    assert latent_sha(comfy.run(wan6_workflow(FP32_WAN, layerwise=PHASE))) == \
        latent_sha(comfy.run(wan6_workflow(FP32_WAN)))
    disk = dict(PHASE, host_cache_gb=cache_gb(engine(comfy, "WanModel", blocks=6), 3))
    slow = wan6_workflow(FP32_WAN, lora=1.0, steps=40, layerwise=disk)
    prompt_id = comfy.queue(slow)
    deadline = time.time() + 120
    while time.time() < deadline:
        state = engine(comfy, "WanModel", blocks=6)
        if state["active"] and (state["telemetry"] or {}).get("disk_reads"):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the disk-streamed prompt never started sampling")
    comfy.interrupt()
    entry = comfy.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    assert not engine(comfy, "WanModel", blocks=6)["active"]
    assert latent_sha(comfy.run(slow)) == reference
    assert latent_sha(comfy.run(slow_plain)) == reference


def _spill_dir_of_last_engine(comfy) -> str:
    return engine(comfy, "WanModel", blocks=6)["disk"]["spill_dir"]


def test_spill_files_go_only_to_the_temp_folder_and_folders_the_settings_file_lists(comfy, wan6, tmp_path):
    """Any API client can queue a workflow, so spill_dir may name only ComfyUI's temp folder (or a
    folder inside it) and the folders listed under "spill_dirs" in <user dir>/tiered_offload.json.
    Every other spelling is refused before anything is written, and names the allowed folders."""
    reference = latent_sha(comfy.run(wan6_workflow(BF16_WAN)))
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, layerwise=PHASE))) == reference
    disk = dict(PHASE, host_cache_gb=cache_gb(engine(comfy, "WanModel", blocks=6), 3))
    temp = os.path.realpath(comfy.base / "temp")
    escape = tmp_path / "escape"
    escape.mkdir()
    inside = comfy.base / "temp" / "spill_link"
    inside.parent.mkdir(exist_ok=True)
    if not inside.exists():
        inside.symlink_to(escape, target_is_directory=True)  # inside the temp folder by name only
    outside = ["/", "/etc", "/dev/shm", "~", "$HOME", str(comfy.base / "temp" / ".." / ".."), str(inside),
               str(escape), "../../..", "temp"]
    for spill_dir in outside:
        message = comfy.refused(wan6_workflow(BF16_WAN, layerwise=dict(disk, spill_dir=spill_dir)), "offload")
        assert "spill_dir" in message, (spill_dir, message)
        assert ("outside the folders a spill file may go to" in message and temp in message
                and "spill_dirs" in message) or "not an absolute folder path" in message, (spill_dir, message)
    assert list(escape.iterdir()) == []
    # A folder inside the temp folder, and one the settings file lists (read at each new engine).
    sub = comfy.base / "temp" / "spill_sub"
    sub.mkdir(exist_ok=True)
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, layerwise=dict(disk, spill_dir=str(sub))))) == reference
    assert _spill_dir_of_last_engine(comfy) == os.path.realpath(sub)
    settings = comfy.base / "user" / "tiered_offload.json"
    settings.write_text(json.dumps({"spill_dirs": [str(escape)]}))
    try:
        assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, layerwise=dict(disk, spill_dir=str(inside))))) == reference
        assert _spill_dir_of_last_engine(comfy) == os.path.realpath(escape)
        settings.write_text("{not json")
        refusal = comfy.refused(wan6_workflow(BF16_WAN, layerwise=dict(disk, spill_dir="/etc")), "offload")
        assert "cannot be read" in refusal, refusal
    finally:
        settings.unlink()
    assert latent_sha(comfy.run(wan6_workflow(BF16_WAN, layerwise=disk))) == reference
    assert _spill_dir_of_last_engine(comfy) == temp
