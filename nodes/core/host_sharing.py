"""Whether and where a model's host copy is shared with the machine's other ComfyUI processes.

A node asks for a `HostShare` (offload_core/sharing/shared_packing.py) for one model; it gets one
when all of these allow it, else None and the reason, which the log and the panel show:
- the node's own input (`share_host_memory`), and the server owner's switch: "share_host_memory"
  in the pack's settings file (core/settings_file.py), true unless set to false;
- the system: Linux (shared locks that vanish with their process, files allocated up front);
- the model: core read it from a file the pack saw it read (core/load_records.py), which names
  the store, so two processes share only the bytes of one file's one version, loaded alike.

Where: below "shared_memory_dir" of the settings file, in a folder of the user's own
(offload_core/sharing/store_folder.py). By default that is first the user's runtime folder
($XDG_RUNTIME_DIR, /run/user/<uid>) where it is a folder of shared memory only the user may write
to, then /dev/shm (also RAM) for what the runtime folder cannot hold (it is often a tenth of the
RAM): in /dev/shm, another local user can make the store folder's name first, which only makes
the pack keep private copies.
One store takes at most "shared_memory_max_share" (a fraction, default 0.5) of that folder's
size, so one model cannot fill the shared memory everything else on the machine needs too.
Where that has no room (a container's
64 MiB /dev/shm), in a disk folder the server's owner allows, by the rules a spill file follows:
the node's `spill_dir` when it names one, then the folders listed under "spill_dirs", but never
ComfyUI's temp folder, which every ComfyUI start empties (a second worker's start would take the
first one's store away). Without room anywhere the model is packed in the process's own memory,
and the log and the panel say so.

Sharing never fails a prompt: whatever keeps a store from being used (a folder that is not the
user's own, no room, a store file changed by someone else, a packer that stopped) gives a private
copy, and the log and the panel say why and what to do.

When a store goes: the last process to let go of it removes it, at the latest when it ends. A
process ended by SIGTERM (how ComfyUI-Distributed, systemd and docker stop a worker) runs no exit
handlers, so the pack lets go of its stores on that signal and then ends as it would have
(`let_go_on_sigterm`); a process killed outright (SIGKILL, a crash) leaves them to the last one
still holding them, or to the next look of any process (`sweep`: at start, at every pack and at
every prompt's end).
"""
from __future__ import annotations

import logging
import os
import signal
import stat
import threading
from typing import Any

import folder_paths

from ...offload_core.files.file_identity import file_system
from ...offload_core.sharing import shared_store
from ...offload_core.sharing.shared_packing import HostShare
from ...offload_core.sharing.store_folder import (
    DEFAULT_MAX_SHARE,
    DISK,
    SHARED_MEMORY,
    SUPPORTED,
    StoreFolder,
    max_share,
)
from . import load_records, settings_file
from .budgets import shorten

log = logging.getLogger(__name__)

SWITCH = "share_host_memory"
FOLDER = "shared_memory_dir"
MAX_SHARE = "shared_memory_max_share"
SPILL_DIRS = "spill_dirs"
SHARED_MEMORY_FOLDER = "/dev/shm"  # the default where the user has no runtime folder in shared memory


