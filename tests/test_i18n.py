"""The pack in the user's language, and its node help, checked in the files, on the server and in
headless Chromium with the frontend switched to Chinese (the Comfy.Locale setting).

Where the frontend reads each file (ComfyUI 0.3.75 with frontend 1.32.9, 0.33.0 with 1.49.6):
- locales/<lang>/{main,nodeDefs,settings,commands}.json at the pack's root, not its web
  directory: app/custom_node_manager.py `build_translations` globs custom_nodes/*/locales/<lang>/,
  puts nodeDefs/settings/commands under their own keys beside main.json's, and GET /i18n serves
  the merge; the frontend merges that into its vue-i18n messages (1.32.9: GraphCanvas.vue
  `loadCustomNodesI18n`; 1.49.6: i18n.ts `mergeCustomNodesI18n`, kept for locales loaded later).
- Keys, with ids' "." as "_" (normalizeI18nKey): nodeDefs.<id>.display_name / .description /
  .inputs.<name>.name / .inputs.<name>.tooltip / .outputs.<index>.tooltip and
  nodeCategories.<segment> (litegraphService.ts, app.ts getNodeDefs, NodeTooltip.vue);
  settings.<id>.name / .tooltip / .options.<option> and settingsCategories.<category>
  (SettingItem.vue, SettingGroup.vue); commands.<id>.label (KeybindingPanel.vue); a sidebar tab's
  title and tooltip are translated as keys (SidebarIcon.vue).
- Node help: /extensions/<pack>/docs/<NodeId>/<locale>.md, then docs/<NodeId>.md, under the web
  directory (services/nodeHelpService.ts, both versions); the pack answers the first for every
  locale (nodes/server/node_help.py), so no help view fails a request.

Frontend 1.32.9 drops the pack's messages of every language but English: its loadLocale()
replaces a lazily loaded language's messages (setLocaleMessage) after /i18n was merged. A
test-only pack (tests/comfy_test_nodes/locales) holds one control string, so the Chinese checks
run where the frontend keeps a pack's Chinese and are skipped, with the reason, where it does not;
there the English fallback is checked instead.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from browser import chromium_path, wait_for_ui
from comfy_server import PACK_LINK_NAME, REPO
from conftest import ARTIFACTS
from test_panel import browser  # noqa: F401  (a fixture)

sys.path.insert(0, str(REPO / "tools"))
import example_workflows  # noqa: E402
from workflows import streamed_demo  # noqa: E402

sync_api = pytest.importorskip("playwright.sync_api")
sync_api.expect.set_options(timeout=30_000)

CHROMIUM = chromium_path()
LOCALES = REPO / "locales"
DOCS = REPO / "web" / "docs"
LANGS = ("en", "zh")
FILES = ("main", "nodeDefs", "settings", "commands")
PACK_MODULE = f"custom_nodes.{PACK_LINK_NAME}"
CONTROL_KEY = "tieredOffloadTestControl.probe"
PLACEHOLDER = re.compile(r"\{(\w+)\}")
# vue-i18n's message syntax, once the {name} placeholders are taken out: `|` separates plural
# forms, `@` starts a linked message, any other brace is syntax.
SYNTAX = re.compile(r"[|@{}]")
# Descriptions the Tiered loaders inherit from core's loaders (they differ between ComfyUI
# versions); the locale says what the Tiered loader is instead.
INHERITED_DESCRIPTIONS = {"TieredCheckpointLoader", "TieredCLIPLoader"}


def load(lang: str, name: str) -> dict:
    return json.loads((LOCALES / lang / f"{name}.json").read_text(encoding="utf-8"))


def flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def frontend_key(name: str) -> str:
    return name.replace(".", "_")


# -- the files ----------------------------------------------------------------------------------

def test_both_languages_have_the_same_keys_and_placeholders():
    for name in FILES:
        en, zh = flat(load("en", name)), flat(load("zh", name))
        assert set(en) == set(zh), (name, sorted(set(en) ^ set(zh)))
        for key, text in en.items():
            for lang, value in (("en", text), ("zh", zh[key])):
                assert isinstance(value, str) and value.strip(), (lang, name, key)
                assert not SYNTAX.search(PLACEHOLDER.sub("", value)), f"vue-i18n syntax in {lang}/{name}.json {key}: {value!r}"
            assert sorted(PLACEHOLDER.findall(text)) == sorted(PLACEHOLDER.findall(zh[key])), (name, key)


def test_every_node_has_help_in_both_languages():
    nodes = set(load("en", "nodeDefs"))
    english = {p.stem for p in DOCS.glob("*.md")}
    chinese = {p.parent.name for p in DOCS.glob("*/zh.md")}
    assert english == chinese == nodes, (english, chinese, nodes)
    for node in nodes:
        for path in (DOCS / f"{node}.md", DOCS / node / "zh.md"):
            text = path.read_text(encoding="utf-8")
            assert text.startswith("# "), path
            assert text.count("\n## ") >= 3, f"{path}: expected sections (inputs, cost, refusals)"


# -- the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pack_nodes(comfy) -> dict[str, dict]:
    info = comfy.get("/object_info")
    return {name: d for name, d in info.items() if d.get("python_module") == PACK_MODULE}


def test_the_locales_name_exactly_the_packs_user_visible_nodes(comfy, pack_nodes):
    """Every node the pack serves has its words; test-only nodes (another
    pack, tests/comfy_test_nodes) have none and are not the pack's."""
    info = comfy.get("/object_info")
    test_nodes = {n for n, d in info.items() if d.get("python_module", "").endswith("tiered_offload_test_nodes")}
    assert test_nodes, "the test-only nodes are not loaded: this check would prove nothing"
    assert not test_nodes & set(pack_nodes)
    for lang in LANGS:
        assert set(load(lang, "nodeDefs")) == set(pack_nodes), lang


