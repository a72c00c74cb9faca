// Rendering of the "Offload" sidebar tab. Pure DOM, no framework; the body is rebuilt from the
// state on each update (a handful of cards), and only while the tab is visible. An input the
// user is typing in survives the rebuild: its element is moved into the new markup. Every word
// comes from tr() (web/i18n.js): the frontend's language, English where it has none.

import { tr } from "./i18n.js";
import { esc, legend, num } from "./html.js";
import { compactTimelineHtml, fitPicture } from "./timeline.js";
import { planHtml } from "./plan.js";
import { View } from "./view.js";

const TIER_LABEL = { vram: "VRAM", cpu: "CPU", ram: "RAM", disk: "DISK" };
// A tier's badge: [class, text, title key]. Without a GPU the top tier is the CPU's own memory
// (the API's tier "cpu"): a model ComfyUI loaded there is in RAM, so its badge says CPU, never VRAM.
function tierBadge(tier, cpu) {
  if (tier === "cpu" || (tier === "vram" && cpu)) return ["cpu", "CPU", "card.badgeTitle.cpu"];
  return [tier, TIER_LABEL[tier], `card.badgeTitle.${tier}`];
}
function badgeHtml(tier, cpu) {
  const [cls, text, title] = tierBadge(tier, cpu);
  return `<span class="to-badge to-badge-${cls}" data-role="tier" title="${esc(tr(title))}">${text}</span>`;
}
// `cpuTitle`: the button's title where the device is the CPU (no VRAM to load into or drop);
// `keptTitle`: where the model is kept in RAM.
const TIER_ACTIONS = [
  { action: "load", icon: "pi-upload", off: (m) => m.tier === "vram" || m.tier === "cpu", cpuTitle: "actions.load.titleCpu" },
  { action: "park", icon: "pi-download", off: (m) => m.tier === "ram", cpuTitle: "actions.park.titleCpu" },
  // A model kept in RAM is never evicted to disk: Keep in RAM off first (its title says so).
  { action: "evict", icon: "pi-trash", off: (m) => m.tier === "disk" || !!m.policy?.keep_in_ram,
    keptTitle: "actions.evict.titleKept" },
];
const BLOCK_STATES = ["resident", "streamed", "in_flight", "cached", "disk"];
const CORE_STATES = ["resident", "partial", "streamed"];
const BUDGET_FIELDS = [
  { key: "ram_budget_gb", bytes: "ram_budget_bytes", label: "ramBudget", empty: true },
  { key: "ram_reserve_gb", bytes: "ram_reserve_bytes", label: "ramReserve" },
  { key: "vram_reserve_gb", bytes: "vram_reserve_bytes", label: "vramReserve", gpu: true },
];
const GIB = 2 ** 30;
const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
// The unit every size is shown in (the panel's "units shown" setting): "auto" picks the unit
// that fits each figure; a fixed binary unit makes figures comparable at a glance.
let shownUnit = "auto";

