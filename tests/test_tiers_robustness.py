"""The tier manager and the pack's routes under bad input, faults and API-queue use, through a
real server (issue 11, and the tier manager's drop of issue 10 C).

Every test ends with the server up and serving, and with a later prompt that gives the same bits
as before: a refusal is a clear 4xx JSON message or a clear prompt error, never a dead server, a
leaked hold or an emptied model.
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import urllib.error
import urllib.request

import psutil
import pytest

import tiny_models
from comfy_server import ComfyServer
from conftest import SECOND_WAN, write_fixture_models
from test_model_swap import with_text_encode
from test_tiers_server import GIB, SD3, WAN, model, models_by_name, tiered, wait_until
from workflows import latent_sha, sample_workflow
from ws_listener import WsListener

TIERS_EVENT = "tiered_offload.tiers"
MAX_MESSAGE = 400  # an error message is one readable line, whatever the request held


@pytest.fixture
def server(tmp_path):
    """A fresh server per test: tier state is process-wide."""
    base = tmp_path / "base"
    write_fixture_models(base)
    s = ComfyServer(base).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that restore what they change."""
    base = tmp_path_factory.mktemp("robust_base")
    write_fixture_models(base)
    s = ComfyServer(base).start()
    yield s
    s.stop()


def send(server: ComfyServer, method: str, path: str, data: bytes | None = None,
         content_type: str = "application/json", timeout: float = 120) -> tuple[int, object]:
    """One HTTP request with raw bytes and any content type; (status, JSON body or text)."""
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload.decode(errors="replace")


