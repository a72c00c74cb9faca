"""Probe of nodes/core/pins.py against the ComfyUI tree under test (run by test_core_pins.py).

Run as `PYTHON core_pins_probe.py` with the ComfyUI root as the working directory; prints one
JSON object. ComfyUI's real `comfy.model_management` is imported (with --cpu), the adapter is
installed into it, and the engine's side is driven through offload_core.host.pinned.

What a CPU cannot do is pin: core's cap is -1 here, and neither core's `pin_memory` nor a
HostStorage registers anything without CUDA. So the probe sets core's cap and own count to what
a CUDA machine would have, and stands in for the engine's registrations with the bookkeeping
call a registration makes (`pinned._count_pinned`); 0.3.75's reset of its count when its last
own pin goes is written the way its `unpin_memory` writes it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 1 << 30

sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI parses the command line when comfy.cli_args loads
sys.path.insert(0, str(Path.cwd()))

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import comfy.model_management as mm  # noqa: E402
from tree_probe import import_pack_module  # noqa: E402


def main() -> None:
    core_pins = import_pack_module("nodes.core.pins")
    pinned = import_pack_module("offload_core.host.pinned")
    out: dict = {"core_cap_on_cpu": mm.MAX_PINNED_MEMORY, "own_cap": pinned.pin_cap()}
    discarded: list[bool] = []
    out["core_has_discard"] = hasattr(mm, "discard_cuda_async_error")
    if out["core_has_discard"]:  # core's function, counted (its body needs a GPU)
        mm.discard_cuda_async_error = lambda: discarded.append(True)
    out["installed"] = core_pins.install()
    if out["core_has_discard"]:
        out["discards_after_failed_registration"] = failed_registration(pinned, discarded)
    out["cap_while_core_pins_nothing"] = pinned.pin_cap()

    mm.MAX_PINNED_MEMORY = 8 * GIB  # a CUDA machine's cap, with 1 GiB pinned by core itself
    mm.TOTAL_PINNED_MEMORY = 1 * GIB
    out["cap"] = pinned.pin_cap()
    pinned._count_pinned(2 * GIB)  # the engine registers a 2 GiB chunk
    out["core_count_after_engine_pin"] = mm.TOTAL_PINNED_MEMORY
    out["cap_after_engine_pin"] = pinned.pin_cap()
    mm.TOTAL_PINNED_MEMORY = 0  # what 0.3.75 writes when core unpins its own last tensor
    out["cap_after_core_reset"] = pinned.pin_cap()
    out["core_count_after_core_reset"] = mm.TOTAL_PINNED_MEMORY
    pinned._count_pinned(-2 * GIB)  # the engine releases its chunk
    out["core_count_after_engine_unpin"] = mm.TOTAL_PINNED_MEMORY
    print(json.dumps(out))


def failed_registration(pinned, discarded: list[bool]) -> int:
    """A registration CUDA refuses (as torch exposes its runtime, faked: a CPU has none); how many
    times core's discard_cuda_async_error ran for it."""
    import torch

    class Refusing:
        def cudaHostRegister(self, ptr, size, flags):
            return 712  # cudaErrorHostMemoryAlreadyRegistered

    available, cudart = torch.cuda.is_available, torch.cuda.cudart
    torch.cuda.is_available, torch.cuda.cudart = (lambda: True), (lambda: Refusing())
    try:
        storage = pinned.HostStorage([1 << 16], pin=True)
        storage.buffer(0)
        assert not storage.is_pinned(0)
        storage.release()
    finally:
        torch.cuda.is_available, torch.cuda.cudart = available, cudart
    return len(discarded)


if __name__ == "__main__":
    main()
