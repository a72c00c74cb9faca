"""Disk streaming over many prompts, as a user's server runs it all day: what every prompt leaves
behind in threads, open descriptors, spill-file bytes and RSS.

Each mode runs on a fresh server of its own, so nothing else moves its figures:
- ``cast``: a bf16 Wan that the CPU loads as fp32 (the loaded tensors are not the file's bytes);
- ``uncast``: an fp32 Wan (what ComfyUI loads is the file's bytes);
- ``tiered``: the uncast Wan through the Tiered UNET Loader, evicted to disk now and then.
Between prompts Apply Layerwise Offload's settings change (granularity, resident blocks, prefetch,
cache size: each change rebuilds the engine), a LoRA comes and goes, and ``/free`` runs every few
prompts. After every prompt the server's threads (/proc/PID/task), descriptors (/proc/PID/fd),
RSS and the bytes of spill files it still holds open or mapped (unlinked files in its temp folder,
found in /proc/PID/fd and /proc/PID/maps) are recorded.

``tests/test_disk_soak.py`` runs a short soak of each mode and asserts that the figures stay flat.
The long one is a command (Linux only, it reads /proc):

    .venv/bin/python -m tests.disk_soak --prompts 200        # every mode; --modes cast uncast tiered

It writes ``tests/artifacts/disk_soak/<mode>.json`` (every sample and a summary) and prints the
summary: each figure after the warm-up and at the end, its growth per 100 prompts (a least-squares
slope over the samples after the warm-up), and the figures once the model is dropped (``/free``;
with the Tiered loader an eviction first, since the tier manager keeps its models across it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
for _path in (TESTS, TESTS / "fixtures"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import tiny_models  # noqa: E402
from comfy_server import ComfyServer, comfy_version, DEFAULT_TREE  # noqa: E402
from workflows import latent_sha, sample_workflow  # noqa: E402

MODES = ("cast", "uncast", "tiered")
LAYERS, DIM, FFN = 8, 384, 1536  # 8 blocks of 9.5 MB in fp32: a leaked cache shows in RSS
UNCAST = "soak_wan8_fp32.safetensors"
CAST = "soak_wan8_bf16.safetensors"
LORA = "soak_wan8_lora.safetensors"
PAGE = 4096
GIB = 1 << 30
MIB = 1 << 20
# Settings the prompts cycle through, two prompts each (the second reuses the engine the first
# built): (granularity, resident blocks, prefetch, cache entries of the largest streamed unit,
# LoRA strength or None).
CYCLE = (
    ("phase", 0, 1, 3, None),
    ("block", 0, 1, 3, None),
    ("phase", 1, 2, 4, 1.0),
    ("block", 2, 1, 3, 0.5),
)
PROMPTS_PER_SETTING = 2
FREE_EVERY = 7  # /free before every 7th prompt
EVICT_EVERY = 5  # tiered mode: evict the model before every 5th prompt
WARMUP = len(CYCLE) * PROMPTS_PER_SETTING + 1  # every setting once, and one /free


def write_models(models: Path) -> None:
    """The soak's Wan in both forms and a LoRA for it, where ComfyUI's loaders look."""
    unet = models / "diffusion_models"
    unet.mkdir(parents=True, exist_ok=True)
    if not (unet / UNCAST).exists():
        tiny_models.write_tiny_wan21(unet / UNCAST, layers=LAYERS, dim=DIM, ffn_dim=FFN, seed=81)
    if not (unet / CAST).exists():
        import torch
        tiny_models.write_tiny_wan21(unet / CAST, layers=LAYERS, dim=DIM, ffn_dim=FFN, seed=82,
                                     dtype=torch.bfloat16)
    lora = models / "loras" / LORA
    if not lora.exists():
        lora.parent.mkdir(parents=True, exist_ok=True)
        tiny_models.write_tiny_wan_lora(lora, model_layers=LAYERS, dim=DIM, ffn_dim=FFN, seed=83)


# ------------------------------------------------------------------------------------ figures
def _deleted_under(target: str, folder: str) -> bool:
    return target.startswith(folder + os.sep) and target.endswith(" (deleted)")


def held_spill(pid: int, folder: str) -> tuple[int, int]:
    """(files, bytes) of unlinked files under ``folder`` that the process still holds open or
    mapped: spill files whose disk space is not given back yet. A file only mapped counts with
    the end of its furthest mapping (its size is not readable from outside)."""
    folder = os.path.realpath(folder)
    sizes: dict[int, int] = {}
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
            if _deleted_under(target, folder):
                st = os.stat(f"{fd_dir}/{name}")
                sizes[st.st_ino] = max(sizes.get(st.st_ino, 0), st.st_size)
        except OSError:  # closed meanwhile
            continue
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not _deleted_under(parts[5].rstrip("\n"), folder):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            inode, end = int(parts[4]), int(parts[2], 16) + hi - lo
            sizes[inode] = max(sizes.get(inode, 0), end)
    return len(sizes), sum(sizes.values())


def measure(pid: int, spill_folder: str) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    files, nbytes = held_spill(pid, spill_folder)
    return {"threads": len(os.listdir(f"/proc/{pid}/task")), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss": rss, "spill_files": files, "spill_bytes": nbytes}


def slope_per_100(xs: list[int], ys: list[int]) -> float:
    """Least-squares growth of ``ys`` per 100 prompts."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def summarize(samples: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steady = [s for s in samples if s["prompt"] >= warmup and s["event"] == "prompt"]
    out: dict[str, Any] = {"prompts": sum(s["event"] == "prompt" for s in samples), "warmup": warmup,
                           "seconds_per_prompt": statistics.fmean(s["seconds"] for s in steady) if steady else None}
    for key in ("threads", "fds", "rss", "spill_files", "spill_bytes"):
        warm = [s[key] for s in samples if s["prompt"] < warmup and s["event"] == "prompt"]
        values = [s[key] for s in steady]
        out[key] = {"warmup_max": max(warm, default=0), "first": values[0] if values else None,
                    "last": values[-1] if values else None, "max": max(values, default=0),
                    "per_100_prompts": slope_per_100([s["prompt"] for s in steady], values)}
    end = [s for s in samples if s["event"] == "end"]
    out["after_end"] = {k: end[-1][k] for k in ("threads", "fds", "rss", "spill_files",
                                                "spill_bytes")} if end else None
    return out


