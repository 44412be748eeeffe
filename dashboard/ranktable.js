/* The verdict table: one row per rank, worst first, updated in place.
 *
 * Rows are DOM nodes kept per rank and refreshed cell by cell (a cell whose text did not
 * change is not touched). Past VIRTUAL_MIN rows only the rows in view (plus a margin) are
 * in the DOM, between two spacer rows, so 512 or 1024 ranks cost what 40 do. While the
 * pointer is over the table a poll does not re-sort: the row under the cursor stays put
 * (sorting, filtering and selecting re-sort at once). */

import { clock, duration, gib, intText, isNum, MIB, rankKey, slopeText } from "./format.js";
import { $, append, clear, el, setText } from "./dom.js";
import { S, vocab } from "./state.js";
import {
  checkpointPeak, filterWords, isLowHeadroom, lowHeadroomText, scopeText, sortRanks, stateOf, statesBySeverity, totalOf,
  verdictOf,
} from "./verdict.js";
import { compareSet } from "./compare.js";

const VIRTUAL_MIN = 80;
const OVERSCAN = 12;
const hooks = { select: () => {}, compare: () => {} };

export function stripHooks(h) { Object.assign(hooks, h); }

function columns() {
  const hd = vocab.headroom || {};
  // figures side by side share a scope: the checkpoint peak and headroom are the same (latest) checkpoint's
  const scope = (figure, tip) => tip + (scopeText(figure) ? " — " + scopeText(figure) : "");
  return [
    { key: null, title: "cmp", tip: "compare this rank in the overlay chart" },
    { key: "rank", title: "Rank", num: true },
    { key: "host", title: "Host" },
    { key: "state", title: "State", tip: "engine state, and what happened to the process: OOM, restart, silent, exited" },
    { key: "plateau", title: "Plateau", num: true, tip: scope("plateau_bytes", "reserved memory on the current plateau (the last one before a break)") },
    { key: "headroom", title: "Headroom", num: true, tip: scope("headroom_bytes", hd.headroom_bytes || "headroom at the latest training step") },
    { key: "ckpt", title: "Ckpt peak", num: true, tip: scope("checkpoint_peak_bytes", "peak allocated at the latest checkpoint") },
    { key: "ckpt_headroom", title: "Ckpt headroom", num: true, tip: scope("checkpoint_headroom_bytes", hd.checkpoint_headroom_bytes || "headroom at the latest checkpoint's peak") },
    { key: "slope", title: "Slope", num: true, tip: scope("slope_bytes_per_step", "growth per step at step boundaries (leak or rising)") },
    { key: "oom", title: "OOM in", num: true, tip: "projected time (and steps) until the device is full; for a dead rank, how and when it died" },
    { key: "outside", title: "Outside torch", num: true, tip: scope("outside_allocator_bytes", "NVML used − reserved: CUDA context, NCCL, other libraries") },
    { key: "step", title: "Last step", num: true },
  ];
}

function buildHead(table) {
  const thead = table.tHead;
  const tr = el("tr");
  for (const c of columns()) {
    const th = el("th", { class: (c.num ? "num " : "") + (c.key ? "sortable" : ""), title: c.tip || null, dataset: { key: c.key || "" }, text: c.title });
    if (c.key) th.addEventListener("click", () => {
      if (S.sort.key === c.key || (S.sort.key === "severity" && c.key === "state")) S.sort.dir = -S.sort.dir;
      else S.sort = { key: c.key, dir: ["rank", "host", "headroom", "ckpt_headroom", "oom"].includes(c.key) ? 1 : -1 };
      drawStrip({ user: true });
    });
    tr.appendChild(th);
  }
  thead.appendChild(tr);
  thead.appendChild(el("tr", { class: "vspace", "aria-hidden": "true" }, el("td", { colspan: 12 })));
  if (!table.tFoot) table.appendChild(el("tfoot"));
  table.tFoot.appendChild(el("tr", { class: "vspace", "aria-hidden": "true" }, el("td", { colspan: 12 })));
  const wrap = table.parentElement;
  wrap.addEventListener("mouseenter", () => { S.stripHover = true; });
  wrap.addEventListener("mouseleave", () => { S.stripHover = false; drawStrip(); });
  let pending = false;
  wrap.addEventListener("scroll", () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; renderWindow(); });
  }, { passive: true });
}

function oomText(r) {
  const v = verdictOf(r), d = r.vw.death;
  if (d) return "died: " + d.how + " · step " + intText(d.step) + " · " + clock(d.ts) + (d.said ? " · " + d.said : "");
  if (isNum(v.seconds_to_oom)) return duration(v.seconds_to_oom) + " (" + intText(v.steps_to_oom) + " steps)";
  if (isNum(v.steps_to_oom)) return intText(v.steps_to_oom) + " steps";
  return "—";
}

