"""The Offload panel's preferences as ComfyUI settings (registerExtension({settings})), used by the
panel, in headless Chromium against a real server: the units sizes are shown in, whether models
only ComfyUI manages get a card, and a refresh interval while the tab is open.

Settings are changed the way the frontend's settings dialog changes them
(app.extensionManager.setting.set, which also stores them on the server) and put back after each
test.
"""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from comfy_server import REPO
from test_panel import CHROMIUM, PanelPage, browser, loaded_cards, sync_api  # noqa: F401  (browser is a fixture)

sys.path.insert(0, str(REPO / "tools"))
import example_workflows  # noqa: E402
from workflows import streamed_demo  # noqa: E402

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")

SIZE = re.compile(r"\d (B|KiB|MiB|GiB|TiB)\b")
SETTINGS = {
    "TieredOffload.Panel.ShowBlockStrips": True,
    "TieredOffload.Panel.Units": "auto",
    "TieredOffload.Panel.ShowCoreModels": True,
    "TieredOffload.Panel.RefreshSeconds": 0,
}


@pytest.fixture(scope="module")
def page(comfy, browser):  # noqa: F811
    example_workflows.write_models(comfy.base)
    comfy.run(streamed_demo())   # a streamed DiT and a text encoder only core manages
    p = PanelPage(browser, comfy.url)
    p.load()
    p.open_tab()
    p.page.wait_for_selector('#tiered-offload-panel [data-card="core"]')
    yield p
    p.page.close()


def set_setting(page, setting_id: str, value) -> None:
    page.page.evaluate("([id, v]) => app.extensionManager.setting.set(id, v)", [setting_id, value])


@pytest.fixture(autouse=True)
def defaults_after(page):
    yield
    for setting_id, value in SETTINGS.items():
        set_setting(page, setting_id, value)


def test_the_settings_are_registered_with_their_english_words(page):
    registered = page.page.evaluate("""() => Object.values(app.extensionManager.setting.settings)
        .filter((s) => s.id.startsWith('TieredOffload.'))
        .map((s) => ({ id: s.id, name: s.name, tooltip: s.tooltip ?? null, category: s.category,
                       options: s.options ?? null, defaultValue: s.defaultValue }))""")
    words = json.loads((REPO / "locales" / "en" / "settings.json").read_text(encoding="utf-8"))
    assert {s["id"]: s["defaultValue"] for s in registered} == SETTINGS
    for s in registered:
        entry = words[s["id"].replace(".", "_")]
        assert s["name"] == entry["name"] and s["tooltip"] == entry.get("tooltip"), s
        assert s["category"][:2] == ["Tiered Offload", "Offload panel"], s
        if s["options"]:
            assert sorted(s["options"]) == sorted(entry["options"]), s


def sizes(page) -> set[str]:
    text = page.page.locator("#tiered-offload-panel").inner_text()
    return {m.group(1) for m in SIZE.finditer(text)}


def wait_sizes(page, accept, what: str, timeout: float = 30.0) -> set[str]:
    """The units of the sizes the panel shows, once `accept` takes them (redrawn in the next
    frame after a setting changes; the wait is an upper bound)."""
    deadline = time.time() + timeout
    while not accept(found := sizes(page)):
        if time.time() > deadline:
            raise AssertionError(f"{what}: {found}\n{page.page.locator('#tiered-offload-panel').inner_text()}")
        page.page.wait_for_timeout(100)
    return found


@pytest.mark.parametrize("unit", ["MiB", "GiB"])
def test_a_fixed_unit_shows_every_size_in_it(page, comfy, unit):
    wait_sizes(page, lambda units: len(units) > 1, "auto shows sizes in the units that fit them")
    set_setting(page, "TieredOffload.Panel.Units", unit)
    wait_sizes(page, lambda units: units == {unit}, f"every size in {unit}")
    # A card's total, in the chosen unit.
    clip = next(c for c in loaded_cards(comfy) if c["class"] == "SD1ClipModel" and not c["tier_id"])
    legend = page.core_card(clip["id"]).locator('[data-role="figures"]').inner_text()
    value = clip["bytes"]["total"] / 2 ** {"MiB": 20, "GiB": 30}[unit]
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    assert legend.rstrip().endswith(f" {value:.{digits}f} {unit}"), legend


