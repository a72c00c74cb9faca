"""The pack's documented refusals: a prompt that fails on P and runs on Q is not a mismatch only
when it is one of these, where the generator said it may happen, and its message is clear.

Each refusal names where it is documented, how to recognise it (node, exception type, words in
the message), and the node inputs its message must name, because a refusal that speaks in
internal names (issue 10's case F: "vram_budget_bytes must be >= 1") leaves the user guessing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refusal:
    doc: str
    nodes: tuple[str, ...] = ()          # node types that raise it; () = any node
    message: str = ""                    # regex the message must match to be this refusal
    exception_suffix: str = ""           # exception type must end with this
    terms: tuple[str, ...] = ()          # node inputs the message must name

    def recognises(self, error: dict[str, Any]) -> bool:
        if self.nodes and error.get("node_type") not in self.nodes:
            return False
        if self.exception_suffix and not str(error.get("exception_type", "")).endswith(self.exception_suffix):
            return False
        return not self.message or re.search(self.message, error.get("exception_message", ""), re.I) is not None

    def clear(self, error: dict[str, Any]) -> bool:
        return all(term in error.get("exception_message", "") for term in self.terms)


DOCUMENTED: dict[str, Refusal] = {
    "swap_before_offload": Refusal(
        "docs/known-limits.md: Model-Level Swap placed before Apply Layerwise Offload",
        nodes=("ApplyLayerwiseOffload",), message=r"swap"),
    "quantized_lora_streamed": Refusal(
        "docs/known-limits.md: a LoRA on a quantized weight with a custom set_func inside a "
        "streamed block", message=r"quantized"),
    "resident_out_of_range": Refusal(
        "tests/test_layerwise_nodes.py::test_impossible_settings_fail_clearly: more resident "
        "blocks than the model has", nodes=("ApplyLayerwiseOffload",), message=r"resident",
        terms=("resident_blocks",)),
    "budget_too_small": Refusal(
        "tests/test_layerwise_nodes.py::test_impossible_settings_fail_clearly: a budget too "
        "small to stream every block", nodes=("ApplyLayerwiseOffload",), message=r"budget",
        terms=("vram_budget_gb",)),
    "tier_untracked": Refusal(
        "docs/vram-tier-manager.md: connect models loaded by the Tiered loaders",
        nodes=("VRAMTierManager",), message=r"Tiered"),
    "compile_streamed": Refusal(
        "docs/torch-compile.md: a compile of the whole model over blocks that may stream (streaming "
        "would split its graph, which changes inductor's result), when queued or at run",
        message=r"compiles .* whole, as one graph",
        terms=("resident_blocks", "compile_per_block")),
    "tier_capacity": Refusal(
        "docs/tiered-loaders.md: a model in use is never evicted, so a RAM budget below "
        "what a prompt holds refuses the load", exception_suffix="TierCapacityError"),
}


def classify(error: dict[str, Any], allowed: list[dict[str, Any]]) -> tuple[str, str] | None:
    """("refused" | "unclear_refusal", kind) if `error` is an allowed documented refusal."""
    for entry in allowed:
        refusal = DOCUMENTED[entry["kind"]]
        if entry.get("node") is not None and entry["node"] != error.get("node_id"):
            continue
        if refusal.recognises(error):
            return ("refused" if refusal.clear(error) else "unclear_refusal"), entry["kind"]
    return None
