"""ComfyUI-side weight handling for streamed blocks: LoRA baking and hand-over from core.

Core merges LoRA into a fully loaded weight with `comfy.lora.calculate_weight` on the load device
(in fp32 up to 0.3.x; newer ComfyUI uses `model_management.lora_compute_dtype(device)`, fp16 on
GPUs that favour it) and stochastic-rounds it with a per-key seed. Doing exactly that when packing
makes a streamed block bit-identical to the same block loaded by core.

GGUF models (ComfyUI-GGUF's `GGMLTensor` weights under its `GGUFModelPatcher`) are the exception:
their patcher merges a LoRA into a quantized weight at no load at all. It hangs the patches on the
weight (`weight.patches`) and its layers apply them each time they dequantize. Its unquantized
weights it merges in fp32 and rounds with seed 0. The engine keeps the weight objects (and so
their `patches`) across packing and streaming, so the hand-over gives them the patches the
patcher's own load would, and the transform leaves their bytes alone.
"""
from __future__ import annotations

import copy
import logging
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils
import comfy.weight_adapter

from ...offload_core.host.released import true_numel
from ...offload_core.host.side_tensors import SideTensors
from .block_budget import cached_bytes, cublas_workspace_bytes
from .hook_weights import StreamedHooks

log = logging.getLogger(__name__)

# Newer ComfyUI moved string_to_seed to comfy.utils and left a shim in comfy.model_patcher that
# logs a warning on every call (once per patched key here); 0.3.75 has only the latter.
_string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


def lora_merge_dtype(device: torch.device) -> torch.dtype:
    """The dtype core's `patch_weight_to_device` merges LoRA in on this device."""
    probe = getattr(comfy.model_management, "lora_compute_dtype", None)
    return probe(device) if callable(probe) else torch.float32


def block_keys(prefix: str, block: torch.nn.Module) -> list[str]:
    """State-dict keys of a block's parameters, as ModelPatcher names them."""
    return [f"{prefix}.{name}" for name, _ in block.named_parameters()]


def merged_keys(patcher, block_prefixes: Sequence[str], blocks: Sequence[torch.nn.Module]) -> frozenset[str]:
    """The blocks' weights core's load merges a weight patch into: those with patches, on the
    modules core loads.

    Core's load (its load list, the same in 0.3.x and 0.33, classic and Dynamic VRAM) leaves out
    every module that has parameters below it besides its own, such as a Wan block's own
    `modulation`: a patch on such a weight is never merged, and the weight runs as loaded. LoRAs
    rarely patch one; a model merge patches every weight. Hook patches are another matter: core
    applies those to every weight (see ``CoreMerge``).
    """
    keys = set()
    for prefix, block in zip(block_prefixes, blocks):
        for name, module in block.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own or len(own) != sum(1 for _ in module.parameters()):
                continue  # no weights, or weights below it: core does not load it
            path = f"{prefix}.{name}" if name else prefix
            keys.update(key for key in (f"{path}.{param}" for param in own) if key in patcher.patches)
    return frozenset(keys)


# Core's merge holds at most this many temporaries of the weight's size at once, each in fp32 (the
# adapters' intermediate dtype) or the merge dtype if wider: DoRA over LoHa holds six (the weight
# in the merge dtype, LoHa's two products, their product, DoRA's merged weight and its scaled
# copy; LoRA three, LoHa five), and one more stands for what rides beside them (factors cast to
# fp32, DoRA's norms, OFT's rotations). tests/budget_probe.py measures each adapter against it.
MERGE_TEMPORARIES = 7


class MergeFailed(RuntimeError):
    """Core could not merge a weight patch into a block and carried on with the base weight."""


