"""Disk streaming releases everything it retires: a short soak of each disk mode on a fresh
server (tests/disk_soak.py says what runs), with flat threads, descriptors, spill-file bytes and
RSS after the warm-up, and nothing of the disk tier left once the model is dropped.

The bounds are counts, not times. Threads and descriptors may exceed what the warm-up (every
setting once, one /free) reached by at most 2 (a connection or a file core's loader has open at
that moment), where a leak per engine build adds 2 threads and 2 or more descriptors for each of
the 8 builds after the warm-up. At most one spill file is held (the live engine's). RSS moves with
the settings cycle (the model is loaded again, caches of other sizes), and its peaks wander by
up to 80 MiB from cycle to cycle with what the allocator keeps (measured over 120 prompts: peaks
of 658 to 741 MiB, lows of 615 to 644 MiB, no trend in the lows). So the lowest RSS of the last
cycle of prompts is compared with the lowest of the first cycle after the warm-up: less than
64 MiB apart, where a leak per engine build adds at least its host cache (3 to 4 entries of a
9.5 MB block or a 3 MB phase) 8 times a cycle, everywhere in the cycle, lows included.
"""
from __future__ import annotations

import json
import os

import pytest

import disk_soak
from comfy_server import ComfyServer  # noqa: F401  (the harness marks this module comfy_tree)
from conftest import ARTIFACTS

CYCLE = len(disk_soak.CYCLE) * disk_soak.PROMPTS_PER_SETTING  # 8 prompts: every setting once
PROMPTS = disk_soak.WARMUP + 2 * CYCLE  # 25
MIB = 1 << 20
RSS_SLACK = 64 * MIB
COUNT_SLACK = 2


@pytest.fixture(scope="module")
def soak_models(tmp_path_factory):
    models = tmp_path_factory.mktemp("soak") / "models"
    disk_soak.write_models(models)
    return models


@pytest.mark.one_lane
@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("mode", disk_soak.MODES)
def test_disk_streaming_leaves_nothing_behind_over_many_prompts(tmp_path, soak_models, mode):
    server = disk_soak.start_server(tmp_path, soak_models)
    try:
        result = disk_soak.soak(server, mode, PROMPTS)
    finally:
        server.stop()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / f"disk_soak_{mode}.json").write_text(json.dumps(result, indent=1))
    summary = result["summary"]
    steady = [s for s in result["samples"] if s["event"] == "prompt" and s["prompt"] >= disk_soak.WARMUP]
    figures = json.dumps(summary, indent=1)
    assert summary["threads"]["max"] <= summary["threads"]["warmup_max"] + COUNT_SLACK, figures
    assert summary["fds"]["max"] <= summary["fds"]["warmup_max"] + COUNT_SLACK, figures
    assert all(s["spill_files"] <= 1 for s in steady), figures
    first = min(s["rss"] for s in steady[:CYCLE])
    last = min(s["rss"] for s in steady[-CYCLE:])
    assert last - first < RSS_SLACK, figures
    # The model is dropped (/free; the Tiered loader's evicted first): no engine is left, so no
    # spill file, reader or cache either.
    final = summary["after_end"]
    assert final["spill_files"] == 0 and final["spill_bytes"] == 0, figures
    assert final["threads"] <= min(s["threads"] for s in steady), figures
