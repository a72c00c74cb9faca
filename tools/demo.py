"""`make demo`: a real ComfyUI with this pack, the demo models written on the spot, the demo
workflow through /prompt, and the way to open it in the UI.

The server is a user's: core's nodes and the pack's, none of the test suite's. It serves on
127.0.0.1:8188 until Ctrl-C; --port (or DEMO_PORT) picks another port, for a machine that already
runs a ComfyUI on 8188: `make demo DEMO_ARGS="--port 8189"`. A port in use is refused before
anything starts (the demo must never queue its workflow on someone else's server). DEMO_EXIT=1
(or --exit) stops it right after the workflow, for scripts. The demo base directory is .demo/ in
the repository. The workflow is the one the pack ships in example_workflows/
(tools/example_workflows.py builds both).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tools"), str(REPO / "tests")]
if TYPE_CHECKING:
    from comfy_server import ComfyServer

MiB = 2**20


def latent_sha256(path: Path) -> str:
    """sha256 of the saved latent tensor's bytes: equal hashes mean bit-identical results."""
    import torch
    from safetensors.torch import load_file

    tensor = load_file(str(path))["latent_tensor"].contiguous()
    return hashlib.sha256(tensor.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def print_layerwise(server: ComfyServer) -> None:
    for state in server.get("/offload/layerwise")["models"]:
        t = state["telemetry"] or {}
        seconds = t.get("seconds", 0)
        rate = t.get("bytes_copied", 0) / seconds / MiB if seconds else 0.0
        print(f"Apply Layerwise Offload: {state['model_class']} with {state['blocks']} blocks, "
              f"resident {state['resident_indices']}, streamed {state['streamed_indices']}")
        print(f"  last run: streamed {t.get('bytes_copied', 0) / MiB:.1f} MiB in {t.get('copies', 0)} "
              f"copies ({rate:.1f} MiB/s over {seconds:.2f} s), at most "
              f"{t.get('peak_materialized_bytes', 0) / MiB:.1f} MiB of blocks on {state['device']} "
              f"(bound {state['bound_bytes'] / MiB:.1f} MiB), "
              f"{t.get('sync_fallbacks', 0)} synchronous fallbacks")
        if state.get("tuning"):
            print(f"  auto settings: {state['tuning']['reason']}")


def print_loaded(server: ComfyServer) -> None:
    for card in server.get("/offload/tiers")["loaded"]:
        b = card["bytes"] or {}
        what = [w for w, on in (("streamed", card["layerwise"]), ("swapped", card["swap"]),
                                ("tier-managed", card["tier_id"])) if on]
        print(f"loaded: {card['class']} ({card['kind']}, {card['file'] or 'file not recorded by this ComfyUI'}) "
              f"{b.get('total', 0) / MiB:.1f} MiB on {card['device']}"
              + (f", {', '.join(what)}" if what else ""))


def port_in_use(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:`port` (or it cannot be bound). Bound as
    the server binds (SO_REUSEADDR), so a port left in TIME_WAIT by an earlier demo counts free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _stop_demo(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exit", action="store_true", default=os.environ.get("DEMO_EXIT") == "1",
                    help="stop the server after the workflow (also DEMO_EXIT=1)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("DEMO_PORT", "8188")),
                    help="the port to serve on (default 8188; also DEMO_PORT)")
    ap.add_argument("--base", type=Path, default=REPO / ".demo", help="ComfyUI base directory")
    args = ap.parse_args()
    if port_in_use(args.port):
        print(f"port {args.port} is in use on 127.0.0.1 (a ComfyUI already running?): run the demo "
              f"on another port, e.g. make demo DEMO_ARGS=\"--port {args.port + 1}\"",
              file=sys.stderr)
        return 2
    # Imported once the port is known free: they load torch, which takes seconds.
    import example_workflows
    from comfy_server import PACK_LINK_NAME, ComfyServer

    base = args.base.resolve()
    for path in example_workflows.write_models(base):
        print(f"demo model written: {path} ({path.stat().st_size / MiB:.1f} MiB)")

    server = ComfyServer(base, port=args.port, test_nodes=False, dies_with_caller=True)
    # A terminal closed (SIGHUP) or a kill (SIGTERM) ends the demo as Ctrl-C does: the server stops
    # with it (and a kill -9 of the demo stops the server too: dies_with_caller).
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _stop_demo)
    print(f"starting ComfyUI on {server.url} (log: {server.log_path})")
    server.start()
    try:
        failed = [line for line in server.log_text().splitlines() if "IMPORT FAILED" in line]
        for line in failed:
            print(f"warning: ComfyUI could not import a module: {line.strip()}")
        # The panel's picture of the run is recorded only while a panel asks for it; the user opens
        # the panel after this run, and ComfyUI would not run the unchanged workflow again: record
        # this one, so its picture is there when the panel opens.
        server.post("/offload/timeline", {"enabled": True})
        t0 = time.time()
        outputs = server.run(example_workflows.demo())
        latent = outputs["7"]["latents"][0]
        path = base / "output" / latent["subfolder"] / latent["filename"]
        print(f"demo workflow finished in {time.time() - t0:.2f} s; latent {path}, "
              f"sha256 {latent_sha256(path)}")
        print_layerwise(server)
        print_loaded(server)
        for picture in server.get("/offload/timeline")["timelines"]:
            print(f"picture of the run recorded for {picture['model_class']}: {len(picture['units'])} "
                  f"streamed units, a pass of {picture['pass_ms']:.1f} ms; the Offload panel shows it")
        print(f"The demo runs the node's defaults; to see blocks streamed on any machine, open the "
              f"example '{example_workflows.LAYERWISE}'.")
        print(f"\nComfyUI is served at {server.url}/ . To open the demo workflow there: "
              f"the Templates button in the left sidebar (or Browse Templates in the ComfyUI logo "
              f"menu), then '{PACK_LINK_NAME}' in the list on the left, then '{example_workflows.DEMO}'. The Offload tab in the left sidebar (the "
              f"server icon) lists the models this run loaded.")
        if args.exit:
            return 0
        print("serving until Ctrl-C")
        while server.alive():
            time.sleep(1)
        code = server.proc.returncode if server.proc is not None else None
        print(f"ComfyUI stopped on its own (exit code {code}); the end of its log, "
              f"{server.log_path}:\n{server.log_tail(20)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ComfyUI")
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
