"""ComfyUI's Dynamic VRAM patcher on CPU, as far as it can run there. Imported inside ComfyUI's
own Python (tests/dynamic_vram_probe.py, tools/dynamic_vram_cost.py), after ComfyUI parsed
`--cpu`.

A real ModelPatcherDynamic cannot be built without a GPU: its `__new__` hands a CPU load device
to the classic ModelPatcher, and its `__init__` allocates comfy-aimdo host buffers, whose native
library loads only with CUDA or ROCm. So `DynamicStandIn` is the real ModelPatcher carrying
ModelPatcherDynamic's own methods (`is_dynamic`, `get_non_dynamic_delegate`, `load`,
`partially_load` and what they call), and `VBARStandIn` is comfy-aimdo's ModelVBAR with its real
address arithmetic (`alloc`) but no device memory behind it. With the load device
`torch.device("cpu", 0)` (not "the CPU" to core's VBAR check, the same memory) core's real
`load_models_gpu` loads such a model and its real samplers run it: its cast path takes the CPU
branch for weights with a VBAR slice. What the stand-in cannot show (faults, eviction, pins,
residency) needs CUDA: tests/test_dynamic_vram_gpu.py.

`map_weights` gives a model the host weights core's Dynamic VRAM loader gives it: read-only views
of a memory map of the model file, so RSS splits into the file's pages and anonymous memory as it
does on a GPU machine.
"""
from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path

import torch

import comfy.model_patcher
from comfy_aimdo.model_vbar import ModelVBAR

MP = comfy.model_patcher.ModelPatcher
MPD = comfy.model_patcher.ModelPatcherDynamic
CPU0 = torch.device("cpu", 0)


class VBARStandIn:
    """comfy-aimdo's ModelVBAR address assignment (`alloc`), without the native allocator."""

    alloc = ModelVBAR.alloc

    def __init__(self, size: int) -> None:
        self.base_addr = 0
        self.offset = 0
        self.max_size = size
        self.unpinned = 0  # slices handed back through vbar_unpin

    def prioritize(self) -> None:
        pass

    def unpin(self, alloc: int, size: int) -> None:
        self.unpinned += 1

    def loaded_size(self) -> int:
        return 0  # no device memory behind it


class DynamicStandIn(MP):
    """The real ModelPatcher, reporting itself dynamic, with ModelPatcherDynamic's methods."""

    is_dynamic = MPD.is_dynamic
    get_non_dynamic_delegate = MPD.get_non_dynamic_delegate
    load = MPD.load
    partially_load = MPD.partially_load
    restore_loaded_backups = MPD.restore_loaded_backups
    unpatch_hooks = MPD.unpatch_hooks

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.non_dynamic_delegate_model = None  # as ModelPatcherDynamic.__init__ sets it
        if not hasattr(self.model, "dynamic_vbars"):
            self.model.dynamic_vbars = {}

    def _vbar_get(self, create: bool = False):
        """ModelPatcherDynamic._vbar_get, making a VBARStandIn where it makes a ModelVBAR."""
        vbar = self.model.dynamic_vbars.get(self.load_device)
        if create and vbar is None:
            vbar = self.model.dynamic_vbars[self.load_device] = VBARStandIn(self.model_size() * 10)
        return vbar


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
    """
    dyn.load_device = device
    dyn.model.dynamic_pins = {device: {"hostbufs_initialized": True, "failed": False,
                                       "active": False, "current_prompt": False}}
    return dyn._vbar_get(create=True)


def runnable(source) -> DynamicStandIn:
    """A stand-in that core's load_models_gpu and samplers run, on CPU, laid out on first load."""
    dyn = dynamic_from(source, load_device=CPU0)
    dyn.model.dynamic_pins = {CPU0: {"hostbufs_initialized": True, "failed": False,
                                     "active": False, "current_prompt": False}}
    return dyn


def map_weights(patcher, path: Path) -> int:
    """Point the model's weights at read-only views of a memory map of its file, as core's
    Dynamic VRAM loader does (`comfy.utils.load_safetensors`). Only tensors whose dtype and shape
    match the file's are mapped; returns the bytes mapped."""
    raw = Path(path).read_bytes()[:8]
    header_len = struct.unpack("<Q", raw)[0]
    with open(path, "rb") as f:
        header = json.loads(f.read(8 + header_len)[8:])
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    base = 8 + header_len
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    done = 0
    for key, info in header.items():
        if key == "__metadata__" or info["dtype"] not in dtypes:
            continue
        target = f"diffusion_model.{key}"
        module_name, _, attr = target.rpartition(".")
        try:
            module = patcher.model.get_submodule(module_name)
        except AttributeError:
            continue
        current = module._parameters.get(attr)
        dtype = dtypes[info["dtype"]]
        if current is None or current.dtype != dtype or list(current.shape) != info["shape"]:
            continue
        start, end = info["data_offsets"]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            view = torch.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize,
                                    offset=base + start).view(info["shape"])
        module._parameters[attr] = torch.nn.Parameter(view, requires_grad=False)
        done += end - start
    return done


def with_lora(patcher, strength: float):
    """A clone with a weight patch on block 0, as LoraLoaderModelOnly makes one."""
    lora = patcher.clone()
    sd = patcher.model.state_dict()
    key = next(k for k in sd if k.startswith("diffusion_model.blocks.0.") and k.endswith(".weight")
               and sd[k].ndim == 2)
    lora.add_patches({key: (torch.full_like(sd[key], 0.01),)}, strength)
    return lora
