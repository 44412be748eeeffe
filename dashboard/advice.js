/* Readiness and batch advice for the run (docs/decisions.md): is this batch ready, the
 * largest tokens per step that fit, what to do next. The numbers are the collector's
 * GET /api/v1/runs/{run}/advice; a collector without that route leaves the panel hidden.
 * A target tokens-per-step typed by the user is projected by the same route. */

import { gib, intText, isNum } from "./format.js";
import { $, append, clear, el } from "./dom.js";
import { ApiError, getAdvice } from "./api.js";
import { S } from "./state.js";

const VERDICT_CLASS = { ready: "plateau", not_ready: "warmup", unsafe: "leak" };

export function advicePanel(onTarget) {
  const input = el("input", { type: "number", id: "advice-target", min: 1, step: 1, placeholder: "tokens / step", "aria-label": "target tokens per step" });
  input.addEventListener("change", () => {
    const v = Number(input.value);
    S.adviceTarget = Number.isFinite(v) && v >= 1 ? Math.round(v) : null;
    onTarget();
  });
  return el("section", { class: "panel", id: "advice-panel" },
    el("div", { class: "panel-head" }, el("h2", { text: "Readiness & batch" }),
      el("span", { class: "hint", id: "advice-hint", text: "is this batch ready, how many tokens fit, what next" }),
      el("div", { class: "tools" }, el("label", { class: "tool" }, "try", input))),
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
    // 404 "Not Found": the route is not there (an older collector, or a report): no panel
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

function fact(label, value, title) {
  return el("div", { class: "fact", title: title || null }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }));
}

function drawAdvice(doc) {
  const body = $("advice-body");
  clear(body);
  const r = doc.readiness || {};
  const verdict = r.verdict || "unknown";
  const perRank = isNum(doc.max_tokens_per_step) ? intText(doc.max_tokens_per_step) + " tokens/step per rank" : "unknown";
  const global = isNum(doc.max_global_tokens_per_step) ? intText(doc.max_global_tokens_per_step) + " global" : "";
  append(body,
    el("div", { class: "facts" },
      el("div", { class: "fact" }, el("div", { class: "label", text: "Readiness" }),
        el("div", { class: "value" }, el("span", { class: "badge", dataset: { state: VERDICT_CLASS[verdict] || "unknown" }, id: "advice-verdict", text: verdict.replace("_", " ") }))),
      fact("Plateau held", isNum(r.plateau_steps) ? intText(r.plateau_steps) + " steps" : "—"),
      fact("Checkpoints passed", isNum(r.checkpoints_passed) ? intText(r.checkpoints_passed) : "—"),
      fact("Min headroom", gib(r.min_headroom_bytes) + (isNum(r.worst_rank) ? " · rank " + r.worst_rank : "")),
      fact("Largest batch that fits", perRank + (global ? " · " + global : ""),
        "largest tokens per step keeping a " + Math.round((doc.margin || 0) * 100) + " % margin at the worst phase" +
        (isNum(doc.binding_rank) ? "; binding rank " + doc.binding_rank : ""))),
    el("p", { class: "advice-rec", id: "advice-rec", text: doc.recommendation || "" }),
    (r.reasons || []).length ? el("ul", { class: "advice-reasons" }, r.reasons.map((x) => el("li", { text: String(x) }))) : null);
  const t = doc.target;
  if (t) {
    append(body, el("p", { class: "advice-target" + (t.fits ? "" : " bad"), id: "advice-target-result",
      text: intText(t.tokens_per_step) + " tokens/step: worst peak " + gib(t.worst_peak_bytes) + " on rank " + t.rank +
        (t.phase ? " (" + t.phase + ")" : "") + ", headroom " + gib(t.headroom_bytes) + " — " + (t.fits ? "fits" : "does not fit") }));
  }
}
