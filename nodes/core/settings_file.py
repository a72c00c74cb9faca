"""The pack's settings file, <ComfyUI user directory>/tiered_offload.json: what only whoever runs
the server decides.

Why a file there and not a frontend setting: ComfyUI's HTTP API writes a user's settings and files
only inside that user's own folder below the user directory (`/settings`, `/userdata`), so no
request can write this file, and no workflow or API client can widen what it allows. Keys:
"preload" (nodes/tiers/preload.py), "spill_dirs" (nodes/layerwise/spill_folder.py), and the shared
host store's "share_host_memory", "shared_memory_dir" and "shared_memory_max_share"
(nodes/core/host_sharing.py).
"""
from __future__ import annotations

import json
import os
from typing import Any

import folder_paths

NAME = "tiered_offload.json"


def path() -> str:
    return os.path.join(folder_paths.get_user_directory(), NAME)


def read() -> dict[str, Any]:
    """The file's JSON object, {} when there is none. Raises OSError or ValueError (not UTF-8 JSON,
    not an object, nested too deep) when it cannot be used."""
    where = path()
    if not os.path.exists(where):
        return {}
    with open(where, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except RecursionError:
            raise ValueError("the JSON is nested too deep") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data
