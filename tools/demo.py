"""`make demo`: a real ComfyUI with this pack, a generated demo model, one workflow through /prompt.

It serves on 127.0.0.1:8188 until Ctrl-C so the UI can be opened; DEMO_EXIT=1 (or --exit) stops
it right after the workflow, for scripts. The demo base directory is .demo/ in the repository.
The conditioning comes from the test suite's conditioning node: no real text encoder is small
enough to generate on the spot.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

import tiny_models  # noqa: E402
from comfy_server import ComfyServer  # noqa: E402
from workflows import latent_sha, sample_workflow  # noqa: E402

DEMO_LAYERS = 8


def build_workflow() -> dict:
    wf = sample_workflow("wan21", layerwise={"resident_blocks": 2, "prefetch": 2}, steps=8)
    wf["load"]["inputs"]["unet_name"] = "demo_wan21_8blocks.safetensors"
    wf["save"] = {"class_type": "SaveLatent",
                  "inputs": {"samples": ["sample", 0], "filename_prefix": "latents/tiered_offload_demo"}}
    return wf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exit", action="store_true", default=os.environ.get("DEMO_EXIT") == "1",
                    help="stop the server after the workflow (also DEMO_EXIT=1)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("DEMO_PORT", "8188")))
    args = ap.parse_args()

    base = REPO / ".demo"
    model = base / "models" / "diffusion_models" / "demo_wan21_8blocks.safetensors"
    if not model.exists():
        tiny_models.write_tiny_wan21(model, layers=DEMO_LAYERS, dim=256, ffn_dim=1024, seed=0)
        print(f"demo model written: {model} ({model.stat().st_size / 2**20:.1f} MiB, "
              f"{DEMO_LAYERS} blocks)")

    server = ComfyServer(base, port=args.port)
    print(f"starting ComfyUI on {server.url} (log: {server.log_path})")
    server.start()
    try:
        t0 = time.time()
        outputs = server.run(build_workflow())
        seconds = time.time() - t0
        print(f"demo workflow finished in {seconds:.2f} s; latent sha256 {latent_sha(outputs)}")
        for model_state in server.get("/offload/layerwise")["models"]:
            t = model_state["telemetry"] or {}
            print(f"layerwise offload: {model_state['model_class']} with {model_state['blocks']} blocks, "
                  f"resident {model_state['resident_indices']}, streamed {model_state['streamed_indices']}")
            print(f"  last run: streamed {t.get('bytes_copied', 0) / 1e6:.1f} MB in {t.get('copies', 0)} "
                  f"copies ({t.get('gbps', 0):.2f} GB/s over {t.get('seconds', 0):.2f} s), "
                  f"peak on the compute device {t.get('peak_materialized_bytes', 0) / 1e6:.1f} MB "
                  f"(bound {model_state['bound_bytes'] / 1e6:.1f} MB), "
                  f"{t.get('sync_fallbacks', 0)} synchronous fallbacks")
            print("  full telemetry: " + json.dumps(t, sort_keys=True))
        print(f"saved latent under {base / 'output' / 'latents'}")
        print(f"ComfyUI UI is served at {server.url}/")
        if args.exit:
            return 0
        print("serving until Ctrl-C")
        while server.alive():
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
