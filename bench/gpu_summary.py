"""The summary of one device call of bench/gpu_session.sh: summary.json and a table to read last.

It reads the session's rows (bench/session_rows.py: every part, test and measurement appended as
it happened) and says: the device, its driver, torch and the ComfyUI version; every part of the
plan with its status, time and tests; every figure of issue 34's table against its goal, with
where it was measured; and whether what the call leaves in $OUT comes back whole (and, in a
rehearsal, whether what it carries fits). A figure no row measured is listed as not measured, so
a part cut at its cap shows as a gap, never as a pass.

  gpu_summary.py device --rows ROWS --comfy-root TREE   append the device's row (first, in the kit)
  gpu_summary.py write --rows ROWS --out OUT --mode first|dynamic --plan "part:cap ..." [...]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import gpu_carry  # noqa: E402
from session_rows import append_row, read_rows  # noqa: E402

# Issue 34's figures: what each measures, which way is better, its goal.
GOALS: dict[str, tuple[str, str, float]] = {
    "P1": ("per-block H2D GB/s / measured pinned peak of this link", ">=", 0.90),
    "P2": ("step time / max(resident compute, streamed bytes / peak)", "<=", 1.05),
    "P2 auto": ("auto's step (resident blocks and prefetch planned) / the best manual setting's", "<=", 1.02),
    "P3": ("pinned host RAM / packed weight bytes", "<=", 1.05),
    "P4": ("step time / core's classic partial load (0.3.75) at equal VRAM, Flux regime", "<=", 0.75),
    "P5": ("step time / core's classic partial load (0.3.75) at equal VRAM, Wan-14B", "<=", 1.00),
    "P11": ("Wan-14B step, all but 2 blocks streamed / all resident", "<=", 1.01),
    "P12": ("streamed step with a rank-32 LoRA on every block / without", "<=", 1.05),
    "P4d auto": ("auto step / core's Dynamic VRAM (0.33) alone at equal VRAM", "<=", 1.00),
    "P4d engine": ("engine step / core's Dynamic VRAM (0.33) alone at equal VRAM", "<=", 0.90),
}
# Which figures each call measures.
FIGURES = {"first": ("P1", "P2", "P2 auto", "P3", "P11", "P12", "P4", "P5"),
           "dynamic": ("P4d auto", "P4d engine")}
# The ComfyUI bench's workloads (bench/gpu_session.sh names them) and the figure each gives.
COMFY_FIGURES = {"flux-1024px": "P4", "wan-480p": "P5"}
# P11's setting: every block streamed but this many.
P11_RESIDENT = 2


# ------------------------------------------------------------------ the device
def device_row(comfy_root: Path | None) -> dict[str, Any]:
    import torch

    from comfy_server import comfy_version
    cuda = torch.cuda.is_available()
    row: dict[str, Any] = {
        "row": "device", "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "device_total_bytes": torch.cuda.mem_get_info(0)[1] if cuda else None,
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "comfyui": comfy_version(comfy_root) if comfy_root else None,
    }
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        row["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        row["driver"] = smi.stdout.split(",")[1].strip() if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError) as e:
        row["nvidia_smi"], row["driver"] = f"not run: {e}", None
    return row


# ------------------------------------------------------------------ figures
def _figure(fid: str, where: str, value: float | None, note: str | None = None) -> dict[str, Any]:
    what, way, goal = GOALS[fid]
    met = None if value is None else (value >= goal if way == ">=" else value <= goal)
    out = {"id": fid, "where": where, "value": value, "goal": f"{way} {goal:.2f}", "met": met,
           "what": what}
    if note:
        out["note"] = note
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def engine_figures(rows: list[dict]) -> list[dict]:
    """P1, P2, P3, P11 and P12 from bench/layerwise.py's rows."""
    out = []
    resident = {r["model"]: r for r in rows if r.get("bench") == "layerwise" and r["row"] == "resident"}
    streaming = [r for r in rows if r.get("bench") == "layerwise" and r["row"] == "streaming"]
    for model in resident:
        mine = [r for r in streaming if r["model"] == model]
        plain = [r for r in mine if not r["lora_rank"]]
        copies = [_ratio(r["per_block_copy_GBps"], r["link_GBps"]) for r in plain if r["per_block_copy_GBps"]]
        if copies:
            out.append(_figure("P1", f"{model}, the slowest setting", min(copies)))
        for r in plain:
            auto = "auto: " if r.get("auto") else ""
            out.append(_figure("P2", f"{model}, {auto}{r['resident']} resident, prefetch {r['prefetch']}",
                               _ratio(r["step_s"], r["bound_s"])))
        manual = [r["step_s"] for r in plain if not r.get("auto")]
        for r in (r for r in plain if r.get("auto")):
            out.append(_figure("P2 auto", f"{model}, auto chose {r['resident']} resident, prefetch "
                                          f"{r['prefetch']}, within the largest manual setting's VRAM",
                               _ratio(r["step_s"], min(manual) if manual else None)))
        pins = [r["pinned_over_packed"] for r in mine if r["pinned_over_packed"] is not None]
        if pins:
            out.append(_figure("P3", f"{model}, the largest of {len(pins)} settings", max(pins)))
        for r in plain:
            if model.startswith("wan") and r["resident"] == P11_RESIDENT and not r.get("auto"):
                out.append(_figure("P11", f"{model}, {r['streamed']} of {r['blocks']} blocks streamed, "
                                          f"prefetch {r['prefetch']}", _ratio(r["step_s"], r["resident_step_s"])))
        for r in (r for r in mine if r["lora_rank"]):
            base = next((p for p in plain if (p["resident"], p["prefetch"]) == (r["resident"], r["prefetch"])), None)
            out.append(_figure("P12", f"{model}, rank {r['lora_rank']}, {r['resident']} resident, "
                                      f"prefetch {r['prefetch']}",
                               _ratio(r["step_s"], base["step_s"] if base else None)))
    return out