def _settings() -> dict[str, Any]:
    try:
        return settings_file.read()
    except (OSError, ValueError) as e:
        log.warning("[tiered offload] %s cannot be read (%s); sharing host memory as by default",
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


def runtime_folder() -> str | None:
    """The user's runtime folder ($XDG_RUNTIME_DIR, else /run/user/<uid>) where it is a real
    folder of this user closed to everyone else, in shared memory (tmpfs; kept where the system
    does not say): below it no other user can make the store folder first."""
    for folder in (os.environ.get("XDG_RUNTIME_DIR"), f"/run/user/{os.geteuid()}"):
        if not folder or not os.path.isabs(folder):
            continue
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700 \
                and file_system(st.st_dev) in ("tmpfs", None):
            return folder
    return None


def memory_folders(settings: dict[str, Any] | None = None) -> list[str]:
    """The roots of the shared-memory store folders, in order: the settings file's alone, else the
    user's runtime folder (``runtime_folder``, where there is one) and then /dev/shm, so a model
    the runtime folder cannot hold is still shared."""
    settings = _settings() if settings is None else settings
    if FOLDER not in settings:
        runtime = runtime_folder()
        return [runtime, SHARED_MEMORY_FOLDER] if runtime else [SHARED_MEMORY_FOLDER]
    folder = settings[FOLDER]
    if not isinstance(folder, str) or not os.path.isabs(folder):
        raise ValueError(f'"{FOLDER}" in {settings_file.path()} must be an absolute folder path')
    return [folder]


def memory_store_folders(settings: dict[str, Any]) -> list[StoreFolder]:
    """The shared-memory store folders, each with the share of it one store may take."""
    where = f'"{MAX_SHARE}" in {settings_file.path()}'
    share = max_share(settings.get(MAX_SHARE, DEFAULT_MAX_SHARE), where)
    return [StoreFolder(root, SHARED_MEMORY, max_share=share,
                        choose_another=f'set "{FOLDER}" in {settings_file.path()} to a folder of your own')
            for root in memory_folders(settings)]


def share_for(module, wanted: bool, *, spill_dir: str | None = None) -> tuple[HostShare | None, str | None]:
    """A request to share ``module``'s host copy, or None and why not."""
    if not wanted:
        return None, "sharing turned off on the node"
    settings = _settings()
    if settings.get(SWITCH, True) is False:
        return None, f'sharing turned off in {settings_file.path()} ("{SWITCH}": false)'
    if not SUPPORTED:
        return None, "sharing host memory needs Linux"
    source = load_records.source_of(module)
    if source is None:
        return None, "ComfyUI loaded this model in a way that names no file"
    folders = memory_store_folders(settings)
    folders += [StoreFolder(folder, DISK) for folder in _disk_folders(settings, spill_dir)]
    return HostShare(source, tuple(folders)), None


def check_unchanged(share: HostShare | None, who: str) -> None:
    """Refuse (ValueError) to run a model whose host copy is shared when its file changed since
    the process read it: the store holds the old file's bytes, and a process that loads the file
    now would run the new ones, so two workers of one machine would give two results for one
    workflow without a word. ComfyUI reads the file again once it unloads the model.

    A change of the file's metadata alone (chmod, chown, a hard link) is not refused where every
    byte of the file reads back as witnessed (core/load_records.py `changed`): the first check of an
    unchanged file starts that witness, once per file version, in the background."""
    if share is None:
        return
    source = dict(share.source)
    why = load_records.changed(source, whole=True)
    if why is None:
        load_records.witness(source)
        return
    raise ValueError(
        f"{who}: {shorten(why, 300)} since ComfyUI loaded this model, and its host copy is shared "
        "with the machine's other ComfyUI processes: they would run different weights for the same "
        "workflow. Unload the model (the Offload panel's Unload, or ComfyUI's Unload Models) so it "
        "is read again, or turn share_host_memory off.")


def sweep(*, if_due: bool = False) -> None:
    """Remove the stores that processes which ended left behind, in every folder: at start-up,
    and (``if_due``: at most once a second per folder, ``StoreFolder.sweep_if_due``) at every
    prompt's end, so a killed worker's store does not wait for a restart. Never raises."""
    try:
        settings = _settings()
        folders = [StoreFolder(root, SHARED_MEMORY) for root in memory_folders(settings)]
        folders += [StoreFolder(f, DISK) for f in _disk_folders(settings, None)]
        for folder in folders:
            if if_due:
                folder.sweep_if_due()
            else:
                folder.sweep()
    except Exception:
        log.exception("[tiered offload] could not look for shared host stores left by ended processes")


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
