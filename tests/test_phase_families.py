"""Phase granularity and disk streaming on every ComfyUI model family the discovery tests cover.

ComfyUI runs in a subprocess (tests/fixtures/phase_families.py), as for the discovery tests. Per
family it builds the real ComfyUI class at tiny widths with random weights on the CPU and compares
a plain forward bit for bit with the layerwise engine streaming every unit: as phases from RAM,
as phases from disk and as whole blocks from disk (the engine's spill file, with a host cache too
small for the model). It also splits the
family's blocks at realistic widths (meta tensors) and reports the largest phase's share.

Per family this asserts: every streamed forward equals the reference (two passes, the second
wraps around the ring) and so does a plain forward after the engine let go; phases run in the
order the table or discovery gave (no order miss, no unit loaded late); the disk runs really
read from the spill file through the cache; each DiT block splits into at least two phases
whose largest is smaller than the block.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from comfy_server import run_tree_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "fixtures" / "phase_families.py"

FAMILIES = ["flux_dev", "flux2_dev", "chroma", "hunyuan_video", "hunyuan_image_21", "wan21_t2v_14b",
            "wan22_ti2v_5b", "wan21_vace_14b", "ltxv_2b", "qwen_image", "sd3_medium", "hidream_i1", "lumina2",
            "z_image", "cosmos_predict2_2b", "cosmos_v1_7b", "sd15", "sdxl"]
# Block classes of the UNet layouts that are one phase (a conv, a resampler, a one-block transformer).
ONE_PHASE_OK = {"Conv2d", "Downsample", "Upsample", "SpatialTransformer"}
MODES = ("phase_ram", "phase_disk", "block_disk")


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    return run_tree_script(SCRIPT, tmp_path_factory.mktemp("phases") / "results.json", threads=1, timeout=900)


def _case(results: dict, name: str) -> dict:
    res = results["cases"][name]
    assert res["error"] is None, f"{name} (ComfyUI {results['comfyui_version']}):\n{res['error']}"
    return res


def test_every_discovery_family_is_run(families):
    assert sorted(families["cases"]) == sorted(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_as_phases_and_from_disk_bit_identical(families, name):
    res = _case(families, name)
    assert res["finite"], "the tiny model's reference output is not finite: the comparison shows nothing"
    for mode in MODES:
        run = res[mode]
        assert run["equal"] == [True, True], (mode, run)
        assert run["restored"], (mode, "a plain forward after the engine let go differs")
        tel = run["telemetry"]
        assert tel["order_misses"] == 0 and tel["sync_fallbacks"] == 0, (mode, tel)
        assert tel["copies"] > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_phase_units_are_finer_than_blocks(families, name):
    res = _case(families, name)
    assert res["phase_ram"]["units"] > res["blocks"], res["phase_ram"]
    assert res["block_disk"]["units"] == res["blocks"]


@pytest.mark.parametrize("name", FAMILIES)
def test_disk_runs_read_the_spill_file_through_the_cache(families, name):
    res = _case(families, name)
    for mode in ("phase_disk", "block_disk"):
        run = res[mode]
        assert run["disk"]["active"], (mode, run["disk"])
        assert run["disk"]["spill_bytes"] >= run["block_bytes"] > 0, (mode, run)
        assert 0 < run["disk"]["cache_bytes"] < run["block_bytes"], "the cache held the whole model"
        tel = run["telemetry"]
        assert tel["disk_reads"] > 0 and tel["cache_requests"] == tel["copies"], (mode, tel)


@pytest.mark.parametrize("name", FAMILIES)
def test_realistic_blocks_split_into_phases(families, name):
    res = _case(families, name)
    for cls, share in res["shares"].items():
        if cls in ONE_PHASE_OK and len(share["phases"]) == 1:
            continue
        assert len(share["phases"]) >= 2, (cls, share)
        assert share["largest_share"] < 1, (cls, share)
        assert sum(share["phase_bytes"]) <= share["block_bytes"]
