"""Apply Layerwise Offload's classic-patcher choice, checked against the ComfyUI tree under test.

The probe (dynamic_vram_probe.py) runs in ComfyUI's own Python with ComfyUI's real loader and
ModelPatcher. On 0.3.75 only the classic case exists; the dynamic case runs where the tree has
ModelPatcherDynamic (0.33 and later: TIERED_OFFLOAD_COMFY_ROOT / TIERED_OFFLOAD_COMFY_PYTHON), on
a stand-in patcher, because a real ModelPatcherDynamic needs comfy-aimdo on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from comfy_server import COMFY_PYTHON, COMFY_ROOT
from conftest import TESTS


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dynamic_probe")
    proc = subprocess.run([COMFY_PYTHON, "-W", "ignore", str(TESTS / "dynamic_vram_probe.py"), str(out)],
                          cwd=COMFY_ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_classic_model_gets_a_plain_clone(probe):
    assert probe["classic"] == {"input_dynamic": False, "is_clone": True, "shares_module": True,
                                "output_dynamic": False}


def test_dynamic_model_gets_a_classic_delegate(probe):
    dyn = probe.get("dynamic")
    if dyn is None:
        pytest.skip("this ComfyUI has no Dynamic VRAM (ModelPatcherDynamic)")
    assert "disable_dynamic" in probe["clone_params"]
    assert probe["delegate_params"] == []
    assert probe["cached_patcher_init"], "core's loader registers the reload factory"
    assert dyn["input_dynamic"] and dyn["got_patcher"]
    assert dyn["output_type"] == "ModelPatcher" and not dyn["output_dynamic"]
    # The delegate is rebuilt from the loader: its own module, same weights, same patches (LoRA).
    assert dyn["new_module"] and dyn["same_weights"] and dyn["patches_kept"]
    # A second call (the node re-run with other settings) must not load the model again.
    assert dyn["rerun_reuses_module"]
    # A model from a loader without a reload factory: the node steps aside instead of failing.
    assert dyn["no_loader_steps_aside"]
