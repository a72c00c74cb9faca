"""Servers that share one host copy of each model, over many prompts with the models switching: what
every prompt leaves behind in shared stores, mappings and RSS.

Two servers (each with the pack) load the same model files from one folder and stream them with
Apply Layerwise Offload, so they share each model's blocks through one store (the settings file
points the store folder at a folder of the run's own). Each prompt runs on one server in turn and
switches that server's model every other prompt (ComfyUI drops the model its loader no longer
gives, which closes the pack's engine and lets go of the store), with a LoRA on one server, and
goes through the ways users run a model (``MODES``): some blocks resident, every block streamed,
Model-Level Swap, both nodes, and core alone on the model the pack handed back; half the cycles
carry a hook LoRA on the positive, which core patches in place while it samples. Every latent is
compared with core's own result for that model, LoRA and hook, and `/free` runs every few prompts
on one of them. After every prompt the run records each server's RSS and the stores it
maps (/proc/PID/smaps), and the store files in the folder.

``tests/test_shared_host_store.py`` runs 200 prompts on its servers and asserts that the figures
stay flat and that no store is left once both servers let go. Longer runs are a command (Linux
only, it reads /proc):

    .venv/bin/python -m tests.host_store_soak --prompts 1000

It writes ``tests/artifacts/host_store_soak/summary.json`` (every sample and a summary) and prints
the summary: each server's RSS after the warm-up and at the end, its growth per 100 prompts, the
most store files at once, and what is left after ``/free`` on both.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
for _path in (TESTS, TESTS / "fixtures"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import tiny_models  # noqa: E402
from comfy_server import DEFAULT_TREE, ComfyServer, comfy_version  # noqa: E402
from disk_soak import slope_per_100  # noqa: E402
from workflows import latent_sha, sample_workflow  # noqa: E402

MODELS = ("soak_share_a.safetensors", "soak_share_b.safetensors")
LORA = "soak_share_lora.safetensors"
LAYERS, DIM, FFN = 4, 128, 512  # 4 blocks of 1.1 MB: a store or a copy kept per switch adds up in RSS
LAYERWISE = {"resident_blocks": 1, "prefetch": 1}
LORAS = (None, 1.0)  # server 0 runs without a LoRA, server 1 with one
HOOKS = (None, 0.7)  # a hook LoRA's strength on the positive, or none
# How a prompt runs the model: some blocks resident (a partial load of the engine), every block
# streamed, Model-Level Swap, both nodes, or core alone (on what the pack handed back).
MODES = ("resident_1", "streamed", "swap", "streamed_swap", "core")
FREE_EVERY = 5  # /free on the prompt's server before every 5th prompt
PER_MODE = 4  # prompts in a row in one mode: each server and model once
CYCLE = PER_MODE * len(MODES) * len(HOOKS)  # prompts before the pattern repeats
MIB = 1 << 20


def write_models(models: Path) -> None:
    """Two Wan models of one shape, a LoRA for them and a text encoder, where ComfyUI's loaders look."""
    unet = models / "diffusion_models"
    unet.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(MODELS, start=91):
        if not (unet / name).exists():
            tiny_models.write_tiny_wan21(unet / name, layers=LAYERS, dim=DIM, ffn_dim=FFN, seed=seed)
    lora = models / "loras" / LORA
    if not lora.exists():
        lora.parent.mkdir(parents=True, exist_ok=True)
        tiny_models.write_tiny_wan_lora(lora, model_layers=LAYERS, dim=DIM, ffn_dim=FFN, seed=93)
    clip = models / "text_encoders" / tiny_models.CLIP_L_FILENAME
    if not clip.exists():
        clip.parent.mkdir(parents=True, exist_ok=True)
        tiny_models.write_random_clip_l(clip)


def prepare_base(base: Path, models: Path, store_root: Path, **settings: Any) -> Path:
    """A server's base folder: its models are ``models`` (a link: every server reads the same
    files), and its settings file puts shared host stores below ``store_root``."""
    base.mkdir(parents=True, exist_ok=True)
    if not (base / "models").exists():
        (base / "models").symlink_to(models, target_is_directory=True)
    user = base / "user"
    user.mkdir(exist_ok=True)
    (user / "tiered_offload.json").write_text(json.dumps({"shared_memory_dir": str(store_root), **settings}))
    return base


