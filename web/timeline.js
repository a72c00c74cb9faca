// The last run's picture (offload_core/device/timeline.py): one pass of the streamed units on a
// time axis in ms from the pass start. In each unit's row its disk read (a thin band on top), its
// copy (upper band), the time compute waited for it (full height, highlighted) and its compute
// (lower band). The verdict is the engine's.
//
// Resident units are not streamed, so the engine times none of them; they still run in the pass,
// between their streamed neighbours. A row of their own says so (hatched, over the time between
// the neighbour before and the one after), where the picture would otherwise show a gap nothing
// explains.
//
// Two sizes. In the sidebar (about 300 px) a compact picture: the rows share a fixed height, one
// label per block where it fits, and a button that opens the full view. The full view lives in
// the frontend's bottom panel, full width: one labelled row per unit, the verdict and the figures
// beside it. Both mark the pass start (0 ms) and shade the units fetched ahead: the prefetch
// wraps around, so the first units of a pass are read and copied while the previous pass still
// computes, and their spans start before 0. The words say so; a bare negative axis does not.
//
// Drawn as HTML (rows and spans placed in %, labels in px), not a scaled SVG: labels keep their
// size at any width, and a label's box is what the user reads. What depends on the drawn width
// (the label column, which tick numbers fit, which marks' names fit) is settled after drawing,
// by `fitPicture`.

import { tr } from "./i18n.js";
import { esc, legend, num } from "./html.js";
import { View } from "./view.js";

// The bottom panel tab's id; the frontend makes "Workspace.ToggleBottomPanelTab.<id>" of it.
export const TIMELINE_TAB = "tiered-offload-timeline";

const KINDS = ["disk", "copy", "wait", "compute"];
const LABEL_H = 11;  // px of one label line (panel.css .to-tl-label)
const TICK_GAP = 8;  // px at least between two tick numbers
// compact: the rows share `height` px, each between minRow and maxRow px; full: fixed rows.
// ticks: about how many at most (fewer where their numbers would touch); edge: how near an end
// (in % of the plot) a tick's number ends there.
// label: the compact view's label column at the least (px), where the fetch-ahead's name may
// reach into it (panel.css --to-tl-label).
const COMPACT = { height: 180, minRow: 3, maxRow: 12, ticks: 5, edge: 10, label: 48 };
const FULL = { row: 16, ticks: 10, edge: 4 };

export const ms = (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2));
const msText = (v) => tr("timeline.msValue", { value: ms(v) });
const pctText = (part, whole) => (whole > 0 ? ((100 * part) / whole).toFixed(0) : "0");

const hasPicture = (tl) => !!tl && Array.isArray(tl.units) && Array.isArray(tl.spans);

// Block numbers as one word: "3", or "3–4" for a run of blocks.
const blockRange = (blocks) => (blocks.length > 1 ? `${blocks[0]}–${blocks.at(-1)}` : String(blocks[0]));

// The rows as drawn, top to bottom: each streamed unit in the order it computed ({unit, block,
// name}), and between them each run of resident units ({resident: [unit...], blocks, start,
// end}: the time between the streamed neighbour before and the one after, null where the pass
// has no neighbour on that side).
function rowsOf(tl, lw, spans) {
  const streamed = tl.units;
  const residentUnits = new Set(Array.isArray(lw?.resident_indices) ? lw.resident_indices : []);
  const describe = Array.isArray(lw?.units) ? lw.units : [];
  const computeEnd = new Map(), waitStart = new Map();
  for (const s of spans) {
    if (s.kind === "compute") computeEnd.set(s.unit, Math.max(computeEnd.get(s.unit) ?? -Infinity, s.end_ms));
    if (s.kind === "wait") waitStart.set(s.unit, Math.min(waitStart.get(s.unit) ?? Infinity, s.start_ms));
  }
  const residentRow = (lo, hi, before, after) => {
    const units = [...residentUnits].filter((u) => u > lo && u < hi).sort((a, b) => a - b);
    if (!units.length) return [];
    const blocks = [...new Set(units.map((u) => describe[u]?.block ?? u))];
    return [{ resident: units, blocks, key: `r${units[0]}`,
              start: before === null ? null : computeEnd.get(before) ?? null,
              end: after === null ? null : waitStart.get(after) ?? null }];
  };
  const rows = [];
  const inOrder = streamed.every((u, i) => i === 0 || streamed[i - 1].unit < u.unit);
  streamed.forEach((u, i) => {
    // Resident units run between streamed units that run in index order; a pass in another
    // order (a model that skips or repeats blocks) gets no resident rows.
    if (inOrder) rows.push(...residentRow(i ? streamed[i - 1].unit : -Infinity, u.unit, i ? streamed[i - 1].unit : null, u.unit));
    rows.push({ ...u, key: `u${u.unit}` });
  });
  if (inOrder && streamed.length) rows.push(...residentRow(streamed.at(-1).unit, Infinity, streamed.at(-1).unit, null));
  return rows;
}

