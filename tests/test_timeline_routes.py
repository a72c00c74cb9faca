"""The picture of the last layerwise run through a real server (both lanes): recorded only while
a lease taken with POST /offload/timeline holds, served by GET /offload/timeline and in the
layerwise report, and the POST's refusals (the same rules as every state-changing route)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from workflows import latent_sha, sample_workflow

STREAMED = {"resident_blocks": 1, "prefetch": 1}
# Every unit streamed through two slots: with more units than slots, each is copied every pass.
ALL_STREAMED = {"resident_blocks": 0, "prefetch": 1}


def _last_report(comfy) -> dict:
    """The layerwise report of the model that finished a run last."""
    reports = [r for r in comfy.get("/offload/layerwise")["models"] if r.get("finished_at")]
    return max(reports, key=lambda r: r["finished_at"])


def _post(comfy, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(comfy.url + "/offload/timeline", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:  # ComfyUI's own origin check answers in plain text
        return status, {"error": payload.decode(errors="replace")}


@pytest.fixture
def lease_ended(comfy):
    """No lease before the test, none after it (the server is shared with other tests)."""
    comfy.post("/offload/timeline", {"enabled": False})
    yield
    comfy.post("/offload/timeline", {"enabled": False})


def test_without_a_lease_nothing_is_recorded(comfy, lease_ended):
    state = comfy.get("/offload/timeline")
    assert state["recording"] is False
    latent_sha(comfy.run(sample_workflow("wan21", layerwise=STREAMED, seed=7)))
    report = _last_report(comfy)
    assert report["streamed_indices"] and report["timeline"] is None
    timelines = comfy.get("/offload/timeline")["timelines"]
    assert all(t["module_id"] != report["module_id"] for t in timelines)


@pytest.mark.parametrize("kind,granularity", [("hunyuan_video", "block"), ("wan21", "phase")])
def test_a_lease_records_one_pass_of_every_streamed_unit(comfy, lease_ended, kind, granularity):
    baseline = latent_sha(comfy.run(sample_workflow(kind, seed=8)))
    state = comfy.post("/offload/timeline", {"enabled": True})
    assert state["recording"] is True and state["lease_seconds"] > 0
    layerwise = dict(ALL_STREAMED, granularity=granularity)
    assert latent_sha(comfy.run(sample_workflow(kind, layerwise=layerwise, seed=8))) == baseline
    report = _last_report(comfy)
    streamed = report["streamed_indices"]
    units = report["units"]
    assert len(streamed) > ALL_STREAMED["prefetch"] + 1, "as many slots as units: nothing is copied twice"
    (timeline,) = [t for t in comfy.get("/offload/timeline")["timelines"]
                   if t["module_id"] == report["module_id"]]
    assert timeline.pop("model_class") == report["model_class"]
    timeline.pop("module_id"), timeline.pop("model_id")
    assert timeline == report["timeline"]
    assert [u["unit"] for u in timeline["units"]] == streamed
    assert [u["block"] for u in timeline["units"]] == [units[i]["block"] for i in streamed]
    for what in ("copy", "wait", "compute"):
        spans = [s for s in timeline["spans"] if s["kind"] == what]
        assert sorted(s["unit"] for s in spans) == sorted(streamed), what
    compute = {s["unit"]: s for s in timeline["spans"] if s["kind"] == "compute"}
    for s in timeline["spans"]:
        if s["kind"] == "copy":
            assert s["end_ms"] <= compute[s["unit"]]["start_ms"] and s["bytes"] == units[s["unit"]]["bytes"]
    # On the CPU every copy runs on the sampling thread: never "copies hidden behind compute".
    assert timeline["bound_by"] in ("copies", "compute_between_copies") and timeline["pass_ms"] > 0
    # Ended: the next run records nothing, and its report says so.
    assert comfy.post("/offload/timeline", {"enabled": False})["recording"] is False
    latent_sha(comfy.run(sample_workflow(kind, layerwise=layerwise, seed=9)))
    assert _last_report(comfy)["timeline"] is None


def test_a_recorded_run_with_a_lora_and_the_run_after_an_interrupt_give_cores_result(comfy, lease_ended):
    """The recording hooks wrap the plain ones: with a LoRA merged on the copy path the latent is
    core's, and an interrupted recorded run leaves the next recorded and plain prompts right."""
    plain = sample_workflow("wan21", lora_strength=0.8, seed=10)
    baseline = latent_sha(comfy.run(plain))
    comfy.post("/offload/timeline", {"enabled": True})
    recorded = sample_workflow("wan21", lora_strength=0.8, layerwise=ALL_STREAMED, seed=10)
    assert latent_sha(comfy.run(recorded)) == baseline
    assert _last_report(comfy)["timeline"] is not None
    slow = sample_workflow("wan21", lora_strength=0.8, layerwise=ALL_STREAMED, seed=10, steps=10_000)
    prompt_id = comfy.queue_running(slow)   # sampling has begun: the interrupt cannot be lost
    comfy.interrupt()
    entry = comfy.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    assert latent_sha(comfy.run(recorded)) == baseline
    assert latent_sha(comfy.run(plain)) == baseline


@pytest.mark.parametrize("body,headers,status", [
    (b'{"enabled": true}', {"Content-Type": "text/plain"}, 415),
    (b'{"enabled": true}', {}, 415),
    (b'{"enabled": "yes"}', {"Content-Type": "application/json"}, 400),
    (b'{"enabled": true, "more": 1}', {"Content-Type": "application/json"}, 400),
    (b'{}', {"Content-Type": "application/json"}, 400),
    (b'[true]', {"Content-Type": "application/json"}, 400),
    (b'{"enabled": tru', {"Content-Type": "application/json"}, 400),
    (b'{"enabled": true}', {"Content-Type": "application/json", "Origin": "http://evil.test"}, 403),
    (b'{"enabled": true}', {"Content-Type": "application/json", "Origin": "null"}, 403),
])
def test_bad_requests_are_refused_and_change_nothing(comfy, lease_ended, body, headers, status):
    got, answer = _post(comfy, body, headers)
    assert got == status and isinstance(answer.get("error"), str), answer
    assert comfy.get("/offload/timeline")["recording"] is False