def start_all(servers: list[ComfyServer]) -> list[ComfyServer]:
    """Start the servers side by side (each start is mostly waiting); stop them all if one fails."""
    errors: list[BaseException] = []

    def start(server: ComfyServer) -> None:
        try:
            server.start()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


def store_folder(store_root: Path) -> Path:
    return store_root / f"tiered-offload-{os.geteuid()}"


def store_files(store_root: Path) -> list[str]:
    folder = store_folder(store_root)
    return sorted(n for n in os.listdir(folder) if n.endswith((".store", ".part"))) if folder.is_dir() else []


def mapped_stores(pid: int, store_root: Path) -> dict[str, dict[str, int]]:
    """The store files a process maps, each with its RSS and PSS in bytes (/proc/PID/smaps)."""
    prefix = str(store_folder(store_root)) + os.sep
    out: dict[str, dict[str, int]] = {}
    name = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                path = line.split(maxsplit=5)[5].strip() if len(head) >= 6 else ""
                name = os.path.basename(path) if path.startswith(prefix) else None
                if name is not None:
                    out.setdefault(name, {"rss": 0, "pss": 0})
            elif name is not None and head[0] in ("Rss:", "Pss:"):
                out[name][head[0][:-1].lower()] += int(head[1]) * 1024
    return out


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def workflow(unet: str, lora: float | None, layerwise: bool, seed: int) -> dict:
    wf = sample_workflow("wan21", layerwise=dict(LAYERWISE) if layerwise else None, lora_strength=lora,
                         seed=seed, steps=2)
    wf["load"]["inputs"]["unet_name"] = unet
    if lora is not None:
        wf["lora"]["inputs"]["lora_name"] = LORA
    return wf


def varied_workflow(unet: str, lora: float | None, hook: float | None, mode: str, seed: int) -> dict:
    """``workflow`` run as ``mode`` says (``MODES``), with a hook LoRA of strength ``hook``."""
    layerwise = {"resident_1": LAYERWISE, "streamed": {"resident_blocks": 0, "prefetch": 1},
                 "streamed_swap": {"resident_blocks": 0, "prefetch": 1}}.get(mode)
    wf = workflow(unet, lora, False, seed)
    model = ["lora", 0] if lora is not None else ["load", 0]
    if layerwise is not None:
        wf["offload"] = {"class_type": "ApplyLayerwiseOffload", "inputs": {
            "model": model, "vram_budget_gb": 12.0, "pin": True, **layerwise}}
        model = ["offload", 0]
    if mode in ("swap", "streamed_swap"):
        wf["clip"] = {"class_type": "CLIPLoader", "inputs": {
            "clip_name": tiny_models.CLIP_L_FILENAME, "type": "stable_diffusion", "device": "default"}}
        wf["swap"] = {"class_type": "ModelLevelSwap", "inputs": {"model": model, "clip": ["clip", 0]}}
        wf["encode"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["swap", 1], "text": "a soak"}}
        wf["encode_stats"] = {"class_type": "TieredTestConditioningStats", "inputs": {"conditioning": ["encode", 0]}}
        model = ["swap", 0]
    wf["sample"]["inputs"]["model"] = model
    if hook is not None:
        wf["hook"] = {"class_type": "CreateHookLoraModelOnly", "inputs": {"lora_name": LORA, "strength_model": hook}}
        wf["pos_hooked"] = {"class_type": "ConditioningSetProperties", "inputs": {
            "cond_NEW": ["pos", 0], "strength": 1.0, "set_cond_area": "default", "hooks": ["hook", 0]}}
        wf["sample"]["inputs"]["positive"] = ["pos_hooked", 0]
    return wf


