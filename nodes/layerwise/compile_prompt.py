"""The torch.compile nodes of a prompt, as Apply Layerwise Offload names them and reads them.

A refusal raised while sampling shows on the sampler, not on the node to change, so each names
that node first, as the user sees it: its title and id ("TorchCompileModel (node 7)"). And a
compile that the node's settings cannot keep is refused when the prompt is queued, where the
prompt shows it (compile_policy.py): that needs the settings of the compile node, read from the
prompt's inputs.

The prompt comes from the queue: while sampling, the graph of the prompt that runs
(core/prompt_lifecycle.py); when the node's inputs are validated, the graph just posted, which a
`/prompt` handler keeps for the request that validates it (`remember_posted`, `posted_graph`).
Without either, nothing is named or read, and the refusal at sampling still says what to change.

A compile node is one on this node's model path (upstream through each node's `model` input,
downstream through the nodes whose `model` input takes one of those) whose class names a compile
of a model: ComfyUI's TorchCompileModel, KJNodes' TorchCompileModel… nodes, and the like. Core's
compile wrapper keeps one compile per model, the last one set: the nearest to the sampler.
"""
from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass
from typing import Any

from ..core import prompt_lifecycle

OFFLOAD_TITLE = "Apply Layerwise Offload"
_COMPILE_CLASS = re.compile(r"(?i)torch_?compile|compile_?(model|blocks)")
# Nodes whose inputs say how they compile: {class: whether it compiles the whole model by
# default}. KJNodes' nodes compile each block on its own unless compile_transformer_blocks_only is
# off; TorchCompileModelWanVideoV2 is deprecated in favour of TorchCompileModelAdvanced.
_READABLE = {"TorchCompileModel": True, "TorchCompileModelAdvanced": False,
             "TorchCompileModelWanVideoV2": False}
_DYNAMIC = {"auto": None, "true": True, "false": False, True: True, False: False}
_posted: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tiered_offload_posted",
                                                                     default=None)


@dataclass(frozen=True)
class CompileNode:
    """A compile node of the prompt; ``kwargs`` (torch.compile's) and ``whole`` (it compiles the
    whole diffusion model) as its inputs say, None where they do not (another class, a link)."""

    node_id: str
    label: str
    whole: bool | None = None
    kwargs: dict[str, Any] | None = None


def install() -> None:
    """Keep each posted graph for its validation (a `/prompt` handler, where the server has them)."""
    from server import PromptServer

    add = getattr(PromptServer.instance, "add_on_prompt_handler", None)
    if callable(add):
        add(remember_posted)


def remember_posted(json_data: dict) -> dict:
    """A `/prompt` handler: keep the posted graph for this request's validation."""
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    _posted.set(prompt if isinstance(prompt, dict) else None)
    return json_data


def posted_graph() -> dict | None:
    """The graph posted in the request being validated, if a handler kept it."""
    return _posted.get()


def running_graph() -> dict | None:
    """The graph of the prompt that runs now."""
    return prompt_lifecycle.current_prompt_graph()


def label(graph: dict | None, node_id: str | None, fallback: str) -> str:
    """A node as the user sees it: its title (or ``fallback``) and its id."""
    node = (graph or {}).get(node_id) if node_id is not None else None
    title = ((node or {}).get("_meta") or {}).get("title") or fallback
    return title if node_id is None else f"{title} (node {node_id})"


def _link(value: Any) -> str | None:
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)):
        return str(value[0])
    return None


def model_path(graph: dict, node_id: str) -> list[str]:
    """The ids on this node's model path: upstream from the loader, the node, then downstream."""
    upstream: list[str] = []
    current = _link(graph.get(node_id, {}).get("inputs", {}).get("model"))
    while current is not None and current in graph and current not in upstream:
        upstream.append(current)
        current = _link(graph[current].get("inputs", {}).get("model"))
    path = [*reversed(upstream), node_id]
    frontier = [node_id]
    while frontier:
        taken = [nid for nid, node in graph.items() if nid not in path and isinstance(node, dict)
                 and _link(node.get("inputs", {}).get("model")) in frontier]
        path += taken
        frontier = taken
    return path


def compile_nodes(graph: dict | None, node_id: str | None) -> list[CompileNode]:
    """The compile nodes on this node's model path, in path order."""
    if not graph or node_id is None or node_id not in graph:
        return []
    found = []
    for nid in model_path(graph, node_id):
        node = graph[nid]
        class_type = str(node.get("class_type", ""))
        if nid == node_id or not _COMPILE_CLASS.search(class_type):
            continue
        whole, kwargs = _read(class_type, node.get("inputs", {}))
        found.append(CompileNode(nid, label(graph, nid, class_type), whole, kwargs))
    return found


def _read(class_type: str, inputs: dict) -> tuple[bool | None, dict[str, Any] | None]:
    """(whole, torch.compile kwargs) of a node whose inputs say how it compiles."""
    if class_type not in _READABLE:
        return None, None
    whole: Any = _READABLE[class_type]
    if "compile_transformer_blocks_only" in inputs or not whole:
        blocks_only = inputs.get("compile_transformer_blocks_only", True)
        whole = None if _link(blocks_only) else not blocks_only
    values = {name: inputs.get(name, default) for name, default in
              (("backend", "inductor"), ("mode", "default"), ("fullgraph", False),
               ("dynamic", None))}
    if any(_link(v) for v in values.values()) or values["dynamic"] not in (None, *_DYNAMIC):
        return whole, None
    return whole, {"backend": values["backend"],
                   "mode": None if values["mode"] == "default" else values["mode"],
                   "fullgraph": bool(values["fullgraph"]),
                   "dynamic": None if values["dynamic"] is None else _DYNAMIC[values["dynamic"]]}
