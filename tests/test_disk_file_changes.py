"""A model file that changes under a disk-streaming server: never a dead server, never a mixed or
stale image, only the images core gives for the same file state, or a clear error naming the file.

Two real servers run side by side: one with the pack, one without it, each on its own copy of the
model files. Every file operation is done to both copies, every prompt is queued on both (the
second without Apply Layerwise Offload). The operations: truncate to half, overwrite in place with
another model of the same size (what `cp other model` does), replace by rename, delete; done
between prompts (after a disk-streamed run) and while one streams from disk (so in the middle of a
pass); then a prompt without the node and one with it, in both orders; then `/free`, so both
servers load the file again as it is now.

The model file is fp32, so the pack streams its blocks from the file itself. A truncation or an
overwrite in place takes the loaded model's bytes away: every prompt that uses that model after
the change (and the one streaming while it happens) fails, with a message that names the file and
says to load the model again, where core, which holds a copy in RAM, still gives the old model's
image. A rename over the name or a delete leaves the open file with exactly those bytes: the pack
reads on from it and gives core's images, and lets go of it at `/free` (no descriptor of the old
file is left, so its disk space comes back). After `/free` both load the file as it is now, and
agree again.

A second test holds the Tiered loader to its promise that an old id never loads new bytes, also
when an overwrite puts the file's modification time back.
"""
from __future__ import annotations

import os
import shutil
import time

import pytest

import tiny_models
from comfy_server import ComfyServer
from test_disk_faults import _open_files
from workflows import sample_workflow

