"""bench/comfy_wan.py --smoke runs its modes through a real server and writes the documented JSON.

It is a check that the benchmark runs. It measures nothing here, and it asserts no timing. The latents of every mode must be
bit-identical, and the engine must stay within its memory bound, as everywhere else.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "comfy_wan.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_comfy_wan", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_comfy_wan_smoke(tmp_path):
    bench = _load_bench()
    out = tmp_path / "comfy_wan.json"
    bench.main(["--smoke", "--base", str(tmp_path / "base"), "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "settings", "model", "link", "modes", "bit_identical"} <= set(data)
    modes = data["modes"]
    assert set(modes) == {"core_full", "core_partial", "layerwise"}
    assert data["bit_identical"] is True
    assert modes["core_full"]["latent_sha256"] == modes["layerwise"]["latent_sha256"]
    steps = data["settings"]["steps"]
    for name in ("core_full", "layerwise"):
        mode = modes[name]
        assert mode["calls"] >= steps and mode["calls"] == mode["calls_per_step"] * steps
        assert mode["step_s"] > 0 and mode["prompt_s"] > 0
        assert any(m["class"] == "WAN21" for m in mode["loaded_models"]), mode["loaded_models"]
    engine = modes["layerwise"]["layerwise"]
    assert engine["streamed_indices"], engine
    telemetry = engine["telemetry"]
    assert telemetry["bytes_copied"] > 0 and telemetry["sync_fallbacks"] == 0
    assert telemetry["peak_materialized_bytes"] <= telemetry["bound_bytes"]
    # The engine copied every streamed block once per model call, and some more (the upload at
    # attach, the prefetch past the last step).
    streamed = modes["layerwise"]["streamed_bytes_per_step"]
    assert 0 < streamed * steps <= telemetry["bytes_copied"]
    if torch.cuda.is_available():
        assert modes["core_partial"]["step_s"] > 0
        assert modes["core_full"]["peak_allocated_bytes"] > 0
    else:
        assert "skipped" in modes["core_partial"]
        # Core's count of the model leaves out the blocks the engine holds, to the byte.
        wan = next(m for m in modes["layerwise"]["loaded_models"] if m["class"] == "WAN21")
        assert wan["loaded_bytes"] == wan["total_bytes"] - data["model"]["block_bytes"]
