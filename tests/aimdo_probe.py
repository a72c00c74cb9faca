"""Probe: the pack's calls into comfy-aimdo, against the comfy-aimdo this Python imports.

Run by tests/test_aimdo_versions.py in the tree under test (`run_tree_script`), once with the
comfy-aimdo ComfyUI 0.33 pins and once with comfy-aimdo 0.6 ahead of it on PYTHONPATH. The pack
calls comfy-aimdo itself in `vbar_layout`: `vbar_unpin` (the reset that hands a model's layout
back to core) and a VBAR's `get_residency` (which blocks are resident).

comfy-aimdo's native library loads only with CUDA or ROCm, so its `lib` is None here. The
probe puts a stand-in for that library under comfy-aimdo's own Python wrappers (its real
`ModelVBAR.alloc`, `unpin`, `get_residency`, `vbar_unpin`), answering as the native calls
would: a slice's hand-back succeeds, or fails from a given slice on (a fault injected at the
native boundary), and pages are resident as a given map says. What needs a device (faults,
eviction, the page-out callback of 0.6's ModelVBAR being called) is not shown here.
"""
from __future__ import annotations

import inspect
import json

import tree_probe

OUT = tree_probe.start()
import torch  # noqa: E402

CPU0 = torch.device("cpu", 0)
SLICE_BYTES = 20 << 20


class NativeStandIn:
    """comfy-aimdo's native library as far as its wrappers call it for the pack: `vbar_unpin`
    answers true (done) until ``fail_from`` slices were handed back, then false; residency
    comes from ``pages``."""

    def __init__(self, fail_from: int | None = None, pages: list[int] | None = None) -> None:
        self.fail_from = fail_from
        self.pages = pages or []
        self.unpins = 0

    def vbar_unpin(self, *args) -> bool:
        self.unpins += 1
        return self.fail_from is None or self.unpins <= self.fail_from

    def vbar_get_nr_pages(self, *args) -> int:
        return len(self.pages)

    def vbar_get_residency(self, devctx, vbar, buf, count) -> None:
        for i in range(count):
            buf[i] = self.pages[i]


def vbar_without_device(model_vbar, size: int):
    """comfy-aimdo's own ModelVBAR object, without the native allocation its __init__ makes."""
    vbar = model_vbar.ModelVBAR.__new__(model_vbar.ModelVBAR)
    vbar._devctx, vbar._ptr, vbar.device = None, None, 0
    vbar.base_addr, vbar.offset, vbar.max_size = 1 << 40, 0, size
    return vbar


def laid_out_model(model_vbar, blocks: int = 4):
    """Blocks of two linear layers that got VBAR slices in block order, as core's dynamic load
    gives them (`_v` from the VBAR's own `alloc`, and a residency signature). Each slice is
    20 MiB, as a large layer's would be (the layers themselves are small: nothing is copied into
    the slices here), so the blocks straddle comfy-aimdo's 32 MiB pages."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
                                  for _ in range(blocks)])
    vbar = vbar_without_device(model_vbar, 1 << 34)
    model.dynamic_vbars = {CPU0: vbar}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module._v = vbar.alloc(SLICE_BYTES)
            module._v_signature = object()
    return model


def slices_left(model) -> int:
    return sum("_v" in m.__dict__ or "_v_signature" in m.__dict__ for m in model.modules())


def reset_case(vbar_layout, model_vbar, native: NativeStandIn) -> dict:
    model = laid_out_model(model_vbar)
    slices = slices_left(model)
    model_vbar.lib = native
    reason = vbar_layout.reset(model, CPU0)
    return {"slices": slices, "reason": reason, "unpin_calls": native.unpins,
            "slices_left": slices_left(model), "vbar_kept": CPU0 in model.dynamic_vbars}


def main() -> None:
    try:
        import comfy_aimdo._version
        import comfy_aimdo.model_vbar as model_vbar
    except ImportError:
        OUT.write_text(json.dumps({"version": None}))
        return
    vbar_layout = tree_probe.import_pack_module("nodes.layerwise.vbar_layout")
    native_lib = model_vbar.lib
    try:
        cases = {"unpin_succeeds": reset_case(vbar_layout, model_vbar, NativeStandIn()),
                 "unpin_fails_at_the_third_slice": reset_case(vbar_layout, model_vbar,
                                                              NativeStandIn(fail_from=2))}
        # Blocks of 40 MiB from the VBAR's start, pages of 32 MiB: pages 0 and 1 resident hold
        # block 0 whole and block 1 in part; blocks 2 and 3 lie in pages 2 to 4.
        model = laid_out_model(model_vbar)
        model_vbar.lib = NativeStandIn(pages=[1, 1, 0, 0, 0, 0])
        residency = vbar_layout.residency(model, CPU0, vbar_layout.read(model, CPU0, list(model)))
    finally:
        model_vbar.lib = native_lib
    OUT.write_text(json.dumps({
        "version": comfy_aimdo._version.__version__,
        "module_file": model_vbar.__file__,
        "vbar_init": list(inspect.signature(model_vbar.ModelVBAR.__init__).parameters),
        "cases": cases,
        "residency": residency,
    }))


if __name__ == "__main__":
    main()
