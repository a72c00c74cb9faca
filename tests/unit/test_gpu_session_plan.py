"""bench/gpu_session.sh's plan keeps to the device's time: read from the script itself.

A session with the lent GPU has 15 device-minutes, the machine's start included: `first` must
end within 8 minutes and `dynamic` within 4 (issue 30). Each part's cap is the most it can take,
so the caps of a mode must add up to no more than that. The numbers are the script's own.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = (BENCH / "gpu_session.sh").read_text()
WALL_S = {"first": 8 * 60, "dynamic": 4 * 60}


def plan(mode: str) -> list[tuple[str, int]]:
    (text,) = re.findall(rf'^PLAN_{mode}="([^"]*)"', SCRIPT, re.M)
    return [(name, int(cap)) for name, cap in (item.split(":") for item in text.split())]


def test_each_modes_caps_add_up_to_its_wall_time_at_most():
    assert set(WALL_S) == set(re.findall(r"^PLAN_(\w+)=", SCRIPT, re.M))
    for mode, wall in WALL_S.items():
        caps = [cap for _, cap in plan(mode)]
        assert len(caps) >= 3 and sum(caps) <= wall, (mode, plan(mode))


def test_every_part_has_its_handler_and_time_to_end_after_its_interrupt():
    (grace,) = re.findall(r"^GRACE=(\d+)", SCRIPT, re.M)
    for mode in WALL_S:
        parts = plan(mode)
        assert parts[0][0] == "kit" and parts[-1][0] == "finish", parts
        for name, cap in parts:
            assert re.search(rf"^part_{name}\(\) \{{", SCRIPT, re.M), name
            assert cap > int(grace), (name, cap)


def test_the_comfy_workloads_are_the_ones_the_summary_turns_into_figures():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_summary
    finally:
        sys.path.remove(str(BENCH))
    (body,) = re.findall(r"^part_comfy\(\) \{\n(.*?)^\}", SCRIPT, re.M | re.S)
    lists = re.findall(r"--workloads ([\w=,.-]+)", body)
    assert len(lists) == 2, body  # the device's sizes and the rehearsal's
    for workloads in lists:
        names = [item.split("=")[0] for item in workloads.split(",")]
        assert sorted(gpu_summary.COMFY_FIGURES[name] for name in names) == ["P4", "P5"], names


def test_every_test_the_script_names_exists():
    """A renamed test would leave a part with nothing to run ("not found", rc 4) on the device."""
    repo = BENCH.parent
    named = re.findall(r"\b(tests/[\w/]+\.py)(?:::(\w+))?", SCRIPT)
    assert named
    for path, test in named:
        source = repo / path
        assert source.is_file(), path
        if test:
            assert re.search(rf"^(?:async )?def {test}\(", source.read_text(), re.M), f"{path}::{test}"
