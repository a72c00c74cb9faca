"""Disk streaming when the process or the disk fails: a server killed mid-prompt, a spill file that
cannot be written.

One base folder, two real servers in turn. The first streams two models from disk (an fp32 Wan
read in place from its own file, a bf16 one that the CPU loads as fp32, so its blocks go to a
spill file) and is killed with SIGKILL while the second samples: no handler runs. The model
files must be byte for byte as before and the spill folder empty. The second server, on the same
folder, runs the same workflows and must give core's latents; then its file size limit
(RLIMIT_FSIZE, set from outside with prlimit, the way a full disk or a quota stops a write) makes
the spill file impossible to write: the prompt fails with a message naming the spill folder and
what it needs, and the model is whole for the next prompts, with the node and without.
"""
from __future__ import annotations

import hashlib
import os
import resource
import signal
import time

import pytest
import torch

import tiny_models
from comfy_server import ComfyServer
from workflows import latent_sha, sample_workflow

PAGE = 4096
GIB = 1 << 30
FP32_WAN = "fault_wan6_fp32.safetensors"
BF16_WAN = "fault_wan6_bf16.safetensors"
PHASE = {"resident_blocks": 0, "prefetch": 1, "granularity": "phase"}
pytestmark = pytest.mark.skipif(not (hasattr(resource, "prlimit") and os.path.isdir("/proc/self/fd")),
                                reason="sets a server's file size limit with prlimit and reads /proc (Linux)")
SPILL = "fault_spill"
STEPS_KILLED = 1000  # far more than the kill leaves it  # a folder inside ComfyUI's temp folder


def _workflow(unet: str, layerwise: dict | None = None, steps: int = 2) -> dict:
    wf = sample_workflow("wan21", layerwise=layerwise, steps=steps)
    wf["load"]["inputs"]["unet_name"] = unet
    return wf


