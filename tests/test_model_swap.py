"""Model-Level Swap through a real server: the diffusion model and the text encoder take turns,
and neither the samples nor the text encodings change."""
import tiny_models
from workflows import latent_sha, sample_workflow


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
    wf["encode"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "a lighthouse at dusk"}}
    wf["encode_stats"] = {"class_type": "TieredTestConditioningStats",
                          "inputs": {"conditioning": ["encode", 0]}}
    return wf


def encode_sha(outputs):
    info = outputs["encode_stats"]["conditioning_stats"][0]
    assert info["finite"] and info["shape"] == [1, 77, 768]
    return info["sha256"]


def test_swap_keeps_samples_and_encodings_identical(comfy):
    plain = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    swapped = comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    assert latent_sha(swapped) == latent_sha(plain)
    assert encode_sha(swapped) == encode_sha(plain)
    again = comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    assert latent_sha(again) == latent_sha(plain) and encode_sha(again) == encode_sha(plain)
    members = {m["name"]: m for m in comfy.get("/offload/swap")["members"]}
    assert {"WAN21", "SD1ClipModel"} <= set(members), members
    # Both took turns: the encoder when it loaded to encode (once: the repeated encode is
    # answered from ComfyUI's cache), the diffusion model at each of the two samplings, which
    # brings it in from its master. (On CPU nothing is on a device to park.)
    assert members["WAN21"]["turns"] >= 2 and members["SD1ClipModel"]["turns"] >= 1, members
    assert members["WAN21"]["loads"] >= 1


def test_swap_with_layerwise_offload_is_identical(comfy):
    plain = comfy.run(with_text_encode(sample_workflow("wan21"), swap=False))
    wf = sample_workflow("wan21", layerwise={"resident_blocks": 0, "prefetch": 1})
    both = comfy.run(with_text_encode(wf, swap=True, model_node="offload"))
    assert latent_sha(both) == latent_sha(plain)
    assert encode_sha(both) == encode_sha(plain)


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