def comfy_figures(rows: list[dict], dynamic: bool) -> list[dict]:
    """P4 and P5 (classic), or P4d (Dynamic VRAM), from bench/comfy_wan.py's rows."""
    modes: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r.get("bench") == "comfy_wan" and r["row"] == "mode" and r["dynamic"] == dynamic:
            modes.setdefault(r["workload"], {})[r["mode"]] = r
    out = []
    for workload, mine in modes.items():
        if dynamic:
            core = mine.get("core_dynamic", {}).get("step_s")
            for mode in ("auto", "engine"):
                out.append(_figure(f"P4d {mode}", workload, _ratio(mine.get(mode, {}).get("step_s"), core)))
        elif workload in COMFY_FIGURES:
            partial = mine.get("core_partial", {}).get("step_s")
            note = None if partial else "no core partial load measured (on a CPU core has none)"
            out.append(_figure(COMFY_FIGURES[workload], workload,
                               _ratio(mine.get("layerwise", {}).get("step_s"), partial), note))
    return out


def correctness(rows: list[dict]) -> list[dict]:
    """Whether each ComfyUI bench mode's latent is its reference's (core's full load; under
    Dynamic VRAM core's own run, which auto must give and engine may not: see the tests)."""
    out = []
    runs: dict[tuple[bool, str], dict[str, str]] = {}
    for r in rows:
        if r.get("bench") == "comfy_wan" and r["row"] == "mode":
            runs.setdefault((r["dynamic"], r["workload"]), {})[r["mode"]] = r["latent_sha256"]
    for (dynamic, workload), shas in runs.items():
        reference = "core_dynamic" if dynamic else "core_full"
        for mode, sha in shas.items():
            if mode != reference and reference in shas:
                out.append({"workload": workload, "mode": mode, "reference": reference,
                            "equal": sha == shas[reference]})
    return out


