"""The pack's nodes on ComfyUI's V3 schema keep the interface saved workflows depend on (both lanes).

A saved UI workflow stores each node's widget values by position and its links by slot index; an
API prompt names inputs. Both keep working only if every node keeps its id, its inputs (names,
order, types, defaults, ranges, tooltips), its outputs, category and display name.
tests/fixtures/node_interfaces.json holds what the nodes served as V1 nodes, before the move to
V3 (taken from /object_info of both ComfyUI versions, which agreed), plus the inputs added since,
each optional and last (`share_host_memory`), which keeps every saved widget value in its place,
and Apply Layerwise Offload's auto defaults (prefetch and disk_workers 0, granularity "auto", each
with its tooltip; every value a saved workflow can hold is still in range); the Tiered loaders
must serve
exactly the inputs, outputs and description of the core loader each one mirrors, on the same
server (the file lists and a loader's options differ between ComfyUI versions).

V3 serializes a few things differently, none of which a workflow or the frontend reads
differently: a combo is `["COMBO", {"options": [...]}]` instead of `[[...], {}]`, and explicit
defaults (`multiselect: false`, `multiline: false`) appear. `normalized` undoes exactly those.
"""
from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from comfy_server import comfy_version
from workflows import latent_sha, sample_workflow

INTERFACES = json.loads((Path(__file__).resolve().parent / "fixtures" / "node_interfaces.json").read_text(encoding="utf-8"))
LOADERS = {"TieredUNETLoader": "UNETLoader", "TieredCheckpointLoader": "CheckpointLoaderSimple",
           "TieredCLIPLoader": "CLIPLoader", "TieredVAELoader": "VAELoader"}
# V3 flags that mean "no" and are sent as false; their absence means the same.
V3_DEFAULTS = {"multiselect": False, "multiline": False}


def normalized_spec(spec: list) -> list:
    kind, options = spec[0], dict(spec[1]) if len(spec) > 1 else {}
    if kind == "COMBO":
        kind = options.pop("options")
    for key, value in V3_DEFAULTS.items():
        if options.get(key) is value:
            del options[key]
    return [kind, options] if options else [kind]


def normalized(info: dict) -> dict:
    return dict(info, input={section: {name: normalized_spec(spec) for name, spec in inputs.items()}
                             for section, inputs in info["input"].items()})


@pytest.fixture(scope="module")
def object_info(comfy) -> dict:
    return comfy.get("/object_info")


@pytest.mark.parametrize("node", ["ApplyLayerwiseOffload", "ModelLevelSwap", "VRAMTierManager"])
def test_a_node_serves_the_interface_it_had_before_v3(object_info, node):
    served = normalized(object_info[node])
    for field, value in INTERFACES[node].items():
        assert served[field] == value, (node, field)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_tiered_loader_serves_its_core_loaders_inputs_and_outputs(object_info, loader):
    served, core = normalized(object_info[loader]), normalized(object_info[LOADERS[loader]])
    for field, value in INTERFACES[loader].items():
        assert served[field] == value, (loader, field)
    outputs = len(served["output"])
    assert served["input"] == core["input"] and served["input_order"] == core["input_order"]
    assert served["description"] == core["description"]
    assert served["output"] == core["output"][:outputs] and served["output_name"] == core["output_name"][:outputs]
    assert (served.get("output_tooltips") or [None] * outputs) == \
        (core.get("output_tooltips") or [None] * len(core["output"]))[:outputs]
    if core.get("search_aliases"):   # 0.33 and later
        assert served["search_aliases"] == core["search_aliases"]


