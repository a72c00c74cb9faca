// comfyui-tiered-offload: the "Offload" sidebar tab.
// Data flow: one GET /api/offload/tiers when the tab opens (and after a websocket reconnect),
// then only websocket pushes ("tiered_offload.tiers" on every tier change, after every prompt
// and after every change made from the panel; "tiered_offload.layerwise" after each sampling
// run). No polling. While the tab is closed the latest payload is kept and nothing touches the
// DOM. The one extra GET follows a budgets save, whose figures (the RAM budget) the server
// derives.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { Panel } from "./panel.js";

const TAB_ID = "tiered-offload";
const SETTING_STRIPS = "TieredOffload.Panel.ShowBlockStrips";

const state = {
  payload: null,      // last GET /api/offload/tiers body (or websocket copy of it)
  status: "idle",     // idle | loading | ok | unavailable | error
  error: null,        // text for status "error" / "unavailable"
  notice: null,       // {kind: "error"|"info", text, model_id} shown in that card (or on top)
  pending: {},        // card id -> action in flight
  stale: true,        // a GET is due the next time the tab opens
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
  settings: () => ({ strips: setting(SETTING_STRIPS, true) }),
  onAction: (id, action) => post(id, action, `/offload/models/${encodeURIComponent(id)}/${action}`),
  onUnload: (id) => post(id, "unload", `/offload/loaded/${encodeURIComponent(id)}/unload`),
  onPolicy: (id, body) => post(id, "policy", `/offload/policy/${encodeURIComponent(id)}`, body),
  onBudgets: (body) => saveBudgets(body),
  onRefresh: () => fetchTiers(),
  onDismiss: () => { state.notice = null; panel.update(); },
});

async function fetchTiers() {
  state.status = state.payload ? state.status : "loading";
  state.stale = false;
  panel.update();
  try {
    const res = await api.fetchApi("/offload/tiers", { cache: "no-store" });
    if (res.status === 404) {
      state.status = "unavailable";
      state.error = "Server side not available: this ComfyUI has no /api/offload/tiers route. " +
        "Update comfyui-tiered-offload and restart ComfyUI.";
    } else if (!res.ok) {
      state.status = "error";
      state.error = `GET /api/offload/tiers failed: ${res.status} ${await errorText(res)}`;
    } else {
      state.payload = await res.json();
      state.status = "ok";
      state.error = null;
    }
  } catch (e) {
    state.status = "error";
    state.error = `GET /api/offload/tiers failed: ${e?.message ?? e}`;
    state.stale = true;
  }
  panel.update();
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
    if (!res.ok) failure = `${await errorText(res)} (HTTP ${res.status})`;
  } catch (e) {
    failure = String(e?.message ?? e);
  }
  delete state.pending[id];
  if (failure) {
    // The card already names the model; the toast (seen from anywhere) says which one.
    state.notice = { kind: "error", text: `${action[0].toUpperCase()}${action.slice(1)} refused: ${failure}`, model_id: id };
    toast(`Offload: ${action} refused`, `“${label}”: ${failure}`);
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
    if (!res.ok) return `${await errorText(res)} (HTTP ${res.status})`;
    const saved = await res.json();
    if (state.payload && saved?.budgets) state.payload.budgets = saved.budgets;
  } catch (e) {
    return String(e?.message ?? e);
  }
  await fetchTiers();
  return null;
}

function toast(summary, detail) {
  const t = app.extensionManager?.toast;
  try {
    if (typeof t?.add === "function") t.add({ severity: "warn", summary, detail, life: 6000 });
    else if (typeof t?.warning === "function") t.warning(summary, { description: detail });
  } catch {
    /* the panel message is the primary channel */
  }
}

function onTiers(e) {
  if (!e.detail || typeof e.detail !== "object") return;
  state.payload = e.detail;
  state.status = "ok";
  state.error = null;
  panel.update();
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
  panel.update();
}

function onReconnected() {
  state.stale = true;
  if (panel.isOpen()) fetchTiers();
}

app.registerExtension({
  name: "comfyui-tiered-offload.panel",
  settings: [
    {
      id: SETTING_STRIPS,
      category: ["Tiered Offload", "Panel", "Block strips"],
      name: "Show block strips of layerwise-offloaded models",
      type: "boolean",
      defaultValue: true,
      onChange: () => panel.update(),
    },
  ],
  async setup() {
    api.addEventListener("tiered_offload.tiers", onTiers);
    api.addEventListener("tiered_offload.layerwise", onLayerwise);
    api.addEventListener("reconnected", onReconnected);
    const em = app.extensionManager;
    if (typeof em?.registerSidebarTab === "function") {
      em.registerSidebarTab({
        id: TAB_ID,
        icon: "pi pi-server",
        title: "Offload",
        tooltip: "Offload: every loaded model, in VRAM / RAM / disk",
        type: "custom",
        render: (el) => {
          panel.mount(el);
          if (state.stale) fetchTiers();
        },
        destroy: () => panel.unmount(),
      });
    }
    window.__tieredOffload = { ready: true, renders: 0 };
  },
});
