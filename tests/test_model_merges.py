"""Core's model merges under Apply Layerwise Offload, through a real server: the bits of core's full load.

A merge hands the other model's weights to the first as weight patches whose `strength_model` is
not 1, on every weight of the model, a block's own weights too (Wan's `modulation`), which core's
load never merges (its load list leaves out a module with weights below it). Each merge node runs
on a six-block Wan streamed from RAM, as phases and from the model's own file, and resident; then
with a LoRA on top, under Model-Level Swap, with the second model loaded by a Tiered loader and
streamed from its file in an earlier prompt, and an fp8 first model (its merge rounds
stochastically into fp8 with `out=` ops, which refuse tensors that record autograd history: the
other model's parameters require grad). Every latent is the one the same workflow gives without
the pack's nodes on the same server.
"""
from __future__ import annotations

import copy
import math

import pytest
from safetensors import safe_open

import tiny_models
from test_disk_streaming import GIB, PAGE, engine
from test_model_swap import with_text_encode
from workflows import latent_sha, sample_workflow
from ws_interrupt import queue_and_interrupt

FIRST = "merge_wan6_a.safetensors"
SECOND = "merge_wan6_b.safetensors"
LORA = "merge_wan6_lora.safetensors"
BLOCKS = 6
STREAMED = {"resident_blocks": 0, "prefetch": 1, "granularity": "block"}
# Each merge node of core with the inputs it is drawn with (per block where it has them).
MERGES = {
    "ModelMergeSimple": {"ratio": 0.3},
    "ModelMergeSubtract": {"multiplier": 0.6},
    "ModelMergeAdd": {},
    "ModelMergeBlocks": {"input": 0.2, "middle": 0.5, "out": 0.8},
    "ModelMergeWAN2_1": {**{f"blocks.{i}.": round(0.15 * (i % 7), 2) for i in range(40)},
                         "patch_embedding.": 0.4, "time_embedding.": 1.0, "time_projection.": 0.7,
                         "text_embedding.": 0.2, "img_emb.": 1.0, "head.": 0.0},
}


@pytest.fixture(scope="module")
def merge_models(comfy_base):
    """Two six-block Wans of one family (the merge's two inputs) and a LoRA on all six blocks."""
    models = comfy_base / "models" / "diffusion_models"
    for name, seed in ((FIRST, 71), (SECOND, 72)):
        if not (models / name).exists():
            tiny_models.write_tiny_wan21(models / name, layers=BLOCKS, seed=seed)
    lora = comfy_base / "models" / "loras" / LORA
    if not lora.exists():
        tiny_models.write_tiny_wan_lora(lora, model_layers=BLOCKS, seed=73)
    return models


def merged_workflow(node: str, layerwise: dict | None = None, *, lora: float | None = None,
                    first_dtype: str = "default", second_loader: str = "UNETLoader", seed: int = 42) -> dict:
    """UNETLoader (FIRST), a second loader (SECOND) → the merge node → [LoRA] → [Apply Layerwise
    Offload] → KSampler."""
    wf = sample_workflow("wan21", seed=seed)
    wf["load"]["inputs"].update(unet_name=FIRST, weight_dtype=first_dtype)
    wf["load2"] = {"class_type": second_loader, "inputs": {"unet_name": SECOND, "weight_dtype": "default"}}
    wf["merge"] = {"class_type": node, "inputs": {"model1": ["load", 0], "model2": ["load2", 0], **MERGES[node]}}
    model = ["merge", 0]
    if lora is not None:
        wf["lora"] = {"class_type": "LoraLoaderModelOnly",
                      "inputs": {"model": model, "lora_name": LORA, "strength_model": lora}}
        model = ["lora", 0]
    if layerwise is not None:
        wf["offload"] = {"class_type": "ApplyLayerwiseOffload",
                         "inputs": {"model": model, "vram_budget_gb": 12.0, "pin": True, **layerwise}}
        model = ["offload", 0]
    wf["sample"]["inputs"]["model"] = model
    return wf


