/* The runs list (#/): every run with its status (the collector's model: running, finished,
 * recovered, crashed, ended; meanings from /api/v1/meta), OOM count (the OOMs suspected from device
 * memory beside it), worst rank's state and least headroom, newest first. Updated in place on every poll. */

import { age, clock, duration, gib, intText, isNum } from "./format.js";
import { $, clear, el, setText } from "./dom.js";
import { S, vocab } from "./state.js";

export function runHref(run, params) {
  const parts = [];
  for (const key of Object.keys(params || {})) {
    const v = params[key];
    if (v !== null && v !== undefined) parts.push(encodeURIComponent(key) + "=" + encodeURIComponent(v));
  }
  return "#/run/" + encodeURIComponent(run) + (parts.length ? "?" + parts.join("&") : "");
}

const HEAD = ["Run", "Status", "OOMs", "Incidents", "State (worst rank)", "Ranks", "Hosts", "Min headroom", "Time to OOM", "Last step", "Last sample", "Samples"];
const NUMERIC = new Set([2, 3, 5, 6, 7, 8, 9, 11]);
// columns a narrow screen leaves out, so the status and the state stay on screen at 390 px
const OPTIONAL = new Set([5, 6, 9, 11]);
const cellClass = (i) => [NUMERIC.has(i) ? "num" : "", OPTIONAL.has(i) ? "opt" : ""].join(" ").trim() || null;

function lowHeadroom(r) {
  if (typeof r.low_headroom === "boolean") return r.low_headroom;
  const f = vocab.low_headroom_fraction;
  return isNum(r.min_headroom_bytes) && isNum(r.total_bytes) && isNum(f) && r.min_headroom_bytes < f * r.total_bytes;
}

function makeRow(r) {
  const href = runHref(r.run);
  const tr = el("tr", { dataset: { run: r.run }, on: { click: () => { location.hash = href; } } },
    el("td", { class: "name", title: r.run }, el("a", { href: href, text: r.run })));
  for (let i = 1; i < HEAD.length; i++) tr.appendChild(el("td", { class: cellClass(i) }));
  tr.cells[1].appendChild(el("span", { class: "pill" }));
  tr.cells[4].appendChild(el("span", { class: "badge" }));
  return tr;
}

function fillRow(tr, r) {
  const c = tr.cells;
  // status and OOM count come from the collector; an older one sends neither
  const status = r.status || "—";
  const sb = c[1].firstChild;
  setText(sb, status);
  sb.dataset.status = status;
  // OOMs suspected from device memory alone (no OOM counter: dcgm, nvidia-smi) beside the confirmed ones, never in them
  const suspected = isNum(r.suspected_ooms) ? r.suspected_ooms : 0;
  setText(c[2], (isNum(r.ooms) ? intText(r.ooms) : "—") + (suspected > 0 ? " + " + intText(suspected) + " suspected" : ""));
  c[2].className = "num" + (r.ooms > 0 || suspected > 0 ? " bad" : " muted");
  c[2].dataset.suspected = suspected;
  // what else happened to the run's processes, as the collector counts it
  const more = [];
  if (suspected > 0) more.push(intText(suspected) + " suspected OOM" + (suspected === 1 ? "" : "s") + " (device memory only, not confirmed)");
  if (r.dead_ranks > 0) more.push(intText(r.dead_ranks) + " dead rank" + (r.dead_ranks === 1 ? "" : "s"));
  if (r.restarts > 0) more.push(intText(r.restarts) + " restart" + (r.restarts === 1 ? "" : "s"));
  if (r.silent_ranks > 0) more.push(intText(r.silent_ranks) + " silent rank" + (r.silent_ranks === 1 ? "" : "s"));
  c[2].title = more.join(", ");
  const meaning = (vocab.run_status_meaning || {})[status];
  sb.title = (meaning ? status + ": " + meaning : status) + (more.length ? " · " + more.join(", ") : "");
  if (r.dead_ranks > 0 && status === "running") setText(sb, "running · " + r.dead_ranks + " dead");
  // incidents: one failure that ended processes (an OOM that took the job down and its restarts is one)
  setText(c[3], isNum(r.incidents) ? intText(r.incidents) : "—");
  c[3].className = "num" + (r.incidents > 0 ? " bad" : " muted");
  const b = c[4].firstChild;
  setText(b, r.worst_state || "no verdict");
  b.dataset.state = r.worst_state || "unknown";
  setText(c[5], intText(r.ranks));
  setText(c[6], intText(r.hosts));
  setText(c[7], gib(r.min_headroom_bytes));
  c[7].className = "num" + (lowHeadroom(r) ? " bad" : "");
  // a runway only while the run runs; an ended run that was leaking says so, never "no leak"
  const eta = isNum(r.seconds_to_oom) && r.status === "running";
  setText(c[8], eta ? duration(r.seconds_to_oom) : r.worst_state === "leak" ? "ended while leaking" : "no leak");
  c[8].className = "num" + (eta || r.worst_state === "leak" ? " bad" : " muted");
  setText(c[9], intText(r.last_step));
  setText(c[10], age(r.last_ts));
  c[10].title = clock(r.last_ts);
  setText(c[11], intText(r.samples));
}

export function drawRuns(runs, startHint, stateMsg) {
  const view = $("view");
  if (!runs.length) {
    S.rendered.runs = "empty";
    clear(view);
    view.appendChild(el("div", { class: "panel" }, stateMsg("No runs yet",
      "no samples yet — start your training with vramwatch.init(url=...) pointing at this collector:", startHint())));
    return;
  }
  if (S.rendered.runs !== "table") {
    clear(view);
    const head = el("tr", null, HEAD.map((h, i) => el("th", { class: cellClass(i), text: h })));
    view.appendChild(el("section", { class: "panel" },
      el("div", { class: "panel-head" }, el("h2", { text: "Runs" }), el("span", { class: "hint", text: "updated live · click a run for its ranks" }),
        el("div", { class: "tools" }, el("a", { href: "#/compare", id: "compare-link", text: "compare two runs" }))),
      el("div", { class: "table-wrap" }, el("table", { class: "data", id: "runs-table" }, el("thead", null, head), el("tbody")))));
    S.rendered.runs = "table";
    S.runRows = new Map();
  }
  const tbody = document.querySelector("#runs-table tbody");
  const sorted = runs.slice().sort((a, b) => (b.last_ts || 0) - (a.last_ts || 0));
  let cursor = tbody.firstChild;
  const seen = new Set();
  for (const r of sorted) {
    let tr = S.runRows.get(r.run);
    if (!tr) { tr = makeRow(r); S.runRows.set(r.run, tr); }
    fillRow(tr, r);
    seen.add(tr);
    if (cursor === tr) { cursor = cursor.nextSibling; continue; }
    tbody.insertBefore(tr, cursor);
  }
  while (cursor) { const next = cursor.nextSibling; if (!seen.has(cursor)) tbody.removeChild(cursor); cursor = next; }
}
