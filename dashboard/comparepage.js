/* Two runs side by side (#/compare?a=RUN&b=RUN), from the collector's GET /api/v1/compare (the
 * same figures as `vramwatch compare` and the CI gate). It leads with what a reader asks first:
 * each run in one line (world size, what went wrong), the largest growth, and one chart with both
 * runs' peaks rank by rank; then one row per rank, the ranks that grew most first (with the OOMs,
 * restarts and deaths of every process of the rank, as the run-life model counts them). Colours mean
 * direction and size: more memory beyond the gate's tolerance is red, a smaller rise amber, less
 * memory green, no change (under 0.05 %) plain. */

import { gib, intText, isNum, toGiB } from "./format.js";
import { $, append, clear, el } from "./dom.js";
import { ApiError, getCompare, plotlyReady, source } from "./api.js";
import { S } from "./state.js";
import { PLOT_CONFIG, baseLayout, chartTheme, drawChart, yAxis } from "./chartbase.js";

const TOLERANCE = 0.03; // the gate's default (vramwatch gate --max-growth)
const UNCHANGED = 0.0005;
const TROUBLE = { oom: "oom", death: "oom", leak: "leak", fragmentation: "fragmentation", unstable: "rising", margin: "rising" };

export function compareHref(a, b) {
  const q = new URLSearchParams();
  if (a) q.set("a", a);
  if (b) q.set("b", b);
  return "#/compare" + (q.toString() ? "?" + q.toString() : "");
}

/** The growth's class: its direction (more memory is worse, for headroom less is) and size. */
export function growthClass(growth, worseWhen) {
  if (!isNum(growth) || Math.abs(growth) < UNCHANGED) return "muted";
  const worse = worseWhen === "down" ? -growth : growth;
  if (worseWhen === "never") return "muted";
  if (worse > TOLERANCE) return "bad";
  return worse > 0 ? "warn" : "good";
}

export function growthText(growth) {
  if (!isNum(growth)) return "—";
  if (Math.abs(growth) < UNCHANGED) return "±0.0 %";
  return (growth > 0 ? "+" : "−") + Math.abs(growth * 100).toFixed(1) + " %";
}

export async function renderComparePage(a, b, chrome) {
  chrome.setCrumbs([{ text: "runs", href: "#/" }, { text: "compare" }]);
  document.title = "vramwatch · compare";
  const view = $("view");
  clear(view);
  const gen = S.gen;
  let runs = [];
  try { runs = await source.runs(); } catch (err) { chrome.handleError(err); }
  if (gen !== S.gen) return;
  const pick = (id, label, current) => {
    const select = el("select", { id: id, "aria-label": label }, el("option", { value: "", text: "choose a run" }),
      runs.map((r) => el("option", { value: r.run, text: r.run })));
    select.value = current || "";
    select.addEventListener("change", () => { location.hash = compareHref($("cmp-a").value, $("cmp-b").value); });
    return select;
  };
  append(view, el("section", { class: "panel" },
    el("div", { class: "panel-head" }, el("h2", { text: "Compare two runs" }),
      el("span", { class: "hint", text: "growth is B against A; red: more memory beyond " + TOLERANCE * 100 + " %, amber: less than that, green: less memory" }),
      el("div", { class: "tools" }, el("label", { class: "tool" }, "A", pick("cmp-a", "run A", a)),
        el("label", { class: "tool" }, "B", pick("cmp-b", "run B", b)))),
    el("div", { id: "compare-body" }, el("p", { class: "muted", text: a && b ? "loading…" : "choose two runs" }))));
  chrome.setLive("live", "comparison");
  if (!a || !b) return;
  let doc;
  try {
    doc = await getCompare(a, b);
  } catch (err) {
    if (gen !== S.gen) return;
    const body = $("compare-body");
    clear(body);
    const missing = err instanceof ApiError && err.status === 404 && err.message === "Not Found";
    append(body, el("p", { class: "muted", text: missing ? "This collector has no compare route (GET /api/v1/compare); use `vramwatch compare A B`."
      : "Cannot compare: " + err.message }));
    return;
  }
  if (gen !== S.gen) return;
  drawComparison(doc);
}

function runLine(s, label) {
  const troubles = (s.troubles || []).map((c) => el("span", { class: "badge", dataset: { state: TROUBLE[c] || "unknown" }, text: c }));
  return el("div", { class: "cmp-run", dataset: { run: s.run } },
    el("strong", { text: label + " · " + s.run }),
    el("span", { class: "muted", text: " " + (isNum(s.world_size) ? intText(s.world_size) + " ranks" : "world size unknown") +
      (s.ranks !== s.world_size ? " (" + intText(s.ranks) + " compared)" : "") + " · " }),
    troubles.length ? troubles : el("span", { class: "badge", dataset: { state: "plateau" }, text: "nothing unsafe" }),
    s.worst ? el("div", { class: "muted cmp-worst", text: s.worst }) : null);
}

function summary(doc) {
  const runs = doc.runs || [];
  const top = (doc.ranks_by_growth || []).find((g) => isNum(g.growth));
  const lead = top ? el("p", { class: "cmp-lead", id: "compare-lead" }, "largest growth ",
    el("span", { class: growthClass(top.growth), text: growthText(top.growth) }),
    " · rank " + top.rank + ", " + (top.metric === "plateau_bytes" ? "plateau" : top.phase + " peak")) : null;
  return el("div", { class: "cmp-summary", id: "compare-summary" },
    runs.map((s, i) => runLine(s, i ? "B" : "A")),
    doc.world_size_mismatch ? el("p", { class: "warn-text", text: "The runs' world sizes differ: their ranks hold different shares of the job; compared rank by rank." }) : null,
    lead);
}

