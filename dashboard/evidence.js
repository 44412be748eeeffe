/* Evidence for the run (docs/evidence.md): ask the selected rank for an allocator snapshot, list
 * the run's snapshots (each downloads as the pickle pytorch.org/memory_viz opens), the leak
 * suspects (per leaking rank, the lines of code whose live memory grew between two of its
 * snapshots), and the post-mortem (who failed first, when, why; how every rank's latest process
 * ended, what it held at that moment, which other processes held memory on its GPU), shown as soon
 * as a rank died or hit an OOM, during the run, and once every rank ended. Data: the collector's
 * /capture, /snapshots, /suspects and /postmortem routes; a report embeds them. Times carry their
 * date and the viewer's zone. */

import { MIB, clock, gib, intText, isNum, plural, timeZoneLabel } from "./format.js";
import { $, append, clear, el } from "./dom.js";
import { ApiError, STATIC, getPostmortem, getSnapshots, getSuspects, requestCapture } from "./api.js";
import { S, vocab } from "./state.js";
import { isRunning, lastWordsText } from "./verdict.js";
import { storyNodes } from "./incidents.js";

const MEMORY_VIZ = "https://pytorch.org/memory_viz";
const DEFAULT_STEPS = 3;
const PM_EVERY = 30;
// suspects come from snapshot diffs the collector computes once per pair: cheap to re-read
const SUSPECTS_EVERY = 10;

export function evidencePanel() {
  const steps = el("input", { type: "number", id: "capture-steps", min: 1, max: 100, step: 1, value: DEFAULT_STEPS,
    size: 4, "aria-label": "steps of allocator history to record" });
  const button = el("button", { type: "button", id: "capture-btn", class: "btn", text: "capture snapshot",
    title: "ask the selected rank to record allocator history for N steps, then upload a snapshot" });
  button.addEventListener("click", () => capture(button, steps));
  return el("section", { class: "panel", id: "evidence-panel" },
    el("div", { class: "panel-head" }, el("h2", { text: "Evidence" }),
      el("span", { class: "hint", id: "evidence-hint" }, "allocator snapshots · open a downloaded file at ",
        el("a", { href: MEMORY_VIZ, target: "_blank", rel: "noopener", text: "pytorch.org/memory_viz" })),
      STATIC ? null : el("div", { class: "tools" }, el("label", { class: "tool" }, "steps", steps), button)),
    el("p", { class: "capture-result", id: "capture-result", role: "status", hidden: true }),
    el("section", { class: "suspects", id: "suspects", hidden: true }),
    el("section", { class: "postmortem", id: "postmortem", hidden: true }),
    el("div", { class: "table-wrap" }, el("table", { class: "data", id: "snapshot-table" }, el("thead"), el("tbody"))),
    el("p", { class: "muted", id: "snapshot-empty", text: "no snapshots for this run yet" }));
}

async function capture(button, stepsInput) {
  const sel = S.selected;
  const out = $("capture-result");
  if (!sel) return;
  const steps = Math.round(Number(stepsInput.value));
  button.disabled = true;
  out.hidden = false;
  out.classList.remove("bad");
  out.textContent = "asking rank " + sel.rank + "…";
  try {
    const ans = await requestCapture(S.run, sel.rank, sel.host, steps);
    out.textContent = ans.directives
      ? "asked rank " + (ans.ranks || [sel.rank]).join(", ") + " for " + plural(steps, "step") +
        " of allocator history: the snapshot appears below after its next " + plural(steps, "step")
      : "rank " + sel.rank + " already has a capture pending: the snapshot appears below when it is taken";
  } catch (err) {
    out.classList.add("bad");
    out.textContent = "capture refused" + (err instanceof ApiError && err.status ? " (" + err.status + ")" : "") + ": " + err.message;
  } finally {
    button.disabled = false;
  }
}

