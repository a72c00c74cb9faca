"""Switching workflows through a real ComfyUI: core's loaders against the Tiered loaders.

Three workflows, each with its own diffusion model (a Wan 2.1, an SD3 and a HunyuanVideo, in
random weights written here, about 1.5 GiB each by default), are visited A, B, C, A, B, C, ...
--rounds times, once on a server whose workflows use core's UNETLoader and once on a fresh
server whose workflows use the Tiered UNET Loader. ComfyUI's default cache drops a workflow's
loader output when another workflow runs, so core reads a model's file again on every visit;
the tier manager keeps it in RAM (within its budget) and hands it back.

Per visit:
  load_s    from the prompt's start until its loader finished: the loader node's own time, plus
            the time before the first node (where the tier manager brings the prompt's models
            up).
  prompt_s  the prompt's wall time, from its start to its end.
            Both are taken on one clock, this script's, when the websocket messages arrive
            (`execution_start`, then `executing` per node, then `executing` with no node at the
            end); the server sends them in order, so load_s never exceeds prompt_s.
  source    for the Tiered loader: where the manager served the model from (disk or ram).

Cold or warm: before every visit the OS page cache is dropped (`/proc/sys/vm/drop_caches`,
root only) unless --warm is given; where the drop is refused the reads are warm, and the table
and JSON say which. --smoke runs the small fixture models, warm, in under a minute; the test
suite runs it. The sampler runs one step at cfg 1, so the prompt is mostly the load.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "fixtures")]
import tiny_models  # noqa: E402
from comfy_server import ComfyServer  # noqa: E402

RESULTS = BENCH / "results"
GIB = 2**30
LOADERS = {"core": "UNETLoader", "tiered": "TieredUNETLoader"}


# ------------------------------------------------------------------ models
def model_specs(smoke: bool) -> dict[str, dict[str, Any]]:
    """Name -> writer, its arguments and the conditioning kind of the test node."""
    if smoke:
        return {name: {"file": f"switch_{name}.safetensors", "writer": spec["writer"],
                       "kwargs": dict(spec["writer_kwargs"]), "kind": name}
                for name, spec in tiny_models.MODELS.items()}
    return {
        "wan21": {"file": "switch_wan21.safetensors", "writer": tiny_models.write_tiny_wan21,
                  "kwargs": {"layers": 8, "dim": 1536, "ffn_dim": 8960, "seed": 0}, "kind": "wan21"},
        "sd3": {"file": "switch_sd3.safetensors", "writer": tiny_models.write_tiny_sd3,
                "kwargs": {"depth": 14, "text_dim": 64, "pooled_dim": 32, "seed": 0}, "kind": "sd3"},
        "hunyuan_video": {"file": "switch_hunyuan_video.safetensors",
                          "writer": tiny_models.write_tiny_hunyuan_video,
                          "kwargs": {"double_blocks": 6, "single_blocks": 12, "hidden": 1024,
                                     "text_dim": 64, "seed": 0}, "kind": "hunyuan_video"},
    }


def write_models(base: Path, specs: dict[str, dict], dtype: torch.dtype) -> dict[str, int]:
    sizes = {}
    for name, spec in specs.items():
        path = base / "models" / "diffusion_models" / spec["file"]
        if not path.exists():
            print(f"writing {path.name} ...", flush=True)
            spec["writer"](path, dtype=dtype, **spec["kwargs"])
        sizes[name] = path.stat().st_size
    return sizes


def workflow(spec: dict[str, Any], loader: str, seed: int) -> dict:
    """Loader → KSampler (1 step, cfg 1: one model call) → latent sha, with test conditioning."""
    latent = tiny_models.MODELS[spec["kind"]]["latent"]
    return {
        "load": {"class_type": loader, "inputs": {"unet_name": spec["file"], "weight_dtype": "default"}},
        "pos": {"class_type": "TieredTestConditioning", "inputs": {"model_kind": spec["kind"], "seed": 1}},
        "latent": {"class_type": latent["node"], "inputs": dict(latent["inputs"])},
        "sample": {"class_type": "KSampler", "inputs": {
            "model": ["load", 0], "positive": ["pos", 0], "negative": ["pos", 0],
            "latent_image": ["latent", 0], "seed": seed, "steps": 1, "cfg": 1.0,
            "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "stats": {"class_type": "TieredTestLatentStats", "inputs": {"samples": ["sample", 0]}},
    }


# ------------------------------------------------------------------ one visit
def drop_page_cache() -> bool:
    """Drop the OS page cache so the next read comes from the disk; False where not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