def test_the_server_serves_both_languages(comfy, pack_nodes):
    served = comfy.get("/i18n")
    for lang in LANGS:
        messages = served[lang]
        for name in pack_nodes:
            assert messages["nodeDefs"][name] == load(lang, "nodeDefs")[name], (lang, name)
        assert messages["tieredOffload"] == load(lang, "main")["tieredOffload"], lang
        for key, value in load(lang, "settings").items():
            assert messages["settings"][key] == value, (lang, key)
        for key, value in load(lang, "commands").items():
            assert messages["commands"][key] == value, (lang, key)
    assert served["zh"]["tieredOffloadTestControl"]["probe"], "the feature-detection control is not served"


def test_every_input_and_output_of_this_comfyui_has_its_words(pack_nodes):
    """Inputs differ between ComfyUI versions (a core loader's options): each one this ComfyUI
    has is named and explained in both languages."""
    for lang in LANGS:
        words = load(lang, "nodeDefs")
        for name, d in pack_nodes.items():
            inputs = {**d["input"].get("required", {}), **d["input"].get("optional", {})}
            for inp in inputs:
                entry = words[name]["inputs"].get(inp)
                assert entry and entry.get("name") and entry.get("tooltip"), (lang, name, inp)
            for index in range(len(d["output"])):
                assert words[name]["outputs"][str(index)]["tooltip"], (lang, name, index)


def test_english_words_are_the_nodes_own(pack_nodes):
    """Where a node defines a string (display name, description, tooltips), the English locale is
    that string, so the frontend shows the same English with or without the locale."""
    words = load("en", "nodeDefs")
    for name, d in pack_nodes.items():
        assert words[name]["display_name"] == d["display_name"], name
        if d.get("description") and name not in INHERITED_DESCRIPTIONS:
            assert words[name]["description"] == d["description"], name
        for section in ("required", "optional"):
            for inp, spec in d["input"].get(section, {}).items():
                tooltip = (spec[1] if len(spec) > 1 else {}).get("tooltip")
                if tooltip:
                    assert words[name]["inputs"][inp]["tooltip"] == tooltip, (name, inp)
                assert words[name]["inputs"][inp]["name"] == inp, (name, inp)
        for index, tooltip in enumerate(d.get("output_tooltips") or []):
            if tooltip:
                assert words[name]["outputs"][str(index)]["tooltip"] == tooltip, (name, index)


# -- the browser --------------------------------------------------------------------------------

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it)")


