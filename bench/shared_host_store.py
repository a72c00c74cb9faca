"""RAM of N ComfyUI workers streaming one model, with and without the shared host store.

N servers (N = 1, 2, 3; each a whole ComfyUI process with the pack, as ComfyUI-Distributed's local
workers are) load one Wan file from one models folder and stream it with Apply Layerwise Offload,
one after the other. Once all have run, the script reads each server's proportional set size
(PSS: shared pages divided among the processes that map them, so the sum over the servers is what
the machine holds for them) and its growth since the server started, and the PSS of the store's
mappings. It does that twice, on fresh servers each time: with the node's `share_host_memory`
off (each packs its own copy) and on (each maps the one store).

Per worker, the second especially (the first packs in both runs):
  attach_s       the engine's attach: packing the blocks (off), or mapping the store (on)
  first_step_s   from the prompt's start to the sampler's first step (websocket progress)
The first worker's prompt loads the model file cold or warm alike in both runs (page cache warm:
every run reads the same file first).

--smoke runs a small model with N = 2 only. The test suite measures the same way (``measure``) on
servers it already runs (tests/test_shared_host_store.py). The JSON goes to
bench/results/shared_host_store-<device>-<time>.json unless --out says otherwise; the table and
the JSON hold the bounds checked: with sharing, each worker after the first adds less than half
the blocks' bytes to the machine's total, and the store's PSS over all workers is one copy.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "fixtures"), str(BENCH)]
import host_store_soak as soak  # noqa: E402
import tiny_models  # noqa: E402
from comfy_server import ComfyServer  # noqa: E402
from layerwise import write_result  # noqa: E402

MIB = 2**20
GIB = 2**30
STEPS = 3
MODEL = "bench_shared_wan.safetensors"
SIZES = {"smoke": {"layers": 4, "dim": 256, "ffn_dim": 1024},  # 17 MiB of blocks
         "full": {"layers": 8, "dim": 1024, "ffn_dim": 4096}}  # 539 MiB of blocks


def pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def workflow(model: str, seed: int, share: bool) -> dict:
    wf = soak.workflow(model, None, True, seed=seed)
    wf["offload"]["inputs"].update(resident_blocks=0, prefetch=1, share_host_memory=share)
    wf["sample"]["inputs"]["steps"] = STEPS
    return wf


async def _first_step(server: ComfyServer, wf: dict, timeout: float) -> tuple[str, float]:
    """Queue ``wf``; the prompt id and the seconds from its start to the sampler's first step."""
    import aiohttp

    client_id = str(uuid.uuid4())
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{server.url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{server.url}/prompt", json={"prompt": wf, "client_id": client_id}) as resp:
                prompt_id = (await resp.json())["prompt_id"]
            start = None
            deadline = time.time() + timeout
            while time.time() < deadline:
                msg = await ws.receive(timeout=max(0.1, deadline - time.time()))
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                body = data.get("data") or {}
                if body.get("prompt_id") != prompt_id:
                    continue
                if data["type"] == "execution_start":
                    start = time.time()
                # The engine's packing reports progress too, with blocks + 1 as its maximum.
                elif data["type"] == "progress" and body.get("max") == STEPS and start is not None:
                    return prompt_id, time.time() - start
    raise TimeoutError(f"no sampler step of {prompt_id} within {timeout} s")


def measure(servers: list[ComfyServer], stores: Path, model: str, share: bool,
            timeout: float = 1800) -> dict[str, Any]:
    """Run the workflow on each server in turn (the node's ``share_host_memory`` set to ``share``),
    then read every server's memory; the servers hold no model before (their growth is the run's)."""
    idle = [pss(s.proc.pid) for s in servers]
    rows = []
    for k, server in enumerate(servers):
        prompt_id, first = asyncio.run(_first_step(server, workflow(model, seed=k, share=share), timeout))
        entry = server.wait(prompt_id, timeout)
        if entry["status"]["status_str"] != "success":
            raise RuntimeError(json.dumps(entry["status"])[:3000])
        card = next(c for c in server.get("/offload/tiers")["loaded"] if c.get("layerwise"))
        lw = card["layerwise"]
        rows.append({"worker": k, "first_step_s": first, "attach_s": lw["telemetry"]["attach_seconds"],
                     "blocks_packed": lw["telemetry"]["blocks_packed"], "host_store": lw["host_store"],
                     "block_bytes": lw["block_bytes"]})
    for row, server, before in zip(rows, servers, idle):
        row["pss"] = pss(server.proc.pid)
        row["pss_growth"] = row["pss"] - before
        row["store_pss"] = sum(m["pss"] for m in soak.mapped_stores(server.proc.pid, stores).values())
    store_files = soak.store_files(stores)
    return {"workers": len(servers), "share": share, "rows": rows, "store_files": store_files,
            "store_bytes": sum((soak.store_folder(stores) / n).stat().st_size for n in store_files),
            "pss_total": sum(r["pss"] for r in rows), "pss_growth_total": sum(r["pss_growth"] for r in rows),
            "store_pss_total": sum(r["store_pss"] for r in rows)}


def run(root: Path, models: Path, workers: int, share: bool, timeout: float) -> dict[str, Any]:
    """Fresh servers for one (N, sharing) pair, so no run starts with another's memory."""
    stores = root / f"stores-{workers}-{share}"
    stores.mkdir()
    servers = soak.start_all([ComfyServer(soak.prepare_base(root / f"w{workers}-{share}-{k}", models, stores))
                              for k in range(workers)])
    try:
        return measure(servers, stores, MODEL, share, timeout)
    finally:
        for server in servers:
            server.stop()


def bounds(runs: list[dict[str, Any]], block_bytes: int) -> dict[str, Any]:
    """What the numbers must show: one copy of the blocks for any N with sharing."""
    shared = {r["workers"]: r for r in runs if r["share"]}
    checks = {}
    for n, r in shared.items():
        checks[f"store_pss_is_one_copy_n{n}"] = r["store_pss_total"] <= r["store_bytes"] \
            and r["store_pss_total"] >= 0.95 * block_bytes
        if n > 1 and 1 in shared:
            # What a worker after the first adds, less what the first added besides the blocks:
            # about 0 with one copy, the blocks' bytes with a copy per worker.
            per_worker = (r["pss_growth_total"] - shared[1]["pss_growth_total"]) / (n - 1)
            blocks_again = per_worker - (shared[1]["pss_growth_total"] - block_bytes)
            checks[f"each_extra_worker_adds_under_half_the_blocks_n{n}"] = blocks_again < block_bytes / 2
    return {"checks": checks, "ok": all(checks.values())}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"cpu ({line.split(':', 1)[1].strip()})"
    return "cpu"


def print_table(result: dict[str, Any]) -> None:
    print(f"\ndevice: {result['device']}  torch {result['torch']}  blocks {result['block_bytes'] / MIB:.1f} MiB")
    head = f"{'N':>2} {'sharing':>8} {'PSS total MiB':>14} {'growth MiB':>11} {'store PSS MiB':>14} " \
           f"{'2nd attach s':>13} {'2nd first step s':>17}"
    print(head)
    print("-" * len(head))
    for r in result["runs"]:
        second = r["rows"][1] if len(r["rows"]) > 1 else None
        print(f"{r['workers']:>2} {'on' if r['share'] else 'off':>8} {r['pss_total'] / MIB:>14.1f} "
              f"{r['pss_growth_total'] / MIB:>11.1f} {r['store_pss_total'] / MIB:>14.1f} "
              f"{(second['attach_s'] if second else float('nan')):>13.3f} "
              f"{(second['first_step_s'] if second else float('nan')):>17.3f}")
    print("bounds: " + ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in result["bounds"]["checks"].items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a small model, N = 2 only")
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="the N to run (default 1 2 3)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    counts = args.workers or ([2] if args.smoke else [1, 2, 3])
    with tempfile.TemporaryDirectory(prefix="shared_store_bench_") as tmp:
        root = Path(tmp)
        models = root / "models"
        (models / "diffusion_models").mkdir(parents=True)
        tiny_models.write_tiny_wan21(models / "diffusion_models" / MODEL, seed=5,
                                     **SIZES["smoke" if args.smoke else "full"])
        runs = [run(root, models, n, share, args.timeout) for n in counts for share in (False, True)]
    block_bytes = runs[0]["rows"][0]["block_bytes"]
    result = {"device": device_name(), "torch": torch.__version__,
              "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke,
              "block_bytes": block_bytes, "steps": STEPS, "runs": runs}
    result["bounds"] = bounds(runs, block_bytes)
    print_table(result)
    write_result(result, "shared_host_store", result["device"].split(" (")[0], args)
    return result


if __name__ == "__main__":
    ok = main()["bounds"]["ok"]
    sys.exit(0 if ok else 1)