// Binary units everywhere, labelled as such: the pack's inputs named _gb are GiB too.
// `unit`: "auto" (the largest unit that keeps the figure at 1 or more) or one of UNITS.
export function fmtBytes(n, unit = shownUnit) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  let v = Math.abs(n);
  let i = UNITS.indexOf(unit);
  if (i < 0) {
    i = 0;
    while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
  } else {
    v /= 1024 ** i;
  }
  const digits = i === 0 || v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${n < 0 ? "-" : ""}${v.toFixed(digits)} ${UNITS[i]}`;
}

export function fmtAgo(unixSeconds, now = Date.now() / 1000) {
  if (typeof unixSeconds !== "number") return tr("ago.never");
  const s = Math.max(0, now - unixSeconds);
  if (s < 5) return tr("ago.now");
  if (s < 60) return tr("ago.seconds", { n: Math.round(s) });
  if (s < 3600) return tr("ago.minutes", { n: Math.round(s / 60) });
  if (s < 86400) return tr("ago.hours", { n: Math.round(s / 3600) });
  return tr("ago.days", { n: Math.round(s / 86400) });
}

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

// Splits a model's bytes into parts that add up to its total: on the GPU, in RAM, on disk only.
// With a CPU compute device nothing is on a GPU: what core "loaded" sits in RAM.
export function placement(total, device, ram, cpu) {
  total = num(total);
  const dev = cpu ? 0 : Math.min(num(device), total);
  const host = Math.min(cpu ? Math.max(num(ram), num(device)) : num(ram), total - dev);
  return { total, device: dev, ram: host, disk: total - dev - host };
}

// The bar of a model's bytes and its legend: each part that holds bytes, and the total where
// there are two parts or more (a whole model in one place reads "RAM: all 236 MiB", no repeat).
// `parts` {blocks, rest}: what a streamed model's total counts, said under the legend.
function placementHtml(p, cpu, parts = null) {
  const shown = [
    !cpu && ["vram", "to-c-vram", p.device],
    ["ram", "to-c-ram", p.ram],
    ["disk", "to-c-disk", p.disk],
  ].filter((x) => x && x[2] > 0);
  const words = (where, bytes) => tr(`placement.${where}`, { size: fmtBytes(bytes) });
  const items = shown.length === 1
    ? [[shown[0][1], tr(`placement.${shown[0][0]}All`, { size: fmtBytes(p.total) })]]
    : [...shown.map(([where, cls, bytes]) => [cls, words(where, bytes)]),
       ["", tr("placement.total", { size: fmtBytes(p.total) })]];
  const counted = parts && typeof parts.blocks === "number" && typeof parts.rest === "number"
    ? `<div class="to-muted to-sub" data-role="parts">${esc(tr("placement.parts", { blocks: fmtBytes(parts.blocks), rest: fmtBytes(parts.rest) }))}</div>`
    : "";
  return `${bar([
      { cls: "to-c-vram", bytes: p.device, title: words("vram", p.device) },
      { cls: "to-c-ram", bytes: p.ram, title: words("ram", p.ram) },
      { cls: "to-c-disk", bytes: p.disk, title: words("disk", p.disk) },
    ], p.total, { cls: "to-bar-thin" })}
    ${legend(items, "figures")}${counted}`;
}

function isCpu(payload) {
  const vram = payload?.devices?.vram;
  return !vram || num(vram.total) === 0;
}

// The RAM bar's rows of what the pack holds (GET /offload/tiers: devices.ram.held_by_pack).
const HELD = [["tier_models", "to-c-ram"], ["swap_masters", "to-c-swap"], ["layerwise_packs", "to-c-pack"],
  ["disk_cache", "to-c-cache"]];

function devicesHtml(payload) {
  const b = fmtBytes;
  const vram = payload.devices?.vram;
  const ram = payload.devices?.ram;
  const out = [];
  if (vram && isCpu(payload)) {
    // No VRAM: the device is the CPU, or a GPU that shares the RAM (Apple silicon); no VRAM tier.
    out.push(`<div class="to-dev" data-dev="device">
      <div class="to-dev-head"><b>${esc(tr("devices.device"))}</b>
        <span class="to-right">${esc(tr(vram.unified_memory ? "devices.unifiedMemory" : "devices.cpuOnly"))}</span></div>
    </div>`);
  } else if (vram) {
    const total = num(vram.total), used = num(vram.used), reserved = num(vram.reserved);
    const free = vram.free ?? Math.max(0, total - used);
    const usedText = tr("devices.used", { size: b(used) });
    const freeText = tr("devices.free", { size: b(free) });
    const reservedText = tr("devices.reserved", { size: b(reserved) });
    out.push(`<div class="to-dev" data-dev="vram">
      <div class="to-dev-head"><b>${esc(tr("devices.vram"))}</b><span class="to-muted to-ellipsis" title="${esc(vram.device ?? "")}">${esc(vram.device ?? "")}</span>
        <span class="to-right">${esc(tr("devices.usedOfTotal", { used: b(used), total: b(total) }))}</span></div>
      ${bar([
        { cls: "to-c-used", bytes: used, title: usedText },
        { cls: "to-c-free", bytes: Math.max(0, free - reserved), title: freeText },
        { cls: "to-c-reserved", bytes: Math.min(reserved, free), title: reservedText },
      ], total)}
      ${legend([["to-c-used", usedText], ["to-c-free", freeText], ["to-c-reserved", reservedText]])}
    </div>`);
  }
  if (ram) {
    const total = num(ram.total), avail = num(ram.available), pinned = num(ram.pinned);
    const budget = num(ram.budget);
    // What the pack holds, by what holds it (a model core loaded itself is in "other"), in the
    // order the bar draws them; none exceeds what is in use.
    const held = ram.held_by_pack ?? { tier_models: num(ram.used_by_models) };
    const inUse = Math.max(0, total - avail);
    let room = inUse;
    const owners = HELD.map(([key, cls]) => {
      const bytes = Math.min(num(held[key]), room);
      room -= bytes;
      return { key, cls, bytes };
    });
    const other = room;
    const pinnedText = tr("devices.pinnedSize", { size: b(pinned) });
    // Pinned RAM only speeds up copies to a GPU: without one nothing is pinned, and no bar says so.
    const cpu = isCpu(payload);
    const pinnedHead = cpu && pinned === 0 ? tr("devices.pinnedNoGpu")
      : budget > 0 ? tr("devices.pinnedOfBudget", { pinned: b(pinned), budget: b(budget) })
        : tr("devices.pinnedNoBudget", { pinned: b(pinned) });
    const ownerText = (o) => tr(`devices.held.${o.key}`, { size: b(o.bytes) });
    out.push(`<div class="to-dev" data-dev="pinned">
      <div class="to-dev-head"><b>${esc(tr("devices.pinned"))}</b>
        <span class="to-right">${esc(pinnedHead)}</span></div>
      ${cpu && pinned === 0 ? "" : bar([{ cls: "to-c-pinned", bytes: pinned, title: pinnedText }],
            budget > 0 ? budget : Math.max(pinned, 1), { cls: pinned > budget && budget > 0 ? "to-over" : "" })}
    </div>
    <div class="to-dev" data-dev="ram">
      <div class="to-dev-head"><b>${esc(tr("devices.ram"))}</b>
        <span class="to-right">${esc(tr("devices.availableOfTotal", { available: b(avail), total: b(total) }))}</span></div>
      ${bar([
        ...owners.map((o) => ({ cls: o.cls, bytes: o.bytes, title: ownerText(o) })),
        { cls: "to-c-other", bytes: other, title: tr("devices.otherTitle", { size: b(other) }) },
      ], total, budget > 0 ? { marker: { bytes: budget, title: tr("devices.ramBudgetMarker", { size: b(budget) }) } } : {})}
      ${legend([...owners.map((o) => o.bytes > 0 && [o.cls, ownerText(o)]),
                ["to-c-other", tr("devices.otherSize", { size: b(other) })],
                ["to-c-free", tr("devices.availableSize", { size: b(avail) })]])}
    </div>`);
  }
  return out.join("") || `<div class="to-muted">${esc(tr("panel.noDevices"))}</div>`;
}

// With disk streaming, where each block's bytes come from: the model's own file (read in place,
// or still to be checked at its first read), the spill file, or both (a block's phases apart).
function blockSources(lw) {
  const sources = lw.disk?.unit_sources;
  const out = [];
  if (!Array.isArray(sources) || !Array.isArray(lw.units)) return out;
  lw.units.forEach((u, i) => {
    const s = sources[i];
    if (!s) return;
    const b = num(u.block);
    out[b] = out[b] === undefined || out[b] === s ? s : "mixed";
  });
  return out;
}

function diskSourcesHtml(disk) {
  if (!disk?.active) return "";
  const files = Array.isArray(disk.model_files) ? disk.model_files : [];
  const parts = [];
  if (num(disk.file_units) > 0) {
    const file = String(files[0] ?? "").split(/[\\/]/).pop();
    parts.push(tr("layerwise.inPlace", { n: num(disk.file_units), size: fmtBytes(num(disk.file_bytes)), file }));
  }
  parts.push(num(disk.spill_units) > 0
    ? tr("layerwise.spilled", { n: num(disk.spill_units), size: fmtBytes(num(disk.spill_written_bytes)) })
    : tr("layerwise.noSpill"));
  return `<div class="to-muted" data-role="lw-disk" title="${esc(files.join(", "))}">${esc(parts.join(" · "))}</div>`;
}

// Where a block's weights are: on the device, in a device slot, in the host cache, on disk only,
// or packed in host RAM. A model core streams with Dynamic VRAM: where comfy-aimdo holds each
// block (read from its VBAR after the last run), or the node's plan where that cannot be read.
// `cpu`: the device is the CPU, whose buffers are RAM too: the words say resident or streamed,
// not on the device or in VRAM.
function stripHtml(lw, cpu, place = cpu ? "blocks.placeCpu" : "blocks.place", states = BLOCK_STATES,
                   sources = []) {
  const shownStates = Array.isArray(lw.block_states) && lw.block_states.length
    ? lw.block_states
    : Array.from({ length: num(lw.blocks) }, (_, i) =>
        (lw.resident_indices ?? []).includes(i) ? "resident" : "streamed");
  const known = new Set(states);
  const where = (s) => (known.has(s) ? tr(`${place}.${s}`) : String(s).replace("_", " "));
  const from = (i) => (sources[i] ? ` · ${tr(`blocks.source.${sources[i]}`)}` : "");
  const cells = shownStates.map((s, i) =>
    `<span class="to-blk to-blk-${esc(s)}" title="${esc(tr("blocks.cell", { index: i, place: where(s) }) + from(i))}"></span>`);
  const shown = new Set(shownStates);
  const legendKey = { "blocks.place": "blocks.legend", "blocks.placeCpu": "blocks.legendCpu" }[place] ?? place;
  return `<div class="to-strip" aria-label="${esc(tr("blocks.strip"))}">${cells.join("")}</div>
    ${legend(states.filter((s) => shown.has(s) || s === "resident" || s === "streamed")
      .map((s) => [`to-blk-${s}`, tr(`${legendKey}.${s}`)]), "strip-legend")}`;
}

// Every telemetry field is optional; older/newer engines name a few of them differently.
const pick = (t, ...keys) => keys.map((k) => t[k]).find((v) => typeof v === "number" && Number.isFinite(v)) ?? null;

// The last run's figures. `cpu`: the device is the CPU (its buffers are RAM). Compute waited is
// counted as the picture of a pass counts it (offload_core/device/telemetry.py compute_wait_s),
// and both say what share of their time it was.
function telemetryHtml(raw, cpu) {
  if (!raw) return `<div class="to-muted">${esc(tr("stats.noRun"))}</div>`;
  const seconds = pick(raw, "seconds");
  const copied = pick(raw, "bytes_copied");
  const wait = pick(raw, "wait_seconds", "compute_wait_s");
  const fallbacks = pick(raw, "fallbacks", "sync_fallbacks");
  const eff = typeof raw.overlap_efficiency === "number"
    ? (raw.overlap_efficiency <= 1 ? raw.overlap_efficiency * 100 : raw.overlap_efficiency) : null;
  // `sub`: a second, smaller line under the value (a share of the run).
  const stat = (name, v, cls = "", key = name, sub = "") =>
    `<div class="to-stat ${cls}" data-stat="${name}" title="${esc(tr(`stats.${key}Title`))}"><span>${esc(tr(`stats.${key}`))}</span><b>${esc(v)}</b>${
      sub ? `<small>${esc(sub)}</small>` : ""}</div>`;
  const secs = (s) => tr("stats.seconds", { value: s.toFixed(2) });
  const share = (s) => (seconds > 0 ? tr("stats.shareOfRun", { share: ((100 * s) / seconds).toFixed(0) }) : "");
  const rows = [];
  if (wait !== null) rows.push(stat("computeWaited", secs(wait), "", "computeWaited", share(wait)));
  const host = pick(raw, "host_wait_s");
  if (host !== null) rows.push(stat("engineOnHost", secs(host), "", "engineOnHost", share(host)));
  if (eff !== null) rows.push(stat("overlap", `${eff.toFixed(0)}%`));
  if (seconds !== null) rows.push(stat("run", secs(seconds)));
  if (copied !== null) {
    rows.push(stat("copied", `${fmtBytes(copied)}${typeof raw.copies === "number" ? ` · ${raw.copies}×` : ""}`,
      "", cpu ? "copiedCpu" : "copied"));
  }
  if (copied !== null && seconds > 0) rows.push(stat("copiedPerSecond", `${fmtBytes(copied / seconds)}/s`));
  if (typeof raw.peak_materialized_bytes === "number") {
    rows.push(stat("peak", fmtBytes(raw.peak_materialized_bytes), "", cpu ? "peakCpu" : "peak"));
  }
  if (num(fallbacks) > 0) rows.push(stat("fallbacks", String(fallbacks), "to-warn"));
  if (num(raw.order_misses) > 0) rows.push(stat("orderMisses", String(raw.order_misses), "to-warn"));
  if (num(raw.unused_copies) > 0) {
    rows.push(stat("unusedCopies", `${fmtBytes(pick(raw, "unused_copy_bytes") ?? 0)} · ${raw.unused_copies}×`));
  }
  // Disk streaming: how fast the disk delivered while reading, what the RAM cache saved, and
  // how long compute waited for a read. The read rate is GiB/s unless a fixed unit is chosen.
  if (typeof raw.disk_read_gibps === "number") {
    const rate = shownUnit === "auto" ? `${raw.disk_read_gibps.toFixed(2)} GiB` : fmtBytes(raw.disk_read_gibps * GIB);
    rows.push(stat("diskRead", `${rate}/s`));
  }
  if (typeof raw.cache_hit_rate === "number") rows.push(stat("cacheHits", `${(100 * raw.cache_hit_rate).toFixed(0)}%`));
  if (typeof raw.disk_wait_s === "number") rows.push(stat("diskWait", secs(raw.disk_wait_s)));
  if (num(raw.disk_read_errors) > 0) rows.push(stat("readErrors", String(raw.disk_read_errors), "to-warn"));
  return `<div class="to-stats">${rows.join("")}</div>`;
}

// Apply Layerwise Offload's auto mode on a Dynamic VRAM model: core streams, in the node's order.
// The order's message and the streaming note are the server's (English) words.
function dynamicOrderHtml(lw, showStrip) {
  const dv = lw.dynamic_vram;
  const fromVbar = dv.residency_source === "vbar";
  const kept = fromVbar ? (dv.core_resident_blocks ?? []).length : (lw.resident_indices ?? []).length;
  const streamed = fromVbar ? (dv.core_streamed_blocks ?? []).length : (lw.streamed_indices ?? []).length;
  let order;
  if (dv.order === "in force") {
    const again = num(dv.relayouts) > 0 ? ` ${tr("dynamic.relaidOut", { n: num(dv.relayouts) })}` : "";
    order = `<div class="to-muted" data-role="lw-order">${esc(tr("dynamic.inForce", { n: (lw.resident_indices ?? []).length }) + again)}</div>`;
  } else if (dv.order === "fixed by an earlier load") {
    order = `<div class="to-muted to-warn-text" data-role="lw-order">${esc(dv.message ?? tr("dynamic.fixedEarlier"))}</div>`;
  } else {
    const text = dv.order === "not loaded yet" ? tr("dynamic.notLoadedYet") : tr("dynamic.order", { order: dv.order });
    order = `<div class="to-muted" data-role="lw-order">${esc(text)}</div>`;
  }
  return `<div class="to-lw" data-role="layerwise" data-path="core">
    <div class="to-lw-head"><b>${esc(tr("dynamic.head"))}</b>
      <span class="to-muted" data-role="lw-summary">${esc(tr("dynamic.summary", { blocks: num(lw.blocks), kept, streamed }))}
      ${esc(tr(fromVbar ? "dynamic.afterRun" : "dynamic.planned"))}</span></div>
    ${order}
    ${planHtml(lw, fmtBytes)}
    ${showStrip ? stripHtml(lw, false, "blocks.corePlace", CORE_STATES) : ""}
    <div class="to-muted" data-role="lw-streaming">${esc(dv.streaming ?? "")}</div>
  </div>`;
}

function streamedPill(lw) {
  if (!lw) return "";
  return lw.dynamic_vram?.path === "core streams"
    ? `<span class="to-pill" title="${esc(tr("dynamic.pillTitle"))}">${esc(tr("dynamic.pill"))}</span>`
    : `<span class="to-pill">${esc(tr("layerwise.pill"))}</span>`;
}

// `open`: {card, offered}, the card's id and whether the full view of its picture can be opened;
// `cpu`: the device is the CPU.
function layerwiseHtml(lw, showStrip, open, cpu) {
  if (!lw) return "";
  if (lw.dynamic_vram?.path === "core streams") return dynamicOrderHtml(lw, showStrip);
  // Resident and streamed counts are in units: blocks, or phases of blocks.
  const parts = [
    tr(num(lw.blocks) === 1 ? "layerwise.blocksOne" : "layerwise.blocks", { n: num(lw.blocks) }) +
      (lw.granularity === "phase" ? ` ${tr("layerwise.asPhases", { n: num(lw.units?.length) })}` : ""),
    tr("layerwise.counts", { resident: lw.resident_indices?.length ?? 0, streamed: lw.streamed_indices?.length ?? 0 }),
    typeof lw.bound_bytes === "number" && tr(cpu ? "layerwise.boundCpu" : "layerwise.bound", { size: fmtBytes(lw.bound_bytes) }),
    lw.disk?.active && tr("layerwise.fromDisk", { size: fmtBytes(num(lw.disk.cache_bytes)) }),
  ].filter(Boolean);
  return `<div class="to-lw" data-role="layerwise">
    <div class="to-lw-head"><b>${esc(tr("layerwise.head"))}</b>
      <span class="to-muted" data-role="lw-summary">${esc(parts.join(" · "))}</span></div>
    ${lw.dynamic_vram?.cost ? `<div class="to-muted" data-role="lw-cost">${esc(tr("layerwise.cost", { cost: lw.dynamic_vram.cost }))}</div>` : ""}
    ${hostStoreHtml(lw.host_store)}
    ${diskSourcesHtml(lw.disk)}
    ${planHtml(lw, fmtBytes)}
    ${showStrip ? stripHtml(lw, cpu, undefined, undefined, blockSources(lw)) : ""}
    ${telemetryHtml(lw.telemetry, cpu)}
    ${compactTimelineHtml(lw, !!lw.telemetry && num(lw.streamed_indices?.length) > 0, open)}
  </div>`;
}

// Where a model's host copy lives: a store every process loading the same file maps (with how
// many others), or this process's own memory and why.
function hostStoreHtml(st) {
  if (!st) return "";
  if (!st.shared) return `<div class="to-muted" data-role="host-store">${esc(tr("hostStore.private", { why: st.why ?? "" }))}</div>`;
  const others = typeof st.users === "number" ? Math.max(0, st.users - 1) : null;
  const withText = others === null ? tr("hostStore.sharedUnknown") : others === 0 ? tr("hostStore.sharedAlone")
    : others === 1 ? tr("hostStore.sharedWithOne") : tr("hostStore.sharedWith", { n: others });
  const where = tr(st.kind === "disk" ? "hostStore.sharedDisk" : "hostStore.sharedMemory", { size: fmtBytes(num(st.bytes)) });
  return `<div class="to-muted" data-role="host-store" data-users="${esc(st.users ?? "")}" title="${esc(`${st.folder}/${st.file}`)}">${esc(`${where} · ${withText}`)}</div>`;
}

// Model-Level Swap's figures (its "swapped" pill stands with the card's other pills).
function swapHtml(sw) {
  if (!sw) return "";
  const master = sw.bytes && typeof sw.bytes.master === "number"
    ? ` · ${tr("swap.master", { size: fmtBytes(sw.bytes.master) })}` : "";
  const count = (n, one, many) => tr(n === 1 ? one : many, { n });
  const turns = count(num(sw.turns), "swap.turnsOne", "swap.turnsMany");
  const parks = count(num(sw.parks), "swap.parksOne", "swap.parksMany");
  const earlier = sw.held_from_earlier_prompt
    ? `<div class="to-muted" data-role="swap-earlier">${esc(tr("swap.heldFromEarlier"))}</div>` : "";
  return `<div class="to-meta" data-role="swap"><span>${esc(tr("swap.figures", { turns, parks }) + master)}</span></div>
    ${earlier}${hostStoreHtml(sw.host_store)}`;
}

const swapPill = (sw) => (sw ? `<span class="to-pill" data-role="swap-pill">${esc(tr("swap.pill"))}</span>` : "");

// `title`: the key of the button's title, where it is not the action's own.
function button(action, icon, { disabled = false, busy = false, title = null } = {}) {
  const label = tr(`actions.${action}.label`);
  return `<button class="to-btn" data-action="${action}" title="${esc(tr(title || `actions.${action}.title`))}" aria-label="${esc(label)}"${disabled ? " disabled" : ""}>
    <i class="pi ${busy ? "pi-spin pi-spinner" : icon}"></i><span class="to-label">${esc(label)}</span></button>`;
}

function nameHtml(primary, secondary) {
  const full = secondary ? `${primary} (${secondary})` : primary;
  return `<span class="to-name" title="${esc(full)}" data-role="name">${esc(primary)}</span>`;
}

// A model's kind in the user's words: the tier manager's (diffusion_model, checkpoint, clip, vae)
// or the card's (diffusion model, text encoder, VAE, model); an unknown kind as it came.
const KINDS = ["diffusion_model", "checkpoint", "clip", "text_encoder", "vae", "model"];
function kindText(kind) {
  const key = String(kind ?? "").toLowerCase().replace(/[^a-z0-9]+/g, "_");
  return KINDS.includes(key) ? tr(`kind.${key}`) : String(kind ?? "").replace("_", " ");
}

// A managed card's parts in core; a part's kind is said only where it is not the card's own
// (the card's kind line says that one).
function partsLine(parts, cardKind) {
  const own = kindText(cardKind);
  return parts.map((l) => [l.class, l.network && l.network !== l.class ? l.network : null,
    l.kind && kindText(l.kind) !== own ? kindText(l.kind) : null]
    .filter(Boolean).join(" · ")).join("; ");
}

// A tier-managed model's streaming report: its own, or that of its part in core.
const managedLayerwise = (m, parts) => m.layerwise ?? parts.find((l) => l.layerwise)?.layerwise;

// Every card with a picture or a finished layerwise run, as the full view picks from them: {id, name, lw}.
export function timelineCards(payload) {
  const managed = Array.isArray(payload?.models) ? payload.models : [];
  const loaded = Array.isArray(payload?.loaded) ? payload.loaded : [];
  return [
    ...managed.map((m) => ({ id: m.id, name: m.name ?? m.id, lw: managedLayerwise(m, loaded.filter((l) => l.tier_id === m.id)) })),
    ...loaded.filter((l) => !l.tier_id).map((l) => ({ id: l.id, name: l.file ?? l.class ?? l.id, lw: l.layerwise })),
  ].filter((c) => c.lw?.timeline || c.lw?.finished_at);
}

// A model the tier manager owns: tier, its parts in core, policy and tier actions.
function managedHtml(m, parts, ctx) {
  const { strips, pending, notice, cpu } = ctx;
  const bytes = m.bytes ?? {};
  const device = num(bytes.vram) + num(bytes.cpu);
  const p = placement(m.total_bytes || device + num(bytes.ram), device, num(bytes.ram) + num(bytes.pinned), cpu);
  const tier = TIER_LABEL[m.tier] ? m.tier : "disk";
  const busy = pending[m.id];
  const users = num(m.in_use);
  const pol = m.policy ?? {};
  const lw = managedLayerwise(m, parts);
  const sw = parts.find((l) => l.swap)?.swap;
  const pills = [
    `<span class="to-pill to-pill-tier" title="${esc(tr("card.tierManagedTitle"))}">${esc(tr("card.tierManaged"))}</span>`,
    streamedPill(lw),
    swapPill(sw),
    users > 0 ? `<span class="to-pill to-pill-busy" title="${esc(tr("card.inUseTitle", { n: users }))}">${esc(tr("card.inUse"))}${users > 1 ? ` ×${users}` : ""}</span>` : "",
  ].join("");
  const buttons = TIER_ACTIONS.map((a) => button(a.action, a.icon,
    { disabled: !!busy || a.off(m), busy: busy === a.action,
      title: (m.policy?.keep_in_ram && a.keptTitle) || (cpu && a.cpuTitle) }));
  const loads = { n: num(m.load_count), disk: num(m.loads_from_disk), ram: num(m.loads_from_ram),
    loaded: num(m.loads_already_loaded) };
  return `<div class="to-model" data-model-id="${esc(m.id)}" data-tier="${tier}" data-card="managed">
    <div class="to-model-head">
      ${badgeHtml(tier, cpu)}
      ${nameHtml(m.name ?? m.id, m.id)}
    </div>
    ${parts.length ? `<div class="to-muted to-sub" data-role="class">${esc(partsLine(parts, m.kind))}</div>` : ""}
    <div class="to-meta">${pills}</div>
    ${placementHtml(p, cpu)}
    <div class="to-meta">
      <span data-role="kind">${esc(kindText(m.kind))}</span>
      <span data-ts="${typeof m.last_used === "number" ? m.last_used : ""}" data-role="last-used">${esc(fmtAgo(m.last_used))}</span>
      <span title="${esc(tr("card.loadsTitle"))}">${esc(tr(loads.n === 1 ? "card.loadsOne" : "card.loadsMany", loads))}</span>
    </div>
    <div class="to-policy" data-role="policy">
      <label title="${esc(tr("card.keepInRamTitle"))}">
        <input type="checkbox" data-policy="keep_in_ram" data-key="keep-${esc(m.id)}"${pol.keep_in_ram ? " checked" : ""}${busy ? " disabled" : ""}> ${esc(tr("card.keepInRam"))}</label>
      <label title="${esc(tr("card.priorityTitle"))}">${esc(tr("card.priority"))}
        <input type="number" min="-100" max="100" step="1" value="${num(pol.priority)}" data-policy="priority" data-key="prio-${esc(m.id)}"${busy ? " disabled" : ""}></label>
    </div>
    ${layerwiseHtml(lw, strips, { card: m.id, offered: ctx.fullView }, cpu)}
    ${swapHtml(sw)}
    <div class="to-actions">${buttons.join("")}</div>
    ${notice?.model_id === m.id ? noticeHtml(notice) : ""}
  </div>`;
}

// A model that only ComfyUI manages: no tier manager, no streaming, no swap.
export function coreOnly(card) {
  return !!card.core && !card.tier_id && !card.layerwise && !card.swap;
}

// A model core loaded through any loader, or one the pack still holds after core let go of it.
// Every card offers Unload: core's own for a model core holds; for one core let go of, the pack
// lets go of what it holds (its pinned master or pack).
function coreHtml(l, ctx) {
  const { strips, pending, notice, cpu } = ctx;
  const title = l.file ?? l.class;  // without a file the class is the title, not said again below
  const sub = [l.file ? l.class : null, l.network && l.network !== l.class ? l.network : null, l.kind && kindText(l.kind)]
    .filter(Boolean).join(" · ");
  let figures;
  let tier;
  if (l.core && l.bytes) {
    const p = placement(l.bytes.total, l.bytes.device, l.bytes.ram, cpu);
    figures = placementHtml(p, cpu, l.bytes);
    tier = cpu ? "cpu" : num(l.bytes.device) > 0 ? "vram" : "ram";  // core loaded it on the compute device
  } else {
    figures = `<div class="to-muted">${esc(tr("card.notLoaded"))}</div>`;
    tier = "ram";
  }
  const busy = pending[l.id];
  const pills = [
    // Without a GPU the badge says CPU already: the pill does not say it again.
    l.core ? `<span class="to-pill" title="${esc(tr("card.coreTitle", { device: l.device }))}">${esc(cpu ? tr("card.coreHere") : tr("card.core", { device: l.device }))}</span>` : "",
    streamedPill(l.layerwise),
    swapPill(l.swap),
  ].join("");
  const unload = button("unload", "pi-eject", { disabled: !!busy, busy: !!busy, title: l.core ? null : "actions.unload.titleHeld" });
  return `<div class="to-model" data-loaded-id="${esc(l.id)}" data-tier="${tier}" data-card="core">
    <div class="to-model-head">
      ${badgeHtml(tier, cpu)}
      ${nameHtml(title, l.file ? l.class : null)}
    </div>
    <div class="to-muted to-sub" data-role="class">${esc(sub)}${l.file ? "" : ` · ${esc(tr("card.fileNotRecorded"))}`}</div>
    <div class="to-meta">${pills}</div>
    ${figures}
    ${layerwiseHtml(l.layerwise, strips, { card: l.id, offered: ctx.fullView }, cpu)}
    ${swapHtml(l.swap)}
    <div class="to-actions to-actions-1">${unload}</div>
    ${notice?.model_id === l.id ? noticeHtml(notice) : ""}
  </div>`;
}

function noticeHtml(n) {
  return `<div class="to-notice to-notice-${esc(n.kind)}" role="alert" data-role="notice">
    <i class="pi pi-exclamation-triangle"></i><span>${esc(n.text)}</span>
    <button class="to-icon-btn" data-role="dismiss" title="${esc(tr("panel.dismiss"))}"><i class="pi pi-times"></i></button></div>`;
}

// The budgets line; without a GPU (`cpu`) it leaves out the VRAM reserve, which has nothing to keep.
function budgetsHtml(bud, ram, editing, cpu) {
  const b = fmtBytes;
  const budget = typeof bud.ram_budget_bytes === "number" ? b(bud.ram_budget_bytes)
    : num(ram?.budget) > 0 ? tr("budgets.autoOf", { size: b(ram.budget) }) : tr("budgets.auto");
  const shown = [
    tr("budgets.shownBudget", { size: budget }),
    typeof bud.ram_reserve_bytes === "number" && tr("budgets.shownRamReserve", { size: b(bud.ram_reserve_bytes) }),
    !cpu && typeof bud.vram_reserve_bytes === "number" && tr("budgets.shownVramReserve", { size: b(bud.vram_reserve_bytes) }),
    typeof bud.disk_tier === "boolean" && tr(bud.disk_tier ? "budgets.diskOn" : "budgets.diskOff"),
  ].filter(Boolean);
  const head = `<div class="to-budgets" data-role="budgets"><span class="to-muted">${esc(shown.join(" · "))}</span>
    ${editing ? "" : `<button class="to-icon-btn" data-role="edit-budgets" title="${esc(tr("budgets.edit"))}"><i class="pi pi-pencil"></i></button>`}</div>`;
  return head + (editing ? `<div data-role="budget-editor-slot"></div>` : "");
}

function budgetEditor(bud, err, cpu) {
  const rows = BUDGET_FIELDS.filter((f) => !(cpu && f.gpu)).map((f) => `<label title="${esc(tr(`budgets.${f.label}Title`))}"><span>${esc(tr(`budgets.${f.label}`))}</span>
      <input type="number" min="0" step="0.25" name="${f.key}" value="${esc(gib(bud[f.bytes]))}"
        placeholder="${esc(f.empty ? tr("budgets.auto") : "")}"><span class="to-muted">GiB</span></label>`);
  rows.push(`<label title="${esc(tr("budgets.diskTierTitle"))}"><span>${esc(tr("budgets.diskTier"))}</span>
      <input type="checkbox" name="disk_tier"${bud.disk_tier !== false ? " checked" : ""}><span></span></label>`);
  return `<form class="to-budget-form" data-role="budget-form" novalidate>${rows.join("")}
    <div class="to-form-err" data-role="budget-error">${esc(err ?? "")}</div>
    <div class="to-actions to-actions-2">
      <button class="to-btn" type="submit" data-role="save-budgets"><i class="pi pi-check"></i><span class="to-label">${esc(tr("budgets.save"))}</span></button>
      <button class="to-btn" type="button" data-role="cancel-budgets"><i class="pi pi-times"></i><span class="to-label">${esc(tr("budgets.cancel"))}</span></button>
    </div></form>`;
}

// The body of a budgets POST from the form, or an error text. A field the form leaves out (the
// VRAM reserve without a GPU) keeps its value.
export function budgetBody(form) {
  const body = {};
  for (const f of BUDGET_FIELDS) {
    if (!form.elements[f.key]) continue;
    const raw = form.elements[f.key].value.trim();
    if (raw === "" && f.empty) { body[f.key] = null; continue; }
    const v = Number(raw);
    if (raw === "" || !Number.isFinite(v) || v < 0) return { error: tr("budgets.notGib", { field: tr(`budgets.${f.label}`) }) };
    body[f.key] = v;
  }
  body.disk_tier = form.elements.disk_tier.checked;
  return { body };
}

export class Panel extends View {
  constructor({ state, settings, onAction, onUnload, onPolicy, onBudgets, onRefresh, onDismiss, onOpenTimeline }) {
    super("tiered-offload-panel", "to-panel");
    Object.assign(this, { state, settings, onAction, onUnload, onPolicy, onBudgets, onRefresh, onDismiss, onOpenTimeline });
    this.clock = 0;
    this.editor = null;   // the budgets form while it is open: kept across renders
  }

  setUp(root) {
    root.addEventListener("click", (e) => this.onClick(e));
    root.addEventListener("change", (e) => this.onChange(e));
    // A priority is sent when the input loses focus or on Enter. Not on "change": the input may
    // be moved into new markup (and focused again) while the user types, which resets what
    // "change" compares against.
    root.addEventListener("focusout", (e) => this.commitPriority(e.target));
    root.addEventListener("keydown", (e) => e.key === "Enter" && this.commitPriority(e.target));
    root.addEventListener("submit", (e) => { e.preventDefault(); this.submitBudgets(e.target); });
    // Relative "last used" times age; refresh only that text, only while open.
    this.clock = setInterval(() => this.isOpen() && this.tick(), 30000);
  }

  tearDown() {
    clearInterval(this.clock);
    this.editor = null;
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
    else if (role === "open-timeline") this.onOpenTimeline?.(btn.dataset.timelineCard);
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
      input.setCustomValidity(tr("card.priorityInvalid"));
    } else if (v !== known) {
      input.setCustomValidity("");
      this.onPolicy(id, { priority: v });
    }
  }

  openEditor() {
    const bud = this.state.payload?.budgets ?? {};
    const holder = document.createElement("div");
    holder.innerHTML = budgetEditor(bud, null, isCpu(this.state.payload));
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
    const { strips, units, showCore, fullView } = this.settings();
    shownUnit = units;
    const p = state.payload;
    const head = `<div class="to-head">
        <span class="to-title"><i class="pi pi-server"></i> ${esc(tr("panel.title"))}</span>
        <button class="to-icon-btn" data-role="refresh" title="${esc(tr("panel.refresh"))}"><i class="pi pi-refresh"></i></button>
      </div>`;
    const managed = Array.isArray(p?.models) ? p.models : [];
    const loaded = Array.isArray(p?.loaded) ? p.loaded : [];
    const others = loaded.filter((l) => !l.tier_id);
    const shown = showCore ? others : others.filter((l) => !coreOnly(l));
    const hidden = others.length - shown.length;
    // A refusal shows in the card it concerns; anything else (or a vanished card) at the top.
    const cardIds = new Set([...managed.map((m) => m.id), ...loaded.map((l) => l.id)]);
    const notice = state.notice && !cardIds.has(state.notice.model_id) ? noticeHtml(state.notice) : "";
    let body;
    if (state.status === "unavailable" || (state.status === "error" && !p)) {
      body = `<div class="to-empty" data-role="status">${esc(state.error)}</div>`;
    } else if (!p) {
      body = `<div class="to-empty" data-role="status">${esc(tr("panel.loading"))}</div>`;
    } else {
      const cpu = isCpu(p);
      const ctx = { strips, pending: state.pending, notice: state.notice, cpu, fullView: !!fullView };
      const cards = [
        ...managed.map((m) => managedHtml(m, loaded.filter((l) => l.tier_id === m.id), ctx)),
        ...shown.map((l) => coreHtml(l, ctx)),
      ];
      const hiddenNote = hidden > 0
        ? `<div class="to-muted" data-role="hidden-core">${esc(tr("panel.hiddenCore", { n: hidden }))}</div>` : "";
      body = `
        ${state.status === "error" ? `<div class="to-notice to-notice-error">${esc(state.error)}</div>` : ""}
        <section class="to-devices">${devicesHtml(p)}${budgetsHtml(p.budgets ?? {}, p.devices?.ram, !!this.editor, cpu)}</section>
        <div class="to-section-head"><b>${esc(tr("panel.models"))}</b><span class="to-muted" data-role="count">${cards.length}</span></div>
        ${hiddenNote}
        <section class="to-models">${cards.length ? cards.join("")
          : hidden ? "" : `<div class="to-empty">${esc(tr("panel.empty"))}</div>`}</section>`;
    }
    const active = this.root.contains(document.activeElement) ? document.activeElement : null;
    this.rendering = true;  // removing a focused input is no commit
    this.root.innerHTML = head + notice + body;
    fitPicture(this.root);
    const slot = this.root.querySelector('[data-role="budget-editor-slot"]');
    if (slot && this.editor) slot.replaceWith(this.editor);
    if (active?.dataset?.key) {
      this.root.querySelector(`[data-key="${CSS.escape(active.dataset.key)}"]`)?.replaceWith(active);
    }
    if (active?.isConnected) active.focus({ preventScroll: true });
    this.rendering = false;
  }
}