@pytest.fixture(scope="module")
def models_loaded(comfy):
    """Real cards for the panel: the demo (core's loaders, a streamed DiT, a core-only text
    encoder) and the Tiered loaders with the tier manager."""
    example_workflows.write_models(comfy.base)
    comfy.run(streamed_demo())
    tiered = example_workflows.tiered()
    comfy.run(tiered)
    yield
    for model in comfy.get("/api/offload/tiers")["models"]:
        if model["name"] in (example_workflows.DIT_FILE, example_workflows.CLIP_FILE):
            # the workflow pinned them: leave them as other tests expect them
            comfy.post(f"/api/offload/policy/{model['id']}", {"keep_in_ram": False, "priority": 0})


def open_page(browser, comfy, locale: str):  # noqa: F811
    status, _ = comfy.request("POST", "/api/settings/Comfy.Locale", locale)
    assert status == 200
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    failed: list[str] = []  # requests of the pack's help pages that failed (a 404 before a fallback)
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if "/docs/" in r.url and r.status >= 400
            else None)
    wait_for_ui(page, comfy.url)
    page.wait_for_function("(locale) => document.getElementById('vue-app').__vue_app__"
                           ".config.globalProperties.$i18n.locale === locale", arg=locale)
    page.errors = errors
    page.failed_help = failed
    return page


@pytest.fixture(scope="module")
def zh_page(browser, comfy, models_loaded):  # noqa: F811
    page = open_page(browser, comfy, "zh")
    yield page
    page.close()
    status, _ = comfy.request("POST", "/api/settings/Comfy.Locale", "en")
    assert status == 200


def keeps_chinese(page) -> bool:
    """Whether this frontend keeps a custom pack's Chinese (the test-only pack's control)."""
    return page.evaluate(f"""() => document.getElementById('vue-app').__vue_app__.config
        .globalProperties.$te('{CONTROL_KEY}', 'zh')""")


def frontend_version(page) -> str:
    return page.evaluate("window.__COMFYUI_FRONTEND_VERSION__ ?? 'unknown'")


def asked_keys(page, pack_nodes: dict[str, dict]) -> dict[str, list[str]]:
    """The keys the frontend asks for the pack's words, by where they are asked, in the key
    shapes of the frontend's own code (see the module docstring), for what this frontend has
    registered: the pack's node definitions, its settings, its sidebar tab, its bottom panel tab
    (the full view of the last run's picture) and their commands, and
    every key the open panel has asked for (web/i18n.js records them)."""
    nodes = []
    for name, d in pack_nodes.items():
        node = f"nodeDefs.{frontend_key(name)}"
        nodes += [f"{node}.display_name", f"{node}.description"]
        for inp in {**d["input"].get("required", {}), **d["input"].get("optional", {})}:
            nodes += [f"{node}.inputs.{frontend_key(inp)}.name", f"{node}.inputs.{frontend_key(inp)}.tooltip"]
        nodes += [f"{node}.outputs.{i}.tooltip" for i in range(len(d["output"]))]
        nodes += [f"nodeCategories.{segment}" for segment in d["category"].split("/")]
    shell = page.evaluate("""async (pack) => {
        const em = app.extensionManager;
        const norm = (s) => String(s).replaceAll('.', '_');
        const keys = [];
        for (const s of Object.values(em.setting.settings).filter((s) => s.id.startsWith('TieredOffload.'))) {
            const id = norm(s.id);
            keys.push(`settings.${id}.name`);
            if (s.tooltip) keys.push(`settings.${id}.tooltip`);
            for (const o of s.options ?? []) keys.push(`settings.${id}.options.${norm(typeof o === 'string' ? o : o.text)}`);
            for (const c of (s.category ?? []).slice(0, 2)) keys.push(`settingsCategories.${norm(c)}`);
        }
        const tab = em.getSidebarTabs().find((t) => t.id === 'tiered-offload');
        keys.push(tab.title, tab.tooltip, `commands.${norm('Workspace.ToggleSidebarTab.' + tab.id)}.label`);
        const bottom = Object.values(em.bottomPanel.panels).flatMap((p) => p.tabs)
            .find((t) => t.id === 'tiered-offload-timeline');
        keys.push(bottom.titleKey, `commands.${norm('Workspace.ToggleBottomPanelTab.' + bottom.id)}.label`);
        return keys;
    }""", PACK_LINK_NAME)
    panel = page.evaluate(f"""async () => {{
        const {{ askedKeys, NAMESPACE }} = await import('/extensions/{PACK_LINK_NAME}/i18n.js');
        return askedKeys().map((k) => `${{NAMESPACE}}.${{k}}`);
    }}""")
    return {"nodes": nodes, "shell": shell, "panel": panel}


