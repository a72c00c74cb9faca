"""Which Chromium the browser tests and tools drive (with playwright; no browser is downloaded).

`CHROMIUM` names one explicitly; otherwise the first `chromium` on PATH, then Debian's path.
The Makefile's chromium rule looks for it the same way before it offers to install one.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

DEBIAN_CHROMIUM = "/usr/bin/chromium"


def chromium_path() -> str | None:
    """The Chromium executable to drive, or None when there is none."""
    for candidate in (os.environ.get("CHROMIUM"), shutil.which("chromium"), DEBIAN_CHROMIUM):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def wait_for_ui(page, url: str) -> None:
    """Open ComfyUI's frontend and wait until the app and this pack's extension are set up."""
    page.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
    page.goto(url, wait_until="domcontentloaded")
    page.wait_for_function("() => window.app && window.app.graph && window.__tieredOffload?.ready",
                           timeout=120_000)


def open_offload_tab(page) -> None:
    """Open the Offload sidebar tab (a no-op when it is open)."""
    if not page.locator("#tiered-offload-panel").count():
        page.locator(".tiered-offload-tab-button").first.click()
    page.wait_for_selector("#tiered-offload-panel", timeout=30_000)


def load_template(page, module: str, name: str) -> None:
    """Put a custom node pack's example workflow on the canvas, as the template browser does."""
    page.evaluate("""async ([module, name]) => {
        const res = await fetch(`/api/workflow_templates/${module}/${name}.json`);
        await app.loadGraphData(await res.json(), true, true, name);
    }""", [module, name])


def boxes(locator) -> list[dict]:
    """The bounding boxes of every element `locator` matches, with their text, data-unit and
    whether their text is cut short (an ellipsis): what the user sees of each, to check that none
    hides another and each can be read."""
    return locator.evaluate_all("""els => els.map((e) => { const r = e.getBoundingClientRect();
        return { x: r.x, y: r.y, w: r.width, h: r.height, text: e.textContent.trim(),
                 unit: e.dataset.unit ?? null, cut: e.scrollWidth > e.clientWidth }; })""")


def overlapping(found: list[dict], slack: float = 0.5) -> list[tuple[str, str]]:
    """The pairs of boxes that overlap by more than `slack` px both ways (a shared edge is not)."""
    pairs = []
    for i, a in enumerate(found):
        for b in found[i + 1:]:
            if (min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"]) > slack
                    and min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"]) > slack):
                pairs.append((a["text"], b["text"]))
    return pairs


# Runs in the page: every element under `root` whose content does not fit its box, as the user
# would see it. A box that clips its text must end it with an ellipsis, carry the whole text in
# its title (its own or an ancestor's) and keep room for a few characters; any other box must
# hold its content (text that runs past its box, or past the root, is what "overflow" means
# here). Icons and the root's own scrolling are no overflow.
_OVERFLOWS_JS = """(root) => {
  const out = [];
  const limit = root.getBoundingClientRect();
  const describe = (el) => `${el.tagName.toLowerCase()}${el.dataset.role ? `[${el.dataset.role}]` : ""}.${
    [...el.classList].join(".")} "${el.textContent.trim().slice(0, 60)}"`;
  for (const el of root.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (!r.width && !r.height) continue;                      // not shown
    if (el.closest(".pi, svg") || el.tagName === "INPUT") continue;
    const style = getComputedStyle(el);
    if (style.visibility === "hidden") continue;
    const text = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (r.right > limit.right + 0.5 || r.left < limit.left - 0.5) {
      out.push(`past the panel's edge (${Math.round(r.left - limit.left)}..${Math.round(r.right - limit.left)} of ${Math.round(limit.width)} px): ${describe(el)}`);
      continue;
    }
    if (el.scrollWidth <= el.clientWidth + 1 || ["auto", "scroll"].includes(style.overflowX)) continue;
    if (style.overflowX === "visible") {
      // Absolutely placed children (a picture's spans and labels) are checked on their own.
      const inner = [...el.children].some((c) => getComputedStyle(c).position === "absolute");
      if (!inner || text) out.push(`runs past its box (${el.scrollWidth} > ${el.clientWidth} px): ${describe(el)}`);
      continue;
    }
    if (!text) continue;                                      // clips only what its children hold
    const titled = el.closest("[title]")?.getAttribute("title")?.includes(el.textContent.trim());
    if (style.textOverflow !== "ellipsis" || !titled) out.push(`cut without an ellipsis and a title: ${describe(el)}`);
    else if (el.clientWidth < 24) out.push(`squeezed to ${el.clientWidth} px: ${describe(el)}`);
  }
  return out;
}"""


def overflows(locator) -> list[str]:
    """What does not fit its box under the element `locator` matches (see _OVERFLOWS_JS): empty
    when every word on it can be read, whole or ellipsized with its full text in a title."""
    return locator.evaluate(_OVERFLOWS_JS)
