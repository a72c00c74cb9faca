"""The Offload panel shows a disk-streamed model's figures and the picture of its last run, in
headless Chromium on a real server.

A Tiered loader's six-block Wan runs with Apply Layerwise Offload as phases from disk through a
host cache smaller than the model: a pass of 18 streamed units, the first of them read and copied
while the previous pass computed. The open panel, updated from the websocket alone, must show
each block's place (GPU slot, RAM cache or disk) as the server reports it, that its bytes are read
in place from the model's file and no spill file was written, the cache hit rate,
the disk read rate and the time compute waited for the disk, the model's bytes on disk, and the
disk reads in the last run's picture. That picture must be readable in the sidebar (no row or
label on top of another, the axis's start before 0 explained) and open full width in the
frontend's bottom panel with one labelled row per unit, the pass start and the fetch-ahead marked
and named, and the verdict and figures beside it. Screenshots of both go to tests/artifacts/.
"""
from __future__ import annotations

import re

import pytest

import tiny_models
from browser import boxes, overflows, overlapping
from conftest import ARTIFACTS
from test_panel import CHROMIUM, PanelPage, browser, sync_api  # noqa: F401  (browser is a fixture)
from test_panel_timeline import VERDICT
from workflows import sample_workflow

MODEL = "panel_disk_wan6.safetensors"
PAGE = 4096

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")


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


@pytest.fixture(scope="module")
def disk_run(comfy, browser, model):  # noqa: F811
    """The panel open while the model runs from disk: (page, the model as the server reports it,
    the page's GETs of the tiers before the run)."""
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
        yield page, truth, gets
    finally:
        page.page.close()
        comfy.post("/offload/timeline", {"enabled": False})


def test_panel_shows_disk_streaming(disk_run):
    page, truth, gets = disk_run
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
    # The fp32 file's bytes are the loaded ones: every block is read in place, nothing is written.
    sources = row.locator('[data-role="lw-disk"]')
    sync_api.expect(sources).to_contain_text(f"read in place from {MODEL}", timeout=5_000)
    assert "no spill file" in sources.inner_text() and lw["disk"]["spill_units"] == 0, lw["disk"]
    titles = [cells.nth(i).get_attribute("title") for i in range(6)]
    assert all("read in place from the model file" in t for t in titles), titles
    stats = row.locator(".to-stats").inner_text()
    tel = lw["telemetry"]
    assert f"{100 * tel['cache_hit_rate']:.0f}%" in stats, stats
    assert re.search(r"disk read\s+\d+\.\d\d G(i)?B/s", stats), stats
    assert re.search(rf"waited for disk\s+{tel['disk_wait_s']:.2f} s", stats), stats
    assert truth["bytes"]["disk"] > 0
    assert re.search(r"disk only \d", row.locator(".to-legend").first.inner_text()), "no disk share in the model bar"
    # The last run's picture shows the disk reads of the units the cache did not hold: each the
    # unit's bytes as the file holds them (its span widened to whole pages: a few KiB either way).
    reads = [sp for sp in lw["timeline"]["spans"] if sp["kind"] == "disk"]
    assert reads and all(abs(sp["bytes"] - lw["units"][sp["unit"]]["bytes"]) <= 4 * PAGE for sp in reads), \
        lw["timeline"]
    sync_api.expect(row.locator('[data-role="tl-chart"] [data-kind="disk"]')).to_have_count(len(reads))
    assert page.tier_gets() == gets, "the panel must update from the websocket, not a GET"
    page.shot("panel_disk_streaming.png")


def _ahead(timeline: dict) -> set[int]:
    """The units whose read or copy began before the pass did (the prefetch wraps around)."""
    return {sp["unit"] for sp in timeline["spans"] if sp["start_ms"] < 0}


