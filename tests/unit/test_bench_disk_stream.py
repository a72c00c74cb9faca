"""bench/disk_stream.py --smoke runs end to end and writes the documented JSON.

It checks that the benchmark runs and that its disk runs really streamed from the spill file and
matched the resident reference; it asserts no timing. In its read-ahead comparison (cold passes
through a cache of a few units, 1, 2 and 4 workers and auto), auto's cache keeps at least as
many units from step to step as any fixed setting's, and reads no more per step: counters that the
cache's order-only rule makes the same from run to run.
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
        auto = ahead["auto"]
        assert auto["tuning"]["auto"] == ["read_ahead"] and auto["tuning"]["phase"] == "hold", auto["tuning"]
        fixed = [ahead[k] for k in ("1", "2", "4")]
        assert auto["cache_hit_rate"] >= max(r["cache_hit_rate"] for r in fixed), (name, ahead)
        assert auto["disk_bytes_read_per_step"] <= min(r["disk_bytes_read_per_step"] for r in fixed) * 1.05, (name, ahead)
        assert ahead["4"]["cache_hit_rate"] < ahead["1"]["cache_hit_rate"], (name, ahead)  # read-ahead takes hits
    assert data["granularity"]["phase"]["ram"]["bound_bytes"] < data["granularity"]["block"]["ram"]["bound_bytes"]
