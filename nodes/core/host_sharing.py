"""Whether and where a model's host copy is shared with the machine's other ComfyUI processes.

A node asks for a `HostShare` (offload_core/host/shared_packing.py) for one model; it gets one
when all of these allow it, else None and the reason, which the log and the panel show:
- the node's own input (`share_host_memory`), and the server owner's switch: "share_host_memory"
  in the pack's settings file (core/settings_file.py), true unless set to false;
- the system: Linux (shared locks that vanish with their process, files allocated up front);
- the model: core read it from a file the pack saw it read (core/model_files.py), which names
  the store, so two processes share only the bytes of one file's one version, loaded alike.

Where: below "shared_memory_dir" of the settings file (default /dev/shm, which is RAM), in a folder
of the user's own (offload_core/host/store_folder.py). Where that has no room (a container's
64 MiB /dev/shm), in a disk folder the server's owner allows, by the rules a spill file follows:
the node's `spill_dir` when it names one, then the folders listed under "spill_dirs", but never
ComfyUI's temp folder, which every ComfyUI start empties (a second worker's start would take the
first one's store away). Without room anywhere the model is packed in the process's own memory,
and the log and the panel say so.

When a store goes: the last process to let go of it removes it, at the latest when it ends. A
process ended by SIGTERM (how ComfyUI-Distributed, systemd and docker stop a worker) runs no exit
handlers, so the pack lets go of its stores on that signal and then ends as it would have
(`let_go_on_sigterm`); a process killed outright (SIGKILL, a crash) leaves them to the next
process that starts (`sweep`) or to the last one still holding them.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import folder_paths

from ...offload_core.host import shared_store
from ...offload_core.host.shared_packing import HostShare
from ...offload_core.host.store_folder import DISK, SHARED_MEMORY, SUPPORTED, StoreFolder
from . import model_files, settings_file
from .budgets import shorten

log = logging.getLogger(__name__)

SWITCH = "share_host_memory"
FOLDER = "shared_memory_dir"
SPILL_DIRS = "spill_dirs"
DEFAULT_FOLDER = "/dev/shm"


def _settings() -> dict[str, Any]:
    try:
        return settings_file.read()
    except (OSError, ValueError) as e:
        log.warning("tiered offload: %s cannot be read (%s); sharing host memory as by default",
                    settings_file.path(), shorten(e, 200))
        return {}


def _real(folder: str) -> str:
    return os.path.normcase(os.path.realpath(folder))


def _disk_folders(settings: dict[str, Any], spill_dir: str | None) -> list[str]:
    """Disk folders the server's owner allows for stores, in order: the node's spill folder, then
    the listed ones; never ComfyUI's temp folder."""
    listed = settings.get(SPILL_DIRS, [])
    if not isinstance(listed, list):
        listed = []
    temp = _real(folder_paths.get_temp_directory())
    out: list[str] = []
    for folder in [spill_dir, *listed]:
        if isinstance(folder, str) and os.path.isabs(folder) and _real(folder) != temp \
                and os.path.commonpath([_real(folder), temp]) != temp and _real(folder) not in out:
            out.append(_real(folder))
    return out


def memory_folder(settings: dict[str, Any] | None = None) -> str:
    """The root of the shared-memory store folder: the settings file's, or /dev/shm."""
    settings = _settings() if settings is None else settings
    folder = settings.get(FOLDER, DEFAULT_FOLDER)
    if not isinstance(folder, str) or not os.path.isabs(folder):
        raise ValueError(f'"{FOLDER}" in {settings_file.path()} must be an absolute folder path')
    return folder


def share_for(module, wanted: bool, *, spill_dir: str | None = None) -> tuple[HostShare | None, str | None]:
    """A request to share ``module``'s host copy, or None and why not."""
    if not wanted:
        return None, "sharing turned off on the node"
    settings = _settings()
    if settings.get(SWITCH, True) is False:
        return None, f'sharing turned off in {settings_file.path()} ("{SWITCH}": false)'
    if not SUPPORTED:
        return None, "sharing host memory needs Linux"
    source = model_files.source_of(module)
    if source is None:
        return None, "ComfyUI loaded this model in a way that names no file"
    folders = [StoreFolder(memory_folder(settings), SHARED_MEMORY)]
    folders += [StoreFolder(folder, DISK) for folder in _disk_folders(settings, spill_dir)]
    return HostShare(source, tuple(folders)), None


def check_unchanged(share: HostShare | None, who: str) -> None:
    """Refuse (ValueError) to run a model whose host copy is shared when its file changed since
    the process read it: the store holds the old file's bytes, and a process that loads the file
    now would run the new ones, so two workers of one machine would give two results for one
    workflow without a word. ComfyUI reads the file again once it unloads the model."""
    if share is None:
        return
    why = model_files.changed(dict(share.source))
    if why is not None:
        raise ValueError(
            f"{who}: {shorten(why, 300)} since ComfyUI loaded this model, and its host copy is shared "
            "with the machine's other ComfyUI processes: they would run different weights for the same "
            "workflow. Unload the model (the Offload panel's Unload, or ComfyUI's Unload Models) so it "
            "is read again, or turn share_host_memory off.")


def sweep() -> None:
    """At start-up: remove the stores that processes which ended left behind, in every folder."""
    try:
        settings = _settings()
        roots = [(memory_folder(settings), SHARED_MEMORY)] + [(f, DISK) for f in _disk_folders(settings, None)]
        for root, kind in roots:
            if os.path.isdir(root):
                StoreFolder(root, kind).sweep()
    except Exception:
        log.exception("tiered offload: could not look for shared host stores left by ended processes")


def let_go_on_sigterm() -> None:
    """On SIGTERM, let go of this process's stores, then do what the signal did before (the
    handler that was there, or the default: end the process)."""
    if not SUPPORTED or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        shared_store.let_go_of_all()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
