"""bench/comfy_wan.py --smoke runs its modes through a real server and writes the documented JSON.

It is a check that the benchmark runs. It measures nothing here, and it asserts no timing. The
layerwise latent must equal core's full load (the reference), and the engine must stay within its
memory bound, as everywhere else.
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
    out, rows = tmp_path / "comfy_wan.json", tmp_path / "rows.jsonl"
    bench.main(["--smoke", "--base", str(tmp_path / "base"), "--out", str(out), "--rows", str(rows)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "settings", "model", "link", "workloads", "reference"} <= set(data)
    (run,) = data["workloads"].values()
    assert {"modes", "layerwise_matches_reference", "core_partial_matches_reference"} <= set(run)
    modes = run["modes"]
    assert set(modes) == {"core_full", "core_partial", "layerwise"}
    assert run["layerwise_matches_reference"] is True and data["reference"] == "core_full"
    # One row per mode that ran, written as it ended, with the figures the JSON has.
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    ran = [name for name, mode in modes.items() if "skipped" not in mode]
    assert [r["mode"] for r in written] == ran
    for row in written:
        assert row["step_s"] == modes[row["mode"]]["step_s"]
        assert row["latent_sha256"] == modes[row["mode"]]["latent_sha256"]
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
    assert telemetry["peak_materialized_bytes"] <= telemetry["peak_bound_bytes"]  # of every auto setting
    # The engine copied every streamed block once per model call, and some more (the upload at
    # attach, the prefetch past the last step).
    streamed = modes["layerwise"]["streamed_bytes_per_step"]
    assert 0 < streamed * steps <= telemetry["bytes_copied"]
    if torch.cuda.is_available():
        assert modes["core_partial"]["step_s"] > 0
        assert modes["core_full"]["peak_allocated_bytes"] > 0
    else:
        assert "skipped" in modes["core_partial"]
        # Between runs core counts as loaded the model less its blocks, to the byte, and its
        # size of the model is that plus the engine's bound (what the next run takes again).
        wan = next(m for m in modes["layerwise"]["loaded_models"] if m["class"] == "WAN21")
        assert engine["block_bytes"] == data["model"]["block_bytes"]
        assert wan["loaded_bytes"] == engine["rest_bytes"]
        assert wan["total_bytes"] == engine["rest_bytes"] + engine["bound_bytes"]


def test_comfy_wan_dynamic_smoke(tmp_path):
    """--dynamic: core alone, auto and engine on one server. On CPU core runs no Dynamic VRAM
    (the JSON says so) and all three are classic; each latent must equal core's."""
    bench = _load_bench()
    out = tmp_path / "comfy_wan_dynamic.json"
    bench.main(["--smoke", "--dynamic", "--base", str(tmp_path / "base"), "--out", str(out)])
    data = json.loads(out.read_text())
    (run,) = data["workloads"].values()
    modes = run["modes"]
    assert set(modes) == {"core_dynamic", "auto", "engine"} and data["reference"] == "core_dynamic"
    assert run["auto_matches_reference"] is True and run["engine_matches_reference"] is True
    if not torch.cuda.is_available():
        assert data["dynamic_vram"] is False  # --cpu turns Dynamic VRAM off
    for mode in modes.values():
        assert mode["step_s"] > 0 and mode["host_rss"]["anon_bytes"] > 0
    assert modes["engine"]["layerwise"]["telemetry"]["bytes_copied"] > 0
