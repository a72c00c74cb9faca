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
def probe(dynamic_vram_probe) -> dict:
    return dynamic_vram_probe


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
    assert auto["block_hooks"] == 0, "auto must add no streamer or hook of its own"
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


def test_engine_gets_a_classic_twin_over_the_models_own_block_tensors(dynamic):
    engine = dynamic["engine"]
    assert engine["output_type"] == "ModelPatcher" and not engine["output_dynamic"]
    assert engine["new_module"] and engine["same_weights"]
    assert engine["loader_calls_first"] == 0, "no reload from disk"
    assert engine["blocks_shared"], "the twin's blocks must be the dynamic model's own tensors"
    assert engine["rest_shared"] == [], "weights outside the blocks are copied (core may pin them)"


def test_lora_change_and_other_settings_reuse_the_delegate(dynamic):
    engine = dynamic["engine"]
    assert engine["loader_calls_after_lora_and_settings"] == 0
    assert engine["lora_reuses_copy"] and engine["lora_patches_kept"]
    assert engine["uses"] == 3


def test_engine_cost_is_in_the_layerwise_report(dynamic):
    engine = dynamic["engine"]
    report = engine["report"]
    assert report["path"] == "twin" and report["uses"] == 3 and report["reason"] is None
    assert 0 < report["copied_bytes"] < report["shared_bytes"] < engine["model_size"]
    assert report["shared_bytes"] + report["copied_bytes"] == engine["model_size"]
    assert report["cost"].startswith("engine on a Dynamic VRAM model: no reload")


def test_refused_models_cost_no_copy(dynamic):
    refused = dynamic["refused"]
    assert refused["budget"] == "ValueError"
    assert refused["unsupported_model"] == "UnsupportedModelError"
    assert refused["loader_calls"] == 0 and refused["no_copy_kept"]
    assert refused["no_loader_engine"] == ["twin", True], "the twin needs no loader"
    assert refused["no_loader_auto_dynamic"]


def test_without_a_twin_the_engine_falls_back_to_a_reload_and_says_so(dynamic):
    refused = dynamic["refused"]
    no_twin = refused["no_twin"]
    assert no_twin["path"] == "classic copy" and no_twin["loader_calls"] == 1
    assert "second copy of the model in RAM" in no_twin["cost"] and "no twin" in no_twin["cost"]
    assert "use mode auto" in refused["no_twin_no_loader"]
    assert "mode must be one of auto, engine" in refused["bad_mode"]


def test_delegate_is_released_with_its_model(dynamic):
    assert dynamic["released"] == {"model_freed": True, "copy_freed": True, "copies_left": 0,
                                   "engine_session_left": False}


