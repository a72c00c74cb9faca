// Rendering of the "Offload" sidebar tab. Pure DOM, no framework; the whole body is rebuilt
// from the state on each update (a handful of rows), and only while the tab is visible.

const CSS_URL = new URL("./panel.css", import.meta.url).href;

const TIER_LABEL = { vram: "VRAM", ram: "RAM", disk: "DISK" };
const ACTIONS = [
  { action: "load", label: "Load", icon: "pi-upload", title: "Load into VRAM", off: (m) => m.tier === "vram" },
  { action: "park", label: "Park", icon: "pi-download", title: "Park in pinned RAM", off: (m) => m.tier === "ram" },
  { action: "evict", label: "Evict", icon: "pi-trash", title: "Drop to disk", off: (m) => m.tier === "disk" },
];

export function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

export function fmtBytes(n, units = "GB") {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  const bin = units === "GiB";
  const k = bin ? 1024 : 1000;
  const names = bin ? ["B", "KiB", "MiB", "GiB", "TiB"] : ["B", "kB", "MB", "GB", "TB"];
  let v = Math.abs(n);
  let i = 0;
  while (v >= k && i < names.length - 1) { v /= k; i++; }
  const digits = i === 0 || v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${n < 0 ? "-" : ""}${v.toFixed(digits)} ${names[i]}`;
}

export function fmtAgo(unixSeconds, now = Date.now() / 1000) {
  if (typeof unixSeconds !== "number") return "never";
  const s = Math.max(0, now - unixSeconds);
  if (s < 5) return "just now";
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : 0);
const pct = (part, whole) => (whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0);

// A horizontal stacked bar: segments [{cls, bytes, title}], scaled to `total`.
function bar(segments, total, { marker = null, cls = "" } = {}) {
  let left = 0;
  const parts = segments.map((s) => {
    const w = Math.min(pct(s.bytes, total), 100 - left);
    left += w;
    return w > 0 ? `<span class="to-seg ${s.cls}" style="width:${w.toFixed(2)}%" title="${esc(s.title)}"></span>` : "";
  });
  const mark = marker && total > 0
    ? `<span class="to-marker" style="left:${pct(marker.bytes, total).toFixed(2)}%" title="${esc(marker.title)}"></span>`
    : "";
  return `<div class="to-bar ${cls}">${parts.join("")}${mark}</div>`;
}

function legend(items) {
  return `<div class="to-legend">${items.filter(Boolean).map(([cls, text]) =>
    `<span>${cls ? `<i class="to-dot ${cls}"></i>` : ""}${esc(text)}</span>`).join("")}</div>`;
}

function devicesHtml(payload, units) {
  const b = (n) => fmtBytes(n, units);
  const vram = payload.devices?.vram;
  const ram = payload.devices?.ram;
  const out = [];
  if (vram) {
    const total = num(vram.total), used = num(vram.used), reserved = num(vram.reserved);
    const free = vram.free ?? Math.max(0, total - used);
    out.push(`<div class="to-dev" data-dev="vram">
      <div class="to-dev-head"><b>VRAM</b><span class="to-muted to-ellipsis" title="${esc(vram.device ?? "")}">${esc(vram.device ?? "")}</span>
        <span class="to-right">${total > 0 ? `${esc(b(used))} / ${esc(b(total))}` : "no GPU memory"}</span></div>
      ${total > 0 ? `${bar([
        { cls: "to-c-used", bytes: used, title: `used ${b(used)}` },
        { cls: "to-c-free", bytes: Math.max(0, free - reserved), title: `free ${b(free)}` },
        { cls: "to-c-reserved", bytes: Math.min(reserved, free), title: `reserved ${b(reserved)}` },
      ], total)}
      ${legend([["to-c-used", `used ${b(used)}`], ["to-c-free", `free ${b(free)}`],
                ["to-c-reserved", `reserved ${b(reserved)}`]])}` : ""}
    </div>`);
  }
  if (ram) {
    const total = num(ram.total), avail = num(ram.available), pinned = num(ram.pinned);
    const budget = num(ram.budget), models = num(ram.used_by_models);
    const unpinnedModels = Math.max(0, models - pinned);
    const other = Math.max(0, total - avail - pinned - unpinnedModels);
    out.push(`<div class="to-dev" data-dev="pinned">
      <div class="to-dev-head"><b>Pinned</b>
        <span class="to-right">${esc(b(pinned))} of ${budget > 0 ? `${esc(b(budget))} budget` : "no budget"}</span></div>
      ${bar([{ cls: "to-c-pinned", bytes: pinned, title: `pinned ${b(pinned)}` }],
            budget > 0 ? budget : Math.max(pinned, 1), { cls: pinned > budget && budget > 0 ? "to-over" : "" })}
    </div>
    <div class="to-dev" data-dev="ram">
      <div class="to-dev-head"><b>RAM</b>
        <span class="to-right">${esc(b(avail))} available of ${esc(b(total))}</span></div>
      ${bar([
        { cls: "to-c-pinned", bytes: pinned, title: `pinned ${b(pinned)}` },
        { cls: "to-c-ram", bytes: unpinnedModels, title: `models, unpinned ${b(unpinnedModels)}` },
        { cls: "to-c-other", bytes: other, title: `other processes ${b(other)}` },
      ], total, budget > 0 ? { marker: { bytes: budget, title: `pin budget ${b(budget)}` } } : {})}
      ${legend([["to-c-pinned", `pinned ${b(pinned)}`],
                unpinnedModels > 0 && ["to-c-ram", `models ${b(unpinnedModels)}`],
                ["to-c-other", `other ${b(other)}`], ["to-c-free", `available ${b(avail)}`]])}
    </div>`);
  }
  return out.join("") || `<div class="to-muted">No device figures.</div>`;
}

// Where a block's weights are: on the device, in a device slot, in the host cache, on disk only,
// or packed in host RAM.
const PLACE = {
  resident: "on the GPU", in_flight: "in a GPU slot", cached: "in the RAM cache", disk: "on disk",
  streamed: "in RAM",
};

function stripHtml(lw) {
  const states = Array.isArray(lw.block_states) && lw.block_states.length
    ? lw.block_states
    : Array.from({ length: num(lw.blocks) }, (_, i) =>
        (lw.resident_indices ?? []).includes(i) ? "resident" : "streamed");
  const cells = states.map((s, i) =>
    `<span class="to-blk to-blk-${esc(s)}" title="block ${i}: ${esc(PLACE[s] ?? String(s).replace("_", " "))}"></span>`);
  return `<div class="to-strip" aria-label="blocks">${cells.join("")}</div>`;
}

// Every telemetry field is optional; older/newer engines name a few of them differently.
const pick = (t, ...keys) => keys.map((k) => t[k]).find((v) => typeof v === "number" && Number.isFinite(v)) ?? null;

function telemetryHtml(raw, units) {
  if (!raw) return `<div class="to-muted">No sampling run yet.</div>`;
  const t = {
    ...raw,
    wait_seconds: pick(raw, "wait_seconds", "compute_wait_s"),
    fallbacks: pick(raw, "fallbacks", "sync_fallbacks"),
    gbps: pick(raw, "gbps") ?? (pick(raw, "seconds") > 0 && typeof raw.bytes_copied === "number"
      ? raw.bytes_copied / 1e9 / raw.seconds : null),
  };
  const bin = units === "GiB";
  const rate = typeof t.gbps === "number" ? (bin ? (t.gbps * 1e9) / 2 ** 30 : t.gbps) : null;
  const eff = typeof t.overlap_efficiency === "number"
    ? (t.overlap_efficiency <= 1 ? t.overlap_efficiency * 100 : t.overlap_efficiency) : null;
  const stat = (k, v, cls = "") => `<div class="to-stat ${cls}"><span>${esc(k)}</span><b>${esc(v)}</b></div>`;
  const rows = [];
  if (rate !== null) rows.push(stat("copy rate", `${rate.toFixed(2)} ${bin ? "GiB" : "GB"}/s`));
  if (typeof t.wait_seconds === "number") {
    const share = typeof t.seconds === "number" && t.seconds > 0 ? ` (${((100 * t.wait_seconds) / t.seconds).toFixed(0)}%)` : "";
    rows.push(stat("compute waited", `${t.wait_seconds.toFixed(2)} s${share}`));
  }
  if (eff !== null) rows.push(stat("overlap", `${eff.toFixed(0)}%`));
  if (typeof t.seconds === "number") rows.push(stat("run", `${t.seconds.toFixed(2)} s`));
  if (typeof t.bytes_copied === "number") {
    rows.push(stat("copied", `${fmtBytes(t.bytes_copied, units)}${typeof t.copies === "number" ? ` · ${t.copies}×` : ""}`));
  }
  if (typeof t.peak_materialized_bytes === "number") rows.push(stat("peak on device", fmtBytes(t.peak_materialized_bytes, units)));
  // Disk streaming: how fast the disk delivered while reading, what the RAM cache saved, and
  // how long compute waited for a read.
  if (typeof t.disk_read_gibps === "number") {
    rows.push(stat("disk read", `${(bin ? t.disk_read_gibps : (t.disk_read_gibps * 2 ** 30) / 1e9).toFixed(2)} ${bin ? "GiB" : "GB"}/s`));
  }
  if (typeof t.cache_hit_rate === "number") rows.push(stat("cache hits", `${(100 * t.cache_hit_rate).toFixed(0)}%`));
  if (typeof t.disk_wait_s === "number") rows.push(stat("waited for disk", `${t.disk_wait_s.toFixed(2)} s`));
  if (num(t.disk_read_errors) > 0) rows.push(stat("read errors", String(t.disk_read_errors), "to-warn"));
  if (num(t.fallbacks) > 0) rows.push(stat("fallbacks", String(t.fallbacks), "to-warn"));
  if (num(t.order_misses) > 0) rows.push(stat("order misses", String(t.order_misses), "to-warn"));
  return `<div class="to-stats">${rows.join("")}</div>`;
}

function layerwiseHtml(lw, showStrip, units, title = "Layerwise") {
  if (!lw) return "";
  const resident = lw.resident_indices?.length ?? 0;
  const streamed = lw.streamed_indices?.length ?? 0;
  // Resident and streamed counts are in units: blocks, or phases of blocks.
  const unitName = lw.granularity === "phase" ? "phases" : "";
  const disk = lw.disk?.active
    ? ` · from disk through ${esc(fmtBytes(num(lw.disk.cache_bytes), units))} RAM cache` : "";
  return `<div class="to-lw">
    <div class="to-lw-head"><b>${esc(title)}</b>
      <span class="to-muted" data-role="lw-summary">${num(lw.blocks)} blocks${unitName ? ` as ${num(lw.units?.length)} ${unitName}` : ""}
      · ${resident} resident · ${streamed} streamed
      ${typeof lw.bound_bytes === "number" ? ` · ${esc(fmtBytes(lw.bound_bytes, units))} bound` : ""}${disk}</span></div>
    ${showStrip ? stripHtml(lw) : ""}
    ${telemetryHtml(lw.telemetry, units)}
  </div>`;
}

function modelHtml(m, ctx) {
  const { units, strips, pending, lastRuns, notice } = ctx;
  const b = (n) => fmtBytes(n, units);
  const bytes = m.bytes ?? {};
  const total = num(m.total_bytes) || num(bytes.vram) + num(bytes.ram);
  // Blocks streamed from disk: the layerwise report (pushed after every run) says how many bytes
  // only the disk holds; the rest of the model outside VRAM is in RAM (its other weights, the cache).
  const lwDisk = m.layerwise?.disk?.active && typeof m.layerwise.host?.disk === "number"
    ? Math.min(m.layerwise.host.disk, total) : null;
  const ram = lwDisk !== null ? Math.max(0, total - num(bytes.vram) - lwDisk) : num(bytes.ram);
  const pinned = Math.min(num(bytes.pinned), ram);
  const unpinned = Math.max(0, ram - pinned);
  let disk = lwDisk ?? (typeof bytes.disk === "number" ? bytes.disk : Math.max(0, total - num(bytes.vram) - ram));
  if (disk < total * 0.001) disk = 0; // rounding / buffers, not a real disk-only share
  const tier = TIER_LABEL[m.tier] ? m.tier : "disk";
  const busy = pending[m.id];
  const inUse = num(m.in_use) > 0;
  const pol = m.policy ?? {};
  let lw = m.layerwise;
  if (lw && !lw.telemetry && lastRuns[m.id]?.telemetry) lw = { ...lw, telemetry: lastRuns[m.id].telemetry };

  const pills = [
    inUse ? `<span class="to-pill to-pill-busy" title="${num(m.in_use)} user(s)">in use${num(m.in_use) > 1 ? ` ×${num(m.in_use)}` : ""}</span>` : "",
    pol.pinned ? `<span class="to-pill to-pill-pin" title="Pinned: never parked or evicted automatically"><i class="pi pi-lock"></i> pinned</span>` : "",
    num(pol.priority) !== 0 ? `<span class="to-pill" title="Eviction priority">prio ${num(pol.priority)}</span>` : "",
  ].join("");
  const buttons = ACTIONS.map((a) =>
    `<button class="to-btn" data-action="${a.action}" title="${esc(a.title)}"${busy || a.off(m) ? " disabled" : ""}>
       <i class="pi ${busy === a.action ? "pi-spin pi-spinner" : a.icon}"></i>${a.label}</button>`);
  const pinAction = pol.pinned ? "unpin" : "pin";
  buttons.push(`<button class="to-btn" data-action="${pinAction}" title="${pol.pinned ? "Allow automatic parking/eviction" : "Keep in its tier"}"${busy ? " disabled" : ""}>
      <i class="pi ${busy === pinAction ? "pi-spin pi-spinner" : pol.pinned ? "pi-lock-open" : "pi-lock"}"></i>${pol.pinned ? "Unpin" : "Pin"}</button>`);

  return `<div class="to-model" data-model-id="${esc(m.id)}" data-tier="${tier}">
    <div class="to-model-head">
      <span class="to-badge to-badge-${tier}" data-role="tier">${TIER_LABEL[tier]}</span>
      <span class="to-name" title="${esc(m.name ?? m.id)} (${esc(m.id)})">${esc(m.name ?? m.id)}</span>
    </div>
    ${bar([
      { cls: "to-c-vram", bytes: num(bytes.vram), title: `VRAM ${b(num(bytes.vram))}` },
      { cls: "to-c-pinned", bytes: pinned, title: `pinned RAM ${b(pinned)}` },
      { cls: "to-c-ram", bytes: unpinned, title: `RAM ${b(unpinned)}` },
      { cls: "to-c-disk", bytes: disk, title: `disk only ${b(disk)}` },
    ], total, { cls: "to-bar-thin" })}
    ${legend([
      num(bytes.vram) > 0 && ["to-c-vram", `VRAM ${b(num(bytes.vram))}`],
      pinned > 0 && ["to-c-pinned", `pinned ${b(pinned)}`],
      unpinned > 0 && ["to-c-ram", `RAM ${b(unpinned)}`],
      disk > 0 && ["to-c-disk", `disk ${b(disk)}`],
      ["", `of ${b(total)}`],
    ])}
    <div class="to-meta">
      <span>${esc(String(m.kind ?? "").replace("_", " "))}</span>
      <span data-ts="${typeof m.last_used === "number" ? m.last_used : ""}" data-role="last-used">${esc(fmtAgo(m.last_used))}</span>
      <span title="loads from disk / from RAM">${num(m.load_count)} load${num(m.load_count) === 1 ? "" : "s"}
        (${num(m.loads_from_disk)} disk, ${num(m.loads_from_ram)} RAM)</span>
      ${pills}
    </div>
    ${layerwiseHtml(lw, strips, units)}
    <div class="to-actions">${buttons.join("")}</div>
    ${notice?.model_id === m.id ? noticeHtml(notice) : ""}
  </div>`;
}

function noticeHtml(n) {
  return `<div class="to-notice to-notice-${esc(n.kind)}" role="alert" data-role="notice">
    <i class="pi pi-exclamation-triangle"></i><span>${esc(n.text)}</span>
    <button class="to-icon-btn" data-role="dismiss" title="Dismiss"><i class="pi pi-times"></i></button></div>`;
}

function budgetsHtml(bud, ram, units) {
  const b = (n) => fmtBytes(n, units);
  const parts = [
    typeof bud.vram_reserve_bytes === "number" && `VRAM reserve ${b(bud.vram_reserve_bytes)}`,
    `pin budget ${typeof bud.ram_budget_bytes === "number" ? b(bud.ram_budget_bytes)
      : num(ram?.budget) > 0 ? `auto (${b(ram.budget)})` : "auto"}`,
    typeof bud.ram_reserve_bytes === "number" && `RAM reserve ${b(bud.ram_reserve_bytes)}`,
    typeof bud.disk_tier === "boolean" && `disk tier ${bud.disk_tier ? "on" : "off"}`,
  ].filter(Boolean);
  return `<div class="to-budgets to-muted" data-role="budgets">${esc(parts.join(" · "))}</div>`;
}

export class Panel {
  constructor({ state, settings, onAction, onRefresh, onDismiss }) {
    Object.assign(this, { state, settings, onAction, onRefresh, onDismiss });
    this.root = null;
    this.dirty = true;
    this.frame = 0;
    this.clock = 0;
    this.observer = null;
  }

  mount(el) {
    if (this.root && this.root.parentElement === el) { this.update(); return; }
    this.unmount();
    if (!document.querySelector(`link[href="${CSS_URL}"]`)) {
      const link = document.createElement("link");
      link.rel = "stylesheet";
      link.href = CSS_URL;
      document.head.appendChild(link);
    }
    const root = document.createElement("div");
    root.id = "tiered-offload-panel";
    root.className = "to-panel";
    root.addEventListener("click", (e) => this.onClick(e));
    el.replaceChildren(root);
    this.root = root;
    // Handles frontends that keep a closed tab alive but hidden: draw again once it shows.
    this.observer = new IntersectionObserver((entries) => {
      if (entries.some((x) => x.isIntersecting) && this.dirty) this.update();
    });
    this.observer.observe(root);
    // Relative "last used" times age; refresh only that text, only while open.
    this.clock = setInterval(() => this.isOpen() && this.tick(), 30000);
    this.dirty = true;
    this.render();
  }

  unmount() {
    cancelAnimationFrame(this.frame);
    clearInterval(this.clock);
    this.observer?.disconnect();
    this.observer = null;
    this.frame = 0;
    this.root = null;
  }

  isOpen() {
    return !!this.root && this.root.isConnected && this.root.getClientRects().length > 0;
  }

  // Cheap to call from any event: while the tab is closed it only marks the view stale.
  update() {
    this.dirty = true;
    if (!this.isOpen() || this.frame) return;
    this.frame = requestAnimationFrame(() => { this.frame = 0; this.render(); });
  }

  onClick(e) {
    const btn = e.target.closest("button");
    if (!btn || btn.disabled) return;
    if (btn.dataset.action) {
      const row = btn.closest("[data-model-id]");
      if (row) this.onAction(row.dataset.modelId, btn.dataset.action);
    } else if (btn.dataset.role === "refresh") this.onRefresh();
    else if (btn.dataset.role === "dismiss") this.onDismiss();
  }

  tick() {
    const now = Date.now() / 1000;
    for (const el of this.root.querySelectorAll("[data-ts]")) {
      const ts = parseFloat(el.dataset.ts);
      el.textContent = fmtAgo(Number.isFinite(ts) ? ts : null, now);
    }
  }

  render() {
    if (!this.root) return;
    this.dirty = false;
    if (window.__tieredOffload) window.__tieredOffload.renders += 1;
    const { state } = this;
    const { units, strips } = this.settings();
    const p = state.payload;
    const head = `<div class="to-head">
        <span class="to-title"><i class="pi pi-server"></i> Tiered Offload</span>
        <button class="to-icon-btn" data-role="refresh" title="Reload from server"><i class="pi pi-refresh"></i></button>
      </div>`;
    // A refusal shows in the row it concerns; anything else (or a vanished row) at the top.
    const rowIds = new Set((p?.models ?? []).map((m) => m.id));
    const notice = state.notice && !rowIds.has(state.notice.model_id) ? noticeHtml(state.notice) : "";
    let body;
    if (state.status === "unavailable" || (state.status === "error" && !p)) {
      body = `<div class="to-empty" data-role="status">${esc(state.error)}</div>`;
    } else if (!p) {
      body = `<div class="to-empty" data-role="status">Loading…</div>`;
    } else {
      const models = Array.isArray(p.models) ? p.models : [];
      const ctx = { units, strips, pending: state.pending, lastRuns: state.lastRuns, notice: state.notice };
      const orphan = state.lastRuns[""];
      body = `
        ${state.status === "error" ? `<div class="to-notice to-notice-error">${esc(state.error)}</div>` : ""}
        <section class="to-devices">${devicesHtml(p, units)}${budgetsHtml(p.budgets ?? {}, p.devices?.ram, units)}</section>
        <div class="to-section-head"><b>Models</b><span class="to-muted">${models.length}</span></div>
        <section class="to-models">${models.length
          ? models.map((m) => modelHtml(m, ctx)).join("")
          : `<div class="to-empty">No models yet. Models appear here once a Tiered loader node has loaded them.</div>`}</section>
        ${orphan ? `<section class="to-models"><div class="to-model">${layerwiseHtml(orphan, strips, units, "Last layerwise run (model not tier-managed)")}</div></section>` : ""}`;
    }
    this.root.innerHTML = head + notice + body;
  }
}
