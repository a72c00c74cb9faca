"""Run steps of a sequence on a server pair and judge each prompt.

A prompt runs on P and its twin on Q at the same time (each server is deterministic on its own;
running them together only halves the wall time). `POST /free` is followed on both servers by a
tiny barrier prompt: ComfyUI acts on /free's flags between prompts, and once the barrier has run
they have been acted on, so the next prompt always sees the freed state.
"""
from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from comfy_server import ComfyServer

from . import progress
from .servers import ServerPair
from .verdict import STATS_KEYS, judge

BARRIER = {"1": {"class_type": "TieredTestConditioning", "inputs": {"model_kind": "wan21", "seed": 0}},
           "2": {"class_type": "TieredTestConditioningStats", "inputs": {"conditioning": ["1", 0]}}}
LOG_FLAG = re.compile(r"(?i)traceback|exception|error|failed|leak")
LOG_NOISE = re.compile(r"torchaudio|ACE model|MMAudio|Missing VAE keys|no CLIP/text encoder weights"
                       r"|clip missing|lora key not loaded")


def run_prompt(server: ComfyServer, workflow: dict, when: progress.Predicate | None = None,
               timeout: float = 900) -> dict[str, Any]:
    """Queue a workflow (interrupting it where `when` says) and return what happened:
    {"status": success|error|interrupted|rejected|died|timeout, "outputs"|"error"|"detail", "seconds"}."""
    started = time.monotonic()
    record: dict[str, Any] = {}
    try:
        if when is not None:
            prompt_id, record = progress.run_with_interrupt(server, workflow, when, timeout)
            if prompt_id is None:
                return {"status": "rejected", "detail": record.get("rejected")}
        else:
            status, resp = server.request("POST", "/prompt",
                                          {"prompt": workflow, "client_id": str(uuid.uuid4())})
            if status != 200:
                return {"status": "rejected", "detail": resp}
            prompt_id = resp["prompt_id"]
            record["node_errors"] = resp.get("node_errors") or {}
        entry = server.wait(prompt_id, timeout)
    except TimeoutError as e:  # a prompt that never ends is a finding, not a harness crash
        return {"status": "timeout", "detail": str(e)}
    except (RuntimeError, ConnectionError, OSError) as e:
        if not server.alive():
            return {"status": "died", "detail": str(e)[:2000]}
        raise
    outcome: dict[str, Any] = {"seconds": round(time.monotonic() - started, 2)}
    if record.get("node_errors"):  # queued with some outputs refused: ComfyUI runs the rest
        outcome["node_errors"] = record["node_errors"]
    if record.get("requested"):
        outcome["interrupt_at"] = record.get("at")
    messages = entry["status"].get("messages", [])
    kinds = [kind for kind, _ in messages]
    outcome["cached"] = sorted({n for k, d in messages if k == "execution_cached" for n in d.get("nodes", [])})
    if "execution_interrupted" in kinds:
        outcome["status"] = "interrupted"
    elif entry["status"].get("status_str") == "error":
        data = next((d for k, d in messages if k == "execution_error"), {})
        outcome["status"] = "error"
        outcome["error"] = {k: data.get(k) for k in ("node_id", "node_type", "exception_type",
                                                      "exception_message")}
        outcome["error"]["traceback"] = "".join(data.get("traceback") or [])[-3000:]
    else:
        outcome["status"] = "success"
        outcome["outputs"] = {node: {k: v for k, v in o.items() if k in STATS_KEYS}
                              for node, o in entry["outputs"].items()
                              if any(k in o for k in STATS_KEYS)}
    return outcome


def _both(fn_p, fn_q) -> tuple[Any, Any]:
    with ThreadPoolExecutor(2) as pool:
        fp, fq = pool.submit(fn_p), pool.submit(fn_q)
        return fp.result(), fq.result()


def _free(server: ComfyServer) -> dict[str, Any]:
    status, _ = server.request("POST", "/free", {"unload_models": True, "free_memory": True})
    barrier = run_prompt(server, BARRIER)
    return {"status": "success" if status == 200 and barrier["status"] == "success" else "failed",
            "barrier": barrier["status"]}


def _tier_action(server: ComfyServer, action: str, name: str) -> dict[str, Any]:
    status, tiers = server.request("GET", "/offload/tiers")
    if status != 200:
        return {"status": status, "detail": tiers}
    found = [m for m in tiers.get("models", []) if m.get("name") == name]
    if not found:
        return {"status": "skipped", "detail": f"{name} is not managed"}
    status, body = server.request("POST", f"/offload/models/{found[0]['id']}/{action}")
    return {"status": status, "tier": (body or {}).get("model", {}).get("tier")
            if isinstance(body, dict) else None, "detail": None if status == 200 else body}


def _graphs(server: ComfyServer) -> int | None:
    """Graphs dynamo has compiled in the server so far (the test nodes' count), None if unknown."""
    try:
        status, counts = server.request("GET", "/tiered_test/dynamo_counts")
    except (RuntimeError, ConnectionError, OSError):
        return None
    return counts.get("graphs") if status == 200 and isinstance(counts, dict) else None


def _log_flags(lines: list[str]) -> list[str]:
    return [line[:300] for line in lines if LOG_FLAG.search(line) and not LOG_NOISE.search(line)][:30]


def run_step(pair: ServerPair, step: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Run one step on the pair; a prompt step gets a verdict."""
    op = step["op"]
    record: dict[str, Any] = {"op": op, "tags": step.get("tags", [])}
    if op == "free":
        record["p"], record["q"] = _both(lambda: _free(pair.p), lambda: _free(pair.q))
    elif op == "tier_action":
        record["p"] = _tier_action(pair.p, step["action"], step["name"])
    elif op == "tier_budgets":
        status, body = pair.p.request("POST", "/offload/budgets", step["body"])
        record["p"] = {"status": status, "detail": None if status == 200 else body}
    elif op == "prompt":
        when_p = when_q = None
        if step.get("interrupt") == "packing":
            when_p, when_q = progress.packing(step["packing_blocks"]), progress.first_progress
        elif step.get("interrupt") == "sampling":
            when_p = when_q = progress.first_progress
        record["index"] = step.get("index")
        before = _both(lambda: _graphs(pair.p), lambda: _graphs(pair.q))
        record["p"], record["q"] = _both(lambda: run_prompt(pair.p, step["p"], when_p, timeout),
                                         lambda: run_prompt(pair.q, step["q"], when_q, timeout))
        after = _both(lambda: _graphs(pair.p), lambda: _graphs(pair.q))
        if None not in before + after:
            record["graphs"] = {"p": after[0] - before[0], "q": after[1] - before[1]}
        record["verdict"] = judge(step, record["p"], record["q"])
    else:
        raise ValueError(f"unknown step op {op!r}")
    for name, server in (("p", pair.p), ("q", pair.q)):
        flagged = _log_flags(pair.new_log_lines(server))
        if flagged:
            record[f"{name}_log"] = flagged
        if not server.alive() and "verdict" not in record:
            record["verdict"] = {"result": "mismatch", "kind": "server_died",
                                 "signature": f"server_died | {name} after {op}", "detail": op}
    return record
