"""Command line of the differential test.

    .venv/bin/python -m tests.differential --seed 7 --prompts 500
    .venv/bin/python -m tests.differential --seeds 1 2 3 --prompts 200 --no-big
    .venv/bin/python -m tests.differential --replay tests/artifacts/differential/<run>/seed7-step41/replay.json
    .venv/bin/python -m tests.differential --minimize .../replay.json

Runs from the repository root. The ComfyUI tree is the one tests/comfy_server.py uses
(`TIERED_OFFLOAD_COMFY_ROOT`, `TIERED_OFFLOAD_COMFY_PYTHON`). Everything is written under
tests/artifacts/differential/: the fixture models (reused between runs), the servers' base
folders, and per run a summary.json plus one replay folder per mismatch. Exit status 1 when
there was a mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import ARTIFACTS, campaign, minimize, report
from .generator import CORE_NODE_SHARE, HOOK_SHARE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.differential", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, help="one seed (same as --seeds N)")
    ap.add_argument("--seeds", type=int, nargs="*", default=[], help="several seeds, each on fresh servers")
    ap.add_argument("--prompts", type=int, default=100, help="prompts per seed")
    ap.add_argument("--no-big", action="store_true",
                    help="leave out the 1.1 GB Wan (and so the interrupts during packing)")
    ap.add_argument("--no-interrupts", action="store_true")
    ap.add_argument("--compile-share", type=float, default=0.15,
                    help="share of chains that get a torch.compile, whole model or per block (0: none)")
    ap.add_argument("--hook-share", type=float, default=HOOK_SHARE,
                    help="share of prompts with a hook LoRA on the positive (0: none)")
    ap.add_argument("--core-node-share", type=float, default=CORE_NODE_SHARE,
                    help="share of chains with one of core's MODEL -> MODEL nodes, from /object_info (0: none)")
    ap.add_argument("--name", help="run folder under tests/artifacts/differential/ (default: a timestamp and the process id)")
    ap.add_argument("--replay", type=Path, help="run the steps of a replay.json on fresh servers")
    ap.add_argument("--minimize", type=Path, help="shrink a replay.json to the fewest steps that still mismatch")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both servers")
    a = ap.parse_args(argv)
    models_root = ARTIFACTS / "models"
    # The process id too: two campaigns started in the same second (one per ComfyUI tree) must not
    # share a folder.
    name = a.name or time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    if a.replay or a.minimize:
        source = a.replay or a.minimize
        work = ARTIFACTS / "work" / name
        if a.replay:
            result = minimize.replay(source, work, models_root, threads=a.threads, echo=print)
        else:
            result = minimize.minimize(source, work, models_root, threads=a.threads, echo=print)
        print(result.pop("description", ""))
        print(json.dumps(result, indent=1))
        return 1 if result.get("mismatch") else 0
    seeds = ([a.seed] if a.seed is not None else []) + a.seeds
    if not seeds:
        ap.error("give --seed N or --seeds N ...")
    opts = campaign.Options(seeds=seeds, prompts=a.prompts, workdir=ARTIFACTS / "work" / name,
                            out_dir=ARTIFACTS / name, models_root=models_root, big=not a.no_big,
                            interrupts=not a.no_interrupts, compile_share=a.compile_share,
                            hook_share=a.hook_share, core_node_share=a.core_node_share,
                            threads=a.threads, echo=print)
    summary = campaign.run(opts)
    print(report.summary_text(summary))
    print(f"summary: {opts.out_dir / 'summary.json'}")
    return 1 if summary["mismatch_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
