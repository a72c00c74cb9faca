"""Where Apply Layerwise Offload may write its spill file: ComfyUI's temp folder, or a folder the
server's owner listed in the pack's settings file, and nowhere else.

Why a list and not any path: `spill_dir` comes from a workflow, and any client of ComfyUI's HTTP
API can queue one, so a free path would let it put a model-sized file wherever the server may
write: system folders, `/dev/shm` (which is RAM), a home folder. The list is "spill_dirs" in
<ComfyUI user directory>/tiered_offload.json, which no request can write (core/settings_file.py).
Paths are compared after `~`, variables, symlinks and `..` are resolved, so no spelling of a path
leads out of the allowed folders.
"""
from __future__ import annotations

import os

import folder_paths

from ..core import settings_file
from ..core.budgets import shorten

KEY = "spill_dirs"


def _real(folder: str) -> str:
    return os.path.normcase(os.path.realpath(folder))


def _listed() -> tuple[list[str], str | None]:
    """The folders the settings file lists, and why it could not be read (None if it could)."""
    try:
        listed = settings_file.read().get(KEY, [])
    except (OSError, ValueError) as e:
        return [], f"{settings_file.path()} cannot be read: {shorten(e, 200)}"
    if not isinstance(listed, list) or not all(isinstance(x, str) and os.path.isabs(x) for x in listed):
        return [], f'"{KEY}" in {settings_file.path()} must be a list of absolute folder paths'
    return listed, None


def _inside(folder: str, root: str) -> bool:
    try:
        return os.path.commonpath([folder, root]) == root
    except ValueError:  # another drive (Windows)
        return False


def spill_folder(text: str) -> str:
    """The real path of the folder for spill files: the node's input, or ComfyUI's temp folder
    when it is empty. ValueError, naming the input and the allowed folders, for any other
    folder, and for one that does not exist or cannot be written."""
    text = text.strip() if isinstance(text, str) else ""
    temp = folder_paths.get_temp_directory()
    if not text:
        os.makedirs(temp, exist_ok=True)
        folder = _real(temp)
    else:
        given = os.path.expandvars(os.path.expanduser(text))
        if not os.path.isabs(given):
            raise ValueError(f"Apply Layerwise Offload: spill_dir '{shorten(text)}' is not an absolute "
                             "folder path; leave it empty for ComfyUI's temp folder")
        folder = _real(given)
        listed, problem = _listed()
        if not any(_inside(folder, _real(root)) for root in [temp, *listed]):
            allowed = ", ".join([f"ComfyUI's temp folder ({temp})", *listed])
            raise ValueError(
                f"Apply Layerwise Offload: spill_dir '{shorten(text)}' is outside the folders a spill "
                f"file may go to: {allowed}. List the folder under \"{KEY}\" in "
                f"{settings_file.path()}, or leave spill_dir empty"
                + (f". {problem}" if problem else ""))
        if not os.path.isdir(folder):
            raise ValueError(f"Apply Layerwise Offload: spill_dir '{shorten(text)}' is not an existing folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"Apply Layerwise Offload: spill_dir '{shorten(folder)}' is not writable")
    return folder
