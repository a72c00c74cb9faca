"""A process that streams a toy model from the shared host store, for the store's tests across real
processes (tests/unit/test_shared_store.py): run by the test's Python, never by ComfyUI.

    python shared_store_probe.py FOLDER [--disk FOLDER] [--seed N] [--source NAME] [--chunk BYTES]
                                        [--pause-at K] [--hold]

It builds ``toy_models.ToyDiT(seed)``, attaches a streamer that shares its host pack under the
key ``--source`` (folders: FOLDER as shared memory, then ``--disk``), runs the model and prints one
JSON line per event: ``{"event": "packing", "done": i}`` per block packed or mapped (``done`` 0
while it waits for another process that packs the same store; ``--pause-at K``: after the K-th
block it says ``{"event": "paused"}`` and waits for a line on stdin, so a test can kill it while
it packs), then ``{"event":
"ready", "out": <sha256 of the output's bytes>, "ref": <the same model's own output, before any
packing>, "store": <the streamer's host_store()>, "pid": ...}``. With ``--hold`` it keeps the pack
until a line arrives on stdin, then closes the streamer and prints ``{"event": "closed"}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402

from offload_core.host.shared_packing import HostShare  # noqa: E402
from offload_core.host.store_folder import DISK, SHARED_MEMORY, StoreFolder  # noqa: E402
from offload_core.layerwise.streamer import LayerwiseStreamer  # noqa: E402
from toy_models import ToyDiT, bits, inputs  # noqa: E402


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--disk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default="toy")
    ap.add_argument("--chunk", type=int, default=64 << 10)
    ap.add_argument("--pause-at", type=int, default=None)
    ap.add_argument("--hold", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ToyDiT(depth=6, dim=64, seed=args.seed)
    x, t = inputs()
    with torch.no_grad():
        ref = sha(model(x, t))
    folders = [StoreFolder(args.folder, SHARED_MEMORY)] + ([StoreFolder(args.disk, DISK)] if args.disk else [])
    streamer = LayerwiseStreamer(list(model.blocks), "cpu", resident=1, host_chunk_bytes=args.chunk,
                                 share=HostShare({"file": args.source}, tuple(folders)))

    def progress(done: int, total: int) -> None:
        say(event="packing", done=done, total=total)
        if done and done == args.pause_at:
            say(event="paused")
            sys.stdin.readline()

    streamer.attach(progress=progress)
    with torch.no_grad():
        out = sha(model(x, t))
    streamer.detach(keep_pack=True)
    with torch.no_grad():
        kept = sha(model(x, t))  # computing straight from the store's read-only bytes
    say(event="ready", out=out, kept=kept, ref=ref, store=streamer.host_store(), pid=__import__("os").getpid())
    if args.hold:
        sys.stdin.readline()
        streamer.close()
        say(event="closed")


if __name__ == "__main__":
    main()
