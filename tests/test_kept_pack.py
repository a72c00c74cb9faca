"""Apply Layerwise Offload keeps its pinned pack when ComfyUI moves the blocks between runs.

The probe (kept_pack_probe.py) runs core's loader and sampler with the node's patcher in the tree
under test, and moves the blocks between runs the way core's own load and unload of the same
model do (see its docstring for the CPU stand-in of device memory).
"""
from __future__ import annotations

import pytest

from comfy_server import run_tree_script
from conftest import TESTS


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kept_pack") / "kept_pack.json"
    return run_tree_script(TESTS / "kept_pack_probe.py", out, threads=2, timeout=600)


def test_cores_unload_puts_the_blocks_back_into_the_kept_pack(probe):
    """Re-pointed before core's `.to()` copies anything: no copy beside the pack, no re-pack."""
    case = probe["cases"]["core_unload"]
    assert case["moved"] and case["back_in_pack_after_unload"], case
    assert case["packed"] == 0 and case["sha"] == probe["first"]["sha"], (case, probe["first"])


def test_the_next_run_takes_the_blocks_back_into_the_kept_pack(probe):
    case = probe["cases"]["next_run_hands_over"]
    assert case["moved"] and case["back_in_pack_after_run"], case
    assert case["packed"] == 0 and case["sha"] == probe["first"]["sha"], (case, probe["first"])
    assert probe["first"]["packed"] > 0


def test_cores_partial_unload_puts_each_module_it_moves_back_into_the_kept_pack(probe):
    """Under memory pressure core moves module by module (`partially_unload`, each module's own
    `.to()`): each module it moves gets its tensors back from the kept pack, no copy in fresh RAM;
    the modules it leaves stay where core counts them (issue 30.7)."""
    case = probe["cases"]["partial_unload"]
    tensors = case["tensors"]
    unloaded = [t for t in tensors if t["unloaded_by_core"]]
    assert 0 < case["freed"] < case["block_bytes"] and 0 < len(unloaded) < len(tensors), case
    assert all(t["in_pack"] == t["unloaded_by_core"] for t in tensors), tensors
    assert case["packed"] == 0 and case["sha"] == probe["first"]["sha"], (case, probe["first"])
    assert case["back_in_pack_after_run"], case
