"""Which file a disk-streamed model was loaded from, and where its blocks' tensors are in it: what
lets the engine read blocks in place instead of writing a spill file (offload_core/disk/sources.py).

Two ways, in this order:
- Tensors that are views of a mapped file name it themselves (Linux: /proc/self/maps):
  ComfyUI-GGUF maps its file and hands out the raw quantized bytes. The file's header (GGUF)
  then says where every tensor is, also those the loader copied out (the norms' float weights).
  The map is also looked up at the load itself (core/load_records.py), so a model whose blocks an
  earlier run moved out of the map (streamed from RAM) is still known by its file.
- Core's loaders copy a safetensors file's tensors into the model; the pack records which file
  each model core loads was read from (core/load_records.py: core's UNET and checkpoint loaders
  and the pack's Tiered ones, whatever nodes pass the model on after). The file's header says
  where each tensor is; keys are matched with whatever prefix the file uses (a checkpoint's
  `model.diffusion_model.`, a bare diffusion model's none), and a tensor the model holds in
  another dtype than the file (a cast at load) is left out, so its unit goes to the spill file.

Nothing found here is trusted blindly: the engine compares every unit's bytes in the file with the
loaded tensors at its first read, and writes a unit that differs to the spill file instead.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ...offload_core.disk.file_headers import gguf_tensors, safetensors_tensors
from ...offload_core.disk.in_place import ModelFileMap
from ...offload_core.host.released import note_of
from ...offload_core.host.tensor_refs import tensor_refs
from ..core import load_records

log = logging.getLogger(__name__)

# The dtype a loaded tensor has when it holds the file's bytes as they are, by the file's type
# name (safetensors and GGUF); GGUF's quantized types are loaded as raw bytes.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _block_tensors(blocks: Sequence[torch.nn.Module]) -> list[tuple[int, str, torch.Tensor]]:
    """(block index, path inside the block, tensor) of every plain tensor the blocks hold; a
    tensor released by an earlier engine needs no finding (its note says where it is)."""
    out = []
    for b, block in enumerate(blocks):
        for ref, t in tensor_refs(block, b):
            if note_of(t) is None and t.device.type == "cpu" and t.numel():
                out.append((b, ref.path, t))
    return out


def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def recorded_file(model: torch.nn.Module) -> str | None:
    """The one file core read ``model`` from, or whose map its tensors were views of at the load
    (core/load_records.py), if the pack saw the load and the file is still the one read; None
    otherwise (logged when it changed)."""
    source = load_records.source_of(model) or load_records.mapped_source_of(model)
    if source is None or len(source["files"]) != 1:
        return None
    why = load_records.changed(source)
    if why is not None:
        log.info("[tiered offload] Apply Layerwise Offload: %s since the model was loaded; streamed blocks go "
                 "to a spill file", why)
        return None
    return source["files"][0][0]


def _from_header(path: str, tensors: list[tuple[int, str, torch.Tensor]],
                 prefixes: Sequence[str]) -> tuple[ModelFileMap | None, int]:
    """Where the tensors are in a safetensors or GGUF file, with the dtype it holds each in (the
    engine spills one loaded in another dtype); with how many the file holds in another dtype."""
    try:
        header = gguf_tensors(path) if _is_gguf(path) else safetensors_tensors(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        log.info("[tiered offload] Apply Layerwise Offload: %s cannot be read in place (%s)", path, e)
        return None, 0
    names = [(b, p, f"{prefixes[b].split('.', 1)[-1]}.{p}", t) for b, p, t in tensors]
    if not names:
        return None, 0
    probe = names[0][2]
    candidates = {key[: -len(probe)] for key in header if key.endswith(probe)
                  and (len(key) == len(probe) or key[-len(probe) - 1] == ".")}
    best, best_count = None, 0
    for prefix in candidates:
        count = sum(f"{prefix}{name}" in header for _, _, name, _ in names)
        if count > best_count:
            best, best_count = prefix, count
    if best is None:
        return None, 0
    found, cast = {}, 0
    for b, p, name, t in names:
        entry = header.get(f"{best}{name}")
        if entry is None:
            continue
        offset, nbytes, kind = entry
        held = _DTYPES.get(kind, torch.uint8)  # a quantized type: raw bytes
        nbytes = t.numel() * t.element_size() if nbytes is None else nbytes  # checked at the first read
        cast += held != t.dtype
        found[(b, p)] = (offset, nbytes, held)
    return (ModelFileMap(path, found) if found else None), cast


def find(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], prefixes: Sequence[str],
         model_class: str) -> ModelFileMap | None:
    """The model's file and where its blocks' tensors are in it, or None (logged: why)."""
    tensors = _block_tensors(blocks)
    if not tensors:
        return None
    path = load_records.mapped_file(t for _, _, t in tensors) or recorded_file(model)
    if path is None:
        log.info("[tiered offload] Apply Layerwise Offload: the file %s was loaded from is not known (its "
                 "loader is not one the pack knows); streamed blocks go to a spill file", model_class)
        return None
    found, cast = _from_header(path, tensors, prefixes)
    if found is None:
        log.info("[tiered offload] Apply Layerwise Offload: none of %s's block tensors are in %s as loaded; streamed "
                 "blocks go to a spill file", model_class, path)
        return None
    log.info("[tiered offload] Apply Layerwise Offload: %d of %s's %d block tensors can be read in place from %s%s",
             len(found.tensors) - cast, model_class, len(tensors), path,
             f" ({cast} are loaded in another dtype than the file's)" if cast else "")
    return found
