"""Probe of Apply Layerwise Offload's device budget against core's own sampler, in the tree under test.

Run by tests/test_block_budget.py in the tree under test (`run_tree_script`). For each scenario
(ComfyUI's reserve, the latent's size, what the model has loaded, core's weight-memory ratio) it
computes:
- core: the weight memory core's own sampler gives the model. `sampler_helpers._prepare_sampling`
  runs for real (core's activation estimate, `load_models_gpu`, `free_memory`); only the last
  step, `LoadedModel.model_load`, is replaced by a recorder of the lowvram figure it is handed
  (a real load would move weights to a GPU this machine lacks). Core's figure for the whole
  model is that figure plus what the model had loaded.
- node: `block_budget.device_room` for the same state, and the auto budget `choose_budget`
  gives the blocks.
The device is a CUDA device as core sees it (`load_device`, a NORMAL_VRAM state); its free memory
is a fixed number, the one thing no CPU machine has.

For a LoRA'd run it also records what the node keeps beside the blocks (the patches' tensors on
the device, the merge workspace), and measures what core's merge of each adapter type holds at
once: the node's transform runs on every patched weight of the blocks under a dispatch mode that
counts the bytes of the tensors its ops make while they live, in core's merge dtype and, where
the tree has one, the fp16 merge dtype newer ComfyUI picks on GPUs.
"""
from __future__ import annotations

import json
import math
import tempfile
import weakref
from pathlib import Path

import tree_probe

OUT = tree_probe.start()
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import comfy.model_management as mm  # noqa: E402
import comfy.sampler_helpers  # noqa: E402
import comfy.sd  # noqa: E402
import tiny_models  # noqa: E402

GIB = 1024 ** 3
DEVICE = torch.device("cuda", 0)
FREE = 11 * GIB


def free_memory_of(dev=None, torch_free_too=False):
    return (FREE, FREE) if torch_free_too else FREE


def conds() -> dict:
    text = torch.zeros(1, 8, 4096)
    return {"positive": [{"cross_attn": text}], "negative": [{"cross_attn": text}]}


def core_weights(patcher, noise_shape) -> int:
    """What core's sampler lets the model's weights take: the lowvram figure it hands the
    model's load, plus what the model had loaded (core subtracts that before the load)."""
    seen = []

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        seen.append(lowvram_model_memory)

    loaded = patcher.loaded_size()
    original = mm.LoadedModel.model_load
    mm.LoadedModel.model_load = model_load
    try:
        comfy.sampler_helpers._prepare_sampling(patcher, noise_shape, conds(), model_options={})
    finally:
        mm.LoadedModel.model_load = original
        mm.current_loaded_models.clear()
    assert len(seen) == 1, seen
    return math.floor(seen[0] + loaded)