def test_a_tiered_loader_refuses_a_file_its_folder_lacks_when_queued(comfy):
    """As core does for its own loader: a 400 naming the input once (0.3.75 checks a V3 node's
    choices only through the node's validate_inputs), and the server keeps serving."""
    wf = sample_workflow("wan21")
    wf["load"]["class_type"] = "TieredUNETLoader"
    wf["load"]["inputs"]["unet_name"] = "no_such_model.safetensors"
    details = comfy.refused(wf, "load")
    assert details.startswith("unet_name - Tiered UNET Loader: unet_name 'no_such_model.safetensors' "
                              "is not one of the choices"), details
    assert "tiny_wan21_t2v.safetensors" in details and details.count(" - ") == 1, details
    wf["load"]["inputs"]["unet_name"] = "tiny_wan21_t2v.safetensors"
    wf["load"]["inputs"]["weight_dtype"] = "fp3"
    if comfy_version().startswith("0.3."):   # checks a V3 node's choices only through the node
        error = comfy.run_expect_error(wf)
        assert error["node_type"] == "TieredUNETLoader", error
        assert "weight_dtype 'fp3' is not one of the choices (default, fp8_e4m3fn" in error["exception_message"]
    else:
        assert "weight_dtype: 'fp3' not in" in comfy.refused(wf, "load")
    assert latent_sha(comfy.run(sample_workflow("wan21"))) is not None


def test_a_spill_folder_the_node_would_refuse_is_refused_when_queued(comfy, tmp_path):
    """Apply Layerwise Offload's validate_inputs: a spill_dir outside the allowed folders, or one
    that does not exist, is refused at queue time with the node's own message, once (on the
    `model` input, the one its check names: it also refuses compiles, docs/torch-compile.md);
    nothing runs, and the server keeps serving."""
    outside = sample_workflow("wan21", layerwise={"host_cache_gb": 0.01, "spill_dir": str(tmp_path)})
    details = comfy.refused(outside, "offload")
    assert details.startswith("model - Apply Layerwise Offload: spill_dir"), details
    assert "is outside the folders a spill file may go to" in details and details.count(" - ") == 1
    missing = sample_workflow("wan21", layerwise={"spill_dir": str(comfy.base / "temp" / "no such folder")})
    assert "is not an existing folder" in comfy.refused(missing, "offload")
    inside = comfy.base / "temp" / "schema_spill"
    inside.mkdir(parents=True, exist_ok=True)
    plain = latent_sha(comfy.run(sample_workflow("wan21")))
    assert latent_sha(comfy.run(sample_workflow("wan21", layerwise={"spill_dir": str(inside)}))) == plain


def test_a_ram_reserve_larger_than_the_machine_is_refused_when_queued(comfy):
    """VRAM Tier Manager's validate_inputs: a RAM reserve no machine of this size can keep, or
    NaN, is refused at queue time; the budgets stay as they were."""
    before = comfy.get("/offload/tiers")["budgets"]
    wf = sample_workflow("wan21")
    wf["tm"] = {"class_type": "VRAMTierManager", "inputs": {
        "ram_budget_gb": 0.0, "ram_reserve_gb": float(int(psutil.virtual_memory().total / 2 ** 30) + 1),
        "vram_reserve_gb": 1.0, "disk_tier": True, "keep_in_ram": False, "priority": 0,
        "model": ["load", 0]}}
    wf["sample"]["inputs"]["model"] = ["tm", 0]
    details = comfy.refused(wf, "tm")
    assert details.startswith("ram_reserve_gb - VRAM Tier Manager: ram_reserve_gb"), details
    assert "more than this machine's RAM" in details
    wf["tm"]["inputs"]["ram_reserve_gb"] = float("nan")
    assert "not NaN" in comfy.refused(wf, "tm")
    assert comfy.get("/offload/tiers")["budgets"] == before


def test_the_readme_picture_shows_the_inputs_the_nodes_serve(object_info):
    """web/screenshot.json records the pack's nodes as the README's picture shows them
    (tools/screenshot.py; tests/unit/test_screenshot_sidecar.py checks it against the recorded
    interfaces): the server under test serves those inputs, no more, no fewer."""
    record = json.loads((Path(__file__).resolve().parent.parent / "web" / "screenshot.json")
                        .read_text(encoding="utf-8"))
    assert record["nodes"], record
    for node, shown in record["nodes"].items():
        served = {name for section in ("required", "optional")
                  for name in object_info[node]["input"].get(section, {})}
        assert set(shown["inputs"]) == served, f"{node}: the README's picture is stale, run make screenshot"