def send_chunked(server: ComfyServer, path: str, chunks: list[bytes]) -> tuple[int, object]:
    """A POST whose body comes in chunks with no Content-Length, as streaming clients send it."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        connection.request("POST", path, body=iter(chunks), encode_chunked=True,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status, payload = response.status, response.read()
    finally:
        connection.close()
    return status, json.loads(payload)


def assert_refused(answer: tuple[int, object], status: int, *fragments: str) -> str:
    got, body = answer
    assert got == status and isinstance(body, dict) and isinstance(body.get("error"), str), \
        (got, str(body)[:300])
    message = body["error"]
    assert 0 < len(message) <= MAX_MESSAGE, message[:MAX_MESSAGE]
    for fragment in fragments:
        assert fragment.lower() in message.lower(), (fragment, message)
    return message


def tiers_models(server: ComfyServer) -> list[dict]:
    return server.get("/offload/tiers")["models"]


# --------------------------------------------------------------------------------------------
# Bad input over every route


def budget_cases() -> list[tuple[bytes, str, int, tuple[str, ...]]]:
    """(body, content type, status, fragments the message must hold) for POST /offload/budgets."""
    json_type = "application/json"
    huge = "1" + "0" * 4294  # × 2^30 it has more than 4,300 digits
    too_many_digits = "1" + "0" * 5000  # Python refuses to parse it
    ram_gib = psutil.virtual_memory().total / GIB
    cases = []
    for field in ("ram_budget_gb", "ram_reserve_gb", "vram_reserve_gb"):
        for literal in ("NaN", "Infinity", "-Infinity"):
            cases.append((f'{{"{field}": {literal}}}'.encode(), json_type, 400, ("NaN",)))
        for literal in ("1e300", "1e400", "-1e400", huge, "-" + huge, "-1", "4097", "-0.5"):
            cases.append((f'{{"{field}": {literal}}}'.encode(), json_type, 400, (field,)))
        for literal in ("5e-324", "1e-300", "9e-11", "0.0000001"):  # more than 0 but less than a MiB
            cases.append((f'{{"{field}": {literal}}}'.encode(), json_type, 400, (field, "1.0 MiB")))
        for literal in ('"2"', "[1]", '{"gb": 1}', "true"):
            cases.append((f'{{"{field}": {literal}}}'.encode(), json_type, 400, (field,)))
        cases.append((f'{{"{field}": {too_many_digits}}}'.encode(), json_type, 400, ("JSON",)))
    for field in ("ram_reserve_gb", "vram_reserve_gb"):
        cases.append((f'{{"{field}": null}}'.encode(), json_type, 400, (field,)))
    cases += [
        (f'{{"ram_reserve_gb": {int(ram_gib) + 1}}}'.encode(), json_type, 400,
         ("ram_reserve", "RAM")),
        (b'{"ram_budget_gb": 1, "disk_tier": "yes"}', json_type, 400, ("disk_tier",)),
        (b'{"disk_tier": null}', json_type, 400, ("disk_tier",)),
        (b'{"disk_tier": 1}', json_type, 400, ("disk_tier",)),
        (b"[" * 50_000 + b"]" * 50_000, json_type, 413, ("larger than",)),  # 50k levels
        (b"[" * 30_000 + b"]" * 30_000, json_type, 400, ("JSON",)),  # deep, within the size
        (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, json_type, 400, ("JSON",)),
        (b'{"ram_budget_gb": 1}', "application/json; charset=bogus", 400, ("UTF-8",)),
        ('{"ram_budget_gb": 1, "x": "é"}'.encode("latin-1"), "application/json; charset=latin-1",
         400, ("UTF-8",)),
        (b'{"ram_budget_gb": "\xff\xfe"}', json_type, 400, ("JSON",)),
        (b"", json_type, 400, ("JSON",)),
        (b"{not json", json_type, 400, ("JSON",)),
        (b"{}", json_type, 400, ("non-empty",)),
        (b"[1, 2]", json_type, 400, ("JSON object",)),
        (b'"ram_budget_gb"', json_type, 400, ("JSON object",)),
        (b"null", json_type, 400, ("JSON object",)),
        (b'{"path": "/etc/passwd"}', json_type, 400, ("unknown field",)),
        (json.dumps({"x" * 60_000: 1}).encode(), json_type, 400, ("unknown field",)),
        (json.dumps({f"f{i}": i for i in range(2_000)}).encode(), json_type, 400,
         ("unknown field", "more")),
        (json.dumps({"y" * (10 << 20): 1}).encode(), json_type, 413, ("larger than",)),
    ]
    return cases


def test_bad_input_on_every_route_gets_a_short_4xx_and_the_server_keeps_serving(shared):
    s = shared
    reference = latent_sha(s.run(tiered("wan21")))
    key = model(s, WAN)["id"]
    before = s.get("/offload/tiers")["budgets"]
    # An open websocket, as a browser tab has: ComfyUI encodes events only when one is connected,
    # and an event that fails to encode there would end its publish loop and the server.
    with WsListener(s.url) as ws:
        for prefix in ("", "/api"):
            for body, content_type, status, fragments in budget_cases():
                answer = send(s, "POST", f"{prefix}/offload/budgets", body, content_type)
                message = assert_refused(answer, status, *fragments)
                assert "x" * 100 not in message and "y" * 100 not in message
                assert s.alive()
            # A streamed body is read to its end, and cut off past the limit.
            status, body = send_chunked(s, f"{prefix}/offload/budgets",
                                        [b'{"disk_tier"', b": ", b"true}"])
            assert status == 200 and body["budgets"]["disk_tier"] is True, body
            assert_refused(send_chunked(s, f"{prefix}/offload/budgets",
                                        [b'{"x": "'] + [b"z" * 4096] * 40 + [b'"}']),
                           413, "larger than")
            long_id = "z" * 4000
            assert_refused(send(s, "POST", f"{prefix}/offload/models/{long_id}/park"), 404,
                           "no model")
            assert_refused(send(s, "POST", f"{prefix}/offload/models/..%2F..%2Fetc/load"), 404)
            assert_refused(send(s, "POST", f"{prefix}/offload/models/{key}/{'q' * 3000}"), 400,
                           "unknown action")
            # Every state-changing route takes JSON only (a page of another site can send
            # text/plain without asking); the action routes read no body, so junk in a JSON
            # request changes nothing.
            for path in (f"{prefix}/offload/models/{key}/park", f"{prefix}/offload/budgets",
                         f"{prefix}/offload/policy/{key}", f"{prefix}/offload/loaded/x/unload"):
                assert_refused(send(s, "POST", path, b'{"disk_tier": false}', "text/plain"), 415,
                               "application/json")
            status, body = send(s, "POST", f"{prefix}/offload/models/{key}/park", b"\xff[[[")
            assert status == 200 and body["model"]["tier"] == "ram", body
            json_type = "application/json"
            for body, content_type, status, fragments in (
                    (b'{"priority": NaN}', json_type, 400, ("NaN",)),
                    (b'{"priority": 1e400}', json_type, 400, ("priority",)),
                    (b'{"priority": 101}', json_type, 400, ("priority",)),
                    (b'{"priority": true}', json_type, 400, ("priority",)),
                    (b'{"keep_in_ram": "yes"}', json_type, 400, ("keep_in_ram",)),
                    (b"{}", json_type, 400, ("keep_in_ram",)),
                    (json.dumps({"x" * 60_000: 1}).encode(), json_type, 400, ("keep_in_ram",)),
                    (b"[" * 50_000 + b"]" * 50_000, json_type, 413, ("larger than",)),
                    (b"[" * 30_000 + b"]" * 30_000, json_type, 400, ("JSON",)),
                    (b'{"priority": 1}', "application/json; charset=bogus", 400, ("UTF-8",))):
                message = assert_refused(send(s, "POST", f"{prefix}/offload/policy/{key}", body,
                                              content_type), status, *fragments)
                assert "x" * 100 not in message
            assert_refused(send(s, "POST", f"{prefix}/offload/policy/{'z' * 4000}",
                                b'{"priority": 1}'), 404, "no model")
            assert_refused(send(s, "POST", f"{prefix}/offload/loaded/{'z' * 4000}/unload"), 404,
                           "no loaded model")
            for path in ("tiers", "layerwise", "swap"):
                status, body = send(s, "GET", f"{prefix}/offload/{path}?x=NaN&y={'1' * 5000}")
                assert status == 200 and isinstance(body, dict), (path, status)
        assert s.get("/offload/tiers")["budgets"] == before  # no refused request changed a thing
        # Valid changes still reach the open websocket, and the server is whole.
        s.post("/offload/budgets", {"disk_tier": False})
        ws.wait_for(lambda m: m["type"] == TIERS_EVENT
                    and m["data"]["budgets"]["disk_tier"] is False, what="the budgets event")
        s.post("/offload/budgets", {"disk_tier": True})
        assert ws.error is None
    assert s.get("/system_stats")["system"]
    assert latent_sha(s.run(tiered("wan21"))) == reference


def test_budgets_mean_the_same_through_rest_and_the_node(shared):
    s = shared
    before = s.get("/offload/tiers")["budgets"]
    try:
        for value, want in ((1.5, int(1.5 * GIB)), (0, None), (2, 2 * GIB), (None, None)):
            body = s.post("/offload/budgets", {"ram_budget_gb": value})
            assert body["budgets"]["ram_budget_bytes"] == want, (value, body)
        wf = tiered("wan21")
        wf["tm"] = {"class_type": "VRAMTierManager", "inputs": {
            "model": ["load", 0], "ram_budget_gb": 0.0, "ram_reserve_gb": 1.0,
            "vram_reserve_gb": 0.5, "disk_tier": True, "keep_in_ram": False, "priority": 0}}
        wf["sample"]["inputs"]["model"] = ["tm", 0]
        s.post("/offload/budgets", {"ram_budget_gb": 3})
        s.run(wf)
        budgets = s.get("/offload/tiers")["budgets"]
        assert budgets["ram_budget_bytes"] is None and budgets["ram_reserve_bytes"] == GIB
        # The node refuses what REST refuses, with the same words.
        ram_gib = psutil.virtual_memory().total / GIB
        too_much = dict(wf, tm={**wf["tm"], "inputs": {**wf["tm"]["inputs"],
                                                     "ram_reserve_gb": float(int(ram_gib) + 1)}})
        refusal = s.refused(too_much, "tm")   # at queue time (the node's validate_inputs)
        assert "more than this machine's RAM" in refusal, refusal
        rest = assert_refused(s.request("POST", "/offload/budgets",
                                        {"ram_reserve_gb": int(ram_gib) + 1}), 400)
        assert rest in refusal
    finally:
        restore = {"ram_budget_gb": None if before["ram_budget_bytes"] is None
                   else before["ram_budget_bytes"] / GIB,
                   "ram_reserve_gb": before["ram_reserve_bytes"] / GIB,
                   "vram_reserve_gb": before["vram_reserve_bytes"] / GIB,
                   "disk_tier": before["disk_tier"]}
        s.post("/offload/budgets", restore)
    assert s.get("/offload/tiers")["budgets"] == before


def test_bytes_per_tier_add_up_to_the_model_once(shared):
    s = shared
    s.run(tiered("sd3"))
    sd3 = model(s, SD3)
    top = s.loaded_tier()
    assert sd3["tier"] == top and sd3["total_bytes"] > 0
    if top == "cpu":  # loaded on the CPU is in RAM: the models' RAM counts it
        assert s.get("/offload/tiers")["devices"]["ram"]["used_by_models"] >= sd3["total_bytes"]
    assert sum(sd3["bytes"].values()) == sd3["total_bytes"], sd3
    status, body = s.request("POST", f"/offload/models/{sd3['id']}/park")
    assert status == 200 and body["model"]["tier"] == "ram"
    assert body["model"]["bytes"] == {top: 0, "ram": sd3["total_bytes"]}, body


def test_pin_and_unpin_reach_other_panels_by_websocket(shared):
    s = shared
    s.run(tiered("wan21"))
    key = model(s, WAN)["id"]

    def pinned_is(value):
        return lambda m: m["type"] == TIERS_EVENT and any(
            x["id"] == key and x["policy"]["keep_in_ram"] is value for x in m["data"]["models"])

    with WsListener(s.url) as ws:
        assert s.request("POST", f"/offload/models/{key}/pin")[0] == 200
        ws.wait_for(pinned_is(True), what="the pin event")
        assert s.request("POST", f"/offload/models/{key}/unpin")[0] == 200
        ws.wait_for(pinned_is(False), what="the unpin event")


# --------------------------------------------------------------------------------------------
# Prompt lifecycle without a client_id


def test_prompts_queued_without_client_id_release_their_models(server):
    s = server
    references = {"wan21": latent_sha(s.run(sample_workflow("wan21"))),
                  "sd3": latent_sha(s.run(sample_workflow("sd3")))}
    for i in range(6):
        kind = "wan21" if i % 2 == 0 else "sd3"
        entry = s.wait(s.queue(tiered(kind), client_id=False))
        assert entry["status"]["status_str"] == "success", entry["status"]
        assert entry["outputs"]["stats"]["latent_stats"][0]["sha256"] == references[kind]
        # Released before /history shows the prompt done, not some time later.
        assert all(m["in_use"] == 0 for m in tiers_models(s)), tiers_models(s)
    failing = tiered("wan21")
    failing["pos"]["inputs"]["model_kind"] = "sd3"  # a conditioning of the wrong width
    entry = s.wait(s.queue(failing, client_id=False))
    assert entry["status"]["status_str"] == "error"
    assert all(m["in_use"] == 0 for m in tiers_models(s))
    # Interrupted once it samples: the model is held from the prompt's start, before ComfyUI
    # clears its interrupt flag, so an interrupt on that sign alone may be lost.
    long_one = s.queue_running(tiered("wan21", steps=400), client_id=False)
    assert model(s, WAN)["in_use"] > 0
    s.interrupt()
    entry = s.wait(long_one)
    assert entry["status"]["status_str"] == "error"
    assert any(kind == "execution_interrupted" for kind, _ in entry["status"]["messages"])
    assert all(m["in_use"] == 0 for m in tiers_models(s))
    # Nothing is held: both evict, and a budget for one model lets a prompt that sends a
    # client_id load the other.
    for name in (WAN, SD3):
        status, body = s.request("POST", f"/offload/models/{model(s, name)['id']}/evict")
        assert status == 200 and body["model"]["tier"] == "disk", body
    s.run(tiered("wan21"))
    s.post("/offload/budgets", {"ram_budget_gb": 1.5 * model(s, WAN)["total_bytes"] / GIB})
    assert latent_sha(s.run(tiered("sd3"))) == references["sd3"]
    assert model(s, WAN)["tier"] == "disk"


# --------------------------------------------------------------------------------------------
# Dropped models are never handed out empty


def test_a_dropped_model_is_never_handed_to_a_prompt_empty(server):
    s = server
    w = tiered("wan21")
    reference = latent_sha(s.run(w))
    assert latent_sha(s.run(w)) == reference  # the loader's output now comes from the cache
    s.post("/offload/budgets", {"ram_budget_gb": 0.001})
    assert model(s, WAN)["tier"] == "disk"
    error = s.run_expect_error(w)
    assert error["node_type"] == "TieredUNETLoader", error
    assert "TierCapacityError" in error["exception_type"], error
    assert "needs" in error["exception_message"] and "meta" not in error["exception_message"]
    s.post("/offload/budgets", {"ram_budget_gb": None})
    assert latent_sha(s.run(w)) == reference
    # The same from inside a workflow: a VRAM Tier Manager whose budget drops its own model
    # when the prompt that set it ends.
    tm = tiered("wan21")
    tm["tm"] = {"class_type": "VRAMTierManager", "inputs": {
        "model": ["load", 0], "ram_budget_gb": 0.001, "ram_reserve_gb": 1.0,
        "vram_reserve_gb": 0.5, "disk_tier": True, "keep_in_ram": False, "priority": 0}}
    tm["sample"]["inputs"]["model"] = ["tm", 0]
    assert latent_sha(s.run(tm)) == reference  # in use while it runs, so it stays
    assert model(s, WAN)["tier"] == "disk"  # dropped once the prompt released it
    error = s.run_expect_error(tm)
    assert error["node_type"] == "TieredUNETLoader" and "meta" not in error["exception_message"]
    assert "TierCapacityError" in error["exception_type"], error
    s.post("/offload/budgets", {"ram_budget_gb": None})
    assert latent_sha(s.run(w)) == reference
    assert "meta tensor" not in s.log_text()


# --------------------------------------------------------------------------------------------
# Files that are gone, corrupt or changed


def test_rest_load_of_a_gone_or_corrupt_file_is_a_clear_4xx(server):
    s = server
    path = s.base / "models" / "diffusion_models" / WAN
    reference = latent_sha(s.run(tiered("wan21")))
    key = model(s, WAN)["id"]
    good = path.read_bytes()
    assert s.request("POST", f"/offload/models/{key}/evict")[0] == 200
    path.unlink()
    for action in ("load", "park"):
        assert_refused(s.request("POST", f"/offload/models/{key}/{action}"), 404, "gone")
    # Bytes that are no model: a new version of the file, which the loader registers under a
    # new id (the old one is forgotten) and cannot load, naming the file.
    path.write_bytes(b"\x00not a safetensors file" * 4096)
    error = s.run_expect_error(tiered("wan21"))
    assert WAN in error["exception_message"] and "cannot be read as a model" in error["exception_message"]
    corrupt = model(s, WAN)["id"]
    assert corrupt != key
    assert_refused(s.request("POST", f"/offload/models/{key}/load"), 404, "no model")
    for action in ("load", "park"):
        assert_refused(s.request("POST", f"/offload/models/{corrupt}/{action}"), 422,
                       "cannot be read as a model")
    assert model(s, WAN)["tier"] == "disk" and s.alive()
    path.write_bytes(good)
    assert latent_sha(s.run(tiered("wan21"))) == reference


def test_a_changed_file_supersedes_its_old_entry(server):
    s = server
    path = s.base / "models" / "diffusion_models" / WAN
    reference = latent_sha(s.run(tiered("wan21")))
    ids = [model(s, WAN)["id"]]
    atime, mtime = path.stat().st_atime_ns, path.stat().st_mtime_ns
    for touch in range(1, 4):
        os.utime(path, ns=(atime, mtime + touch * 10 ** 9))
        assert latent_sha(s.run(tiered("wan21"))) == reference
        entries = [m for m in tiers_models(s) if m["name"] == WAN]
        assert len(entries) == 1 and entries[0]["id"] not in ids, (ids, entries)
        ids.append(entries[0]["id"])
        assert_refused(s.request("POST", f"/offload/models/{ids[-2]}/load"), 404, "no model")
    # New bytes under an old id: never loaded, and the stale entry is forgotten.
    assert s.request("POST", f"/offload/models/{ids[-1]}/evict")[0] == 200
    tiny_models.write_tiny_wan21(path, seed=7)  # the same bytes as SECOND_WAN
    os.utime(path, ns=(atime, mtime + 10 * 10 ** 9))
    assert_refused(s.request("POST", f"/offload/models/{ids[-1]}/load"), 409, "changed")
    assert WAN not in models_by_name(s)
    other = sample_workflow("wan21")
    other["load"]["inputs"]["unet_name"] = SECOND_WAN
    rewritten = latent_sha(s.run(tiered("wan21")))
    assert rewritten == latent_sha(s.run(other)) and rewritten != reference
    assert len([m for m in tiers_models(s) if m["name"] == WAN]) == 1


# --------------------------------------------------------------------------------------------
# The preload file


GOOD_ENTRY = {"loader": "TieredUNETLoader", "inputs": {"unet_name": WAN, "weight_dtype": "default"},
              "tier": "ram"}
BAD_ENTRIES = [
    None, 5, "TieredUNETLoader", [GOOD_ENTRY],
    {**GOOD_ENTRY, "tier": "disk"}, {**GOOD_ENTRY, "tier": "bogus"}, {**GOOD_ENTRY, "tier": None},
    {"loader": "VRAMTierManager", "inputs": {}}, {"loader": "Nope", "inputs": {}},
    {"loader": ["TieredUNETLoader"], "inputs": {}}, {"loader": "TieredUNETLoader", "inputs": 5},
    {"loader": "TieredUNETLoader", "inputs": {"weight_dtype": "default"}},
    {"loader": "TieredUNETLoader", "inputs": {"unet_name": "missing.safetensors",
                                             "weight_dtype": "default"}},
]


# The file's parsing is the pack's: its bad forms run on the 0.3.75 lane only; the bad entries
# beside a good one (which loads through core's loader) on both.
@pytest.mark.parametrize("content, skipped", [
    pytest.param(b'{"preload": null}', None, id="null", marks=pytest.mark.one_lane),
    pytest.param(b"5", None, id="number", marks=pytest.mark.one_lane),
    pytest.param(b"[" * 50_000, None, id="deep", marks=pytest.mark.one_lane),
    pytest.param(b"\xff\xfe{", None, id="not-utf8", marks=pytest.mark.one_lane),
    pytest.param(json.dumps({"preload": [*BAD_ENTRIES, GOOD_ENTRY]}).encode(), len(BAD_ENTRIES), id="bad-entries"),
])
def test_a_bad_preload_file_is_logged_and_never_disables_the_pack(tmp_path, content, skipped):
    base = tmp_path / "base"
    write_fixture_models(base)
    (base / "user").mkdir(parents=True, exist_ok=True)
    (base / "user" / "tiered_offload.json").write_bytes(content)
    s = ComfyServer(base).start()  # fails if the pack's import failed
    try:
        info = s.get("/object_info")
        assert {"TieredUNETLoader", "VRAMTierManager", "ApplyLayerwiseOffload"} <= set(info)
        assert s.post("/offload/budgets", {"disk_tier": True})["budgets"]["disk_tier"] is True
        log = s.log_text()
        assert "preload failed" not in log
        if skipped is None:  # the whole file is unusable: one line says so
            assert "tiered_offload.json" in log and "cannot read" in log, log[-4000:]
        else:  # each bad entry is logged and skipped, the good one is preloaded
            assert log.count("skipping preload entry") == skipped, log[-4000:]
            wait_until(lambda: WAN in models_by_name(s) and model(s, WAN)["tier"] == "ram",
                       what="the good entry's preload")
        assert latent_sha(s.run(tiered("wan21"))) == latent_sha(s.run(sample_workflow("wan21")))
    finally:
        s.stop()


# --------------------------------------------------------------------------------------------
# Status reads and /interrupt answer while a big model loads


BIG_WAN = "wan21_dim512_16blocks.safetensors"


def probe_while_moving(s: ComfyServer, name: str, still_busy) -> list[int] | None:
    """Statuses of requests answered while `name` is moving and the request that moves it is
    still unanswered, or None if the move ended first. Order, not time, is the proof: the move
    is published before the probes, and it is still under way after their answers."""
    probes = [("GET", "/system_stats"), ("GET", "/offload/layerwise"), ("GET", "/offload/swap"),
              ("POST", "/interrupt")]
    while still_busy():
        if not model(s, name)["moving"]:
            continue
        answers = [s.request(method, path, {} if method == "POST" else None)[0]
                   for method, path in probes]
        if model(s, name)["moving"] and still_busy():
            return answers
    return None


def test_status_routes_and_interrupt_answer_while_a_big_model_loads(tmp_path):
    base = tmp_path / "base"
    write_fixture_models(base)
    tiny_models.write_tiny_wan21(base / "models" / "diffusion_models" / BIG_WAN, layers=16,
                                 dim=512, ffn_dim=2048, seed=11)
    s = ComfyServer(base).start()
    try:
        wf = tiered("wan21", steps=1)
        wf["load"]["inputs"]["unet_name"] = BIG_WAN
        reference = latent_sha(s.run(wf))
        key = model(s, BIG_WAN)["id"]
        assert model(s, BIG_WAN)["total_bytes"] > 200 << 20
        # A REST load from disk runs off the event loop.
        for _attempt in range(3):
            assert s.request("POST", f"/offload/models/{key}/evict")[0] == 200
            answer = {}
            worker = threading.Thread(target=lambda: answer.update(
                load=s.request("POST", f"/offload/models/{key}/load", timeout=600)))
            worker.start()
            probes = probe_while_moving(s, BIG_WAN, worker.is_alive)
            worker.join(600)
            assert answer["load"][0] == 200, answer
            if probes is not None:
                break
        else:
            pytest.fail("no request was answered while the REST load ran")
        assert probes == [200, 200, 200, 200]
        # A load a prompt makes (its Tiered loader) does not stall status reads either.
        for _attempt in range(3):
            assert s.request("POST", f"/offload/models/{key}/evict")[0] == 200
            prompt_id = s.queue(wf)

            def running() -> bool:
                entry = s.get(f"/history/{prompt_id}").get(prompt_id)
                return not (entry and entry.get("status", {}).get("completed") is not None)

            probes = probe_while_moving(s, BIG_WAN, running)
            entry = s.wait(prompt_id)
            if probes is not None:
                break
        else:
            pytest.fail("no request was answered while a prompt loaded the model")
        # The probes' /interrupt may have stopped this prompt; the next one is right.
        assert entry["status"]["status_str"] in ("success", "error")
        assert latent_sha(s.run(wf)) == reference
    finally:
        s.stop()


# --------------------------------------------------------------------------------------------
# Issue 10 C: a drop closes the engines bound to the model


def test_a_budget_drop_closes_swap_and_layerwise_engines(server):
    s = server
    swapped = with_text_encode(tiered("wan21"), swap=True)
    streamed = tiered("sd3", layerwise={"resident_blocks": 0, "prefetch": 1})
    plain_swap = s.run(with_text_encode(sample_workflow("wan21"), swap=False))
    plain_stream = latent_sha(s.run(sample_workflow("sd3")))
    for _ in range(2):
        assert latent_sha(s.run(swapped)) == latent_sha(plain_swap)
        assert latent_sha(s.run(streamed)) == plain_stream
    members = {m["name"]: m for m in s.get("/offload/swap")["members"]}
    assert "WAN21" in members and sum(members["WAN21"]["bytes"].values()) > 0, members
    sessions = [r["model_class"] for r in s.get("/offload/layerwise")["models"]]
    assert "OpenAISignatureMMDITWrapper" in sessions, sessions
    pinned_before = s.get("/offload/tiers")["devices"]["ram"]["pinned"]

    s.post("/offload/budgets", {"ram_budget_gb": 0.001})
    assert model(s, WAN)["tier"] == "disk" and model(s, SD3)["tier"] == "disk"
    assert model(s, WAN)["bytes"] == {s.loaded_tier(): 0, "ram": 0}
    # The dropped models' engines are closed: no master, no pinned pack is left behind.
    members = {m["name"] for m in s.get("/offload/swap")["members"]}
    assert "WAN21" not in members, members
    sessions = [r["model_class"] for r in s.get("/offload/layerwise")["models"]]
    assert "OpenAISignatureMMDITWrapper" not in sessions, sessions
    pinned_after = s.get("/offload/tiers")["devices"]["ram"]["pinned"]
    assert pinned_after <= pinned_before
    if pinned_before:  # only CUDA pins; on CPU both are 0
        assert pinned_after < pinned_before

    s.post("/offload/budgets", {"ram_budget_gb": None})
    again = s.run(swapped)
    assert latent_sha(again) == latent_sha(plain_swap)
    assert again["encode_stats"] == plain_swap["encode_stats"]
    assert latent_sha(s.run(streamed)) == plain_stream
    log = s.log_text()
    assert "prompt lifecycle listener failed" not in log and "is not supported" not in log
