"""A small builder for API-format ComfyUI graphs: numbered nodes, links as [node_id, slot]."""
from __future__ import annotations

from typing import Any

Link = list  # [node_id, output_slot], as ComfyUI's API format writes it


class Graph:
    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}

    def add(self, class_type: str, **inputs: Any) -> str:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs}
        return node_id

    def of_class(self, *class_types: str) -> list[str]:
        return [nid for nid, node in self.nodes.items() if node["class_type"] in class_types]

    def to_api(self) -> dict[str, dict[str, Any]]:
        return {nid: {"class_type": n["class_type"], "inputs": dict(n["inputs"])}
                for nid, n in self.nodes.items()}


def out(node_id: str, slot: int = 0) -> Link:
    return [node_id, slot]


def is_link(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], int))
