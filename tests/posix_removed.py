"""A pytest plugin (``-p posix_removed``) that takes away, before the pack is imported, the POSIX
calls Windows does not have, so that the pack's code takes the branches it takes there.

Why a plugin: the pack decides some things when it is imported (whether host stores can be
shared, which read call to use), so the calls must be gone before the first test module imports
it, and stay gone for the whole session. What goes: positional reads and writes
(``pread``, ``preadv``, ``pwrite``), ``posix_fadvise``, ``posix_fallocate``, the open flags
``O_DIRECT`` and ``O_NOFOLLOW``, and the ``fcntl`` module (``flock``). Everything else the
platform differs in (drive letters, its file-sharing rules) cannot be taken away on Linux.
"""
from __future__ import annotations

import os
import sys

REMOVED_CALLS = ("pread", "preadv", "pwrite", "posix_fadvise", "posix_fallocate", "O_DIRECT", "O_NOFOLLOW")
REMOVED_MODULES = ("fcntl",)
PACK_MODULES = ("offload_core", "nodes")


def _remove() -> None:
    imported = [name for name in sys.modules if name.split(".")[0] in PACK_MODULES]
    if imported:
        raise RuntimeError(f"posix_removed must load before the pack; already imported: {imported}")
    for name in REMOVED_CALLS:
        if hasattr(os, name):
            delattr(os, name)
    # Libraries that pick their file lock when imported (torch.compile's cache takes filelock's)
    # keep the one they have on this OS: the pack's calls are what is taken away, not theirs.
    import filelock  # noqa: F401
    for name in REMOVED_MODULES:
        sys.modules[name] = None  # a later ``import fcntl`` raises ImportError, as on Windows


_remove()  # at the plugin's import: ``-p`` plugins load before any conftest.py

