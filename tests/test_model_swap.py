"""Model-Level Swap through a real server: the diffusion model and the text encoder take turns,
and neither the samples nor the text encodings change, LoRA included, in any prompt order."""
import copy

import tiny_models
from conftest import WAN_CLIP_LORA
from workflows import latent_sha, sample_workflow

TEXT = "a lighthouse at dusk"


def with_text_encode(wf: dict, swap: bool, model_node: str = "load") -> dict:
    """Add a real text encode to the workflow; with `swap`, route model and CLIP through the node."""
    wf["clip"] = {"class_type": "CLIPLoader", "inputs": {
        "clip_name": tiny_models.CLIP_L_FILENAME, "type": "stable_diffusion", "device": "default"}}
    clip = ["clip", 0]
    if swap:
        wf["swap"] = {"class_type": "ModelLevelSwap", "inputs": {"model": [model_node, 0], "clip": clip}}
        for node in wf.values():
            for name, value in node["inputs"].items():
                if value == [model_node, 0] and node is not wf["swap"]:
                    node["inputs"][name] = ["swap", 0]
        clip = ["swap", 1]
    wf["encode"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": TEXT}}
    wf["encode_stats"] = {"class_type": "TieredTestConditioningStats",
                          "inputs": {"conditioning": ["encode", 0]}}
    return wf


def with_model_and_clip_lora(swap: bool, strength_model: float = 1.0, strength_clip: float = 1.0) -> dict:
    """LoraLoader on both the diffusion model and the text encoder, optionally through the swap."""
    wf = with_text_encode(sample_workflow("wan21"), swap=False)
    wf["lora"] = {"class_type": "LoraLoader", "inputs": {
        "model": ["load", 0], "clip": ["clip", 0], "lora_name": WAN_CLIP_LORA,
        "strength_model": strength_model, "strength_clip": strength_clip}}
    model, clip = ["lora", 0], ["lora", 1]
    if swap:
        wf["swap"] = {"class_type": "ModelLevelSwap", "inputs": {"model": model, "clip": clip}}
        model, clip = ["swap", 0], ["swap", 1]
    wf["sample"]["inputs"]["model"] = model
    wf["encode"]["inputs"]["clip"] = clip
    return wf


def encode_sha(outputs, node="encode_stats"):
    info = outputs[node]["conditioning_stats"][0]
    assert info["finite"] and info["shape"] == [1, 77, 768]
    return info["sha256"]


def members(comfy) -> dict:
    return {m["name"]: m for m in comfy.get("/offload/swap")["members"]}


def test_swap_keeps_samples_and_encodings_identical(comfy):
    plain = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    swapped = comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    assert latent_sha(swapped) == latent_sha(plain)
    assert encode_sha(swapped) == encode_sha(plain)
    again = comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    assert latent_sha(again) == latent_sha(plain) and encode_sha(again) == encode_sha(plain)
    found = members(comfy)
    assert {"WAN21", "SD1ClipModel"} <= set(found), found
    # Both took turns: the encoder when it loaded to encode (once: the repeated encode is
    # answered from ComfyUI's cache), the diffusion model at each of the two samplings.
    assert found["WAN21"]["turns"] >= 2 and found["SD1ClipModel"]["turns"] >= 1, found
    assert found["WAN21"]["bytes"]["master"] > 0


def test_swap_keeps_the_lora_of_both_models(comfy):
    """Core merges a LoRA into new tensors when it loads a model; the swap must neither park the
    base weights over them nor hand the merged ones to its master (issue 10 A)."""
    plain = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    reference = comfy.run(with_model_and_clip_lora(swap=False))
    assert latent_sha(reference) != latent_sha(plain), "the LoRA must change the sample"
    assert encode_sha(reference) != encode_sha(plain), "the LoRA must change the encoding"
    for _ in range(2):
        swapped = comfy.run(with_model_and_clip_lora(swap=True))
        assert latent_sha(swapped) == latent_sha(reference)
        assert encode_sha(swapped) == encode_sha(reference)
    # The diffusion-model-only LoRA node, swap after it.
    model_only = sample_workflow("wan21", lora_strength=1.0)
    expected = latent_sha(comfy.run(with_text_encode(copy.deepcopy(model_only), swap=False)))
    got = comfy.run(with_text_encode(model_only, swap=True, model_node="lora"))
    assert latent_sha(got) == expected
    # Core's own runs afterwards, with and without the LoRA.
    assert latent_sha(comfy.run(with_model_and_clip_lora(swap=False))) == latent_sha(reference)
    again = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    assert latent_sha(again) == latent_sha(plain) and encode_sha(again) == encode_sha(plain)


def test_a_master_never_carries_a_lora_into_later_prompts(comfy):
    """The master is built from base weights even when the model was just run with a LoRA merged
    (issue 10 B): a later prompt without the LoRA, with or without the pack, is plain."""
    comfy.free()
    plain = latent_sha(comfy.run(sample_workflow("wan21")))
    lora = latent_sha(comfy.run(sample_workflow("wan21", lora_strength=1.0)))
    assert lora != plain
    swapped = latent_sha(comfy.run(with_text_encode(sample_workflow("wan21"), swap=True)))
    assert swapped == plain
    assert latent_sha(comfy.run(sample_workflow("wan21"))) == plain
    assert latent_sha(comfy.run(sample_workflow("wan21", lora_strength=1.0))) == lora
    assert latent_sha(comfy.run(with_text_encode(sample_workflow("wan21", lora_strength=1.0),
                                                 swap=True, model_node="lora"))) == lora


def test_tiered_model_under_swap_survives_free_without_a_double_lora(comfy):
    """A Tiered loader keeps the module (and its master) across /free: a LoRA run after that
    applies the LoRA once."""
    def tiered(wf):
        wf["load"]["class_type"] = "TieredUNETLoader"
        return wf

    lora = latent_sha(comfy.run(tiered(sample_workflow("wan21", lora_strength=1.0))))
    plain = latent_sha(comfy.run(tiered(with_text_encode(sample_workflow("wan21"), swap=True))))
    comfy.free()
    assert latent_sha(comfy.run(tiered(sample_workflow("wan21", lora_strength=1.0)))) == lora
    assert latent_sha(comfy.run(tiered(with_text_encode(sample_workflow("wan21"), swap=True)))) == plain
    assert latent_sha(comfy.run(tiered(sample_workflow("wan21", lora_strength=1.0)))) == lora


def two_branches(swap_first: bool) -> dict:
    """One loader feeding a LoRA branch and a Model-Level Swap branch in one prompt; node ids
    are chosen so that each order of the branches is tried."""
    wf = with_text_encode(sample_workflow("wan21"), swap=True)
    lora_id, swap_id = ("b_lora", "a_swap") if swap_first else ("a_lora", "b_swap")
    wf[swap_id] = wf.pop("swap")
    wf["sample"]["inputs"]["model"] = [swap_id, 0]
    wf["encode"]["inputs"]["clip"] = [swap_id, 1]
    wf[lora_id] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": ["load", 0], "lora_name": tiny_models.LORAS["wan21_lora"]["filename"],
        "strength_model": 1.0}}
    wf["sample_lora"] = copy.deepcopy(wf["sample"])
    wf["sample_lora"]["inputs"]["model"] = [lora_id, 0]
    wf["stats_lora"] = {"class_type": "TieredTestLatentStats", "inputs": {"samples": ["sample_lora", 0]}}
    return wf


