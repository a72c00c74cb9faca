"""Compare what one prompt did on P (with the pack) and on Q (its stripped twin, without).

Both succeeded: every stats output must be equal (shape, dtype, finiteness, sha256). P failed
and Q did not: a mismatch unless it is an allowed, clearly worded documented refusal. Both
failed: the same kind of node with the same exception (a prompt failing alike on both is counted,
not compared). An interrupted prompt is not compared (the
prompts after it are). Every mismatch carries a signature that groups it with its kind.
"""
from __future__ import annotations

import re
from typing import Any

from . import refusals
from .twin import PACK_NODES

STATS_KEYS = ("latent_stats", "conditioning_stats")


def _norm(message: str) -> str:
    message = re.sub(r"0x[0-9a-f]+", "0x…", message or "")
    return re.sub(r"\d+", "N", message).strip()


def _error_key(error: dict[str, Any]) -> tuple:
    """What a failure is: the node's class, the exception and its message. Not the node's id: in a
    prompt of two branches ComfyUI may run them in another order with the pack's nodes in one, so
    the same failure can come first in the other branch's node of the same class."""
    return error.get("node_type"), error.get("exception_type"), _norm(error.get("exception_message", ""))


def pack_nodes(workflow: dict[str, Any]) -> list[str]:
    return sorted({n["class_type"] for n in workflow.values() if n["class_type"] in PACK_NODES})


def _mismatch(kind: str, step: dict[str, Any], detail: Any, key: str) -> dict[str, Any]:
    """A failure is grouped by its error; a differing output by the pack nodes of its prompt
    (there is no error text to tell two causes apart)."""
    if kind == "output_differs":
        key = f"{key} | {'+'.join(pack_nodes(step['p'])) or 'no pack node'}"
    return {"result": "mismatch", "kind": kind, "detail": detail, "signature": f"{kind} | {key}"}


def compare_outputs(p: dict[str, Any], q: dict[str, Any], workflow: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stats output that differs, as {node, class_type, stat, p, q}."""
    diffs = []
    for node in sorted(set(p) | set(q), key=lambda n: int(n) if n.isdigit() else n):
        for key in STATS_KEYS:
            pv, qv = p.get(node, {}).get(key), q.get(node, {}).get(key)
            if pv != qv:
                diffs.append({"node": node, "class_type": workflow.get(node, {}).get("class_type"),
                              "stat": key, "p": pv, "q": qv})
    return diffs


def queue_errors(workflow: dict[str, Any], detail: Any) -> list[dict[str, Any]]:
    """A prompt refused when queued (400), as the errors a node raises when it runs."""
    node_errors = detail.get("node_errors", {}) if isinstance(detail, dict) else {}
    return [{"node_id": node, "node_type": workflow.get(node, {}).get("class_type"),
             "exception_type": "validation", "exception_message": error.get("details", "")}
            for node, entry in node_errors.items() for error in entry.get("errors", [])]


def judge(step: dict[str, Any], p: dict[str, Any], q: dict[str, Any]) -> dict[str, Any]:
    """The verdict on one prompt step, given both outcomes (see runner.run_prompt)."""
    ps, qs = p["status"], q["status"]
    if "died" in (ps, qs) or "timeout" in (ps, qs):
        kind = "server_died" if "died" in (ps, qs) else "timeout"
        return _mismatch(kind, step, {"p": p.get("detail"), "q": q.get("detail")}, f"P {ps}, Q {qs}")
    if ps == "rejected" and qs in ("success", "interrupted"):
        # Refused when queued: the node's validation names the same documented refusals.
        for error in queue_errors(step["p"], p.get("detail")):
            found = refusals.classify(error, step.get("allowed_refusals", []))
            if found is not None and found[0] == "refused":
                return {"result": "refused", "kind": found[1], "when": "queued"}
    if "rejected" in (ps, qs):
        return _mismatch("rejected", step, {"p": p.get("detail"), "q": q.get("detail")},
                         f"P {ps}, Q {qs}")
    partial = None
    if p.get("node_errors"):
        # Queued with some outputs refused (ComfyUI runs the others): each refusal must be a
        # documented one, and the outputs P ran are compared with Q's below.
        found = [refusals.classify(error, step.get("allowed_refusals", []))
                 for error in queue_errors(step["p"], {"node_errors": p["node_errors"]})]
        if not all(f is not None and f[0] == "refused" for f in found):
            return _mismatch("rejected", step, {"p": p["node_errors"]}, "P refused some outputs")
        partial = found[0][1]
    if "interrupted" in (ps, qs) and not (ps == "error" and qs == "interrupted"):
        return {"result": "interrupted"}
    if ps == "error" and qs in ("success", "interrupted"):
        # Q's twin ran until it finished (or was interrupted while sampling): P should have too.
        found = refusals.classify(p["error"], step.get("allowed_refusals", []))
        if found is not None and found[0] == "refused":
            return {"result": "refused", "kind": found[1]}
        error = p["error"]
        kind = "unclear_refusal" if found else "p_failed"
        return _mismatch(kind, step, error, f"{error.get('node_type')}: {error.get('exception_type')}: "
                                            f"{_norm(error.get('exception_message', ''))[:90]}")
    if ps == "success" and qs == "error":
        error = q["error"]
        return _mismatch("q_failed", step, error, f"{error.get('node_type')}: {error.get('exception_type')}")
    if ps == "error" and qs == "error":
        if _error_key(p["error"]) == _error_key(q["error"]):
            return {"result": "match", "both_failed": True}
        return _mismatch("errors_differ", step, {"p": p["error"], "q": q["error"]},
                         f"{p['error'].get('node_type')} vs {q['error'].get('node_type')}")
    stale = sorted(n for n in set(p["outputs"]) | set(q["outputs"])
                   if n in p.get("cached", []) or n in q.get("cached", []))
    if stale:  # the generator's job is that this never happens: a cached output proves nothing
        return _mismatch("cached_output", step, stale, "a compared output came from the cache")
    ran = q["outputs"] if partial is None else {n: o for n, o in q["outputs"].items() if n in p["outputs"]}
    diffs = compare_outputs(p["outputs"], ran, step["p"])
    if diffs:
        stats = "+".join(sorted({d["stat"] for d in diffs}))
        return _mismatch("output_differs", step, diffs, stats)
    return {"result": "match"} if partial is None else {"result": "refused", "kind": partial,
                                                         "when": "queued"}