// The share of the width the fetch-ahead (left of 0) may take at most: the pass is what the
// picture is about; a longer fetch-ahead is drawn compressed, its times still on hover.
const LEAD_SHARE = 15;

// The pass as drawn: the spans with known kinds and times; the axis from the earliest start (a
// unit fetched ahead starts before 0) to the pass end; `pct(t)`, where t lies on it in %: to
// scale, but for a fetch-ahead longer than LEAD_SHARE of it, which is squeezed into that share.
// `lw`: the model's layerwise report (its resident units and its prefetch), where known.
function figure(tl, lw) {
  const spans = tl.spans.filter((s) => KINDS.includes(s.kind) && Number.isFinite(s.start_ms) && Number.isFinite(s.end_ms));
  const t0 = Math.min(0, ...spans.map((s) => s.start_ms));
  const t1 = Math.max(num(tl.pass_ms), ...spans.map((s) => s.end_ms));
  const natural = t1 > t0 ? (100 * -t0) / (t1 - t0) : 0;
  const lead = Math.min(natural, LEAD_SHARE);
  const pct = (t) => {
    if (t1 <= t0) return 0;
    if (t < 0) return t0 < 0 ? (lead * (t - t0)) / -t0 : 0;
    return t1 > 0 ? lead + ((100 - lead) * t) / t1 : lead;
  };
  const ahead = new Set(spans.filter((s) => s.start_ms < 0).map((s) => s.unit));
  const phase = tl.units.some((u) => u.name && u.name !== "block");
  const prefetch = typeof lw?.settings?.prefetch === "number" ? lw.settings.prefetch : null;
  return { spans, t0, t1, pct, ahead, phase, prefetch, zero: pct(0), squeezed: natural > LEAD_SHARE,
           rows: rowsOf(tl, lw, spans),
           disk: spans.some((s) => s.kind === "disk") };
}

const unitName = (u, phase) =>
  (phase ? tr("timeline.rowPhase", { block: u.block, name: u.name }) : tr("timeline.row", { block: u.block }));

// A row's label: the full view names each unit (and says which rows are resident); the compact
// view names blocks.
function rowName(row, fig, full) {
  if (row.resident) {
    const blocks = blockRange(row.blocks);
    return full ? tr(row.blocks.length > 1 ? "timeline.residentRows" : "timeline.residentRow", { blocks })
      : tr(row.blocks.length > 1 ? "timeline.rows" : "timeline.row", { block: blocks, blocks });
  }
  return full ? unitName(row, fig.phase) : tr("timeline.row", { block: row.block });
}

// Where each kind sits in a row of `rowH` px (the last px is the gap to the next row): [top,
// bottom] in px. Rows too thin for three bands draw the disk read and the copy in the upper half
// (a unit's read ends before its copy starts).
function bands(rowH) {
  const u = rowH - 1;
  if (u >= 6) {
    const d = Math.max(1, Math.round(u * 0.2)), c = Math.round(u * 0.55);
    return { disk: [0, d], copy: [d, c], compute: [c, u], wait: [0, u] };
  }
  const h = Math.floor(u / 2);
  return { disk: [0, h], copy: [0, h], compute: [h, u], wait: [0, u] };
}

