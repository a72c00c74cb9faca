"""Every model core has loaded, as GET /offload/tiers' `loaded` list reports it, and core's
unload from REST: through a real server, with core's loaders, the pack's nodes and the Tiered
loaders."""
from test_model_swap import with_text_encode
from workflows import latent_sha, sample_workflow


def cards(comfy) -> list[dict]:
    return comfy.get("/offload/tiers")["loaded"]


def card(comfy, cls: str, core: bool = True) -> dict:
    found = [c for c in cards(comfy) if c["class"] == cls and (c["core"] or not core)]
    assert found, cards(comfy)
    return found[0]


def test_core_loaded_models_are_listed_with_what_the_pack_does(comfy):
    wf = with_text_encode(sample_workflow("wan21", layerwise={"resident_blocks": 1}), swap=False)
    comfy.run(wf)
    wan, clip = card(comfy, "WAN21"), card(comfy, "SD1ClipModel")
    assert wan["kind"] == "diffusion model" and wan["network"] == "WanModel"
    # Each card names the file core's loader read (core's record where it keeps one, else the
    # pack's), on every ComfyUI version.
    names = [node["inputs"][key] for node in wf.values() for key in ("unet_name", "clip_name") if key in node["inputs"]]
    assert [wan["file"], clip["file"]] == names, (wan["file"], clip["file"], names)
    assert clip["kind"] == "text encoder" and clip["network"] is None
    for c in (wan, clip):
        b = c["bytes"]
        assert b["device"] + b["ram"] + b["disk"] == b["total"] > 0 and b["loaded_by_core"] <= b["total"], c
        assert c["tier_id"] is None and c["swap"] is None
    # The streamed model's size is its blocks (the engine's pack) and the rest core holds, not
    # core's figure for a module whose streamed blocks it handed over.
    lw = wan["layerwise"]
    assert wan["bytes"]["total"] == lw["block_bytes"] + lw["rest_bytes"] == \
        wan["bytes"]["blocks"] + wan["bytes"]["rest"], (wan["bytes"], lw["block_bytes"], lw["rest_bytes"])
    assert wan["layerwise"]["blocks"] == 2 and len(wan["layerwise"]["resident_indices"]) == 1, wan
    assert clip["layerwise"] is None

    # Under Model-Level Swap the partner that is not taking its turn is unloaded from core; its
    # pinned master keeps a card (core False, no core figures) so its RAM is never hidden.
    comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    # (Other models of these classes may be loaded on a server shared with other tests: the
    # swapped ones are those with a swap report.)
    swapped = [next((c for c in cards(comfy) if c["class"] == cls and c["swap"]), None)
               for cls in ("WAN21", "SD1ClipModel")]
    assert all(swapped) and swapped[0]["swap"]["turns"] >= 1, cards(comfy)
    assert all(c["bytes"] is None for c in swapped if not c["core"]), swapped
    # A master's card has the kind of the model's own card.
    assert [c["kind"] for c in swapped] == ["diffusion model", "text encoder"], swapped

    wf = sample_workflow("wan21")
    wf["load"]["class_type"] = "TieredUNETLoader"
    comfy.run(wf)
    managed = {m["id"]: m for m in comfy.get("/offload/tiers")["models"]}
    wan = card(comfy, "WAN21")
    assert wan["tier_id"] in managed and wan["file"] == managed[wan["tier_id"]]["name"]


def test_core_unload_between_prompts_and_the_next_prompt_is_identical(comfy):
    wf = sample_workflow("wan21")
    base = latent_sha(comfy.run(wf))
    wan = card(comfy, "WAN21")
    status, body = comfy.request("POST", f"/offload/loaded/{wan['id']}/unload")
    assert status == 200 and body["unloaded"]["class"] == "WAN21", body
    assert wan["id"] not in [c["id"] for c in cards(comfy)]
    assert latent_sha(comfy.run(wf)) == base
    # The cached loader output is the same model: core loaded it again, under the same card.
    assert card(comfy, "WAN21")["id"] == wan["id"]
    status, body = comfy.request("POST", "/offload/loaded/core-0/unload")
    assert status == 404, body

    tiered = sample_workflow("wan21")
    tiered["load"]["class_type"] = "TieredUNETLoader"
    comfy.run(tiered)
    managed = card(comfy, "WAN21")
    assert managed["tier_id"]
    status, body = comfy.request("POST", f"/offload/loaded/{managed['id']}/unload")
    assert status == 409 and "Park" in body["error"], body


def test_a_streamed_model_core_let_go_of_is_named_by_its_file(comfy):
    """Core unloads a streamed model that ComfyUI's cache still keeps: the pack still holds its
    blocks, and the card listing them names the file it was loaded from, as its card did while
    loaded (one file, one name, on every card); its Unload frees them and the next prompt is
    bit-identical."""
    wf = sample_workflow("wan21", layerwise={"resident_blocks": 1}, seed=5, steps=2)
    base = latent_sha(comfy.run(wf))
    wan = card(comfy, "WAN21")
    status, body = comfy.request("POST", f"/offload/loaded/{wan['id']}/unload")
    assert status == 200, body
    held = [c for c in cards(comfy) if not c["core"] and c["layerwise"] and c["class"] == "WanModel"]
    assert wan["file"] in [c["file"] for c in held], (wan["file"], held)
    assert all(c["file"] for c in held), held
    [mine] = [c for c in held if c["layerwise"]["module_id"] == wan["layerwise"]["module_id"]]
    status, body = comfy.request("POST", f"/offload/loaded/{mine['id']}/unload")
    assert status == 200, body
    assert latent_sha(comfy.run(wf)) == base


def test_a_held_swap_master_is_unloaded_between_prompts_and_the_next_prompt_is_identical(comfy):
    """A card that lists what the pack still holds of a model core let go of (the text encoder's
    Model-Level Swap master, out of core while the model samples) is unloaded as core's cards
    are: between prompts, after which it is gone, and what the encoder and the model compute
    next is bit-identical to what they computed before. (The 409 while a prompt runs is in
    tests/test_panel.py.)"""
    def workflow(text: str, seed: int) -> dict:
        wf = with_text_encode(sample_workflow("wan21", seed=seed, steps=2), swap=True)
        wf["encode"]["inputs"]["text"] = text
        return wf

    first = comfy.run(workflow("a red fox in the snow", 11))
    comfy.run(workflow("a blue bird on a wire", 12))   # the encoder loads from its master again
    held = [c for c in cards(comfy) if not c["core"] and c["swap"]]
    assert [c["kind"] for c in held] == ["text encoder"], held
    status, body = comfy.request("POST", f"/offload/loaded/{held[0]['id']}/unload")
    assert status == 200 and body["unloaded"] == {"id": held[0]["id"], "class": "SD1ClipModel"}, body
    assert held[0]["id"] not in [c["id"] for c in cards(comfy)]
    status, body = comfy.request("POST", f"/offload/loaded/{held[0]['id']}/unload")
    assert status == 404, body
    again = comfy.run(workflow("a red fox in the snow", 11))   # both encode and sample run again
    assert again["encode_stats"] == first["encode_stats"]
    assert latent_sha(again) == latent_sha(first)
