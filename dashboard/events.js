/* The selected rank's engine events, newest first; a click zooms the charts there. */

import { capacity, clock, gib, intText, isNum, runway, slopeText } from "./format.js";
import { $, clear, el } from "./dom.js";
import { S } from "./state.js";
import { zoomToStep } from "./zoom.js";

const MAX_ROWS = 500;
/** How an event type reads where its name alone would not (the rest: the type, underscores as spaces). */
export const EVENT_NAMES = { suspected_oom: "suspected OOM" };

export function eventName(type) { return EVENT_NAMES[type] || String(type).replace(/_/g, " "); }

/** One line of details, each number named by what it is measured against. */
export function eventDetail(e) {
  const parts = [];
  if (e.type === "leak" && isNum(e.onset_step)) parts.push("onset at step " + intText(e.onset_step) + ", detected at step " + intText(e.step));
  if (e.type === "plateau_break" && e.cause) parts.push("cause: " + e.cause + (e.relevel ? " (one-time ratchet: plateau re-levelled)" : ""));
  if (e.type === "oom") parts.push("out of memory" + (isNum(e.ooms) ? " (#" + intText(e.ooms) + " of this process)" : "") + (e.phase ? " during " + e.phase : ""));
  if (e.type === "suspected_oom") {
    // seen from the device alone: a suspicion, with the numbers it rests on
    parts.push("suspected OOM (device memory only, no OOM counter): device used fell from " + gib(e.used_before_bytes) +
      (isNum(e.total_bytes) ? " of " + capacity(e.total_bytes) : "") + " to " + gib(e.used_after_bytes));
    if (e.reason) parts.push("reason: " + String(e.reason).replace(/_/g, " "));
  }
  if (e.type === "restart") parts.push("new process" + (isNum(e.from_step) ? ", previous one last reported step " + intText(e.from_step) : ""));
  if (isNum(e.slope_bytes_per_step)) parts.push(slopeText(e.slope_bytes_per_step));
  if (isNum(e.steps_to_oom)) parts.push("OOM in " + runway(e.steps_to_oom, e.seconds_to_oom));
  if (e.source) parts.push("source: " + e.source);
  if (isNum(e.peak_bytes)) parts.push("peak " + gib(e.peak_bytes));
  if (isNum(e.above_plateau_bytes)) {
    // measured against the training steps' own peak, not the reserved plateau column
    parts.push(e.above_plateau_bytes >= 0 ? gib(e.above_plateau_bytes) + " above the training peak"
      : gib(-e.above_plateau_bytes) + " below the training peak (no extra need)");
  }
  if (isNum(e.headroom_bytes)) parts.push(gib(e.headroom_bytes) + " headroom");
  if (isNum(e.level_bytes)) parts.push("level " + gib(e.level_bytes));
  if (isNum(e.plateau_bytes)) parts.push((e.type === "plateau_break" ? "previous plateau " : "plateau ") + gib(e.plateau_bytes) + " reserved");
  if (e.message) parts.push(String(e.message));
  return parts.join(" · ");
}

export function drawEvents() {
  const table = $("events-table");
  if (!table || !S.mainData) return;
  // newest first by time: after a restart from a checkpoint the steps run twice, and the
  // restart (an earlier step) comes after the OOM that caused it
  const events = (S.mainData.events || []).slice().sort((a, b) => ((b.ts || 0) - (a.ts || 0)) || ((b.step || 0) - (a.step || 0)));
  if (!table.tHead.rows.length) {
    table.tHead.appendChild(el("tr", null, el("th", { class: "num", text: "Step" }), el("th", { text: "Event" }), el("th", { text: "Details" })));
  }
  const tbody = table.tBodies[0];
  const sig = events.length + "|" + (events[0] ? events[0].step + events[0].type : "") + "|" + S.selected.rank;
  if (tbody.dataset.sig === sig) return; // nothing new: leave the rows (and the user's scroll) alone
  tbody.dataset.sig = sig;
  clear(tbody);
  $("events-hint").textContent = "rank " + S.selected.rank + " · " + events.length + " event" + (events.length === 1 ? "" : "s") + ", newest first";
  if (!events.length) {
    tbody.appendChild(el("tr", null, el("td", { colspan: 3, class: "muted", text: "no events yet: the engine reports plateaus, breaks, leaks, OOMs (suspected ones too), restarts and phase spikes here." })));
    return;
  }
  const frag = document.createDocumentFragment();
  for (const e of events.slice(0, MAX_ROWS)) {
    frag.appendChild(el("tr", { dataset: { type: e.type }, on: { click: () => zoomToStep(e.step) }, title: "zoom the chart to this event" },
      el("td", { class: "num", text: intText(e.step) + (isNum(e.attempt) && e.attempt > 1 ? " (attempt " + e.attempt + ")" : ""),
        title: isNum(e.ts) ? clock(e.ts) : null }),
      el("td", { text: eventName(e.type) }),
      el("td", { text: eventDetail(e) })));
  }
  tbody.appendChild(frag);
}