class _MergeErrors:
    """The errors core reports on a thread while it merges (see ``lora_transform``).

    Core's weight adapters (LoRA, LoHa, LoKr, GLoRA, OFT, BOFT) catch every exception of their
    math, out of memory included, call ``logging.error("ERROR <adapter> <key> <exception>")`` and
    return the weight unmerged: that call is the only sign of the failure. A log handler misses
    it whenever the root logger's level hides ERROR (ComfyUI's ``--verbose CRITICAL``): logging
    then makes no record at all. So the root logger's ``error`` is wrapped, once: on a thread
    that is merging, the message is kept before logging tests its level; the call then goes on
    as it would have, and the log shows what the user's level lets through.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._installed = False

    def _install(self) -> None:
        with self._lock:
            if self._installed:
                return
            root = logging.getLogger()
            original = root.error  # the class's method, or whatever stands in for it already
            local = self._local

            def error(msg: object, *args: Any, **kwargs: Any) -> None:
                box = getattr(local, "box", None)
                if box is not None:
                    try:
                        box.append(str(msg) % args if args else str(msg))
                    except (TypeError, ValueError):  # logging's own formatting would fail too
                        box.append(str(msg))
                original(msg, *args, **kwargs)

            root.error = error
            self._installed = True

    @contextmanager
    def collect(self) -> Iterator[list[str]]:
        if not self._installed:
            self._install()
        previous = getattr(self._local, "box", None)
        self._local.box = box = []
        try:
            yield box
        finally:
            self._local.box = previous


_MERGE_ERRORS = _MergeErrors()
_ADAPTER = getattr(comfy.weight_adapter, "WeightAdapterBase", ())  # () matches nothing


def _calculate_weight(patches, weight: torch.Tensor, key: str, original_weights: dict | None = None) -> torch.Tensor:
    """Core's `calculate_weight`, raising MergeFailed where core reports a failure and goes on."""
    with _MERGE_ERRORS.collect() as errors:
        merged = comfy.lora.calculate_weight(patches, weight, key, original_weights=original_weights)
    if errors:
        raise MergeFailed(
            f"Apply Layerwise Offload: the LoRA (or other weight patch) on {key} could not be merged "
            f"into its streamed copy: {errors[0]}. The prompt stops rather than run that block with "
            "its base weights. If the GPU ran out of memory, lower vram_budget_gb, prefetch or the "
            "resolution.")
    return merged


def merge_temporary_bytes(patcher, block_prefixes: Sequence[str],
                          blocks: Sequence[torch.nn.Module]) -> int:
    """The size of one of a merge's temporaries (see MERGE_TEMPORARIES) for the largest patched
    weight of the blocks, in fp32 or the merge dtype if wider (0 without patches). GGUF's
    quantized weights are merged at dequantization, not here."""
    largest = 0
    merged = merged_keys(patcher, block_prefixes, blocks)
    for prefix, block in zip(block_prefixes, blocks):
        for name, weight in block.named_parameters():
            if f"{prefix}.{name}" in merged and not (is_ggml(weight) and ggml_quantized(weight)):
                largest = max(largest, true_numel(weight))
    size = torch.empty((), dtype=lora_merge_dtype(patcher.load_device)).element_size()
    return largest * max(size, 4)


def merge_workspace_bytes(patcher, block_prefixes: Sequence[str],
                          blocks: Sequence[torch.nn.Module]) -> int:
    """Device memory a merge into one of the blocks' weights needs beside the copy and the
    patches' tensors (0 without patches).

    The merges run on the engine's copy stream: CUDA's allocator keeps their temporaries cached
    for that stream once freed, and torch's cuBLAS keeps a workspace for it, and core counts
    neither as used before the run (the workspace does not exist yet; cached memory it counts as
    free). So the figure is the temporaries as the allocator reserves them, plus the workspace.
    """
    temporary = merge_temporary_bytes(patcher, block_prefixes, blocks)
    if not temporary:
        return 0
    device = patcher.load_device
    if device.type != "cuda":
        return MERGE_TEMPORARIES * temporary
    return cached_bytes(temporary, MERGE_TEMPORARIES) + cublas_workspace_bytes(device)


class _Taken:
    """Where a patch tensor goes in its block's side tensors."""

    def __init__(self, index: int) -> None:
        self.index = index


