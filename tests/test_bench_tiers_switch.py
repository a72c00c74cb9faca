"""bench/tiers_switch.py --smoke visits its workflows through real servers and writes its JSON.

A check that the benchmark runs and measures what it says; it asserts no timing. Core's loader
reads the file again on every visit, the Tiered loader serves every revisit from RAM, and each
workflow's latent is the same bit for bit on every visit with either loader.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "tiers_switch.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_tiers_switch", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_tiers_switch_smoke(tmp_path):
    bench = _load_bench()
    out = tmp_path / "tiers_switch.json"
    bench.main(["--smoke", "--base", str(tmp_path / "base"), "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "page_cache", "model_bytes", "visits", "summary", "bit_identical"} <= set(data)
    assert data["page_cache"] == "warm" and data["device"]
    assert data["bit_identical"] is True
    workflows = set(data["model_bytes"])
    assert len(workflows) == 3
    rounds = data["settings"]["rounds"]
    for mode in ("core", "tiered"):
        visits = [v for v in data["visits"] if v["mode"] == mode]
        assert [v["workflow"] for v in visits] == list(data["model_bytes"]) * rounds
        for v in visits:
            assert 0 <= v["load_s"] <= v["prompt_s"], v
        assert data["summary"][mode]["revisits"] == len(workflows) * (rounds - 1)
    core = [v for v in data["visits"] if v["mode"] == "core"]
    assert all(v["loader_ran"] and v["source"] == "disk" for v in core), core
    tiered = [v for v in data["visits"] if v["mode"] == "tiered"]
    assert [v["source"] for v in tiered] == ["disk"] * len(workflows) + ["ram"] * len(workflows) * (rounds - 1)
    assert all(v["loads_from_disk"] == 1 for v in tiered), tiered