def test_two_branch_prompt_is_right_in_either_order(comfy):
    plain = latent_sha(comfy.run(sample_workflow("wan21")))
    lora = latent_sha(comfy.run(sample_workflow("wan21", lora_strength=1.0)))
    for swap_first in (True, False):
        comfy.free()
        out = comfy.run(two_branches(swap_first))
        assert latent_sha(out) == plain, swap_first
        assert latent_sha(out, "stats_lora") == lora, swap_first


def test_swap_with_layerwise_offload_is_identical(comfy):
    plain = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    wf = sample_workflow("wan21", layerwise={"resident_blocks": 0, "prefetch": 1})
    both = comfy.run(with_text_encode(wf, swap=True, model_node="offload"))
    assert latent_sha(both) == latent_sha(plain)
    assert encode_sha(both) == encode_sha(plain)


def test_swap_over_a_kept_layerwise_pack_holds_the_blocks_once(comfy):
    """An earlier workflow streamed the model and its pack is kept; Model-Level Swap on the same
    model leaves the blocks in that pack (its master holds the rest), and nothing changes."""
    comfy.free()
    plain = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    comfy.run(sample_workflow("wan21", layerwise={"resident_blocks": 0, "prefetch": 1}))
    swapped = comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    assert latent_sha(swapped) == latent_sha(plain) and encode_sha(swapped) == encode_sha(plain)
    dit = members(comfy)["WAN21"]
    lw = next(m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel")
    assert dit["in_layerwise_pack"] > 0
    assert dit["bytes"]["master"] <= lw["rest_bytes"] + 64 * 1024  # the rest, not the blocks again
    comfy.free()


def test_two_samplers_with_swap_are_identical(comfy):
    """Wan 2.2 style high/low experts, each under Model-Level Swap with the same encoder."""
    from test_layerwise_nodes import two_stage_workflow

    plain = comfy.run(with_text_encode(two_stage_workflow(), swap=False))
    wf = with_text_encode(two_stage_workflow(), swap=True)
    wf["swap_low"] = {"class_type": "ModelLevelSwap", "inputs": {"model": ["load_low", 0], "clip": ["clip", 0]}}
    wf["sample_low"]["inputs"]["model"] = ["swap_low", 0]
    swapped = comfy.run(wf)
    assert latent_sha(swapped) == latent_sha(plain)
    assert encode_sha(swapped) == encode_sha(plain)