function stateCell(r) {
  const v = verdictOf(r), vw = r.vw;
  const flags = [];
  if (v.fragmentation && stateOf(r) !== "fragmentation") flags.push(["frag", "flag", "fragmentation: reserved − allocated growing, allocator retries"]);
  if (vw.ooms) flags.push(["OOM ×" + vw.ooms, "flag oom", "the allocator ran out of memory on this rank (kept until the run ends)"]);
  if (vw.suspectedOoms) flags.push(["suspected OOM ×" + vw.suspectedOoms, "flag oom", "its memory vanished from the device "
    + "near full or at the top of a climb: an OOM suspected from device memory alone, not confirmed (no OOM counter)"]);
  if (vw.restarts) flags.push(["restart ×" + vw.restarts, "flag restart", "the process on this rank restarted"]);
  if (vw.liveness && vw.liveness !== "live") flags.push([vw.liveness, "flag " + vw.liveness, (vocab.liveness_meaning || {})[vw.liveness] ||
    vw.liveness]);
  // a plateau re-levelled by a checkpoint is normal: said in the badge's tooltip, not flagged
  const sig = vw.shown + "|" + flags.map((f) => f[0]).join("|");
  return { sig, build: (td) => {
    clear(td);
    append(td, el("span", { class: "badge", dataset: { state: vw.shown }, title: vw.title, text: vw.shown === "unknown" ? "no verdict" : vw.shown }));
    for (const [text, cls, tip] of flags) append(td, " ", el("span", { class: cls, title: tip, text }));
  } };
}

function makeRow(r) {
  const key = rankKey(r.host, r.rank);
  const box = el("input", { type: "checkbox", "aria-label": "compare rank " + r.rank, title: "compare in the overlay chart" });
  box.addEventListener("click", (ev) => { ev.stopPropagation(); hooks.compare(key, box.checked); });
  // a row is focusable and opens with Enter or Space, as it opens with a click
  const tr = el("tr", { dataset: { rank: r.rank, host: r.host }, tabindex: "0", "aria-label": "rank " + r.rank + " on " + r.host });
  tr.addEventListener("click", () => hooks.select(tr.__row));
  tr.addEventListener("keydown", (ev) => {
    if (ev.target !== tr || (ev.key !== "Enter" && ev.key !== " ")) return;
    ev.preventDefault();
    hooks.select(tr.__row);
  });
  tr.appendChild(el("td", null, box));
  for (let i = 1; i < 12; i++) tr.appendChild(el("td"));
  tr.cells[2].className = "name";
  tr.cells[3].className = "state";
  return tr;
}

function fillRow(tr, r, cmp, sel) {
  tr.__row = r;
  const v = verdictOf(r);
  const c = tr.cells;
  const total = totalOf(r);
  const head = (b) => "num" + (isLowHeadroom(b, total) ? " bad" : "");
  const leaking = r.vw.shown === "leak" || r.vw.shown === "rising";
  const isSel = !!sel && sel.rank === r.rank && sel.host === r.host;
  if (tr.classList.contains("selected") !== isSel) tr.classList.toggle("selected", isSel);
  if (tr.dataset.state !== stateOf(r)) tr.dataset.state = stateOf(r);
  c[0].firstChild.checked = cmp.has(rankKey(r.host, r.rank));
  setText(c[1], r.rank); c[1].className = "num";
  setText(c[2], r.host); c[2].title = r.host;
  const st = stateCell(r);
  if (c[3].dataset.sig !== st.sig) { c[3].dataset.sig = st.sig; st.build(c[3]); }
  setText(c[4], gib(v.plateau_bytes)); c[4].className = "num";
  setText(c[5], gib(v.headroom_bytes)); c[5].className = head(v.headroom_bytes);
  setText(c[6], gib(checkpointPeak(r))); c[6].className = "num";
  setText(c[7], gib(v.checkpoint_headroom_bytes)); c[7].className = head(v.checkpoint_headroom_bytes);
  const showSlope = leaking || (isNum(v.slope_bytes_per_step) && Math.abs(v.slope_bytes_per_step) >= MIB);
  setText(c[8], showSlope ? slopeText(v.slope_bytes_per_step) : "—"); c[8].className = "num" + (leaking ? " bad" : " muted");
  const oom = oomText(r);
  setText(c[9], oom); c[9].className = "num" + (oom !== "—" ? " bad" : " muted");
  const range = oom !== "—" && !r.vw.death && isNum(v.seconds_to_oom_low) && isNum(v.seconds_to_oom_high)
    ? "80 % range: " + duration(v.seconds_to_oom_low) + " to " + duration(v.seconds_to_oom_high) : "";
  if (c[9].title !== range) c[9].title = range;  // the forecast's spread (the engine's), on hover
  setText(c[10], gib(v.outside_allocator_bytes)); c[10].className = "num";
  setText(c[11], intText(r.last_step)); c[11].className = "num";
}