PAGE = 4096
GIB = 1 << 30
OPS = ("truncate", "overwrite", "replace", "delete")
READ_ON = ("replace", "delete")  # the open file keeps the loaded bytes
LAYERS = 6
PHASES = {"resident_blocks": 0, "prefetch": 1, "granularity": "phase"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(with the pack, without it), each with its own base folder and model files."""
    root = tmp_path_factory.mktemp("file_changes")
    pair = []
    try:
        for name, with_pack in (("pack", True), ("core", False)):
            pair.append(ComfyServer(root / name, with_pack=with_pack).start())
        yield tuple(pair)
    finally:
        for server in pair:
            server.stop()


def _model_path(server: ComfyServer, name: str):
    return server.base / "models" / "diffusion_models" / name


def _write(servers, name: str, seed: int) -> None:
    for server in servers:
        tiny_models.write_tiny_wan21(_model_path(server, name), layers=LAYERS, seed=seed)


def _change(servers, op: str, name: str, other_seed: int) -> None:
    """Do ``op`` to the model file of both servers."""
    for server in servers:
        path = _model_path(server, name)
        if op == "truncate":
            os.truncate(path, path.stat().st_size // 2)
        elif op == "overwrite":  # cp other model: the same inode, truncated and written again
            other = path.with_suffix(".other")
            tiny_models.write_tiny_wan21(other, layers=LAYERS, seed=other_seed)
            assert other.stat().st_size == path.stat().st_size
            shutil.copyfile(other, path)
            other.unlink()
        elif op == "replace":  # a new file renamed over the old name: a new inode
            new = path.with_name(path.name + ".part")
            tiny_models.write_tiny_wan21(new, layers=LAYERS, seed=other_seed)
            os.replace(new, path)
        elif op == "delete":
            path.unlink()


def _workflow(name: str, layerwise: dict | None, seed: int, steps: int = 2) -> dict:
    wf = sample_workflow("wan21", layerwise=layerwise, seed=seed, steps=steps)
    wf["load"]["inputs"]["unet_name"] = name
    return wf


def _strip(wf: dict) -> dict:
    """The same workflow without Apply Layerwise Offload (for the server without the pack)."""
    out = {k: dict(v, inputs=dict(v["inputs"])) for k, v in wf.items() if k != "offload"}
    out["sample"]["inputs"]["model"] = ["load", 0]
    return out


def _outcome(server: ComfyServer, wf: dict, prompt_id: str | None = None) -> tuple:
    """("latent", sha256), ("refused", node error types) at queueing, or ("error", exception
    type, message) at execution; the server must still be up afterwards."""
    if prompt_id is None:
        status, body = server.request("POST", "/prompt", {"prompt": wf, "client_id": "file-changes"})
        if status != 200:
            errors = sorted({e["type"] for node in body.get("node_errors", {}).values() for e in node["errors"]})
            assert server.alive()
            return ("refused", tuple(errors) or body.get("error", {}).get("type"))
        prompt_id = body["prompt_id"]
    entry = server.wait(prompt_id)
    assert server.alive(), server.log_tail()
    if entry["status"]["status_str"] == "success":
        return ("latent", entry["outputs"]["stats"]["latent_stats"][0]["sha256"])
    error = next(data for kind, data in entry["status"]["messages"] if kind == "execution_error")
    return ("error", error["exception_type"], error["exception_message"])


def _same(pack_outcome: tuple, core_outcome: tuple, pack: ComfyServer, core: ComfyServer) -> None:
    if pack_outcome[0] == "error":  # messages may name each server's own copy of the file
        pack_outcome = pack_outcome[:2] + (pack_outcome[2].replace(str(pack.base), "<base>"),)
        core_outcome = core_outcome[:2] + (core_outcome[2].replace(str(core.base), "<base>"),)
    assert pack_outcome == core_outcome


def _names_the_file(outcome: tuple, name: str) -> bool:
    """The prompt failed, saying which file changed and what to do."""
    return outcome[0] == "error" and name in outcome[2] and "Load the model again" in outcome[2]


def _held_old_file(server: ComfyServer, name: str) -> list[str]:
    """The pack server's descriptors and maps of an unlinked file by ``name`` (an old version it read)."""
    return [t for t in _open_files(server.proc.pid) if t.endswith(f"{name} (deleted)")]


def _wait_let_go(server: ComfyServer, name: str) -> None:
    """The old file is let go once the freed model is collected: ComfyUI's worker collects
    garbage after a free at most every 10 s, so prompts pass through it until then (60 s at most)."""
    deadline = time.time() + 60
    while _held_old_file(server, name):
        assert time.time() < deadline, f"the old file is still open after /free: {_held_old_file(server, name)}"
        server.free()
        time.sleep(1)


def _engine(pack: ComfyServer) -> dict:
    """The engine of the last sampling run (every case has a model of its own)."""
    return max((m for m in pack.get("/offload/layerwise")["models"] if m["blocks"] == LAYERS),
               key=lambda m: m["finished_at"] or 0)


def _host_cache_gb(pack: ComfyServer) -> float:
    engine = _engine(pack)
    unit = max(engine["units"][i]["bytes"] for i in engine["streamed_indices"])
    return 3 * (-(-unit // PAGE) * PAGE) / GIB


def _wait_streaming(pack: ComfyServer) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if any(m["active"] and (m["telemetry"] or {}).get("disk_reads")
               for m in pack.get("/offload/layerwise")["models"] if m["blocks"] == LAYERS):
            return
        time.sleep(0.02)
    pytest.fail("the disk-streamed prompt never started sampling")


# Every case on the 0.3.75 lane; on the 0.33 lane each change once between prompts (then core
# alone runs first) and once while streaming (then the node runs first): the file checks are the
# pack's, what meets core is the next prompt of each kind.
CASES = [pytest.param(op, when, next_first, id=f"{op}-{when}-{next_first}",
                      marks=() if (when == "while streaming") == (next_first == "node") else pytest.mark.one_lane)
         for op in OPS for when in ("between prompts", "while streaming") for next_first in ("plain", "node")]


@pytest.mark.parametrize("op, when, next_first", CASES)
def test_a_changed_model_file_gives_cores_images_or_a_clear_error(servers, op, when, next_first):
    pack, core = servers
    case = OPS.index(op) * 4 + (when == "while streaming") * 2 + (next_first == "node")
    name = f"changing_wan_{case}.safetensors"
    _write(servers, name, seed=100 + case)
    # The engine is built and its blocks are placed on disk: the handed-back weights are what a
    # later plain prompt runs on.
    _same(_outcome(pack, _workflow(name, PHASES, seed=1)), _outcome(core, _workflow(name, None, seed=1)),
          pack, core)
    disk = dict(PHASES, host_cache_gb=_host_cache_gb(pack))
    first = _workflow(name, disk, seed=2)
    reference = _outcome(core, _strip(first))
    assert reference[0] == "latent"
    _same(_outcome(pack, first), reference, pack, core)
    state = _engine(pack)
    assert state["disk"]["active"] and state["disk"]["spill_bytes"] == 0, state["disk"]
    assert state["disk"]["model_files"] and state["disk"]["model_files"][0].endswith(name), state["disk"]
    if when == "while streaming":
        # Long enough for the change to land while it streams (it lands in milliseconds after the
        # first read; a step takes a tenth of a second or more), short enough that core's twin,
        # which runs every step, does not hold the lane up.
        slow = _workflow(name, disk, seed=3, steps=24)
        queued = pack.queue(slow), core.queue(_strip(slow))  # both queued before the change
        _wait_streaming(pack)
        _change(servers, op, name, other_seed=200 + case)
        got = _outcome(pack, slow, queued[0])
        reference = _outcome(core, _strip(slow), queued[1])
        assert reference[0] == "latent"
        if op in READ_ON:  # the run reads on from the open file: core's image
            _same(got, reference, pack, core)
        else:
            # The run was streaming when the file changed (a run that had ended would have its
            # latent): the pass after the change fails.
            assert _names_the_file(got, name), got
    else:
        _change(servers, op, name, other_seed=200 + case)
    # The loaded model's blocks are in the changed file: with the node or without, it fails
    # clearly, or (renamed over) gives core's image from the open file.
    order = [None, disk] if next_first == "plain" else [disk, None]
    for seed, layerwise in enumerate(order, start=4):
        wf = _workflow(name, layerwise, seed=seed)
        got, reference = _outcome(pack, wf), _outcome(core, _strip(wf))
        if reference[0] == "refused" or op in READ_ON:  # a deleted file: both refuse it when queued
            _same(got, reference, pack, core)
        else:
            assert reference[0] == "latent", reference
            assert _names_the_file(got, name), got
    # Both servers load the file again as it is now; the pack holds nothing of the old one.
    pack.free()
    core.free()
    if op == "delete" and when == "between prompts" and next_first == "plain":
        _wait_let_go(pack, name)
    for seed, layerwise in enumerate(order, start=6):
        wf = _workflow(name, layerwise, seed=seed)
        got = _outcome(pack, wf)
        _same(got, _outcome(core, _strip(wf)), pack, core)
        if op == "truncate":  # core's own loader refuses the shrunk file (with core's message)
            assert got[0] == "error", got
        elif op == "delete":
            assert got[0] == "refused", got
        else:
            assert got[0] == "latent", got


def test_tiered_loader_never_loads_new_bytes_under_an_old_id(tmp_path):
    """An overwrite in place that puts the modification time back is still a new version: the old
    id refuses to load (409, and is forgotten), and the loader registers the file under a new id,
    whose model is core's for the new bytes. A truncated file is an error that names it."""
    server = ComfyServer(tmp_path / "base").start()
    try:
        name = "tiered_overwritten.safetensors"
        path = _model_path(server, name)
        tiny_models.write_tiny_wan21(path, layers=LAYERS, seed=301)
        other = path.with_suffix(".other")
        tiny_models.write_tiny_wan21(other, layers=LAYERS, seed=302)
        tiered = _workflow(name, None, seed=1)
        tiered["load"]["class_type"] = "TieredUNETLoader"
        old = server.run(tiered)["stats"]["latent_stats"][0]["sha256"]
        key = next(m["id"] for m in server.get("/offload/tiers")["models"] if m["name"] == name)
        status, body = server.request("POST", f"/offload/models/{key}/evict")
        assert status == 200, body
        stamp = path.stat()
        shutil.copyfile(other, path)
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        assert path.stat().st_mtime_ns == stamp.st_mtime_ns and path.stat().st_size == stamp.st_size
        status, body = server.request("POST", f"/offload/models/{key}/load")
        assert status == 409 and "changed on disk" in body["error"], (status, body)
        assert key not in {m["id"] for m in server.get("/offload/tiers")["models"]}
        new = server.run(tiered)["stats"]["latent_stats"][0]["sha256"]
        server.free()
        assert new != old
        assert new == server.run(_workflow(name, None, seed=1))["stats"]["latent_stats"][0]["sha256"]
        os.truncate(path, path.stat().st_size // 2)
        error = server.run_expect_error(tiered)
        assert name in error["exception_message"] and "cannot be read" in error["exception_message"], error
        assert server.alive()
    finally:
        server.stop()
