"""What Apply Layerwise Offload costs on a Dynamic VRAM model, measured on CPU: RAM and seconds.

Run with ComfyUI 0.33's Python from its tree (the figures in docs/dynamic-vram.md came from this):

    cd .comfyui-033 && OMP_NUM_THREADS=2 ../.venv-033/bin/python ../tools/dynamic_vram_cost.py \
        --pack .. --out ../tests/artifacts/dynamic_vram_cost.json

`--pack` names the pack checkout whose nodes/ is measured, so an older commit (unpacked with
`git archive`) gives the "before" figures. The model is a Wan 2.1 written on the spot (fp32, the
dtype core loads on CPU, so that its weights can be the file's own bytes). On CPU core cannot
build a real ModelPatcherDynamic, so the dynamic model is tests/dynamic_vram_standin.py's
stand-in over core's real loader, with its weights pointed at a read-only memory map of the file
as core's Dynamic VRAM loader does: RSS then splits as on a GPU machine, into the file's pages
(`RssFile`, the dynamic model's own host weights) and anonymous memory (`RssAnon`, every copy).
Steps: the node's `apply` in each mode, then one sampling run of the engine's output (core's
own sampler: the engine packs the blocks there). RSS is read after gc and malloc_trim, so freed
memory does not count; a run's peak is VmHWM, reset before it.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import inspect
import json
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
GIB = 1 << 30
MIB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pack", type=Path, default=HERE.parent, help="pack checkout to measure")
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--model", type=Path, help="model file (written if absent)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn-dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    return p.parse_args(argv)


def boot_comfy() -> None:
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path.insert(0, str(Path.cwd()))
    import comfy.options
    comfy.options.enable_args_parsing()


def import_nodes(pack: Path):
    """`pack`'s Apply Layerwise Offload module as a package module, without the pack's server
    wiring: nodes/layerwise/node.py, or nodes/layerwise.py in a checkout from before nodes/ had
    rooms (the "before" figures of an older commit)."""
    for name, path in (("tiered_offload_cost", pack), ("tiered_offload_cost.nodes", pack / "nodes")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    node = "layerwise.node" if (pack / "nodes" / "layerwise" / "node.py").exists() else "layerwise"
    return importlib.import_module(f"tiered_offload_cost.nodes.{node}")


def memory() -> dict[str, int]:
    """Anonymous and file-backed resident bytes, after gc and malloc_trim."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return {"anon": fields["RssAnon"], "file": fields["RssFile"], "peak": fields["VmHWM"]}


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def sample(model):
    """Two steps of core's own sampler on a small latent (as KSampler calls it)."""
    import torch
    import comfy.sample
    latent = torch.zeros(1, 16, 1, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 42)
    cond = [[torch.randn(1, 8, 4096, generator=torch.Generator().manual_seed(1)), {}]]
    return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", cond, cond, latent,
                               disable_pbar=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    boot_comfy()
    sys.path.insert(0, str(TESTS))
    sys.path.insert(0, str(TESTS / "fixtures"))
    import torch
    import comfy.model_management
    import comfy.sd
    import dynamic_vram_standin as standin
    import tiny_models

    model_path = args.model or args.out.with_suffix(".safetensors")
    if not model_path.exists():
        model_path.parent.mkdir(parents=True, exist_ok=True)
        tiny_models.write_tiny_wan21(model_path, layers=args.layers, dim=args.dim,
                                     ffn_dim=args.ffn_dim, dtype=torch.float32)
    layerwise = import_nodes(args.pack.resolve())
    node = layerwise.ApplyLayerwiseOffload
    # A V3 node (the classmethod execute), or an older checkout's V1 node (apply on an instance).
    apply = node.execute if hasattr(node, "define_schema") else node().apply
    has_mode = "mode" in inspect.signature(apply).parameters
    settings = {"resident_blocks": args.layers // 4, "vram_budget_gb": 12.0, "prefetch": 2, "pin": True}
    impossible = dict(settings, resident_blocks=-1, vram_budget_gb=1e-6)

    steps: list[dict] = []
    keep: list = []  # what a ComfyUI cache would hold: every node output stays alive

    def record(name: str, mode: str, before: dict, seconds: float, error: str | None,
               peak: int | None = None) -> None:
        after = memory()
        out = {"step": name, "mode": mode, "seconds": seconds, "error": error,
               "anon_delta_bytes": after["anon"] - before["anon"],
               "file_delta_bytes": after["file"] - before["file"], "peak_rss_bytes": peak}
        steps.append(out)
        print(f"{name:28s} {mode:8s} {seconds:7.2f} s  anon {out['anon_delta_bytes'] / MIB:+8.1f} MiB"
              f"  file {out['file_delta_bytes'] / MIB:+8.1f} MiB  {error or ''}", flush=True)

    def step(name: str, model, mode: str | None, step_settings: dict) -> None:
        kwargs = dict(step_settings, **({"mode": mode} if has_mode and mode else {}))
        before = memory()
        start = time.perf_counter()
        error = None
        try:
            keep.append(apply(model, **kwargs)[0])
        except Exception as e:  # noqa: BLE001 - a refusal is one of the measured outcomes
            error = f"{type(e).__name__}: {str(e)[:120]}"
        record(name, kwargs.get("mode", "engine"), before, time.perf_counter() - start, error)

    start_mem = memory()
    source = comfy.sd.load_diffusion_model(str(model_path))
    dyn = standin.runnable(source)
    mapped = standin.map_weights(dyn, model_path)
    del source
    keep.append(dyn)
    model_bytes = dyn.model_size()
    sample(dyn)  # core alone first, as a user would have: the mapping's pages are read
    loaded = memory()
    print(f"model {model_bytes / GIB:.2f} GiB ({mapped / GIB:.2f} GiB mapped from the file), "
          f"sampled once by core: anon {(loaded['anon'] - start_mem['anon']) / MIB:+.1f} MiB, "
          f"file {(loaded['file'] - start_mem['file']) / MIB:+.1f} MiB", flush=True)
    if has_mode:
        step("auto", dyn, "auto", settings)
    step("engine, first", dyn, "engine", settings)
    before = memory()
    reset_peak()
    start = time.perf_counter()
    error = None
    try:
        sample(keep[-1])
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {str(e)[:120]}"
    record("engine, first run", "engine", before, time.perf_counter() - start, error,
           memory()["peak"])
    lora = standin.with_lora(dyn, 0.5)
    keep.append(lora)
    step("engine, LoRA change", lora, "engine", settings)
    lora2 = standin.with_lora(dyn, 0.8)
    keep.append(lora2)
    step("engine, refused settings", lora2, "engine", impossible)
    end = memory()
    blocks = list(dyn.model.diffusion_model.blocks)
    block_bytes = sum(comfy.model_management.module_size(b) for b in blocks)
    result = {"pack": str(args.pack.resolve()), "torch": torch.__version__, "model_file": str(model_path),
              "model_bytes": model_bytes, "block_bytes": block_bytes, "mapped_bytes": mapped,
              "layers": args.layers, "dim": args.dim,
              "after_core_run": {"anon_bytes": loaded["anon"] - start_mem["anon"],
                                 "file_bytes": loaded["file"] - start_mem["file"]},
              "total_after": {"anon_bytes": end["anon"] - start_mem["anon"],
                              "file_bytes": end["file"] - start_mem["file"]},
              "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
