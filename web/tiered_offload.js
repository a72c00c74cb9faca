// comfyui-tiered-offload: the "Offload" sidebar tab.
// Data flow: one GET /api/offload/tiers when the tab opens (and after a websocket reconnect),
// then only websocket pushes ("tiered_offload.tiers" on every tier change, after every prompt
// and after every change made from the panel; "tiered_offload.layerwise" after each sampling
// run). No polling by default. While the tab is closed the latest payload is kept and nothing
// touches the DOM. The one extra GET follows a budgets save, whose figures (the RAM budget) the
// server derives; with a refresh interval set (a setting, 0 by default) the open tab also GETs on
// it, which shows models core loads in the middle of a prompt (core sends no event for those).
// Refusals of the panel's requests and errors the pack's code raises in a prompt also show as
// toasts. While the tab is open it renews a lease (POST /api/offload/timeline) under which the
// server records a picture of each layerwise run; the picture opens full width in a tab of the
// frontend's bottom panel (web/timeline.js), which holds the lease too while it shows.
// Words: web/i18n.js.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { frontendKey, tr } from "./i18n.js";
import { Panel, timelineCards } from "./panel.js";
import { TIMELINE_TAB, TimelineView } from "./timeline.js";

const TAB_ID = "tiered-offload";
const SETTING_STRIPS = "TieredOffload.Panel.ShowBlockStrips";
const SETTING_REFRESH = "TieredOffload.Panel.RefreshSeconds";
const SETTING_UNITS = "TieredOffload.Panel.Units";
const SETTING_CORE = "TieredOffload.Panel.ShowCoreModels";
const CATEGORY = ["Tiered Offload", "Offload panel"];
// The folder ComfyUI serves this file from is the pack's folder name: /extensions/<pack>/.
const PACK = decodeURIComponent(new URL(".", import.meta.url).pathname.split("/").filter(Boolean).pop());
// A path inside the pack, in a traceback line or an exception's module (ComfyUI names a pack's
// modules after its folder's path): "/<pack>/" or "/<pack>." with either slash.
const IN_PACK = new RegExp(`[\\\\/]${PACK.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}[.\\\\/]`);
const packNodes = new Set();   // node ids this pack registers

const state = {
  payload: null,      // last GET /api/offload/tiers body (or websocket copy of it)
  status: "idle",     // idle | loading | ok | unavailable | error
  error: null,        // text for status "error" / "unavailable"
  notice: null,       // {kind: "error"|"info", text, model_id} shown in that card (or on top)
  pending: {},        // card id -> action in flight
  stale: true,        // a GET is due the next time the tab opens
  timelineCard: null, // the card whose picture the full view shows (null: the latest picture)
};

function setting(id, fallback) {
  try {
    const v = app.extensionManager?.setting?.get(id);
    return v === undefined || v === null ? fallback : v;
  } catch {
    return fallback;
  }
}

const panel = new Panel({
  state,
  settings: () => ({
    strips: setting(SETTING_STRIPS, true),
    units: setting(SETTING_UNITS, "auto"),
    showCore: setting(SETTING_CORE, true),
    fullView: fullViewOffered(),
  }),
  onAction: (id, action) => post(id, action, `/offload/models/${encodeURIComponent(id)}/${action}`),
  onUnload: (id) => post(id, "unload", `/offload/loaded/${encodeURIComponent(id)}/unload`),
  onPolicy: (id, body) => post(id, "policy", `/offload/policy/${encodeURIComponent(id)}`, body),
  onBudgets: (body) => saveBudgets(body),
  onRefresh: () => fetchTiers(),
  onDismiss: () => { state.notice = null; panel.update(); },
  onOpenTimeline: (id) => openTimeline(id),
});
const timelineView = new TimelineView({ state, cards: () => timelineCards(state.payload) });

// Both views draw from `state`: each draws only while it shows.
function redraw() {
  panel.update();
  timelineView.update();
}