# ------------------------------------------------------------------------------------ prompts
def _unit_bytes(server: ComfyServer, unet: str, loader: str) -> dict[str, int]:
    """The largest block and phase of the model, page-rounded (what one cache entry holds)."""
    sizes = {}
    for granularity in ("block", "phase"):
        server.run(workflow(unet, loader, {"resident_blocks": 0, "prefetch": 1, "granularity": granularity},
                            None, seed=0))
        engine = max((m for m in server.get("/offload/layerwise")["models"] if m["blocks"] == LAYERS),
                     key=lambda m: m["finished_at"] or 0)
        unit = max(engine["units"][i]["bytes"] for i in engine["streamed_indices"])
        sizes[granularity] = -(-unit // PAGE) * PAGE
    return sizes


def workflow(unet: str, loader: str, layerwise: dict[str, Any] | None, lora: float | None, *,
             seed: int) -> dict:
    wf = sample_workflow("wan21", layerwise=layerwise, lora_strength=lora, seed=seed, steps=2)
    wf["load"]["class_type"] = loader
    wf["load"]["inputs"]["unet_name"] = unet
    if lora is not None:
        wf["lora"]["inputs"]["lora_name"] = LORA
    return wf


def _tier_id(server: ComfyServer, name: str) -> str | None:
    return next((m["id"] for m in server.get("/offload/tiers")["models"] if m["name"] == name), None)


def soak(server: ComfyServer, mode: str, prompts: int, *, log=None) -> dict[str, Any]:
    """Run ``prompts`` disk-streamed prompts of ``mode`` on a started server; every sample and
    the summary. Every latent must equal core's for the same model and LoRA (checked on the
    first prompt of each, and on every later prompt against that)."""
    unet = CAST if mode == "cast" else UNCAST
    loader = "TieredUNETLoader" if mode == "tiered" else "UNETLoader"
    spill_folder = str(server.base / "temp")
    pid = server.proc.pid
    units = _unit_bytes(server, unet, loader)
    reference: dict[tuple[float | None, int], str] = {}
    samples: list[dict[str, Any]] = []
    for i in range(prompts):
        granularity, resident, prefetch, entries, lora = CYCLE[(i // PROMPTS_PER_SETTING) % len(CYCLE)]
        events = []
        if i and i % FREE_EVERY == 0:
            server.free()
            events.append("free")
        if mode == "tiered" and i and i % EVICT_EVERY == 0 and (key := _tier_id(server, unet)):
            status, body = server.request("POST", f"/offload/models/{key}/evict")
            assert status == 200, body
            events.append("evict")
        seed = i % 3  # three seeds: every latent has a core reference, and prompts never hit the cache
        if (lora, seed) not in reference:
            reference[(lora, seed)] = latent_sha(server.run(workflow(unet, loader, None, lora, seed=seed)))
        layerwise = {"resident_blocks": resident, "prefetch": prefetch, "granularity": granularity,
                     "host_cache_gb": entries * units[granularity] / GIB}
        start = time.perf_counter()
        got = latent_sha(server.run(workflow(unet, loader, layerwise, lora, seed=seed)))
        seconds = time.perf_counter() - start
        assert got == reference[(lora, seed)], f"prompt {i} of {mode}: the latent differs from core's"
        sample = {"prompt": i, "event": "prompt", "events": events, "seconds": seconds,
                  **measure(pid, spill_folder)}
        samples.append(sample)
        if log is not None:
            log(mode, sample)
    # The end: /free drops core's loaders' models; the tier manager keeps its own until evicted.
    events = ["free"]
    if mode == "tiered" and (key := _tier_id(server, unet)):
        status, body = server.request("POST", f"/offload/models/{key}/evict")
        assert status == 200, body
        events.append("evict")
    server.free()
    samples.append({"prompt": prompts, "event": "end", "events": events, "seconds": 0.0,
                    **measure(pid, spill_folder)})
    return {"mode": mode, "comfyui": comfy_version(), "model": {"layers": LAYERS, "dim": DIM, "ffn": FFN},
            "cycle": CYCLE, "free_every": FREE_EVERY, "evict_every": EVICT_EVERY if mode == "tiered" else None,
            "samples": samples, "summary": summarize(samples, WARMUP)}


def start_server(root: Path, models: Path) -> ComfyServer:
    """A fresh server whose models folder is ``models`` (written once, shared by every mode)."""
    server = ComfyServer(root / "base")
    link = server.base / "models"
    if not link.exists():
        link.symlink_to(models, target_is_directory=True)
    return server.start()


def _print_sample(mode: str, s: dict[str, Any]) -> None:
    print(f"{mode:7s} {s['prompt']:4d} {','.join(s['events']) or '-':10s} {s['seconds']:5.2f} s  "
          f"threads {s['threads']:3d}  fds {s['fds']:4d}  rss {s['rss'] / MIB:7.1f} MiB  "
          f"spill {s['spill_files']} file(s) {s['spill_bytes'] / MIB:6.1f} MiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--quiet", action="store_true", help="no line per prompt")
    args = parser.parse_args(argv)
    out = TESTS / "artifacts" / ("disk_soak" if DEFAULT_TREE else f"comfyui-{comfy_version()}/disk_soak")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TESTS / "artifacts") as tmp:
        models = Path(tmp) / "models"
        write_models(models)
        for mode in args.modes:
            server = start_server(Path(tmp) / mode, models)
            try:
                result = soak(server, mode, args.prompts, log=None if args.quiet else _print_sample)
            finally:
                server.stop()
            (out / f"{mode}.json").write_text(json.dumps(result, indent=1))
            print(json.dumps({"mode": mode, **result["summary"]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
