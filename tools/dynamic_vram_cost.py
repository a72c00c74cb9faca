"""What Apply Layerwise Offload costs on a Dynamic VRAM model, measured on CPU: RSS and seconds.

Run with ComfyUI 0.33's Python from its tree (the figures in the README came from this):

    cd .comfyui-033 && OMP_NUM_THREADS=2 ../.venv-033/bin/python ../tools/dynamic_vram_cost.py \
        --pack .. --out ../tests/artifacts/dynamic_vram_cost.json

`--pack` names the pack checkout whose nodes/ is measured, so an older commit (unpacked with
`git archive`) gives the "before" figures. The model is a mid-size Wan 2.1 written on the spot
(dim 1024, 16 blocks, bf16 by default). On CPU core cannot build a real ModelPatcherDynamic, so
the dynamic model is tests/dynamic_vram_standin.py's stand-in over core's real loader, and what
is measured is the node's own cost: the classic copy (core's reload with Dynamic VRAM off) and
whatever it keeps. RSS is read after gc and malloc_trim, so freed memory does not count.
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pack", type=Path, default=HERE.parent, help="pack checkout to measure")
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--model", type=Path, help="model file (written if absent)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn-dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    return p.parse_args(argv)


def boot_comfy() -> None:
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path.insert(0, str(Path.cwd()))
    import comfy.options
    comfy.options.enable_args_parsing()


def import_nodes(pack: Path):
    """`pack`/nodes/layerwise.py as a package module, without the pack's server wiring."""
    for name, path in (("tiered_offload_cost", pack), ("tiered_offload_cost.nodes", pack / "nodes")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    return importlib.import_module("tiered_offload_cost.nodes.layerwise")


def rss() -> int:
    import psutil
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    boot_comfy()
    sys.path.insert(0, str(TESTS))
    sys.path.insert(0, str(TESTS / "fixtures"))
    import torch
    import comfy.sd
    import dynamic_vram_standin as standin
    import tiny_models

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model_path = args.model or args.out.with_suffix(".safetensors")
    if not model_path.exists():
        model_path.parent.mkdir(parents=True, exist_ok=True)
        tiny_models.write_tiny_wan21(model_path, layers=args.layers, dim=args.dim,
                                     ffn_dim=args.ffn_dim, dtype=dtype)
    layerwise = import_nodes(args.pack.resolve())
    node = layerwise.ApplyLayerwiseOffload()
    has_mode = "mode" in inspect.signature(node.apply).parameters
    settings = {"resident_blocks": args.layers // 4, "vram_budget_gb": 12.0, "prefetch": 2, "pin": True}
    impossible = dict(settings, resident_blocks=-1, vram_budget_gb=1e-6)

    steps: list[dict] = []
    keep: list = []  # what a ComfyUI cache would hold: every node output stays alive

    def step(name: str, model, mode: str | None, step_settings: dict) -> None:
        kwargs = dict(step_settings, **({"mode": mode} if has_mode and mode else {}))
        before = rss()
        start = time.perf_counter()
        error = None
        try:
            keep.append(node.apply(model, **kwargs)[0])
        except Exception as e:  # noqa: BLE001 - a refusal is one of the measured outcomes
            error = f"{type(e).__name__}: {str(e)[:120]}"
        seconds = time.perf_counter() - start
        out = {"step": name, "mode": kwargs.get("mode", "engine (no mode input)"), "seconds": seconds,
               "rss_delta_bytes": rss() - before, "error": error}
        steps.append(out)
        print(f"{name:28s} {out['mode']:24s} {seconds:7.2f} s  {out['rss_delta_bytes'] / GIB:+7.2f} GiB"
              f"  {error or ''}", flush=True)

    start_rss = rss()
    source = comfy.sd.load_diffusion_model(str(model_path))
    dyn = standin.dynamic_from(source)
    keep.append(dyn)
    model_bytes = dyn.model_size()
    loaded_rss = rss()
    print(f"model {model_bytes / GIB:.2f} GiB, loaded: RSS {loaded_rss / GIB:.2f} GiB "
          f"(+{(loaded_rss - start_rss) / GIB:.2f} GiB)", flush=True)
    if has_mode:
        step("auto", dyn, "auto", settings)
    step("engine, first", dyn, "engine", settings)
    lora = standin.with_lora(dyn, 0.5)
    keep.append(lora)
    step("engine, LoRA change", lora, "engine", settings)
    lora2 = standin.with_lora(dyn, 0.8)
    keep.append(lora2)
    step("engine, refused settings", lora2, "engine", impossible)
    result = {"pack": str(args.pack.resolve()), "torch": torch.__version__, "model_file": str(model_path),
              "model_bytes": model_bytes, "layers": args.layers, "dim": args.dim, "dtype": args.dtype,
              "rss_after_load_bytes": loaded_rss, "final_rss_bytes": rss(), "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
