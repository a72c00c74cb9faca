"""What the engine's per-block hooks cost the sampling thread, on the CPU.

A stack of tiny blocks (one 8x8 linear each) is run with every block streamed through the
LayerwiseStreamer and with the same blocks plain; the difference per block call is the hook path
(enter: slot lookup, wait, bind; exit: free, release, refill the window and copy the next unit in).
The blocks are so small that their compute and copies are noise beside the hook path, which is
what this measures: a change to the engine's hot path shows here first. Median of ``--repeats``
runs of ``--passes`` passes each. ``--root`` picks the checkout to import the engine from, so two
trees can be compared with the same script.

    .venv/bin/python bench/hook_overhead.py [--blocks 64] [--passes 200] [--repeats 7] [--root DIR]
                                            [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn


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


def measure(blocks: int, passes: int, repeats: int, granularity: str = "block") -> dict:
    from offload_core import LayerwiseStreamer

    torch.set_num_threads(1)
    plain, streamed = [], []
    stack = _stack(blocks)
    _pass_seconds(stack, 5)
    for _ in range(repeats):
        plain.append(_pass_seconds(stack, passes))
    engine = LayerwiseStreamer(list(stack), "cpu", resident=0, prefetch=2, pin=False, granularity=granularity)
    engine.attach()
    try:
        _pass_seconds(stack, 5)
        for _ in range(repeats):
            streamed.append(_pass_seconds(stack, passes))
        figures = engine.figures()
    finally:
        engine.close()
    calls = blocks * passes
    plain_us = statistics.median(plain) / calls * 1e6
    streamed_us = statistics.median(streamed) / calls * 1e6
    return {"blocks": blocks, "passes": passes, "repeats": repeats, "granularity": granularity,
            "plain_us_per_block": plain_us, "streamed_us_per_block": streamed_us,
            "hook_overhead_us_per_block": streamed_us - plain_us,
            "sync_fallbacks": figures["sync_fallbacks"], "order_misses": figures["order_misses"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="checkout whose offload_core is measured")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.root.resolve()))
    result = dict(measure(args.blocks, args.passes, args.repeats), torch=torch.__version__,
                  root=str(args.root.resolve()))
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
