// Rendering of the "Offload" sidebar tab. Pure DOM, no framework; the body is rebuilt from the
// state on each update (a handful of cards), and only while the tab is visible. An input the
// user is typing in survives the rebuild: its element is moved into the new markup.

const CSS_URL = new URL("./panel.css", import.meta.url).href;

const TIER_LABEL = { vram: "VRAM", ram: "RAM", disk: "DISK" };
const TIER_ACTIONS = [
  { action: "load", label: "Load", icon: "pi-upload", title: "Load into VRAM", off: (m) => m.tier === "vram" },
  { action: "park", label: "Park", icon: "pi-download", title: "Park in RAM (drop the GPU copy)", off: (m) => m.tier === "ram" },
  { action: "evict", label: "Evict", icon: "pi-trash", title: "Drop to disk (free its RAM)", off: (m) => m.tier === "disk" },
];
const BLOCK_STATES = [
  ["resident", "resident on the device"],
  ["streamed", "streamed from RAM"],
  ["in_flight", "in a device slot now"],
  ["cached", "in the RAM cache (disk streaming)"],
  ["disk", "on disk only (disk streaming)"],
];
const BUDGET_FIELDS = [
  { key: "ram_budget_gb", bytes: "ram_budget_bytes", label: "RAM budget", empty: "auto",
    title: "Cap on RAM held by models the manager keeps; empty: only the reserve limits it" },
  { key: "ram_reserve_gb", bytes: "ram_reserve_bytes", label: "RAM reserve",
    title: "RAM always left free for ComfyUI and the system" },
  { key: "vram_reserve_gb", bytes: "vram_reserve_bytes", label: "VRAM reserve",
    title: "VRAM kept free when the manager loads models itself" },
];
const GIB = 2 ** 30;