// The bottom panel took the pack's tab: frontends 1.32 to 1.49 register an extension's
// `bottomPanelTabs` and make a toggle command of each, the command openTimeline runs. Where there
// is no such command the panel offers no full view.
const TIMELINE_COMMAND = `Workspace.ToggleBottomPanelTab.${TIMELINE_TAB}`;
function fullViewOffered() {
  const command = app.extensionManager?.command;
  return typeof command?.execute === "function"
    && !!command.commands?.some?.((c) => c.id === TIMELINE_COMMAND);
}

// Shows `id`'s picture in the bottom panel's tab, opening the panel on it unless it shows already
// (the frontend's command toggles: run on an open tab it would close it).
async function openTimeline(id) {
  state.timelineCard = id;
  if (timelineView.isOpen()) { timelineView.update(); return; }
  try {
    await app.extensionManager.command.execute(TIMELINE_COMMAND);
  } catch (e) {
    toast("warn", tr("timeline.openFailed"), String(e?.message ?? e));
  }
}

let fetching = null;
function fetchTiers() {
  fetching ??= getTiers().finally(() => { fetching = null; });
  return fetching;
}

async function getTiers() {
  state.status = state.payload ? state.status : "loading";
  state.stale = false;
  redraw();
  try {
    const res = await api.fetchApi("/offload/tiers", { cache: "no-store" });
    if (res.status === 404) {
      state.status = "unavailable";
      state.error = tr("panel.unavailable");
    } else if (!res.ok) {
      state.status = "error";
      state.error = tr("panel.getFailed", { error: `${res.status} ${await errorText(res)}` });
    } else {
      state.payload = await res.json();
      state.status = "ok";
      state.error = null;
    }
  } catch (e) {
    state.status = "error";
    state.error = tr("panel.getFailed", { error: e?.message ?? e });
    state.stale = true;
  }
  redraw();
}

async function errorText(res) {
  try {
    const body = await res.json();
    return body?.error ?? JSON.stringify(body);
  } catch {
    return res.statusText || "";
  }
}

function cardLabel(id) {
  const p = state.payload;
  const m = p?.models?.find((x) => x.id === id) ?? p?.loaded?.find((x) => x.id === id);
  return m?.name ?? m?.file ?? m?.class ?? id;
}

// One panel request; the change itself arrives as a "tiered_offload.tiers" push.
// Requests about one card go out one after the other, in the order the user made them: a
// priority typed while the keep-in-RAM change is still on its way is sent after it, not dropped.
const chains = {};
function post(id, action, path, body) {
  const send = () => postNow(id, action, path, body);
  chains[id] = (chains[id] ?? Promise.resolve()).then(send, send);
  return chains[id];
}

async function postNow(id, action, path, body) {
  const label = cardLabel(id);
  state.pending[id] = action;
  panel.update();
  let failure = null;
  try {
    // Every POST says it is JSON, body or not: the pack refuses anything else (no simple
    // cross-site request can change its state).
    const init = { method: "POST", headers: { "Content-Type": "application/json" } };
    if (body !== undefined) init.body = JSON.stringify(body);
    const res = await api.fetchApi(path, init);
    if (!res.ok) failure = tr("panel.http", { error: await errorText(res), status: res.status });
  } catch (e) {
    failure = String(e?.message ?? e);
  }
  delete state.pending[id];
  if (failure) {
    // The card already names the model; the toast (seen from anywhere) says which one.
    const name = tr(`actions.${action}.label`);
    state.notice = { kind: "error", text: tr("refusal.notice", { action: name, error: failure }), model_id: id };
    toast("warn", tr("refusal.toast", { action: name }), tr("refusal.toastDetail", { model: label, error: failure }));
  } else if (state.notice?.model_id === id) {
    state.notice = null;
  }
  panel.update();
}

