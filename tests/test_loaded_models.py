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
    comfy.run(with_text_encode(sample_workflow("wan21", layerwise={"resident_blocks": 1}), swap=False))
    wan, clip = card(comfy, "WAN21"), card(comfy, "SD1ClipModel")
    assert wan["kind"] == "diffusion model" and wan["network"] == "WanModel"
    assert clip["kind"] == "text encoder" and clip["network"] is None
    for c in (wan, clip):
        b = c["bytes"]
        assert b["device"] + b["ram"] == b["total"] > 0 and b["loaded_by_core"] <= b["total"], c
        assert c["tier_id"] is None and c["swap"] is None
    assert wan["layerwise"]["blocks"] == 2 and len(wan["layerwise"]["resident_indices"]) == 1, wan
    assert clip["layerwise"] is None

    # Under Model-Level Swap the partner that is not taking its turn is unloaded from core; its
    # pinned master keeps a card (core False, no core figures) so its RAM is never hidden.
    comfy.run(with_text_encode(sample_workflow("wan21"), swap=True))
    swapped = [card(comfy, cls, core=False) for cls in ("WAN21", "SD1ClipModel")]
    assert all(c["swap"] for c in swapped) and swapped[0]["swap"]["turns"] >= 1, swapped
    assert all(c["bytes"] is None for c in swapped if not c["core"]), swapped

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
