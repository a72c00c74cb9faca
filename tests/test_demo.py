"""`make demo` from end to end: a user's server (no test-only node), the demo workflow, and
the way to open it in the UI. Its log must show no module that failed to import. The demo serves
on the port it is given (a machine may already run ComfyUI on 8188), and refuses a port in use
before anything starts; its ComfyUI ends with it, however it ends."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from comfy_server import TEST_NODES_LINK_NAME, free_port

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import example_workflows  # noqa: E402


def test_demo_runs_with_user_nodes_only(tmp_path):
    base = tmp_path / "demo"
    port = free_port()
    done = subprocess.run([sys.executable, str(REPO / "tools" / "demo.py"), "--exit",
                           "--port", str(port), "--base", str(base)],
                          capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "sha256 " in out and "Browse Templates" in out and example_workflows.DEMO in out, out
    assert f"ComfyUI is served at http://127.0.0.1:{port}/" in out, out
    assert "Apply Layerwise Offload: HunyuanVideo with 12 blocks" in out, out
    assert "loaded: SD1ClipModel (text encoder" in out, out
    # The node's defaults: auto says what it chose; the streaming example is named.
    assert "  auto settings: " in out and example_workflows.LAYERWISE in out, out
    assert "could not import" not in out, out
    assert " MB" not in out and " GB" not in out, "decimal units in the demo's output"
    assert not (base / "custom_nodes" / TEST_NODES_LINK_NAME).exists()
    log = "".join(p.read_text(errors="replace") for p in base.glob("comfy-*.log"))
    assert "IMPORT FAILED" not in log, [l for l in log.splitlines() if "IMPORT FAILED" in l]
    assert "comfy_test_nodes" not in log


def test_demo_refuses_a_port_in_use_and_names_the_option(tmp_path):
    """Someone's ComfyUI on the port: the demo must not start (nor queue its workflow on that
    server), and says how to pick another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, str(REPO / "tools" / "demo.py"), "--exit",
                               "--port", str(port), "--base", str(tmp_path / "demo")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port} is in use" in done.stderr, done.stderr
    assert f'make demo DEMO_ARGS="--port {port + 1}"' in done.stderr, done.stderr
    assert not (tmp_path / "demo").exists(), "the demo wrote its models before refusing"


def test_make_demo_passes_demo_args_on():
    """The README's `make demo DEMO_ARGS="--port 8189"` reaches tools/demo.py (make -n: printed,
    nothing run)."""
    done = subprocess.run(["make", "-n", "demo", "DEMO_ARGS=--port 8189 --exit"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tools/demo.py --port 8189 --exit" in done.stdout, done.stdout


@pytest.mark.parametrize("how", ["demo terminated", "demo killed", "ComfyUI died"])
def test_the_demo_and_its_comfyui_end_together(tmp_path_factory, how):
    """A demo stopped (SIGTERM, as a closed terminal's SIGHUP does) or killed outright (SIGKILL)
    leaves no ComfyUI serving; a ComfyUI that dies ends the demo, which says so and where its log
    is, instead of exiting in silence."""
    base = tmp_path_factory.getbasetemp() / "demo-ends"  # the models are written once for all three
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-u", str(REPO / "tools" / "demo.py"), "--port", str(port),
                             "--base", str(base)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in demo.stdout:
            lines.append(line)
            if "serving until Ctrl-C" in line:
                break
        assert demo.poll() is None, "".join(lines)[-3000:]
        [comfy] = psutil.Process(demo.pid).children()
        if how == "demo terminated":
            demo.send_signal(signal.SIGTERM)
        elif how == "demo killed":
            demo.kill()
        else:
            comfy.kill()
        rest = demo.stdout.read()
        code = demo.wait(timeout=60)
        psutil.wait_procs([comfy], timeout=30)
        assert not comfy.is_running() or comfy.status() == psutil.STATUS_ZOMBIE, how
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, "ComfyUI still serves on the demo's port"
        if how == "ComfyUI died":
            assert code == 1 and "ComfyUI stopped on its own" in rest and "comfy-" in rest, rest
        elif how == "demo terminated":
            assert code == 0 and "stopping ComfyUI" in rest, rest
    finally:
        if demo.poll() is None:
            demo.kill()
