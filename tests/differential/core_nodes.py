"""Core's nodes that change a model, read from the running ComfyUI's `/object_info`, and their draws.

Every node of core (not of a custom node pack) with a MODEL input and a MODEL output is a
candidate, so a newer ComfyUI's nodes are drawn with no change here. A candidate is drawable when
each of its required inputs is a MODEL (the chain's model for the first, another model of the
catalogue for the others: a merge's second model) or a value with a declared type: a number, a
switch, a choice or a text. Anything else it requires (a CLIP, a latent, an image, ...) has no
loader in the campaign's catalogue: the node is skipped, with that reason. Optional inputs are
left out. TorchCompileModel is the one node left to its own draw (`compile_share`): it compiles
with inductor, which takes minutes a prompt on a CPU.

Values are drawn from what the node declares: its default half the time, else a value within its
range, from a window around the default (a range up to 16384 or 1e9 would mostly draw sizes that
only run out of memory on both servers alike; the window's ends are drawn too), a choice among
its options, the other switch value, the default text.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

MODEL = "MODEL"
PRIMITIVES = ("INT", "FLOAT", "BOOLEAN", "STRING")
LEFT_TO_OTHER_DRAWS = {"TorchCompileModel": "compiles with inductor; drawn by the compile share instead"}


@dataclass(frozen=True)
class Value:
    """One input of a declared type: ``kind`` is INT, FLOAT, BOOLEAN, STRING or COMBO."""
    kind: str
    default: Any = None
    low: float | None = None
    high: float | None = None
    options: tuple[Any, ...] = ()


@dataclass(frozen=True)
class CoreNode:
    name: str
    models: tuple[str, ...]  # its MODEL inputs; the first takes the chain's model
    output: int  # the slot of its MODEL output
    values: dict[str, Value] = field(default_factory=dict)


@dataclass
class CoreNodes:
    """The server's nodes that take and give a MODEL: those drawn, and why each other is not."""
    drawable: list[CoreNode]
    skipped: dict[str, str]

    @property
    def count(self) -> int:
        return len(self.drawable) + len(self.skipped)

    def describe(self) -> dict[str, Any]:
        return {"model_nodes": self.count, "drawable": len(self.drawable), "skipped": dict(sorted(self.skipped.items()))}


def _value(spec: list) -> Value | str:
    """An input's declaration as a Value, or why it cannot be drawn."""
    kind = spec[0] if spec else None
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if isinstance(kind, list) or kind == "COMBO":
        choices = tuple(kind if isinstance(kind, list) else options.get("options") or ())
        if not choices:
            return "a choice with no options on this server"
        return Value("COMBO", options.get("default", choices[0]), options=choices)
    if kind in PRIMITIVES:
        return Value(kind, options.get("default"), options.get("min"), options.get("max"))
    return f"needs a {kind} input, which the campaign has no loader for"


def from_object_info(info: dict[str, dict[str, Any]]) -> CoreNodes:
    """The MODEL → MODEL nodes of core among the server's nodes."""
    drawable, skipped = [], {}
    for name, node in sorted(info.items()):
        if str(node.get("python_module", "")).startswith("custom_nodes"):
            continue  # a pack's own, not core's
        outputs = list(node.get("output") or [])
        inputs = node.get("input") or {}
        required = inputs.get("required") or {}
        every = {**required, **(inputs.get("optional") or {})}
        if MODEL not in outputs or not any(spec and spec[0] == MODEL for spec in every.values()):
            continue
        if name in LEFT_TO_OTHER_DRAWS:
            skipped[name] = LEFT_TO_OTHER_DRAWS[name]
            continue
        models = tuple(n for n, spec in required.items() if spec and spec[0] == MODEL)
        if not models:
            skipped[name] = "its MODEL input is optional"
            continue
        values, why = {}, None
        for input_name, spec in required.items():
            if input_name in models:
                continue
            value = _value(spec)
            if isinstance(value, str):
                why = f"{input_name}: {value}"
                break
            values[input_name] = value
        if why is not None:
            skipped[name] = why
            continue
        drawable.append(CoreNode(name, models, outputs.index(MODEL), values))
    return CoreNodes(drawable, skipped)


def draw(rng: random.Random, value: Value) -> Any:
    """A value of the declared type (see the module docstring)."""
    if value.kind == "COMBO":
        return rng.choice(value.options)
    if value.kind == "BOOLEAN":
        return bool(value.default) if rng.random() < 0.5 else not value.default
    if value.kind == "STRING":
        return value.default if value.default is not None else ""
    default = value.default if value.default is not None else (value.low if value.low is not None else 0)
    if rng.random() < 0.5:
        return default
    span = 4 * abs(default) + (16 if value.kind == "INT" else 1.0)
    low = default - span if value.low is None else max(value.low, default - span)
    high = default + span if value.high is None else min(value.high, default + span)
    if low > high:  # a default outside its own range
        return default
    if value.kind == "INT":
        low, high = int(low), int(high)
        return rng.choice((low, high, rng.randint(low, high)))
    return rng.choice((low, high, round(rng.uniform(low, high), 3)))
