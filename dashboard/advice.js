/* Readiness and the next step of the batch procedure for the run: is this batch ready, the
 * largest tokens per step that fit, what was proven and what ran out of memory, what to do next
 * (raise, hold, back off, fix) with its cause. The numbers are the collector's
 * GET /api/v1/runs/{run}/advice (a report embeds the same document); a collector without that
 * route leaves the panel hidden. A target tokens-per-step typed by the user is judged by the same
 * route (live page only). Loaded with the page, not when scrolled into view: it is the verdict. */

import { gib, intText, isNum } from "./format.js";
import { $, append, clear, el } from "./dom.js";
import { ApiError, STATIC, getAdvice } from "./api.js";
import { S } from "./state.js";

const VERDICT_CLASS = { ready: "plateau", not_ready: "warmup", unsafe: "leak" };
// the next step's colour: raise is good news, back off and fix are the ones to act on
const ACTION_CLASS = { raise: "plateau", hold: "warmup", back_off: "rising", fix: "leak" };
const ACTION_TEXT = { raise: "raise", hold: "hold", back_off: "back off", fix: "fix first" };

export function advicePanel(onTarget) {
  const input = el("input", { type: "number", id: "advice-target", min: 1, step: 1, placeholder: "tokens / step", "aria-label": "target tokens per step per rank" });
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
  let doc;
  try {
    doc = await getAdvice(S.run, S.adviceTarget);
  } catch (err) {
    if (gen !== S.gen) return;
    // 404 "Not Found": the route is not there (an older collector, a report without it): no panel
    if (err instanceof ApiError && (err.status === 404 || err.status === 405) && !/run/.test(err.message)) {
      S.adviceMissing = true;
      panel.hidden = true;
      return;
    }
    throw err;
  }
  if (gen !== S.gen) return;
  panel.hidden = false;
  drawAdvice(doc);
}

function fact(label, value, title, id) {
  return el("div", { class: "fact", title: title || null }, el("div", { class: "label", text: label }),
    el("div", { class: "value", id: id || null, text: value }));
}

function batchText(perRank, global) {
  return isNum(perRank) ? intText(perRank) + " per rank" + (isNum(global) ? " · " + intText(global) + " global" : "") : "—";
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
  if (oom) parts.push("OOM at " + intText(oom.tokens) + " (rank " + oom.rank + ", step " + intText(oom.step) + ", " + oom.phase + ")");
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
      fact("Largest batch that fits", batchText(doc.max_tokens_per_step, doc.max_global_tokens_per_step) + (bound ? " (" + bound + ")" : ""),
        "largest tokens per step keeping a " + Math.round((doc.margin || 0) * 100) + " % margin at the worst phase, bounded by what the runs showed" +
        (isNum(doc.binding_rank) ? "; binding rank " + doc.binding_rank : ""), "advice-max"),
      fact("Evidence", evidenceText(ev), isNum(ev.granularity) ? "settable in steps of " + intText(ev.granularity) + " tokens per rank" : null, "advice-evidence")),
    (r.reasons || []).length ? el("ul", { class: "advice-reasons" }, r.reasons.map((x) =>
      el("li", { dataset: { cause: x.cause || "" }, text: x.text !== undefined ? String(x.text) : String(x) }))) : null);
  const t = doc.target;
  if (t) {
    const verdictText = t.fits === true ? "fits" : t.fits === false ? "does not fit" : "cannot be judged";
    const because = t.because ? " — " + t.because.text : "";
    append(body, el("p", { class: "advice-target" + (t.fits === false ? " bad" : ""), id: "advice-target-result",
      text: intText(t.tokens_per_step) + " tokens/step (" + intText(t.global_tokens_per_step) + " global): " + verdictText + because }));
  }
}
