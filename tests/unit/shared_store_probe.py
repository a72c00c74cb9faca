"""A process that streams a toy model from the shared host store, for the store's tests across real
processes (tests/unit/test_shared_store.py): run by the test's Python, never by ComfyUI.

    python shared_store_probe.py FOLDER [--disk FOLDER] [--seed N] [--source NAME] [--chunk BYTES]
                                        [--pause-at K] [--hold] [--wait-bound S] [--fork]

It builds ``toy_models.ToyDiT(seed)``, attaches a streamer that shares its host pack under the
key ``--source`` (folders: FOLDER as shared memory, then ``--disk``), runs the model and prints one
JSON line per event: ``{"event": "packing", "done": i}`` per block packed or mapped (``done`` 0
while it waits for another process that packs the same store; ``--pause-at K``: after the K-th
block it says ``{"event": "paused"}`` and waits for a line on stdin, so a test can kill it while
it packs), then ``{"event":
"ready", "out": <sha256 of the output's bytes>, "ref": <the same model's own output, before any
packing>, "store": <the streamer's host_store()>, "pid": ...}``. With ``--hold`` it keeps the pack
until a line arrives on stdin, then closes the streamer and prints ``{"event": "closed"}``.
``--wait-bound S``: a packer that writes nothing for S seconds is waited for no longer (the
store folder's ``LOCK_WAIT_S``). ``--fork`` (before ``--hold``): after "ready" it writes into the
first block's weights in place, says ``{"event": "weights", "sha": <sha256 of every parameter's
bytes>}``, forks without exec, and the child says ``{"event": "forked", "sha": <the same, as the
child reads them>, "pid": ...}``, then waits for a line on stdin and ends without exit handlers.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402

from offload_core.sharing import store_folder  # noqa: E402
from offload_core.sharing.shared_packing import HostShare  # noqa: E402
from offload_core.sharing.store_folder import DISK, SHARED_MEMORY, StoreFolder  # noqa: E402
from offload_core.layerwise.streamer import LayerwiseStreamer  # noqa: E402
from toy_models import ToyDiT, bits, inputs  # noqa: E402


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()


def memory_sha(model: torch.nn.Module) -> str:
    """The parameters' bytes read straight from memory (no torch op: safe in a forked child)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(ctypes.string_at(p.data_ptr(), p.numel() * p.element_size()))
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--disk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default="toy")
    ap.add_argument("--chunk", type=int, default=64 << 10)
    ap.add_argument("--pause-at", type=int, default=None)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--wait-bound", type=float, default=None)
    ap.add_argument("--fork", action="store_true")
    args = ap.parse_args()
    if args.wait_bound is not None:
        store_folder.LOCK_WAIT_S = args.wait_bound
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
    say(event="ready", out=out, kept=kept, ref=ref, store=streamer.host_store(), pid=os.getpid())
    if args.fork:
        with torch.no_grad():
            model.blocks[0].mlp_out.weight.add_(0.25)  # pages of this process's own, in the store's mapping
        say(event="weights", sha=memory_sha(model))
        if os.fork() == 0:
            say(event="forked", sha=memory_sha(model), pid=os.getpid())
            sys.stdin.readline()
            os._exit(0)
    if args.hold:
        sys.stdin.readline()
        streamer.close()
        say(event="closed")


if __name__ == "__main__":
    main()
