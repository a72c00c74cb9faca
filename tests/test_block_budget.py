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
    # On the CPU: the merge's temporaries of the largest patched weight, in fp32.
    assert lora["workspace"] == lora["temporaries"] * 4 * lora["largest_patched_numel"]


def test_the_merge_figure_holds_what_cores_merge_of_each_adapter_holds(probe):
    """Measured on every patched weight of the blocks (issue 30.9): DoRA over LoHa holds six
    weight-sized temporaries at once, LoHa five; the node's figure counted four."""
    rows = probe["merge_peaks"]
    kinds = {r["kind"] for r in rows}
    assert {"lora", "dora", "loha", "dora_loha", "lokr", "oft", "boft", "glora", "diff"} <= kinds
    merged = [r for r in rows if r["failed"] is None]
    assert all(r["failed"] is None for r in rows if r["merge_dtype"] == "core's"), rows
    for r in merged:
        assert r["merged"] > 0 and 0 < r["peak"] <= r["figure"], r
        assert r["per_weight"] <= probe["lora"]["temporaries"], r


def test_cuda_figures_are_torchs_own(probe):
    """The allocator keeps large temporaries in their own 2 MiB-rounded segments and packs small
    ones into shared 20 MiB (up to 10 MiB) or 2 MiB (up to 1 MiB) segments; torch's cuBLAS
    workspace is 32 MiB on Hopper and Blackwell, 8 MiB + 128 KiB before, or what
    CUBLAS_WORKSPACE_CONFIG (":SIZE:COUNT" in KiB) says."""
    mib = 1024 ** 2
    assert probe["allocator"]["cached"] == {"7 x 100 MiB + 1": 7 * 102 * mib, "7 x 3 MiB": 2 * 20 * mib,
                                            "7 x 4 KiB": 2 * mib, "1 x 1 MiB": 2 * mib}
    assert probe["allocator"]["workspace"] == {
        "H100 default": 32 * mib, "RTX 4090 default": 8 * mib + 128 * 1024,
        "RTX 5090 default": 32 * mib, ":4096:8": 32 * mib, ":16:8": 128 * 1024,
        "unparsable": 32 * mib, "MI300 default": 128 * mib}
