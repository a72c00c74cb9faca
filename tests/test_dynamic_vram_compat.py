"""Apply Layerwise Offload's `mode` on classic and Dynamic VRAM models, against the tree under test.

The probe (dynamic_vram_probe.py) runs in ComfyUI's own Python with ComfyUI's real loader, clone
and ModelPatcherDynamic code. On 0.3.75 only the classic case exists; the dynamic cases run where
the tree has ModelPatcherDynamic (the 0.33 lane), on stand-in patchers
(dynamic_vram_standin.py), because a real one needs comfy-aimdo on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from comfy_server import COMFY_PYTHON, COMFY_ROOT
from conftest import TESTS


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dynamic_probe")
    proc = subprocess.run([COMFY_PYTHON, "-W", "ignore", str(TESTS / "dynamic_vram_probe.py"), str(out)],
                          cwd=COMFY_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dynamic(probe) -> dict:
    if probe["dynamic"] is None:
        pytest.skip("this ComfyUI has no Dynamic VRAM (ModelPatcherDynamic)")
    return probe["dynamic"]


def test_classic_model_gets_a_plain_clone_in_both_modes(probe):
    assert probe["classic"] == {"input_dynamic": False, "is_clone": True, "shares_module": True,
                                "output_dynamic": False, "modes_share_module": True,
                                "modes_have_units_patch": [False, False], "engine_session": True}


def test_auto_lets_core_stream_a_dynamic_model_without_a_copy(dynamic):
    auto = dynamic["auto"]
    assert auto["output_dynamic"] and auto["shares_module"]
    assert auto["loader_calls"] == 0 and not auto["engine_session"]
    # 2 resident of 4, spread evenly: the engine's own choice.
    assert auto["resident"] == [1, 3] and auto["streamed"] == [0, 2]


def test_core_load_puts_the_nodes_resident_blocks_first_and_streamed_blocks_last(dynamic):
    order = dynamic["order_with_node"]
    assert order["had_units_during_load"] and order["patch_restored"]
    spans = {int(k): v for k, v in order["block_spans"].items()}
    low, high = order["other_range"]
    # Lower VBAR addresses are the ones comfy-aimdo keeps resident under pressure.
    assert spans[1][1] <= spans[3][0] and spans[3][1] <= low
    assert high < min(spans[0][0], spans[2][0])
    assert all(order["unit_roots_marked"])
    # Without the node core orders by size: the blocks' weights interleave through the range.
    alone = dynamic["order_core_alone"]
    assert not alone["had_units_during_load"]
    alone_spans = {int(k): v for k, v in alone["block_spans"].items()}
    assert alone_spans[0][1] > alone_spans[1][0]


def test_dynamic_model_gets_a_classic_delegate(dynamic):
    engine = dynamic["engine"]
    assert engine["output_type"] == "ModelPatcher" and not engine["output_dynamic"]
    assert engine["new_module"] and engine["same_weights"]
    assert engine["loader_calls_first"] == 1


def test_lora_change_and_other_settings_reuse_the_delegate(dynamic):
    engine = dynamic["engine"]
    assert engine["loader_calls_after_lora_and_settings"] == 1
    assert engine["lora_reuses_copy"] and engine["lora_patches_kept"]
    assert engine["uses"] == 3


def test_engine_cost_is_in_the_layerwise_report(dynamic):
    engine = dynamic["engine"]
    report = engine["report"]
    assert report["path"] == "classic copy" and report["uses"] == 3
    assert report["extra_ram_bytes"] == engine["model_size"] > 0
    assert report["reload_seconds"] > 0
    assert f"second copy of the model in RAM ({engine['model_size'] / 2**20:.1f} MiB)" in report["cost"]


def test_refused_models_cost_no_copy(dynamic):
    refused = dynamic["refused"]
    assert refused["budget"] == "ValueError"
    assert refused["unsupported_model"] == "UnsupportedModelError"
    assert refused["loader_calls"] == 0 and refused["no_copy_kept"]
    assert "use mode auto" in refused["no_loader_engine"]
    assert refused["no_loader_auto_dynamic"]
    assert "mode must be one of auto, engine" in refused["bad_mode"]


def test_delegate_is_released_with_its_model(dynamic):
    assert dynamic["released"] == {"model_freed": True, "copy_freed": True, "copies_left": 0,
                                   "engine_session_left": False}


def test_cost_tool_runs(dynamic, tmp_path):
    """tools/dynamic_vram_cost.py (the README's cost figures) on a tiny Wan, so it never rots."""
    out = tmp_path / "cost.json"
    proc = subprocess.run([COMFY_PYTHON, "-W", "ignore", str(TESTS.parent / "tools" / "dynamic_vram_cost.py"),
                           "--out", str(out), "--layers", "2", "--dim", "128", "--ffn-dim", "256",
                           "--dtype", "fp32"],
                          cwd=COMFY_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(out.read_text())
    steps = {s["step"]: s for s in result["steps"]}
    assert list(steps) == ["auto", "engine, first", "engine, LoRA change", "engine, refused settings"]
    assert [steps[s]["mode"] for s in steps] == ["auto", "engine", "engine", "engine"]
    assert all(steps[s]["error"] is None for s in list(steps)[:3])
    assert steps["engine, refused settings"]["error"].startswith("ValueError")
    assert result["model_bytes"] > 0 and all(s["seconds"] > 0 for s in steps.values())
