/* Two runs side by side (#/compare?a=RUN&b=RUN): per rank, plateau, peaks per phase,
 * headroom (the latest process's), step time and the OOMs, restarts and deaths of every process
 * of the rank, and the growth from A to B, from the collector's GET /api/v1/compare (the same
 * figures as `vramwatch compare` and the CI gate). */

import { gib, isNum } from "./format.js";
import { $, append, clear, el } from "./dom.js";
import { ApiError, getCompare, source } from "./api.js";
import { S } from "./state.js";

const NAMES = { plateau_bytes: "plateau", peak_bytes: "peak", min_headroom_bytes: "min headroom", step_time_s: "step time",
  ooms: "OOMs", restarts: "restarts", deaths: "deaths" };
const LIFE = new Set(["ooms", "restarts", "deaths"]);

export function compareHref(a, b) {
  const q = new URLSearchParams();
  if (a) q.set("a", a);
  if (b) q.set("b", b);
  return "#/compare" + (q.toString() ? "?" + q.toString() : "");
}

function value(name, v) {
  if (!isNum(v)) return "—";
  if (LIFE.has(name)) return String(v);
  return name.endsWith("_bytes") ? gib(v) : v.toFixed(3) + " s";
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
      el("span", { class: "hint", text: "growth is B against A; positive growth of memory is red" }),
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

function drawComparison(doc) {
  const body = $("compare-body");
  clear(body);
  const rows = (doc.metrics || []).map((m) => {
    const name = String(m.metric || m.name || "");
    const growth = isNum(m.growth) ? m.growth : isNum(m.a) && isNum(m.b) && m.a > 0 ? (m.b - m.a) / m.a : null;
    // more memory, less headroom, or more OOMs / deaths in B is worse; step time is shown, not judged
    const worse = LIFE.has(name) ? name !== "restarts" && isNum(m.a) && isNum(m.b) && m.b > m.a
      : growth !== null && (name === "min_headroom_bytes" ? growth < 0 : name.endsWith("_bytes") && growth > 0);
    return el("tr", { dataset: { rank: m.rank, metric: name, phase: m.phase } },
      el("td", { class: "num", text: m.rank }), el("td", { text: NAMES[name] || name }), el("td", { text: m.phase }),
      el("td", { class: "num", text: value(name, m.a) }), el("td", { class: "num", text: value(name, m.b) }),
      el("td", { class: "num" + (worse ? " bad" : " muted"),
        text: LIFE.has(name) ? (isNum(m.delta) && m.delta ? (m.delta > 0 ? "+" : "") + m.delta : "—")
          : growth === null ? "—" : (growth > 0 ? "+" : "") + (growth * 100).toFixed(1) + " %" }));
  });
  append(body, el("div", { class: "table-wrap" }, el("table", { class: "data", id: "compare-table" },
    el("thead", null, el("tr", null, ["Rank", "Figure", "Phase / scope", doc.a, doc.b, "Growth"].map((h, i) =>
      el("th", { class: i === 0 || i >= 3 ? "num" : null, text: h })))),
    el("tbody", null, rows))));
  const only = [];
  if ((doc.ranks_only_in_a || []).length) only.push("ranks only in " + doc.a + ": " + doc.ranks_only_in_a.join(", "));
  if ((doc.ranks_only_in_b || []).length) only.push("ranks only in " + doc.b + ": " + doc.ranks_only_in_b.join(", "));
  if (only.length) append(body, el("p", { class: "muted", text: only.join(" · ") }));
}