async def _run_watched(server: ComfyServer, wf: dict, timeout: float) -> tuple[str, list]:
    """Queue `wf` with a websocket open; return its id and the (receipt time, node) of its
    `execution_start` (node "start") and of each `executing` message it sent, up to its end
    (node None)."""
    import aiohttp

    client_id = str(uuid.uuid4())
    events: list[tuple[float, str | None]] = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{server.url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{server.url}/prompt",
                                    json={"prompt": wf, "client_id": client_id}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"POST /prompt -> {resp.status}: {json.dumps(body)[:2000]}")
            prompt_id = body["prompt_id"]
            deadline = time.time() + timeout
            while time.time() < deadline:
                msg = await ws.receive(timeout=max(0.1, deadline - time.time()))
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                kind = data.get("type")
                if kind not in ("execution_start", "executing") or data["data"].get("prompt_id") != prompt_id:
                    continue
                events.append((time.time(), "start" if kind == "execution_start" else data["data"].get("node")))
                if events[-1][1] is None:
                    return prompt_id, events
    raise TimeoutError(f"prompt {prompt_id} did not end within {timeout} s")


def visit(server: ComfyServer, wf: dict, timeout: float) -> dict[str, Any]:
    prompt_id, events = asyncio.run(_run_watched(server, wf, timeout))
    entry = server.wait(prompt_id, timeout)
    if entry["status"]["status_str"] != "success":
        raise RuntimeError(f"visit failed: {json.dumps(entry['status'])[:3000]}\n{server.log_tail(40)}")
    nodes = [node for _, node in events]
    if nodes[0] != "start":
        raise RuntimeError(f"visit: no execution_start before its first node: {nodes}")
    start, end = events[0][0], events[-1][0]
    load_end = events[1][0]  # the first node starts once the prompt's models are held
    if "load" in nodes:
        load_end = events[nodes.index("load") + 1][0]
    return {"load_s": load_end - start, "prompt_s": end - start,
            "loader_ran": "load" in nodes,
            "latent_sha256": entry["outputs"]["stats"]["latent_stats"][0]["sha256"]}


# ------------------------------------------------------------------ one mode
def run_mode(base: Path, mode: str, specs: dict[str, dict], args: argparse.Namespace,
             cold: bool) -> list[dict[str, Any]]:
    visits = []
    with _server(base, args.threads) as server:
        if mode == "tiered" and args.ram_budget_gib is not None:
            server.post("/offload/budgets", {"ram_budget_gb": args.ram_budget_gib})
        for round_ in range(args.rounds):
            for name, spec in specs.items():
                dropped = drop_page_cache() if cold else False
                figures = visit(server, workflow(spec, LOADERS[mode], seed=round_),
                                args.prompt_timeout)
                figures.update(mode=mode, workflow=name, round=round_, page_cache_dropped=dropped)
                if mode == "tiered":
                    tiers = {m["name"]: m for m in server.get("/offload/tiers")["models"]}
                    m = tiers[spec["file"]]
                    before = visits_by(visits, name)
                    disk_before = before[-1]["loads_from_disk"] if before else 0
                    figures.update(loads_from_disk=m["loads_from_disk"], loads_from_ram=m["loads_from_ram"],
                                   source="disk" if m["loads_from_disk"] > disk_before else "ram")
                else:
                    figures["source"] = "disk" if figures["loader_ran"] else "cache"
                visits.append(figures)
                print(f"{mode:<7} round {round_} {name:<14} load {figures['load_s']:7.2f} s  "
                      f"prompt {figures['prompt_s']:7.2f} s  from {figures['source']}", flush=True)
    return visits