def test_engine_on_a_dynamic_model_holds_one_host_copy(dynamic, tmp_path):
    """tools/dynamic_vram_cost.py (the RAM figures of docs/dynamic-vram.md) on a 150 MiB Wan whose
    weights are a read-only map of its file, as core's Dynamic VRAM loader makes them: the engine's
    output copies only the weights outside the blocks, its run adds the pack of the blocks and
    nothing else, so the process holds the file's pages once and one anonymous copy of the model."""
    out = tmp_path / "cost.json"
    proc = subprocess.run([COMFY_PYTHON, "-W", "ignore", str(TESTS.parent / "tools" / "dynamic_vram_cost.py"),
                           "--out", str(out), "--layers", "8", "--dim", "512", "--ffn-dim", "2048"],
                          cwd=COMFY_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(out.read_text())
    steps = {s["step"]: s for s in result["steps"]}
    assert list(steps) == ["auto", "engine, first", "engine, first run", "engine, LoRA change",
                           "engine, refused settings"]
    assert all(steps[s]["error"] is None for s in list(steps)[:4])
    assert steps["engine, refused settings"]["error"].startswith("ValueError")
    model, blocks = result["model_bytes"], result["block_bytes"]
    assert model - result["mapped_bytes"] < 2**16, "the stand-in's weights are the file's pages"
    slack = 16 * 2**20 + model // 20
    rest = model - blocks
    # apply: the twin copies the weights outside the blocks, never the model.
    assert steps["auto"]["anon_delta_bytes"] < slack
    assert steps["engine, first"]["anon_delta_bytes"] < rest + slack
    # the first run: the engine's pack of the blocks, built from the mapped weights.
    assert steps["engine, first run"]["anon_delta_bytes"] < blocks + slack
    engine = sum(steps[s]["anon_delta_bytes"] for s in ("engine, first", "engine, first run"))
    assert engine < model + slack, "one anonymous copy of the model, not two"
    assert all(s["file_delta_bytes"] < slack for s in steps.values()), "no second map of the file"
    assert steps["engine, LoRA change"]["anon_delta_bytes"] < slack


# ---------------------------------------------------------------- auto on a laid-out model
# Core gives a weight its VBAR slice at the model's first dynamic load and keeps it; these runs
# are core's own sampler on the stand-in, first without the node, then with it.

def _steps(dynamic) -> dict:
    return {s["step"]: s for s in dynamic["orders"]["steps"]}


def _resident_first(layout, resident, streamed) -> bool:
    """The resident blocks own the lowest addresses, the streamed blocks the highest."""
    spans, rest = layout["blocks"], layout["rest"]
    low = [spans[i] for i in resident]
    high = [spans[i] for i in streamed]
    return all(s[1] <= rest[0] for s in low) and all(s[0] >= rest[1] for s in high)


def test_core_alone_interleaves_the_blocks(dynamic):
    core = dynamic["orders"]["core_alone"]
    assert not _resident_first(core, [1, 3], [0, 2])


def test_a_model_sampled_before_the_node_gets_the_nodes_order(dynamic):
    step = _steps(dynamic)["node after core"]
    assert step["resident"] == [1, 3] and step["streamed"] == [0, 2]
    assert _resident_first(step["layout"], [1, 3], [0, 2])
    assert step["layout"]["blocks"][1][1] <= step["layout"]["blocks"][3][0], "resident blocks in order"
    dv = step["dynamic_vram"]
    assert dv["order"] == "in force" and dv["order_in_force"] is True and dv["message"] is None
    assert dv["relayouts"] == 1
    assert step["same_as_core"], "re-laying out the VRAM must not change a bit of the result"


def test_the_old_layout_went_back_to_core(dynamic):
    orders = dynamic["orders"]
    assert orders["first_vbar_unpinned"] > 0, "every slice handed back through vbar_unpin"
    assert orders["first_vbar_freed"], "the old VBAR is dropped, so the address space stays bounded"


def test_a_changed_resident_blocks_takes_effect(dynamic):
    step = _steps(dynamic)["resident_blocks changed"]
    assert step["resident"] == [2] and _resident_first(step["layout"], [2], [0, 1, 3])
    assert step["dynamic_vram"]["order"] == "in force" and step["dynamic_vram"]["relayouts"] == 2
    assert step["same_as_core"]


def test_the_same_settings_again_keep_the_layout(dynamic):
    steps = _steps(dynamic)
    again = steps["same settings again"]
    assert again["dynamic_vram"]["relayouts"] == 2
    assert again["layout"] == steps["resident_blocks changed"]["layout"]


def test_the_default_plans_resident_blocks_from_free_memory(dynamic):
    step = _steps(dynamic)["default settings"]
    # On the stand-in the load device is host memory, plentiful for 4 tiny blocks: all resident.
    assert step["budget_bytes"] and step["budget_bytes"] > 0
    assert step["resident"] == [0, 1, 2, 3] and step["streamed"] == []
    assert step["dynamic_vram"]["order"] == "in force" and step["same_as_core"]


def test_a_budget_plans_what_it_pays_for(dynamic):
    orders = dynamic["orders"]
    step = _steps(dynamic)["a budget for one block"]
    assert step["budget_bytes"] == orders["one_block_budget_bytes"]
    assert step["resident"] == [2] and _resident_first(step["layout"], [2], [0, 1, 3])
    assert step["dynamic_vram"]["order"] == "in force" and step["same_as_core"]


def test_auto_adds_no_streamer_and_says_how_core_streams(dynamic):
    orders = dynamic["orders"]
    for step in orders["steps"]:
        assert step["block_hooks"] == [0, 0], step["step"]
    assert orders["engine_sessions_for_model"] == 0
    dv = orders["steps"][0]["dynamic_vram"]
    # 0.33 has comfy/model_prefetch.py, but Wan's loop does not call it.
    assert dv["core_prefetch"] is False
    assert "adds no streamer" in dv["streaming"]


def test_a_layout_that_cannot_be_handed_back_is_said_plainly(dynamic):
    held = dynamic["orders"]["held"]
    dv = held["dynamic_vram"]
    assert dv["order"] == "fixed by an earlier load" and dv["order_in_force"] is False
    assert "order already fixed by an earlier load" in dv["message"]
    assert "takes effect after the model is reloaded" in dv["message"]
    assert "/free" in dv["message"] and "CUDA graph" in dv["message"]
    assert len(held["warnings"]) == 1 and held["layout_unchanged"]
    assert held["same_as_core"]


def test_the_runs_measurements_choose_which_blocks_core_keeps(dynamic):
    """auto with a budget on HunyuanVideo (double blocks over twice the size of single ones): the
    first run is timed in the budget's order (one single block first), the next is laid out in
    the order the measurements chose (the double blocks first: their copies cost most), the one
    after holds it; core's output never changes and no hook of the node's is left on the model.
    The link is the probe's 1 GB/s (the stand-in's copies are memcpys a busy host slows down);
    the real timed copy is checked to give a rate."""
    case = dynamic["measured_order"]
    sizes = case["block_bytes"]
    first, second, third = case["runs"]
    assert first["resident"] == [3] and first["in_force"], first
    assert first["tuning"]["phase"] == "plan" and len(first["tuning"]["block_ms"]) == len(sizes)
    assert all(t > 0 for t in first["tuning"]["block_ms"]) and case["timed_copy_bytes_per_ms"] > 0
    assert first["tuning"]["link_bytes_per_ms"] == 1e6, "the probe's link (the stand-in has none)"
    doubles = [i for i, b in enumerate(sizes) if b == max(sizes)]
    assert second["resident"] == doubles and second["in_force"], second
    assert second["relayouts"] == first["relayouts"] + 1, "laid out again once, for the measured order"
    change = second["tuning"]["changes"]
    assert [c["to"]["resident_blocks"] for c in change] == [doubles] and change[0]["why"] == "planned"
    assert second["tuning"]["predicted_ms"] > 0 and second["tuning"]["measured_ms"] > 0
    assert f"blocks {', '.join(map(str, doubles))} first in VRAM" in second["tuning"]["reason"]
    assert third["resident"] == doubles and third["relayouts"] == second["relayouts"], third
    assert third["tuning"]["phase"] == "hold" and third["auto_settings"] == ["resident"]
    assert all(r["same_as_core"] for r in case["runs"]), "an order must not change a bit of the result"
    assert all(r["hooks_after"] == 0 for r in case["runs"]), "the timing hooks come off with the run"


def test_an_interrupt_in_a_timed_run_leaves_no_hook_and_the_next_runs_right(dynamic):
    interrupted = dynamic["measured_order"]["interrupted"]
    assert interrupted["raised"], "the interrupt must reach the sampler's caller"
    assert interrupted["hooks_left"] == 0, "the timing hooks come off with the interrupted run"
    assert interrupted["next_runs_same_as_core"] == [True, True]


def test_a_fixed_count_stays_and_says_what_auto_would_keep(dynamic):
    """resident_blocks fixed on the node, the measured order's model and budget: every run keeps
    the user's block; the first run is timed (its hooks come off), and the report gives what auto
    would keep first (the double blocks, as auto does) and the step that would save; the second
    run is neither timed nor laid out again; core's output never changes."""
    case = dynamic["fixed_count"]
    sizes = case["block_bytes"]
    first, second = case["runs"]
    doubles = [i for i, b in enumerate(sizes) if b == max(sizes)]
    assert first["resident"] == second["resident"] and len(first["resident"]) == 1, case
    assert first["resident"] != doubles and first["auto_settings"] == [] == second["auto_settings"]
    tuning = first["tuning"]
    assert tuning["auto"] == [] and tuning["phase"] == "hold" and not tuning["changes"], tuning
    assert tuning["setting"]["resident_blocks"] == first["resident"], tuning
    assert tuning["auto_choice"]["resident_blocks"] == doubles, tuning
    assert tuning["explicit_cost_ms"] > 0 and tuning["auto_predicted_ms"] > 0, tuning
    assert f"blocks {', '.join(map(str, doubles))} first in VRAM" in tuning["auto_reason"], tuning
    assert second["tuning"]["passes"] == tuning["passes"] == 1, "measured once per latent shape"
    assert second["relayouts"] == first["relayouts"], "the user's order is not laid out again"
    assert all(r["same_as_core"] for r in case["runs"]) and all(r["hooks_after"] == 0 for r in case["runs"])