def _chain(cast: dict | None, in_place: dict | None, steps: int = 2) -> dict:
    """One prompt, two models: the bf16 Wan samples first (through ``cast`` node inputs, None:
    without the node), the fp32 one continues from its latent for ``steps`` (``in_place``)."""
    wf = _workflow(BF16_WAN, cast)
    second = _workflow(FP32_WAN, in_place, steps=steps)
    for node in ("load", "offload", "sample"):
        if node in second:
            wf[f"{node}2"] = second[node]
    wf["offload2" if in_place is not None else "sample2"]["inputs"]["model"] = ["load2", 0]
    if in_place is not None:
        wf["sample2"]["inputs"]["model"] = ["offload2", 0]
    wf["sample2"]["inputs"]["latent_image"] = ["sample", 0]
    wf["stats"]["inputs"]["samples"] = ["sample2", 0]
    return wf


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _open_files(pid: int) -> list[str]:
    """The files the process has open or mapped (an unlinked one ends in " (deleted)")."""
    with open(f"/proc/{pid}/maps") as maps:
        out = [line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return out


def _engine(server: ComfyServer) -> dict:
    return max((m for m in server.get("/offload/layerwise")["models"] if m["blocks"] == 6),
               key=lambda m: (m["active"], m["finished_at"] or 0))


def _disk(server: ComfyServer, entries: int = 3) -> dict:
    """Node inputs that stream the last engine's model from disk through ``entries`` units."""
    state = _engine(server)
    unit = max(state["units"][i]["bytes"] for i in state["streamed_indices"])
    spill = server.base / "temp" / SPILL
    spill.mkdir(parents=True, exist_ok=True)  # ComfyUI empties its temp folder at start
    return dict(PHASE, host_cache_gb=entries * (-(-unit // PAGE) * PAGE) / GIB, spill_dir=str(spill))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Kill a server with SIGKILL while a disk-streamed prompt samples; yield what it left (the
    models' hashes before, the spill folder, the core latents) and a fresh server on the same
    folder."""
    base = tmp_path_factory.mktemp("disk_faults")
    models = base / "models" / "diffusion_models"
    tiny_models.write_tiny_wan21(models / FP32_WAN, layers=6, seed=71)
    tiny_models.write_tiny_wan21(models / BF16_WAN, layers=6, seed=72, dtype=torch.bfloat16)
    hashes = {name: _sha256(models / name) for name in (FP32_WAN, BF16_WAN)}
    server = ComfyServer(base).start()
    fresh = None
    try:
        core = {name: latent_sha(server.run(_workflow(name))) for name in (FP32_WAN, BF16_WAN)}
        disk = {}
        for name in (BF16_WAN, FP32_WAN):
            assert latent_sha(server.run(_workflow(name, PHASE))) == core[name]
            disk[name] = _disk(server)
        # One prompt: the cast model samples from its spill file, then the fp32 one from its own
        # file, killed while it samples (the cast model's engine still holds its spill file).
        core["chain"] = latent_sha(server.run(_chain(None, None)))
        assert latent_sha(server.run(_chain(disk[BF16_WAN], disk[FP32_WAN]))) == core["chain"]
        server.queue(_chain(disk[BF16_WAN], disk[FP32_WAN], steps=STEPS_KILLED))
        deadline = time.time() + 120
        while time.time() < deadline:
            state = next((m for m in server.get("/offload/layerwise")["models"]
                          if m["active"] and m["disk"].get("model_files")
                          and (m["telemetry"] or {}).get("disk_reads")), None)
            if state is not None:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the disk-streamed prompt never started sampling")
        assert state["disk"]["model_files"] == [str(models / FP32_WAN)], state["disk"]
        held = _open_files(server.proc.pid)
        assert str(models / FP32_WAN) in held, held
        assert any(SPILL in f and f.endswith("(deleted)") for f in held), held
        os.killpg(server.proc.pid, signal.SIGKILL)
        assert server.proc.wait(timeout=60) == -signal.SIGKILL
        left = sorted(p.name for p in (base / "temp" / SPILL).iterdir())
        after = {name: _sha256(models / name) for name in (FP32_WAN, BF16_WAN)}
        server.stop()
        fresh = ComfyServer(base).start()
        yield {"hashes": hashes, "after": after, "left": left, "core": core, "server": fresh}
    finally:
        server.stop()
        if fresh is not None:
            fresh.stop()


def test_a_server_killed_while_streaming_leaves_the_files_whole_and_nothing_behind(killed):
    assert killed["after"] == killed["hashes"]
    assert killed["left"] == [], "a file of the engine's was left in the spill folder"
    server, core = killed["server"], killed["core"]
    # The same workflows, on the next server, give core's latents.
    disk = {}
    for name in (FP32_WAN, BF16_WAN):
        assert latent_sha(server.run(_workflow(name, PHASE))) == core[name]
        disk[name] = _disk(server)
    assert latent_sha(server.run(_chain(disk[BF16_WAN], disk[FP32_WAN]))) == core["chain"]
    assert latent_sha(server.run(_chain(None, None))) == core["chain"]


def test_a_spill_file_that_cannot_be_written_fails_clearly_and_loses_nothing(killed):
    """RLIMIT_FSIZE is what a full disk is to a write, from the inside: the kernel refuses to
    grow a file past it (EFBIG, as ENOSPC for a full disk), so the real write fails part way."""
    server, core = killed["server"], killed["core"]
    reference = core[BF16_WAN]
    assert latent_sha(server.run(_workflow(BF16_WAN, PHASE))) == reference
    disk = _disk(server)
    spill_need = _engine(server)["host"]["packed"]
    limit = 1 << 20
    assert spill_need > 2 * limit, "the spill file would fit under the limit"
    assert server.log_path.stat().st_size < limit // 2  # the server's own log stays below it
    server.free()  # a new engine: its blocks are written to the spill file at placement
    soft, hard = resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
    try:
        error = server.run_expect_error(_workflow(BF16_WAN, disk))
    finally:
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (soft, hard))
    message = error["exception_message"]
    assert "spill file" in message and disk["spill_dir"] in message, message
    assert "File too large" in message and "spill_dir" in message, message
    assert server.alive()
    assert list((server.base / "temp" / SPILL).iterdir()) == []
    # Nothing is lost: core's image without the node, with it from RAM, and from disk again.
    assert latent_sha(server.run(_workflow(BF16_WAN))) == reference
    assert latent_sha(server.run(_workflow(BF16_WAN, dict(disk, host_cache_gb=0)))) == reference
    assert latent_sha(server.run(_workflow(BF16_WAN, disk))) == reference
