"""Apply Layerwise Offload's auto settings through a real ComfyUI server (both lanes).

Left to auto (the node's defaults), the engine measures the first steps of a run, plans, and
applies the plan between two steps; the run's report lists each change and its reason. Every
latent is compared with the same workflow without the node (the server pins OMP_NUM_THREADS, so
equal hashes mean bit-identical), with a LoRA, and after an interrupt that lands once the plan has
changed. The models stream as phases (more units than blocks), within a budget that holds the
shared tensors and three slots of the largest phase, as prefetch 2 (the start before any
measurement) needs: on the CPU a copy costs next to nothing beside the tiny models' compute, so
the plan streams through two slots, as fast and a slot smaller, a change on every run. The
Offload panel shows the plan and its reason (headless Chromium).
"""
from __future__ import annotations

import re

import pytest

from test_panel import CHROMIUM, PanelPage, browser, sync_api  # noqa: F401  (browser is a fixture)
from workflows import latent_sha, sample_workflow
from ws_interrupt import queue_and_interrupt

GIB = 1024 ** 3
STEPS = 8  # the plan is applied before the model's third call (one left out, one measured)
CLASSES = {"hunyuan_video": "HunyuanVideo", "wan21": "WanModel"}


def _state(comfy, kind: str) -> dict:
    models = [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == CLASSES[kind]]
    assert models, comfy.get("/offload/layerwise")
    return max(models, key=lambda m: m.get("finished_at") or 0)


def _auto(comfy, kind: str) -> dict:
    """Resident units and prefetch left to auto, as phases, within the shared tensors and three
    slots of the largest phase, learnt from a run with fixed settings (two slots)."""
    fixed = {"resident_blocks": 0, "prefetch": 1, "granularity": "phase"}
    comfy.run(sample_workflow(kind, steps=1, layerwise=fixed))
    state = _state(comfy, kind)
    largest = max(u["bytes"] for u in state["units"])
    return {"resident_blocks": -1, "vram_budget_gb": (state["bound_bytes"] + largest + 4096) / GIB,
            "prefetch": 0, "granularity": "phase"}


def _changed_between_steps(state: dict) -> dict:
    tuning = state["tuning"]
    assert tuning is not None, state
    changes = tuning["changes"]
    assert changes, tuning
    first = changes[0]
    assert 1 < first["pass"] < STEPS and first["to"] != first["from"], tuning
    last = changes[-1]
    assert tuning["setting"] == last["to"] and tuning["reason"], tuning
    # A host busy with other work may slow the checked pass: the plan is then rolled back, and
    # the reason in force says so.
    assert last["why"].startswith("rolled back") == tuning["reason"].startswith("rolled back"), tuning
    assert {"resident_blocks", "prefetch"} <= set(state["auto_settings"]), state
    return tuning


@pytest.mark.parametrize("kind,lora", [("hunyuan_video", None), ("wan21", 1.0)])
def test_the_plan_changes_between_steps_and_the_output_does_not(comfy, kind, lora):
    auto = _auto(comfy, kind)
    baseline = latent_sha(comfy.run(sample_workflow(kind, steps=STEPS, lora_strength=lora)))
    got = latent_sha(comfy.run(sample_workflow(kind, steps=STEPS, lora_strength=lora, layerwise=auto)))
    assert got == baseline
    state = _state(comfy, kind)
    _changed_between_steps(state)
    # The node told the engine the sampler's steps, and each one's end (a change within a run is
    # weighed against the calls it has left).
    steps = state["tuning"]["sampler_steps"]
    assert steps["steps"] == steps["done"] == STEPS and steps["calls_per_step"] >= 1, steps
    assert not state["active"] and state["granularity"] == "phase"
    # A later prompt without the node runs the model exactly as core would.
    assert latent_sha(comfy.run(sample_workflow(kind, steps=STEPS, lora_strength=lora))) == baseline


def test_an_interrupt_after_the_plan_changed_leaves_the_next_run_right(comfy):
    workflow = sample_workflow("hunyuan_video", steps=STEPS, seed=7, layerwise=_auto(comfy, "hunyuan_video"))
    baseline = latent_sha(comfy.run(sample_workflow("hunyuan_video", steps=STEPS, seed=7)))
    prompt_id, sent = queue_and_interrupt(comfy.url, workflow,
                                          lambda d: d.get("max") == STEPS and d.get("value", 0) >= STEPS - 2)
    assert sent
    entry = comfy.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    state = _state(comfy, "hunyuan_video")
    assert not state["active"]
    _changed_between_steps(state)  # the interrupt landed after the change
    assert latent_sha(comfy.run(workflow)) == baseline
    assert latent_sha(comfy.run(sample_workflow("hunyuan_video", steps=STEPS, seed=7))) == baseline


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")
def test_the_panel_shows_the_plan_and_its_reason(comfy, browser):  # noqa: F811
    workflow = sample_workflow("hunyuan_video", steps=STEPS, seed=3, layerwise=_auto(comfy, "hunyuan_video"))
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
        # The engine's words, each size in the panel's units (its "units shown" setting).
        words = [re.escape(part) for part in tuning["reason_template"].split("{}")]
        assert len(words) == len(tuning["reason_sizes"]) + 1, tuning
        shown = re.compile("^" + r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)".join(words) + "$")
        sync_api.expect(plan.locator('[data-role="plan-reason"]')).to_have_text(shown, timeout=20_000)
        setting = tuning["setting"]
        shown = plan.locator('[data-role="plan-setting"]').inner_text()
        assert f"{len(setting['resident_blocks'])} of {truth['layerwise']['blocks']} blocks resident" in shown, shown
        assert f"prefetch {setting['prefetch']}" in shown, shown
        check = plan.locator('[data-role="plan-check"]').inner_text()
        assert "predicted" in check and "measured" in check and tuning["verdict"] in check, check
        first, last = tuning["measured_passes"]  # which calls the measured step is the mean of
        assert f"the mean of calls {first}–{last}" in check, check
        # This run's changes are counted; one the next run starts with is said apart.
        made = [c for c in tuning["changes"] if not c.get("next_run")]
        if made:
            changes = plan.locator('[data-role="plan-changes"]')
            assert changes.get_attribute("data-changes") == str(len(made))
        if len(made) < len(tuning["changes"]):
            nxt = plan.locator('[data-role="plan-next-run"]').inner_text()
            assert nxt.startswith("the next run starts with"), nxt
        assert not [c for c in page.console if "pageerror" in c["text"] or "plan.js" in c["url"]], page.console
        page.shot("panel_auto_plan.png")
    finally:
        page.page.close()
