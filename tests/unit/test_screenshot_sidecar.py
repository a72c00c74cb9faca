"""The README's picture (web/screenshot.png) shows the pack's nodes as they are: `make screenshot`
(tools/screenshot.py) writes it from the example that streams blocks (example_workflows.LAYERWISE)
with a sidecar (web/screenshot.json) recording the
inputs and values of the pack's nodes the canvas showed, sealed with the picture's bytes. This
fails when a node's inputs (tests/fixtures/node_interfaces.json, which tests/test_node_schema.py
holds to what the server serves) or the example's values change and the picture was not made
again, and when the picture and its sidecar were not written together."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools")]
import example_workflows  # noqa: E402
import screenshot  # noqa: E402

PICTURE = ROOT / "web" / "screenshot.png"
INTERFACES = json.loads((ROOT / "tests" / "fixtures" / "node_interfaces.json").read_text(encoding="utf-8"))
AGAIN = "the README's picture is stale: run `make screenshot`"


def sidecar() -> dict:
    return json.loads(screenshot.sidecar_path(PICTURE).read_text(encoding="utf-8"))


def schema_inputs(node: str) -> set[str]:
    order = INTERFACES[node]["input_order"]
    return set(order.get("required", [])) | set(order.get("optional", []))


PICTURED = example_workflows.LAYERWISE


def pictured() -> dict[str, dict]:
    return example_workflows.EXAMPLES[PICTURED].build()


def stale(record: dict, workflow: dict[str, dict]) -> list[str]:
    """What the picture's record says that the pack's nodes and the pictured example no longer say."""
    found = []
    if record.get("workflow") != PICTURED:
        found.append(f"the picture shows '{record.get('workflow')}', the example is '{PICTURED}'")
    for node in sorted({n["class_type"] for n in workflow.values()} & set(INTERFACES)):
        shown = record["nodes"].get(node)
        if shown is None:
            found.append(f"{node} is in the example but not in the picture")
            continue
        if set(shown["inputs"]) != schema_inputs(node):
            found.append(f"{node}: the picture shows inputs {sorted(shown['inputs'])}, the node has "
                         f"{sorted(schema_inputs(node))}")
        [inputs] = [n["inputs"] for n in workflow.values() if n["class_type"] == node]
        values = {k: v for k, v in inputs.items() if not isinstance(v, list)}   # not the links
        if shown["values"] != values:
            found.append(f"{node}: the picture shows {shown['values']}, the example sets {values}")
    return found


def test_the_picture_and_its_sidecar_were_written_together():
    record = sidecar()
    assert record["picture"] == PICTURE.name
    assert record["seal"] == screenshot.seal(PICTURE.read_bytes(), record["nodes"]), AGAIN


def test_the_picture_shows_the_nodes_inputs_and_the_examples_values():
    found = stale(sidecar(), pictured())
    assert found == [], f"{AGAIN}:\n" + "\n".join(found)


def test_a_stale_picture_is_found():
    """A node that gained an input, a value of the example changed, and a picture of another workflow are
    each named (a check that cannot fail proves nothing)."""
    record = sidecar()
    workflow = pictured()
    [node_id] = [k for k, n in workflow.items() if n["class_type"] == "ApplyLayerwiseOffload"]
    assert stale(record, workflow) == []
    fewer = json.loads(json.dumps(record))
    fewer["nodes"]["ApplyLayerwiseOffload"]["inputs"].remove("spill_dir")
    assert [p.split(":")[0] for p in stale(fewer, workflow)] == ["ApplyLayerwiseOffload"]
    workflow[node_id]["inputs"]["prefetch"] += 1
    assert "the example sets" in " ".join(stale(record, workflow))
    assert stale(dict(record, workflow="another"), pictured())[0].startswith(
        "the picture shows 'another'")
    assert stale(dict(record, nodes={}), pictured()) == [
        "ApplyLayerwiseOffload is in the example but not in the picture"]