def _readable_and_marked(picture, labels: list[dict]) -> dict:
    """What both sizes of the picture must show: its row labels and its marks apart and whole,
    the tick numbers apart and inside the chart (0 among them), the pass start marked and named,
    the fetch-ahead shaded up to the pass start's line and named: above the shade where its name
    fits there (the label column's width and the shade's, which the pass's timing sets), else
    in the note beside or under the picture. Returns the shade's box."""
    marks = boxes(picture.locator('[data-role="tl-marks"] > *'))
    named = [m["text"] for m in marks]
    assert named in (["fetched ahead", "pass start"], ["pass start"]) and not overlapping(marks), marks
    if named == ["pass start"]:
        room = picture.locator('[data-role="tl-ahead"]').bounding_box()["width"] + \
            picture.locator(".to-tl-labels").bounding_box()["width"]
        assert room < 90, ("the fetch-ahead's name fits above its shade, yet it is not there", room)
        sync_api.expect(picture.locator('[data-role="tl-ahead-note"]')).to_contain_text("previous pass")
    assert not overlapping(labels), overlapping(labels)
    assert not [b["text"] for b in labels + marks if b["cut"]], "words cut short"
    ticks = boxes(picture.locator('[data-role="tl-tick"]'))
    assert "0" in [t["text"] for t in ticks] and not overlapping(ticks), ticks
    chart = picture.locator('[data-role="tl-chart"]').bounding_box()
    assert all(chart["x"] - 0.5 <= t["x"] and t["x"] + t["w"] <= chart["x"] + chart["width"] + 0.5 for t in ticks), (chart, ticks)
    start = picture.locator('[data-role="tl-start"]').bounding_box()
    shaded = picture.locator('[data-role="tl-ahead"]').bounding_box()
    assert abs(shaded["x"] + shaded["width"] - (start["x"] + start["width"] / 2)) <= 1.5, (shaded, start)
    return shaded


def test_the_sidebar_picture_keeps_its_rows_and_labels_apart(disk_run):
    """18 rows in the 330-pixel sidebar: each row its own strip, one label per block where it
    fits and none on another, the pass start marked and the axis's start before 0 explained."""
    page, truth, _ = disk_run
    timeline = truth["layerwise"]["timeline"]
    units = timeline["units"]
    assert len(units) == 18 and _ahead(timeline), timeline["units"]
    picture = page.row(truth["id"]).locator('[data-role="timeline"]')
    rows = picture.locator('[data-role="tl-row"]')
    sync_api.expect(rows).to_have_count(len(units))
    assert [r["unit"] for r in boxes(rows)] == [str(u["unit"]) for u in units]
    drawn = boxes(rows)
    assert all(r["h"] >= 2 for r in drawn), drawn
    assert all(a["y"] + a["h"] <= b["y"] + 0.5 for a, b in zip(drawn, drawn[1:])), "rows drawn on top of each other"
    labels = boxes(picture.locator('[data-role="tl-label"]'))
    assert [label["text"] for label in labels] == [f"block {b}" for b in sorted({u["block"] for u in units})]
    _readable_and_marked(picture, labels)
    assert not overflows(page.row(truth["id"])), overflows(page.row(truth["id"]))
    sync_api.expect(picture.locator('[data-role="tl-ahead-note"]')).to_contain_text("during the previous pass")
    assert picture.locator('[data-role="tl-verdict"]').inner_text() == f"Bound by: {VERDICT[timeline['bound_by']]}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    picture.screenshot(path=str(ARTIFACTS / "panel_disk_timeline.png"))


