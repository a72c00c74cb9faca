"""`make screenshot`: the README's picture (web/screenshot.png), from the example workflow that
streams blocks on any machine (example_workflows.LAYERWISE), as a user runs it.

A user's server (core's and the pack's nodes only) serves it; headless Chromium puts it on the
canvas from the pack's template, with the Offload tab open before the run (the open tab asks the
server to record the run's picture), then the workflow runs: the picture shows
the workflow with Apply Layerwise Offload's current inputs, and the panel with the streamed
model's blocks, figures and the picture of that run, beside the text encoder's card.

Beside the picture it writes a sidecar (web/screenshot.json): the inputs and values of the pack's
nodes as the canvas showed them, the ComfyUI and frontend versions, and a seal over the picture's
bytes and those inputs. tests/unit/test_screenshot_sidecar.py fails when a node's inputs or the
example's values no longer match the picture (run `make screenshot` again), and when the picture and
its sidecar were not written together. Run on purpose only; `make test` never writes into the
repository.

usage: python tools/screenshot.py [OUT.png]   (default web/screenshot.png; the sidecar beside it)
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tools"), str(REPO / "tests")]

import example_workflows  # noqa: E402
from browser import LAUNCH_ARGS, chromium_path, load_template, open_offload_tab, wait_for_ui  # noqa: E402
from comfy_server import PACK_LINK_NAME, ComfyServer, comfy_version  # noqa: E402

VIEWPORT = {"width": 1600, "height": 1000}
PANEL = "#tiered-offload-panel"
# The streamed model's card and the rows of its run's picture (tests/test_panel_timeline.py).
LAYERWISE_CARD = f'{PANEL} [data-role="layerwise"]'
PICTURE_ROWS = f'{PANEL} [data-role="timeline"] [data-role="tl-row"]'

# What the canvas shows of each of the pack's nodes: its input slots, its widgets and their
# values (a node's python_module names the pack's folder in custom_nodes/).
_SHOWN_NODES_JS = """(pack) => {
  const shown = {};
  for (const node of app.graph.nodes) {
    const def = LiteGraph.registered_node_types[node.type]?.nodeData;
    if (!def || !String(def.python_module ?? "").includes(pack)) continue;
    const widgets = (node.widgets ?? []).filter((w) => w.name !== "control_after_generate");
    shown[node.type] = {
      inputs: [...new Set([...(node.inputs ?? []).map((i) => i.name), ...widgets.map((w) => w.name)])],
      values: Object.fromEntries(widgets.map((w) => [w.name, w.value])),
    };
  }
  return shown;
}"""


def seal(png: bytes, nodes: dict) -> str:
    """sha256 over the picture's bytes and the node inputs it shows: a sidecar edited by hand, or
    a picture replaced without its sidecar, no longer matches."""
    return hashlib.sha256(png + json.dumps(nodes, sort_keys=True).encode()).hexdigest()


def sidecar_path(png: Path) -> Path:
    return png.with_suffix(".json")


def wait_for_recording(server: ComfyServer, timeout: float = 30.0) -> None:
    """The open tab's request to record the next run's picture reached the server."""
    deadline = time.time() + timeout
    while not server.get("/offload/timeline").get("recording"):
        if time.time() > deadline:
            raise RuntimeError("the Offload tab is open but the server records no picture of the run")
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    out = Path(argv[0]).resolve() if argv else REPO / "web" / "screenshot.png"
    chromium = chromium_path()
    if chromium is None:
        print("needs Chromium (see the Makefile's chromium rule)", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="tiered_offload_shot_") as tmp:
        base = Path(tmp)
        example_workflows.write_models(base)
        server = ComfyServer(base, test_nodes=False).start()
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, headless=True, args=LAUNCH_ARGS)
                page = browser.new_page(viewport=VIEWPORT)
                wait_for_ui(page, server.url)
                # The minimap would cover the end of the graph.
                page.evaluate("app.extensionManager.setting.set('Comfy.Minimap.Visible', false)")
                load_template(page, PACK_LINK_NAME, example_workflows.LAYERWISE)
                open_offload_tab(page)
                wait_for_recording(server)
                # The workflow on the canvas is the template's; run that one.
                shown_graph = page.evaluate("async () => (await app.graphToPrompt()).output")
                server.run(shown_graph)
                page.wait_for_selector(LAYERWISE_CARD, timeout=30_000)
                page.wait_for_selector(PICTURE_ROWS, timeout=30_000)
                nodes = page.evaluate(_SHOWN_NODES_JS, PACK_LINK_NAME)
                frontend = page.evaluate("window.__COMFYUI_FRONTEND_VERSION__ ?? null")
                page.evaluate("app.extensionManager.command.execute('Comfy.Canvas.FitView')")
                page.wait_for_timeout(800)
                # The open tab covers the canvas's left side: move the graph out from under it.
                panel = page.locator(PANEL).bounding_box()
                page.evaluate("""(right) => { const ds = app.canvas.ds;
                    ds.scale = Math.max(ds.scale * 0.85, 0.62);
                    ds.offset[0] += right / ds.scale; app.canvas.setDirty(true, true); }""",
                              panel["x"] + panel["width"])
                page.wait_for_timeout(500)
                png = page.screenshot()
                browser.close()
        finally:
            server.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    record = {
        "picture": out.name,
        "workflow": example_workflows.LAYERWISE,
        "comfyui": comfy_version(),
        "frontend": frontend,
        "viewport": VIEWPORT,
        "nodes": nodes,
        "seal": seal(png, nodes),
    }
    sidecar_path(out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {out} and {sidecar_path(out).name}: {', '.join(sorted(nodes))} as the picture shows them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