export function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// Binary units everywhere, labelled as such: the pack's inputs named _gb are GiB too.
export function fmtBytes(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  const names = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Math.abs(n);
  let i = 0;
  while (v >= 1024 && i < names.length - 1) { v /= 1024; i++; }
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
const gib = (bytes) => (typeof bytes === "number" ? String(Math.round((bytes / GIB) * 100) / 100) : "");

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

function legend(items, role = "") {
  return `<div class="to-legend"${role ? ` data-role="${role}"` : ""}>${items.filter(Boolean).map(([cls, text]) =>
    `<span>${cls ? `<i class="to-dot ${cls}"></i>` : ""}${esc(text)}</span>`).join("")}</div>`;
}

// Splits a model's bytes into parts that add up to its total: on the GPU, in RAM, on disk only.
// With a CPU compute device nothing is on a GPU: what core "loaded" sits in RAM.
export function placement(total, device, ram, cpu) {
  total = num(total);
  const dev = cpu ? 0 : Math.min(num(device), total);
  const host = Math.min(cpu ? Math.max(num(ram), num(device)) : num(ram), total - dev);
  return { total, device: dev, ram: host, disk: total - dev - host };
}

function placementHtml(p, cpu) {
  return `${bar([
      { cls: "to-c-vram", bytes: p.device, title: `VRAM ${fmtBytes(p.device)}` },
      { cls: "to-c-ram", bytes: p.ram, title: `RAM ${fmtBytes(p.ram)}` },
      { cls: "to-c-disk", bytes: p.disk, title: `disk only ${fmtBytes(p.disk)}` },
    ], p.total, { cls: "to-bar-thin" })}
    ${legend([
      !cpu && ["to-c-vram", `VRAM ${fmtBytes(p.device)}`],
      ["to-c-ram", `RAM ${fmtBytes(p.ram)}`],
      p.disk > 0 && ["to-c-disk", `disk only ${fmtBytes(p.disk)}`],
      ["", `= ${fmtBytes(p.total)}`],
    ], "figures")}`;
}

function isCpu(payload) {
  const vram = payload?.devices?.vram;
  return !vram || num(vram.total) === 0;
}

function devicesHtml(payload) {
  const b = fmtBytes;
  const vram = payload.devices?.vram;
  const ram = payload.devices?.ram;
  const out = [];
  if (vram) {
    const total = num(vram.total), used = num(vram.used), reserved = num(vram.reserved);
    const free = vram.free ?? Math.max(0, total - used);
    out.push(`<div class="to-dev" data-dev="vram">
      <div class="to-dev-head"><b>VRAM</b><span class="to-muted to-ellipsis" title="${esc(vram.device ?? "")}">${esc(vram.device ?? "")}</span>
        <span class="to-right">${total > 0 ? `${esc(b(used))} / ${esc(b(total))}` : "none: models run on the CPU"}</span></div>
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
        { cls: "to-c-ram", bytes: unpinnedModels, title: `managed models, unpinned ${b(unpinnedModels)}` },
        { cls: "to-c-other", bytes: other, title: `everything else ${b(other)}` },
      ], total, budget > 0 ? { marker: { bytes: budget, title: `RAM budget ${b(budget)}` } } : {})}
      ${legend([["to-c-pinned", `pinned ${b(pinned)}`],
                unpinnedModels > 0 && ["to-c-ram", `managed ${b(unpinnedModels)}`],
                ["to-c-other", `other ${b(other)}`], ["to-c-free", `available ${b(avail)}`]])}
    </div>`);
  }
  return out.join("") || `<div class="to-muted">No device figures.</div>`;
}

// Where a block's weights are: on the device, in a device slot, in the host cache, on disk only,
// or packed in host RAM.
const PLACE = {
  resident: "on the device", in_flight: "in a device slot", cached: "in the RAM cache", disk: "on disk",
  streamed: "in RAM",
};

// A model core streams with Dynamic VRAM: where comfy-aimdo holds each block (read from its VBAR
// after the last run), or the node's plan where that cannot be read.
const CORE_PLACE = {
  resident: "kept in VRAM by ComfyUI", partial: "partly in VRAM (ComfyUI)", streamed: "streamed by ComfyUI",
};
const CORE_STATES = [["resident", CORE_PLACE.resident], ["partial", CORE_PLACE.partial],
  ["streamed", CORE_PLACE.streamed]];

function stripHtml(lw, place = PLACE, states_legend = BLOCK_STATES) {
  const states = Array.isArray(lw.block_states) && lw.block_states.length
    ? lw.block_states
    : Array.from({ length: num(lw.blocks) }, (_, i) =>
        (lw.resident_indices ?? []).includes(i) ? "resident" : "streamed");
  const cells = states.map((s, i) =>
    `<span class="to-blk to-blk-${esc(s)}" title="block ${i}: ${esc(place[s] ?? String(s).replace("_", " "))}"></span>`);
  const shown = new Set(states);
  return `<div class="to-strip" aria-label="blocks">${cells.join("")}</div>
    ${legend(states_legend.filter(([s]) => shown.has(s) || s === "resident" || s === "streamed")
      .map(([s, text]) => [`to-blk-${s}`, text]), "strip-legend")}`;
}

// Every telemetry field is optional; older/newer engines name a few of them differently.
const pick = (t, ...keys) => keys.map((k) => t[k]).find((v) => typeof v === "number" && Number.isFinite(v)) ?? null;

function telemetryHtml(raw) {
  if (!raw) return `<div class="to-muted">No sampling run yet.</div>`;
  const seconds = pick(raw, "seconds");
  const copied = pick(raw, "bytes_copied");
  const wait = pick(raw, "wait_seconds", "compute_wait_s");
  const fallbacks = pick(raw, "fallbacks", "sync_fallbacks");
  const eff = typeof raw.overlap_efficiency === "number"
    ? (raw.overlap_efficiency <= 1 ? raw.overlap_efficiency * 100 : raw.overlap_efficiency) : null;
  const stat = (k, v, title, cls = "") =>
    `<div class="to-stat ${cls}" title="${esc(title)}"><span>${esc(k)}</span><b>${esc(v)}</b></div>`;
  const rows = [];
  if (copied !== null && seconds > 0) {
    rows.push(stat("copy rate", `${fmtBytes(copied / seconds)}/s`, "bytes streamed over the run's wall time"));
  }
  if (wait !== null) {
    const share = seconds > 0 ? ` (${((100 * wait) / seconds).toFixed(0)}%)` : "";
    rows.push(stat("compute waited", `${wait.toFixed(2)} s${share}`, "time compute waited for a block's copy"));
  }
  const host = pick(raw, "host_wait_s");
  if (host !== null) {
    const share = seconds > 0 ? ` (${((100 * host) / seconds).toFixed(0)}%)` : "";
    rows.push(stat("engine on host", `${host.toFixed(2)} s${share}`,
      "time the sampling thread spent in the engine: issuing copies and merges, and waiting for them"));
  }
  if (eff !== null) {
    rows.push(stat("overlap", `${eff.toFixed(0)}%`, "share of the run neither compute nor the sampling thread waited"));
  }
  if (seconds !== null) rows.push(stat("run", `${seconds.toFixed(2)} s`, "the last sampling run"));
  if (copied !== null) {
    rows.push(stat("copied", `${fmtBytes(copied)}${typeof raw.copies === "number" ? ` · ${raw.copies}×` : ""}`,
      "bytes and copies from RAM to the device"));
  }
  if (typeof raw.peak_materialized_bytes === "number") {
    rows.push(stat("peak on device", fmtBytes(raw.peak_materialized_bytes), "most block bytes on the device at once"));
  }
  if (num(fallbacks) > 0) rows.push(stat("fallbacks", String(fallbacks), "synchronous copies", "to-warn"));
  if (num(raw.order_misses) > 0) rows.push(stat("order misses", String(raw.order_misses), "blocks run out of order", "to-warn"));
  // Disk streaming: how fast the disk delivered while reading, what the RAM cache saved, and
  // how long compute waited for a read.
  if (typeof raw.disk_read_gibps === "number") {
    rows.push(stat("disk read", `${raw.disk_read_gibps.toFixed(2)} GiB/s`, "bytes read from disk over the time spent reading"));
  }
  if (typeof raw.cache_hit_rate === "number") {
    rows.push(stat("cache hits", `${(100 * raw.cache_hit_rate).toFixed(0)}%`, "streamed units found in the RAM cache"));
  }
  if (typeof raw.disk_wait_s === "number") {
    rows.push(stat("waited for disk", `${raw.disk_wait_s.toFixed(2)} s`, "time compute waited for a disk read"));
  }
  if (num(raw.disk_read_errors) > 0) rows.push(stat("read errors", String(raw.disk_read_errors), "failed disk reads", "to-warn"));
  return `<div class="to-stats">${rows.join("")}</div>`;
}

// Apply Layerwise Offload's auto mode on a Dynamic VRAM model: core streams, in the node's order.
function dynamicOrderHtml(lw, showStrip) {
  const dv = lw.dynamic_vram;
  const fromVbar = dv.residency_source === "vbar";
  const kept = fromVbar ? (dv.core_resident_blocks ?? []).length : (lw.resident_indices ?? []).length;
  const streamed = fromVbar ? (dv.core_streamed_blocks ?? []).length : (lw.streamed_indices ?? []).length;
  const order = dv.order === "in force"
    ? `<div class="to-muted" data-role="lw-order">Order: the node's ${(lw.resident_indices ?? []).length} resident blocks first, in force${num(dv.relayouts) > 0 ? ` (laid out again ${num(dv.relayouts)}×)` : ""}</div>`
    : dv.order === "fixed by an earlier load"
      ? `<div class="to-muted to-warn-text" data-role="lw-order">${esc(dv.message ?? "Order already fixed by an earlier load; it takes effect after the model is reloaded.")}</div>`
      : `<div class="to-muted" data-role="lw-order">Order: ${esc(dv.order)}</div>`;
  return `<div class="to-lw" data-role="layerwise" data-path="core">
    <div class="to-lw-head"><b>Streamed by ComfyUI (Dynamic VRAM) in the order of Apply Layerwise Offload</b>
      <span class="to-muted" data-role="lw-summary">${num(lw.blocks)} blocks · ${kept} kept in VRAM · ${streamed} streamed
      ${fromVbar ? "(after the last run)" : "(as planned)"}</span></div>
    ${order}
    ${showStrip ? stripHtml(lw, CORE_PLACE, CORE_STATES) : ""}
    <div class="to-muted" data-role="lw-streaming">${esc(dv.streaming ?? "")}</div>
  </div>`;
}

function streamedPill(lw) {
  if (!lw) return "";
  return lw.dynamic_vram?.path === "core streams"
    ? `<span class="to-pill" title="ComfyUI streams it with Dynamic VRAM, in the order of Apply Layerwise Offload">core streams · ordered</span>`
    : `<span class="to-pill">streamed</span>`;
}

function layerwiseHtml(lw, showStrip) {
  if (!lw) return "";
  if (lw.dynamic_vram?.path === "core streams") return dynamicOrderHtml(lw, showStrip);
  const resident = lw.resident_indices?.length ?? 0;
  const streamed = lw.streamed_indices?.length ?? 0;
  // Resident and streamed counts are in units: blocks, or phases of blocks.
  const unitName = lw.granularity === "phase" ? "phases" : "";
  const disk = lw.disk?.active
    ? ` · from disk through ${esc(fmtBytes(num(lw.disk.cache_bytes)))} RAM cache` : "";
  return `<div class="to-lw" data-role="layerwise">
    <div class="to-lw-head"><b>Streamed by Apply Layerwise Offload</b>
      <span class="to-muted" data-role="lw-summary">${num(lw.blocks)} blocks${unitName ? ` as ${num(lw.units?.length)} ${unitName}` : ""}
      · ${resident} resident · ${streamed} streamed
      ${typeof lw.bound_bytes === "number" ? ` · at most ${esc(fmtBytes(lw.bound_bytes))} on the device` : ""}${disk}</span></div>
    ${lw.dynamic_vram?.cost ? `<div class="to-muted" data-role="lw-cost">Cost: ${esc(lw.dynamic_vram.cost)}</div>` : ""}
    ${showStrip ? stripHtml(lw) : ""}
    ${telemetryHtml(lw.telemetry)}
  </div>`;
}

function swapHtml(sw) {
  if (!sw) return "";
  return `<div class="to-meta" data-role="swap"><span class="to-pill">swapped</span>
    <span>Model-Level Swap: ${num(sw.turns)} turns, ${num(sw.parks)} parks without a copy back${
      sw.bytes && typeof sw.bytes.master === "number" ? ` · master ${esc(fmtBytes(sw.bytes.master))}` : ""}</span></div>`;
}

function button(action, label, icon, title, { disabled = false, busy = false } = {}) {
  return `<button class="to-btn" data-action="${action}" title="${esc(title)}" aria-label="${esc(label)}"${disabled ? " disabled" : ""}>
    <i class="pi ${busy ? "pi-spin pi-spinner" : icon}"></i><span class="to-label">${esc(label)}</span></button>`;
}

function nameHtml(primary, secondary) {
  const full = secondary ? `${primary} (${secondary})` : primary;
  return `<span class="to-name" title="${esc(full)}" data-role="name">${esc(primary)}</span>`;
}

function partsLine(parts) {
  return parts.map((l) => [l.class, l.network && l.network !== l.class ? l.network : null, l.kind]
    .filter(Boolean).join(" · ")).join("; ");
}

// A model the tier manager owns: tier, its parts in core, policy and tier actions.
function managedHtml(m, parts, ctx) {
  const { strips, pending, notice, cpu } = ctx;
  const bytes = m.bytes ?? {};
  const p = placement(m.total_bytes || num(bytes.vram) + num(bytes.ram),
    bytes.vram, num(bytes.ram) + num(bytes.pinned), cpu);
  const tier = TIER_LABEL[m.tier] ? m.tier : "disk";
  const busy = pending[m.id];
  const inUse = num(m.in_use) > 0;
  const pol = m.policy ?? {};
  const lw = m.layerwise ?? parts.find((l) => l.layerwise)?.layerwise;
  const sw = parts.find((l) => l.swap)?.swap;
  const pills = [
    `<span class="to-pill to-pill-tier" title="Kept by the VRAM Tier Manager across workflows">tier-managed</span>`,
    streamedPill(lw),
    inUse ? `<span class="to-pill to-pill-busy" title="${num(m.in_use)} running prompt(s) use it">in use${num(m.in_use) > 1 ? ` ×${num(m.in_use)}` : ""}</span>` : "",
  ].join("");
  const buttons = TIER_ACTIONS.map((a) => button(a.action, a.label, a.icon, a.title,
    { disabled: !!busy || a.off(m), busy: busy === a.action }));
  return `<div class="to-model" data-model-id="${esc(m.id)}" data-tier="${tier}" data-card="managed">
    <div class="to-model-head">
      <span class="to-badge to-badge-${tier}" data-role="tier">${TIER_LABEL[tier]}</span>
      ${nameHtml(m.name ?? m.id, m.id)}
    </div>
    ${parts.length ? `<div class="to-muted to-sub" data-role="class">${esc(partsLine(parts))}</div>` : ""}
    <div class="to-meta">${pills}</div>
    ${placementHtml(p, cpu)}
    <div class="to-meta">
      <span>${esc(String(m.kind ?? "").replace("_", " "))}</span>
      <span data-ts="${typeof m.last_used === "number" ? m.last_used : ""}" data-role="last-used">${esc(fmtAgo(m.last_used))}</span>
      <span title="loads from disk / from RAM">${num(m.load_count)} load${num(m.load_count) === 1 ? "" : "s"}
        (${num(m.loads_from_disk)} disk, ${num(m.loads_from_ram)} RAM)</span>
    </div>
    <div class="to-policy" data-role="policy">
      <label title="Never drop this model to disk (it may still be parked from VRAM to RAM)">
        <input type="checkbox" data-policy="keep_in_ram" data-key="keep-${esc(m.id)}"${pol.pinned ? " checked" : ""}${busy ? " disabled" : ""}> keep in RAM</label>
      <label title="Higher priority models are evicted later (-100 to 100)">priority
        <input type="number" min="-100" max="100" step="1" value="${num(pol.priority)}" data-policy="priority" data-key="prio-${esc(m.id)}"${busy ? " disabled" : ""}></label>
    </div>
    ${layerwiseHtml(lw, strips)}
    ${swapHtml(sw)}
    <div class="to-actions">${buttons.join("")}</div>
    ${notice?.model_id === m.id ? noticeHtml(notice) : ""}
  </div>`;
}

// A model core loaded through any loader, or one the pack still holds after core let go of it.
function coreHtml(l, ctx) {
  const { strips, pending, notice, cpu } = ctx;
  const title = l.file ?? l.class;
  const sub = [l.class, l.network && l.network !== l.class ? l.network : null, l.kind]
    .filter(Boolean).join(" · ");
  let figures;
  let badge;
  if (l.core && l.bytes) {
    figures = placementHtml(placement(l.bytes.total, l.bytes.device, l.bytes.ram, cpu), cpu);
    badge = cpu ? ["ram", "RAM"] : num(l.bytes.device) > 0 ? ["vram", "VRAM"] : ["ram", "RAM"];
  } else {
    figures = `<div class="to-muted">Not loaded by ComfyUI now; the pack still holds its weights in RAM.</div>`;
    badge = ["ram", "RAM"];
  }
  const busy = pending[l.id];
  const pills = [
    l.core ? `<span class="to-pill" title="Loaded by ComfyUI on ${esc(l.device)}">core · ${esc(l.device)}</span>` : "",
    streamedPill(l.layerwise),
    l.swap ? `<span class="to-pill">swapped</span>` : "",
  ].join("");
  return `<div class="to-model" data-loaded-id="${esc(l.id)}" data-tier="${badge[0]}" data-card="core">
    <div class="to-model-head">
      <span class="to-badge to-badge-${badge[0]}" data-role="tier">${badge[1]}</span>
      ${nameHtml(title, l.file ? l.class : null)}
    </div>
    <div class="to-muted to-sub" data-role="class">${esc(sub)}${l.file ? "" : " · file not recorded by this ComfyUI"}</div>
    <div class="to-meta">${pills}</div>
    ${figures}
    ${layerwiseHtml(l.layerwise, strips)}
    ${swapHtml(l.swap)}
    ${l.core ? `<div class="to-actions to-actions-1">${button("unload", "Unload", "pi-eject",
      "Core's own unload, as core does to make room; offered between prompts", { disabled: !!busy, busy: !!busy })}</div>` : ""}
    ${notice?.model_id === l.id ? noticeHtml(notice) : ""}
  </div>`;
}

function noticeHtml(n) {
  return `<div class="to-notice to-notice-${esc(n.kind)}" role="alert" data-role="notice">
    <i class="pi pi-exclamation-triangle"></i><span>${esc(n.text)}</span>
    <button class="to-icon-btn" data-role="dismiss" title="Dismiss"><i class="pi pi-times"></i></button></div>`;
}

function budgetsHtml(bud, ram, editing) {
  const b = fmtBytes;
  const shown = [
    `RAM budget ${typeof bud.ram_budget_bytes === "number" ? b(bud.ram_budget_bytes)
      : num(ram?.budget) > 0 ? `auto (${b(ram.budget)})` : "auto"}`,
    typeof bud.ram_reserve_bytes === "number" && `RAM reserve ${b(bud.ram_reserve_bytes)}`,
    typeof bud.vram_reserve_bytes === "number" && `VRAM reserve ${b(bud.vram_reserve_bytes)}`,
    typeof bud.disk_tier === "boolean" && `disk tier ${bud.disk_tier ? "on" : "off"}`,
  ].filter(Boolean);
  const head = `<div class="to-budgets" data-role="budgets"><span class="to-muted">${esc(shown.join(" · "))}</span>
    ${editing ? "" : `<button class="to-icon-btn" data-role="edit-budgets" title="Edit budgets and the disk tier"><i class="pi pi-pencil"></i></button>`}</div>`;
  return head + (editing ? `<div data-role="budget-editor-slot"></div>` : "");
}

function budgetEditor(bud, err) {
  const rows = BUDGET_FIELDS.map((f) => `<label title="${esc(f.title)}"><span>${esc(f.label)}</span>
      <input type="number" min="0" step="0.25" name="${f.key}" value="${esc(gib(bud[f.bytes]))}"
        placeholder="${esc(f.empty ?? "")}"><span class="to-muted">GiB</span></label>`);
  rows.push(`<label title="Allow dropping idle models to disk when RAM is over budget"><span>Disk tier</span>
      <input type="checkbox" name="disk_tier"${bud.disk_tier !== false ? " checked" : ""}><span></span></label>`);
  return `<form class="to-budget-form" data-role="budget-form" novalidate>${rows.join("")}
    <div class="to-form-err" data-role="budget-error">${esc(err ?? "")}</div>
    <div class="to-actions to-actions-2">
      <button class="to-btn" type="submit" data-role="save-budgets"><i class="pi pi-check"></i><span class="to-label">Save</span></button>
      <button class="to-btn" type="button" data-role="cancel-budgets"><i class="pi pi-times"></i><span class="to-label">Cancel</span></button>
    </div></form>`;
}

// The body of a budgets POST from the form, or an error text.
export function budgetBody(form) {
  const body = {};
  for (const f of BUDGET_FIELDS) {
    const raw = form.elements[f.key].value.trim();
    if (raw === "" && f.key === "ram_budget_gb") { body[f.key] = null; continue; }
    const v = Number(raw);
    if (raw === "" || !Number.isFinite(v) || v < 0) return { error: `${f.label} must be a number of GiB ≥ 0` };
    body[f.key] = v;
  }
  body.disk_tier = form.elements.disk_tier.checked;
  return { body };
}

export class Panel {
  constructor({ state, settings, onAction, onUnload, onPolicy, onBudgets, onRefresh, onDismiss }) {
    Object.assign(this, { state, settings, onAction, onUnload, onPolicy, onBudgets, onRefresh, onDismiss });
    this.root = null;
    this.dirty = true;
    this.frame = 0;
    this.clock = 0;
    this.observer = null;
    this.editor = null;   // the budgets form while it is open: kept across renders
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
    root.addEventListener("change", (e) => this.onChange(e));
    // A priority is sent when the input loses focus or on Enter. Not on "change": the input may
    // be moved into new markup (and focused again) while the user types, which resets what
    // "change" compares against.
    root.addEventListener("focusout", (e) => this.commitPriority(e.target));
    root.addEventListener("keydown", (e) => e.key === "Enter" && this.commitPriority(e.target));
    root.addEventListener("submit", (e) => { e.preventDefault(); this.submitBudgets(e.target); });
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
    this.editor = null;
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
    const role = btn.dataset.role;
    if (btn.dataset.action === "unload") {
      this.onUnload(btn.closest("[data-loaded-id]").dataset.loadedId);
    } else if (btn.dataset.action) {
      const row = btn.closest("[data-model-id]");
      if (row) this.onAction(row.dataset.modelId, btn.dataset.action);
    } else if (role === "refresh") this.onRefresh();
    else if (role === "dismiss") this.onDismiss();
    else if (role === "edit-budgets") { this.state.budgetError = null; this.openEditor(); }
    else if (role === "cancel-budgets") { this.editor = null; this.state.budgetError = null; this.update(); }
  }

  onChange(e) {
    const input = e.target;
    const row = input.closest?.("[data-model-id]");
    if (input.dataset?.policy === "keep_in_ram" && row) {
      this.onPolicy(row.dataset.modelId, { keep_in_ram: input.checked });
    }
  }

  commitPriority(input) {
    const row = input?.closest?.("[data-model-id]");
    if (this.rendering || input?.dataset?.policy !== "priority" || !row) return;
    const id = row.dataset.modelId;
    const known = this.state.payload?.models?.find((m) => m.id === id)?.policy?.priority;
    const v = Number(input.value);
    if (!Number.isInteger(v) || v < -100 || v > 100) {
      input.setCustomValidity("a whole number from -100 to 100");
    } else if (v !== known) {
      input.setCustomValidity("");
      this.onPolicy(id, { priority: v });
    }
  }

  openEditor() {
    const bud = this.state.payload?.budgets ?? {};
    const holder = document.createElement("div");
    holder.innerHTML = budgetEditor(bud, null);
    this.editor = holder.firstElementChild;
    this.update();
  }

  async submitBudgets(form) {
    const { body, error } = budgetBody(form);
    if (error) { this.showBudgetError(error); return; }
    const failure = await this.onBudgets(body);
    if (failure) this.showBudgetError(failure);
    else { this.editor = null; this.update(); }
  }

  showBudgetError(text) {
    const el = this.editor?.querySelector('[data-role="budget-error"]');
    if (el) el.textContent = text;
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
    const { strips } = this.settings();
    const p = state.payload;
    const head = `<div class="to-head">
        <span class="to-title"><i class="pi pi-server"></i> Tiered Offload</span>
        <button class="to-icon-btn" data-role="refresh" title="Reload from server"><i class="pi pi-refresh"></i></button>
      </div>`;
    const managed = Array.isArray(p?.models) ? p.models : [];
    const loaded = Array.isArray(p?.loaded) ? p.loaded : [];
    // A refusal shows in the card it concerns; anything else (or a vanished card) at the top.
    const cardIds = new Set([...managed.map((m) => m.id), ...loaded.map((l) => l.id)]);
    const notice = state.notice && !cardIds.has(state.notice.model_id) ? noticeHtml(state.notice) : "";
    let body;
    if (state.status === "unavailable" || (state.status === "error" && !p)) {
      body = `<div class="to-empty" data-role="status">${esc(state.error)}</div>`;
    } else if (!p) {
      body = `<div class="to-empty" data-role="status">Loading…</div>`;
    } else {
      const ctx = { strips, pending: state.pending, notice: state.notice, cpu: isCpu(p) };
      const cards = [
        ...managed.map((m) => managedHtml(m, loaded.filter((l) => l.tier_id === m.id), ctx)),
        ...loaded.filter((l) => !l.tier_id).map((l) => coreHtml(l, ctx)),
      ];
      body = `
        ${state.status === "error" ? `<div class="to-notice to-notice-error">${esc(state.error)}</div>` : ""}
        <section class="to-devices">${devicesHtml(p)}${budgetsHtml(p.budgets ?? {}, p.devices?.ram, !!this.editor)}</section>
        <div class="to-section-head"><b>Models</b><span class="to-muted" data-role="count">${cards.length}</span></div>
        <section class="to-models">${cards.length ? cards.join("")
          : `<div class="to-empty">No model loaded yet. Every model ComfyUI loads appears here, from any loader.</div>`}</section>`;
    }
    const active = this.root.contains(document.activeElement) ? document.activeElement : null;
    this.rendering = true;  // removing a focused input is no commit
    this.root.innerHTML = head + notice + body;
    const slot = this.root.querySelector('[data-role="budget-editor-slot"]');
    if (slot && this.editor) slot.replaceWith(this.editor);
    if (active?.dataset?.key) {
      this.root.querySelector(`[data-key="${CSS.escape(active.dataset.key)}"]`)?.replaceWith(active);
    }
    if (active?.isConnected) active.focus({ preventScroll: true });
    this.rendering = false;
  }
}
