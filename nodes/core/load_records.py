"""Which file each model core loaded was read from, recorded as it is loaded: what names the model's
shared host store (offload_core/sharing/store_key.py), so processes that load the same file with the
same options share one copy of its weights.

Why record it at the load: core keeps no such record in 0.3.75 (0.33's `cached_patcher_init`
names the path, not the file's version), and the version must be the one the bytes were read
from. So core's file loaders (`comfy.sd.load_diffusion_model`, `load_checkpoint_guess_config`,
`load_clip`; what the UNET, checkpoint and CLIP loader nodes and the pack's Tiered loaders call)
are wrapped once at start-up: each file's version (`file_identity.file_version`) is read before
and after the load, and a model whose file changed meanwhile is not recorded (its bytes belong to
no one version). Whether a file is still the one read later is file_identity's rule (`changed`): a
change of its metadata alone (chmod, chown, a hard link) is no change once its bytes are checked. A wrapper calls whatever was there before it (another pack's wrapper included)
and records nothing when its arguments do not name files; models from other loaders have no file
here and keep private host copies.
"""
from __future__ import annotations

import bisect
import functools
import inspect
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import comfy.sd
import torch

from ...offload_core.files.file_identity import file_version, same_bytes, witness_whole
from . import state

log = logging.getLogger(__name__)

_WRAPPED = "__tiered_offload_records_files__"
# core's loader -> the argument that names its file(s), and what of its result is which part
_LOADERS: dict[str, str] = {
    "load_diffusion_model": "unet_path",
    "load_checkpoint_guess_config": "ckpt_path",
    "load_clip": "ckpt_paths",
}
_NOT_OPTIONS = {"embedding_directory", "disable_dynamic"}  # what does not change the weights' bytes


def _modules(result: Any) -> list[tuple[str, Any]]:
    """(part, nn.Module) of each model in a loader's result: a ModelPatcher, a CLIP, or a tuple."""
    found = []
    for part, obj in enumerate(result if isinstance(result, (tuple, list)) else (result,)):
        patcher = getattr(obj, "patcher", None)  # CLIP, VAE
        if patcher is None and hasattr(obj, "model") and hasattr(obj, "load_device"):
            patcher = obj  # a ModelPatcher
        module = getattr(patcher, "model", None)
        if module is not None and hasattr(module, "parameters"):
            found.append((str(part), module))
    return found


def _versions(paths: list[str]) -> list[tuple[str, tuple[int, ...]]] | None:
    try:
        return [(os.path.realpath(p), file_version(os.stat(p))) for p in paths]
    except OSError:
        return None


def _recording(name: str, path_arg: str, load: Callable) -> Callable:
    signature = inspect.signature(load)

    @functools.wraps(load)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments[path_arg]
            paths = [given] if isinstance(given, (str, os.PathLike)) else list(given)
            paths = [os.fspath(p) for p in paths]
            options = {k: v for k, v in bound.arguments.items() if k != path_arg and k not in _NOT_OPTIONS}
        except (TypeError, KeyError):
            return load(*args, **kwargs)  # called in a way this wrapper does not read: record nothing
        before = _versions(paths)
        result = load(*args, **kwargs)
        after = _versions(paths)
        if before is None or before != after:
            log.info("[tiered offload] %s changed on disk while ComfyUI read it; its host copy stays "
                     "this process's own", " + ".join(os.path.basename(p) for p in paths))
            return result
        for part, module in _modules(result):
            state.MODEL_FILES[module] = {
                "loader": name, "part": part, "files": [[p, list(v)] for p, v in after], "options": options}
        return result

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file mapping of this process, by start (Linux; none elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, parts[5]))
    out.sort()
    return out


def mapped_file(tensors: Iterable[torch.Tensor]) -> str | None:
    """The regular file most of ``tensors`` are views of (a loader that maps its file), if any."""
    maps = mapped_files()
    starts = [m[0] for m in maps]
    paths = []
    for t in tensors:
        k = bisect.bisect_right(starts, t.data_ptr()) - 1
        if k >= 0 and maps[k][0] <= t.data_ptr() < maps[k][1]:
            paths.append(maps[k][2])
    if not paths:
        return None
    file = Counter(paths).most_common(1)[0][0]
    return file if os.path.isfile(file) else None


def _recording_mapped(load: Callable) -> Callable:
    """``load_diffusion_model_state_dict`` recording the file its state dict's tensors are mapped
    from (ComfyUI-GGUF's), read while the map surely exists: the load itself."""

    @functools.wraps(load)
    def wrapper(sd, *args, **kwargs):
        try:
            tensors = [t for t in sd.values() if isinstance(t, torch.Tensor) and t.device.type == "cpu"] \
                if isinstance(sd, dict) else []
            path = mapped_file(tensors) if tensors else None
            before = _versions([path]) if path is not None else None
        except Exception:  # the record is an optimisation: never the load's failure
            log.debug("[tiered offload] no mapped file found for a state dict", exc_info=True)
            before = None
        result = load(sd, *args, **kwargs)
        if before is not None and result is not None and _versions([path]) == before:
            for _, module in _modules(result):
                state.MAPPED_FILES[module] = {"files": [[p, list(v)] for p, v in before]}
        return result

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def install() -> None:
    """Wrap core's file loaders (once; a loader core lacks is left out), and the state-dict loader
    other packs' loaders call with mapped tensors."""
    for name, path_arg in _LOADERS.items():
        load = getattr(comfy.sd, name, None)
        if not callable(load) or getattr(load, _WRAPPED, False):
            continue
        if path_arg not in inspect.signature(load).parameters:
            log.info("[tiered offload] comfy.sd.%s takes no %s here; models it loads keep private host copies",
                     name, path_arg)
            continue
        setattr(comfy.sd, name, _recording(name, path_arg, load))
    load = getattr(comfy.sd, "load_diffusion_model_state_dict", None)
    if callable(load) and not getattr(load, _WRAPPED, False):
        comfy.sd.load_diffusion_model_state_dict = _recording_mapped(load)


def source_of(module) -> dict[str, Any] | None:
    """What ``module``'s weights were read from (loader, files with versions, options), or None."""
    return state.MODEL_FILES.get(module)


def mapped_source_of(module) -> dict[str, Any] | None:
    """The file ``module``'s tensors were mapped from at its load (``{"files": [[path, version]]}``),
    or None."""
    return state.MAPPED_FILES.get(module)


def witness(source: dict[str, Any]) -> None:
    """Have the bytes of ``source``'s files witnessed (once per file version, in the background),
    so a later change of their metadata alone can be told from a change of their bytes."""
    for path, version in source["files"]:
        witness_whole(path, tuple(version))


def changed(source: dict[str, Any], *, whole: bool = False) -> str | None:
    """Why the files of ``source`` are not the ones its bytes were read from any more, or None.
    A file whose metadata alone changed is unchanged where its bytes are checked the same
    (`file_identity.same_bytes`; ``whole``: only a check of every byte of the file counts)."""
    for path, version in source["files"]:
        if not os.path.exists(path):
            return f"{path} is gone"
        if same_bytes(path, tuple(version), whole=whole) is None:
            return f"{path} changed on disk"
    return None
