"""Apply Layerwise Offload's device budget is what core's own sampler would leave the model.

The probe (budget_probe.py) runs in the tree under test: core's real `_prepare_sampling`
(activation estimate, `load_models_gpu`, `free_memory`) against the node's `device_room` on the
same model and the same free memory, for ComfyUI's default reserve and `--reserve-vram`, small
and large latents, a partly loaded model and the weight ratio core uses off NVIDIA.
"""
from __future__ import annotations

import pytest

from comfy_server import run_tree_script
from conftest import TESTS

GIB = 1024 ** 3


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("budget") / "budget.json"
    return run_tree_script(TESTS / "budget_probe.py", out, threads=2, timeout=600)


def test_the_weight_room_is_cores_own_figure(probe):
    scenarios = probe["scenarios"]
    assert len(scenarios) == 6
    for sc in scenarios:
        assert sc["node_weights"] == sc["core_weights"], sc
        # Auto takes all of it for the blocks once the model's other weights are placed.
        assert sc["auto_budget"] == sc["for_blocks"] == sc["core_weights"] - sc["rest"], sc


def test_the_scenarios_cover_each_term_of_cores_figure(probe):
    """The reserve counts once, and the larger of the inference minimum and the activations."""
    by = {sc["name"]: sc for sc in probe["scenarios"]}
    small, large = by["default reserve, small latent"], by["default reserve, large latent"]
    assert small["activations_least"] < 0.8 * GIB < large["activations_least"]
    # Core's figures are fractional bytes; the node rounds what it keeps up.
    assert abs(small["kept"] - small["minimum_inference"]) <= 1  # 0.8 GiB + the reserve, once
    assert abs(large["kept"] - (large["activations_least"] + large["reserve"])) <= 1
    reserved = by["--reserve-vram 3, small latent"]
    assert small["core_weights"] - reserved["core_weights"] == reserved["reserve"] - small["reserve"]
    loaded = by["model partly loaded"]
    assert loaded["core_weights"] > small["core_weights"]  # what the model holds counts as room
    ratio = by["weight ratio 0.4 (not NVIDIA)"]
    assert ratio["core_weights"] > ratio["free"] - ratio["kept"]  # the ratio's branch won


def test_a_lora_costs_its_merge_workspace_and_one_blocks_factors(probe):
    lora = probe["lora"]
    assert lora["factors_on_device"] and lora["factors_equal"]
    assert lora["device_bytes"] == lora["largest_block_factors"] > 0
    assert lora["uploads_after_two_loads_of_one_block"] == 1  # a block's factors go up once
    assert lora["workspace"] == 4 * 4 * lora["largest_patched_numel"]  # four fp32 copies
