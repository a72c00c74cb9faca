"""Mid-size Wan 2.1 through a real ComfyUI server: Apply Layerwise Offload against core's own
partial loading at the same VRAM budget, and against no offload at all.

One model file, written once, serves every workload (--workloads: latent sizes, each named) and
every mode; a server runs each of its modes for every workload before the next server starts.
Modes, each queued through POST /prompt --repeats times (the last run is reported, the first
is the cold one that loads the model):
  core_full     the plain workflow; core loads the whole model. Its step time is the compute
                floor and its peak is "VRAM without offload".
  core_partial  the plain workflow on a server started with --reserve-vram, so core sees only
                --visible-gb of the card. It loads what fits and casts the rest to the device
                layer by layer on every call (classic lowvram partial loading).
  layerwise     Apply Layerwise Offload on that same server, with its block budget set to the
                block bytes core kept loaded in core_partial, so both hold the same weight bytes
                on the device.

Per mode: step time from CUDA events around apply_model, peak allocated and reserved VRAM,
what core believes is loaded, the engine's telemetry, the latent's sha256 (layerwise must equal
core_full, the reference; core_partial is reported beside it) and the prompt's wall time. A streamed mode's bound is
max(compute, streamed bytes per step / pinned link bandwidth), where compute is core_full's step
time and the link is measured before any server starts. Streamed bytes per step are the
streamed blocks' bytes once per model call for layerwise (the engine's own counter, which also
holds the upload at attach and the prefetch past the last step, is in the JSON beside it), and
for core_partial the bytes core left unloaded, once per model call.

--dynamic compares instead, on one server with the same visible VRAM (--reserve-vram on CUDA):
  core_dynamic  the plain workflow: with ComfyUI 0.15 and later on NVIDIA, core's Dynamic VRAM
                streams the model itself (run it with TIERED_OFFLOAD_COMFY_ROOT/_PYTHON naming a
                0.33 tree; bench/gpu_session.sh dynamic does)
  auto          Apply Layerwise Offload, mode auto: core streams, in the node's order
  engine        Apply Layerwise Offload, mode engine: the pack's engine on a classic twin
with step time, peak device memory (the device's own use: Dynamic VRAM maps weights outside
torch's allocator), the server's host RSS, and whether each latent equals core_dynamic's. The
JSON says whether the server ran Dynamic VRAM at all (on CPU all three modes are classic).

The model is Wan 2.1 with 14B dimensions (dim 5120, ffn 13824, 40 heads) and --layers blocks,
in random bf16 weights written here. The text context is 16 random tokens rather than T5's 512.
A block of it is 0.65 GiB, about Flux-dev's double block (0.63 GiB): a workload of one
1024x1024 frame (4096 tokens, Flux-dev's image tokens at 1024x1024) runs it in Flux's regime,
where a block's copy takes longer than its compute; 480p video frames are Wan's, compute-bound.
The JSON has, per workload, its modes and latents; --rows appends one JSON row per mode as it
ends (bench/gpu_session.sh reads them back if a run is cut short).
--smoke runs a 6-block dim-128 Wan, in well under a minute. On a CPU-only machine it skips
core_partial, because with --cpu core keeps everything on the CPU and has no partial loading
to compare.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "fixtures"), str(BENCH)]
import tiny_models  # noqa: E402
from comfy_server import ComfyServer  # noqa: E402
from layerwise import link_peak  # noqa: E402
from session_rows import append_row  # noqa: E402

RESULTS = BENCH / "results"
MODEL_FILE = "bench_wan21.safetensors"
BENCH_NODES = {"tiered_offload_bench_nodes": BENCH / "comfy_nodes"}
# PyTorch's own caching allocator rather than core's default cudaMallocAsync: its peak counters
# are complete, and bench/layerwise.py measures under the same allocator.
SERVER_ARGS = ("--disable-cuda-malloc",)
GB = 1e9  # link rates
GIB = 2**30  # the node's vram_budget_gb and --reserve-vram are binary gigabytes


# ------------------------------------------------------------------ the model on disk
def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, read from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: v["data_offsets"][1] - v["data_offsets"][0]
            for k, v in header.items() if k != "__metadata__"}


def write_model(base: Path, args: argparse.Namespace) -> Path:
    path = base / "models" / "diffusion_models" / MODEL_FILE
    if not path.exists():
        print(f"writing a {args.layers}-block dim-{args.dim} Wan 2.1 to {path} ...", flush=True)
        tiny_models.write_tiny_wan21(path, layers=args.layers, dim=args.dim, ffn_dim=args.ffn,
                                     seed=0, dtype=getattr(torch, args.dtype))
    return path


def probe_device(link_bytes: int) -> dict[str, Any]:
    """The link's pinned bandwidth, and the device's name and size (see probe_in_child)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    return {"link": link_peak(device, link_bytes, 5),
            "name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "total_bytes": torch.cuda.mem_get_info(device)[1] if cuda else None}


def probe_in_child(link_bytes: int) -> dict[str, Any]:
    """probe_device in a child process, so this one never holds a CUDA context: the servers
    then see the whole card, less only what --reserve-vram takes."""
    out = subprocess.run([sys.executable, __file__, "--probe-device", str(link_bytes)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


# ------------------------------------------------------------------ the workflow
def parse_workloads(text: str) -> dict[str, dict[str, int]]:
    """"NAME=WxHxF,..." (width, height, frames of the latent video) in order."""
    out: dict[str, dict[str, int]] = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        width, height, frames = (int(v) for v in size.split("x"))
        out[name] = {"width": width, "height": height, "frames": frames}
    return out


def workflow(args: argparse.Namespace, latent: dict[str, int], label: str, seed: int,
             layerwise: dict[str, Any] | None) -> dict:
    """UNETLoader → [Apply Layerwise Offload] → clock → KSampler → latent sha + bench report."""
    wf: dict[str, dict] = {
        "load": {"class_type": "UNETLoader",
                 "inputs": {"unet_name": MODEL_FILE, "weight_dtype": "default"}},
        "pos": {"class_type": "TieredTestConditioning", "inputs": {"model_kind": "wan21", "seed": 1}},
        "neg": {"class_type": "TieredTestConditioning", "inputs": {"model_kind": "wan21", "seed": 2}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": latent["width"], "height": latent["height"],
                              "length": latent["frames"], "batch_size": 1}},
        "stats": {"class_type": "TieredTestLatentStats", "inputs": {"samples": ["sample", 0]}},
        "report": {"class_type": "TieredBenchReport",
                   "inputs": {"samples": ["sample", 0], "label": label}},
    }
    model = ["load", 0]
    if layerwise is not None:
        wf["offload"] = {"class_type": "ApplyLayerwiseOffload",
                         "inputs": {"model": model, "resident_blocks": -1, "prefetch": args.prefetch,
                                    "pin": True, **layerwise}}
        model = ["offload", 0]
    wf["clock"] = {"class_type": "TieredBenchClock", "inputs": {"model": model}}
    wf["sample"] = {"class_type": "KSampler",
                    "inputs": {"model": ["clock", 0], "positive": ["pos", 0],
                               "negative": ["neg", 0], "latent_image": ["latent", 0],
                               "seed": seed, "steps": args.steps, "cfg": args.cfg,
                               "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    return wf


def prompt_seconds(entry: dict) -> float | None:
    """Wall time of a prompt from its execution_start and execution_success messages."""
    stamps = {kind: data.get("timestamp") for kind, data in entry["status"]["messages"]}
    start, end = stamps.get("execution_start"), stamps.get("execution_success")
    return (end - start) / 1000 if start is not None and end is not None else None


def _pack_report(reports: list[dict], core_streams: bool) -> dict | None:
    """The node's report on the Wan: the engine's session, or the order core streams in."""
    return next((r for r in reports if r["model_class"] == "WanModel"
                 and ((r.get("dynamic_vram") or {}).get("path") == "core streams") == core_streams),
                None)


def run_mode(server: ComfyServer, args: argparse.Namespace, workload: str, mode: str,
             layerwise: dict[str, Any] | None) -> dict:
    """Queue the mode's workflow --repeats times from a clean server; report the last run (and
    append it to --rows)."""
    server.free()
    runs = []
    latent = args.workloads[workload]
    for i in range(args.repeats):
        entry = server.wait(server.queue(workflow(args, latent, mode, args.seed, layerwise)),
                            timeout=args.prompt_timeout)
        if entry["status"]["status_str"] != "success":
            raise RuntimeError(f"{workload} {mode} run {i} failed: {json.dumps(entry['status'])[:4000]}\n"
                               f"{server.log_tail(60)}")
        figures = entry["outputs"]["report"]["bench"][0]
        figures["latent_sha256"] = entry["outputs"]["stats"]["latent_stats"][0]["sha256"]
        figures["prompt_s"] = prompt_seconds(entry)
        runs.append(figures)
    last = dict(runs[-1])
    calls = last.pop("call_s")
    last.update(calls=len(calls), calls_per_step=len(calls) / args.steps,
                call_s_median=statistics.median(calls),
                step_s=sum(calls) / args.steps,
                cold_prompt_s=runs[0]["prompt_s"])
    if layerwise is not None:
        reports = server.get("/offload/layerwise")["models"]
        # auto on a Dynamic VRAM model: the order core streams in; anywhere else the engine's.
        auto = layerwise.get("mode") == "auto"
        last["layerwise"] = _pack_report(reports, auto) or _pack_report(reports, not auto)
    append_row(args.rows, {"bench": "comfy_wan", "row": "mode", "workload": workload, "mode": mode,
                           "dynamic": args.dynamic, "latent": latent,
                           "budget_gib": (layerwise or {}).get("vram_budget_gb"),
                           **{k: last.get(k) for k in ROW_FIELDS}})
    return last


# What a row of a mode holds (the JSON has the rest).
ROW_FIELDS = ("step_s", "calls", "calls_per_step", "call_s_median", "prompt_s", "cold_prompt_s",
              "latent_sha256", "peak_allocated_bytes", "peak_device_used_bytes", "host_rss")


# ------------------------------------------------------------------ figures
def wan_loaded_bytes(mode: dict) -> int:
    return sum(m["loaded_bytes"] for m in mode["loaded_models"] if m["class"] == "WAN21")


def add_bounds(result: dict, modes: dict, link_gbps: float | None) -> None:
    """Streamed bytes per step, the bound and how close each streamed mode gets to it."""
    compute = modes["core_full"]["step_s"]
    total = result["model"]["bytes"]
    for name, mode in modes.items():
        if name == "core_full" or "step_s" not in mode:
            continue
        if name == "layerwise":  # every streamed block crosses the link once per model call
            per_block = result["model"]["bytes_per_block"]
            streamed = (sum(per_block[i] for i in mode["layerwise"]["streamed_indices"])
                        * mode["calls_per_step"])
        else:  # core casts every weight it left unloaded, once per model call
            streamed = (total - wan_loaded_bytes(mode)) * mode["calls_per_step"]
        mode["streamed_bytes_per_step"] = streamed
        if link_gbps:
            bound = max(compute, streamed / (link_gbps * GB))
            mode.update(bound_s=bound, efficiency=bound / mode["step_s"],
                        over_compute=mode["step_s"] / compute - 1)


def _gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_table(result: dict) -> None:
    link = result["link"]
    print(f"device: {result['device']}  torch {result['torch']}  model: {result['model']['layers']} "
          f"blocks, {_gib(result['model']['bytes'])} GiB  link: "
          f"{link['pinned_h2d_GBps']:.1f} GB/s pinned")
    head = (f"{'workload':<14} {'mode':<13} {'step s':>8} {'bound s':>8} {'eff':>5} {'peak GiB':>9} "
            f"{'core-loaded GiB':>16} {'streamed/step GiB':>18} {'cold prompt s':>14} {'sha':>10}")
    print(head)
    print("-" * len(head))
    for workload, run in result["workloads"].items():
        for name, m in run["modes"].items():
            if "skipped" in m:
                print(f"{workload:<14} {name:<13} skipped: {m['skipped']}")
                continue
            bound = f"{m['bound_s']:.3f}" if "bound_s" in m else "-"
            eff = f"{m['efficiency']:.2f}" if "efficiency" in m else "-"
            print(f"{workload:<14} {name:<13} {m['step_s']:>8.3f} {bound:>8} {eff:>5} "
                  f"{_gib(m['peak_allocated_bytes']):>9} {_gib(wan_loaded_bytes(m)):>16} "
                  f"{_gib(m.get('streamed_bytes_per_step')):>18} {m['cold_prompt_s'] or 0:>14.2f} "
                  f"{m['latent_sha256'][:10]:>10}")
        print(f"{workload}: layerwise latent equals core's full load (the reference): "
              f"{run['layerwise_matches_reference']}; core's partial load equals it: "
              f"{run['core_partial_matches_reference']}")


def run_dynamic(args: argparse.Namespace, base: Path, result: dict, cuda: bool,
                cpu_budget_gib: float) -> None:
    """core_dynamic, auto and engine on one server: the same visible VRAM for all three. The
    node's budget is --budget-gb, else its own default (from what is free at each run); on a
    CPU, where that default keeps every block resident, one resident block so that it streams."""
    runs = result["workloads"] = {name: {"latent": latent, "modes": {}}
                                  for name, latent in args.workloads.items()}
    extra: tuple[str, ...] = ()
    if cuda:
        reserve_gib = max(0.0, result["device_total_bytes"] / GIB - args.visible_gb)
        result["settings"]["reserve_vram_gib"] = reserve_gib
        extra = ("--reserve-vram", f"{reserve_gib:.3f}")
    budget = args.budget_gb or (0.0 if cuda else cpu_budget_gib)
    result["settings"]["layerwise_budget_gib"] = budget
    result["reference"] = "core_dynamic"
    with _server(base, extra, torch.get_num_threads(), dynamic_vram=True) as server:
        result["dynamic_vram"] = "DynamicVRAM support detected and enabled" in server.log_text()
        for workload, run in runs.items():
            modes = run["modes"]
            modes["core_dynamic"] = run_mode(server, args, workload, "core_dynamic", None)
            modes["auto"] = run_mode(server, args, workload, "auto",
                                     {"mode": "auto", "vram_budget_gb": budget})
            modes["engine"] = run_mode(server, args, workload, "engine",
                                       {"mode": "engine", "vram_budget_gb": budget})
            reference = modes["core_dynamic"]["latent_sha256"]
            run["auto_matches_reference"] = modes["auto"]["latent_sha256"] == reference
            run["engine_matches_reference"] = modes["engine"]["latent_sha256"] == reference


def print_dynamic_table(result: dict) -> None:
    print(f"device: {result['device']}  torch {result['torch']}  Dynamic VRAM: "
          f"{result['dynamic_vram']}  model: {result['model']['layers']} blocks, "
          f"{_gib(result['model']['bytes'])} GiB")
    head = (f"{'workload':<14} {'mode':<13} {'step s':>8} {'peak device GiB':>16} {'host anon GiB':>14} "
            f"{'host file GiB':>14} {'host peak GiB':>14} {'cold prompt s':>14} {'sha':>10}")
    print(head)
    print("-" * len(head))
    for workload, run in result["workloads"].items():
        for name, m in run["modes"].items():
            rss = m.get("host_rss") or {}
            print(f"{workload:<14} {name:<13} {m['step_s']:>8.3f} "
                  f"{_gib(m.get('peak_device_used_bytes')):>16} {_gib(rss.get('anon_bytes')):>14} "
                  f"{_gib(rss.get('file_bytes')):>14} {_gib(rss.get('peak_bytes')):>14} "
                  f"{m['cold_prompt_s'] or 0:>14.2f} {m['latent_sha256'][:10]:>10}")
        print(f"{workload}: latent equals core_dynamic's: auto {run['auto_matches_reference']}, "
              f"engine {run['engine_matches_reference']}")


# ------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a 6-block dim-128 Wan, under a minute")
    ap.add_argument("--dynamic", action="store_true",
                    help="core's Dynamic VRAM alone vs the node's auto and engine modes")
    ap.add_argument("--layers", type=int, default=16, help="Wan blocks (Wan 2.1 14B has 40)")
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--ffn", type=int, default=13824)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads",
                    help="NAME=WIDTHxHEIGHTxFRAMES list: the latents every mode samples, in order "
                         "(default wan-480p=832x480x33; --smoke: smoke=64x64x5)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cfg", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode; the last is reported")
    ap.add_argument("--visible-gb", type=float, default=10.0,
                    help="VRAM (GiB) core may use in core_partial and layerwise")
    ap.add_argument("--budget-gb", type=float,
                    help="layerwise block budget (GiB); default: the block bytes core kept loaded")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--prompt-timeout", type=float, default=1200)
    ap.add_argument("--base", type=Path, help="ComfyUI base directory (kept; reuses the model)")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/comfy_wan-<device>-<time>.json)")
    ap.add_argument("--rows", type=Path, help="append one JSON row per mode here as it ends")
    ap.add_argument("--probe-device", type=int, metavar="LINK_BYTES", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.dim, args.ffn, args.dtype, args.prefetch = 6, 128, 256, "float32", 1
        args.steps = 3
        args.workloads = args.workloads or "smoke=64x64x5"
    args.workloads = parse_workloads(args.workloads or "wan-480p=832x480x33")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.probe_device:
        probe = probe_device(args.probe_device)
        print(json.dumps(probe))
        return probe
    cuda = torch.cuda.is_available()
    base = args.base or Path(tempfile.mkdtemp(prefix="comfy_wan_bench_"))
    path = write_model(base, args)
    sizes = tensor_bytes(path)
    bytes_per_block = [sum(n for k, n in sizes.items() if k.startswith(f"blocks.{i}."))
                       for i in range(args.layers)]
    block_bytes = sum(bytes_per_block)
    # The engine needs prefetch + 1 block-sized slots before it can keep anything resident.
    min_budget = (args.prefetch + 1) * block_bytes / args.layers / GIB
    probe = probe_in_child(8 << 20 if args.smoke else 1 << 30)
    link, total_vram = probe["link"], probe["total_bytes"]
    result: dict[str, Any] = {
        "device": probe["name"],
        "device_total_bytes": total_vram,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"layers": args.layers, "dim": args.dim, "ffn": args.ffn, "dtype": args.dtype,
                  "bytes": sum(sizes.values()), "block_bytes": block_bytes,
                  "bytes_per_block": bytes_per_block},
        "link": link,
    }
    if args.dynamic:
        run_dynamic(args, base, result, cuda, min_budget + block_bytes / args.layers / GIB)
        print_dynamic_table(result)
        return _write(result, args)
    runs = result["workloads"] = {name: {"latent": latent, "modes": {}}
                                  for name, latent in args.workloads.items()}
    result["settings"]["layerwise_min_budget_gib"] = min_budget
    threads = torch.get_num_threads()
    with _server(base, SERVER_ARGS, threads) as server:
        for workload, run in runs.items():
            modes = run["modes"]
            modes["core_full"] = run_mode(server, args, workload, "core_full", None)
            if not cuda:
                modes["core_partial"] = {"skipped": "with --cpu core keeps the whole model on the "
                                                    "CPU; it has no partial loading to compare"}
                budget = args.budget_gb or min_budget + block_bytes / args.layers / GIB  # 1 resident
                run["layerwise_budget_gib"] = budget
                modes["layerwise"] = run_mode(server, args, workload, "layerwise",
                                              {"vram_budget_gb": budget})
    if cuda:
        reserve_gib = max(0.0, total_vram / 2**30 - args.visible_gb)
        result["settings"]["reserve_vram_gib"] = reserve_gib
        with _server(base, (*SERVER_ARGS, "--reserve-vram", f"{reserve_gib:.3f}"), threads) as server:
            for workload, run in runs.items():
                modes = run["modes"]
                modes["core_partial"] = run_mode(server, args, workload, "core_partial", None)
                nonblock = result["model"]["bytes"] - block_bytes
                kept = max(0, wan_loaded_bytes(modes["core_partial"]) - nonblock)
                budget = args.budget_gb or max(kept / GIB, min_budget)
                run.update(core_kept_block_gib=kept / GIB, layerwise_budget_gib=budget)
                modes["layerwise"] = run_mode(server, args, workload, "layerwise",
                                              {"vram_budget_gb": budget})
    # The reference is core's full load (what a user whose card fits the model gets); core's
    # partial load may differ from it with a LoRA on bf16/fp16/fp8 weights (it applies the LoRA
    # at forward time without stochastic rounding), so it is reported, not required.
    result["reference"] = "core_full"
    for run in runs.values():
        modes = run["modes"]
        reference = modes["core_full"]["latent_sha256"]
        run["layerwise_matches_reference"] = modes["layerwise"].get("latent_sha256") == reference
        run["core_partial_matches_reference"] = (
            modes["core_partial"]["latent_sha256"] == reference
            if "latent_sha256" in modes["core_partial"] else None)
        add_bounds(result, modes, link["pinned_h2d_GBps"] if cuda else None)
    print_table(result)
    return _write(result, args)


def _write(result: dict, args: argparse.Namespace) -> dict:
    out = args.out
    if out is None:
        slug = "smoke" if args.smoke else result["device"].lower().replace(" ", "-")
        kind = "comfy_wan_dynamic" if args.dynamic else "comfy_wan"
        out = RESULTS / f"{kind}-{slug}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


@contextlib.contextmanager
def _server(base: Path, extra_args: tuple[str, ...], threads: int,
            dynamic_vram: bool = False) -> Iterator[ComfyServer]:
    """A ComfyServer with the bench nodes, stopped on exit; its log is kept beside the base."""
    server = ComfyServer(base, extra_args=extra_args, threads=threads, extra_nodes=BENCH_NODES,
                         dynamic_vram=dynamic_vram)
    server.start()
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    main()
