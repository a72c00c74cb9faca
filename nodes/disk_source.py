"""Which safetensors file a diffusion model was loaded from, and where a spill file may go.

The disk tier reads blocks straight from the model's own file when the loaded tensors are that
file's bytes (the engine checks this byte for byte, pack by pack). ComfyUI does not always say
which file a model came from, so the candidates are tried in this order:
1. a Tiered loader's model: the manager registered its file;
2. ComfyUI 0.33 records how to reload a model, `cached_patcher_init = (load_diffusion_model,
   (path, options))` (or the checkpoint loader with the path first);
3. 0.33 with Dynamic VRAM tags memory-mapped tensors' storages with `_comfy_tensor_file_slice`
   (file handle, offset, size): the handle names the file;
4. otherwise (0.3.75's core loaders keep nothing) the model folders are searched: a file whose
   header has the blocks' tensors (names, dtypes, shapes) and whose bytes for one of them equal
   the loaded tensor's.
The key mapping strips ComfyUI's `diffusion_model.` and puts the file's own prefix in front
(`model.diffusion_model.` in a checkpoint, nothing in a diffusion-model file). Formats ComfyUI
converts on load (diffusers names, fused qkv) map to nothing, and those blocks are spilled.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

import folder_paths

from ..offload_core.disk import ModelFile, TensorInFile, read_safetensors_index

log = logging.getLogger(__name__)

MODEL_PREFIX = "diffusion_model."
SEARCH_FOLDERS = ("diffusion_models", "checkpoints")
SUFFIXES = (".safetensors", ".sft")
_index_cache: dict[tuple[str, int, int], dict[str, TensorInFile] | None] = {}


def _index(path: str) -> dict[str, TensorInFile] | None:
    """A file's tensor index, read once per (path, size, mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _index_cache:
        try:
            _index_cache[key] = read_safetensors_index(path)
        except (OSError, ValueError, UnicodeDecodeError):
            _index_cache[key] = None
    return _index_cache[key]


def _probes(block_prefixes: Sequence[str], blocks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Block tensors to recognise the file by: (key without `diffusion_model.`, tensor), the first
    and last of the first and last blocks. The first one's bytes are compared too."""
    named = [(f"{prefix}.{name}", t) for prefix, block in zip(block_prefixes, blocks)
             for name, t in [*block.named_parameters(), *block.named_buffers()]]
    named = [(k[len(MODEL_PREFIX):] if k.startswith(MODEL_PREFIX) else k, t) for k, t in named]
    if not named:
        return []
    return [named[0]] if len(named) == 1 else [named[0], named[-1]]


def _prefix_in(index: dict[str, TensorInFile], probes: list[tuple[str, torch.Tensor]]) -> str | None:
    """The prefix that turns the probes' keys into the file's, if the file holds them all alike."""
    key0 = probes[0][0]
    for file_key in index:
        if not file_key.endswith(key0):
            continue
        prefix = file_key[: len(file_key) - len(key0)]
        if prefix and not prefix.endswith("."):
            continue
        if all((f := index.get(prefix + k)) is not None and f.dtype == t.dtype and f.shape == tuple(t.shape)
               for k, t in probes):
            return prefix
    return None


def _bytes_equal(path: str, found: TensorInFile, t: torch.Tensor, limit: int = 1 << 20) -> bool:
    """Whether the file's bytes for ``t`` start like ``t``'s own (up to ``limit`` bytes)."""
    if not t.is_contiguous() or t.numel() == 0:
        return False
    mine = t.detach().reshape(-1).view(torch.uint8)[:limit].cpu()
    with open(path, "rb") as f:
        f.seek(found.offset)
        data = f.read(mine.numel())
    return len(data) == mine.numel() and torch.equal(mine, torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _candidate_paths(patcher, blocks: Sequence[torch.nn.Module]) -> list[tuple[str, str]]:
    """(path, how it was found) from what ComfyUI and the tier manager recorded."""
    out = []
    from . import tiers  # the tier manager builds on the layerwise node

    key = tiers.key_of(patcher)
    if key is not None:
        backend = tiers.MANAGER.get(key).backend
        source = getattr(backend, "source", None)
        if source is not None:
            out.append((source.path, "Tiered loader"))
    init = getattr(patcher, "cached_patcher_init", None)
    if isinstance(init, tuple) and len(init) >= 2 and isinstance(init[1], tuple) and init[1] \
            and isinstance(init[1][0], str):
        out.append((init[1][0], "ComfyUI's reload recipe"))
    for block in blocks[:1]:
        for t in block.parameters():
            tag = getattr(t.untyped_storage(), "_comfy_tensor_file_slice", None)
            handle = getattr(tag, "file_ref", None)
            name = getattr(handle, "name", None)
            if isinstance(name, str):
                out.append((name, "ComfyUI's memory map"))
                break
    return out


def _search_paths() -> list[str]:
    paths = []
    for folder in SEARCH_FOLDERS:
        try:
            names = folder_paths.get_filename_list(folder)
        except (KeyError, OSError):
            continue
        for name in names:
            if name.lower().endswith(SUFFIXES):
                full = folder_paths.get_full_path(folder, name)
                if full:
                    paths.append(full)
    return paths


def model_file(patcher, block_prefixes: Sequence[str], blocks: Sequence[torch.nn.Module]) -> ModelFile | None:
    """The model's own safetensors file with its key mapping, or None (every block is spilled).

    Call it while the blocks hold their base weights on the host (after the hand-over from core),
    because the first tensor's bytes are compared with the file's."""
    probes = _probes(block_prefixes, blocks)
    if not probes:
        return None
    recorded = _candidate_paths(patcher, blocks)
    searched = [(p, "search of the model folders") for p in _search_paths()]
    seen: set[str] = set()
    for path, how in recorded + searched:
        if path in seen or not path.lower().endswith(SUFFIXES):
            continue
        seen.add(path)
        index = _index(path)
        prefix = _prefix_in(index, probes) if index else None
        if prefix is None:
            continue
        first_key, first = probes[0]
        if not _bytes_equal(path, index[prefix + first_key], first):
            continue
        log.info("Apply Layerwise Offload: blocks can be read from %s (found by %s)", path, how)
        return ModelFile(path, _key_mapper(block_prefixes, prefix))
    log.info("Apply Layerwise Offload: the model's own file is unknown or holds other bytes; blocks "
             "streamed from disk go to a spill file")
    return None


def _key_mapper(block_prefixes: Sequence[str], prefix: str):
    stripped = [p[len(MODEL_PREFIX):] if p.startswith(MODEL_PREFIX) else p for p in block_prefixes]

    def key_of(block: int, path: str) -> str | None:
        if not 0 <= block < len(stripped):
            return None
        return f"{prefix}{stripped[block]}.{path}"

    return key_of


def spill_folder(text: str) -> str:
    """The folder for spill files: the node's input, or ComfyUI's temp folder when it is empty."""
    folder = os.path.expandvars(os.path.expanduser(text.strip())) if text and text.strip() else \
        folder_paths.get_temp_directory()
    if text and text.strip() and not os.path.isdir(folder):
        raise ValueError(f"Apply Layerwise Offload: spill_dir '{text.strip()}' is not an existing folder")
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise ValueError(f"Apply Layerwise Offload: spill_dir '{folder}' is not writable")
    return folder
