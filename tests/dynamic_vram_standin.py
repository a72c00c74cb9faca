"""ComfyUI's Dynamic VRAM patcher on CPU, as far as it can run there. Imported inside ComfyUI's
own Python (tests/dynamic_vram_probe.py, tools/dynamic_vram_cost.py), after ComfyUI parsed
`--cpu`.

A real ModelPatcherDynamic cannot be built without a GPU: its `__new__` hands a CPU load device
to the classic ModelPatcher, and its `__init__` allocates comfy-aimdo host buffers, whose native
library loads only with CUDA or ROCm. So `DynamicStandIn` is the real ModelPatcher carrying
ModelPatcherDynamic's own methods (`is_dynamic`, `get_non_dynamic_delegate`, `load` and what
`load` calls), and `VBARStandIn` is comfy-aimdo's ModelVBAR with its real address arithmetic
(`alloc`) but no device memory behind it. What they cannot show (faults, eviction, pins) needs
CUDA: tests/test_dynamic_vram_gpu.py.
"""
from __future__ import annotations

import torch

import comfy.model_patcher
from comfy_aimdo.model_vbar import ModelVBAR

MP = comfy.model_patcher.ModelPatcher
MPD = comfy.model_patcher.ModelPatcherDynamic


class DynamicStandIn(MP):
    """The real ModelPatcher, reporting itself dynamic, with ModelPatcherDynamic's methods."""

    is_dynamic = MPD.is_dynamic
    get_non_dynamic_delegate = MPD.get_non_dynamic_delegate
    load = MPD.load
    restore_loaded_backups = MPD.restore_loaded_backups
    unpatch_hooks = MPD.unpatch_hooks
    _vbar_get = MPD._vbar_get

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.non_dynamic_delegate_model = None  # as ModelPatcherDynamic.__init__ sets it


class VBARStandIn:
    """comfy-aimdo's ModelVBAR address assignment (`alloc`), without the native allocator."""

    alloc = ModelVBAR.alloc

    def __init__(self, size: int) -> None:
        self.base_addr = 0
        self.offset = 0
        self.max_size = size

    def prioritize(self) -> None:
        pass


def dynamic_from(source, *, with_loader: bool = True, load_device=None) -> DynamicStandIn:
    """A stand-in dynamic patcher over `source`'s model (from core's real loader)."""
    dyn = DynamicStandIn(source.model, load_device or source.load_device, source.offload_device,
                         source.model_size())
    if with_loader:
        dyn.cached_patcher_init = source.cached_patcher_init
    return dyn


def prepare_dynamic_load(dyn: DynamicStandIn, device: torch.device) -> VBARStandIn:
    """What ModelPatcherDynamic.__init__ and aimdo would have set up for `load(device)`.

    `device` must not equal torch.device("cpu"): core gives that load device no VBAR.
    torch.device("cpu", 0) does not equal it and is the same memory, so the load runs on CPU.
    """
    vbar = VBARStandIn(dyn.model_size() * 10)  # ModelPatcherDynamic._vbar_get's size
    dyn.model.dynamic_vbars = {device: vbar}
    dyn.model.dynamic_pins = {device: {"hostbufs_initialized": True, "failed": False,
                                       "active": False, "current_prompt": False}}
    return vbar


def with_lora(patcher, strength: float):
    """A clone with a weight patch on block 0, as LoraLoaderModelOnly makes one."""
    lora = patcher.clone()
    sd = patcher.model.state_dict()
    key = next(k for k in sd if k.startswith("diffusion_model.blocks.0.") and k.endswith(".weight")
               and sd[k].ndim == 2)
    lora.add_patches({key: (torch.full_like(sd[key], 0.01),)}, strength)
    return lora
