"""The randomized differential test of issue 10, bounded for `make test`.

Every generated prompt runs on a ComfyUI server with the pack and its stripped twin on a second
server without it, in the same order; every output must be bit-identical, and a prompt that
fails with the pack must fail the same way without it unless it is a documented refusal. The
seed list is fixed, so CI runs the same prompts every time; the seeds were picked so that this
short campaign covers every feature listed in REQUIRED (checked below, so a generator change
that loses coverage fails here instead of silently testing less). Long campaigns with any seed:
`python -m tests.differential --seed N --prompts 500` (see docs/tests.md).
"""
import collections

import pytest

from differential import ARTIFACTS, campaign, catalogue, core_nodes, generator, report, shrink, twin, verdict
from differential.workflow import is_link

SEEDS = [113, 307]
PROMPTS = 11
REQUIRED = ["family:wan", "family:sd3", "family:hunyuan_video", "offload", "lora", "lora_stack",
            "adapter:loha", "swap", "text_encode", "loader:TieredUNETLoader",
            "loader:TieredCLIPLoader", "loader:CheckpointLoaderSimple", "tier_manager",
            "shape:two_branch", "shape:two_stage", "free", "rest_action", "interrupt:sampling",
            "file_dtype:bf16", "file_dtype:mixed_fp8", "weight_dtype:fp8_e4m3fn", "resident:-1",
            "resident:0", "resident:k", "resident:all", "offload_before_lora",
            "offload_after_lora", "strength:0", "strength:neg", "strength:>1", "vae", "pin:false", "tiny_budget",
            "tier_manager:clip", "scenario:swap_then_drop", "rest_budgets", "hook_lora",
            "hook_lora:keyframes"]


def offline_catalogue(excluded: list[str]) -> catalogue.Catalogue:
    """The campaign's catalogue without writing files."""
    models, _ = catalogue._plan(big=False)
    return catalogue.Catalogue(models=models, clip="clip.safetensors", vae="vae.safetensors",
                               root=ARTIFACTS / "models", excluded=excluded)


@pytest.mark.parametrize("excluded", [["flux"], []], ids=["without-flux", "with-flux"])
def test_generator_is_deterministic_and_twins_hold_no_pack_node(excluded):
    """Both catalogues the bounded campaign can meet: 0.3.75 cannot load the small Flux."""
    cat = offline_catalogue(excluded)
    steps = [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat)]
    assert steps == [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat)]
    prompts = [s for s in steps if s["op"] == "prompt"]
    assert len(prompts) == len(SEEDS) * PROMPTS
    for step in prompts:
        p, q = step["p"], step["q"]
        assert any(n["class_type"] in twin.PACK_NODES for n in p.values()) or p == q
        assert not any(n["class_type"] in twin.PACK_NODES for n in q.values())
        for node_id, node in q.items():
            assert node["class_type"] == twin.CORE_LOADER.get(p[node_id]["class_type"],
                                                              p[node_id]["class_type"])
            for value in node["inputs"].values():
                if is_link(value):
                    assert value[0] in q, (node_id, value)
    coverage = collections.Counter(tag for s in steps for tag in s["tags"])
    missing = [tag for tag in REQUIRED + ([] if excluded else ["family:flux"]) if tag not in coverage]
    assert not missing, f"the bounded campaign no longer covers {missing}: pick other SEEDS"


def test_compile_is_drawn_on_and_off_from_a_stream_of_its_own():
    """With a compile share, chains get ComfyUI's TorchCompileModel or a per-block compile, in
    both the prompt and its twin; every other choice is drawn as without it, so the bounded
    campaign's seeds keep their coverage. A whole-model compile over blocks that may stream is an
    allowed refusal (docs/torch-compile.md)."""
    cat = offline_catalogue(["flux"])
    plain = [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat)]
    drawn = [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat, compile_share=0.5)]
    assert [step.get("models") for step in plain] == [step.get("models") for step in drawn]
    assert [sorted(t for t in s["tags"] if not t.startswith("compile")) for s in plain] == \
        [sorted(t for t in s["tags"] if not t.startswith("compile")) for s in drawn]
    tags = collections.Counter(tag for step in drawn for tag in step["tags"])
    assert tags["compile:whole"] and tags["compile:blocks"] and tags["compile"] < len(drawn)
    assert not any("compile" in tag for step in plain for tag in step["tags"])
    for step in (s for s in drawn if s["op"] == "prompt"):
        compiles = sorted(n["class_type"] for n in step["p"].values()
                          if n["class_type"] in ("TorchCompileModel", "TieredTestCompileBlocks"))
        assert compiles == sorted(n["class_type"] for n in step["q"].values()
                                  if n["class_type"] in ("TorchCompileModel", "TieredTestCompileBlocks"))
        assert bool(compiles) == ("compile" in step["tags"])
        whole = {"shape:single", "compile:whole", "offload"} <= set(step["tags"])
        if whole and any(t in step["tags"] for t in ("resident:0", "resident:k")):
            assert {"kind": "compile_streamed"} in step["allowed_refusals"], step["tags"]


