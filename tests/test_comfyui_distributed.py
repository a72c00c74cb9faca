"""The pack under ComfyUI-Distributed, as users run it: a master and a local worker on one machine,
both streaming the same model from one shared host store.

The unmodified ComfyUI-Distributed (`make third-party`, copied into the server's base folder so
its config file is the test's own) runs on the master; the worker is configured and launched
through the master's own REST API (`/distributed/config/update_worker`, `/distributed/launch_worker`,
with `extra_args` "--cpu", WORKER_ARGS says why it has one more), so the master's own launch code starts it, with the master's base
folder (the same models, custom nodes and settings file). The stores live where users' do, below
/dev/shm. A workflow with ComfyUI-Distributed's nodes (DistributedSeed gives the worker its own
seed, DistributedCollector brings the worker's images to the master) is queued with
`/distributed/queue`; the images are a latent's bits (TieredTestLatentBits), so the worker's PNG
carries them exactly. With Apply Layerwise Offload and without it, both results must be equal.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

import host_store_soak as soak
from comfy_server import COMFY_ROOT, THIRD_PARTY, ComfyServer, free_port
from workflows import sample_workflow

DISTRIBUTED = THIRD_PARTY / "ComfyUI-Distributed"
WORKER_ID = "1"
# --cpu as the users run it here; ComfyUI's database in memory, or the worker (launched
# without the master's --database-url) would write one into the ComfyUI tree under test.
WORKER_ARGS = "--cpu --database-url sqlite:///:memory:"

pytestmark = [
    pytest.mark.skipif(not DISTRIBUTED.is_dir(), reason="needs ComfyUI-Distributed (make third-party)"),
    pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.exists("/proc/self/smaps"),
                       reason="shared host stores need Linux"),
]


def _get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def _kill_tree(pid: int) -> None:
    """End the worker the test had the master start (its monitor process and what runs under it)."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [*parent.children(recursive=True), parent]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=20)
    for proc in alive:
        proc.kill()


class Worker(ComfyServer):
    """The worker's server, which the master started: read and sent prompts like the test's own."""

    def __init__(self, base: Path, port: int, pid: int) -> None:
        super().__init__(base, port=port)
        self.pid = pid

    def alive(self) -> bool:
        return psutil.pid_exists(self.pid)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    base = root / "base"
    models = root / "models"
    models.mkdir()
    unet = models / "diffusion_models"
    unet.mkdir()
    soak.tiny_models.write_tiny_wan21(unet / "dist_wan.safetensors", layers=4, seed=17)
    base.mkdir()
    (base / "models").symlink_to(models, target_is_directory=True)
    custom = base / "custom_nodes"
    custom.mkdir()
    shutil.copytree(DISTRIBUTED, custom / "ComfyUI-Distributed", ignore=shutil.ignore_patterns(".github", "tests"))
    for path in (custom / "ComfyUI-Distributed").rglob("*"):  # the export is read-only; its config is written
        path.chmod(path.stat().st_mode | 0o200)
    (custom / "ComfyUI-Distributed").chmod(0o755)
    # ComfyUI-Distributed writes its workers' logs below the ComfyUI tree it finds; this one is the
    # test's (its main.py a link to the tree's), so the tree under test stays untouched.
    tree = root / "tree"
    tree.mkdir()
    (tree / "main.py").symlink_to(COMFY_ROOT / "main.py")
    master = ComfyServer(base, env={"COMFYUI_ROOT": str(tree)}).start()
    worker_pid = None
    port = free_port()
    try:
        master.post("/distributed/config/update_worker", {
            "worker_id": WORKER_ID, "name": "Local worker", "host": "127.0.0.1", "port": port,
            "cuda_device": 0, "enabled": True, "extra_args": WORKER_ARGS, "type": "local"})
        launched = master.post("/distributed/launch_worker", {"worker_id": WORKER_ID})
        worker_pid = launched["pid"]
        deadline = time.monotonic() + 300  # an upper bound for a loaded machine, not a timing
        while _get(f"http://127.0.0.1:{port}/prompt") != 200:
            logs = list((tree / "logs" / "workers").glob("*.log"))
            assert time.monotonic() < deadline and psutil.pid_exists(worker_pid), \
                "the worker did not start:\n" + "\n".join(p.read_text()[-4000:] for p in logs)
            time.sleep(0.5)
        yield {"master": master, "worker": Worker(base, port, worker_pid), "tree": tree}
    finally:
        try:
            master.request("POST", "/distributed/stop_worker", {"worker_id": WORKER_ID})
        finally:
            if worker_pid is not None:
                _kill_tree(worker_pid)
            master.stop()


def _workflow(layerwise: bool) -> dict:
    wf = sample_workflow("wan21", layerwise={"resident_blocks": 1, "prefetch": 1} if layerwise else None,
                         seed=21, steps=2)
    wf["load"]["inputs"]["unet_name"] = "dist_wan.safetensors"
    wf["seed"] = {"class_type": "DistributedSeed", "inputs": {"seed": 21}}
    wf["sample"]["inputs"]["seed"] = ["seed", 0]
    del wf["stats"]
    wf["bits"] = {"class_type": "TieredTestLatentBits", "inputs": {"samples": ["sample", 0]}}
    wf["collect"] = {"class_type": "DistributedCollector", "inputs": {"images": ["bits", 0], "load_balance": False}}
    wf["stats"] = {"class_type": "TieredTestImageStats", "inputs": {"images": ["collect", 0]}}
    return wf


def _dispatch(master: ComfyServer, wf: dict) -> list[str]:
    """Queue through ComfyUI-Distributed on the master and the worker; the images' sha256, the
    master's first, the worker's after it."""
    body = {"prompt": wf, "client_id": str(uuid.uuid4()), "enabled_worker_ids": [WORKER_ID],
            "delegate_master": False}
    queued = master.post("/distributed/queue", body)
    assert queued["worker_count"] == 1, queued
    entry = master.wait(queued["prompt_id"], timeout=600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:4000]
    return [image["sha256"] for image in entry["outputs"]["stats"]["image_stats"]]


def _host_store(server_get) -> dict | None:
    cards = server_get("/offload/tiers")["loaded"]
    stores = [c["layerwise"]["host_store"] for c in cards if c.get("layerwise")]
    return stores[0] if stores else None


def test_master_and_local_worker_stream_one_store_with_cores_results(cluster):
    master, worker = cluster["master"], cluster["worker"]
    without = _dispatch(master, _workflow(layerwise=False))
    assert len(without) == 2 and without[0] != without[1]  # the worker ran its own seed
    with_pack = _dispatch(master, _workflow(layerwise=True))
    assert with_pack == without
    stores = [_host_store(master.get), _host_store(worker.get)]
    assert all(s is not None and s["shared"] for s in stores), stores
    assert stores[0]["file"] == stores[1]["file"] and stores[0]["users"] == stores[1]["users"] == 2
    roots = ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}")  # the default roots
    assert stores[0]["folder"] in {os.path.join(os.path.realpath(r), f"tiered-offload-{os.geteuid()}") for r in roots}
    assert sum(s["created_here"] for s in stores) == 1  # one of them packed, the other mapped
    # Once more: both keep the store, the results stay core's.
    assert _dispatch(master, _workflow(layerwise=True)) == without
    path = os.path.join(stores[0]["folder"], stores[0]["file"])
    master.free()
    assert os.path.exists(path)  # the worker still maps it
    worker.free()
    assert not os.path.exists(path)  # the last to let go removed it
