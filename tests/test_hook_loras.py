"""Core's hook LoRAs (CreateHookLoraModelOnly + ConditioningSetProperties on the positive) under
every node of the pack, through a real server, against the same workflow without the pack's
nodes on a second server that has no pack.

Core patches hooked weights in place while it samples, by key, for each group of conditionings:
- streamed blocks hold no tensors between passes, so the engine applies their hook patches to
  its copies (nodes/layerwise/hook_weights.py) and core must not log "Key does not exist";
- what the pack hands back to core between prompts (a kept pack, shared or not; a swap master)
  must take an in-place write: the same model without the node, with a hook LoRA, right after a
  prompt with the node, is where a read-only mapping used to kill the server;
- keyframes change a hook's strength mid-run: the streamed copies follow.
"""
from __future__ import annotations

import copy

import pytest

from comfy_server import ComfyServer
from test_model_swap import with_text_encode
from workflows import LORA_FILE, latent_sha, sample_workflow

KEY_MISSING = "Key does not exist in model"


@pytest.fixture(scope="module")
def twin(comfy_base, tmp_path_factory):
    """The same ComfyUI and models without the pack: the reference."""
    base = tmp_path_factory.mktemp("hook_twin")
    (base / "models").symlink_to(comfy_base / "models", target_is_directory=True)
    server = ComfyServer(base, with_pack=False).start()
    yield server
    server.stop()


def _hooked(wf: dict, strength: float = 0.8, keyframes: bool = False) -> dict:
    """The positive carries a hook LoRA (optionally with keyframes that change its strength)."""
    wf = copy.deepcopy(wf)
    wf["hook"] = {"class_type": "CreateHookLoraModelOnly",
                  "inputs": {"lora_name": LORA_FILE, "strength_model": strength}}
    hooks = ["hook", 0]
    if keyframes:
        wf["kf0"] = {"class_type": "CreateHookKeyframe",
                     "inputs": {"strength_mult": 0.25, "start_percent": 0.0}}
        wf["kf1"] = {"class_type": "CreateHookKeyframe",
                     "inputs": {"strength_mult": 1.5, "start_percent": 0.5, "prev_hook_kf": ["kf0", 0]}}
        wf["hook_kf"] = {"class_type": "SetHookKeyframes", "inputs": {"hooks": hooks, "hook_kf": ["kf1", 0]}}
        hooks = ["hook_kf", 0]
    wf["pos_hooked"] = {"class_type": "ConditioningSetProperties",
                        "inputs": {"cond_NEW": ["pos", 0], "strength": 1.0, "set_cond_area": "default",
                                   "hooks": hooks}}
    wf["sample"]["inputs"]["positive"] = ["pos_hooked", 0]
    return wf


def _stripped(wf: dict) -> dict:
    """The workflow without the pack's nodes: what each of them fed on goes straight through."""
    wf = copy.deepcopy(wf)
    ours = {name: node for name, node in wf.items()
            if node["class_type"] in ("ApplyLayerwiseOffload", "ModelLevelSwap")}
    for name, node in ours.items():
        del wf[name]
        feeds = {0: node["inputs"].get("model"), 1: node["inputs"].get("clip")}
        for other in wf.values():
            for key, value in other["inputs"].items():
                if isinstance(value, list) and len(value) == 2 and value[0] == name:
                    other["inputs"][key] = feeds[value[1]]
    return wf


def _same_as_core(comfy: ComfyServer, twin: ComfyServer, wf: dict) -> str:
    """Run ``wf`` on the pack's server and its stripped twin on the other; the results match and
    core found every hooked key. Returns the result's hash."""
    before = len(comfy.log_text())
    got = latent_sha(comfy.run(wf))
    want = latent_sha(twin.run(_stripped(wf)))
    assert got == want
    assert KEY_MISSING not in comfy.log_text()[before:]
    return got


def _layerwise(resident: int, **more) -> dict:
    return {"resident_blocks": resident, **more}


def test_the_hook_changes_the_result(comfy, twin):
    """The check below could not pass by a hook that does nothing."""
    plain = sample_workflow("wan21", steps=3)
    assert latent_sha(twin.run(plain)) != latent_sha(twin.run(_hooked(plain)))


@pytest.mark.parametrize("layerwise", [
    _layerwise(0),  # every block streamed
    _layerwise(1),  # one resident (core patches it), one streamed (the engine)
    _layerwise(-1),  # all resident
    _layerwise(0, granularity="phase", share_host_memory=False),
], ids=["streamed", "half", "resident", "phases-private"])
def test_a_hook_lora_under_layerwise_offload_is_core_bit_for_bit(comfy, twin, layerwise):
    wf = sample_workflow("wan21", layerwise=layerwise, steps=3)
    _same_as_core(comfy, twin, _hooked(wf))
    _same_as_core(comfy, twin, _hooked(wf, strength=0.3))  # another strength: new patches, kept pack


def test_a_hook_lora_beside_a_regular_lora_and_keyframes(comfy, twin):
    wf = sample_workflow("wan21", layerwise=_layerwise(0), lora_strength=0.6, steps=4)
    _same_as_core(comfy, twin, _hooked(wf, keyframes=True))
    _same_as_core(comfy, twin, _hooked(sample_workflow("wan21", layerwise=_layerwise(1), steps=4), keyframes=True))


def test_the_model_after_the_node_takes_a_hook_lora(comfy, twin):
    """A prompt with the node keeps its (shared) pack and hands the blocks back; the next prompt
    without the node writes the hooked weights in place, as core does."""
    for layerwise in (_layerwise(-1), _layerwise(0)):
        _same_as_core(comfy, twin, sample_workflow("wan21", layerwise=layerwise, steps=2))
        _same_as_core(comfy, twin, _hooked(sample_workflow("wan21", steps=2)))
        _same_as_core(comfy, twin, sample_workflow("wan21", layerwise=layerwise, steps=2))  # and back
        # Model-Level Swap of the model whose blocks the kept pack holds, with a hook LoRA
        _same_as_core(comfy, twin, _hooked(with_text_encode(sample_workflow("wan21", steps=2), swap=True)))


def test_a_hook_lora_under_model_level_swap_and_both_nodes(comfy, twin):
    swap = with_text_encode(sample_workflow("wan21", steps=2), swap=True)
    _same_as_core(comfy, twin, _hooked(swap))
    both = with_text_encode(sample_workflow("wan21", layerwise=_layerwise(0), steps=2), swap=True,
                            model_node="offload")
    _same_as_core(comfy, twin, _hooked(both))
    _same_as_core(comfy, twin, _hooked(sample_workflow("wan21", steps=2)))  # the model alone, after both