def test_models_only_comfyui_manages_can_be_hidden(page, comfy):
    cards = loaded_cards(comfy)
    core_only = [c for c in cards if c["core"] and not c["tier_id"] and not c["layerwise"] and not c["swap"]]
    streamed = [c for c in cards if c["layerwise"] and not c["tier_id"]]
    assert core_only and streamed, cards
    shown = page.page.locator("#tiered-offload-panel [data-card]").count()
    set_setting(page, "TieredOffload.Panel.ShowCoreModels", False)
    for card in core_only:
        sync_api.expect(page.core_card(card["id"])).to_have_count(0)
    for card in streamed:
        sync_api.expect(page.core_card(card["id"])).to_have_count(1)
    note = page.page.locator('#tiered-offload-panel [data-role="hidden-core"]')
    sync_api.expect(note).to_contain_text(f"{len(core_only)} hidden")
    assert page.page.locator("#tiered-offload-panel [data-card]").count() == shown - len(core_only)
    set_setting(page, "TieredOffload.Panel.ShowCoreModels", True)
    sync_api.expect(page.core_card(core_only[0]["id"])).to_have_count(1)
    sync_api.expect(note).to_have_count(0)


def test_a_refresh_interval_makes_the_open_panel_ask_the_server(page):
    """0 (the default): no GET after the first; 1 s: GETs while the tab is open, none while it is
    closed; back to 0: none."""
    gets = page.tier_gets()
    page.page.wait_for_timeout(2500)
    assert page.tier_gets() == gets, "asked the server with the interval at 0"
    set_setting(page, "TieredOffload.Panel.RefreshSeconds", 1)
    wait_gets(page, gets + 2)
    page.toggle_tab()                                 # closed: the timer stops
    page.page.wait_for_selector("#tiered-offload-panel", state="detached")
    closed = page.tier_gets()
    page.page.wait_for_timeout(2500)
    assert page.tier_gets() == closed, "asked the server while the tab was closed"
    page.open_tab()
    wait_gets(page, closed + 2)
    set_setting(page, "TieredOffload.Panel.RefreshSeconds", 0)
    stopped = page.tier_gets()
    page.page.wait_for_timeout(2500)
    assert page.tier_gets() == stopped, "asked the server with the interval at 0"


def wait_gets(page, count: int, timeout: float = 30.0) -> None:
    """Until the page has made `count` GETs of /api/offload/tiers (an upper bound, not a time
    the test asserts)."""
    deadline = time.time() + timeout
    while page.tier_gets() < count:
        assert time.time() < deadline, f"{page.tier_gets()} GETs, expected {count}"
        page.page.wait_for_timeout(100)


def test_the_demos_picture_is_there_when_the_panel_opens(page, comfy):
    """`make demo` runs the demo before anyone opens the panel, and ComfyUI would not run the
    unchanged workflow again. A run made while no panel asked for a picture says how to get one
    (keep the panel open, change an input); a run made under the lease tools/demo.py takes, as
    the demo's is, shows its picture as soon as the tab opens."""
    def run_closed(seed: int, record: bool) -> dict:
        page.toggle_tab()
        page.page.wait_for_selector("#tiered-offload-panel", state="detached")
        comfy.post("/offload/timeline", {"enabled": record})
        workflow = streamed_demo()
        workflow["6"]["inputs"].update(seed=seed, steps=2)  # a pass or two is all a picture needs
        comfy.run(workflow)
        comfy.post("/offload/timeline", {"enabled": False})
        page.open_tab()
        return next(c for c in loaded_cards(comfy) if c["layerwise"] and c["layerwise"]["blocks"] == 12)

    dit = run_closed(201, record=False)
    assert not dit["layerwise"]["timeline"]
    hint = page.core_card(dit["id"]).locator('[data-role="tl-none"]')
    sync_api.expect(hint).to_contain_text("change the seed (or any input)")
    dit = run_closed(202, record=True)
    assert dit["layerwise"]["timeline"]
    rows = page.core_card(dit["id"]).locator('[data-role="timeline"] [data-role="tl-row"]')
    sync_api.expect(rows).to_have_count(len(dit["layerwise"]["timeline"]["units"]))
