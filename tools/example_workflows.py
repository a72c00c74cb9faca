"""The demo and the example workflows: one source for `make demo`, the tests and the UI files.

Every workflow uses only nodes a user has: core's and the pack's. The models are ones a user can
make on the spot: a small random-weight HunyuanVideo-shaped DiT, whose text width ComfyUI reads
from the weights (768, CLIP-L's), and a random-weight CLIP-L text encoder loaded with core's
CLIPLoader. (A Wan needs 4096-wide umt5-xxl conditioning: ComfyUI fixes Wan's text width, and no
encoder of that width is small enough to write here.)

`python tools/example_workflows.py` rewrites `example_workflows/api/*.json`, the API form of each
workflow (what POST /prompt takes, as "Export (API)" saves it), and `example_workflows/*.json`,
the graph (UI) files ComfyUI's template browser lists for this pack: it starts a server with the
pack, lets the frontend build each graph in headless Chromium and saves what the frontend
serializes, so the files are what a user would get by saving the workflow. `--api-only` writes
the API forms alone (no server, no browser).

The template browser shows a pack's workflow by its file name only (as its title, and again as
its caption), so each file is named for what the workflow shows.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "fixtures")]
import tiny_models  # noqa: E402

EXAMPLES_DIR = REPO / "example_workflows"
API_DIR = EXAMPLES_DIR / "api"
DIT_FILE = "demo_hunyuan_video_12blocks.safetensors"
CLIP_FILE = tiny_models.CLIP_L_FILENAME
DIT_SHAPE = {"double_blocks": 4, "single_blocks": 8, "hidden": 128, "text_dim": 768, "seed": 0}
DIT_BLOCKS = DIT_SHAPE["double_blocks"] + DIT_SHAPE["single_blocks"]
LAYERWISE_RESIDENT = 4   # the blocks the Apply Layerwise Offload example keeps: it streams the rest
PROMPT = "a lighthouse on a cliff at dusk, waves below"
NEGATIVE = "blurry"


# The models every example loads: (models/ subfolder, file name) -> what it is.
MODELS = {
    ("diffusion_models", DIT_FILE): f"a random-weight HunyuanVideo-shaped diffusion model of {DIT_BLOCKS} "
                                    "blocks",
    ("text_encoders", CLIP_FILE): "a random-weight CLIP-L text encoder",
}


def write_models_into(models_dir: Path) -> list[Path]:
    """Write the demo's models into a ComfyUI models folder where core's loaders look (MODELS);
    a file already there is kept. Returns the files written."""
    writers = {DIT_FILE: lambda path: tiny_models.write_tiny_hunyuan_video(path, **DIT_SHAPE),
               CLIP_FILE: tiny_models.write_random_clip_l}
    written = []
    for folder, name in MODELS:
        path = models_dir / folder / name
        if not path.exists():
            writers[name](path)
            written.append(path)
    return written


def write_models(base: Path) -> list[Path]:
    """Write the demo's models under a ComfyUI base directory's models/ (see write_models_into)."""
    return write_models_into(base / "models")


def _base(unet: str = "UNETLoader", clip: str = "CLIPLoader") -> dict[str, dict]:
    """Loaders, text encodes, an empty video latent and the sampler; numeric ids as the UI uses."""
    return {
        "1": {"class_type": unet, "inputs": {"unet_name": DIT_FILE, "weight_dtype": "default"}},
        "2": {"class_type": clip, "inputs": {"clip_name": CLIP_FILE, "type": "stable_diffusion",
                                             "device": "default"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PROMPT}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": NEGATIVE}},
        "5": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0],
            "latent_image": ["5", 0], "seed": 42, "steps": 6, "cfg": 4.0,
            "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "7": {"class_type": "SaveLatent",
              "inputs": {"samples": ["6", 0], "filename_prefix": "latents/tiered_offload"}},
    }


def _layerwise_inputs(**chosen) -> dict:
    """Apply Layerwise Offload over the loader's model: every input written out (the template
    shows each widget's value), the node's defaults but for what an example chooses
    (tests/unit/test_example_files.py holds them to the node's own)."""
    inputs = {"model": ["1", 0], "resident_blocks": -1, "vram_budget_gb": 0.0, "prefetch": 0,
              "pin": True, "mode": "auto", "host_cache_gb": 0.0, "disk_workers": 0,
              "granularity": "auto", "spill_dir": "", "compile_per_block": False, "share_host_memory": True}
    inputs.update(chosen)
    return inputs


def demo() -> dict[str, dict]:
    """`make demo`: core's loaders and Apply Layerwise Offload with the node's defaults, what a
    user who drops the node in gets (auto settings; the panel says what they chose and why)."""
    wf = _base()
    wf["8"] = {"class_type": "ApplyLayerwiseOffload", "inputs": _layerwise_inputs()}
    wf["6"]["inputs"]["model"] = ["8", 0]
    wf["7"]["inputs"]["filename_prefix"] = "latents/tiered_offload_demo"
    return wf


def layerwise() -> dict[str, dict]:
    """Apply Layerwise Offload keeping a count of blocks on the device: it streams the rest on any
    machine (a budget in GiB would keep the whole small demo model on a large card, or on a CPU)."""
    wf = _base()
    wf["8"] = {"class_type": "ApplyLayerwiseOffload",
               "inputs": _layerwise_inputs(resident_blocks=LAYERWISE_RESIDENT, vram_budget_gb=0.0)}
    wf["6"]["inputs"]["model"] = ["8", 0]
    return wf


def swap() -> dict[str, dict]:
    """Model-Level Swap: the DiT and the text encoder take turns on the GPU."""
    wf = _base()
    wf["8"] = {"class_type": "ModelLevelSwap",
               "inputs": {"model": ["1", 0], "clip": ["2", 0], "share_host_memory": True}}
    wf["6"]["inputs"]["model"] = ["8", 0]
    for node in ("3", "4"):
        wf[node]["inputs"]["clip"] = ["8", 1]
    return wf


def tiered() -> dict[str, dict]:
    """The Tiered loaders, with the VRAM Tier Manager setting budgets and the DiT's policy."""
    wf = _base("TieredUNETLoader", "TieredCLIPLoader")
    wf["8"] = {"class_type": "VRAMTierManager", "inputs": {
        "model": ["1", 0], "clip": ["2", 0], "ram_budget_gb": 0.0, "ram_reserve_gb": 2.0,
        "vram_reserve_gb": 1.0, "disk_tier": True, "keep_in_ram": True, "priority": 10}}
    wf["6"]["inputs"]["model"] = ["8", 0]
    for node in ("3", "4"):
        wf[node]["inputs"]["clip"] = ["8", 1]
    return wf


_MODELS_NOTE = (f"Models: {DIT_FILE} (in models/diffusion_models) and {CLIP_FILE} (in "
                "models/text_encoders), random-weight demo files: make demo writes them, and so "
                "does python tools/demo_models.py YOUR_COMFYUI_FOLDER from a clone of the pack. "
                "Or pick your own models in the loaders.")


class Example(NamedTuple):
    build: Callable[[], dict]
    note: str   # shown on the canvas
    focus: tuple[str, ...] = ("ApplyLayerwiseOffload",)  # the nodes its thumbnail shows, large


# The file stem -> the example. The template browser shows the stem as the title (cut at about 25
# characters: the node comes first) and again as the caption (two lines, about 60 characters, with
# "-" and "_" turned into spaces): it says what the workflow shows. A stem is a file name on every
# system: none of / \ : * ? " < > | (Windows refuses them).
DEMO = "Demo, the offload node's defaults, seen in the Offload panel"
# The example with blocks streamed on any machine: the README's picture shows it (make screenshot).
LAYERWISE = f"Apply Layerwise Offload, {DIT_BLOCKS - LAYERWISE_RESIDENT} of {DIT_BLOCKS} blocks streamed from RAM"
EXAMPLES: dict[str, Example] = {
    DEMO: Example(demo, (
        "The demo of comfyui-tiered-offload (make demo): Apply Layerwise Offload as you get it "
        "when you add it, every input at its default. It keeps on the GPU as many of the "
        "diffusion model's blocks as make the run faster, within what the card has free, and "
        "streams the others from pinned RAM while earlier blocks compute; each run's timings "
        "choose how many and how far ahead. The demo model is small, so a card with room for it "
        "keeps every block. The result is bit-identical to the same workflow without the node. "
        "Open the Offload tab in the sidebar before a run: every loaded model, where its blocks "
        "are, what auto chose and why. " + _MODELS_NOTE)),
    LAYERWISE: Example(layerwise, (
        f"Apply Layerwise Offload between the model loader (and any LoRA) and the sampler. "
        f"resident_blocks {LAYERWISE_RESIDENT}: that many of the model's blocks stay on the GPU, "
        f"the rest ({DIT_BLOCKS - LAYERWISE_RESIDENT} of the demo model's {DIT_BLOCKS}) are "
        f"streamed from pinned RAM, on any machine. For your own model, set resident_blocks to -1 "
        f"and vram_budget_gb to the GiB the blocks may take on your card (for example 12 on a "
        f"24 GiB card running a 14B video model), or to 0 to let the node take what the card has "
        f"free. " + _MODELS_NOTE)),
    "Model-Level Swap, model and text encoder share the GPU": Example(swap, (
        "Model-Level Swap after the loaders: the diffusion model is parked in RAM while text is "
        "encoded, the text encoder while sampling. Both move from pinned RAM masters: a few "
        "large copies in, nothing copied back. " + _MODELS_NOTE), ("ModelLevelSwap",)),
    "Tiered loaders, models kept in RAM between workflows": Example(tiered, (
        "The Tiered loaders load what core's loaders load, and the tier manager keeps their "
        "models across workflows (VRAM, RAM, disk). The VRAM Tier Manager sets the budgets (GiB) "
        "and this model's policy: keep in RAM, priority 10. Run another workflow, then this one "
        "again: its models come back from RAM, not from disk. The Offload tab edits the same "
        "budgets and policy. " + _MODELS_NOTE), ("VRAMTierManager",)),
}


def api_graphs() -> dict[str, dict]:
    return {stem: example.build() for stem, example in EXAMPLES.items()}


def api_text(graph: dict) -> str:
    """An API graph as the shipped file holds it."""
    return json.dumps(graph, indent=1) + "\n"


def write_api_files(out_dir: Path) -> list[Path]:
    """The API form of every example, as `<stem>.json` in `out_dir`: what POST /prompt takes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, graph in api_graphs().items():
        path = out_dir / f"{stem}.json"
        path.write_text(api_text(graph), encoding="utf-8")
        written.append(path)
    return written


# Runs in the page: the frontend builds the graph from the API form, lays it out, adds the note
# and fixes the seed (a template should give the same result on every run), then serializes it.
_BUILD_JS = """async ([apiGraph, note, name]) => {
  await app.loadApiJson(apiGraph, name);
  for (const node of app.graph.nodes) {
    for (const w of node.widgets ?? []) if (w.name === "control_after_generate") w.value = "fixed";
  }
  const n = LiteGraph.createNode("Note");
  n.widgets[0].value = note;
  n.size = [420, 160];
  app.graph.add(n);
  app.graph.arrange();
  return JSON.stringify(app.graph.serialize());  // as saved: no undefined turned into null
}"""


# Runs in the page: the example's own nodes, drawn large on the canvas alone (no menus, no
# minimap), cut to 4:3 around them. The template browser shows thumbnails a few hundred pixels
# wide: a whole graph there is boxes without words, its own node can be read.
_THUMBNAIL_JS = """([types, width, height, pad]) => {
  const shown = app.graph.nodes.filter((n) => types.includes(n.type));
  const title = LiteGraph.NODE_TITLE_HEIGHT;
  let x0 = Math.min(...shown.map((n) => n.pos[0])) - pad;
  let y0 = Math.min(...shown.map((n) => n.pos[1] - title)) - pad;
  let w = Math.max(...shown.map((n) => n.pos[0] + n.size[0])) + pad - x0;
  let h = Math.max(...shown.map((n) => n.pos[1] + n.size[1])) + pad - y0;
  if (w / h < width / height) { const wide = h * width / height; x0 -= (wide - w) / 2; w = wide; }
  else { const tall = w * height / width; y0 -= (tall - h) / 2; h = tall; }
  const canvas = app.canvas.canvas;
  const ratio = canvas.width / canvas.clientWidth;
  const ds = app.canvas.ds;
  ds.scale = Math.min(canvas.clientWidth / w, canvas.clientHeight / h);
  ds.offset[0] = -x0; ds.offset[1] = -y0;
  app.canvas.setDirty(true, true);
  app.canvas.draw(true, true);
  const out = document.createElement("canvas");
  out.width = width; out.height = height;
  out.getContext("2d").drawImage(canvas, 0, 0, w * ds.scale * ratio, h * ds.scale * ratio, 0, 0, width, height);
  return out.toDataURL("image/jpeg", 0.85);
}"""
THUMBNAIL = (640, 480)
THUMBNAIL_PAD = 30   # graph units around the example's own nodes


def build_ui_files(url: str, out_dir: Path, chromium: str) -> list[Path]:
    """Let the frontend at `url` turn each API graph into its graph (UI) file in `out_dir`, with
    the thumbnail the template browser shows beside it (<name>.jpg: the example's own nodes)."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
        page.goto(url, wait_until="domcontentloaded")
        page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph",
                               timeout=120_000)
        page.evaluate("app.extensionManager.setting.set('Comfy.Graph.CanvasInfo', false)")
        for stem, example in EXAMPLES.items():
            graph = json.loads(page.evaluate(_BUILD_JS, [example.build(), example.note, stem]))
            path = out_dir / f"{stem}.json"
            path.write_text(json.dumps(graph, indent=1) + "\n")
            page.wait_for_timeout(300)
            data_url = page.evaluate(_THUMBNAIL_JS, [list(example.focus), *THUMBNAIL, THUMBNAIL_PAD])
            thumb = out_dir / f"{stem}.jpg"
            thumb.write_bytes(base64.b64decode(data_url.split(",", 1)[1]))
            written += [path, thumb]
        browser.close()
    return written


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api-only", action="store_true", help="write the API forms only")
    args = ap.parse_args(argv)
    for path in write_api_files(API_DIR):
        print(f"wrote {path.relative_to(REPO)}")
    if args.api_only:
        return 0
    from browser import chromium_path
    from comfy_server import ComfyServer

    chromium = chromium_path()
    if chromium is None:
        print("needs Chromium (see make chromium)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="tiered_offload_examples_") as tmp:
        base = Path(tmp)
        write_models(base)
        server = ComfyServer(base, test_nodes=False).start()
        try:
            for path in build_ui_files(server.url, EXAMPLES_DIR, chromium):
                print(f"wrote {path.relative_to(REPO)}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