/** The rows in table order: sorted and filtered; a poll under the cursor keeps the old order. */
function ordered(user) {
  const filter = ($("strip-filter").value || "").trim().toLowerCase();
  let rows = S.ranks;
  if (filter) rows = rows.filter((r) => String(r.rank) === filter || r.host.toLowerCase().includes(filter) || filterWords(r).includes(filter));
  const keep = !user && S.stripHover && S.stripOrder && S.stripFilter === filter;
  if (keep) {
    const pos = new Map(S.stripOrder.map((k, i) => [k, i]));
    rows = rows.slice().sort((a, b) => (pos.get(rankKey(a.host, a.rank)) ?? 1e9) - (pos.get(rankKey(b.host, b.rank)) ?? 1e9));
  } else rows = sortRanks(rows, S.sort.key, S.sort.dir);
  S.stripOrder = rows.map((r) => rankKey(r.host, r.rank));
  S.stripFilter = filter;
  return rows;
}

/** Redraw the table. ``user``: a sort, filter or selection (re-sort even under the cursor);
 * ``reveal``: scroll the selected rank into view. */
export function drawStrip(opts) {
  const table = $("verdict-strip");
  if (!table || !S.ranks) return;
  const o = opts || {};
  if (!table.tHead.rows.length) buildHead(table);
  for (const th of table.tHead.rows[0].cells) {
    const key = th.dataset.key;
    const sortKey = S.sort.key === "severity" ? "state" : S.sort.key;
    if (key && key === sortKey) th.setAttribute("aria-sort", S.sort.dir < 0 ? "descending" : "ascending");
    else th.removeAttribute("aria-sort");
  }
  S.stripRows = ordered(o.user);
  if (o.reveal && S.selected) {
    const idx = S.stripRows.findIndex((r) => r.rank === S.selected.rank && r.host === S.selected.host);
    const wrap = table.parentElement;
    const h = S.rowHeight || 29;
    if (idx >= 0 && (idx * h < wrap.scrollTop || (idx + 1) * h > wrap.scrollTop + wrap.clientHeight - h)) {
      wrap.scrollTop = Math.max(0, idx * h - wrap.clientHeight / 2);
    }
  }
  renderWindow();
  drawFoot();
}

function renderWindow() {
  const table = $("verdict-strip");
  if (!table || !S.stripRows) return;
  const rows = S.stripRows;
  const wrap = table.parentElement;
  const virtual = rows.length > VIRTUAL_MIN;
  const h = S.rowHeight || 29;
  let first = 0, last = rows.length;
  if (virtual) {
    first = Math.max(0, Math.floor(wrap.scrollTop / h) - OVERSCAN);
    last = Math.min(rows.length, first + Math.ceil((wrap.clientHeight || 300) / h) + 2 * OVERSCAN);
  }
  const pool = S.rowPool || (S.rowPool = new Map());
  const cmp = compareSet();
  const tbody = table.tBodies[0];
  const want = [];
  for (let i = first; i < last; i++) {
    const r = rows[i];
    const key = rankKey(r.host, r.rank);
    let tr = pool.get(key);
    if (!tr) { tr = makeRow(r); pool.set(key, tr); }
    fillRow(tr, r, cmp, S.selected);
    want.push(tr);
  }
  // put the wanted rows in order, moving only those out of place
  let cursor = tbody.firstChild;
  for (const tr of want) {
    if (cursor === tr) { cursor = cursor.nextSibling; continue; }
    tbody.insertBefore(tr, cursor);
  }
  while (cursor) { const next = cursor.nextSibling; tbody.removeChild(cursor); cursor = next; }
  if (want.length && !S.rowHeight) S.rowHeight = want[0].getBoundingClientRect().height || 29;
  table.tHead.rows[1].cells[0].style.height = virtual ? first * (S.rowHeight || h) + "px" : "0px";
  table.tFoot.rows[0].cells[0].style.height = virtual ? (rows.length - last) * (S.rowHeight || h) + "px" : "0px";
}

function drawFoot() {
  const foot = $("strip-foot");
  clear(foot);
  const counts = {};
  let silent = 0, oom = 0, dead = 0;
  for (const r of S.ranks) {
    counts[r.vw.shown] = (counts[r.vw.shown] || 0) + 1;
    if (r.vw.liveness === "silent") silent++;
    if (r.vw.liveness === "dead") dead++;
    if (r.vw.ooms) oom++;
  }
  const matching = S.stripRows.length;
  append(foot, el("span", { text: (matching < S.ranks.length ? matching + " matching of " : "") + S.ranks.length + " ranks" +
    (matching > VIRTUAL_MIN ? " · scroll for more" : "") }));
  for (const k of statesBySeverity(Object.keys(counts))) {
    append(foot, el("span", null, el("span", { class: "badge", dataset: { state: k }, text: k }), " " + counts[k]));
  }
  if (dead) append(foot, el("span", null, el("span", { class: "flag dead", text: "dead" }), " " + dead));
  if (silent) append(foot, el("span", null, el("span", { class: "flag silent", text: "silent" }), " " + silent));
  if (oom) append(foot, el("span", null, el("span", { class: "flag oom", text: "OOM" }), " " + oom));
  const low = lowHeadroomText();
  if (low) append(foot, el("span", { class: "muted", text: "red headroom: " + low }));
}