function byRank(doc) {
  const out = new Map();
  for (const m of doc.metrics || []) {
    if (!out.has(m.rank)) out.set(m.rank, {});
    out.get(m.rank)[m.metric + "|" + m.phase] = m;
  }
  return out;
}

function cell(m, worseWhen) {
  if (!m) return el("td", { class: "num muted", text: "—" });
  const fmt = (v) => (isNum(v) ? (m.metric === "step_time_s" ? v.toFixed(3) + " s" : gib(v)) : "—");
  return el("td", { class: "num" }, fmt(m.a) + " → " + fmt(m.b) + " ",
    el("span", { class: "growth " + growthClass(m.growth, worseWhen), text: growthText(m.growth) }));
}

/** A count of every process of the rank (vramwatch.runlife): more in B is ``worse``'s colour. */
function count(m, worse) {
  if (!m) return el("td", { class: "num muted", text: "—" });
  const a = isNum(m.a) ? m.a : 0, b = isNum(m.b) ? m.b : 0;
  return el("td", { class: "num " + (b > a ? worse : "muted"), text: intText(a) + " → " + intText(b) });
}

function drawComparison(doc) {
  const body = $("compare-body");
  clear(body);
  const ranks = byRank(doc);
  const phases = Array.from(new Set((doc.metrics || []).filter((m) => m.metric === "peak_bytes").map((m) => m.phase)))
    .sort((x, y) => (x === "train" ? -1 : y === "train" ? 1 : x < y ? -1 : 1));
  const order = (doc.ranks_by_growth || []).map((g) => g.rank);
  for (const r of ranks.keys()) if (!order.includes(r)) order.push(r);
  const growthOf = new Map((doc.ranks_by_growth || []).map((g) => [g.rank, g]));
  const head = ["Rank", "Largest growth", "Plateau", ...phases.map((p) => p + " peak"), "Min headroom", "Step time",
    "OOMs", "Restarts", "Deaths"];
  const rows = order.map((rank) => {
    const f = ranks.get(rank) || {};
    const g = growthOf.get(rank) || {};
    return el("tr", { dataset: { rank: rank } },
      el("td", { class: "num", text: rank }),
      el("td", { class: "num" }, el("span", { class: "growth " + growthClass(g.growth), text: growthText(g.growth) })),
      cell(f["plateau_bytes|train"]), ...phases.map((p) => cell(f["peak_bytes|" + p])),
      cell(f["min_headroom_bytes|process"], "down"), cell(f["step_time_s|train"], "never"),
      count(f["ooms|rank"], "bad"), count(f["restarts|rank"], "warn"), count(f["deaths|rank"], "bad"));
  });
  append(body, summary(doc), el("div", { class: "chart", id: "compare-chart" }),
    el("div", { class: "table-wrap" }, el("table", { class: "data", id: "compare-table" },
      el("thead", null, el("tr", null, head.map((h, i) => el("th", { class: i === 0 || i >= 1 ? "num" : null, text: h })))),
      el("tbody", null, rows))));
  const only = [];
  if ((doc.ranks_only_in_a || []).length) only.push("ranks only in " + doc.a + ": " + doc.ranks_only_in_a.join(", "));
  if ((doc.ranks_only_in_b || []).length) only.push("ranks only in " + doc.b + ": " + doc.ranks_only_in_b.join(", "));
  if (only.length) append(body, el("p", { class: "muted", text: only.join(" · ") }));
  drawOverlay(doc, ranks).catch(() => {});
}

/** One chart: both runs' training peak (and plateau), rank by rank, overlaid. */
async function drawOverlay(doc, ranks) {
  await plotlyReady;
  const gd = $("compare-chart");
  if (!gd) return;
  const t = chartTheme();
  const xs = Array.from(ranks.keys()).sort((p, q) => p - q);
  const series = (key, side) => toGiB(xs.map((r) => { const m = (ranks.get(r) || {})[key]; return m && isNum(m[side]) ? m[side] : null; }));
  const traces = [
    { name: doc.a + " · train peak", x: xs, y: series("peak_bytes|train", "a"), mode: "lines+markers", line: { color: t.warmup, width: 1.6 } },
    { name: doc.b + " · train peak", x: xs, y: series("peak_bytes|train", "b"), mode: "lines+markers", line: { color: t.leak, width: 1.6 } },
    { name: doc.a + " · plateau", x: xs, y: series("plateau_bytes|train", "a"), mode: "lines", line: { color: t.warmup, width: 1, dash: "dot" } },
    { name: doc.b + " · plateau", x: xs, y: series("plateau_bytes|train", "b"), mode: "lines", line: { color: t.leak, width: 1, dash: "dot" } },
  ];
  drawChart(gd, traces, baseLayout(t, {
    xaxis: { title: { text: "rank", font: { color: t.muted, size: 11 } }, gridcolor: t.grid, tickfont: { color: t.muted }, dtick: xs.length > 32 ? 8 : 1 },
    yaxis: yAxis(t, { rangemode: "normal" }), hovermode: "x unified", margin: { l: 64, r: 10, t: 10, b: 40 },
  }), PLOT_CONFIG);
}