// Ticks at a round step (1, 2 or 5 times a power of ten) giving at most about `target` of them;
// 0 is always one of them (the axis spans it).
function ticks(t0, t1, target) {
  if (!(t1 > t0)) return [0];
  const raw = (t1 - t0) / target;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const digits = Math.max(0, -Math.floor(Math.log10(step)));
  const out = [];
  for (let k = Math.ceil(t0 / step); k * step <= t1 + step * 1e-9; k++) out.push(Number((k * step).toFixed(digits)));
  return out;
}

function spanHtml(s, fig, band) {
  const [top, bottom] = band[s.kind];
  const left = fig.pct(s.start_ms);
  const title = tr("timeline.span", { kind: tr(`timeline.kind.${s.kind}`), start: ms(s.start_ms), end: ms(s.end_ms) });
  // A mark drawn wider than its time (panel.css: --to-tl-min) ends at the plot's right edge at
  // the latest, so the last units' marks stay in view.
  return `<span class="to-tl-span to-tl-${s.kind}" data-kind="${s.kind}" title="${esc(title)}"
    style="left:min(${left.toFixed(2)}%, 100% - var(--to-tl-min));width:${(fig.pct(s.end_ms) - left).toFixed(2)}%;top:${top}px;height:${bottom - top}px"></span>`;
}

function rowsHtml(fig, rowH, full) {
  const band = bands(rowH);
  let parity = 0;
  return fig.rows.map((row, i) => {
    const block = row.resident ? row.blocks[0] : row.block;
    const before = i > 0 ? fig.rows[i - 1] : null;
    if (before && (before.resident ? before.blocks.at(-1) : before.block) !== block) parity ^= 1;
    const style = `top:${i * rowH}px;height:${rowH - 1}px`;
    const odd = parity ? " to-tl-odd" : "";
    if (row.resident) {
      const blocks = blockRange(row.blocks);
      const timed = row.start !== null && row.end !== null && row.end > row.start;
      const title = timed ? tr("timeline.residentSpan", { blocks, start: ms(row.start), end: ms(row.end) })
        : tr("timeline.residentUntimed", { blocks });
      const span = timed ? `<span class="to-tl-span to-tl-resident" data-kind="resident" title="${esc(title)}"
        style="left:${fig.pct(row.start).toFixed(2)}%;width:${(fig.pct(row.end) - fig.pct(row.start)).toFixed(2)}%;top:0;height:${rowH - 1}px"></span>` : "";
      return `<div class="to-tl-row to-tl-row-resident${odd}" data-role="tl-resident" data-units="${esc(row.resident.join(" "))}"
        title="${esc(title)}" style="${style}">${span}</div>`;
    }
    // Waits first: the unit's own bars draw over its highlighted wait.
    const bars = fig.spans.filter((s) => s.unit === row.unit)
      .sort((a, b) => (a.kind === "wait" ? 0 : 1) - (b.kind === "wait" ? 0 : 1)).map((s) => spanHtml(s, fig, band));
    return `<div class="to-tl-row${odd}" data-role="tl-row" data-unit="${esc(row.unit)}" data-block="${esc(row.block)}"
      title="${esc(rowName(row, fig, full))}" style="${style}">${bars.join("")}</div>`;
  });
}

// The full view: a label per row, centred on it.
function rowLabels(fig, rowH) {
  return fig.rows.map((row, i) => {
    const name = rowName(row, fig, true);
    const who = row.resident ? `data-resident="${esc(row.resident.join(" "))}"` : `data-unit="${esc(row.unit)}"`;
    return `<span class="to-tl-label${row.resident ? " to-tl-label-resident" : ""}" data-role="tl-label" ${who} title="${esc(name)}"
      style="top:${(i * rowH + (rowH - 1 - LABEL_H) / 2).toFixed(1)}px">${esc(name)}</span>`;
  });
}

