"""The layerwise benchmark's --smoke mode runs end to end and writes the documented JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "layerwise.py"


def load_layerwise_bench():
    spec = importlib.util.spec_from_file_location("bench_layerwise", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    return bench


def test_bench_smoke_writes_json(tmp_path):
    bench = load_layerwise_bench()
    out = tmp_path / "smoke.json"
    bench.main(["--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "torch", "settings", "link", "models"} <= set(data)
    assert data["smoke"] is True
    assert {"pinned_h2d_GBps", "pageable_h2d_GBps"} <= set(data["link"])
    assert set(data["models"]) == {"wan-smoke", "flux-smoke"}
    for model in data["models"].values():
        assert model["resident_step_s"] > 0 and model["naive_swap_step_s"] > 0
        assert len(model["streaming"]) >= 3
        for s in model["streaming"]:
            for key in ("resident", "prefetch", "step_s", "bound_s", "efficiency", "per_block_copy_GBps",
                        "streamed_bytes_per_step", "bound_bytes", "pinned_over_packed", "telemetry"):
                assert key in s, key
            assert s["telemetry"]["peak_materialized_bytes"] <= s["bound_bytes"]
            assert s["telemetry"]["sync_fallbacks"] == 0


def test_hook_overhead_bench_streams_every_block_in_order(tmp_path):
    """bench/hook_overhead.py runs end to end: every block call was served from a slot its copy
    had filled ahead of time (no fallback, no order miss), and the JSON has its figures."""
    spec = importlib.util.spec_from_file_location("bench_hook_overhead", BENCH.with_name("hook_overhead.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "hook.json"
    result = bench.main(["--blocks", "6", "--passes", "3", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    (engine,) = result["engines"].values()
    assert engine["sync_fallbacks"] == 0 and engine["order_misses"] == 0
    assert result["plain"]["min_us"] > 0 and engine["streamed"]["min_us"] > 0
    assert engine["timeline_recorded"] is False  # off unless asked for
    # --timeline: the engine records the picture of each pass, and serves every block the same.
    (engine,) = bench.main(["--blocks", "6", "--passes", "3", "--repeats", "2", "--timeline"])["engines"].values()
    assert engine["timeline_recorded"] is True
    assert engine["sync_fallbacks"] == 0 and engine["order_misses"] == 0


def test_bench_rows_give_the_session_its_figures(tmp_path):
    """--rows appends each measurement as it is taken, and bench/gpu_summary.py turns them into
    issue 34's engine figures: each one the ratio of the measurements it names."""
    bench = load_layerwise_bench()
    rows_path = tmp_path / "rows.jsonl"
    data = bench.main(["--smoke", "--settings", "0:1,2:2", "--lora-settings", "2:2", "--lora-rank", "4",
                       "--skip-naive", "--rows", str(rows_path), "--out", str(tmp_path / "smoke.json")])
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_summary
        from session_rows import read_rows
    finally:
        sys.path.remove(str(BENCH.parent))
    rows = read_rows(rows_path)
    assert [r["row"] for r in rows] == ["link"] + ["resident", "streaming", "streaming", "streaming"] * 2
    figures = gpu_summary.engine_figures(rows)
    assert sorted({f["id"] for f in figures}) == ["P1", "P11", "P12", "P2", "P3"]
    wan = data["models"]["wan-smoke"]
    plain, lora = (next(s for s in wan["streaming"] if (s["resident"], s["lora_rank"]) == (2, rank))
                   for rank in (0, 4))
    assert lora["telemetry"]["transforms"] > 0, "the LoRA was merged into no streamed copy"
    (p11,) = [f for f in figures if f["id"] == "P11"]
    assert p11["value"] == plain["step_s"] / wan["resident_step_s"]
    p12 = [f for f in figures if f["id"] == "P12" and f["where"].startswith("wan-smoke")]
    assert [f["value"] for f in p12] == [lora["step_s"] / plain["step_s"]]
    p2 = [f["value"] for f in figures if f["id"] == "P2" and f["where"].startswith("wan-smoke")]
    assert p2 == [s["step_s"] / s["bound_s"] for s in wan["streaming"] if not s["lora_rank"]]


def test_bench_compiled_row_streams_the_compiled_blocks_bit_identically(tmp_path):
    """--compiled: each block compiled (inductor), resident and then streamed; on the CPU the two
    give the same bits and the timed passes compile nothing (one small model: compiling is slow)."""
    bench = load_layerwise_bench()
    import torch._dynamo
    torch._dynamo.reset()
    try:
        result = bench.main(["--smoke", "--compiled", "--models", "wan", "--skip-naive",
                             "--settings", "1:1", "--out", str(tmp_path / "compiled.json")])
    finally:
        torch._dynamo.reset()
    (model,) = result["models"].values()
    row = model["compiled"]
    assert (row["resident"], row["prefetch"]) == (1, 1)
    assert row["bit_identical"] is True and row["graphs_compiled_while_timed"] == 0
    assert row["resident_compiled_step_s"] > 0 and row["streamed_over_resident"] > 0


def test_auto_runs_bench_runs_every_row_and_keeps_the_output(tmp_path):
    """bench/auto_runs.py --smoke: every row of the matrix runs auto and the old default, each
    setting's runs give the output of every block resident, bit for bit, and each row has its
    verdict against the old default and its ratio to the best fixed setting."""
    spec = importlib.util.spec_from_file_location("bench_auto_runs", BENCH.with_name("auto_runs.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        out = tmp_path / "auto_runs.json"
        result = bench.main(["--smoke", "--dir", str(tmp_path), "--out", str(out)])
    finally:
        sys.modules.pop(spec.name, None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["row"]["name"] for r in result["rows"]] == [row.name for row in bench.ROWS]
    for row in result["rows"]:
        assert {"auto", "old default"} <= set(row["settings"]), row
        assert row["verdict"] in ("faster", "equal", "slower"), row
        assert row["auto_vs_best_fixed"] > 0 and row["best_fixed"] in row["settings"], row
        for name, s in row["settings"].items():
            assert len(s["runs_s"]) == result["rounds"], (row["row"]["name"], name)
            assert s["same_output"] or row["row"]["lora"], (row["row"]["name"], name)
        assert row["auto_tuning"]["phase"] in ("hold", "check", "measure", "planning"), row["auto_tuning"]
    assert sum(result["verdicts"].values()) == len(result["rows"])


def test_auto_matrix_bench_runs_its_rows_on_the_stream_model(tmp_path):
    """bench/auto_matrix.py --smoke: each row runs auto, the old default and every fixed setting
    on the stream model, every output is the one of every block resident, and each row has auto's
    first and later runs against the old default and the best fixed setting, with a verdict."""
    spec = importlib.util.spec_from_file_location("bench_auto_matrix", BENCH.with_name("auto_matrix.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        out = tmp_path / "auto_matrix.json"
        result = bench.main(["--smoke", "--runs", "2", "--out", str(out)])
    finally:
        sys.modules.pop(spec.name, None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["row"] for r in result["rows"]] == [row.name for row in bench.SMOKE]
    for row in result["rows"]:
        assert row["same_output"] and row["settings_weighed"] > 1, row
        assert row["verdict"] in ("faster", "equal", "slower"), row
        for key in ("first_vs_old_default", "later_vs_old_default", "first_vs_best_fixed", "later_vs_best_fixed"):
            assert row[key] > 0, (key, row)
    assert sum(result["verdicts"].values()) == len(result["rows"])
