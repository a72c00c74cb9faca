"""bench/disk_stream.py --smoke runs end to end and writes the documented JSON.

It checks that the benchmark runs, that its direct mode read the model's own file and wrote
nothing while its spill mode wrote the blocks first, and that both matched the resident
reference; it asserts no timing. In its read-ahead comparison (cold passes through a cache of a
few units, 1, 2 and 4 workers and auto), reading further ahead costs hits, auto's cache keeps as
many units from step to step as any fixed setting that reads as far ahead or further, and the
pipeline model's hit rate is the one measured: counters that the cache's order-only rule makes
the same from run to run.
"""
from __future__ import annotations

import pytest

import importlib.util
import json
import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parents[2] / "bench" / "disk_stream.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_disk_stream", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    return bench


def test_the_read_ahead_comparison_can_be_left_out_and_a_negative_count_is_refused(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "modes.json"
    bench.main(["--smoke", "--read-ahead-rounds", "0", "--modes", "direct", "--dir", str(tmp_path), "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["read_ahead"] is None and set(data["modes"]) == {"direct"}
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--read-ahead-rounds", "-1"])
    assert "--read-ahead-rounds must be 0" in capsys.readouterr().err


def test_disk_stream_smoke_writes_json(tmp_path):
    bench = _bench()
    out = tmp_path / "smoke.json"
    bench.main(["--smoke", "--dir", str(tmp_path), "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "settings", "spec", "file_bytes", "modes"} <= set(data)
    assert data["smoke"] is True and data["device"] == "cpu"
    assert set(data["modes"]) == {"direct", "spill"}
    for name, row in data["modes"].items():
        assert row["matches_reference"] is True, name
        assert row["first_step_s"] > 0 and row["first_step_vs_pass_reads"] > 0, row
        assert row["direct_read_before_gibps"] > 0 and row["direct_read_after_gibps"] > 0, row
        assert row["disk_bytes_read_per_pass"] > 0 and row["engine_read_gibps"] > 0 and row["p8"] > 0, row
        assert 0 < row["cache_bytes"] < row["streamed_bytes"], row
        assert row["order_misses"] == 0 and row["sync_fallbacks"] == 0 and row["disk_read_errors"] == 0
    direct, spill = data["modes"]["direct"], data["modes"]["spill"]
    assert direct["written_bytes_engine"] == 0 and direct["attach_figures"]["spill_units"] == 0, direct
    assert direct["attach_figures"]["file_units"] == data["spec"]["blocks"], direct
    assert spill["written_bytes_engine"] >= spill["streamed_bytes"], spill
    assert spill["attach_figures"]["file_units"] == 0, spill
    ahead, name = data["read_ahead"]["settings"], "read-ahead"
    assert set(ahead) == {"1", "2", "4", "auto", "1 again"}, name
    assert ahead["1 again"]["read_ahead"] == 1 and data["read_ahead"]["same_setting_spread"] >= 0, name
    auto, tuning = ahead["auto"], ahead["auto"]["tuning"]
    assert tuning["auto"] == ["read_ahead"] and tuning["phase"] == "hold", tuning
    assert ahead["4"]["cache_hit_rate"] < ahead["1"]["cache_hit_rate"], (name, ahead)  # read-ahead takes hits
    # Auto reads ahead as far as its plan needs (deeper where reads must start earlier to be
    # hidden), and its cache keeps as much as any fixed setting that reads as far or further.
    deeper = [ahead[k] for k in ("1", "2", "4") if int(k) >= auto["read_ahead"]]
    assert auto["cache_hit_rate"] >= max(r["cache_hit_rate"] for r in deeper) - 0.05, (name, ahead)
    assert tuning["hit_rate"] is not None and abs(tuning["hit_rate"] - auto["cache_hit_rate"]) <= 0.1, \
        (name, tuning["hit_rate"], auto)  # the model's hit rate is the cache's