def main() -> None:
    block_budget = tree_probe.import_pack_module("nodes.layerwise.block_budget")
    path = Path(tempfile.mkdtemp()) / "wan.safetensors"
    tiny_models.write_tiny_wan21(path, layers=4)
    patcher = comfy.sd.load_diffusion_model(str(path))
    patcher.load_device = DEVICE
    blocks = patcher.model.diffusion_model.blocks
    block_bytes = sum(mm.module_size(b) for b in blocks)
    rest = mm.module_size(patcher.model) - block_bytes
    mm.vram_state = mm.VRAMState.NORMAL_VRAM
    mm.get_free_memory = free_memory_of
    small, large = [1, 16, 1, 8, 8], [1, 16, 21, 90, 160]  # a tiny latent, and Wan's 720p x 81 frames
    scenarios = [
        {"name": "default reserve, small latent", "reserve": 0.4, "latent": small},
        {"name": "default reserve, large latent", "reserve": 0.4, "latent": large},
        {"name": "--reserve-vram 3, small latent", "reserve": 3.0, "latent": small},
        {"name": "--reserve-vram 3, large latent", "reserve": 3.0, "latent": large},
        {"name": "model partly loaded", "reserve": 0.4, "latent": small, "loaded": rest // 2},
        # Core's weight-memory ratio outside NVIDIA wins where the activations leave less.
        {"name": "weight ratio 0.4 (not NVIDIA)", "reserve": 3.0, "latent": [1, 16, 31, 90, 160],
         "ratio": 0.4},
    ]
    results = []
    for sc in scenarios:
        mm.EXTRA_RESERVED_VRAM = int(sc["reserve"] * GIB)
        mm.MIN_WEIGHT_MEMORY_RATIO = sc.get("ratio", 0.0)
        patcher.model.model_loaded_weight_memory = sc.get("loaded", 0)
        need, need_least = comfy.sampler_helpers.estimate_memory(patcher, sc["latent"], conds())
        core = core_weights(patcher, sc["latent"])
        room = block_budget.device_room(patcher, rest, block_bytes, sc["latent"], conds(), {})
        mm.current_loaded_models.clear()
        budget = block_budget.choose_budget("probe", None, room, 1, 10 * FREE)
        results.append({"name": sc["name"], "core_weights": core, "node_weights": room.weights,
                        "for_blocks": room.for_blocks, "auto_budget": budget, "rest": rest,
                        "free": room.free, "kept": room.kept,
                        "activations_least": int(need_least), "reserve": mm.EXTRA_RESERVED_VRAM,
                        "minimum_inference": int(mm.minimum_inference_memory())})
    OUT.write_text(json.dumps({"scenarios": results, "lora": lora_figures(path),
                               "merge_peaks": merge_peaks(path), "allocator": allocator_figures()}))


def lora_figures(path: Path) -> dict:
    """What a LoRA'd run keeps beside the blocks: the merge workspace and the device buffer of
    the patches' tensors, against the model's own weights and the LoRA's factors."""
    comfy_weights = tree_probe.import_pack_module("nodes.layerwise.comfy_weights")
    lora_path = path.with_name("lora.safetensors")
    tiny_models.write_tiny_wan_lora(lora_path, model_layers=4)
    import comfy.utils
    patcher = comfy.sd.load_diffusion_model(str(path))
    lora = comfy.utils.load_torch_file(str(lora_path))
    patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0.0)
    blocks = list(patcher.model.diffusion_model.blocks)
    prefixes = [f"diffusion_model.blocks.{i}" for i in range(len(blocks))]
    patched = [(i, name, w) for i, b in enumerate(blocks) for name, w in b.named_parameters()
               if f"{prefixes[i]}.{name}" in patcher.patches]
    factors = [sum(t.numel() * t.element_size() for t in patcher.patches[f"{prefixes[i]}.{name}"][0][1].weights
                   if isinstance(t, torch.Tensor)) for i, name, _ in patched]
    per_block = [sum(f for (i, _, _), f in zip(patched, factors) if i == b) for b in range(len(blocks))]
    store = comfy_weights.BlockPatches(patcher, prefixes, blocks,
                                       comfy_weights.merged_keys(patcher, prefixes, blocks), torch.device("cpu"))
    try:
        key = f"{prefixes[1]}.{patched[0][1]}"
        on_device = store.patches(1, key)[0][1]
        moved = [t for t in on_device.weights if isinstance(t, torch.Tensor)]
        originals = {t.untyped_storage().data_ptr() for t in patcher.patches[key][0][1].weights
                     if isinstance(t, torch.Tensor)}
        buffers = {t.untyped_storage().data_ptr() for t in moved}
        inside = len(buffers) == 1 and not buffers & originals  # one device buffer, not the originals
        equal = all(torch.equal(a, b) for a, b in zip(on_device.weights, patcher.patches[key][0][1].weights)
                    if isinstance(a, torch.Tensor))
        figures = {"device_bytes": store.device_bytes, "largest_block_factors": max(per_block),
                   "uploads_after_two_loads_of_one_block": None}
        store.patches(1, f"{prefixes[1]}.{patched[-1][1]}")
        figures["uploads_after_two_loads_of_one_block"] = store.uploads
    finally:
        store.close()
    return dict(figures, factors_on_device=inside, factors_equal=equal,
                workspace=comfy_weights.merge_workspace_bytes(patcher, prefixes, blocks),
                temporaries=comfy_weights.MERGE_TEMPORARIES,
                largest_patched_numel=max(w.numel() for _, _, w in patched))


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops make while this mode is on and that are still alive,
    and their peak. Storages that existed before (``known``) are never counted."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.known or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out


