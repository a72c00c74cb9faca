"""Smaller variants of one prompt, for shrinking a failing replay node by node.

A variant bypasses one model operation (its outputs rewired to the inputs it passes through),
turns a Tiered loader into its core loader, or drops one of several outputs; nodes no output
depends on any more are removed. The twin is rebuilt from the variant, so P and Q stay twins.
"""
from __future__ import annotations

import copy
from typing import Any, Iterator

from .twin import CORE_LOADER, PASS_THROUGH, strip
from .workflow import is_link

BYPASS: dict[str, dict[int, str]] = {
    **PASS_THROUGH,
    "LoraLoaderModelOnly": {0: "model"},
    "TieredTestBlockReplace": {0: "model"},
    "TorchCompileModel": {0: "model"},
    "TieredTestCompileBlocks": {0: "model"},
}
OUTPUTS = ("TieredTestLatentStats", "TieredTestConditioningStats")


def _prune(wf: dict[str, Any]) -> dict[str, Any]:
    """Keep only the output nodes and what they depend on."""
    keep: set[str] = set()
    todo = [nid for nid, n in wf.items() if n["class_type"] in OUTPUTS]
    while todo:
        nid = todo.pop()
        if nid in keep:
            continue
        keep.add(nid)
        todo += [v[0] for v in wf[nid]["inputs"].values() if is_link(v)]
    return {nid: n for nid, n in wf.items() if nid in keep}


def _bypass(wf: dict[str, Any], node_id: str) -> dict[str, Any] | None:
    mapping = BYPASS[wf[node_id]["class_type"]]
    out = copy.deepcopy(wf)
    for node in out.values():
        for name, value in node["inputs"].items():
            if is_link(value) and value[0] == node_id:
                source = wf[node_id]["inputs"].get(mapping.get(value[1], ""))
                if not is_link(source):
                    return None
                node["inputs"][name] = list(source)
    del out[node_id]
    return _prune(out)


def variants(step: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(what changed, smaller step) for every single reduction of a prompt step."""
    wf = step["p"]
    outputs = [nid for nid, n in wf.items() if n["class_type"] in OUTPUTS]
    candidates: list[tuple[str, dict[str, Any] | None]] = []
    if len(outputs) > 1:
        for nid in outputs:
            candidates.append((f"drop output {nid}", _prune({k: v for k, v in wf.items() if k != nid})))
    for nid, node in wf.items():
        if node["class_type"] in BYPASS:
            candidates.append((f"bypass {nid}:{node['class_type']}", _bypass(wf, nid)))
        elif node["class_type"] in CORE_LOADER:
            core = copy.deepcopy(wf)
            core[nid]["class_type"] = CORE_LOADER[node["class_type"]]
            candidates.append((f"core loader for {nid}", core))
    for what, smaller in candidates:
        if smaller:
            yield what, {**step, "p": smaller, "q": strip(smaller)}