// The compact picture: one label per block (or run of resident blocks), centred on its rows,
// where it clears the one above (half a pixel of a line's leading may be shared).
function blockLabels(fig, rowH) {
  const { rows } = fig;
  const height = rows.length * rowH;
  const group = (row) => (row.resident ? row.key : `b${row.block}`);
  const out = [];
  let clear = -Infinity;
  for (let i = 0; i < rows.length;) {
    let j = i;
    while (j < rows.length && group(rows[j]) === group(rows[i])) j++;
    const top = Math.max(0, Math.min(height - LABEL_H, i * rowH + ((j - i) * rowH - 1 - LABEL_H) / 2));
    if (top >= clear - 0.5) {
      const name = rowName(rows[i], fig, false);
      const block = rows[i].resident ? rows[i].blocks[0] : rows[i].block;
      out.push(`<span class="to-tl-label${rows[i].resident ? " to-tl-label-resident" : ""}" data-role="tl-label" data-block="${esc(block)}" title="${esc(name)}"
        style="top:${top.toFixed(1)}px">${esc(name)}</span>`);
      clear = top + LABEL_H;
    }
    i = j;
  }
  return out;
}

// The chart: marks above (the fetch-ahead and the pass start, named), the labels and rows, the
// axis below. `full`: one labelled row per unit at a fixed height, more ticks.
function chartHtml(fig, full) {
  const n = fig.rows.length;
  const rowH = full ? FULL.row
    : Math.max(COMPACT.minRow, Math.min(COMPACT.maxRow, Math.floor(COMPACT.height / Math.max(1, n))));
  const zero = fig.zero.toFixed(2);
  const ahead = fig.t0 < 0;
  // The fetch-ahead's name ends at the pass start's line and may reach into the labels' column
  // (empty above the rows); the pass start's name starts at the line. Where 0 lies past the
  // middle, the pass start's name ends at the line instead and the note names the fetch-ahead.
  const startRight = fig.zero > 55;
  const marks = [
    ahead && !startRight ? `<span class="to-tl-ahead-mark" data-role="tl-ahead-mark"
      style="right:${(100 - fig.zero).toFixed(2)}%;max-width:calc(${zero}% + var(--to-tl-label) + var(--to-tl-gap))">${esc(tr("timeline.ahead"))}</span>` : "",
    `<span class="to-tl-start-mark${startRight ? " to-tl-start-mark-end" : ""}" data-role="tl-start-mark"
      style="${startRight ? `right:${(100 - fig.zero).toFixed(2)}%;max-width:${zero}%` : `left:${zero}%;max-width:${(100 - fig.zero).toFixed(2)}%`}">${esc(tr("timeline.passStart"))}</span>`,
  ];
  // A squeezed fetch-ahead has no scale to mark: the ticks start at the pass.
  const axis = ticks(fig.squeezed ? 0 : fig.t0, fig.t1, full ? FULL.ticks : COMPACT.ticks);
  const grid = axis.filter((t) => t !== 0).map((t) => `<i class="to-tl-grid" data-t="${t}" style="left:${fig.pct(t).toFixed(2)}%"></i>`);
  // A tick's number is centred on it, except near an end, where half of it would stick out.
  const edge = full ? FULL.edge : COMPACT.edge;
  const tickLabels = axis.map((t) => {
    const p = fig.pct(t);
    const at = p < edge ? `left:${p.toFixed(2)}%` : p > 100 - edge ? `right:${(100 - p).toFixed(2)}%`
      : `left:${p.toFixed(2)}%;transform:translateX(-50%)`;
    return `<span class="to-tl-tick${t === 0 ? " to-tl-tick-zero" : ""}" data-role="tl-tick" data-t="${t}" style="${at}">${esc(String(t))}</span>`;
  });
  return `<div class="to-tl-chart${full ? " to-tl-chart-full" : ""}" data-role="tl-chart" role="img" aria-label="${esc(tr("timeline.figure"))}">
    <div class="to-tl-strip to-tl-strip-top"><div class="to-tl-marks" data-role="tl-marks">${marks.join("")}</div></div>
    <div class="to-tl-body" style="height:${n * rowH}px">
      <div class="to-tl-labels">${(full ? rowLabels(fig, rowH) : blockLabels(fig, rowH)).join("")}</div>
      <div class="to-tl-plot">
        ${grid.join("")}
        ${ahead ? `<div class="to-tl-ahead" data-role="tl-ahead" style="width:${zero}%" title="${esc(aheadNote(fig))}"></div>` : ""}
        <div class="to-tl-start" data-role="tl-start" style="left:${zero}%"></div>
        ${rowsHtml(fig, rowH, full).join("")}
      </div>
    </div>
    <div class="to-tl-strip to-tl-strip-bottom"><div class="to-tl-axis" data-role="tl-axis">${tickLabels.join("")}</div>
      <div class="to-muted to-tl-axis-name">${esc(tr("timeline.axis"))}</div></div>
  </div>`;
}

