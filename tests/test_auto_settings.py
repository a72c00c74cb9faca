"""Apply Layerwise Offload's auto settings through a real ComfyUI server (both lanes).

Left to auto (the node's defaults), the engine measures the first steps of a run, plans, and
applies the plan between two steps: the run's report lists each change and its reason. Every
latent is compared with the same workflow without the node (the server pins OMP_NUM_THREADS, so
equal hashes mean bit-identical), with a LoRA and after an interrupt that lands once the plan has
changed too. On the CPU the engine's "device" is host RAM: a resident block is a second copy of it
and a copy costs next to nothing beside the tiny models' compute, so auto streams what the budget
holds resident by default, which makes a change on every run. The Offload panel shows the plan
and its reason (headless Chromium).
"""
from __future__ import annotations

import pytest

from test_panel import CHROMIUM, PanelPage, browser, sync_api  # noqa: F401  (browser is a fixture)
from workflows import latent_sha, sample_workflow
from ws_interrupt import queue_and_interrupt

AUTO = {"resident_blocks": -1, "vram_budget_gb": 0.0, "prefetch": 0}  # every setting left to auto
STEPS = 8  # the plan is applied before the model's third call (one left out, one measured)


def _state(comfy) -> dict:
    models = [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel"]
    assert models, comfy.get("/offload/layerwise")
    return max(models, key=lambda m: m.get("finished_at") or 0)


def _changed_between_steps(state: dict) -> dict:
    tuning = state["tuning"]
    assert tuning is not None, state
    changes = tuning["changes"]
    assert changes, tuning
    first = changes[0]
    assert 1 < first["pass"] < STEPS and first["to"] != first["from"], tuning
    assert tuning["reason"] and tuning["setting"] == changes[-1]["to"], tuning
    assert set(state["auto_settings"]) >= {"resident_blocks", "prefetch"}, state
    return tuning


def test_the_plan_changes_between_steps_and_the_output_does_not(comfy):
    for lora in (None, 1.0):
        baseline = latent_sha(comfy.run(sample_workflow("wan21", steps=STEPS, lora_strength=lora)))
        got = latent_sha(comfy.run(sample_workflow("wan21", steps=STEPS, lora_strength=lora, layerwise=AUTO)))
        assert got == baseline, lora
        state = _state(comfy)
        _changed_between_steps(state)
        assert not state["active"]
    # A later prompt without the node runs the model exactly as core would.
    assert latent_sha(comfy.run(sample_workflow("wan21", steps=STEPS))) == baseline


def test_an_interrupt_after_the_plan_changed_leaves_the_next_run_right(comfy):
    workflow = sample_workflow("wan21", steps=STEPS, seed=7, layerwise=AUTO)
    baseline = latent_sha(comfy.run(sample_workflow("wan21", steps=STEPS, seed=7)))
    prompt_id, sent = queue_and_interrupt(comfy.url, workflow,
                                          lambda d: d.get("max") == STEPS and d.get("value", 0) >= STEPS - 2)
    assert sent
    entry = comfy.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    state = _state(comfy)
    assert not state["active"]
    _changed_between_steps(state)  # the interrupt landed after the change
    assert latent_sha(comfy.run(workflow)) == baseline
    assert latent_sha(comfy.run(sample_workflow("wan21", steps=STEPS, seed=7))) == baseline


@pytest.mark.skipif(not __import__("pathlib").Path(CHROMIUM or "").exists(),
                    reason="needs Debian's chromium (make test installs it)")
def test_the_panel_shows_the_plan_and_its_reason(comfy, browser):  # noqa: F811
    workflow = sample_workflow("hunyuan_video", steps=STEPS, seed=3, layerwise=AUTO)
    workflow["load"]["class_type"] = "TieredUNETLoader"
    page = PanelPage(browser, comfy.url)
    try:
        page.load()
        page.open_tab()
        comfy.run(workflow)
        truth = max((m for m in comfy.get("/api/offload/tiers")["models"] if m.get("layerwise")),
                    key=lambda m: m["layerwise"].get("finished_at") or 0)
        tuning = truth["layerwise"]["tuning"]
        assert tuning and tuning["changes"] and tuning["reason"], truth["layerwise"]
        plan = page.row(truth["id"]).locator('[data-role="lw-plan"]')
        sync_api.expect(plan.locator('[data-role="plan-reason"]')).to_have_text(tuning["reason"], timeout=20_000)
        setting = tuning["setting"]
        shown = plan.locator('[data-role="plan-setting"]').inner_text()
        assert f"{len(setting['resident_blocks'])} of {truth['layerwise']['blocks']} blocks resident" in shown, shown
        assert f"prefetch {setting['prefetch']}" in shown, shown
        check = plan.locator('[data-role="plan-check"]').inner_text()
        assert "predicted" in check and "measured" in check and tuning["verdict"] in check, check
        changes = plan.locator('[data-role="plan-changes"]')
        assert changes.get_attribute("data-changes") == str(len(tuning["changes"]))
        assert not page.console, page.console
        page.shot("panel_auto_plan.png")
    finally:
        page.page.close()
