"""Which model a file is: ids that change whenever the file's bytes may have changed.

A model file that changed on disk is a different model (``model_id`` covers its ``file_version``:
inode, size and time stamps, the change time included, which no one can put back), so new bytes
never appear under an old id. ``source_key`` leaves the version out: one key for every version of
a file loaded with the same options, so a newer version can supersede the older one.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any


def file_version(st: os.stat_result) -> tuple[int, ...]:
    """What moves on whenever a file's bytes may have changed: its device and inode (a new file
    renamed over the name), its size, its modification time, and its inode change time. The last
    is why a version cannot be faked: a write moves it on, and so does putting the modification
    time back (``touch -d``, ``cp -p``), since that changes the inode too."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def model_id(source_path: str | os.PathLike[str], version: tuple[int, ...], options: Mapping[str, Any]) -> str:
    """A short stable id for a model file loaded with given options.

    The id covers the resolved path, the file's version (``file_version``) and the load options
    (JSON with sorted keys, non-JSON values by ``str``), so a re-saved file or a different dtype is
    a different model and never reuses a stale parked copy.
    """
    identity = json.dumps(
        {"path": os.path.realpath(os.fspath(source_path)), "version": [int(v) for v in version],
         "options": dict(options)},
        sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def source_key(source_path: str | os.PathLike[str], options: Mapping[str, Any]) -> str:
    """What ``model_id`` covers except the file's version: one key for every version of a file
    loaded with the same options, so a newer version can supersede the older one."""
    identity = json.dumps(
        {"path": os.path.realpath(os.fspath(source_path)), "options": dict(options)},
        sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]
