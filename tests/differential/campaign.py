"""A differential campaign: seeds × prompts on one server pair, with replay files and a summary.

Each seed is its own sequence on freshly started servers. After a mismatch both servers are
restarted, so a later mismatch is not an after-effect of an earlier one and every replay file
holds only the steps since the last fresh start: the seed, the step index and both workflows of
each prompt, enough to run them again with `python -m tests.differential --replay FILE`.
"""
from __future__ import annotations

import collections
import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from comfy_server import COMFY_PYTHON, COMFY_ROOT

from . import catalogue as catalogue_mod
from . import core_nodes, probe
from .generator import CORE_NODE_SHARE, HOOK_SHARE, generate
from .report import node_list, step_line
from .runner import run_step
from .servers import ServerPair


@dataclass
class Options:
    seeds: list[int]
    prompts: int
    workdir: Path
    out_dir: Path
    models_root: Path
    big: bool = True
    interrupts: bool = True
    rest_actions: bool = True
    compile_share: float = 0.0  # chains that get a torch.compile (see generator.py)
    hook_share: float = HOOK_SHARE  # prompts with a hook LoRA on the positive (see generator.py)
    core_node_share: float = CORE_NODE_SHARE  # chains with one of core's MODEL → MODEL nodes
    threads: int = 2
    timeout: float = 900.0
    echo: Callable[[str], None] = field(default=lambda line: None, repr=False)


def comfy_version() -> str:
    try:
        text = (COMFY_ROOT / "comfyui_version.py").read_text()
        return text.split('"')[1]
    except (OSError, IndexError):
        return "unknown"


def write_replay(out_dir: Path, seed: int, index: int, steps: list[dict[str, Any]],
                 record: dict[str, Any], cat: catalogue_mod.Catalogue, pair: ServerPair) -> Path:
    folder = out_dir / f"seed{seed}-step{index}"
    folder.mkdir(parents=True, exist_ok=True)
    last = steps[-1]
    (folder / "replay.json").write_text(json.dumps({
        "seed": seed, "step": index, "comfy_version": comfy_version(),
        "catalogue": cat.describe(), "verdict": record.get("verdict"), "steps": steps}, indent=1))
    if last["op"] == "prompt":
        (folder / "p_workflow.json").write_text(json.dumps(last["p"], indent=1))
        (folder / "q_workflow.json").write_text(json.dumps(last["q"], indent=1))
    (folder / "outcome.json").write_text(json.dumps(record, indent=1))
    for name, server in (("p", pair.p), ("q", pair.q)):
        (folder / f"{name}_log_tail.txt").write_text(server.log_tail(200))
    return folder / "replay.json"


def run_sequence(pair: ServerPair, seed: int, steps: list[dict[str, Any]], opts: Options,
                 cat: catalogue_mod.Catalogue, totals: collections.Counter,
                 coverage: collections.Counter, log_flags: collections.Counter,
                 mismatches: list[dict[str, Any]], graph_differences: list[dict[str, Any]]) -> None:
    """Run one seed's steps; count into the counters and append mismatches as they happen, and
    the prompts for which dynamo compiled another number of graphs with the pack than without."""
    since_fresh: list[dict[str, Any]] = []
    for index, step in enumerate(steps):
        record = run_step(pair, step, opts.timeout)
        since_fresh.append(step)
        for flag in record.get("p_log", []):
            log_flags[flag[:160]] += 1
        verdict = record.get("verdict")
        coverage.update(step["tags"])
        if step["op"] == "prompt":
            totals["prompts"] += 1
            at = record["p"].get("interrupt_at") or {}
            if step.get("interrupt") == "packing" and record["p"]["status"] == "interrupted" \
                    and at.get("max") in (step["packing_blocks"], step["packing_blocks"] + 1):
                coverage["interrupted_while_packing"] += 1
            totals[verdict["result"]] += 1
            graphs = record.get("graphs")
            if graphs:
                totals["graphs_p"] += graphs["p"]
                totals["graphs_q"] += graphs["q"]
                if graphs["p"] != graphs["q"]:
                    graph_differences.append({"seed": seed, "step": index, "graphs": graphs,
                                              "status": [record["p"]["status"], record["q"]["status"]],
                                              "nodes": node_list(step["p"])})
            if verdict.get("both_failed"):
                totals["both_failed"] += 1
        else:
            totals[step["op"]] += 1
        opts.echo(f"seed {seed} step {index} {step_line(step, record)}")
        if verdict and verdict["result"] == "mismatch":
            replay = write_replay(opts.out_dir, seed, index, since_fresh, record, cat, pair)
            mismatches.append({"seed": seed, "step": index, "index": step.get("index"),
                               "verdict": verdict, "replay": str(replay),
                               "nodes": node_list(step["p"]) if step["op"] == "prompt" else step["op"],
                               "outcomes": {"p": record.get("p"), "q": record.get("q")}})
            pair.restart()
            since_fresh = []


def run(opts: Options) -> dict[str, Any]:
    """Run the campaign; write `summary.json` into opts.out_dir and return the summary."""
    started = time.monotonic()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*opts.out_dir.glob("seed*-step*"), opts.out_dir / "summary.json"]:
        # a run reusing a name must not leave an earlier run's replays beside its own
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
    cat = catalogue_mod.build(opts.models_root, big=opts.big)
    pair = ServerPair(opts.workdir, opts.models_root, threads=opts.threads)
    totals: collections.Counter = collections.Counter()
    coverage: collections.Counter = collections.Counter()
    log_flags: collections.Counter = collections.Counter()
    mismatches: list[dict[str, Any]] = []
    graph_differences: list[dict[str, Any]] = []
    excluded: dict[str, str] = {}
    core = core_nodes.CoreNodes([], {})
    stopped_early = False
    try:
        probing = probe.start(cat)
        pair.start()
        excluded = probe.finish(probing, cat)
        # What core has on this server (the one without the pack: only core's and the test nodes).
        core = core_nodes.from_object_info(pair.q.get("/object_info"))
        for n, seed in enumerate(opts.seeds):
            if n:
                pair.restart()
            steps = generate(seed, opts.prompts, cat, interrupts=opts.interrupts,
                             rest_actions=opts.rest_actions, compile_share=opts.compile_share,
                             hook_share=opts.hook_share, core=core, core_node_share=opts.core_node_share)
            run_sequence(pair, seed, steps, opts, cat, totals, coverage, log_flags, mismatches,
                         graph_differences)
    except KeyboardInterrupt:  # Ctrl-C ends a long campaign early, with its summary so far
        stopped_early = True
    finally:
        pair.stop()
    signatures = collections.Counter(m["verdict"]["signature"] for m in mismatches)
    summary = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()
                    if k != "echo"},
        "comfy_version": comfy_version(), "comfy_root": str(COMFY_ROOT), "comfy_python": COMFY_PYTHON,
        "omp_threads": opts.threads, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "catalogue": cat.describe(), "excluded_reasons": excluded,
        "seconds": round(time.monotonic() - started, 1), "stopped_early": stopped_early,
        "totals": dict(totals), "mismatch_count": len(mismatches),
        "graph_differences": graph_differences,
        "signatures": dict(signatures.most_common()),
        "mismatches": mismatches, "coverage": dict(sorted(coverage.items())),
        "core_nodes": {**core.describe(), "prompts_through": {
            tag.split(":", 1)[1]: count for tag, count in sorted(coverage.items())
            if tag.startswith("core_node:") and tag.split(":", 1)[1] not in ("before_offload", "after_offload")}},
        "p_log_flags": dict(log_flags.most_common(40)),
    }
    (opts.out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
