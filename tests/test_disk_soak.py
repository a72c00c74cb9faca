"""Disk streaming releases everything it retires: a short soak of each disk mode on a fresh
server (tests/disk_soak.py says what runs), with flat threads, descriptors, spill-file bytes and
RSS after the warm-up, and nothing of the disk tier left once the model is dropped.

The bounds are counts, not times: threads and descriptors may not exceed what the warm-up (every
setting once, one /free) reached; at most one spill file is held (the live engine's); RSS grows
less than 64 MiB from the first prompts after the warm-up to the last ones, where one leaked
engine costs at least its host cache (3 to 4 entries of a 9.5 MB block or a 3 MB phase) and a
leak per rebuild would add that some ten times.
"""
from __future__ import annotations

import json
import os
import statistics

import pytest

import disk_soak
from comfy_server import ComfyServer  # noqa: F401  (the harness marks this module comfy_tree)
from conftest import ARTIFACTS

PROMPTS = disk_soak.WARMUP + 2 * len(disk_soak.CYCLE) * disk_soak.PROMPTS_PER_SETTING  # 25
MIB = 1 << 20
RSS_SLACK = 64 * MIB


@pytest.fixture(scope="module")
def soak_models(tmp_path_factory):
    models = tmp_path_factory.mktemp("soak") / "models"
    disk_soak.write_models(models)
    return models


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
    assert summary["threads"]["max"] <= summary["threads"]["warmup_max"], figures
    assert summary["fds"]["max"] <= summary["fds"]["warmup_max"], figures
    assert all(s["spill_files"] <= 1 for s in steady), figures
    first = statistics.median(s["rss"] for s in steady[:5])
    last = statistics.median(s["rss"] for s in steady[-5:])
    assert last - first < RSS_SLACK, figures
    # The model is dropped (/free; the Tiered loader's evicted first): no engine is left, so no
    # spill file, reader or cache either.
    final = summary["after_end"]
    assert final["spill_files"] == 0 and final["spill_bytes"] == 0, figures
    assert final["threads"] <= min(s["threads"] for s in steady), figures