def _map_patch(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` (a patch as core stores it) with ``fn`` applied to its tensors (and to the
    placeholders that stand for them): inside tuples, lists and dicts, and a weight adapter's
    ``weights``. Anything else is kept as it is."""
    if isinstance(value, (torch.Tensor, _Taken)):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [_map_patch(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _map_patch(v, fn) for k, v in value.items()}
    weights = getattr(value, "weights", None)
    if isinstance(value, _ADAPTER) and isinstance(weights, (tuple, list)):
        moved = copy.copy(value)
        moved.weights = type(weights)(_map_patch(w, fn) for w in weights)
        return moved
    return value


class BlockPatches:
    """The patcher's weight patches of each block, their tensors brought to the device with the
    block (offload_core.side_tensors): a merge on the copy stream then reads no pageable memory.

    A LoRA's factors are small beside the weight they patch and are packed, once per run. A patch
    tensor as large as its weight (a model merge's difference) stays where it is: packing it
    would hold a second model in RAM; its merges read it as core does (logged).
    """

    def __init__(self, patcher, block_prefixes: Sequence[str], blocks: Sequence[torch.nn.Module],
                 merged: frozenset[str], device: torch.device) -> None:
        groups: list[list[torch.Tensor]] = []
        templates: list[dict[str, Any]] = []
        left = 0
        for prefix, block in zip(block_prefixes, blocks):
            tensors: list[torch.Tensor] = []
            index: dict[int, int] = {}
            template: dict[str, Any] = {}
            for name, weight in block.named_parameters():
                key = f"{prefix}.{name}"
                if key not in merged or (is_ggml(weight) and ggml_quantized(weight)):
                    continue  # GGUF merges its quantized weights at dequantization

                def take(t: torch.Tensor, full: int = true_numel(weight)) -> Any:
                    nonlocal left
                    if t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter):
                        return t
                    if t.numel() >= full:
                        left += 1
                        return t
                    if id(t) not in index:
                        index[id(t)] = len(tensors)
                        tensors.append(t)
                    return _Taken(index[id(t)])

                template[key] = _map_patch(patcher.patches[key], take)
            groups.append(tensors)
            templates.append(template)
        if left:
            log.info("[tiered offload] Apply Layerwise Offload: %d patch tensors are as large as the weights "
                     "they patch (a model merge); their merges read them from RAM, which holds up sampling", left)
        self._templates = templates
        self._side = SideTensors(groups, device)
        self._on_device: dict[int, dict[str, Any]] = {}

    @property
    def device_bytes(self) -> int:
        return self._side.device_bytes

    @property
    def uploads(self) -> int:
        return self._side.uploads

    def patches(self, block_index: int, key: str):
        """The patches of ``key`` with their packed tensors on the device, uploaded (on the
        current stream) unless the device holds this block's already; None for a key the block
        had no patches under when they were packed."""
        views = self._side.load(block_index)
        on_device = self._on_device.get(block_index)
        if on_device is None:
            def view(item: Any) -> Any:
                return views[item.index] if isinstance(item, _Taken) else item

            on_device = self._on_device[block_index] = {
                k: _map_patch(t, view) for k, t in self._templates[block_index].items()}
        return on_device.get(key)

    def close(self) -> None:
        self._side.close()


def lora_transform(patcher, block_prefixes: Sequence[str], merged: frozenset[str],
                   block_patches: BlockPatches | None = None, hooks: StreamedHooks | None = None) -> CoreMerge:
    """A transform that merges the patcher's weight patches into ``merged`` (``merged_keys``) the
    way core's full load does, and, with ``hooks``, the hook patches in force the way core's hook
    patching does (``CoreMerge``)."""
    return CoreMerge(patcher, block_prefixes, merged, block_patches, hooks)


class CoreMerge:
    """The engine's transform of a block copy: core's LoRA merge, then core's hook patches.

    Core's `patch_weight_to_device`: the weight in the merge dtype on the load device, the
    layer's `convert_func` (scaled fp8's scale, a quantized tensor's dequantize),
    `calculate_weight`, then either the layer's own `set_func` (scaled fp8, mixed precision: it
    rounds, or quantizes, as that layer stores weights, returning a new quantized tensor whose
    inner tensors the engine writes into the copy) or stochastic rounding to the storage dtype,
    each seeded by the key. The same steps here give the same bits. The layer's methods read
    its other tensors (a scale), so the engine runs the transform while the block's tensors are
    bound to the copy. A GGUF weight is merged as its own patcher merges it (see the module
    docstring).

    Core's `patch_hook_weight_to_device` then patches a hooked weight as loaded (merged): in
    fp32, `convert_func`, `calculate_weight` with the hooks' combined patches (the weight's own
    base and patches as the originals a patch may ask for), rounded as above. ``hooks`` says
    which patches are in force (hook_weights.py); ``now`` freezes them for a copy queued now.

    With ``block_patches`` the patches' tensors come from the device (uploaded with the block,
    on the stream the merge runs on), so a merge never waits on the host. A merge core fails
    and carries on from (it logs the error and keeps the base weight) raises MergeFailed.
    """

    def __init__(self, patcher, block_prefixes: Sequence[str], merged: frozenset[str],
                 block_patches: BlockPatches | None, hooks: StreamedHooks | None,
                 hooked: dict[str, list] | None = None) -> None:
        self._patcher = patcher
        self._prefixes = block_prefixes
        self._merged = merged
        self._block_patches = block_patches
        self._hooks = hooks
        self._hooked = hooked  # frozen hook patches (``now``); None: ask ``hooks`` at each call
        self._merge_dtype = lora_merge_dtype(patcher.load_device)

    def now(self) -> CoreMerge:
        """This transform with the hook patches in force now (``host.transform.transform_now``)."""
        if self._hooks is None:
            return self
        return CoreMerge(self._patcher, self._prefixes, self._merged, self._block_patches, self._hooks,
                         self._hooks.snapshot())

    def _patches_of(self, block_index: int, key: str):
        on_device = None if self._block_patches is None else self._block_patches.patches(block_index, key)
        return self._patcher.patches[key] if on_device is None else on_device

    def __call__(self, block_index: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = f"{self._prefixes[block_index]}.{name}"
        hooked = self._hooked if self._hooked is not None or self._hooks is None else self._hooks.snapshot()
        hook_patches = None if hooked is None else hooked.get(key)
        patched = key in self._merged
        if not patched and hook_patches is None:
            return tensor
        model, device = self._patcher.model, self._patcher.load_device
        weight, set_func, convert_func = comfy.model_patcher.get_key_weight(model, key)
        if is_ggml(weight):
            if hook_patches is not None:
                raise MergeFailed(
                    f"Apply Layerwise Offload: a hook LoRA patches {key}, a GGUF weight of a streamed block, "
                    "which the engine cannot patch as ComfyUI-GGUF would. Keep every block resident "
                    "(resident_blocks set to the block count) for hook LoRAs on a GGUF model.")
            if ggml_quantized(weight) or not patched:
                return tensor  # quantized: applied at dequantization through weight.patches
            work = comfy.model_management.cast_to_device(tensor, device, torch.float32, copy=True)
            merged = _calculate_weight(self._patches_of(block_index, key), work, key)
            return comfy.float.stochastic_rounding(merged, tensor.dtype).to(tensor.device)
        seed = _string_to_seed(key)
        merged = tensor
        if patched:
            work = comfy.model_management.cast_to_device(tensor, device, self._merge_dtype, copy=True)
            if convert_func is not None:
                work = convert_func(work, inplace=True)
            merged = _round(_calculate_weight(self._patches_of(block_index, key), work, key), tensor, set_func, seed)
        if hook_patches is not None:
            work = comfy.model_management.cast_to_device(merged, device, torch.float32, copy=True)
            if convert_func is not None:
                work = convert_func(work, inplace=True)
            originals = {key: [(tensor, convert_func or _unchanged)] + list(self._patcher.patches.get(key, []))}
            merged = _round(_calculate_weight(hook_patches, work, key, originals), tensor, set_func, seed)
        return merged.to(tensor.device)


def _unchanged(weight: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Core's stand-in for a layer without a `convert_func`."""
    return weight


def _round(merged: torch.Tensor, like: torch.Tensor, set_func, seed: int) -> torch.Tensor:
    """A merged weight as the layer stores it: its `set_func`, or stochastic rounding."""
    if set_func is None:
        return comfy.float.stochastic_rounding(merged, like.dtype, seed=seed)
    return set_func(merged, seed=seed, return_weight=True)


def is_ggml(weight: object) -> bool:
    """A ComfyUI-GGUF `GGMLTensor` (known by its attributes, so the pack needs no GGUF import)."""
    return isinstance(weight, torch.Tensor) and hasattr(weight, "tensor_type") \
        and hasattr(weight, "tensor_shape")


def ggml_quantized(weight: torch.Tensor) -> bool:
    """GGUF's `is_quantized`: any tensor type but F32 and F16 (which torch reads as they are)."""
    qtype = getattr(weight, "tensor_type", None)
    return qtype is not None and getattr(qtype, "name", str(qtype)) not in ("F32", "F16")


def _attach_ggml_patches(patcher, block_prefixes: Sequence[str],
                         blocks: Sequence[torch.nn.Module]) -> None:
    """Give each quantized GGUF weight of the blocks the patches its patcher's load would.

    `GGUFModelPatcher.patch_weight_to_device` sets `weight.patches = [(patches, key)]`, the
    patches moved to the load device with `patch_on_device`, else to the offload device. Core
    never loads the engine's blocks (they are hidden from it), so this is done here, once per run;
    the engine keeps the objects, so streamed copies carry them too.
    """
    merged = merged_keys(patcher, block_prefixes, blocks)
    for prefix, block in zip(block_prefixes, blocks):
        for name, weight in block.named_parameters():
            key = f"{prefix}.{name}"
            if key in merged and is_ggml(weight) and ggml_quantized(weight):
                device = patcher.load_device if getattr(patcher, "patch_on_device", False) \
                    else patcher.offload_device
                weight.patches = [(_move_patches(type(weight), patcher.patches[key], device), key)]


def _move_patches(weight_class: type, patches, device: torch.device):
    """GGUF's own `move_patch_to_device`, from the module that defines its tensor class; the
    patches as they are where that module has none (they are moved at dequantization anyway)."""
    move = getattr(sys.modules.get(weight_class.__module__), "move_patch_to_device", None)
    return move(patches, device) if callable(move) else patches


def _clear_ggml_patches(module: torch.nn.Module) -> None:
    """What `GGUFModelPatcher.unpatch_model` does: no weight carries patches."""
    for weight in module.parameters(recurse=False):
        if is_ggml(weight) and getattr(weight, "patches", None):
            weight.patches = []


def hand_over_from_core(patcher, block_prefixes: Sequence[str],
                        blocks: Sequence[torch.nn.Module], reclaim: Callable[[], int]) -> None:
    """Make the streamed blocks pristine, on the host and unknown to core before the engine
    takes them.

    The engine's master is host RAM whatever core's offload device is (`--highvram` makes that
    the GPU), so the blocks go to the CPU. Once core's base weights are back, ``reclaim`` (the
    engine's) re-points every tensor that holds them at a kept pack: blocks core loaded onto
    the device since the last run come back without a copy, and the pack stays valid. A block
    already on the host is not moved: a no-op `.to()` still rebuilds every quantized (wrapper
    subclass) parameter. GGUF weights then get the patches their patcher's load would give them.
    """
    _restore_base_weights(patcher, block_prefixes, blocks)
    taken = reclaim()
    if taken:
        log.info("[tiered offload] Apply Layerwise Offload: %d block tensors core had moved were re-pointed at the "
                 "kept pack, with no copy", taken)
    cpu = torch.device("cpu")
    for block in blocks:
        if any(t.device != cpu for t in [*block.parameters(), *block.buffers()]):
            block.to(cpu)
    _attach_ggml_patches(patcher, block_prefixes, blocks)
    _settle_requires_grad(patcher, block_prefixes, blocks)


def _settle_requires_grad(patcher, block_prefixes: Sequence[str],
                          blocks: Sequence[torch.nn.Module]) -> None:
    """Give each block weight that has a patch the `requires_grad` core's own load gives it.

    Core's load puts every weight it merges a patch into back as a new
    `Parameter(requires_grad=False)` (and so does its unpatch), unless the patcher updates
    weights in place; weights it never patched keep the `requires_grad=True` they were built
    with. The engine merges into its device copies and keeps the parameter objects, so without
    this they would keep `True` where core's are `False`. No result depends on it (sampling
    runs under inference mode), but torch.compile guards on it: a compiled block whose weights
    differ from core's in it compiles graphs of its own (docs/torch-compile.md#recompiles).
    """
    if getattr(patcher, "weight_inplace_update", False):
        return
    merged = merged_keys(patcher, block_prefixes, blocks)
    for prefix, block in zip(block_prefixes, blocks):
        for name, weight in block.named_parameters():
            if weight.requires_grad and f"{prefix}.{name}" in merged:
                weight.requires_grad_(False)


def _restore_base_weights(patcher, block_prefixes: Sequence[str],
                          blocks: Sequence[torch.nn.Module]) -> None:
    """Put core's backups of the blocks' weights back and forget core's marks on the blocks.

    A clone sharing this nn.Module may have merged its LoRA into these weights; core keeps the
    originals in the shared `backup`. Restoring them (and dropping the backup entries) means the
    engine packs the base weights and no later unpatch writes into a streamed block. GGUF weights
    lose the patches hung on them, as its patcher's unpatch does. Core's marks go module by
    module, right after that module's weights are restored, so that whatever interrupts this, a
    module core still counts as patched holds its merged weights.
    """
    model = patcher.model
    for prefix, block in zip(block_prefixes, blocks):
        for name, module in block.named_modules():
            path = f"{prefix}.{name}" if name else prefix
            for param, _ in module.named_parameters(recurse=False):
                key = f"{path}.{param}"
                if key in patcher.pinned:
                    patcher.unpin_weight(key)
                backup = patcher.backup.pop(key, None)
                if backup is not None:
                    if backup.inplace_update:
                        comfy.utils.copy_to_param(model, key, backup.weight)
                    else:
                        comfy.utils.set_attr_param(model, key, backup.weight)
            _clear_ggml_patches(module)
            _forget_core_marks([module], lowvram=True, recurse=False)


def _forget_core_marks(blocks: Sequence[torch.nn.Module], *, lowvram: bool,
                       recurse: bool = True) -> None:
    """Drop core's "patched" mark from every block module, and with ``lowvram`` all its
    partial-load state too (cast-at-forward marks and weight functions)."""
    for block in blocks:
        for module in (block.modules() if recurse else [block]):
            if lowvram:
                comfy.model_patcher.wipe_lowvram_weight(module)
            if hasattr(module, "comfy_patched_weights"):
                del module.comfy_patched_weights


def return_to_core(patcher, block_prefixes: Sequence[str],
                   blocks: Sequence[torch.nn.Module]) -> None:
    """After a run, however it ended: the blocks hold their base weights on the host. Tell core.

    Core's partial load may have marked the empty block modules cast-at-forward; left in place,
    that mark makes its next load skip them ("already lowvramed") and run them without its
    patches. And core must not take the model for fully loaded: "lowvram" makes its next load
    of it bring the blocks to the device and merge its patches into them. A hand-over that was
    interrupted is completed first, so no block is left merged but unmarked.
    """
    _restore_base_weights(patcher, block_prefixes, blocks)
    patcher.model.model_lowvram = True


def settle_after_core_load(blocks: Sequence[torch.nn.Module]) -> None:
    """Undo what core's load() left on the engine's modules: its "patched" mark and any
    LowVramPatch.

    Core loaded the blocks while the engine held their tensors out of sight, so it marked them
    patched with nothing merged. Without the mark a partial unload never moves them, and core's
    next load of the model merges its patches into them again. The engine's weights already
    carry the LoRA merge; a LowVramPatch would apply it twice. Weight wrappers from
    `add_weight_wrapper` are kept: they are meant to run at forward time. `comfy_cast_weights`
    is left alone: the cast path is still right (and needed for fp8 storage) when the weight
    already sits on the compute device.
    """
    _forget_core_marks(blocks, lowvram=False)
    lowvram_patch = comfy.model_patcher.LowVramPatch
    for block in blocks:
        for module in block.modules():
            for attr in ("weight_function", "bias_function"):
                funcs = getattr(module, attr, None)
                if funcs:
                    setattr(module, attr, [f for f in funcs if not isinstance(f, lowvram_patch)])
