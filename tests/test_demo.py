"""`make demo` from end to end: a user's server (no test-only node), the demo workflow, and
the way to open it in the UI. Its log must show no module that failed to import."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from comfy_server import TEST_NODES_LINK_NAME, free_port

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_with_user_nodes_only(tmp_path):
    base = tmp_path / "demo"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "demo.py"), "--exit",
                           "--port", str(free_port()), "--base", str(base)],
                          capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "sha256 " in out and "Browse Templates" in out and "tiered_offload_demo" in out, out
    assert "Apply Layerwise Offload: HunyuanVideo with 12 blocks" in out, out
    assert "loaded: SD1ClipModel (text encoder" in out, out
    # Its picture is recorded, so the panel opened after the run shows it.
    assert "picture of the run recorded for HunyuanVideo: 10 streamed units" in out, out
    assert "could not import" not in out, out
    assert " MB" not in out and " GB" not in out, "decimal units in the demo's output"
    assert not (base / "custom_nodes" / TEST_NODES_LINK_NAME).exists()
    log = "".join(p.read_text(errors="replace") for p in base.glob("comfy-*.log"))
    assert "IMPORT FAILED" not in log, [l for l in log.splitlines() if "IMPORT FAILED" in l]
    assert "comfy_test_nodes" not in log
