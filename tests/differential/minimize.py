"""Run a replay file again, or shrink it to the fewest steps and nodes that still mismatch.

Every trial starts both servers fresh, so a trial's result depends only on its steps. Shrinking
first looks for the shortest tail of the sequence that still mismatches (most after-effects need
one or two earlier prompts), then drops the remaining earlier steps one at a time, then makes the
failing prompt itself smaller (shrink.variants) while the mismatch keeps its kind (and, for a
failure, its error). The result is written beside the input as minimal.json, a replay file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from . import catalogue as catalogue_mod
from .report import describe_replay, step_line
from .runner import run_step
from .shrink import variants
from .servers import ServerPair


def _run(steps: list[dict[str, Any]], work: Path, models_root: Path, threads: int,
         echo: Callable[[str], None]) -> list[dict[str, Any]]:
    pair = ServerPair(work, models_root, threads=threads)
    records = []
    try:
        pair.start()
        for index, step in enumerate(steps):
            record = run_step(pair, step)
            echo(f"  step {index} {step_line(step, record)}")
            records.append(record)
    finally:
        pair.stop()
    return records


def _ensure_fixtures(data: dict[str, Any], models_root: Path) -> None:
    catalogue_mod.build(models_root, big="wan_big" in data.get("catalogue", {}).get("models", []))


def replay(path: Path, work: Path, models_root: Path, *, threads: int = 2,
           echo: Callable[[str], None] = print) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    _ensure_fixtures(data, models_root)
    records = _run(data["steps"], work, models_root, threads, echo)
    last = records[-1].get("verdict") or {}
    return {"mismatch": last.get("result") == "mismatch", "signature": last.get("signature"),
            "expected": (data.get("verdict") or {}).get("signature"),
            "description": describe_replay(data["steps"], records)}


def minimize(path: Path, work: Path, models_root: Path, *, threads: int = 2,
             echo: Callable[[str], None] = print) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    _ensure_fixtures(data, models_root)
    target = data["verdict"]
    steps = data["steps"]
    trials = 0
    found: dict[str, Any] = {}

    def reproduces(candidate: list[dict[str, Any]]) -> bool:
        nonlocal trials
        trials += 1
        echo(f"trial {trials}: {len(candidate)} steps")
        records = _run(candidate, work, models_root, threads, echo)
        verdict = records[-1].get("verdict") or {}
        if verdict.get("kind") != target["kind"] or (
                target["kind"] != "output_differs" and verdict.get("signature") != target["signature"]):
            return False
        found.update(verdict=verdict, description=describe_replay(candidate, records))
        return True

    tail = None
    length = 1
    while length < len(steps):
        if reproduces(steps[-length:]):
            tail = steps[-length:]
            break
        length *= 2
    if tail is None:
        if not reproduces(steps):
            return {"mismatch": False, "trials": trials, "note": "the full replay did not reproduce"}
        tail = steps
    i = 0
    while i < len(tail) - 1:
        candidate = tail[:i] + tail[i + 1:]
        if reproduces(candidate):
            tail = candidate
        else:
            i += 1
    rejected: set[str] = set()  # a reduction that lost the mismatch is not tried again
    changed = True
    while changed:
        changed = False
        for what, smaller in variants(tail[-1]):
            if what in rejected:
                continue
            echo(f"shrink: {what}")
            if reproduces(tail[:-1] + [smaller]):
                tail = tail[:-1] + [smaller]
                changed = True
                break
            rejected.add(what)
    out = Path(path).with_name("minimal.json")
    out.write_text(json.dumps({**data, "verdict": found["verdict"], "steps": tail,
                               "minimized_from": len(steps)}, indent=1))
    return {"mismatch": True, "trials": trials, "steps": len(tail), "minimal": str(out),
            "signature": found["verdict"]["signature"], "description": found["description"]}