def missing(page, keys: list[str], lang: str) -> list[str]:
    return page.evaluate("""([keys, lang]) => {
        const i18n = document.getElementById('vue-app').__vue_app__.config.globalProperties;
        return keys.filter((k) => !i18n.$te(k, lang));
    }""", [keys, lang])


def open_panel(page) -> None:
    if not page.locator("#tiered-offload-panel").count():
        page.locator(".tiered-offload-tab-button").first.click()
    page.wait_for_selector("#tiered-offload-panel [data-card]", timeout=30_000)


@needs_chromium
def test_every_key_the_frontend_asks_for_exists_in_english(zh_page, pack_nodes):
    open_panel(zh_page)
    keys = asked_keys(zh_page, pack_nodes)
    assert len(keys["panel"]) > 40, keys["panel"]   # the panel drew real cards and asked for them
    for where, found in keys.items():
        assert not missing(zh_page, found, "en"), (where, missing(zh_page, found, "en"))
    assert not zh_page.errors, zh_page.errors


@needs_chromium
def test_every_key_the_frontend_asks_for_exists_in_chinese(zh_page, pack_nodes):
    if not keeps_chinese(zh_page):
        pytest.skip(f"frontend {frontend_version(zh_page)} drops a custom pack's Chinese "
                    "(its loadLocale replaces the messages /i18n merged)")
    open_panel(zh_page)
    keys = asked_keys(zh_page, pack_nodes)
    for where, found in keys.items():
        assert not missing(zh_page, found, "zh"), (where, missing(zh_page, found, "zh"))


def panel_english(page) -> dict:
    return page.evaluate(f"""async () => (await import('/extensions/{PACK_LINK_NAME}/i18n.js')).ENGLISH""")


@needs_chromium
def test_the_panels_english_is_the_english_locale(zh_page):
    """web/i18n.js's ENGLISH (the words where the frontend's i18n is absent) is
    locales/en/main.json's, word for word."""
    assert panel_english(zh_page) == load("en", "main")["tieredOffload"]


def shown(page) -> dict:
    """What the user sees: the panel's header and section title, the tab button's tooltip (its
    aria-label), a new node's title and a widget's label, and the panel's whole text."""
    return page.evaluate("""() => {
        const node = LiteGraph.createNode('ApplyLayerwiseOffload');
        const out = { title: node.title,
            prefetch: node.widgets.find((w) => w.name === 'prefetch')?.label ?? null,
            header: document.querySelector('#tiered-offload-panel .to-title').textContent.trim(),
            tab: (() => { const b = document.querySelector('.tiered-offload-tab-button');
                          return b.getAttribute('aria-label') ?? b.querySelector('[aria-label]')?.getAttribute('aria-label'); })(),
            models: document.querySelector('#tiered-offload-panel .to-section-head b').textContent.trim(),
            text: document.querySelector('#tiered-offload-panel').innerText };
        return out;
    }""")


@needs_chromium
def test_chinese_is_what_the_user_sees(zh_page):
    if not keeps_chinese(zh_page):
        pytest.skip(f"frontend {frontend_version(zh_page)} drops a custom pack's Chinese")
    open_panel(zh_page)
    zh_main, zh_nodes = load("zh", "main")["tieredOffload"], load("zh", "nodeDefs")
    seen = shown(zh_page)
    assert seen["title"] == zh_nodes["ApplyLayerwiseOffload"]["display_name"]
    assert seen["prefetch"] == zh_nodes["ApplyLayerwiseOffload"]["inputs"]["prefetch"]["name"]
    assert seen["header"] == zh_main["panel"]["title"]
    assert seen["models"] == zh_main["panel"]["models"]
    assert seen["tab"].startswith(zh_main["tab"]["tooltip"]), seen["tab"]
    assert "tieredOffload." not in seen["text"], seen["text"]


