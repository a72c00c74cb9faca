"""JSON rows appended as a benchmark or test run measures, one line each, flushed at once.

Why: a device call is cut off at its time cap, and whatever a run has measured by then must
already be on disk. A JSON document written at the end of a run is lost with the run; a row
appended per measurement is not. bench/gpu_summary.py reads the rows of a session back.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def append_row(path: Path | str | None, row: dict[str, Any]) -> None:
    """Append ``row`` (with the wall-clock time it was written) to ``path``; no path, no row."""
    if path is None:
        return
    line = json.dumps({**row, "written_at": round(time.time(), 3)}, default=str)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()


def read_rows(path: Path | str) -> list[dict[str, Any]]:
    """Every complete row of ``path``; a last line cut off mid-write is skipped."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