function verdictHtml(tl) {
  const bound = ["link", "copies", "disk", "compute", "compute_between_copies"].includes(tl.bound_by) ? tl.bound_by : null;
  return bound ? `<div class="to-tl-verdict to-tl-bound-${bound}" data-role="tl-verdict" data-bound="${bound}">${
    esc(tr("timeline.boundBy", { what: tr(`timeline.bound.${bound}`) }))}</div>` : "";
}

const legendHtml = (fig) => legend([
  ...KINDS.filter((k) => fig.spans.some((s) => s.kind === k)).map((k) => [`to-tl-${k}`, tr(`timeline.kind.${k}`)]),
  fig.rows.some((r) => r.resident) && ["to-tl-resident", tr("timeline.kind.resident")],
], "tl-legend");

// How many units were fetched ahead and why that many: the window holds the unit compute asks
// for next and `prefetch` more, so a pass starts with prefetch + 1 units fetched.
function aheadNote(fig) {
  const units = fig.ahead.size;
  const squeezed = fig.squeezed ? ` ${tr("timeline.aheadSqueezed", { ms: ms(-fig.t0) })}` : "";
  if (fig.prefetch !== null && units === fig.prefetch + 1) {
    return tr("timeline.aheadNotePrefetch", { units, prefetch: fig.prefetch }) + squeezed;
  }
  return tr(units === 1 ? "timeline.aheadNoteOne" : "timeline.aheadNote", { units }) + squeezed;
}

// The time compute waited in the pass (for copies and for the disk, counted as the card's
// "compute waited" counts the run), and its share of the pass.
function waited(tl) {
  const totals = tl.totals ?? {};
  const link = num(totals.link_wait_ms), disk = num(totals.disk_wait_ms);
  return { link, disk, all: link + disk, share: pctText(link + disk, num(tl.pass_ms)) };
}

// The sidebar's picture, under a layerwise card's figures. `lw`: the model's layerwise report,
// whose `timeline` it draws; `open`: {card, offered} where the full view can be opened for that
// card; `hasRun`: a run streamed something, so a missing picture is worth a word.
export function compactTimelineHtml(lw, hasRun, open) {
  const tl = lw?.timeline;
  if (!hasPicture(tl)) {
    return hasRun ? `<div class="to-muted" data-role="tl-none">${esc(tr("timeline.notRecorded"))}</div>` : "";
  }
  const fig = figure(tl, lw);
  const w = waited(tl);
  const totals = [
    tr("timeline.totalsCompute", { compute: ms(num(tl.totals?.compute_ms)) }),
    tr("timeline.totalsWaited", { waited: ms(w.all), share: w.share }),
    fig.disk && tr("timeline.totalsForDisk", { disk: ms(w.disk) }),
  ].filter(Boolean).join(" · ");
  return `<div class="to-tl" data-role="timeline">
    <div class="to-lw-head"><b>${esc(tr("timeline.head"))}</b>
      <span class="to-muted">${esc(tr(tl.units.length === 1 ? "timeline.summaryOne" : "timeline.summary", { units: tl.units.length, ms: ms(num(tl.pass_ms)) }))}</span></div>
    ${verdictHtml(tl)}
    ${chartHtml(fig, false)}
    ${fig.t0 < 0 ? `<div class="to-muted to-tl-note" data-role="tl-ahead-note">${esc(aheadNote(fig))}</div>` : ""}
    ${legendHtml(fig)}
    <div class="to-muted" data-role="tl-totals">${esc(totals)}</div>
    ${open?.offered ? `<div class="to-actions to-actions-1"><button class="to-btn" data-role="open-timeline" data-timeline-card="${esc(open.card)}"
      title="${esc(tr("timeline.openFullTitle"))}"><i class="pi pi-window-maximize"></i><span class="to-label">${esc(tr("timeline.openFull"))}</span></button></div>` : ""}
  </div>`;
}

