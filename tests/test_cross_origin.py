"""Only ComfyUI's own origin (its page) changes the pack's state from a browser, in real headless Chromium.

Pages of three kinds send the same requests to every state-changing route of the pack (budgets, a
model's policy, pin, evict, core's unload):
  * pages of other origins: another site (evil.test) and another host of the server's own site
    (evil.comfy.test);
  * a sandboxed iframe in the other site's page (its requests carry `Origin: null`, which ComfyUI
    0.3.75's own origin check lets through);
  * a page of ComfyUI's own origin (one of its JSON answers: what the app's page sends from, the
    same origin, without loading the whole frontend, which takes over a minute on a busy CPU).
Each sends them the two ways a page can: a `no-cors` fetch with a text/plain body (a "simple"
request, which a browser sends without asking: what a form post does too), and a fetch with a JSON
body (which needs a CORS preflight first). Chromium maps every *.test name to the loopback; the
pages reach the server as comfy.test, a host name ComfyUI's own Host/Origin check does not look at
(it guards only loopback names). ComfyUI 0.33 also refuses requests a browser marks cross-site
(`Sec-Fetch-Site`), which covers another site and the sandboxed iframe there, but not another host
of the same site: that one only the pack's own check stops, on both versions. What changed is read
on the server with urllib, which no page sees.
"""
from __future__ import annotations

import http.server
import json
import threading

import pytest

from browser import LAUNCH_ARGS, chromium_path
from comfy_server import COMFY_ROOT
from conftest import ARTIFACTS
from workflows import sample_workflow

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = chromium_path()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")

WAN_FILE = "tiny_wan21_t2v.safetensors"
HOSTS = "MAP *.test 127.0.0.1"

# Sends every request both ways, then reports what each answered (an opaque no-cors answer is 0).
ATTACK = """
async function attack(base, requests) {
  const answers = [];
  for (const [path, body] of requests) {
    for (const how of ["no-cors text/plain", "JSON"]) {
      const init = how === "JSON"
        ? {method: "POST", headers: {"Content-Type": "application/json"}, body: body ?? "{}"}
        : {method: "POST", mode: "no-cors", body: body ?? ""};
      try {
        const res = await fetch(base + path, init);
        answers.push([path, how, res.status]);
      } catch (e) {
        answers.push([path, how, "blocked: " + String(e.message || e).slice(0, 80)]);
      }
    }
  }
  return answers;
}
"""


def _js_string(text: str) -> str:
    """A JavaScript string literal that is safe inside an inline script ("</script>" escaped)."""
    return json.dumps(text).replace("</", "<\\/")


def _page(script: str) -> bytes:
    return f"<!doctype html><html><body><script>{ATTACK}\n{script}</script></body></html>".encode()


class _Site(http.server.ThreadingHTTPServer):
    """evil.test: a page that attacks, and the same attack in a sandboxed iframe."""

    def __init__(self, target: str, requests: list) -> None:
        run = f"window.answers = attack({json.dumps(target)}, {json.dumps(requests)});"
        framed = (f"attack({json.dumps(target)}, {json.dumps(requests)})"
                  ".then(a => parent.postMessage(JSON.stringify(a), '*'));")
        pages = {
            "/attack": _page(run),
            "/framed": _page(f"""
                window.answers = new Promise(resolve => addEventListener("message", e => resolve(JSON.parse(e.data))));
                const frame = document.createElement("iframe");
                frame.sandbox = "allow-scripts";
                frame.srcdoc = {_js_string(_page(framed).decode())};
                document.body.append(frame);"""),
        }

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = pages.get(self.path)
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/html")
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()


PAGES = {"other site": "http://evil.test:{port}/attack",
         "sandboxed iframe": "http://evil.test:{port}/framed",
         "other host of the same site": "http://evil.comfy.test:{port}/attack"}


def _state(comfy, key: str) -> dict:
    tiers = comfy.get("/offload/tiers")
    model = next(m for m in tiers["models"] if m["id"] == key)
    return {"budget": tiers["budgets"]["ram_budget_bytes"], "pinned": model["policy"]["keep_in_ram"],
            "priority": model["policy"]["priority"], "tier": model["tier"],
            "loaded": sorted(card["id"] for card in tiers["loaded"] if card["tier_id"] is None)}


def test_only_the_comfyui_page_changes_state_cross_origin_pages_change_nothing(comfy):
    tiered = sample_workflow("wan21")
    tiered["load"]["class_type"] = "TieredUNETLoader"
    comfy.run(tiered)
    comfy.run(sample_workflow("sd3"))  # a model core loaded: its card offers core's unload
    tiers = comfy.get("/offload/tiers")
    key = next(m["id"] for m in tiers["models"] if m["name"] == WAN_FILE)
    card = next(c["id"] for c in tiers["loaded"] if c["network"] == "OpenAISignatureMMDITWrapper")
    before = _state(comfy, key)
    assert before["budget"] is None and not before["pinned"] and before["tier"] != "disk", before
    requests = [
        ["/api/offload/budgets", json.dumps({"ram_budget_gb": 3})],
        [f"/api/offload/policy/{key}", json.dumps({"priority": 7})],
        [f"/api/offload/models/{key}/evict", None],
        [f"/api/offload/models/{key}/pin", None],
        [f"/api/offload/loaded/{card}/unload", None],
    ]
    target = f"http://comfy.test:{comfy.port}"
    site = _Site(target, requests)
    answers = {}
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=[*LAUNCH_ARGS, f"--host-resolver-rules={HOSTS}"])
            try:
                page = browser.new_page()
                for kind, url in PAGES.items():
                    page.goto(url.format(port=site.server_address[1]))
                    answers[kind] = page.evaluate("window.answers")
                    assert _state(comfy, key) == before, (kind, answers[kind])
                # ComfyUI's own origin: the same script, the same requests.
                page.goto(f"{target}/api/system_stats")
                page.add_script_tag(content=ATTACK)
                answers["comfyui"] = page.evaluate(f"attack({json.dumps(target)}, {json.dumps(requests)})")
            finally:
                browser.close()
        after = _state(comfy, key)
    finally:
        site.shutdown()
        site.server_close()
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "cross_origin_answers.json").write_text(json.dumps(answers, indent=1))
        comfy.post("/offload/budgets", {"ram_budget_gb": None})
        comfy.post(f"/offload/policy/{key}", {"priority": 0, "keep_in_ram": False})
    # The simple requests reached the server (a browser sends them without asking) and were
    # refused, each by the pack with a log line unless ComfyUI refused it first; the JSON ones
    # never got past the preflight.
    for kind in PAGES:
        for path, how, status in answers[kind]:
            if how == "JSON":
                assert str(status).startswith("blocked"), (kind, path, status)
            else:
                assert status == 0, (kind, path, status)  # opaque: the page cannot read it
    log = comfy.log_text()
    assert f"a request from another origin (comfy.test:{comfy.port})" not in log
    assert "a request from another origin (evil.comfy.test:" in log
    if "Sec-Fetch-Site" not in (COMFY_ROOT / "server.py").read_text():  # ComfyUI lets them through
        assert "a request from another origin (evil.test:" in log
        assert "a request from a page with no origin of its own (Origin: null) is refused" in log
    # ComfyUI's own origin: text/plain is refused, JSON does what it says.
    for path, how, status in answers["comfyui"]:
        assert status == (200 if how == "JSON" else 415), (path, how, status)
    assert after["budget"] == 3 << 30 and after["priority"] == 7, after
    assert after["tier"] == "disk" and after["pinned"] is True and card not in after["loaded"], after