def _storages(value) -> set[int]:
    """The storages of the tensors inside a patch as core keeps it (tuples, lists, adapters)."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    weights = getattr(value, "weights", None)
    return _storages(weights) if isinstance(weights, (tuple, list)) else set()


def merge_peaks(path: Path) -> list[dict]:
    """For each adapter type (and a model merge's difference), the most core's merge of one of
    the blocks' weights holds at once, against the node's figure for the run."""
    comfy_weights = tree_probe.import_pack_module("nodes.layerwise.comfy_weights")
    dtypes = [None] + ([torch.float16] if hasattr(mm, "lora_compute_dtype") else [])
    rows = []
    for kind in (*tiny_models.WAN_ADAPTER_KINDS, "diff"):
        patcher = comfy.sd.load_diffusion_model(str(path))
        blocks = list(patcher.model.diffusion_model.blocks)
        prefixes = [f"diffusion_model.blocks.{i}" for i in range(len(blocks))]
        if kind == "diff":
            g = torch.Generator().manual_seed(3)
            patcher.add_patches({f"{prefix}.{name}": (torch.randn(w.shape, generator=g) * 0.01,)
                                 for prefix, b in zip(prefixes, blocks) for name, w in b.named_parameters()
                                 if w.ndim == 2}, 0.7)
        else:
            patcher, _ = comfy.sd.load_lora_for_models(
                patcher, None, tiny_models.build_tiny_wan_adapter(kind, model_layers=len(blocks)), 0.7, 0.0)
        known = set().union(*(_storages(p) for p in patcher.patches.values()))
        for dtype in dtypes:
            chosen = mm.lora_compute_dtype if dtype is not None else None
            if dtype is not None:
                mm.lora_compute_dtype = lambda device, dtype=dtype: dtype
            try:
                rows.append(dict(kind=kind, merge_dtype=str(dtype or "core's"),
                                 **_merge_peak(comfy_weights, patcher, prefixes, blocks, known)))
            finally:
                if chosen is not None:
                    mm.lora_compute_dtype = chosen
    return rows


def _merge_peak(comfy_weights, patcher, prefixes, blocks, known) -> dict:
    keys = comfy_weights.merged_keys(patcher, prefixes, blocks)
    transform = comfy_weights.lora_transform(patcher, prefixes, keys)
    unit = max(comfy_weights.lora_merge_dtype(patcher.load_device).itemsize, 4)
    peak = ratio = merged = 0
    for index, (prefix, block) in enumerate(zip(prefixes, blocks)):
        for name, weight in block.named_parameters():
            if f"{prefix}.{name}" not in keys:
                continue
            copy = weight.detach().clone()  # the slot copy the engine merges into
            with torch.no_grad(), LiveBytes(known | {copy.untyped_storage().data_ptr()}) as live:
                try:
                    out = transform(index, name, copy)
                except comfy_weights.MergeFailed as e:  # core's own merge fails the same way
                    return {"failed": str(e)}
                del out
            peak, merged = max(peak, live.peak), merged + 1
            ratio = max(ratio, live.peak / (weight.numel() * unit))
    return {"failed": None, "merged": merged, "peak": peak, "per_weight": ratio,
            "figure": comfy_weights.MERGE_TEMPORARIES
            * comfy_weights.merge_temporary_bytes(patcher, prefixes, blocks)}


def allocator_figures() -> dict:
    """The node's figures for CUDA's caching allocator and torch's cuBLAS workspace, for sizes
    and settings whose answers torch's sources fix."""
    block_budget = tree_probe.import_pack_module("nodes.layerwise.block_budget")
    mib = 1024 ** 2
    return {
        "cached": {"7 x 100 MiB + 1": block_budget.cached_bytes(100 * mib + 1, 7),
                   "7 x 3 MiB": block_budget.cached_bytes(3 * mib, 7),
                   "7 x 4 KiB": block_budget.cached_bytes(4096, 7),
                   "1 x 1 MiB": block_budget.cached_bytes(mib, 1)},
        "workspace": {"H100 default": block_budget.workspace_config_bytes(None, (9, 0)),
                      "RTX 4090 default": block_budget.workspace_config_bytes(None, (8, 9)),
                      "RTX 5090 default": block_budget.workspace_config_bytes(None, (12, 0)),
                      ":4096:8": block_budget.workspace_config_bytes(":4096:8", (8, 9)),
                      ":16:8": block_budget.workspace_config_bytes(":16:8", (9, 0)),
                      "unparsable": block_budget.workspace_config_bytes("4096", (9, 0)),
                      "MI300 default": block_budget.workspace_config_bytes(None, (9, 4), "gfx942:sramecc+:xnack-")},
    }


if __name__ == "__main__":
    main()