@needs_chromium
def test_without_the_packs_chinese_the_panel_falls_back_to_english(zh_page):
    """On a frontend that dropped the pack's Chinese, the panel and the nodes are in English,
    never raw keys."""
    if keeps_chinese(zh_page):
        pytest.skip(f"frontend {frontend_version(zh_page)} keeps the pack's Chinese (checked above)")
    open_panel(zh_page)
    en_main, en_nodes = load("en", "main")["tieredOffload"], load("en", "nodeDefs")
    seen = shown(zh_page)
    assert seen["title"] == en_nodes["ApplyLayerwiseOffload"]["display_name"]
    assert seen["header"] == en_main["panel"]["title"]
    assert seen["tab"].startswith(en_main["tab"]["tooltip"]), seen["tab"]
    assert "tieredOffload." not in seen["text"], seen["text"]


# -- node help ----------------------------------------------------------------------------------

def help_heading(page, node_id: str) -> str:
    """``shown_help_heading``; where a step of it fails, the page's state at that moment is saved
    (a screenshot under tests/artifacts and the canvas, selection and any open dialog or toast in
    the message), since such a failure has been seen without being reproduced."""
    try:
        return shown_help_heading(page, node_id)
    except Exception as exc:
        shot = ARTIFACTS / f"help-panel-{node_id}.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot))
        state = page.evaluate("""() => ({ offset: [...app.canvas.ds.offset], scale: app.canvas.ds.scale,
            nodes: app.graph.nodes.map((n) => [n.type, [...n.pos]]),
            selected: Object.keys(app.canvas.selected_nodes ?? {}),
            infoButtons: document.querySelectorAll('[data-testid="info-button"]').length,
            shown: [...document.querySelectorAll('[role="dialog"], .p-toast-message')]
              .map((e) => e.innerText.slice(0, 200)) })""")
        raise AssertionError(f"help panel of {node_id}: {type(exc).__name__}: {str(exc)[:300]}; page "
                             f"state {json.dumps(state)}; screenshot {shot}") from exc


def shown_help_heading(page, node_id: str) -> str:
    """Put the node on an empty canvas, click its title as a user selects it and press the
    selection toolbox's Info button: the frontend's help panel (1.32.9: the node library's help
    page; 1.49.6: the right side panel's Info tab) renders the node's help; return its first
    heading."""
    # The view moves while the frontend restores its last workflow: wait until it stays put.
    page.wait_for_function("""() => {
        const now = JSON.stringify([app.canvas.ds.offset, app.canvas.ds.scale]);
        const settled = now === window.__helpViewWas;
        window.__helpViewWas = now;
        return settled;
    }""", polling=300)
    # The last node's selection toolbox goes first: it would sit over the new node's title.
    page.evaluate("() => { app.canvas.deselectAll(); app.graph.clear(); app.canvas.setDirty(true, true); }")
    sync_api.expect(page.locator('[data-testid="info-button"]')).to_have_count(0)
    page.evaluate("""(id) => {
        const node = LiteGraph.createNode(id);
        app.graph.add(node);
        // In the middle of the canvas, clear of the sidebar's help page and the right panel, in
        // LiteGraph's view transform: screen = (graph + offset) * scale.
        const { offset, scale } = app.canvas.ds;
        const rect = app.canvas.canvas.getBoundingClientRect();
        node.pos = [rect.width / 2 / scale - offset[0] - node.size[0] / 2,
                    rect.height / 2 / scale - offset[1] - node.size[1] / 2];
        app.canvas.setDirty(true, true);
        // The title's middle: its left end holds the collapse toggle.
        window.__helpTitle = [node.pos[0] + node.size[0] / 2, node.pos[1] - LiteGraph.NODE_TITLE_HEIGHT / 2];
    }""", node_id)
    # Hit tests use the bounds a drawn frame computes: click once the title is hit there.
    page.wait_for_function("() => app.graph.getNodeOnPos(...window.__helpTitle) === app.graph.nodes[0]")
    page.mouse.click(*page.evaluate("""() => {
        const { offset, scale } = app.canvas.ds;
        const rect = app.canvas.canvas.getBoundingClientRect();
        const [x, y] = window.__helpTitle;
        return [rect.left + (x + offset[0]) * scale, rect.top + (y + offset[1]) * scale];
    }"""))
    page.wait_for_function("() => app.canvas.selected_nodes[app.graph.nodes[0].id] !== undefined")
    page.locator('[data-testid="info-button"]').first.click()
    heading = page.locator(".node-help-content .markdown-content h1").first
    sync_api.expect(heading).to_be_visible()
    return heading.inner_text().strip()