# ------------------------------------------------------------------ the summary
def parts(rows: list[dict], plan: str) -> list[dict]:
    done = {r["part"]: r for r in rows if r.get("row") == "part"}
    out = []
    for item in plan.split():
        name, cap = item.split(":")
        part = {k: v for k, v in done.get(name, {}).items() if k not in ("row", "written_at")}
        part.setdefault("part", name)
        part.setdefault("cap_s", int(cap))
        part.setdefault("status", "this summary" if name == "finish" else "not run")
        tests = [r for r in rows if r.get("row") == "test" and r.get("part") == name]
        if tests:
            counts: dict[str, int] = {}
            for t in tests:
                counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
            part["tests"] = counts
            part["failures"] = [t["nodeid"] for t in tests if t["outcome"] in ("failed", "error")]
        out.append(part)
    return out


def summarize(rows: list[dict], mode: str, plan: str, rehearse: bool) -> dict[str, Any]:
    device = next((r for r in rows if r.get("row") == "device"), {})
    figures = engine_figures(rows) + comfy_figures(rows, dynamic=mode == "dynamic")
    found = {f["id"] for f in figures}
    figures += [_figure(fid, "-", None, "not measured") for fid in FIGURES[mode] if fid not in found]
    figures.sort(key=lambda f: list(GOALS).index(f["id"]))
    if rehearse:
        for f in figures:
            f["met"] = None
            f["note"] = "rehearsal on a CPU at smoke sizes: no goal applies"
    properties = [{"nodeid": r["nodeid"], **r["properties"]} for r in rows
                  if r.get("row") == "test" and r.get("properties")]
    return {
        "mode": mode, "rehearsal": rehearse,
        "device": {k: v for k, v in device.items() if k not in ("row", "written_at")},
        "parts": parts(rows, plan),
        "figures": figures,
        "latents": correctness(rows),
        "recorded_by_tests": properties,
    }


def print_table(summary: dict[str, Any]) -> None:
    d = summary["device"]
    print(f"== {summary['mode']}{' (rehearsal)' if summary['rehearsal'] else ''}: {d.get('device')}, "
          f"driver {d.get('driver')}, torch {d.get('torch')}, ComfyUI {d.get('comfyui')}")
    for p in summary["parts"]:
        tests = " ".join(f"{k} {v}" for k, v in sorted(p.get("tests", {}).items()))
        seconds = f"{p['seconds']:.0f}" if "seconds" in p else "-"
        print(f"  {p['part']:<8} {p['status']:<20} {seconds:>4} s of {p['cap_s']:<4} {tests}")
    for f in summary["figures"]:
        value = "-" if f["value"] is None else f"{f['value']:.3f}"
        met = {True: "met", False: "MISSED", None: ""}[f["met"]]
        print(f"  {f['id']:<10} {value:>7} {f['goal']:<7} {met:<6} {f['where']}")
    for latent in summary["latents"]:
        print(f"  latent {latent['workload']} {latent['mode']} == {latent['reference']}: {latent['equal']}")
    for check in ("comes_back", "carried"):
        if check in summary:
            c = summary[check]
            print(f"  {check}: {'ok' if c['ok'] else 'NOT OK'} {'; '.join(c['problems'])}")


def write(args: argparse.Namespace) -> int:
    rows = read_rows(args.rows)
    summary = summarize(rows, args.mode, args.plan, args.rehearse)
    path = args.out / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    if args.rehearse:
        summary["carried"] = gpu_carry.carried(BENCH.parent, args.carry)
    summary["comes_back"] = gpu_carry.comeback(args.out)  # summary.json included
    path.write_text(json.dumps(summary, indent=1))
    print_table(summary)
    ok = summary["comes_back"]["ok"] and summary.get("carried", {"ok": True})["ok"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("device")
    d.add_argument("--rows", type=Path, required=True)
    d.add_argument("--comfy-root", type=Path)
    w = sub.add_parser("write")
    w.add_argument("--rows", type=Path, required=True)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--mode", choices=sorted(FIGURES), required=True)
    w.add_argument("--plan", required=True, help="the mode's plan, part:cap ...")
    w.add_argument("--rehearse", action="store_true")
    w.add_argument("--carry", action="append", default=[], help="a carried path (rehearsal)")
    args = ap.parse_args(argv)
    if args.command == "device":
        row = device_row(args.comfy_root)
        append_row(args.rows, row)
        print(json.dumps(row))
        return 0
    return write(args)


if __name__ == "__main__":
    sys.exit(main())
