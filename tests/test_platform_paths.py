"""What the pack does on platforms this machine is not, through a real server (both lanes).

Apple silicon (mps): the GPU shares the host's RAM, so there is nothing to offload to; Apply
Layerwise Offload and Model-Level Swap hand back the very model and text encoder they were given,
with no hook of the pack, and say so in one log line. The test node `TieredTestOnDevice` gives the
models the load device core would give them on a Mac (nothing runs there: the workflow has no
sampler). The Windows calls are the `posix_removed` lane's (docs/platforms.md): there the
blocks' host copy is the process's own, with the reason on the model's card, and the images are
core's.
"""
from __future__ import annotations

import json
import sys

import pytest

import tiny_models
from test_panel import CHROMIUM, PanelPage, browser  # noqa: F401  (browser is a fixture)
from workflows import latent_sha, sample_workflow

PASS = "whose GPU shares the RAM"


def _mps_workflow(node: dict) -> dict:
    return {
        "load": {"class_type": "UNETLoader",
                 "inputs": {"unet_name": tiny_models.MODELS["wan21"]["filename"], "weight_dtype": "default"}},
        "clip": {"class_type": "CLIPLoader", "inputs": {
            "clip_name": tiny_models.CLIP_L_FILENAME, "type": "stable_diffusion", "device": "default"}},
        "mac": {"class_type": "TieredTestOnDevice",
                "inputs": {"model": ["load", 0], "clip": ["clip", 0], "device": "mps"}},
        "node": node,
        "check": {"class_type": "TieredTestPassedThrough", "inputs": {
            "model": ["node", 0], "clip": node.get("clip_out", ["mac", 1]), "given_model": ["mac", 0],
            "given_clip": ["mac", 1]}},
    }


def _passed_through(comfy, node: dict) -> dict:
    clip_out = node.pop("clip_out", None)
    wf = _mps_workflow(node)
    if clip_out is not None:
        wf["check"]["inputs"]["clip"] = clip_out
    before = comfy.log_text().count(PASS)
    [report] = comfy.run(wf)["check"]["passed_through"]
    lines = [line for line in comfy.log_text().splitlines() if PASS in line]
    assert len(lines) == before + 1, lines  # one line for the node's run
    return {**report, "line": lines[-1]}


def test_layerwise_offload_passes_an_mps_model_through(comfy):
    report = _passed_through(comfy, {"class_type": "ApplyLayerwiseOffload",
                                     "inputs": {"model": ["mac", 0], "resident_blocks": -1, "vram_budget_gb": 0.0,
                                                "prefetch": 0, "pin": True}})
    assert report["model"] and not report["pack_hooks"], report
    assert "Apply Layerwise Offload" in report["line"] and "mps" in report["line"], report


def test_model_level_swap_passes_mps_models_through(comfy):
    report = _passed_through(comfy, {"class_type": "ModelLevelSwap",
                                     "inputs": {"model": ["mac", 0], "clip": ["mac", 1]},
                                     "clip_out": ["node", 1]})
    assert report["model"] and report["clip"] and not report["pack_hooks"], report
    assert "Model-Level Swap" in report["line"] and "mps" in report["line"], report


def test_host_copies_are_shared_only_where_the_os_has_the_calls(comfy):
    """Sharing between processes needs flock and shared-memory files: with them (Linux) the
    streamed blocks' host copy is in a shared store; without them (the posix_removed lane, as on
    Windows) it is the process's own, the card says why, and the latent is core's."""
    workflow = sample_workflow("wan21", seed=23, layerwise={"resident_blocks": 0})
    got = latent_sha(comfy.run(workflow))
    assert got == latent_sha(comfy.run(sample_workflow("wan21", seed=23)))
    cards = [c for c in comfy.get("/offload/tiers")["loaded"] if c.get("layerwise")]
    store = max(cards, key=lambda c: c["layerwise"].get("finished_at") or 0)["layerwise"]["host_store"]
    if "posix_removed" in sys.modules:
        assert store == {"shared": False, "why": "sharing host memory needs Linux"}, store
    else:
        assert store and store["shared"], store


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")
def test_the_panel_says_a_mac_passes_models_through(comfy, browser):  # noqa: F811
    page = PanelPage(browser, comfy.url)

    def as_on_a_mac(route) -> None:
        body = route.fetch().json()
        body["devices"]["vram"].update(device="mps", total=0, used=0, free=0, reserved=0, unified_memory=True)
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    try:
        page.page.route("**/offload/tiers", as_on_a_mac)
        page.load()
        page.open_tab()
        row = page.page.locator('#tiered-offload-panel [data-dev="device"]')
        row.wait_for(timeout=20_000)
        assert "the GPU shares the RAM, so the offload nodes pass models through" in row.inner_text()
        assert page.page.locator('#tiered-offload-panel [data-dev="vram"]').count() == 0
    finally:
        page.page.close()
