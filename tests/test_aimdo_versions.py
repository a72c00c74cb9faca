"""The pack's calls into comfy-aimdo against the comfy-aimdo ComfyUI 0.33 pins and comfy-aimdo 0.6.

comfy-aimdo 0.6 changed what the pack relies on: `unpin`, `set_watermark` and `free_memory`
raise when the native call fails, and `ModelVBAR` takes a page-out callback. The pack calls
`vbar_unpin` and `get_residency` itself (nodes/layerwise/vbar_layout.py); `set_watermark`,
`free_memory` and the making of a VBAR only core does. The probe (aimdo_probe.py) runs those calls through
comfy-aimdo's real Python wrappers over a stand-in of its native library (CUDA only); the
Makefile installs 0.6 into .aimdo-0.6/ (`make .aimdo-0.6/.ready`, a step of the 0.33 lane).
"""
from __future__ import annotations

import re

import pytest

from comfy_server import REPO, run_tree_script
from conftest import TESTS

AIMDO_06 = REPO / ".aimdo-0.6"


def _run(tmp_path_factory, name: str, env: dict[str, str] | None = None) -> dict:
    out = tmp_path_factory.mktemp("aimdo") / f"{name}.json"
    probe = run_tree_script(TESTS / "aimdo_probe.py", out, threads=2, timeout=300, env=env)
    if probe["version"] is None:
        pytest.skip("this ComfyUI's Python has no comfy-aimdo (no Dynamic VRAM)")
    return probe


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> dict:
    return _run(tmp_path_factory, "pinned")


@pytest.fixture(scope="module")
def newer(pinned, tmp_path_factory) -> dict:
    assert (AIMDO_06 / "comfy_aimdo" / "model_vbar.py").is_file(), \
        "comfy-aimdo 0.6 is not installed: make .aimdo-0.6/.ready"
    return _run(tmp_path_factory, "0.6", {"PYTHONPATH": str(AIMDO_06)})


def test_the_probes_import_the_versions_they_are_meant_to(pinned, newer):
    pin = re.search(r"^comfy-aimdo==(\S+)$", (REPO / "tools" / "requirements-033.txt").read_text(), re.M)
    assert pinned["version"] == pin.group(1)
    assert newer["version"].startswith("0.6.") and newer["module_file"].startswith(str(AIMDO_06))
    assert "pageout_callback" in newer["vbar_init"] and "pageout_callback" not in pinned["vbar_init"]


@pytest.mark.parametrize("which", ["pinned", "newer"])
def test_a_reset_hands_every_slice_back_and_drops_the_vbar(which, request):
    case = request.getfixturevalue(which)["cases"]["unpin_succeeds"]
    assert case == {"slices": 8, "reason": None, "unpin_calls": 8, "slices_left": 0,
                    "vbar_kept": False}


def test_a_slice_comfy_aimdo_06_cannot_hand_back_stops_the_reset_and_says_so(newer):
    """0.6 raises where its native unpin fails: the reset stops there (two slices handed back,
    the rest and the VBAR kept, a state core's next load handles) and gives the reason, which
    the node shows instead of failing the prompt."""
    case = newer["cases"]["unpin_fails_at_the_third_slice"]
    assert case["reason"].startswith("comfy-aimdo could not hand a weight's VRAM slice back (VBAR unpin failed)")
    assert "2 slices handed back" in case["reason"]
    assert case["unpin_calls"] == 3 and case["slices_left"] == 6 and case["vbar_kept"]


def test_the_pinned_comfy_aimdo_cannot_say_that_an_unpin_failed(pinned):
    """0.4's unpin returns nothing, failed or not: the reset goes on to the end, as before."""
    case = pinned["cases"]["unpin_fails_at_the_third_slice"]
    assert case == {"slices": 8, "reason": None, "unpin_calls": 8, "slices_left": 0,
                    "vbar_kept": False}


@pytest.mark.parametrize("which", ["pinned", "newer"])
def test_residency_reads_the_pages_of_each_block(which, request):
    assert request.getfixturevalue(which)["residency"] == ["resident", "partial", "streamed", "streamed"]
