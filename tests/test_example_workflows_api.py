"""The example workflows run in an existing ComfyUI as a user of the README's install runs them:
tools/demo_models.py writes the demo's models into the server's models folder, and each shipped
API form (example_workflows/api/) is queued as it is through POST /prompt. The Apply Layerwise
Offload example streams blocks: the engine reports streamed blocks and copies for its run.
(tests/unit/test_example_files.py checks the files against tools/example_workflows.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import example_workflows  # noqa: E402

SAVE_LATENT = "7"   # the examples' SaveLatent node
# The Apply Layerwise Offload example: blocks streamed on any machine.
LAYERWISE = example_workflows.LAYERWISE


@pytest.fixture(scope="module")
def demo_models(comfy) -> str:
    """tools/demo_models.py run into the shared server's models folder, as a user runs it. The
    shared server is left as other tests expect it: the Tiered loaders example pins its models
    (keep in RAM, priority 10), which is undone."""
    done = subprocess.run([sys.executable, str(REPO / "tools" / "demo_models.py"),
                           "--models-dir", str(comfy.base / "models")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    yield done.stdout
    for model in comfy.get("/api/offload/tiers")["models"]:
        if model["name"] in {name for _, name in example_workflows.MODELS}:
            comfy.post(f"/api/offload/policy/{model['id']}", {"keep_in_ram": False, "priority": 0})


def api_form(stem: str) -> dict:
    return json.loads((example_workflows.API_DIR / f"{stem}.json").read_text(encoding="utf-8"))


def test_demo_models_lands_each_model_where_the_examples_load_it(comfy, demo_models):
    for folder, name in example_workflows.MODELS:
        path = comfy.base / "models" / folder / name
        assert path.is_file() and f"{path}:" in demo_models, demo_models
    listed = {folder: comfy.get(f"/models/{folder}") for folder, _ in example_workflows.MODELS}
    assert all(name in listed[folder] for folder, name in example_workflows.MODELS), listed


def test_the_layerwise_example_streams_blocks(comfy, demo_models):
    """Its API form queued as shipped (so it is not queued again below)."""
    settings = api_form(LAYERWISE)["8"]["inputs"]
    outputs = comfy.run(api_form(LAYERWISE))
    assert outputs[SAVE_LATENT]["latents"], outputs
    [state] = [m for m in comfy.get("/offload/layerwise")["models"]
               if m.get("settings", {}).get("resident_blocks") == settings["resident_blocks"]
               and m.get("runs", 0) >= 1]
    assert len(state["resident_indices"]) == settings["resident_blocks"], state["resident_indices"]
    assert len(state["streamed_indices"]) == example_workflows.DIT_BLOCKS - settings["resident_blocks"]
    assert (state["telemetry"] or {}).get("copies", 0) > 0, state["telemetry"]


@pytest.mark.parametrize("stem", [s for s in example_workflows.EXAMPLES if s != LAYERWISE])
def test_each_api_form_runs_as_shipped(comfy, demo_models, stem):
    """Queued without a change: ComfyUI accepts it and the prompt succeeds (a prompt another test
    queued the same way may come from core's cache; it still has to succeed)."""
    entry = comfy.wait(comfy.queue(api_form(stem)))
    assert entry["status"]["status_str"] == "success", entry["status"]