// After a picture is drawn into `root` and laid out, what depends on its drawn width: the label
// column takes its longest label's width (the full view's names are long; the sidebar's keeps
// its width at the least, for the fetch-ahead's name above it);
// a mark whose name does not fit where it stands (a narrow fetch-ahead, typical of a long pass)
// is left out, as the notes say the same in words; tick numbers that would touch are thinned to
// every 2nd, 5th or 10th (0 stays).
export function fitPicture(root) {
  for (const chart of root.querySelectorAll('[data-role="tl-chart"]')) {
    fitLabelColumn(chart);
    for (const mark of chart.querySelectorAll('[data-role="tl-marks"] > *')) {
      if (mark.scrollWidth > mark.clientWidth) mark.remove();  // cut by as little as a pixel: its ellipsis shows
    }
    fitTicks(chart);
  }
}

function fitLabelColumn(chart) {
  const labels = [...chart.querySelectorAll('[data-role="tl-label"]')];
  if (!labels.length) return;
  const range = document.createRange();
  const widest = Math.max(...labels.map((label) => { range.selectNodeContents(label); return range.getBoundingClientRect().width; }));
  const room = chart.getBoundingClientRect().width * 0.4;  // the plot keeps most of the width
  const least = chart.classList.contains("to-tl-chart-full") ? 0 : COMPACT.label;
  chart.style.setProperty("--to-tl-label", `${Math.ceil(Math.max(least, Math.min(widest + 2, room)))}px`);
}

function fitTicks(chart) {
  const all = [...chart.querySelectorAll('[data-role="tl-tick"]')];
  const zero = all.findIndex((t) => t.dataset.t === "0");
  const crowded = (kept) => {
    const boxes = kept.map((t) => t.getBoundingClientRect()).sort((a, b) => a.left - b.left);
    return boxes.some((b, i) => i > 0 && boxes[i - 1].right + TICK_GAP > b.left);
  };
  let kept = all;
  for (const every of [2, 5, 10]) {
    if (!crowded(kept)) break;
    kept = all.filter((_, i) => (i - zero) % every === 0);
  }
  const shown = new Set(kept.map((t) => t.dataset.t));
  for (const t of all) if (!shown.has(t.dataset.t)) t.remove();
  for (const line of chart.querySelectorAll(".to-tl-grid")) if (!shown.has(line.dataset.t)) line.remove();
}

// The figures beside the full picture: [key, value] with a tooltip each.
function figuresHtml(tl, fig) {
  const totals = tl.totals ?? {};
  const w = waited(tl);
  const copied = fig.spans.filter((s) => s.kind === "copy").reduce((n, s) => n + num(s.bytes), 0);
  const busy = num(totals.copy_busy_ms);
  const rows = [
    ["pass", msText(num(tl.pass_ms))],
    ["units", String(tl.units.length)],
    ["compute", msText(num(totals.compute_ms))],
    ["waited", tr("timeline.shareOfPass", { value: msText(w.all), share: w.share })],
    fig.disk && ["forDisk", msText(w.disk)],
    ["copyBusy", msText(busy)],
    copied > 0 && busy > 0 && ["linkRate", tr("timeline.rate", { size: fmtRate(copied / (busy / 1000)) })],
    fig.disk && ["diskBusy", msText(num(totals.disk_busy_ms))],
    fig.t0 < 0 && ["ahead", tr(fig.prefetch !== null && fig.ahead.size === fig.prefetch + 1 ? "timeline.aheadFigurePrefetch"
      : fig.ahead.size === 1 ? "timeline.aheadFigureOne" : "timeline.aheadFigure", { units: fig.ahead.size, prefetch: fig.prefetch, ms: ms(-fig.t0) })],
  ].filter(Boolean);
  return `<div class="to-tl-figs" data-role="tl-figures">${rows.map(([key, value]) =>
    `<div class="to-tl-fig${key === "ahead" ? " to-tl-fig-wide" : ""}" data-figure="${key}" title="${esc(tr(`timeline.figures.${key}Title`))}">
      <span>${esc(tr(`timeline.figures.${key}`))}</span><b>${esc(value)}</b></div>`).join("")}</div>`;
}