/** Link for a snapshot: relative to the page, so a collector behind a path prefix works. */
function snapshotLink(s, text) {
  if (STATIC || !s.url) return el("span", { text: text, title: "download it from the collector: " + (s.url || s.id) });
  return el("a", { href: String(s.url).replace(/^\//, ""), download: "", text: text, title: "download the pickle; open it at " + MEMORY_VIZ });
}

function drawSnapshots(list) {
  const table = $("snapshot-table");
  if (!table) return;
  const head = table.tHead, body = table.tBodies[0];
  clear(head);
  clear(body);
  $("snapshot-empty").hidden = list.length > 0;
  table.hidden = list.length === 0;
  if (!list.length) return;
  append(head, el("tr", null, ["Rank", "Host", "Step", "Trigger", "Size", "Time", "Download"].map((t) => el("th", { text: t }))));
  const rows = list.slice().sort((a, b) => (b.ts || 0) - (a.ts || 0));
  for (const s of rows) {
    append(body, el("tr", { dataset: { rank: s.rank, trigger: s.trigger } },
      el("td", { text: s.rank }), el("td", { text: s.host }), el("td", { text: intText(s.step) }),
      el("td", null, el("span", { class: "badge", dataset: { state: s.trigger === "oom" ? "leak" : "unknown" }, text: s.trigger })),
      el("td", { text: isNum(s.bytes) ? (s.bytes / 1048576).toFixed(2) + " MiB" : "—" }),
      el("td", { text: clock(s.ts) }),
      el("td", null, snapshotLink(s, "rank " + s.rank + " · step " + s.step + ".pickle"))));
  }
}

function mib(bytes) { return (bytes >= 0 ? "+" : "") + (bytes / MIB).toFixed(1) + " MiB"; }

/** Leak suspects: per leaking rank, its growing allocation sites between two snapshots. */
function drawSuspects(list) {
  const box = $("suspects");
  clear(box);
  box.hidden = !list.length;
  if (!list.length) return;
  append(box, el("h3", { text: "Leak suspects" }),
    el("p", { class: "muted", text: "live memory by the line that allocated it (first frame outside torch), " +
      "between two snapshots of each leaking rank; the allocator's cache is not counted" }));
  for (const s of list) {
    const head = "rank " + s.rank + " · " + s.host + " · steps " + intText(s.old_step) + " → " + intText(s.new_step) +
      " (" + plural(s.steps, "step") + ")";
    const untraced = s.untraced && s.untraced.bytes_delta ? " · " + mib(s.untraced.bytes_delta) + " allocated while no history was recorded" : "";
    append(box, el("p", { class: "suspect-head", text: head + untraced }),
      s.sites.length ? el("div", { class: "table-wrap" }, el("table", { class: "data suspect-table", dataset: { rank: s.rank } },
        el("thead", null, el("tr", null, ["Allocation site", "Function", "Growth", "Blocks", "Then → now"].map((t) => el("th", { text: t })))),
        el("tbody", null, s.sites.map((c) => el("tr", { dataset: { file: c.file, line: c.line } },
          el("td", { class: "site", text: c.file + ":" + c.line, title: (c.stack || []).join("\n") }),
          el("td", { text: c.function }), el("td", { text: mib(c.bytes_delta) }),
          el("td", { text: (c.blocks_delta >= 0 ? "+" : "") + intText(c.blocks_delta) }),
          el("td", { text: (c.bytes_old / MIB).toFixed(1) + " → " + (c.bytes_new / MIB).toFixed(1) + " MiB" }))))))
        : el("p", { class: "muted", text: "no allocation site grew between the two snapshots" }));
  }
}

/** What makes a post-mortem worth showing, from the collector's rank rows: a process that died
 * (the latest or an earlier one), an OOM (a suspected one too), or a run whose ranks all ended. Its text changes when
 * one more rank dies, which asks for the post-mortem at once. */
function postmortemReason() {
  const ranks = S.ranks || [];
  if (STATIC) return STATIC.postmortem ? "embedded" : "";
  const dead = ranks.filter((r) => r.vw.death).length;
  const deaths = ranks.reduce((n, r) => n + r.vw.deaths, 0);
  const ooms = ranks.reduce((n, r) => n + r.vw.ooms, 0);
  const suspected = ranks.reduce((n, r) => n + r.vw.suspectedOoms, 0);
  const ended = ranks.length > 0 && !ranks.some(isRunning);
  return dead || deaths || ooms || suspected || ended ? [dead, deaths, ooms, suspected, ended].join("|") : "";
}

const END_STATE = { oom: "oom", killed: "dead", stopped: "dead", exited: "exited", ended: "ended", running: "plateau",
  cuda_error: "dead", collective_timeout: "dead", crash: "dead", checkpoint_failed: "dead", exception: "dead" };

function drawPostmortem(pm) {
  const box = $("postmortem");
  clear(box);
  box.hidden = false;
  const f = pm.first_failure;
  S.runStatus = pm.status || null;
  S.runIncidents = Array.isArray(pm.incidents) ? pm.incidents.length : null;
  const meaning = (vocab.run_status_meaning || {})[pm.status];
  append(box, el("h3", { text: "Post-mortem · " + (pm.status || ""), title: meaning || null }),
    el("p", { class: "muted", id: "pm-zone", text: "times in " + timeZoneLabel() }));
  if (f) {
    append(box, el("p", { class: "pm-first", id: "pm-first" },
      el("strong", { text: "First failure: rank " + f.rank + " on " + f.host }),
      " · " + f.cause + " · step " + intText(f.step) + " · " + clock(f.ts)),
    f.detail ? el("p", { class: "muted", id: "pm-detail", text: f.detail }) : null);
  } else {
    append(box, el("p", { id: "pm-first", text: "No failure: every rank is running or closed cleanly." }));
  }
  append(box, el("section", { class: "pm-story", id: "pm-story" }, storyNodes(pm)));
  const snaps = new Map();
  for (const s of pm.snapshots || []) if (!snaps.has(s.rank)) snaps.set(s.rank, s);
  append(box, el("div", { class: "table-wrap" }, el("table", { class: "data", id: "pm-ranks" },
    el("thead", null, el("tr", null, ["Rank", "Host", "End", "Last step", "Last sample", "Headroom", "Held at failure",
      "Headroom at failure", "Snapshot"].map((t) => el("th", { text: t })))),
    el("tbody", null, (pm.ranks || []).map((r) => el("tr", { dataset: { rank: r.rank, end: r.end } },
      el("td", { text: r.rank }), el("td", { text: r.host }),
      el("td", null, el("span", { class: "badge", dataset: { state: END_STATE[r.end] || "unknown" },
        title: [(vocab.outcomes || {})[r.end], r.died && lastWordsText(r.died.last_words)].filter(Boolean).join(" — ") || null,
        text: r.end + (r.ooms ? " · OOM ×" + r.ooms : "") + (r.restarts ? " · restart ×" + r.restarts : "") })),
      el("td", { text: intText(r.last_step) }), el("td", { text: clock(r.last_ts) }),
      el("td", { text: gib(r.headroom_bytes) }), el("td", { text: gib(r.held_at_failure_bytes) }),
      el("td", { text: gib(r.headroom_at_failure_bytes) }),
      el("td", null, snaps.has(r.rank) ? snapshotLink(snaps.get(r.rank), snaps.get(r.rank).trigger + " · step " + snaps.get(r.rank).step) : "—")))))));
  const foreign = (pm.ranks || []).filter((r) => (r.foreign_processes || []).length);
  if (foreign.length) {
    append(box, el("ul", { class: "pm-foreign", id: "pm-foreign" }, foreign.flatMap((r) => r.foreign_processes.map((p) =>
      el("li", { dataset: { rank: r.rank, pid: p.pid }, text: "rank " + r.rank + ": " + p.summary })))));
  }
}

/** Refresh the snapshot list and, when the run needs one, the post-mortem. Routes a
 * collector lacks hide their part (404 "Not Found" from the route check). */
export async function refreshEvidence() {
  const panel = $("evidence-panel");
  if (!panel || S.evidenceMissing) return;
  const gen = S.gen;
  let list;
  try {
    list = await getSnapshots(S.run);
  } catch (err) {
    if (err instanceof ApiError && err.status === 404 && err.message === "Not Found") { S.evidenceMissing = true; panel.hidden = true; return; }
    throw err;
  }
  if (gen !== S.gen) return;
  drawSnapshots(list);
  if (!isNum(S.suspectsTick) || S.tick - S.suspectsTick >= SUSPECTS_EVERY) {
    S.suspectsTick = S.tick;
    const suspects = await getSuspects(S.run);
    if (gen !== S.gen) return;
    drawSuspects(suspects);
  }
  // the post-mortem replays the run on the collector: at most every PM_EVERY polls, and at once
  // when a rank died since the last one
  const reason = postmortemReason();
  if (!reason) { $("postmortem").hidden = true; S.pmReason = ""; return; }
  if (reason === S.pmReason && isNum(S.pmTick) && S.tick - S.pmTick < PM_EVERY) return;
  S.pmTick = S.tick;
  S.pmReason = reason;
  let pm;
  try {
    pm = await getPostmortem(S.run);
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) return;
    throw err;
  }
  if (gen === S.gen) drawPostmortem(pm);
}
