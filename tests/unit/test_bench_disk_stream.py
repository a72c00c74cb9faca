"""bench/disk_stream.py --smoke runs end to end and writes the documented JSON.

It checks that the benchmark runs and that its disk runs really streamed from the spill file and
matched the resident reference; it asserts no timing. In its read-ahead comparison (cold passes
through a cache of a few units, 1, 2 and 4 workers and auto), reading further ahead costs hits,
auto's cache keeps as many units from step to step as any fixed setting that reads as far ahead
or further, and the pipeline model's hit rate is the one measured: counters that the cache's
order-only rule makes the same from run to run.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "disk_stream.py"


def test_disk_stream_smoke_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_disk_stream", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    out = tmp_path / "smoke.json"
    bench.main(["--smoke", "--dir", str(tmp_path), "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "settings", "raw", "granularity", "file_bytes", "block_bytes"} <= set(data)
    assert data["smoke"] is True and data["device"] == "cpu"
    assert data["raw"]["warm"] > 0 and data["raw"]["cold"] > 0
    assert set(data["granularity"]) == {"block", "phase"}
    for name, row in data["granularity"].items():
        assert row["ram"]["step_s"] > 0
        disk = row["disk"]
        assert disk["matches_reference"] is True, name
        assert disk["spill_bytes"] >= data["block_bytes"], disk  # the packed layout, padded
        assert 0 < disk["cache_bytes"] < data["block_bytes"]
        for state in ("warm", "cold"):
            figures = disk[state]
            assert figures["step_s"] > 0 and figures["disk_bytes_read_per_step"] > 0, (name, state, figures)
            assert figures["disk_read_gibps"] > 0 and figures["vs_raw"] > 0
            assert 0 <= figures["cache_hit_rate"] < 1
            assert figures["order_misses"] == 0 and figures["sync_fallbacks"] == 0
    assert data["granularity"]["phase"]["ram"]["units"] > data["granularity"]["block"]["ram"]["units"]
    for name, row in data["granularity"].items():
        ahead = row["read_ahead"]["settings"]
        assert set(ahead) == {"1", "2", "4", "auto"}, name
        auto, tuning = ahead["auto"], ahead["auto"]["tuning"]
        assert tuning["auto"] == ["read_ahead"] and tuning["phase"] == "hold", tuning
        assert ahead["4"]["cache_hit_rate"] < ahead["1"]["cache_hit_rate"], (name, ahead)  # read-ahead takes hits
        # Auto reads ahead as far as its plan needs (deeper where reads must start earlier to be
        # hidden), and its cache keeps as much as any fixed setting that reads as far or further.
        deeper = [ahead[k] for k in ("1", "2", "4") if int(k) >= auto["read_ahead"]]
        assert auto["cache_hit_rate"] >= max(r["cache_hit_rate"] for r in deeper) - 0.05, (name, ahead)
        assert tuning["hit_rate"] is not None and abs(tuning["hit_rate"] - auto["cache_hit_rate"]) <= 0.1, \
            (name, tuning["hit_rate"], auto)  # the model's hit rate is the cache's
    assert data["granularity"]["phase"]["ram"]["bound_bytes"] < data["granularity"]["block"]["ram"]["bound_bytes"]
