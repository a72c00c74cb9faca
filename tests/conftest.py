"""Shared fixtures: tiny fixture models on disk and a real ComfyUI server with our pack.

Lanes: `make test` runs every test against the ComfyUI tree beside .venv/ (0.3.75), then only
the tests marked `comfy_tree` against ComfyUI 0.33.0 (TIERED_OFFLOAD_COMFY_ROOT/_PYTHON, see
comfy_server.py). A test gets that marker by itself when it uses the shared `comfy` server or its
module imports the server harness (ComfyServer, COMFY_ROOT); unit tests do not, so they run on
one lane only: they run the engine alone, which no ComfyUI version changes. Soaks (many
prompts through paths each lane's other tests already run once), and the cases of a matrix that
exercise only the pack's own logic once its other cases have met core, are marked `one_lane`:
they run against 0.3.75 only, since they repeat what the pack does, not what core version it
meets.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "fixtures"))

import tiny_models  # noqa: E402
from comfy_server import COMFY_ROOT, DEFAULT_TREE, ComfyServer, comfy_version, run_tree_script  # noqa: E402

# Each lane keeps its own screenshots and figures: the second must not overwrite the first's.
ARTIFACTS = TESTS / "artifacts" if DEFAULT_TREE else TESTS / "artifacts" / f"comfyui-{comfy_version()}"
TREE_MARKER = "comfy_tree"
ONE_LANE = "one_lane"
_HARNESS = (ComfyServer, COMFY_ROOT, run_tree_script)
SECOND_WAN = "tiny_wan21_low.safetensors"
BLOCK0_LORA = "tiny_wan21_lora_block0.safetensors"
WAN_CLIP_LORA = "tiny_wan21_and_clip_l_lora.safetensors"
SCALED_FP8_WAN = "tiny_wan21_scaled_fp8.safetensors"
MIXED_PRECISION_WAN = "tiny_wan21_mixed_precision.safetensors"


def write_fixture_models(base: Path) -> None:
    """Write every tiny model and LoRA where ComfyUI's loaders look for them."""
    for spec in tiny_models.MODELS.values():
        path = base / "models" / "diffusion_models" / spec["filename"]
        if not path.exists():
            spec["writer"](path, **spec["writer_kwargs"])
    for spec in tiny_models.LORAS.values():
        path = base / "models" / "loras" / spec["filename"]
        if not path.exists():
            spec["writer"](path, **spec["writer_kwargs"])
    # A second Wan (the "low noise" expert of a Wan 2.2-style two-sampler workflow) and a LoRA
    # that touches only block 0, to see that a strength change re-packs one block.
    extra = base / "models" / "diffusion_models" / SECOND_WAN
    if not extra.exists():
        tiny_models.write_tiny_wan21(extra, seed=7)
    lora = base / "models" / "loras" / BLOCK0_LORA
    if not lora.exists():
        tiny_models.write_tiny_wan_lora(lora, model_layers=1, seed=3)
    for name, writer in ((SCALED_FP8_WAN, tiny_models.write_tiny_wan21_scaled_fp8),
                         (MIXED_PRECISION_WAN, tiny_models.write_tiny_wan21_mixed_precision)):
        path = base / "models" / "diffusion_models" / name
        if not path.exists():
            writer(path)
    both = base / "models" / "loras" / WAN_CLIP_LORA
    if not both.exists():
        tiny_models.write_wan_and_clip_lora(both)
    clip = base / "models" / "text_encoders" / tiny_models.CLIP_L_FILENAME
    if not clip.exists():
        tiny_models.write_random_clip_l(clip)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", f"{TREE_MARKER}: runs ComfyUI from the tree under test; the only tests of the "
                   "0.33 lane (set automatically for users of the server harness)")
    config.addinivalue_line(
        "markers", f"{ONE_LANE}: a soak, or a case of the pack's own logic, that runs on the 0.3.75 "
                   "lane only, though it uses the server harness")


def pytest_report_header(config) -> str:
    return f"ComfyUI under test: {comfy_version()} ({COMFY_ROOT})"


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = getattr(item, "module", None)
        uses_harness = module is not None and any(
            value is harness for value in vars(module).values() for harness in _HARNESS)
        if (uses_harness or "comfy" in getattr(item, "fixturenames", ())) and not item.get_closest_marker(ONE_LANE):
            item.add_marker(TREE_MARKER)


@pytest.fixture(scope="session", autouse=True)
def server_fork_parents():
    """Servers of this session are forked from warm parents (tests/server_forks.py): a start
    then costs ComfyUI's own imports and start-up, not torch's and the other packages' again.
    TIERED_OFFLOAD_TEST_FORKS=0 starts each server as its own process, as a user's is."""
    import comfy_server
    from server_forks import ForkParents

    if os.environ.get("TIERED_OFFLOAD_TEST_FORKS", "1") == "0":
        yield None
        return
    comfy_server.fork_parents = parents = ForkParents()
    try:
        yield parents
    finally:
        comfy_server.fork_parents = None
        parents.close()


@pytest.fixture(scope="session")
def comfy_base(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("comfy_base")
    write_fixture_models(base)
    return base


@pytest.fixture(scope="session")
def comfy(comfy_base) -> ComfyServer:
    """One real ComfyUI server for the session's integration tests."""
    server = ComfyServer(comfy_base).start()
    yield server
    server.stop()
    # Core warns when a model it unloaded is still referenced from somewhere: the pack must
    # never keep a dropped model (and its pinned master) alive.
    leaks = [line for line in server.log_text().splitlines() if "memory leak with model" in line]
    assert not leaks, leaks[:5]


@pytest.fixture(scope="session")
def dynamic_vram_probe(tmp_path_factory) -> dict:
    """tests/dynamic_vram_probe.py's report on the tree under test: Apply Layerwise Offload's
    modes against core's real loader, samplers and (stand-in) Dynamic VRAM load."""
    import json
    import subprocess

    from comfy_server import COMFY_PYTHON
    out = tmp_path_factory.mktemp("dynamic_probe")
    proc = subprocess.run([COMFY_PYTHON, "-W", "ignore", str(TESTS / "dynamic_vram_probe.py"), str(out)],
                          cwd=COMFY_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for value in item.funcargs.values():
            if isinstance(value, ComfyServer):
                report.sections.append(("ComfyUI server log (tail)", value.log_tail(120)))
