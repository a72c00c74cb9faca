"""Auto's whole runs against fixed settings: what a user who leaves every setting to ``auto`` gets.

A run here is what a prompt's sampling is: the attach (resident blocks uploaded), ``calls`` calls
of the model, the device synchronized at the end, tuning passes and all. Each row of the matrix is
one kind of run (few or many calls, from RAM or from disk through a small or a large cache, Flux's
heavy and light blocks or Wan's equal ones, inputs that alternate in shape, a LoRA on every block),
run by one engine per setting:
  * ``auto``: resident blocks, prefetch and read-ahead left to the tuner, within the VRAM budget;
  * ``old default``: as many resident blocks as the budget holds, prefetch 2, two disk readers
    (what the node did before its settings were left to auto);
  * fixed settings within the same budget: 0, a quarter and half the blocks resident at prefetch
    1 and 2, and from disk read-ahead 1 and 4 with nothing resident.
The engines take turns in ``--rounds`` rounds, each round starting one setting later, so a machine
whose speed drifts weighs on every setting alike; an engine is kept from round to round, as a
loaded model is from prompt to prompt, so ``auto`` reuses what its earlier runs learned. Each
setting's first run and its later runs are reported apart.

Per row: every setting's whole-run seconds (first run; mean of the later ones), auto against the
old default and against the best fixed setting, and a verdict (faster, equal, slower than the old
default, where "equal" is within the spread of the old default's own later runs, at least 1%).
The summary counts the verdicts and checks the goals: never slower than the old default beyond
that spread on any row; within 3% of the best fixed setting (or that spread, if larger: the best is
the least of several noisy runs) on rows of 8 calls or more. Outputs
are checked bit for bit against every block resident. Prints a table, writes JSON (device, torch,
settings) to bench/results/. ``--smoke`` runs tiny shapes on the CPU in seconds so the script never
rots; no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from disk_stream import drop_file_cache, file_map, load_stack, write_model  # noqa: E402
from layerwise import BenchLora, Spec, Stack, write_result  # noqa: E402

from offload_core import LayerwiseStreamer  # noqa: E402
from offload_core.alignment import PAGE, align_up  # noqa: E402
from offload_core.disk.tier import DiskOptions  # noqa: E402

GOAL_BEST = 1.03  # auto's whole run against the best fixed setting, on rows of 8 calls or more
MIN_NOISE = 0.01


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # "flux" (heavy and light blocks) or "wan" (equal blocks)
    calls: int
    disk: str | None = None  # None: from RAM; "small" or "large": the RAM cache of a disk run
    alternating: bool = False  # calls alternate between two input lengths (a cond and an uncond call)
    lora: bool = False  # a LoRA merged into every block's copy


ROWS = (
    Row("flux, RAM, 4 calls", "flux", 4),
    Row("flux, RAM, 8 calls", "flux", 8),
    Row("flux, RAM, 20 calls", "flux", 20),
    Row("wan, RAM, 8 calls", "wan", 8),
    Row("flux, RAM, 8 calls, alternating shapes", "flux", 8, alternating=True),
    Row("flux, RAM, 8 calls, LoRA", "flux", 8, lora=True),
    Row("wan, disk, 8 calls, small cache", "wan", 8, disk="small"),
    Row("wan, disk, 8 calls, large cache", "wan", 8, disk="large"),
)


def spec_of(model: str, smoke: bool) -> Spec:
    if smoke:
        if model == "wan":
            return Spec("wan-smoke", "wan", dim=64, heads=4, tokens=64, ctx=16, blocks=8, ffn=128)
        return Spec("flux-smoke", "flux", dim=64, heads=4, tokens=48, ctx=16, blocks=3, singles=6)
    if model == "wan":  # Wan 2.1 14B's blocks at 480p, 81 frames, a fifth of its 40 blocks
        return Spec("wan2.1-14b", "wan", dim=5120, heads=40, tokens=32760, ctx=512, blocks=8, ffn=13824)
    return Spec("flux-dev", "flux", dim=3072, heads=24, tokens=4096, ctx=512, blocks=4, singles=8)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Setting:
    name: str
    resident: int | str | None  # None: as many as the budget holds
    prefetch: int | str
    read_ahead: int | str | None = None  # from disk: None, two readers ahead

    @property
    def auto(self) -> bool:
        return self.resident == "auto"


def settings_of(blocks: int, disk: bool) -> list[Setting]:
    out = [Setting("auto", "auto", "auto", "auto" if disk else None), Setting("old default", None, 2)]
    for resident in sorted({0, blocks // 4, blocks // 2}):
        out += [Setting(f"r{resident} p1", resident, 1), Setting(f"r{resident} p2", resident, 2)]
    if disk:
        out += [Setting("r0 p1 ra1", 0, 1, 1), Setting("r0 p1 ra4", 0, 1, 4)]
    return out


def build(row: Row, spec: Spec, device: torch.device, folder: Path) -> tuple[Stack, Path | None]:
    if row.disk is None:
        return Stack(spec, device), None
    path = folder / f"{spec.name}.safetensors"
    if not path.exists():
        write_model(Stack(spec, torch.device("cpu")).blocks, path)
    return load_stack(spec, device, path), path


def inputs_of(row: Row, stack: Stack) -> Callable[[int], torch.Tensor]:
    if not row.alternating:
        return lambda k: stack.x
    short = stack.x[:, : stack.x.shape[1] // 2].contiguous()
    return lambda k: short if k % 2 else stack.x


def bench_row(row: Row, device: torch.device, args, folder: Path) -> dict:
    spec = spec_of(row.model, args.smoke)
    stack, path = build(row, spec, device, folder)
    inputs = inputs_of(row, stack)
    with torch.no_grad():
        reference = [stack.to(device)(inputs(k)).float().cpu() for k in range(2)]  # every block resident
    stack.to("cpu")
    sizes = [sum(t.numel() * t.element_size() for t in b.state_dict().values()) for b in stack.blocks]
    budget = int(sum(sizes) * args.budget)
    cache = None
    if row.disk is not None:
        entry = align_up(max(sizes), PAGE)
        cache = entry * (args.small_cache_units if row.disk == "small" else len(sizes) + 2)
    engines: dict[str, tuple[LayerwiseStreamer, BenchLora | None]] = {}
    refused: dict[str, str] = {}
    for s in settings_of(len(sizes), row.disk is not None):
        disk = None if cache is None else DiskOptions(
            cap_bytes=cache, workers=2, spill_dir=str(folder), model_file=file_map(stack, path),
            read_ahead=s.read_ahead)
        try:
            st = LayerwiseStreamer(list(stack.blocks), device, resident=s.resident, prefetch=s.prefetch,
                                   vram_budget_bytes=budget if s.resident in (None, "auto") else None, disk=disk)
        except ValueError as e:
            refused[s.name] = str(e)
            continue
        if not s.auto and st.bound_bytes() > budget:
            refused[s.name] = f"takes {st.bound_bytes()} bytes of the {budget}-byte budget"
            st.close()
            continue
        engines[s.name] = (st, BenchLora(list(stack.blocks), 8, device) if row.lora else None)
    names = list(engines)
    runs: dict[str, list[float]] = {n: [] for n in names}
    same = {n: True for n in names}
    tunings: dict[str, dict | None] = {}
    try:
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                st, lora = engines[name]
                if path is not None:
                    drop_file_cache(path, False)
                sync(device)
                t0 = time.perf_counter()
                try:
                    st.attach(transform=lora, root=stack if name == "auto" else None)
                except Exception as e:  # a fixed setting the cache cannot serve
                    refused[name] = f"{type(e).__name__}: {e}"
                    continue
                try:
                    with torch.no_grad():
                        outs = [stack(inputs(k)) for k in range(row.calls)]
                    sync(device)
                    runs[name].append(time.perf_counter() - t0)
                    if lora is None:
                        same[name] &= all(torch.equal(o.float().cpu(), reference[k % 2] if row.alternating
                                                      else reference[0]) for k, o in enumerate(outs))
                    tunings[name] = st.tuning()
                finally:
                    st.detach(keep_pack=True)
    finally:
        for st, lora in engines.values():
            st.close()
            if lora is not None:
                lora.close()
    return summarize(row, spec, budget, cache, runs, same, refused, tunings)


def summarize(row: Row, spec: Spec, budget: int, cache: int | None, runs: dict[str, list[float]],
              same: dict[str, bool], refused: dict[str, str], tunings: dict) -> dict:
    settings = {}
    for name, times in runs.items():
        if not times or name in refused:
            continue
        later = times[1:] or times
        settings[name] = {"first_run_s": times[0], "later_run_s": statistics.mean(later), "runs_s": times,
                          "same_output": same[name]}
    out = {"row": asdict(row), "spec": spec.name, "budget_bytes": budget, "cache_bytes": cache,
           "settings": settings, "refused": refused,
           "auto_tuning": tunings.get("auto")}
    if "auto" not in settings or "old default" not in settings:
        return out
    old = settings["old default"]["runs_s"][1:] or settings["old default"]["runs_s"]
    noise = max(MIN_NOISE, max(old) / min(old) - 1)
    fixed = {n: s for n, s in settings.items() if n != "auto"}
    best = min(fixed, key=lambda n: fixed[n]["later_run_s"])
    auto = settings["auto"]
    vs_old = auto["later_run_s"] / settings["old default"]["later_run_s"]
    out.update(
        noise=noise, best_fixed=best,
        auto_vs_old_default=vs_old,
        auto_vs_old_default_first_run=auto["first_run_s"] / settings["old default"]["first_run_s"],
        auto_vs_best_fixed=auto["later_run_s"] / fixed[best]["later_run_s"],
        verdict="faster" if vs_old < 1 - noise else "slower" if vs_old > 1 + noise else "equal",
    )
    # The best fixed setting is the least of several noisy runs: within the spread counts as met too.
    out["goals_met"] = vs_old <= 1 + noise and (row.calls < 8 or out["auto_vs_best_fixed"] <= max(GOAL_BEST, 1 + noise))
    return out


def print_table(result: dict) -> None:
    print(f"\nauto's whole runs on {result['device']} (torch {result['torch']}), {result['rounds']} rounds, "
          f"VRAM budget {result['budget']:.0%} of the blocks")
    head = f"{'row':<42} {'auto s':>8} {'old s':>8} {'best fixed':>14} {'auto/old':>9} {'auto/best':>9} {'1st run':>8}  verdict"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        if "verdict" not in r:
            print(f"{r['row']['name']:<42} (auto or the old default did not run: {r['refused']})")
            continue
        s = r["settings"]
        print(f"{r['row']['name']:<42} {s['auto']['later_run_s']:8.3f} {s['old default']['later_run_s']:8.3f} "
              f"{r['best_fixed']:>14} {r['auto_vs_old_default']:9.3f} {r['auto_vs_best_fixed']:9.3f} "
              f"{r['auto_vs_old_default_first_run']:8.3f}  {r['verdict']} (noise {r['noise']:.1%})"
              f"{'' if r['goals_met'] else '  GOAL MISSED'}")
    c = result["verdicts"]
    print(f"against the old default: {c['faster']} faster, {c['equal']} equal, {c['slower']} slower; "
          f"goals met on {result['goals_met']} of {len(result['rows'])} rows")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    ap.add_argument("--rows", help="comma list of row numbers (from 1) to run; default: all")
    ap.add_argument("--rounds", type=int, help="runs of each setting, the first reported apart (default 4; --smoke 2)")
    ap.add_argument("--budget", type=float, default=0.5, help="VRAM budget, a share of the blocks' bytes")
    ap.add_argument("--small-cache-units", type=int, default=5, help="the small disk cache, in units")
    ap.add_argument("--dir", type=Path, help="folder for the disk rows' model file (default: a temporary one)")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/auto_runs-<device>-<time>.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.rounds = args.rounds or (2 if args.smoke else 4)
    if args.smoke:
        args.budget = max(args.budget, 0.75)  # the tiny Flux's three slots of a double block must fit
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = ROWS if not args.rows else [ROWS[int(k) - 1] for k in args.rows.split(",")]
    result = {"device": name, "device_type": device.type, "torch": torch.__version__, "smoke": args.smoke,
              "rounds": args.rounds, "budget": args.budget,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="auto-runs-") as folder:
        for row in rows:
            result["rows"].append(bench_row(row, device, args, Path(folder)))
    result["verdicts"] = {v: sum(r.get("verdict") == v for r in result["rows"]) for v in ("faster", "equal", "slower")}
    result["goals_met"] = sum(bool(r.get("goals_met")) for r in result["rows"])
    print_table(result)
    write_result(result, "auto_runs", name, args)
    return result


if __name__ == "__main__":
    main()
