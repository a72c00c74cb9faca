// The auto settings' section of a layerwise card (offload_core/layerwise/tuning.py's report): the
// setting the run streams with, why (the engine's reason), what the pipeline model predicted
// against what the run measured, and the plan's changes in this run. For a setting fixed on the
// node, what auto would have chosen and what that would save. The reason and the verdict are the
// server's (English) words, as the Dynamic VRAM order's message is; the sizes in the reason are
// the panel's own (its "units shown" setting).

import { tr } from "./i18n.js";
import { esc, num } from "./html.js";
import { ms } from "./timeline.js";

const msText = (v) => tr("timeline.msValue", { value: ms(v) });

function settingText(s, blocks) {
  if (!s) return "";
  const parts = [
    tr("plan.resident", { n: (s.resident_blocks ?? []).length, blocks }),
  ];
  // No prefetch where core streams (it fetches one block ahead by itself).
  if (s.prefetch != null) parts.push(tr("plan.prefetch", { n: num(s.prefetch) }));
  if (num(s.read_ahead) > 0) parts.push(tr("plan.readAhead", { n: num(s.read_ahead) }));
  return parts.join(" · ");
}

// The reason's words with each {} replaced by its size, in the panel's units (`fmtBytes`); the
// server's text where it gives no template.
function reasonText(t, fmtBytes) {
  const sizes = Array.isArray(t.reason_sizes) ? t.reason_sizes : null;
  if (typeof t.reason_template !== "string" || !sizes) return t.reason;
  let k = 0;
  return t.reason_template.replace(/\{\}/g, () => fmtBytes(sizes[k++]));
}

// `lw`: the layerwise report; nothing without a tuning report (nothing measured yet).
// `fmtBytes`: the panel's size formatter.
export function planHtml(lw, fmtBytes) {
  const t = lw?.tuning;
  if (!t || typeof t !== "object") return "";
  const blocks = num(lw.blocks);
  const auto = Array.isArray(lw.auto_settings) ? lw.auto_settings : [];
  const fixed = auto.length === 0;
  const measured = typeof t.measured_ms === "number" ? msText(t.measured_ms) : null;
  const predicted = typeof t.predicted_ms === "number" ? msText(t.predicted_ms) : null;
  // A change the next run starts with (``next_run``) is not a change of this run: said apart.
  const all = Array.isArray(t.changes) ? t.changes : [];
  const changes = all.filter((c) => !c.next_run);
  const next = all.filter((c) => c.next_run).pop();
  const rows = [
    `<div class="to-lw-head"><b>${esc(tr(fixed ? "plan.headFixed" : "plan.head"))}</b>
      <span class="to-muted" data-role="plan-setting">${esc(settingText(t.setting, blocks))}</span></div>`,
  ];
  if (!fixed && t.reason) rows.push(`<div data-role="plan-reason">${esc(reasonText(t, fmtBytes))}</div>`);
  // Which calls the measured step is the mean of: the progress bar's step may hold more than one
  // call of the model, and the sampler's own work between them.
  const calls = Array.isArray(t.measured_passes) && t.measured_passes.length === 2 ? t.measured_passes : null;
  if (predicted && measured) {
    const words = calls ? tr("plan.checkCalls", { predicted, measured, first: num(calls[0]), last: num(calls[1]) })
      : tr("plan.check", { predicted, measured });
    rows.push(`<div class="to-muted" data-role="plan-check">${esc(words)}
      <span data-role="plan-verdict">${esc(t.verdict_key ? tr(`plan.verdict.${t.verdict_key}`) : (t.verdict ?? ""))}</span></div>`);
  } else if (t.counted === "runs" && measured) {
    const words = fixed ? "plan.measuredFixed" : "plan.measuredRun";
    rows.push(`<div class="to-muted" data-role="plan-check">${esc(tr(words, { measured }))}</div>`);
  } else if (t.phase === "planning") {
    rows.push(`<div class="to-muted" data-role="plan-check">${esc(tr("plan.planning"))}</div>`);
  } else if (t.phase === "measure" || t.phase === "new") {
    const words = t.counted === "runs" ? "plan.measuringRun" : "plan.measuring";
    rows.push(`<div class="to-muted" data-role="plan-check">${esc(tr(words))}</div>`);
  }
  if (typeof t.explicit_cost_ms === "number" && t.auto_choice && Math.abs(t.explicit_cost_ms) > 0) {
    rows.push(`<div class="to-muted" data-role="plan-explicit">${esc(tr("plan.autoWould", {
      setting: settingText(t.auto_choice, blocks), ms: msText(Math.abs(t.explicit_cost_ms)),
      how: tr(t.explicit_cost_ms > 0 ? "plan.faster" : "plan.slower") }))}</div>`);
  } else if (t.explicit_within_noise === true && t.auto_choice) {
    rows.push(`<div class="to-muted" data-role="plan-explicit">${esc(tr("plan.autoWouldNoise", {
      setting: settingText(t.auto_choice, blocks) }))}</div>`);
  }
  if (changes.length) {
    const last = changes[changes.length - 1];
    rows.push(`<div class="to-muted" data-role="plan-changes" data-changes="${changes.length}">${esc(tr(
      `plan.changes${t.counted === "runs" ? "Runs" : ""}${changes.length === 1 ? "One" : ""}`,
      { n: changes.length, pass: num(last.pass), setting: settingText(last.to, blocks) }))}</div>`);
  }
  if (next) {
    rows.push(`<div class="to-muted" data-role="plan-next-run">${esc(tr(
      next.next_run === "too_few_calls" ? "plan.nextRunShort" : "plan.nextRunEnded",
      { setting: settingText(next.to, blocks), pass: num(next.pass), n: num(next.calls_left ?? 0) }))}</div>`);
  }
  return `<div class="to-plan" data-role="lw-plan" data-phase="${esc(t.phase ?? "")}">${rows.join("")}</div>`;
}
