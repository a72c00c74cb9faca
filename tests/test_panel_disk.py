"""The Offload panel shows a disk-streamed model's figures, in headless Chromium on a real server.

A Tiered loader's six-block Wan runs with Apply Layerwise Offload as phases from disk through a
host cache smaller than the model. The open panel, updated from the websocket alone, must show
each block's place (GPU slot, RAM cache or disk) as the server reports it, the cache hit rate,
the disk read rate and the time compute waited for the disk, the model's bytes on disk, and the
disk reads in the last run's picture.
"""
from __future__ import annotations

import re

import pytest

import tiny_models
from conftest import ARTIFACTS
from test_panel import CHROMIUM, PanelPage, browser, sync_api  # noqa: F401  (browser is a fixture)
from workflows import sample_workflow

MODEL = "panel_disk_wan6.safetensors"
PAGE = 4096

pytestmark = pytest.mark.skipif(not __import__("pathlib").Path(CHROMIUM).exists(),
                                reason="needs Debian's chromium (make test installs it)")


@pytest.fixture(scope="module")
def model(comfy_base):
    path = comfy_base / "models" / "diffusion_models" / MODEL
    if not path.exists():
        tiny_models.write_tiny_wan21(path, layers=6, seed=64)
    return MODEL


def _workflow(layerwise, seed):
    wf = sample_workflow("wan21", layerwise=layerwise, seed=seed)
    wf["load"]["class_type"] = "TieredUNETLoader"
    wf["load"]["inputs"]["unet_name"] = MODEL
    return wf


def test_panel_shows_disk_streaming(comfy, browser, model):  # noqa: F811
    phases = {"resident_blocks": 0, "prefetch": 1, "granularity": "phase"}
    comfy.run(_workflow(phases, seed=1))
    sizes = max((m for m in comfy.get("/offload/layerwise")["models"] if m["blocks"] == 6),
                key=lambda m: m["finished_at"] or 0)
    unit = max(sizes["units"][i]["bytes"] for i in sizes["streamed_indices"])
    disk = dict(phases, host_cache_gb=4 * (-(-unit // PAGE) * PAGE) / (1 << 30))
    page = PanelPage(browser, comfy.url)
    try:
        page.load()
        with page.page.expect_response(lambda r: r.url.endswith("/api/offload/timeline")) as lease:
            page.open_tab()  # and takes the lease under which the run records its picture
        assert lease.value.status == 200
        gets = page.tier_gets()
        comfy.run(_workflow(disk, seed=2))
        truth = next(m for m in comfy.get("/api/offload/tiers")["models"] if m["name"] == MODEL)
        lw = truth["layerwise"]
        assert lw["disk"]["active"] and lw["telemetry"]["disk_reads"] > 0, lw
        row = page.row(truth["id"])
        summary = row.locator('[data-role="lw-summary"]')
        sync_api.expect(summary).to_contain_text("from disk through", timeout=5_000)
        assert f"as {len(lw['units'])} phases" in summary.inner_text()
        cells = row.locator(".to-strip .to-blk")
        sync_api.expect(cells).to_have_count(6, timeout=5_000)
        places = [cells.nth(i).get_attribute("class").split("to-blk-")[-1] for i in range(6)]
        assert places == lw["block_states"] and set(places) <= {"cached", "disk", "in_flight"}, places
        assert "disk" in places or "cached" in places
        stats = row.locator(".to-stats").inner_text()
        tel = lw["telemetry"]
        assert f"{100 * tel['cache_hit_rate']:.0f}%" in stats, stats
        assert re.search(r"disk read\s+\d+\.\d\d G(i)?B/s", stats), stats
        assert re.search(rf"waited for disk\s+{tel['disk_wait_s']:.2f} s", stats), stats
        assert truth["bytes"]["disk"] > 0
        assert re.search(r"disk only \d", row.locator(".to-legend").first.inner_text()), "no disk share in the model bar"
        # The last run's picture shows the disk reads of the units the cache did not hold.
        reads = [sp for sp in lw["timeline"]["spans"] if sp["kind"] == "disk"]
        assert reads and all(sp["bytes"] == lw["units"][sp["unit"]]["bytes"] for sp in reads), lw["timeline"]
        sync_api.expect(row.locator('[data-role="tl-svg"] rect[data-kind="disk"]')).to_have_count(len(reads))
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        row.locator('[data-role="timeline"]').screenshot(path=str(ARTIFACTS / "panel_disk_timeline.png"))
        assert page.tier_gets() == gets, "the panel must update from the websocket, not a GET"
        page.shot("panel_disk_streaming.png")
    finally:
        page.page.close()
        comfy.post("/offload/timeline", {"enabled": False})
