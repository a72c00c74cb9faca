"""The stripped twin of a prompt: the same graph with the pack's nodes taken out.

Pass-through nodes (Apply Layerwise Offload, Model-Level Swap, VRAM Tier Manager) disappear and
every link to one of their outputs is rewired to the input it passes through; Tiered loaders
become the core loaders they are twins of, with the same inputs. Every other node keeps its id,
so outputs and errors of the two runs can be matched node by node.
"""
from __future__ import annotations

from typing import Any

from .workflow import is_link

PASS_THROUGH: dict[str, dict[int, str]] = {
    "ApplyLayerwiseOffload": {0: "model"},
    "ModelLevelSwap": {0: "model", 1: "clip"},
    "VRAMTierManager": {0: "model", 1: "clip", 2: "vae"},
}
CORE_LOADER = {
    "TieredUNETLoader": "UNETLoader",
    "TieredCheckpointLoader": "CheckpointLoaderSimple",
    "TieredCLIPLoader": "CLIPLoader",
    "TieredVAELoader": "VAELoader",
}
PACK_NODES = frozenset(PASS_THROUGH) | frozenset(CORE_LOADER)


def _resolve(wf: dict[str, dict[str, Any]], link: list) -> list:
    seen = set()
    while wf[link[0]]["class_type"] in PASS_THROUGH:
        if link[0] in seen:
            raise ValueError(f"cycle through pass-through node {link[0]}")
        seen.add(link[0])
        node = wf[link[0]]
        name = PASS_THROUGH[node["class_type"]].get(link[1])
        source = node["inputs"].get(name) if name else None
        if not is_link(source):
            raise ValueError(f"node {link[0]} ({node['class_type']}) output {link[1]} passes "
                             "nothing through: the twin has no equivalent")
        link = source
    return list(link)


def strip(wf: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return the twin of an API-format workflow (the input is not modified)."""
    twin = {}
    for node_id, node in wf.items():
        class_type = node["class_type"]
        if class_type in PASS_THROUGH:
            continue
        inputs = {k: (_resolve(wf, v) if is_link(v) else v) for k, v in node["inputs"].items()}
        twin[node_id] = {"class_type": CORE_LOADER.get(class_type, class_type), "inputs": inputs}
    return twin