def test_the_full_view_draws_one_labelled_row_per_unit(disk_run):
    """"Open full view" shows the picture in the frontend's bottom panel, full width: one row and
    one label per unit, in the order they computed, none on another; the pass start and the
    fetch-ahead marked and explained; the verdict and the figures beside it."""
    page, truth, _ = disk_run
    timeline = truth["layerwise"]["timeline"]
    units = timeline["units"]
    compact = page.row(truth["id"]).locator('[data-role="tl-chart"] .to-tl-plot').bounding_box()
    page.row(truth["id"]).locator('[data-role="open-timeline"]').click()
    view = page.page.locator("#tiered-offload-timeline")
    picture = view.locator('[data-role="timeline"]')
    sync_api.expect(picture).to_have_attribute("data-timeline-card", truth["id"])
    sync_api.expect(view.locator('[data-role="tl-model"]')).to_have_text(MODEL)
    # A second click leaves it open (the frontend's command toggles the tab).
    page.row(truth["id"]).locator('[data-role="open-timeline"]').click()
    sync_api.expect(picture).to_be_visible()

    rows = picture.locator('[data-role="tl-row"]')
    sync_api.expect(rows).to_have_count(len(units))
    # Drawn, not only in the page: the first and the last row laid out (a redraw for the view's
    # new width may still be on its way in the next frame).
    sync_api.expect(rows.first).to_be_visible()
    sync_api.expect(rows.last).to_be_visible()
    drawn = boxes(rows)
    assert [r["unit"] for r in drawn] == [str(u["unit"]) for u in units]
    assert page.page.locator("#tiered-offload-timeline").count() == 1, "one full view in the page"
    labels = boxes(picture.locator('[data-role="tl-label"]'))
    assert [(label["unit"], label["text"]) for label in labels] == [
        (str(u["unit"]), f"block {u['block']} · {u['name']}") for u in units]
    for row, label in zip(drawn, labels):  # each label beside its own row
        assert row["y"] <= label["y"] + label["h"] / 2 <= row["y"] + row["h"] + 1, (row, label)
    # The same kinds of spans per row as the server recorded.
    for i, unit in enumerate(units):
        kinds = sorted(rows.nth(i).locator("[data-kind]").evaluate_all("ss => ss.map((s) => s.dataset.kind)"))
        assert kinds == sorted(sp["kind"] for sp in timeline["spans"] if sp["unit"] == unit["unit"]), unit
    plot = picture.locator(".to-tl-plot").bounding_box()
    # Full width: the view spans the window beside the sidebar, and its plot is wider than the sidebar's.
    window = page.page.viewport_size["width"]
    assert view.bounding_box()["width"] >= 0.7 * window and plot["width"] > 1.5 * compact["width"], (plot, compact)

    shaded = _readable_and_marked(picture, labels)
    assert shaded["width"] > 0 and shaded["height"] >= drawn[-1]["y"] + drawn[-1]["h"] - drawn[0]["y"] - 1
    aside = picture.locator('[data-role="tl-aside"]')
    sync_api.expect(aside.locator('[data-role="tl-start-note"]')).to_contain_text("pass start (0 ms)")
    sync_api.expect(aside.locator('[data-role="tl-ahead-note"]')).to_contain_text("while the previous pass computed")
    assert aside.locator('[data-role="tl-verdict"]').inner_text() == f"Bound by: {VERDICT[timeline['bound_by']]}"
    figures = aside.locator('[data-role="tl-figures"]')
    assert figures.locator('[data-figure="units"] b').inner_text() == str(len(units))
    pass_ms = timeline["pass_ms"]
    assert figures.locator('[data-figure="pass"] b').inner_text() == (
        f"{pass_ms:.0f} ms" if pass_ms >= 100 else f"{pass_ms:.1f} ms" if pass_ms >= 10 else f"{pass_ms:.2f} ms")
    assert figures.locator('[data-figure="ahead"] b').inner_text().startswith(f"{len(_ahead(timeline))} units")
    side = aside.bounding_box()
    assert side["x"] >= plot["x"] + plot["width"], "the figures stand beside the picture"

    assert not overflows(view), overflows(view)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    view.screenshot(path=str(ARTIFACTS / "panel_disk_timeline_full.png"))
    page.page.screenshot(path=str(ARTIFACTS / "panel_disk_timeline_full_page.png"))

    # In a narrower bottom panel (a smaller window, or the frontend's right side panel open) the
    # figures go under the picture and the picture keeps its width.
    page.page.set_viewport_size({"width": 1150, "height": 1000})
    try:
        sync_api.expect(aside).to_be_visible()
        page.page.wait_for_function("(el) => el.getBoundingClientRect().top > 0 && "
                                    "el.getBoundingClientRect().top >= el.previousElementSibling"
                                    ".getBoundingClientRect().bottom", arg=aside.element_handle())
        narrow = picture.locator(".to-tl-plot").bounding_box()
        assert view.bounding_box()["width"] < 900 and narrow["width"] > 1.5 * compact["width"], (narrow, compact)
        assert not overflows(view), overflows(view)
        page.page.screenshot(path=str(ARTIFACTS / "panel_disk_timeline_full_1150.png"))
        # And a full HD window: the figures beside the picture again, nothing past its box.
        page.page.set_viewport_size({"width": 1920, "height": 1080})
        page.page.wait_for_function("""() => { const aside = document.querySelector('#tiered-offload-timeline [data-role="tl-aside"]');
            return aside && aside.getBoundingClientRect().left > aside.previousElementSibling.getBoundingClientRect().right; }""")
        assert not overflows(view), overflows(view)
        assert not overlapping(boxes(picture.locator('[data-role="tl-tick"]')))
        page.page.screenshot(path=str(ARTIFACTS / "panel_disk_timeline_full_1920.png"))
    finally:
        page.page.set_viewport_size({"width": 1400, "height": 1000})