// Returns an error text, or null once saved.
async function saveBudgets(body) {
  try {
    const res = await api.fetchApi("/offload/budgets", {
      method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" } });
    if (!res.ok) return budgetsRefused(tr("panel.http", { error: await errorText(res), status: res.status }));
    const saved = await res.json();
    if (state.payload && saved?.budgets) state.payload.budgets = saved.budgets;
  } catch (e) {
    return budgetsRefused(String(e?.message ?? e));
  }
  await fetchTiers();
  return null;
}

function budgetsRefused(failure) {
  toast("warn", tr("refusal.toast", { action: tr("actions.budgets.label") }), failure);
  return failure;
}

// The frontend's toasts: `add` in the frontends we know (1.32 to 1.49); the named methods of
// newer builds otherwise. Where neither exists the panel's own message (or the frontend's error
// dialog, for a prompt) is all the user sees.
function toast(severity, summary, detail) {
  const t = app.extensionManager?.toast;
  const life = severity === "error" ? 12000 : 6000;
  try {
    if (typeof t?.add === "function") t.add({ severity, summary, detail, life });
    else if (typeof t?.[severity === "warn" ? "warning" : severity] === "function") {
      t[severity === "warn" ? "warning" : severity](summary, { description: detail });
    }
  } catch {
    /* the panel message is the primary channel */
  }
}

// A prompt failed: if the pack's code raised it (one of the pack's nodes, or a frame or an
// exception type of the pack's modules, such as a refusal raised while a sampler runs), a toast
// says so with the prompt's own message, the one the frontend's error report shows.
function fromPack(error) {
  if (packNodes.has(error.node_type)) return true;
  const frames = Array.isArray(error.traceback) ? error.traceback : [];
  return IN_PACK.test(String(frames.at(-1) ?? "")) || IN_PACK.test(String(error.exception_type ?? ""));
}

function nodeTitle(error) {
  const node = app.graph?.getNodeById?.(error.node_id);
  return node?.title || globalThis.LiteGraph?.registered_node_types?.[error.node_type]?.title || error.node_type;
}

function onExecutionError(e) {
  const error = e.detail;
  if (!error || typeof error !== "object" || !fromPack(error)) return;
  toast("error", tr("promptError.toast", { node: nodeTitle(error) }), String(error.exception_message ?? ""));
}

// While the tab is mounted, an optional GET every few seconds (the refresh interval setting),
// made only while it shows.
let refreshTimer = 0;
// `value`: the setting's new value, from its onChange (1.49 calls it before storing the value).
function scheduleRefresh(value = setting(SETTING_REFRESH, 0)) {
  clearInterval(refreshTimer);
  refreshTimer = 0;
  const seconds = Number(value);
  if (!panel.isMounted() || !Number.isFinite(seconds) || seconds <= 0) return;
  refreshTimer = setInterval(() => panel.isOpen() && fetchTiers(), seconds * 1000);
}

// While the tab (or the full view of the picture) is open the server records a picture of each
// layerwise run (its timeline): the view renews a lease every TIMELINE_RENEW_S, and the server
// stops recording when the lease runs out (twice that), so closed views leave nothing recording.
// Nothing is recorded otherwise.
const TIMELINE_RENEW_S = 30;
let timelineTimer = 0;
// `opening`: a view is being drawn (it may not be laid out yet); later renewals only while one shows.
function renewTimeline(opening = false) {
  if (!opening && !panel.isOpen() && !timelineView.isOpen()) return;
  api.fetchApi("/offload/timeline", {
    method: "POST", body: JSON.stringify({ enabled: true }), headers: { "Content-Type": "application/json" },
  }).catch(() => { /* an older server without the route: no picture */ });
}

function scheduleTimeline() {
  clearInterval(timelineTimer);
  timelineTimer = 0;
  if (!panel.isMounted() && !timelineView.isMounted()) return;
  renewTimeline(true);
  timelineTimer = setInterval(renewTimeline, TIMELINE_RENEW_S * 1000);
}

function onTiers(e) {
  if (!e.detail || typeof e.detail !== "object") return;
  state.payload = e.detail;
  state.status = "ok";
  state.error = null;
  redraw();
}

// A sampling run ended: its figures go into the card of the model it streamed.
function onLayerwise(e) {
  const { model_id: id = null, layerwise = null } = e.detail ?? {};
  if (!layerwise || !state.payload) return;
  const managed = id && state.payload.models?.find((m) => m.id === id);
  if (managed) managed.layerwise = layerwise;
  for (const card of state.payload.loaded ?? []) {
    if (card.layerwise?.module_id === layerwise.module_id) card.layerwise = layerwise;
  }
  redraw();
}

function onReconnected() {
  state.stale = true;
  if (panel.isOpen()) fetchTiers();
}

// The settings' names and tooltips here are English; the frontend shows them in the user's
// language from the pack's locales/<lang>/settings.json (keys: the ids with "." as "_").
app.registerExtension({
  name: "comfyui-tiered-offload.panel",
  settings: [
    {
      id: SETTING_STRIPS,
      category: [...CATEGORY, "Block strips"],
      name: "Show block strips of layerwise-offloaded models",
      type: "boolean",
      defaultValue: true,
      onChange: () => panel.update(),
    },
    {
      id: SETTING_UNITS,
      category: [...CATEGORY, "Units"],
      name: "Units of sizes",
      tooltip: "auto: each size in the binary unit that fits it (KiB, MiB, GiB); GiB or MiB: every size in that unit.",
      type: "combo",
      options: ["auto", "GiB", "MiB"],
      defaultValue: "auto",
      onChange: () => panel.update(),
    },
    {
      id: SETTING_CORE,
      category: [...CATEGORY, "Core models"],
      name: "Show models that only ComfyUI manages",
      tooltip: "Models ComfyUI loaded that the pack neither tier-manages, streams nor swaps. Off: the panel lists only the pack's models and says how many it hides.",
      type: "boolean",
      defaultValue: true,
      onChange: () => panel.update(),
    },
    {
      id: SETTING_REFRESH,
      category: [...CATEGORY, "Refresh"],
      name: "Refresh interval while the panel is open (seconds)",
      tooltip: "0: live updates only (websocket events after every change and every prompt). Above 0: the open panel also asks the server this often, so a model ComfyUI loads in the middle of a prompt appears before the prompt ends.",
      type: "number",
      attrs: { min: 0, max: 3600, step: 1 },
      defaultValue: 0,
      onChange: (value) => scheduleRefresh(value),
    },
  ],
  // The full view of the last run's picture. Title: English for the frontend's command ("Toggle
  // … Bottom Panel"), the key for the tab, which the frontend translates.
  bottomPanelTabs: [{
    id: TIMELINE_TAB,
    title: "Offload timeline",
    titleKey: frontendKey("timeline.tab"),
    type: "custom",
    render: (el) => {
      timelineView.mount(el);
      if (state.stale) fetchTiers();
      scheduleTimeline();
    },
    destroy: () => {
      timelineView.unmount();
      scheduleTimeline();
    },
  }],
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (String(nodeData?.python_module ?? "").split(".")[1] === PACK) packNodes.add(nodeData.name);
  },
  async setup() {
    // The nodes' help pages: their long names in code wrap within the help column (web/help.css).
    const helpStyles = document.createElement("link");
    helpStyles.rel = "stylesheet";
    helpStyles.href = new URL("./help.css", import.meta.url).href;
    document.head.appendChild(helpStyles);
    api.addEventListener("tiered_offload.tiers", onTiers);
    api.addEventListener("tiered_offload.layerwise", onLayerwise);
    api.addEventListener("reconnected", onReconnected);
    api.addEventListener("execution_error", onExecutionError);
    const em = app.extensionManager;
    if (typeof em?.registerSidebarTab === "function") {
      // Title and tooltip as i18n keys: the frontend translates them (as it does its own tabs').
      em.registerSidebarTab({
        id: TAB_ID,
        icon: "pi pi-server",
        title: frontendKey("tab.title"),
        tooltip: frontendKey("tab.tooltip"),
        type: "custom",
        render: (el) => {
          panel.mount(el);
          if (state.stale) fetchTiers();
          scheduleRefresh();
          scheduleTimeline();
        },
        destroy: () => {
          panel.unmount();
          scheduleRefresh();
          scheduleTimeline();
        },
      });
    }
    window.__tieredOffload = { ready: true, renders: 0 };
  },
});
