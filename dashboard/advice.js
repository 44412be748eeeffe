/* Readiness and the next step of the batch procedure for the run: is this batch ready, the
 * largest tokens per step that fit, what was proven and what ran out of memory, what to do next
 * (raise, hold, back off, fix) with its cause. The numbers are the collector's
 * GET /api/v1/runs/{run}/advice (a report embeds the same document); a collector without that
 * route leaves the panel hidden. Every batch reads global first, per rank beside it; the "try" box
 * takes the global batch, as the operator sets it, judged by the same route (live page only; one
 * off the grid is answered with the route's one line naming the grid). Loaded with the page, not
 * when scrolled into view: it is the verdict. */

import { duration, gib, intText, isNum } from "./format.js";
import { $, append, clear, el } from "./dom.js";
import { ApiError, STATIC, getAdvice } from "./api.js";
import { S } from "./state.js";
import { remediesBlock } from "./remedies.js";

const VERDICT_CLASS = { ready: "plateau", not_ready: "warmup", unsafe: "leak" };
// the next step's colour: raise is good news, back off and fix are the ones to act on
const ACTION_CLASS = { raise: "plateau", hold: "warmup", back_off: "rising", fix: "leak" };
const ACTION_TEXT = { raise: "raise", hold: "hold", back_off: "back off", fix: "fix first" };

export function advicePanel(onTarget) {
  const input = el("input", { type: "number", id: "advice-target", min: 1, step: 1, placeholder: "global tokens / step", "aria-label": "target global batch (tokens per step over every rank)" });
  input.addEventListener("change", () => {
    const v = Number(input.value);
    S.adviceTarget = Number.isFinite(v) && v >= 1 ? Math.round(v) : null;
    onTarget();
  });
  return el("section", { class: "panel", id: "advice-panel" },
    el("div", { class: "panel-head" }, el("h2", { text: "Readiness & batch" }),
      el("span", { class: "hint", id: "advice-hint", text: "is this batch ready, how many tokens fit, what next" }),
      // a report is a file: nothing can judge a new target there
      STATIC ? null : el("div", { class: "tools" }, el("label", { class: "tool" }, "try", input))),
    el("div", { class: "advice", id: "advice-body" }, el("p", { class: "muted", text: "checking…" })));
}

export async function refreshAdvice() {
  const panel = $("advice-panel");
  if (!panel || S.adviceMissing) return;
  const gen = S.gen;
  let doc, offGrid = null;
  try {
    doc = await getAdvice(S.run, S.adviceTarget);
  } catch (err) {
    if (gen !== S.gen) return;
    if (err instanceof ApiError && err.status === 422 && S.adviceTarget) {
      // a target the route refuses (not on the grid): its one line, and the advice without it
      offGrid = err.message;
      doc = await getAdvice(S.run, null);
    } else if (err instanceof ApiError && (err.status === 404 || err.status === 405) && !/run/.test(err.message)) {
      // 404 "Not Found": the route is not there (an older collector, a report without it): no panel
      S.adviceMissing = true;
      panel.hidden = true;
      return;
    } else throw err;
  }
  if (gen !== S.gen) return;
  panel.hidden = false;
  drawAdvice(doc);
  if (offGrid) append($("advice-body"), el("p", { class: "advice-target bad", id: "advice-target-result", text: offGrid }));
}

function fact(label, value, title, id) {
  return el("div", { class: "fact", title: title || null }, el("div", { class: "label", text: label }),
    el("div", { class: "value", id: id || null, text: value }));
}

function batchText(perRank, global) {
  if (!isNum(perRank)) return "—";
  return isNum(global) ? intText(global) + " global · " + intText(perRank) + " per rank" : intText(perRank) + " per rank";
}

// the soonest runway of any rank, in time at its own step time beside steps
function runwayText(r) {
  const soon = (r.ranks || []).filter((x) => isNum(x.steps_to_oom))
    .sort((a, b) => (a.seconds_to_oom ?? Infinity) - (b.seconds_to_oom ?? Infinity) || a.steps_to_oom - b.steps_to_oom)[0];
  if (!soon) return null;
  const steps = intText(soon.steps_to_oom) + " steps";
  return (isNum(soon.seconds_to_oom) ? duration(soon.seconds_to_oom) + " · " + steps : steps) + " · rank " + soon.rank;
}

