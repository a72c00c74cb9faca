"""Probe of Apply Layerwise Offload's Dynamic-VRAM branch against the ComfyUI tree under test.

Run by test_dynamic_vram_compat.py as `PYTHON dynamic_vram_probe.py OUT_DIR` with the ComfyUI
root as the working directory (the Python and tree the server tests use, so a newer release can
be checked with TIERED_OFFLOAD_COMFY_ROOT / TIERED_OFFLOAD_COMFY_PYTHON). Prints one JSON object.

A real ModelPatcherDynamic cannot be built without a GPU: its `__new__` hands a CPU load device
to the classic ModelPatcher, and its `__init__` allocates comfy-aimdo host buffers, whose native
library loads only with CUDA or ROCm. So the dynamic case uses a stand-in: a subclass of the real
ModelPatcher that says it is dynamic and carries ModelPatcherDynamic's own
`get_non_dynamic_delegate` function. `clone(disable_dynamic=...)` and the delegate then run
ComfyUI's real code against a model from ComfyUI's real loader (`comfy.sd.load_diffusion_model`,
which registers `cached_patcher_init`). What the stand-in does not cover is said in "covers".
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

OUT_DIR = Path(sys.argv[1])
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI parses the command line when comfy.cli_args loads
sys.path.insert(0, str(Path.cwd()))
sys.path.insert(0, str(TESTS / "fixtures"))

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402

import comfy.model_patcher  # noqa: E402
import comfy.sd  # noqa: E402
import tiny_models  # noqa: E402


def import_layerwise():
    """nodes/layerwise.py as a package module, without running the pack's server wiring."""
    for name, path in (("tiered_offload_probe", REPO), ("tiered_offload_probe.nodes", REPO / "nodes")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    return importlib.import_module("tiered_offload_probe.nodes.layerwise")


def state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def main() -> None:
    path = OUT_DIR / "probe_wan21.safetensors"
    tiny_models.write_tiny_wan21(path, seed=11)
    layerwise = import_layerwise()
    MP = comfy.model_patcher.ModelPatcher
    report: dict = {"clone_params": list(inspect.signature(MP.clone).parameters)[1:]}

    # Classic model (0.3.75, or newer with Dynamic VRAM off, or any CPU load device).
    classic = comfy.sd.load_diffusion_model(str(path))
    got = layerwise._classic_patcher(classic)
    report["classic"] = {
        "input_dynamic": layerwise._is_dynamic(classic),
        "is_clone": got is not None and got is not classic,
        "shares_module": got is not None and got.model is classic.model,
        "output_dynamic": got is not None and layerwise._is_dynamic(got),
    }

    MPD = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if MPD is None or not hasattr(MPD, "get_non_dynamic_delegate"):
        report["dynamic"] = None
        print(json.dumps(report))
        return
    report["delegate_params"] = list(inspect.signature(MPD.get_non_dynamic_delegate).parameters)[1:]
    report["cached_patcher_init"] = getattr(classic, "cached_patcher_init", None) is not None

    class DynamicStandIn(MP):
        """The real ModelPatcher, reporting itself dynamic, with the real delegate method."""
        is_dynamic = MPD.is_dynamic
        get_non_dynamic_delegate = MPD.get_non_dynamic_delegate

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.non_dynamic_delegate_model = None  # as ModelPatcherDynamic.__init__ sets it

    def dynamic_from(source, with_init: bool):
        dyn = DynamicStandIn(source.model, source.load_device, source.offload_device,
                             source.model_size())
        if with_init:
            dyn.cached_patcher_init = source.cached_patcher_init
        key = next(k for k in source.model.state_dict() if k.startswith("diffusion_model.blocks.0.")
                   and k.endswith(".weight") and source.model.state_dict()[k].ndim == 2)
        dyn.add_patches({key: (torch.zeros_like(source.model.state_dict()[key]),)}, 0.5)
        return dyn

    dyn = dynamic_from(classic, with_init=True)
    first = layerwise._classic_patcher(dyn)
    second = layerwise._classic_patcher(dyn)
    report["dynamic"] = {
        "input_dynamic": layerwise._is_dynamic(dyn),
        "got_patcher": first is not None,
        "output_type": type(first).__name__ if first is not None else None,
        "output_dynamic": first is not None and layerwise._is_dynamic(first),
        "new_module": first is not None and first.model is not dyn.model,
        "same_weights": first is not None and state_equal(first.model, dyn.model),
        "patches_kept": first is not None and first.patches.keys() == dyn.patches.keys()
                        and first.patches_uuid == dyn.patches_uuid,
        "rerun_reuses_module": second is not None and first is not None
                               and second is not first and second.model is first.model,
        "no_loader_steps_aside": layerwise._classic_patcher(dynamic_from(classic, with_init=False)) is None,
    }
    report["covers"] = ("ModelPatcher.clone(disable_dynamic=True) and "
                        "ModelPatcherDynamic.get_non_dynamic_delegate as shipped, on a stand-in "
                        "patcher; not ModelPatcherDynamic.__init__/load (aimdo, GPU only)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
