"""`make screenshot`: the README's picture of the Offload panel, from a real workflow.

A user's server (core's and the pack's nodes only) runs the demo workflow, then headless
Chromium shows it on the canvas with the Offload tab open: the models of a real workflow, the
diffusion model streamed by Apply Layerwise Offload with its blocks and figures, and the text
encoder. Run on purpose only; `make test` never writes into the repository.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tools"), str(REPO / "tests")]

import example_workflows  # noqa: E402
from browser import LAUNCH_ARGS, chromium_path, load_template, open_offload_tab, wait_for_ui  # noqa: E402
from comfy_server import PACK_LINK_NAME, ComfyServer  # noqa: E402


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else REPO / "web" / "screenshot.png"
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
            server.run(example_workflows.demo())
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, headless=True, args=LAUNCH_ARGS)
                page = browser.new_page(viewport={"width": 1800, "height": 1000})
                wait_for_ui(page, server.url)
                load_template(page, PACK_LINK_NAME, example_workflows.DEMO)
                open_offload_tab(page)
                page.wait_for_selector('#tiered-offload-panel [data-role="layerwise"]', timeout=10_000)
                page.evaluate("app.extensionManager.command.execute('Comfy.Canvas.FitView')")
                page.wait_for_timeout(800)
                # The open tab covers the canvas's left side: move the graph out from under it.
                page.evaluate("""() => { const ds = app.canvas.ds; ds.scale = Math.max(ds.scale * 0.85, 0.62);
                    ds.offset[0] += 330 / ds.scale; app.canvas.setDirty(true, true); }""")
                page.wait_for_timeout(500)
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out))
                browser.close()
        finally:
            server.stop()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