// Bytes per second in the binary unit that fits (the panel's units setting is for sizes).
function fmtRate(perSecond) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = perSecond, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v >= 100 || i === 0 ? 0 : v >= 10 ? 1 : 2)} ${units[i]}`;
}

// The bottom panel's view: `card` {id, name, lw} whose picture it shows, or null.
export function fullTimelineHtml(card) {
  const tl = card?.lw?.timeline;
  if (!hasPicture(tl)) {
    // A run that kept every block in VRAM copies nothing: there is no picture to keep the panel open for.
    const allResident = !!card?.lw?.finished_at && Array.isArray(card.lw.streamed_indices)
      && card.lw.streamed_indices.length === 0;
    return `<div class="to-head"><span class="to-title">${esc(tr("timeline.head"))}</span></div>
      <div class="to-empty" data-role="tl-none">${esc(tr(allResident ? "timeline.nothingStreamed" : "timeline.noPicture"))}</div>`;
  }
  const fig = figure(tl, card.lw);
  // The chart takes the panel's height; its title, the verdict and the figures stand beside it.
  return `<div class="to-tl-full" data-role="timeline" data-timeline-card="${esc(card.id)}">
      <div class="to-tl-main">${chartHtml(fig, true)}</div>
      <aside class="to-tl-aside" data-role="tl-aside">
        <div class="to-tl-title"><b>${esc(tr("timeline.head"))}</b>
          <span class="to-muted to-ellipsis" data-role="tl-model" title="${esc(card.name)}">${esc(card.name)}</span></div>
        ${verdictHtml(tl)}
        ${figuresHtml(tl, fig)}
        ${legendHtml(fig)}
        <p class="to-tl-explain" data-role="tl-start-note"><b>${esc(tr("timeline.passStart"))}</b> ${esc(tr("timeline.startExplain"))}</p>
        ${fig.t0 < 0 ? `<p class="to-tl-explain" data-role="tl-ahead-note"><b>${esc(tr("timeline.ahead"))}</b> ${esc(tr("timeline.aheadExplain"))}</p>` : ""}
        ${fig.rows.some((r) => r.resident) ? `<p class="to-tl-explain" data-role="tl-resident-note"><b>${esc(tr("timeline.kind.resident"))}</b> ${esc(tr("timeline.residentExplain"))}</p>` : ""}
        <p class="to-tl-explain to-muted">${esc(tr("timeline.rowsExplain"))}</p>
      </aside>
    </div>`;
}

// The full view in the bottom panel. It shows the picture of the card the user opened it from
// (state.timelineCard), or, opened from the panel's tab bar, the latest picture of any card.
export class TimelineView extends View {
  // `cards()`: [{id, name, lw}] of every card whose layerwise report holds a picture or a finished run.
  constructor({ state, cards }) {
    super("tiered-offload-timeline", "to-panel to-tl-view");
    this.state = state;
    this.cards = cards;
  }

  mount(el) {
    // The bottom panel hands its tab a bare element with no height: fill the panel, scroll inside.
    el.style.height = "100%";
    super.mount(el);
  }

  shown() {
    const cards = this.cards();
    return cards.find((c) => c.id === this.state.timelineCard)
      ?? cards.reduce((a, b) => (a && num(a.lw.finished_at) >= num(b.lw.finished_at) ? a : b), null);
  }

  render() {
    if (!this.root) return;
    this.dirty = false;
    this.root.innerHTML = fullTimelineHtml(this.shown());
    fitPicture(this.root);
  }
}