# What /object_info says of a few nodes, in both declaration styles (a list of choices, and
# newer nodes' "COMBO" with options).
OBJECT_INFO = {
    "ModelMergeSimple": {"input": {"required": {"model1": ["MODEL"], "model2": ["MODEL"], "ratio": [
        "FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}]}}, "output": ["MODEL"],
        "python_module": "comfy_extras.nodes_model_merging"},
    "SkipLayerGuidanceDiT": {"input": {"required": {"model": ["MODEL"], "double_layers": ["STRING", {"default": "7, 8, 9"}],
                                                    "scale": ["FLOAT", {"default": 3.0, "min": 0.0, "max": 10.0}],
                                                    "rescaling_scale": ["FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0}]}},
                             "output": ["MODEL"], "python_module": "comfy_extras.nodes_slg"},
    "ModelSamplingDiscrete": {"input": {"required": {"model": ["MODEL"], "sampling": [["eps", "v_prediction", "lcm"]],
                                                     "zsnr": ["BOOLEAN", {"default": False}]}},
                              "output": ["MODEL"], "python_module": "comfy_extras.nodes_model_advanced"},
    "EasyCache": {"input": {"required": {"model": ["MODEL"], "reuse_threshold": ["FLOAT", {"default": 0.2, "min": 0.0, "max": 3.0}],
                                         "start_percent": ["FLOAT", {"default": 0.15}], "end_percent": ["FLOAT", {"default": 0.95}],
                                         "verbose": ["BOOLEAN", {"default": False}], "mode": ["COMBO", {"options": ["a", "b"]}]}},
                  "output": ["MODEL"], "python_module": "comfy_extras.nodes_easycache"},
    "LoraLoader": {"input": {"required": {"model": ["MODEL"], "clip": ["CLIP"], "lora_name": [["a.safetensors"]]}},
                   "output": ["MODEL", "CLIP"], "python_module": "nodes"},
    "HypernetworkLoader": {"input": {"required": {"model": ["MODEL"], "hypernetwork_name": [[]],
                                                  "strength": ["FLOAT", {"default": 1.0}]}},
                           "output": ["MODEL"], "python_module": "comfy_extras.nodes_hypernetwork"},
    "TorchCompileModel": {"input": {"required": {"model": ["MODEL"], "backend": [["inductor", "cudagraphs"]]}},
                          "output": ["MODEL"], "python_module": "comfy_extras.nodes_torch_compile"},
    "ModelOptional": {"input": {"required": {"steps": ["INT", {"default": 4}]}, "optional": {"model": ["MODEL"]}},
                      "output": ["LATENT", "MODEL"], "python_module": "comfy_extras.nodes_x"},
    "CLIPSetLastLayer": {"input": {"required": {"clip": ["CLIP"], "stop_at_clip_layer": ["INT", {"default": -1}]}},
                         "output": ["CLIP"], "python_module": "nodes"},
    "ApplyLayerwiseOffload": {"input": {"required": {"model": ["MODEL"]}}, "output": ["MODEL"],
                              "python_module": "custom_nodes.comfyui-tiered-offload"},
}


def test_core_s_model_nodes_are_read_from_object_info():
    core = core_nodes.from_object_info(OBJECT_INFO)
    assert [n.name for n in core.drawable] == ["EasyCache", "ModelMergeSimple", "ModelSamplingDiscrete",
                                               "SkipLayerGuidanceDiT"]
    assert core.skipped == {
        "HypernetworkLoader": "hypernetwork_name: a choice with no options on this server",
        "LoraLoader": "clip: needs a CLIP input, which the campaign has no loader for",
        "ModelOptional": "its MODEL input is optional",
        "TorchCompileModel": "compiles with inductor; drawn by the compile share instead"}
    assert core.count == 8  # a pack's own node and a CLIP-only node are not counted
    merge = next(n for n in core.drawable if n.name == "ModelMergeSimple")
    assert merge.models == ("model1", "model2") and merge.output == 0 and list(merge.values) == ["ratio"]
    rng = __import__("random").Random(3)
    for node in core.drawable:
        for name, value in node.values.items():
            for _ in range(50):
                drawn = core_nodes.draw(rng, value)
                if value.kind == "COMBO":
                    assert drawn in value.options
                elif value.kind in ("INT", "FLOAT"):
                    assert (value.low is None or drawn >= value.low) and (value.high is None or drawn <= value.high), \
                        (node.name, name, drawn)
                    assert abs(drawn - value.default) <= 4 * abs(value.default) + 16, (node.name, name, drawn)
                elif value.kind == "STRING":
                    assert drawn == value.default


def test_core_nodes_are_drawn_from_a_stream_of_their_own():
    """With a table of core's nodes, chains get one of them before or after the pack's nodes, in
    the prompt and its twin alike, a merge with a second model of the family; every other choice
    is drawn as without them, so the bounded campaign keeps its coverage."""
    cat = offline_catalogue(["flux"])
    core = core_nodes.from_object_info(OBJECT_INFO)
    plain = [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat)]
    drawn = [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat, core=core)]
    assert drawn == [step for seed in SEEDS for step in generator.generate(seed, PROMPTS, cat, core=core)]
    assert [step.get("models") for step in plain] == [step.get("models") for step in drawn]
    assert [sorted(t for t in s["tags"] if not t.startswith("core_node")) for s in plain] == \
        [sorted(t for t in s["tags"] if not t.startswith("core_node")) for s in drawn]
    tags = collections.Counter(tag for step in drawn for tag in step["tags"])
    assert tags["core_node:before_offload"] and tags["core_node:after_offload"], tags
    assert tags["core_node:ModelMergeSimple"], tags
    for step in (s for s in drawn if s["op"] == "prompt" and "core_node" in s["tags"]):
        p_nodes = sorted(n["class_type"] for n in step["p"].values())
        q_nodes = sorted(n["class_type"] for n in step["q"].values())
        for name in (n.name for n in core.drawable):
            assert p_nodes.count(name) == q_nodes.count(name)
        for node in (n for n in step["p"].values() if n["class_type"] == "ModelMergeSimple"):
            partner = step["p"][node["inputs"]["model2"][0]]
            assert partner["class_type"] in ("UNETLoader", "CheckpointLoaderSimple"), partner


def test_twin_rewires_through_chained_pass_throughs():
    wf = {"1": {"class_type": "TieredUNETLoader", "inputs": {"unet_name": "m", "weight_dtype": "default"}},
          "2": {"class_type": "TieredCLIPLoader", "inputs": {"clip_name": "c", "type": "stable_diffusion",
                                                             "device": "default"}},
          "3": {"class_type": "ApplyLayerwiseOffload", "inputs": {"model": ["1", 0], "resident_blocks": 0}},
          "4": {"class_type": "VRAMTierManager", "inputs": {"model": ["3", 0], "clip": ["2", 0]}},
          "5": {"class_type": "ModelLevelSwap", "inputs": {"model": ["4", 0], "clip": ["4", 1]}},
          "6": {"class_type": "KSampler", "inputs": {"model": ["5", 0]}},
          "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["5", 1], "text": "x"}}}
    assert twin.strip(wf) == {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "m", "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "c", "type": "stable_diffusion",
                                                     "device": "default"}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["1", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": "x"}}}
    wf["4"]["inputs"].pop("clip")
    with pytest.raises(ValueError, match="passes nothing through"):
        twin.strip(wf)


def _ok(sha: str) -> dict:
    return {"status": "success", "outputs": {"9": {"latent_stats": [{"sha256": sha}]}}}


def test_verdicts():
    step = {"p": {"3": {"class_type": "ApplyLayerwiseOffload", "inputs": {}}}, "q": {},
            "allowed_refusals": [{"kind": "resident_out_of_range", "node": "3"}]}
    assert verdict.judge(step, _ok("a"), _ok("a"))["result"] == "match"
    differs = verdict.judge(step, _ok("a"), _ok("b"))
    assert differs["result"] == "mismatch" and differs["kind"] == "output_differs"
    error = {"node_id": "3", "node_type": "ApplyLayerwiseOffload", "exception_type": "ValueError"}
    clear = {"status": "error", "error": {**error, "exception_message": "resident_blocks=5 but the model has 2 blocks"}}
    vague = {"status": "error", "error": {**error, "exception_message": "resident=5 but there are only 2 blocks"}}
    other = {"status": "error", "error": {**error, "exception_message": "boom"}}
    assert verdict.judge(step, clear, _ok("a")) == {"result": "refused", "kind": "resident_out_of_range"}
    assert verdict.judge(step, vague, _ok("a"))["kind"] == "unclear_refusal"
    assert verdict.judge(step, other, _ok("a"))["kind"] == "p_failed"
    assert verdict.judge({**step, "allowed_refusals": []}, clear, _ok("a"))["kind"] == "p_failed"
    assert verdict.judge(step, {"status": "interrupted"}, _ok("a"))["result"] == "interrupted"
    # Both failing alike, in either branch's node of one class: counted, not a mismatch.
    sampler = {"node_type": "KSampler", "exception_type": "AssertionError", "exception_message": "x"}
    both = verdict.judge(step, {"status": "error", "error": {**sampler, "node_id": "16"}},
                         {"status": "error", "error": {**sampler, "node_id": "17"}})
    assert both == {"result": "match", "both_failed": True}
    other = verdict.judge(step, {"status": "error", "error": {**sampler, "node_id": "16"}},
                          {"status": "error", "error": {**sampler, "exception_message": "y", "node_id": "16"}})
    assert other["kind"] == "errors_differ"
    # Refused when queued: the node's validation error is judged like the same refusal at run.
    queued = {"status": "rejected", "detail": {"node_errors": {"3": {"errors": [
        {"details": "model - resident_blocks=5 but the model has 2 blocks"}]}}}}
    assert verdict.judge(step, queued, _ok("a")) == {"result": "refused", "kind": "resident_out_of_range",
                                                      "when": "queued"}
    assert verdict.judge({**step, "allowed_refusals": []}, queued, _ok("a"))["kind"] == "rejected"
    # Queued with one branch refused: ComfyUI runs the other, which must match.
    errors = queued["detail"]["node_errors"]
    two = {"status": "success", "outputs": {"9": {"latent_stats": [{"sha256": "a"}]},
                                            "12": {"latent_stats": [{"sha256": "b"}]}}}
    ran = {"status": "success", "node_errors": errors, "outputs": {"9": {"latent_stats": [{"sha256": "a"}]}}}
    assert verdict.judge(step, ran, two) == {"result": "refused", "kind": "resident_out_of_range",
                                             "when": "queued"}
    wrong = {**ran, "outputs": {"9": {"latent_stats": [{"sha256": "c"}]}}}
    assert verdict.judge(step, wrong, two)["kind"] == "output_differs"
    assert verdict.judge({**step, "allowed_refusals": []}, ran, two)["kind"] == "rejected"


@pytest.mark.comfy_tree  # on both lanes: what it draws is what each ComfyUI has
def test_bounded_differential_campaign(tmp_path):
    out_dir = ARTIFACTS / "bounded"
    opts = campaign.Options(seeds=SEEDS, prompts=PROMPTS, workdir=tmp_path / "servers", out_dir=out_dir,
                            models_root=ARTIFACTS / "models", big=False, echo=print)
    summary = campaign.run(opts)
    text = report.summary_text(summary)
    print(text)
    assert summary["totals"]["prompts"] == len(SEEDS) * PROMPTS
    flux = [] if "flux" in summary["catalogue"]["excluded"] else ["family:flux"]
    missing = [tag for tag in REQUIRED + flux if tag not in summary["coverage"]]
    assert not missing, missing
    # Core's nodes that change the model, from this server's /object_info, were drawn.
    core = summary["core_nodes"]
    assert core["model_nodes"] > core["drawable"] > 20 and sum(core["prompts_through"].values()) >= 6, core
    assert {"core_node:before_offload", "core_node:after_offload"} <= set(summary["coverage"]), core
    ran = summary["totals"].get("match", 0) - summary["totals"].get("both_failed", 0)
    assert ran >= PROMPTS // 2, f"too few prompts ran to completion on both servers:\n{text}"
    assert summary["mismatch_count"] == 0, (
        f"{text}\nEach replay folder holds both workflows, the outcomes and log tails; "
        f"summary: {out_dir / 'summary.json'}")


def test_shrink_variants_keep_prompts_valid():
    wf = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "m", "weight_dtype": "default"}},
          "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "l",
                                                                "strength_model": 1.0}},
          "3": {"class_type": "ApplyLayerwiseOffload", "inputs": {"model": ["2", 0]}},
          "4": {"class_type": "KSampler", "inputs": {"model": ["3", 0]}},
          "5": {"class_type": "TieredTestLatentStats", "inputs": {"samples": ["4", 0]}},
          "6": {"class_type": "KSampler", "inputs": {"model": ["2", 0]}},
          "7": {"class_type": "TieredTestLatentStats", "inputs": {"samples": ["6", 0]}}}
    found = dict(shrink.variants({"op": "prompt", "p": wf, "q": twin.strip(wf)}))
    assert set(found) == {"drop output 5", "drop output 7", "bypass 2:LoraLoaderModelOnly",
                          "bypass 3:ApplyLayerwiseOffload"}
    assert set(found["drop output 5"]["p"]) == {"1", "2", "6", "7"}
    assert found["bypass 2:LoraLoaderModelOnly"]["p"]["3"]["inputs"]["model"] == ["1", 0]
    assert found["bypass 3:ApplyLayerwiseOffload"]["q"] == found["bypass 3:ApplyLayerwiseOffload"]["p"]
