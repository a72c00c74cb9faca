"""VRAM Tier Manager through a real server: tiered loaders, budgets, REST and preload."""
import json
import time

import psutil
import pytest

from comfy_server import ComfyServer
from conftest import ARTIFACTS, write_fixture_models
from workflows import latent_sha, sample_workflow

GIB = 1024 ** 3


def tiered(kind: str, **kwargs) -> dict:
    wf = sample_workflow(kind, **kwargs)
    wf["load"]["class_type"] = "TieredUNETLoader"
    return wf


def models_by_name(server) -> dict:
    return {m["name"]: m for m in server.get("/offload/tiers")["models"]}


def model(server, name: str) -> dict:
    found = models_by_name(server)
    assert name in found, found
    return found[name]


def wait_until(predicate, timeout=30.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def tier_server(tmp_path):
    """A fresh server per test: tier state is process-wide."""
    base = tmp_path / "base"
    write_fixture_models(base)
    server = ComfyServer(base).start()
    yield server
    server.stop()


WAN = "tiny_wan21_t2v.safetensors"
SD3 = "tiny_sd3.safetensors"


def test_tiered_loader_matches_core_and_switching_back_comes_from_ram(tier_server):
    s = tier_server
    core_a = latent_sha(s.run(sample_workflow("wan21")))
    core_b = latent_sha(s.run(sample_workflow("sd3")))
    a1 = latent_sha(s.run(tiered("wan21")))
    assert a1 == core_a
    assert model(s, WAN)["loads_from_disk"] == 1
    assert latent_sha(s.run(tiered("sd3"))) == core_b
    # Without VRAM pressure core keeps A loaded: it comes back from the device tier.
    assert latent_sha(s.run(tiered("wan21"))) == core_a
    wan = model(s, WAN)
    assert wan["loads_from_disk"] == 1 and wan["load_count"] >= 2, wan
    # Under VRAM pressure A is parked in RAM while B runs (done here through the REST API,
    # as the manager does when room is needed); then A comes back from RAM, not disk.
    status, _ = s.request("POST", f"/offload/models/{wan['id']}/park")
    assert status == 200 and model(s, WAN)["tier"] == "ram"
    assert latent_sha(s.run(tiered("sd3"))) == core_b
    assert latent_sha(s.run(tiered("wan21"))) == core_a
    wan = model(s, WAN)
    assert wan["loads_from_disk"] == 1 and wan["loads_from_ram"] >= 1, wan
    assert f"'{WAN}' ({wan['id']}) served from its RAM copy, no disk read" in s.log_text()


def test_ram_budget_pushes_lru_model_to_disk_and_reload_is_identical(tier_server):
    s = tier_server
    a1 = latent_sha(s.run(tiered("wan21")))
    wan_bytes = model(s, WAN)["total_bytes"]
    # Room for one tiny model, not two.
    s.post("/offload/budgets", {"ram_budget_gb": 1.5 * wan_bytes / GIB})
    latent_sha(s.run(tiered("sd3")))
    wan = model(s, WAN)
    assert wan["tier"] == "disk", wan
    assert model(s, SD3)["tier"] in ("ram", s.loaded_tier())
    assert latent_sha(s.run(tiered("wan21"))) == a1
    assert model(s, WAN)["loads_from_disk"] == 2
    assert "dropped to disk" in s.log_text()


def test_rest_evict_of_a_model_in_use_is_refused_and_the_prompt_completes(tier_server):
    s = tier_server
    s.run(tiered("wan21", steps=2))
    key = model(s, WAN)["id"]
    prompt_id = s.queue(tiered("wan21", steps=400))
    wait_until(lambda: model(s, WAN)["in_use"] > 0, what="the model to be in use")
    status, body = s.request("POST", f"/offload/models/{key}/evict")
    assert status == 409 and "prompt is running" in body["error"], (status, body)
    entry = s.wait(prompt_id)
    assert entry["status"]["status_str"] == "success"
    wait_until(lambda: model(s, WAN)["in_use"] == 0, what="the prompt to release the model")
    status, body = s.request("POST", f"/offload/models/{key}/evict")
    assert status == 200 and body["model"]["tier"] == "disk"


def test_moves_from_the_api_are_refused_while_a_prompt_runs_and_work_after_it(tier_server):
    """Core's model management belongs to the prompt worker: while a prompt runs, a move from the
    API is refused for every model, not only the prompt's own, and a policy change is not a move.
    The prompt and the next one are right."""
    s = tier_server
    reference = latent_sha(s.run(tiered("wan21", steps=2)))
    s.run(tiered("sd3", steps=2))
    wan, other = model(s, WAN)["id"], model(s, SD3)["id"]
    slow = s.queue_running(tiered("wan21", steps=400))  # samples: an interrupt now reaches it
    try:
        assert model(s, WAN)["in_use"] > 0
        for path, body in ((f"/offload/models/{other}/park", None), (f"/offload/models/{other}/load", None),
                           (f"/offload/models/{other}/evict", None), (f"/offload/models/{wan}/park", None),
                           ("/offload/budgets", {"ram_budget_gb": 4.0})):
            status, reply = s.request("POST", path, body)
            assert status == 409 and "a prompt is running" in reply["error"], (path, status, reply)
        status, reply = s.request("POST", f"/offload/policy/{other}", {"priority": 3})
        assert status == 200 and reply["model"]["policy"]["priority"] == 3, reply
        assert model(s, WAN)["in_use"] > 0, "the prompt ended before the requests: not a refusal test"
    finally:
        s.interrupt()
        s.wait(slow, timeout=120)
    wait_until(lambda: model(s, WAN)["in_use"] == 0, what="the prompt to release the model")
    for action, tier in (("evict", "disk"), ("park", "ram")):
        status, reply = s.request("POST", f"/offload/models/{other}/{action}")
        assert status == 200 and reply["model"]["tier"] == tier, (action, status, reply)
    assert latent_sha(s.run(tiered("wan21", steps=2))) == reference


def test_an_unpin_while_a_prompt_runs_drops_nothing_until_the_prompt_ends(tier_server):
    """Unpin (the action, and keep_in_ram false) is taken at once, but the drop to disk it makes
    necessary goes through core's unload, which belongs to the prompt worker: it waits for the
    running prompt's end. Unknown ids get 404 meanwhile, not "a prompt is running"."""
    s = tier_server
    s.run(tiered("sd3", steps=2))
    sd3 = model(s, SD3)["id"]
    unknown = "0123456789abcdef"
    for how in ("unpin", "policy"):
        if model(s, SD3)["tier"] == "disk":
            assert s.request("POST", f"/offload/models/{sd3}/park")[0] == 200
        s.post(f"/offload/models/{sd3}/pin")
        s.post("/offload/budgets", {"ram_budget_gb": 1 / 1024})  # 1 MiB: only its pin keeps it
        assert model(s, SD3)["tier"] != "disk"
        slow = s.queue(sample_workflow("wan21", steps=400))  # core's loader: nothing of the manager's
        try:
            wait_until(lambda: s.get("/queue")["queue_running"], what="the prompt to start")
            if how == "unpin":
                status, reply = s.request("POST", f"/offload/models/{sd3}/unpin")
            else:
                status, reply = s.request("POST", f"/offload/policy/{sd3}", {"keep_in_ram": False})
            assert status == 200 and reply["model"]["policy"]["keep_in_ram"] is False, (how, status, reply)
            assert model(s, SD3)["tier"] != "disk", "dropped through core's unload while a prompt runs"
            for path, body in ((f"/offload/models/{unknown}/park", None), (f"/offload/models/{unknown}/unpin", None),
                               (f"/offload/policy/{unknown}", {"priority": 1}),
                               ("/offload/loaded/core-999999/unload", None)):
                status, reply = s.request("POST", path, body)
                assert status == 404, (path, status, reply)
            assert s.get("/queue")["queue_running"], "the prompt ended before the checks: not a deferral test"
        finally:
            s.interrupt()
            s.wait(slow, timeout=120)
        wait_until(lambda: model(s, SD3)["tier"] == "disk", what="the drop when the prompt ended")
        s.post("/offload/budgets", {"ram_budget_gb": None})


def test_rest_actions_move_models_and_bad_requests_get_clear_4xx(tier_server):
    s = tier_server
    s.run(tiered("wan21"))
    key = model(s, WAN)["id"]
    top = s.loaded_tier()  # "cpu" on a server without a GPU: the API names no VRAM tier there
    for action, tier in (("park", "ram"), ("load", top), ("evict", "disk"), ("load", top)):
        status, body = s.request("POST", f"/offload/models/{key}/{action}")
        assert status == 200 and body["model"]["tier"] == tier, (action, status, body)
    status, body = s.request("POST", f"/offload/policy/{key}", {"priority": 0})
    assert status == 200 and body["model"]["tier"] == top, body  # every answer names the tier alike
    assert s.request("POST", f"/offload/models/{key}/pin")[1]["model"]["policy"]["keep_in_ram"]
    status, body = s.request("POST", f"/offload/models/{key}/evict")
    assert status == 409 and "kept in ram" in body["error"].lower(), body
    assert not s.request("POST", f"/offload/models/{key}/unpin")[1]["model"]["policy"]["keep_in_ram"]

    cases = [
        ("POST", "/offload/models/0123456789abcdef/park", None, None, 404, "no model"),
        ("POST", f"/offload/models/{key}/explode", None, None, 400, "unknown action"),
        ("POST", "/offload/budgets", None, b"{not json", 400, "JSON"),
        ("POST", "/offload/budgets", [1, 2], None, 400, "JSON object"),
        ("POST", "/offload/budgets", {}, None, 400, "non-empty"),
        ("POST", "/offload/budgets", {"ram_budget_gb": -1}, None, 400, "ram_budget_gb"),
        ("POST", "/offload/budgets", {"ram_budget_gb": "lots"}, None, 400, "ram_budget_gb"),
        ("POST", "/offload/budgets", {"disk_tier": "yes"}, None, 400, "disk_tier"),
        ("POST", "/offload/budgets", {"path": "/etc/passwd"}, None, 400, "unknown field"),
    ]
    for method, path, body, raw, want, fragment in cases:
        status, reply = s.request(method, path, body, raw=raw)
        assert status == want, (path, body, raw, status, reply)
        assert fragment.lower() in reply["error"].lower(), (path, reply)
    assert s.get("/system_stats")["system"]
    assert latent_sha(s.run(tiered("wan21"))) is not None


def test_tier_manager_node_sets_budgets_and_policy_from_the_api_queue(tier_server):
    s = tier_server
    wf = tiered("wan21")
    wf["tm"] = {"class_type": "VRAMTierManager", "inputs": {
        "model": ["load", 0], "ram_budget_gb": 3.0, "ram_reserve_gb": 1.0,
        "vram_reserve_gb": 0.5, "disk_tier": True, "keep_in_ram": True, "priority": 7}}
    wf["sample"]["inputs"]["model"] = ["tm", 0]
    baseline = latent_sha(s.run(sample_workflow("wan21")))
    assert latent_sha(s.run(wf)) == baseline
    budgets = s.get("/offload/tiers")["budgets"]
    assert budgets["ram_budget_bytes"] == 3 * GIB and budgets["ram_reserve_bytes"] == GIB
    assert model(s, WAN)["policy"] == {"keep_in_ram": True, "priority": 7}

    untracked = sample_workflow("wan21")
    untracked["tm"] = dict(wf["tm"])
    untracked["sample"]["inputs"]["model"] = ["tm", 0]
    error = s.run_expect_error(untracked)
    assert "Tiered loader" in error["exception_message"]


def test_preload_at_start_then_a_prompt_neither_loads_twice_nor_fails(tmp_path):
    base = tmp_path / "base"
    write_fixture_models(base)
    (base / "user").mkdir(parents=True, exist_ok=True)
    (base / "user" / "tiered_offload.json").write_text(json.dumps({"preload": [
        {"loader": "TieredUNETLoader", "inputs": {"unet_name": WAN, "weight_dtype": "default"},
         "tier": "ram"},
        {"loader": "TieredUNETLoader", "inputs": {"unet_name": "missing.safetensors",
                                                  "weight_dtype": "default"}},
    ]}))
    s = ComfyServer(base).start()
    try:
        prompt_id = s.queue(tiered("wan21"))  # queued while the warm-up may still run
        entry = s.wait(prompt_id)
        assert entry["status"]["status_str"] == "success"
        wan = model(s, WAN)
        assert wan["loads_from_disk"] == 1, wan
        assert "skipping preload entry" in s.log_text() and "missing.safetensors" in s.log_text()
        assert "preload" in s.log_text()
    finally:
        s.stop()


@pytest.mark.one_lane
def test_soak_alternating_workflows_does_not_leak(tier_server):
    """50 prompts alternating two workflows: RSS, pinned bytes, open files and threads stay flat
    after warm-up. A leak of one file descriptor or one thread per prompt shows as +40."""
    s = tier_server
    proc = psutil.Process(s.proc.pid)
    samples = []
    for i in range(50):
        s.run(tiered("wan21" if i % 2 == 0 else "sd3"))
        if i >= 9:
            samples.append({"rss": proc.memory_info().rss,
                            "pinned": s.get("/offload/tiers")["devices"]["ram"]["pinned"],
                            "fds": proc.num_fds(), "threads": proc.num_threads()})
    series = {name: [sample[name] for sample in samples] for name in samples[0]}
    rss, pinned, fds, threads = (series[n] for n in ("rss", "pinned", "fds", "threads"))
    growth = rss[-1] - rss[0]
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "soak.json").write_text(json.dumps(
        {"prompts": 50, "warmup": 10, "rss_bytes_after_each": rss, "pinned_bytes_after_each": pinned,
         "open_fds_after_each": fds, "threads_after_each": threads,
         "rss_growth_bytes": growth}, indent=1))
    print(f"soak: RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB over 40 prompts "
          f"(max {max(rss) / 2**20:.1f}), pinned {min(pinned)}..{max(pinned)} bytes, "
          f"fds {min(fds)}..{max(fds)}, threads {min(threads)}..{max(threads)}")
    assert growth < 48 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 40 prompts: {rss}"
    assert max(pinned) == min(pinned), pinned
    # A socket of a request just answered may still be closing: a little slack, never a trend.
    assert max(fds[-10:]) <= max(fds[:10]) + 4, fds
    assert max(threads[-10:]) <= max(threads[:10]) + 2, threads