def disk_settings(models, units: float = 3.5) -> dict:
    """Blocks streamed from the model's file through a cache of about ``units`` blocks (both
    models' blocks are the same size)."""
    with safe_open(str(models / FIRST), "pt") as f:  # fp32: 4 bytes a value
        block = sum(4 * math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("blocks.0."))
    return {**STREAMED, "host_cache_gb": units * (-(-block // PAGE) * PAGE) / GIB}


@pytest.mark.parametrize("node", list(MERGES))
def test_merge_is_core_s_on_streamed_resident_phase_and_disk_blocks(comfy, merge_models, node):
    reference = latent_sha(comfy.run(merged_workflow(node)))
    assert reference != latent_sha(comfy.run(sample_workflow("wan21"))), "the merge must change the result"
    for layerwise in (STREAMED, {**STREAMED, "granularity": "phase"}, {**STREAMED, "resident_blocks": BLOCKS}):
        assert latent_sha(comfy.run(merged_workflow(node, layerwise))) == reference, (node, layerwise)
    disk = disk_settings(merge_models)
    assert latent_sha(comfy.run(merged_workflow(node, disk))) == reference, (node, "disk")
    state = engine(comfy, "WanModel", blocks=BLOCKS)
    assert state["disk"]["active"] and state["telemetry"]["disk_reads"] > 0, state["disk"]
    assert state["telemetry"]["transforms"] > 0, "the merge was not applied to the streamed copies"
    # The merged model without the node afterwards: core's again.
    assert latent_sha(comfy.run(merged_workflow(node))) == reference


def test_merge_with_a_lora_on_top_and_an_fp8_first_model_from_disk(comfy, merge_models):
    with_lora = latent_sha(comfy.run(merged_workflow("ModelMergeSimple", lora=0.8)))
    assert latent_sha(comfy.run(merged_workflow("ModelMergeSimple", STREAMED, lora=0.8))) == with_lora
    assert latent_sha(comfy.run(merged_workflow("ModelMergeSimple", disk_settings(merge_models), lora=0.8))) == with_lora
    # fp8 storage: core's merge rounds stochastically into fp8; so must the engine's, without
    # the other model's parameters dragging autograd into it.
    fp8 = latent_sha(comfy.run(merged_workflow("ModelMergeSimple", first_dtype="fp8_e5m2")))
    assert latent_sha(comfy.run(merged_workflow("ModelMergeSimple", STREAMED, first_dtype="fp8_e5m2"))) == fp8
    assert latent_sha(comfy.run(merged_workflow("ModelMergeSimple", disk_settings(merge_models),
                                                first_dtype="fp8_e5m2"))) == fp8


def test_merge_of_a_tiered_model_streamed_from_its_file_under_swap(comfy, merge_models):
    """The second model comes from a Tiered loader and was streamed from its own file in the
    prompt before (its blocks hold no bytes between runs); the merged model is streamed and then
    swapped with the text encoder."""
    tiered = dict(second_loader="TieredUNETLoader")
    reference = latent_sha(comfy.run(with_text_encode(merged_workflow("ModelMergeSimple", **tiered), swap=False)))
    second_alone = sample_workflow("wan21")
    second_alone["load"] = {"class_type": "TieredUNETLoader", "inputs": {"unet_name": SECOND, "weight_dtype": "default"}}
    second_alone["offload"] = {"class_type": "ApplyLayerwiseOffload",
                               "inputs": {"model": ["load", 0], "vram_budget_gb": 12.0, "pin": True,
                                          **disk_settings(merge_models)}}
    second_alone["sample"]["inputs"]["model"] = ["offload", 0]
    comfy.run(second_alone)
    assert engine(comfy, "WanModel", blocks=BLOCKS)["disk"]["active"]
    swapped = with_text_encode(merged_workflow("ModelMergeSimple", disk_settings(merge_models), **tiered),
                               swap=True, model_node="offload")
    assert latent_sha(comfy.run(swapped)) == reference
    assert latent_sha(comfy.run(with_text_encode(merged_workflow("ModelMergeSimple", **tiered), swap=True))) == reference


@pytest.mark.parametrize("interrupted", [False, True], ids=["finished", "interrupted"])
def test_swap_after_a_prompt_that_streamed_the_model_from_its_file(comfy, merge_models, interrupted):
    """Model-Level Swap builds its master from the model's tensors. After a prompt that streamed
    the blocks from the model's file, they hold no bytes until they are read back: the master must
    read them back first (it packed empty tensors and failed every later prompt, until the model
    was freed). The next prompts, with the swap alone and with core alone, are core's."""
    comfy.free()
    plain = sample_workflow("wan21")
    plain["load"]["inputs"]["unet_name"] = FIRST
    reference = latent_sha(comfy.run(with_text_encode(plain, swap=False)))
    streamed = sample_workflow("wan21", seed=44, layerwise=disk_settings(merge_models))
    streamed["load"] = plain["load"]
    prompt = with_text_encode(streamed, swap=True, model_node="offload")
    if interrupted:
        prompt_id, sent = queue_and_interrupt(comfy.url, prompt, lambda data: data.get("value", 0) >= 2)
        assert sent, "the prompt ended before its second progress event"
        assert comfy.wait(prompt_id)["status"]["status_str"] == "error"
    else:
        comfy.run(prompt)
    assert engine(comfy, "WanModel", blocks=BLOCKS)["disk"]["file_bytes"] > 0
    assert latent_sha(comfy.run(with_text_encode(plain, swap=True))) == reference
    assert latent_sha(comfy.run(with_text_encode(plain, swap=False))) == reference


def slg_workflow(layerwise: dict | None = None, seed: int = 42) -> dict:
    """The first model with skip-layer guidance over two of its blocks in every step: each step
    runs one more call, in which those blocks are replaced by a pass-through."""
    wf = sample_workflow("wan21", seed=seed, steps=4)
    wf["load"]["inputs"]["unet_name"] = FIRST
    wf["slg"] = {"class_type": "SkipLayerGuidanceDiT", "inputs": {
        "model": ["load", 0], "double_layers": "1, 3", "single_layers": "", "scale": 3.0,
        "start_percent": 0.0, "end_percent": 1.0, "rescaling_scale": 0.0}}
    model = ["slg", 0]
    if layerwise is not None:
        wf["offload"] = {"class_type": "ApplyLayerwiseOffload",
                         "inputs": {"model": model, "vram_budget_gb": 12.0, "pin": True, **layerwise}}
        model = ["offload", 0]
    wf["sample"]["inputs"]["model"] = model
    return wf


INTERRUPTED = {
    # a merge merged into each streamed copy, from the model's file
    "merge": lambda models: merged_workflow("ModelMergeSimple", disk_settings(models), seed=45),
    # a step's extra call that skips two of the streamed blocks
    "skipped-block call": lambda models: slg_workflow(STREAMED, seed=45),
}


@pytest.mark.parametrize("point", list(INTERRUPTED))
def test_an_interrupt_leaves_core_s_model_whole(comfy, merge_models, point):
    """Interrupted at its second step, a prompt leaves the loaded model as core holds it: the
    next prompts on it, without the pack's nodes, with Apply Layerwise Offload and with
    Model-Level Swap, give core's latents (while packing: test_layerwise_nodes.py's
    test_interrupt_while_packing_leaves_core_consistent; in a swap: the test above)."""
    if point == "merge":
        follow_ups = {"core": merged_workflow("ModelMergeSimple"),
                      "offload": merged_workflow("ModelMergeSimple", STREAMED)}
    else:
        follow_ups = {"core": slg_workflow(), "offload": slg_workflow(STREAMED)}
    reference = latent_sha(comfy.run(follow_ups["core"]))
    prompt_id, sent = queue_and_interrupt(comfy.url, INTERRUPTED[point](merge_models),
                                          lambda data: data.get("value", 0) >= 2)
    assert sent, "the prompt ended before its second progress event"
    assert comfy.wait(prompt_id)["status"]["status_str"] == "error"
    swap = with_text_encode(copy.deepcopy(follow_ups["offload"]), swap=True, model_node="offload")
    for name, wf in (*follow_ups.items(), ("swap", swap), ("core again", follow_ups["core"])):
        assert latent_sha(comfy.run(wf)) == reference, name
