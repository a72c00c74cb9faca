"""The example workflows the pack ships (example_workflows/) are the ones tools/example_workflows.py
builds: each in API form (example_workflows/api/, what POST /prompt takes) and as a graph file
the template browser lists, named for what it shows, with the models it loads named on its
canvas. tests/test_example_workflows_api.py runs the API forms on a real server;
tests/test_panel.py checks that each graph file is its API graph in the real frontend."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import example_workflows  # noqa: E402

# What Windows refuses in a file name (the pack installs there too), and what would hide a file
# from the template browser's listing or its URL.
UNSAFE = set('/\\:*?"<>|#%') | {chr(c) for c in range(32)}


def test_every_shipped_api_form_is_the_graph_the_tool_builds():
    shipped = {p.stem: p.read_text(encoding="utf-8") for p in example_workflows.API_DIR.glob("*.json")}
    built = {stem: example_workflows.api_text(graph)
             for stem, graph in example_workflows.api_graphs().items()}
    assert sorted(shipped) == sorted(built), "run: python tools/example_workflows.py --api-only"
    stale = [stem for stem in built if shipped[stem] != built[stem]]
    assert stale == [], f"stale API forms {stale}: run python tools/example_workflows.py --api-only"


def test_every_example_ships_a_graph_file_its_thumbnail_and_its_api_form():
    stems = set(example_workflows.EXAMPLES)
    assert {p.stem for p in example_workflows.EXAMPLES_DIR.glob("*.json")} == stems
    assert {p.stem for p in example_workflows.EXAMPLES_DIR.glob("*.jpg")} == stems
    assert {p.stem for p in example_workflows.API_DIR.glob("*.json")} == stems
    for stem in stems:
        graph = json.loads((example_workflows.EXAMPLES_DIR / f"{stem}.json").read_text(encoding="utf-8"))
        types = sorted(n["type"] for n in graph["nodes"] if n["type"] != "Note")
        assert types == sorted(n["class_type"] for n in example_workflows.EXAMPLES[stem].build().values()), stem


def test_example_names_say_what_they_show_and_are_file_names_everywhere():
    """The template browser shows the file name as the title (cut short) and again as the
    caption: a name must say more than the node's, start with a word, and be a file name on
    every system."""
    for stem in example_workflows.EXAMPLES:
        assert not set(stem) & UNSAFE and stem == stem.strip() and not stem.endswith("."), stem
        assert len(stem.split()) >= 5, f"'{stem}' does not say what the workflow shows"
        assert len(stem) <= 64, f"'{stem}' is cut short in the caption (two lines, about 60 characters)"
    assert example_workflows.DEMO in example_workflows.EXAMPLES


def test_every_note_names_the_models_its_workflow_loads():
    for stem, example in example_workflows.EXAMPLES.items():
        loaded = {v for node in example.build().values() for k, v in node["inputs"].items()
                  if k in ("unet_name", "clip_name")}
        assert loaded == {name for _, name in example_workflows.MODELS}, stem
        assert all(name in example.note for name in loaded), f"{stem}: its note does not name {loaded}"
        assert "tools/demo_models.py" in example.note, stem


def offload_inputs(stem: str) -> dict:
    [inputs] = [node["inputs"] for node in example_workflows.EXAMPLES[stem].build().values()
                if node["class_type"] == "ApplyLayerwiseOffload"]
    return inputs


def node_defaults(node: str) -> dict:
    """Each input's default as the server serves the node (tests/fixtures/node_interfaces.json,
    which tests/test_node_schema.py holds to the server)."""
    schema = json.loads((ROOT / "tests" / "fixtures" / "node_interfaces.json").read_text(encoding="utf-8"))[node]
    return {name: spec[1]["default"] for group in schema["input"].values()
            for name, spec in group.items() if len(spec) > 1 and "default" in spec[1]}


def test_the_demo_runs_the_offload_nodes_defaults():
    """A user's first run shows what they get when they add the node: every input at its default."""
    defaults = node_defaults("ApplyLayerwiseOffload")
    demo = {k: v for k, v in offload_inputs(example_workflows.DEMO).items() if k != "model"}
    assert demo == defaults


def test_every_example_writes_the_defaults_of_what_it_does_not_choose():
    defaults = node_defaults("ApplyLayerwiseOffload")
    chosen = {k: v for k, v in offload_inputs(example_workflows.LAYERWISE).items()
              if k != "model" and v != defaults[k]}
    assert chosen == {"resident_blocks": example_workflows.LAYERWISE_RESIDENT}, chosen


def test_the_layerwise_example_streams_blocks_on_any_machine():
    """A budget in GiB keeps the whole demo model resident on a large card and on a CPU; a count
    of resident blocks below the model's streams the rest everywhere (a real run: the server
    test)."""
    layerwise = offload_inputs(example_workflows.LAYERWISE)
    assert 0 <= layerwise["resident_blocks"] < example_workflows.DIT_BLOCKS