def test_tiered_checkpoint_and_vae_loaders_match_core(tier_server):
    """The checkpoint and VAE loaders hand out VAEs, which the tier manager must track through
    their patchers (a VAE failed as if it were a ModelPatcher). Decode and re-encode so the
    VAE's weights reach the compared latent."""
    import tiny_checkpoint
    import tiny_vae

    s = tier_server
    ckpt = s.base / "models" / "checkpoints" / "tiny_sd3_checkpoint.safetensors"
    tiny_checkpoint.write_tiny_sd3_checkpoint(ckpt)
    tiny_vae.write_tiny_taesd(s.base / "models" / "vae" / "tiny_taesd.safetensors", seed=5)

    def through_vae(wf: dict, vae_link: list) -> dict:
        wf["image"] = {"class_type": "VAEDecode", "inputs": {"samples": ["sample", 0], "vae": vae_link}}
        wf["again"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["image", 0], "vae": vae_link}}
        wf["stats"]["inputs"]["samples"] = ["again", 0]
        return wf

    def from_checkpoint(loader: str) -> dict:
        wf = sample_workflow("sd3")
        wf["load"] = {"class_type": loader, "inputs": {"ckpt_name": ckpt.name}}
        return through_vae(wf, ["load", 2])

    def separate_vae(loader: str) -> dict:
        wf = sample_workflow("sd3")
        wf["vae"] = {"class_type": loader, "inputs": {"vae_name": "tiny_taesd.safetensors"}}
        return through_vae(wf, ["vae", 0])

    for core, ours, build in (("CheckpointLoaderSimple", "TieredCheckpointLoader", from_checkpoint),
                              ("VAELoader", "TieredVAELoader", separate_vae)):
        reference = latent_sha(s.run(build(core)))
        assert latent_sha(s.run(build(ours))) == reference, ours
        assert latent_sha(s.run(build(ours))) == reference, f"{ours}, second run"
    names = models_by_name(s)
    assert ckpt.name in names and "tiny_taesd.safetensors" in names, sorted(names)