def test_each_help_request_is_answered_in_the_users_language_or_english(comfy):
    """The frontend's first request for a node's help (docs/<Node>/<locale>.md) is answered for
    every language: Chinese where the pack has it, English otherwise; another name is a 404."""
    base = f"/extensions/{PACK_LINK_NAME}/docs"
    for node in sorted(load("en", "nodeDefs")):
        for locale, want in (("en", DOCS / f"{node}.md"), ("zh", DOCS / node / "zh.md"), ("ja", DOCS / f"{node}.md"),
                             ("pt-BR", DOCS / f"{node}.md")):
            status, body = comfy.request("GET", f"{base}/{node}/{locale}.md")
            assert status == 200 and body == want.read_text(encoding="utf-8"), (node, locale, status)
    for path in (f"{base}/NoSuchNode/en.md", f"{base}/ApplyLayerwiseOffload/x_y.md"):
        assert comfy.request("GET", path)[0] == 404, path


def first_heading(path: Path) -> str:
    return path.read_text(encoding="utf-8").splitlines()[0].removeprefix("# ").strip()


@needs_chromium
@pytest.mark.parametrize("locale", ["en", "zh"])
def test_the_help_panel_shows_each_nodes_help(browser, comfy, locale):  # noqa: F811
    settings = comfy.get("/api/settings")
    page = open_page(browser, comfy, locale)
    try:
        for node_id in sorted(load("en", "nodeDefs")):
            doc = DOCS / node_id / "zh.md" if locale == "zh" else DOCS / f"{node_id}.md"
            assert help_heading(page, node_id) == first_heading(doc), (locale, node_id)
            body = page.locator(".node-help-content .markdown-content").first.inner_text()
            assert "`" not in body and "|---" not in body, "markdown not rendered"
            assert page.locator(".node-help-content .markdown-content li").count() >= 1
            # Nothing wider than the help column (a table of four columns was twice its width):
            # no element of the help, or box holding it, scrolls sideways.
            wide = page.evaluate("""() => {
                const out = [];
                let el = document.querySelector('.node-help-content .markdown-content');
                for (const e of el.querySelectorAll('*')) {
                    if (e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0) out.push(e.tagName + ' ' + e.scrollWidth + '>' + e.clientWidth + ' ' + e.textContent.slice(0, 60));
                }
                for (let k = 0; el && k < 4; k++, el = el.parentElement) {
                    if (el.scrollWidth > el.clientWidth + 1) out.push('box ' + el.className);
                }
                return out;
            }""")
            assert not wide, (locale, node_id, wide)
        assert not page.errors, page.errors
        assert not page.failed_help, page.failed_help
    finally:
        page.close()
        # The frontend keeps the side panel that showed the help open (1.49's right side panel
        # saves that in the server's settings): later pages start as the test found them.
        changed = {key for key, value in comfy.get("/api/settings").items() if settings.get(key) != value}
        comfy.post("/api/settings", {key: settings.get(key, "en" if key == "Comfy.Locale" else None)
                                     for key in changed})


@needs_chromium
def test_where_the_frontend_has_no_i18n_the_panel_speaks_english(zh_page):
    """The panel's words come from the frontend's vue-i18n; a frontend without it (no Vue app
    global properties: hidden here for one call) gets web/i18n.js's English, never a key."""
    said = zh_page.evaluate(f"""async () => {{
        const {{ tr }} = await import('/extensions/{PACK_LINK_NAME}/i18n.js');
        const el = document.getElementById('vue-app');
        const words = () => [tr('panel.title'), tr('panel.hiddenCore', {{ n: 3 }})];
        const withI18n = words();
        const app = el.__vue_app__;
        delete el.__vue_app__;
        try {{ return {{ withI18n, without: words() }}; }} finally {{ el.__vue_app__ = app; }}
    }}""")
    en = load("en", "main")["tieredOffload"]["panel"]
    assert said["without"] == [en["title"], en["hiddenCore"].replace("{n}", "3")]
    if keeps_chinese(zh_page):
        zh = load("zh", "main")["tieredOffload"]["panel"]
        assert said["withI18n"] == [zh["title"], zh["hiddenCore"].replace("{n}", "3")]
    else:
        assert said["withI18n"] == said["without"]
