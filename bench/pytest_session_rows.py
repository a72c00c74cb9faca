"""A pytest plugin for bench/gpu_session.sh: one JSON row per test outcome, appended as it comes.

Why: a part of a device session is cut off at its time cap, and pytest's own summary is printed
only at the end; the rows say which tests ran and how each ended, whatever happens after. Loaded
with ``-p pytest_session_rows`` (bench/ on PYTHONPATH); it writes to $TIERED_GPU_SESSION_ROWS and
names the session's part from $TIERED_GPU_SESSION_PART_NAME. A test's recorded properties
(``record_property``) travel in its row: tests/test_dynamic_vram_gpu.py records what it measures
there.
"""
from __future__ import annotations

import os

from session_rows import append_row

ROWS = os.environ.get("TIERED_GPU_SESSION_ROWS")
PART = os.environ.get("TIERED_GPU_SESSION_PART_NAME")


def pytest_runtest_logreport(report) -> None:
    # A test's call, and its setup or teardown only where they did not pass (an error, a skip).
    if report.when != "call" and report.passed:
        return
    outcome = report.outcome if report.when == "call" or report.skipped else "error"
    row = {"row": "test", "part": PART, "nodeid": report.nodeid, "when": report.when,
           "outcome": outcome, "seconds": round(report.duration, 3)}
    if report.user_properties:
        row["properties"] = dict(report.user_properties)
    if report.failed:
        row["message"] = str(report.longrepr)[-3000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        row["message"] = report.longrepr[2]
    append_row(ROWS, row)


def pytest_sessionfinish(session, exitstatus) -> None:
    append_row(ROWS, {"row": "pytest", "part": PART, "exitstatus": int(exitstatus),
                      "collected": session.testscollected, "failed": session.testsfailed})