def plan(i: int) -> tuple[int, str, float | None, float | None, str]:
    """Prompt ``i``: its server, its model (each server switches every prompt it runs), its
    server's LoRA strength, its hook LoRA and its mode."""
    server = i % 2
    mode = MODES[(i // PER_MODE) % len(MODES)]
    hook = HOOKS[(i // (PER_MODE * len(MODES))) % len(HOOKS)]
    return server, MODELS[(i // 2) % 2], LORAS[server], hook, mode


def soak(servers: list[ComfyServer], store_root: Path, prompts: int, *, log=None) -> dict[str, Any]:
    """Run the prompts; return every sample and a summary (``summary``)."""
    refs: dict[tuple[str, float | None, float | None], str] = {}
    for model in MODELS:  # core's own results, before any store exists
        for lora in LORAS:
            for hook in HOOKS:
                refs[(model, lora, hook)] = latent_sha(servers[0].run(varied_workflow(model, lora, hook, "core", 5)))
    servers[0].free()
    samples: list[dict[str, Any]] = []
    for i in range(prompts):
        index, model, lora, hook, mode = plan(i)
        server = servers[index]
        if i and i % FREE_EVERY == 0:
            server.free()
        start = time.perf_counter()
        got = latent_sha(server.run(varied_workflow(model, lora, hook, mode, seed=5)))
        sample = {"prompt": i, "server": index, "model": model, "lora": lora, "hook": hook, "mode": mode,
                  "seconds": time.perf_counter() - start, "right": got == refs[(model, lora, hook)],
                  "store_files": len(store_files(store_root)),
                  "rss": [rss(s.proc.pid) for s in servers],
                  "mapped": [len(mapped_stores(s.proc.pid, store_root)) for s in servers]}
        samples.append(sample)
        if log is not None:
            log(sample)
    for server in servers:
        server.free()
    after = {"store_files": store_files(store_root),
             "mapped": [len(mapped_stores(s.proc.pid, store_root)) for s in servers]}
    return {"samples": samples, "summary": summarize(samples, after)}


def summarize(samples: list[dict[str, Any]], after: dict[str, Any]) -> dict[str, Any]:
    steady = samples[CYCLE:]
    out: dict[str, Any] = {"prompts": len(samples), "warmup": CYCLE, "wrong": [s["prompt"] for s in samples
                                                                                if not s["right"]],
                           "most_store_files": max((s["store_files"] for s in samples), default=0),
                           "most_mapped": max((m for s in samples for m in s["mapped"]), default=0),
                           "after_free": after}
    for k in range(len(samples[0]["rss"]) if samples else 0):
        values = [s["rss"][k] for s in steady]
        out[f"rss_server{k}"] = {
            "warmup_max": max((s["rss"][k] for s in samples[:CYCLE]), default=0),
            "first_cycle_max": max(values[:CYCLE], default=0), "last_cycle_max": max(values[-CYCLE:], default=0),
            "growth_per_100_prompts": slope_per_100([s["prompt"] for s in steady], values)}
    return out


def start_servers(root: Path, models: Path, store_root: Path, count: int = 2) -> list[ComfyServer]:
    write_models(models)
    store_root.mkdir(parents=True, exist_ok=True)
    return start_all([ComfyServer(prepare_base(root / f"server{k}", models, store_root)) for k in range(count)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--out", type=Path, default=TESTS / "artifacts" / "host_store_soak")
    args = ap.parse_args(argv)
    if not os.path.exists("/proc/self/smaps"):
        print("this soak reads /proc (Linux)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="host_store_soak_") as tmp:
        root = Path(tmp)
        servers = start_servers(root, root / "models", root / "stores")
        try:
            result = soak(servers, root / "stores", args.prompts, log=lambda s: print(json.dumps(s), flush=True))
        finally:
            for server in servers:
                server.stop()
        result["left_after_stop"] = store_files(root / "stores")
    result["comfyui"] = comfy_version() if not DEFAULT_TREE else f"{comfy_version()} (.comfyui)"
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({**result["summary"], "left_after_stop": result["left_after_stop"]}, indent=1))
    ok = not result["summary"]["wrong"] and not result["summary"]["after_free"]["store_files"] \
        and not result["left_after_stop"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