def visits_by(visits: list[dict], name: str) -> list[dict]:
    return [v for v in visits if v["workflow"] == name]


def summary(visits: list[dict]) -> dict[str, Any]:
    """Mean load and prompt seconds over the revisits (every round after the first)."""
    out = {}
    for mode in LOADERS:
        again = [v for v in visits if v["mode"] == mode and v["round"] > 0]
        if again:
            out[mode] = {"revisit_load_s_mean": statistics.mean(v["load_s"] for v in again),
                         "revisit_prompt_s_mean": statistics.mean(v["prompt_s"] for v in again),
                         "revisits": len(again)}
    if {"core", "tiered"} <= set(out) and out["tiered"]["revisit_load_s_mean"] > 0:
        out["revisit_load_speedup"] = (out["core"]["revisit_load_s_mean"]
                                       / out["tiered"]["revisit_load_s_mean"])
    return out


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu ({line.split(':', 1)[1].strip()})"
    return f"cpu ({platform.processor() or platform.machine()})"


def print_table(result: dict) -> None:
    print(f"\ndevice: {result['device']}  torch {result['torch']}  page cache: {result['page_cache']}")
    print("models: " + ", ".join(f"{n} {s / GIB:.2f} GiB" for n, s in result["model_bytes"].items()))
    head = f"{'round':>5} {'workflow':<14} {'core load s':>12} {'core prompt s':>14} " \
           f"{'tiered load s':>14} {'tiered prompt s':>16} {'tiered from':>12}"
    print(head)
    print("-" * len(head))
    core = [v for v in result["visits"] if v["mode"] == "core"]
    tiered = [v for v in result["visits"] if v["mode"] == "tiered"]
    for c, t in zip(core, tiered):
        print(f"{c['round']:>5} {c['workflow']:<14} {c['load_s']:>12.2f} {c['prompt_s']:>14.2f} "
              f"{t['load_s']:>14.2f} {t['prompt_s']:>16.2f} {t['source']:>12}")
    s = result["summary"]
    if "revisit_load_speedup" in s:
        print(f"revisits: core loads {s['core']['revisit_load_s_mean']:.2f} s, tiered "
              f"{s['tiered']['revisit_load_s_mean']:.2f} s on average "
              f"({s['revisit_load_speedup']:.1f}x); latents identical: {result['bit_identical']}")


# ------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the small fixture models, warm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="never drop the page cache")
    ap.add_argument("--dtype", default=None, help="weights on disk (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--ram-budget-gib", type=float, help="the tier manager's RAM budget (default: auto)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-timeout", type=float, default=1800)
    ap.add_argument("--base", type=Path, help="ComfyUI base directory (kept; reuses the models)")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/tiers_switch-<device>-<time>.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.warm, args.rounds = True, 2
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    base = args.base or Path(tempfile.mkdtemp(prefix="tiers_switch_bench_"))
    specs = model_specs(args.smoke)
    sizes = write_models(base, specs, getattr(torch, args.dtype))
    cold = not args.warm and drop_page_cache()
    visits = []
    for mode in LOADERS:
        visits += run_mode(base, mode, specs, args, cold)
    # The same workflow and seed must give the same latent with either loader.
    shas: dict[tuple, set] = {}
    for v in visits:
        shas.setdefault((v["workflow"], v["round"]), set()).add(v["latent_sha256"])
    result = {
        "device": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "page_cache": "cold (dropped before every visit)" if cold else "warm",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_bytes": sizes,
        "visits": visits,
        "bit_identical": all(len(s) == 1 for s in shas.values()),
    }
    result["summary"] = summary(visits)
    print_table(result)
    out = args.out
    if out is None:
        slug = "smoke" if args.smoke else result["device"].split(" (")[0].lower().replace(" ", "-")
        out = RESULTS / f"tiers_switch-{slug}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


@contextlib.contextmanager
def _server(base: Path, threads: int) -> Iterator[ComfyServer]:
    """A fresh server per mode, so neither starts with the other's models; stopped on exit."""
    server = ComfyServer(base, threads=threads)
    server.start()
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    main()
