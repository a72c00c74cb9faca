"""Text for people: progress lines, mismatch paragraphs with hash pairs, replays, run summaries."""
from __future__ import annotations

import json
from typing import Any

PLUMBING = ("TieredTestConditioning", "TieredTestLatentStats", "TieredTestConditioningStats")


def node_list(workflow: dict[str, Any]) -> str:
    """The graph's nodes in id order, without the test plumbing (conditioning, stats)."""
    return ", ".join(f"{nid}:{n['class_type']}" for nid, n in workflow.items()
                     if n["class_type"] not in PLUMBING)


def step_line(step: dict[str, Any], record: dict[str, Any]) -> str:
    """One progress line: what ran, how long and how it ended on P and Q, and the verdict."""
    verdict = record.get("verdict") or {}
    sides = [record[s] for s in ("p", "q") if isinstance(record.get(s), dict)]
    times = "/".join(str(side.get("seconds", "-")) for side in sides)
    statuses = "/".join(str(side.get("status", "")) for side in sides)
    what = "+".join(step.get("models", [])) or f"{step.get('action', '')} {step.get('name', '')}"
    line = f"{step['op']} {what.strip()} [{times} s {statuses}] {verdict.get('result', '')}"
    if step.get("interrupt"):
        line += f" (interrupt {step['interrupt']} at {record['p'].get('interrupt_at')})"
    graphs = record.get("graphs") or {}
    if any(graphs.values()):
        line += f" (graphs compiled P {graphs['p']} Q {graphs['q']})"
    return f"{line} {verdict.get('signature', '')}".rstrip()


def verdict_lines(verdict: dict[str, Any]) -> list[str]:
    """Hash pairs of a differing output, or the error of a failure."""
    detail = verdict.get("detail")
    if verdict.get("kind") == "output_differs":
        lines = []
        for d in detail:
            pv, qv = (d["p"] or [{}])[0], (d["q"] or [{}])[0]
            lines.append(f"  node {d['node']} {d['class_type']} {d['stat']}: "
                         f"P {str(pv.get('sha256'))[:12]}… Q {str(qv.get('sha256'))[:12]}…")
        return lines
    if isinstance(detail, dict):
        return [f"  {json.dumps({k: v for k, v in detail.items() if k != 'traceback'})[:600]}"]
    return [f"  {detail}"] if detail else []


def describe_mismatch(m: dict[str, Any]) -> str:
    """One paragraph: where, what differs, which nodes, how to replay."""
    verdict = m["verdict"]
    return "\n".join([f"seed {m['seed']} step {m['step']} (prompt {m.get('index')}): {verdict['signature']}",
                      *verdict_lines(verdict), f"  nodes: {m['nodes']}",
                      f"  replay: python -m tests.differential --replay {m['replay']}"])


def describe_replay(steps: list[dict[str, Any]], records: list[dict[str, Any]]) -> str:
    """Every step of a replayed sequence: its nodes in order, and the verdict on the last one."""
    lines = []
    for index, (step, record) in enumerate(zip(steps, records)):
        lines.append(f"step {index}: {step_line(step, record)}")
        if step["op"] == "prompt":
            lines.append(f"  P nodes: {node_list(step['p'])}")
    if records and records[-1].get("verdict"):
        lines += verdict_lines(records[-1]["verdict"])
    return "\n".join(lines)


def summary_text(summary: dict[str, Any]) -> str:
    t = summary["totals"]
    lines = [f"differential campaign on ComfyUI {summary['comfy_version']}: seeds "
             f"{summary['options']['seeds']}, {t.get('prompts', 0)} prompts run "
             f"({t.get('match', 0)} matched, {t.get('both_failed', 0)} of them failing alike, "
             f"{t.get('refused', 0)} refused as documented, {t.get('interrupted', 0)} interrupted), "
             f"{t.get('free', 0)} /free, {t.get('tier_action', 0) + t.get('tier_budgets', 0)} tier REST "
             f"calls; "
             f"{summary['mismatch_count']} mismatches in {len(summary['signatures'])} classes; "
             f"{summary['seconds']} s" + (" (stopped early)" if summary.get("stopped_early") else "")]
    core = summary.get("core_nodes") or {}
    if core.get("model_nodes"):
        through = core["prompts_through"]
        lines.append(f"core's nodes that change a model: {core['model_nodes']} on this server, "
                     f"{core['drawable']} drawable, {len(through)} drawn in "
                     f"{sum(through.values())} prompts: " + ", ".join(f"{n} {c}" for n, c in through.items()))
    if t.get("graphs_p") or t.get("graphs_q"):
        lines.append(f"dynamo graphs compiled: {t.get('graphs_p', 0)} with the pack, "
                     f"{t.get('graphs_q', 0)} without; prompts where they differ: "
                     f"{len(summary.get('graph_differences', []))}")
        for d in summary.get("graph_differences", []):
            lines.append(f"  seed {d['seed']} step {d['step']}: P {d['graphs']['p']} Q "
                         f"{d['graphs']['q']} ({'/'.join(d['status'])}) {d['nodes']}")
    if summary["catalogue"]["excluded"]:
        lines.append(f"excluded (this ComfyUI does not load them): {summary['catalogue']['excluded']}")
    firsts: dict[str, dict[str, Any]] = {}
    for m in summary["mismatches"]:
        firsts.setdefault(m["verdict"]["signature"], m)
    for signature, count in summary["signatures"].items():
        lines.append(f"[{count}x] " + describe_mismatch(firsts[signature]))
    return "\n".join(lines)
