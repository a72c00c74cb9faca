// Markup helpers the panel and the last run's picture share: the views build HTML strings, so
// every value that goes into them is escaped here, and the legends look the same in both.

export function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// A finite number, or 0: every figure from the server is optional.
export const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : 0);

// A row of coloured dots with their words: items [cls, text] (cls "" for words alone; falsy
// items are left out).
export function legend(items, role = "") {
  return `<div class="to-legend"${role ? ` data-role="${role}"` : ""}>${items.filter(Boolean).map(([cls, text]) =>
    `<span>${cls ? `<i class="to-dot ${cls}"></i>` : ""}${esc(text)}</span>`).join("")}</div>`;
}
