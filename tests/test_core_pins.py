"""The engine's pins count in core's pinned-memory figure, and core's cap bounds the engine's.

Runs tests/core_pins_probe.py in the ComfyUI tree under test (TIERED_OFFLOAD_COMFY_ROOT /
TIERED_OFFLOAD_COMFY_PYTHON pick another release); see the probe for what a CPU cannot show.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from comfy_server import COMFY_PYTHON, COMFY_ROOT
from conftest import TESTS

GIB = 1 << 30


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = subprocess.run([COMFY_PYTHON, "-W", "ignore", str(TESTS / "core_pins_probe.py")],
                          cwd=COMFY_ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_installs_and_leaves_the_engine_cap_alone_where_core_pins_nothing(probe):
    assert probe["installed"] is True
    assert probe["core_cap_on_cpu"] <= 0  # ComfyUI pins nothing without NVIDIA or AMD
    assert probe["cap_while_core_pins_nothing"] == probe["own_cap"]


def test_engine_pins_count_in_core_and_core_cap_bounds_the_engine(probe):
    assert probe["own_cap"] > 7 * GIB, "this check needs more RAM than core's test cap"
    assert probe["cap"] == 7 * GIB  # core's 8 GiB less its own 1 GiB
    assert probe["core_count_after_engine_pin"] == 3 * GIB
    assert probe["cap_after_engine_pin"] == 7 * GIB  # the engine's own pins are inside its cap


def test_core_count_reset_is_repaired_and_the_engine_unpin_is_subtracted(probe):
    assert probe["cap_after_core_reset"] == 8 * GIB  # core holds nothing of its own now
    assert probe["core_count_after_core_reset"] == 2 * GIB  # the engine's 2 GiB are counted again
    assert probe["core_count_after_engine_unpin"] == 0


def test_a_failed_registration_is_cleared_with_cores_own_function_where_it_has_one(probe):
    """0.33 clears the CUDA error a failed cudaHostRegister leaves with discard_cuda_async_error;
    the engine then uses it too (0.3.75 has none: the engine does the same with torch)."""
    if not probe["core_has_discard"]:
        pytest.skip("this ComfyUI has no discard_cuda_async_error")
    assert probe["discards_after_failed_registration"] == 1
