"""What the engine's per-block hooks cost the sampling thread, on the CPU.

A stack of tiny blocks (one 8x8 linear each) is run with every block streamed through the
LayerwiseStreamer and with the same blocks plain; the difference per block call is the hook path
(enter: slot lookup, wait, bind; exit: free, release, refill the window and copy the next unit in).
The blocks are so small that their compute and copies are noise beside the hook path, which is
what this measures: a change to the engine's hot path shows here first.

``--against DIR`` loads the engine of another checkout too, under another package name, and runs
both in this process, alternating pass by pass, so that both see the same machine load (on a
shared machine the load moves more between two runs than a hot path changes). Each figure is the
minimum and the median over ``--repeats`` runs of ``--passes`` passes.

    .venv/bin/python bench/hook_overhead.py [--blocks 64] [--passes 100] [--repeats 40]
                                            [--against OTHER_CHECKOUT] [--out FILE.json] [--timeline]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _stack(blocks: int) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))


def _pass_seconds(stack: nn.ModuleList, passes: int) -> float:
    x = torch.randn(1, 8)
    start = time.perf_counter()
    for _ in range(passes):
        y = x
        for block in stack:
            y = block(y)
    return time.perf_counter() - start


def load_engine(checkout: Path, name: str) -> ModuleType:
    """``checkout``'s offload_core as package ``name`` (its relative imports follow the name)."""
    init = checkout / "offload_core" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def measure(engines: dict[str, ModuleType], blocks: int, passes: int, repeats: int,
            timeline: bool = False) -> dict:
    """Per engine: the time per block call streamed, and its excess over the plain blocks.
    ``timeline``: the engines that can record the picture of a pass do (the panel open)."""
    torch.set_num_threads(1)
    plain = _stack(blocks)
    stacks, streamers = {}, {}
    for name, engine in engines.items():
        stacks[name] = _stack(blocks)
        streamers[name] = engine.LayerwiseStreamer(list(stacks[name]), "cpu", resident=0, prefetch=2, pin=False)
        if timeline and hasattr(streamers[name], "record_timeline"):
            streamers[name].record_timeline(True)
        streamers[name].attach()
    try:
        seconds: dict[str, list[float]] = {"plain": [], **{name: [] for name in engines}}
        for stack in (plain, *stacks.values()):
            _pass_seconds(stack, 5)  # warm-up; the streamed ones also wrap their prefetch around
        for _ in range(repeats):
            for name, runs in seconds.items():
                runs.append(_pass_seconds(plain if name == "plain" else stacks[name], passes))
        figures = {name: s.figures() for name, s in streamers.items()}
        recording = {name: getattr(s.telemetry, "timeline", None) is not None for name, s in streamers.items()}
    finally:
        for s in streamers.values():
            s.close()
    calls = blocks * passes

    def per_call(runs: list[float]) -> dict[str, float]:
        return {"min_us": min(runs) / calls * 1e6, "median_us": statistics.median(runs) / calls * 1e6}

    base = per_call(seconds["plain"])
    out = {"blocks": blocks, "passes": passes, "repeats": repeats, "plain": base, "engines": {}}
    for name in engines:
        streamed = per_call(seconds[name])
        out["engines"][name] = {
            "streamed": streamed,
            "hook_overhead_us_per_block": {k: streamed[k] - base[k] for k in base},
            "sync_fallbacks": figures[name]["sync_fallbacks"],
            "order_misses": figures[name]["order_misses"],
            "timeline_recorded": recording[name],
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--against", type=Path, help="another checkout whose engine runs alongside")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--timeline", action="store_true",
                        help="record the picture of each pass where the engine can (as while the panel is open)")
    args = parser.parse_args(argv)
    engines = {"this checkout": load_engine(ROOT, "offload_core_bench_this")}
    if args.against is not None:
        engines[str(args.against.resolve())] = load_engine(args.against.resolve(), "offload_core_bench_other")
    result = dict(measure(engines, args.blocks, args.passes, args.repeats, args.timeline), torch=torch.__version__)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
