"""bench/shared_host_store.py --smoke runs two workers with and without sharing through real servers
and writes its JSON.

A check that the benchmark runs and measures what it says; it asserts no timing. Without sharing
each worker packs its own copy and maps no store; with it one store exists, one worker packs it,
the other maps it (packing nothing), and the store's PSS over both is one copy of the blocks.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "shared_host_store.py"

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads /proc (Linux)")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_shared_host_store", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_shared_host_store_smoke(tmp_path):
    bench = _load_bench()
    out = tmp_path / "shared_host_store.json"
    bench.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "block_bytes", "runs", "bounds"} <= set(data) and data["device"]
    runs = {(r["workers"], r["share"]): r for r in data["runs"]}
    assert set(runs) == {(2, False), (2, True)}
    off, on = runs[(2, False)], runs[(2, True)]
    assert off["store_files"] == [] and off["store_pss_total"] == 0
    assert all(row["blocks_packed"] > 0 and row["host_store"]["shared"] is False for row in off["rows"])
    assert len(on["store_files"]) == 1
    assert [row["blocks_packed"] > 0 for row in on["rows"]] == [True, False]  # the second maps
    assert all(row["host_store"]["shared"] and row["host_store"]["users"] == 2 for row in on["rows"])
    assert data["bounds"]["checks"]["store_pss_is_one_copy_n2"] is True
    for row in on["rows"] + off["rows"]:
        assert 0 < row["attach_s"] and 0 < row["first_step_s"] and row["pss_growth"] > 0