function nextStep(next) {
  if (!next) return null;
  const because = next.because || {};
  return el("div", { class: "advice-next", id: "advice-next", dataset: { action: next.action || "", cause: because.cause || "" } },
    el("span", { class: "badge", dataset: { state: ACTION_CLASS[next.action] || "unknown" }, id: "advice-action",
      text: ACTION_TEXT[next.action] || String(next.action) }),
    el("span", { class: "advice-batch", id: "advice-batch", text: isNum(next.tokens_per_step) ? batchText(next.tokens_per_step, next.global_tokens_per_step) : "" }),
    el("span", { class: "advice-cause", title: "cause", text: because.cause ? because.cause.replace(/_/g, " ") : "" }));
}

function evidenceText(ev) {
  if (!ev) return "—";
  const parts = [];
  if (ev.proven) parts.push("proven " + batchText(ev.proven.tokens_per_step, ev.proven.global_tokens_per_step));
  const oom = ev.oom_ceiling;
  const world = ev.grid && ev.grid.tokens_per_step ? ev.grid.global_tokens_per_step / ev.grid.tokens_per_step : null;
  if (oom) parts.push("OOM at " + batchText(oom.tokens, isNum(world) ? oom.tokens * world : null) + " (rank " + oom.rank + ", step " + intText(oom.step) + ", " + oom.phase + ")");
  // "no OOM" is never said after one: OOMs the batch did not cause (a leak's) are still OOMs
  const others = (ev.ooms || []).length;
  if (!oom && others) parts.push(intText(others) + " OOM(s) not caused by the batch");
  return parts.length ? parts.join(" · ") : "nothing proven, no OOM";
}

function drawAdvice(doc) {
  const body = $("advice-body");
  clear(body);
  const r = doc.readiness || {};
  const verdict = r.verdict || "unknown";
  const ev = doc.evidence || {};
  const bound = { model: "by the model", oom: "below an OOM", proven: "a proven batch" }[doc.bound] || "";
  append(body,
    nextStep(doc.next),
    el("p", { class: "advice-rec", id: "advice-rec", text: doc.recommendation || "" }),
    el("div", { class: "facts" },
      el("div", { class: "fact" }, el("div", { class: "label", text: "Readiness" }),
        el("div", { class: "value" }, el("span", { class: "badge", dataset: { state: VERDICT_CLASS[verdict] || "unknown" }, id: "advice-verdict", text: verdict.replace("_", " ") }))),
      fact("Plateau held", isNum(r.plateau_steps) ? intText(r.plateau_steps) + " steps" : "—"),
      fact("Checkpoints passed", isNum(r.checkpoints_passed) ? intText(r.checkpoints_passed) : "—"),
      fact("Min headroom", gib(r.min_headroom_bytes) + (isNum(r.min_headroom_rank) ? " · rank " + r.min_headroom_rank : ""),
        "the least headroom of any rank's current process, any phase", "advice-headroom"),
      fact("Largest batch that fits", isNum(doc.max_tokens_per_step)
        ? batchText(doc.max_tokens_per_step, doc.max_global_tokens_per_step) + (bound ? " (" + bound + ")" : "")
        : doc.max_tokens_hidden ? doc.max_tokens_hidden.text : "—",
        "largest tokens per step keeping a " + Math.round((doc.margin || 0) * 100) + " % margin at the worst phase, bounded by what the runs showed" +
        (isNum(doc.binding_rank) ? "; binding rank " + doc.binding_rank : ""), "advice-max"),
      fact("Evidence", evidenceText(ev), null, "advice-evidence"),
      ev.grid ? fact("Settable in steps of", batchText(ev.grid.tokens_per_step, ev.grid.global_tokens_per_step) + " (" + ev.grid.source + ")",
        ev.grid.why, "advice-grid") : null,
      runwayText(r) ? fact("Runway", runwayText(r), "the soonest OOM at the current slope, at the rank's own step time", "advice-runway") : null),
    (r.reasons || []).length ? el("ul", { class: "advice-reasons" }, r.reasons.map((x) =>
      el("li", { dataset: { cause: x.cause || "" }, text: x.text !== undefined ? String(x.text) : String(x) }))) : null,
    remediesBlock(doc));
  const t = doc.target;
  if (t) {
    const verdictText = t.fits === true ? "fits" : t.fits === false ? "does not fit" : "cannot be judged";
    const because = t.because ? " — " + t.because.text : "";
    append(body, el("p", { class: "advice-target" + (t.fits === false ? " bad" : ""), id: "advice-target-result",
      text: intText(t.global_tokens_per_step) + " global (" + intText(t.tokens_per_step) + " per rank): " + verdictText + because }));
  }
}
