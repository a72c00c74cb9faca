"""The Offload panel draws the last layerwise run's picture, in headless Chromium on a real server.

Opening the tab takes the server's recording lease (POST /api/offload/timeline); a run made while
it is open then shows, under the model's layerwise figures, a time line with one row per
streamed unit and the verdict on what bound the run, as the server reported them, its rows and
labels apart. (tests/test_panel_disk.py checks an 18-unit pass in the sidebar and its full view.)
"""
from __future__ import annotations

import pytest

from browser import boxes, overlapping
from test_panel import CHROMIUM, PanelPage, browser, sync_api  # noqa: F401  (browser is a fixture)
from workflows import sample_workflow

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")

VERDICT = {"link": "link (compute waited for copies)", "disk": "disk (compute waited for reads)",
           "compute": "compute (copies hidden behind it)",
           "compute_between_copies": "compute (copies ran between blocks, briefly)",
           "copies": "copies (each block was copied between the others, on the CPU)"}


def _workflow(seed: int) -> dict:
    wf = sample_workflow("hunyuan_video", seed=seed,
                         layerwise={"resident_blocks": 0, "prefetch": 1})
    wf["load"]["class_type"] = "TieredUNETLoader"
    return wf


def test_the_open_panel_draws_the_last_run(comfy, browser):  # noqa: F811
    comfy.post("/offload/timeline", {"enabled": False})
    page = PanelPage(browser, comfy.url)
    try:
        page.load()
        # The tab asks for recording as it opens.
        with page.page.expect_response(lambda r: r.url.endswith("/api/offload/timeline")
                                       and r.request.method == "POST") as answer:
            page.open_tab()
        assert answer.value.status == 200
        assert comfy.get("/offload/timeline")["recording"] is True
        comfy.run(_workflow(seed=5))
        truth = max((m for m in comfy.get("/api/offload/tiers")["models"] if m.get("layerwise")),
                    key=lambda m: m["layerwise"].get("finished_at") or 0)
        timeline = truth["layerwise"]["timeline"]
        assert timeline and timeline["units"], truth["layerwise"]
        row = page.row(truth["id"])
        rows = row.locator('[data-role="timeline"] [data-role="tl-row"]')
        sync_api.expect(rows).to_have_count(len(timeline["units"]), timeout=20_000)
        assert len(timeline["units"]) == len(truth["layerwise"]["streamed_indices"])
        shown = [(rows.nth(i).get_attribute("data-unit"), rows.nth(i).get_attribute("data-block"))
                 for i in range(rows.count())]
        assert shown == [(str(u["unit"]), str(u["block"])) for u in timeline["units"]]
        # Every streamed unit's row holds its compute and its wait; copies where the server saw them.
        for i, unit in enumerate(timeline["units"]):
            kinds = sorted(rows.nth(i).locator("[data-kind]").evaluate_all("ss => ss.map((s) => s.dataset.kind)"))
            want = sorted(s["kind"] for s in timeline["spans"] if s["unit"] == unit["unit"])
            assert kinds == want, (unit, kinds, want)
        verdict = row.locator('[data-role="tl-verdict"]')
        sync_api.expect(verdict).to_have_attribute("data-bound", timeline["bound_by"])
        assert verdict.inner_text() == f"Bound by: {VERDICT[timeline['bound_by']]}"
        assert row.locator('[data-role="tl-chart"]').get_attribute("role") == "img"
        drawn = boxes(rows)
        assert all(a["y"] + a["h"] <= b["y"] + 0.5 for a, b in zip(drawn, drawn[1:])), "rows on top of each other"
        labels = boxes(row.locator('[data-role="timeline"] [data-role="tl-label"]'))
        assert labels and not overlapping(labels) and not [b for b in labels if b["cut"]], labels
        page.shot("panel_timeline.png")
    finally:
        page.page.close()
        comfy.post("/offload/timeline", {"enabled": False})


def test_a_run_that_streams_nothing_says_so_in_the_full_view(comfy, browser):  # noqa: F811
    """Every block fits the budget, so the run copies nothing: with the panel open through the
    run, the full view says that nothing streamed, not that the panel should have been open."""
    comfy.post("/offload/timeline", {"enabled": False})
    page = PanelPage(browser, comfy.url)
    try:
        page.load()
        page.open_tab()
        wf = sample_workflow("hunyuan_video", seed=17, layerwise={"resident_blocks": -1, "vram_budget_gb": 12.0})
        wf["load"]["class_type"] = "TieredUNETLoader"
        comfy.run(wf)
        truth = max((m for m in comfy.get("/api/offload/tiers")["models"] if m.get("layerwise")),
                    key=lambda m: m["layerwise"].get("finished_at") or 0)
        assert truth["layerwise"]["streamed_indices"] == [] and not truth["layerwise"]["timeline"], truth["layerwise"]
        sync_api.expect(page.row(truth["id"])).to_be_visible(timeout=20_000)
        page.page.evaluate("(id) => window.app.extensionManager.command.execute(id)",
                           "Workspace.ToggleBottomPanelTab.tiered-offload-timeline")
        hint = page.page.locator('#tiered-offload-timeline [data-role="tl-none"]')
        sync_api.expect(hint).to_have_text(
            "Nothing streamed in the last run: every block stayed resident, so there were no copies to picture.")
    finally:
        page.page.close()
        comfy.post("/offload/timeline", {"enabled": False})
