/* Memory by category for the selected rank (vw.watch(model, optimizer) on the hook): a stacked
 * chart of parameters, gradients, optimizer state, activations and temporaries (the step's peak
 * minus those three), the allocator's cache (reserved beyond the peak), memory outside the
 * allocator (NVML used − reserved − other processes) and other processes on the GPU. The three
 * model categories are sparse fields (sent when they change): each is carried forward from its
 * latest value. Hidden until the rank sent a category. One /chart request per refresh. */

import { gib, isNum, toGiB } from "./format.js";
import { $, el } from "./dom.js";
import { source } from "./api.js";
import { S } from "./state.js";
import { PLOT_CONFIG, baseLayout, chartTheme, drawChart, uirev, xAxis, yAxis } from "./chartbase.js";
import { CHART_FIELDS, FIELD_LABELS, SPARSE_FIELDS } from "./fields.js";

export const CAT_FIELDS = ["ts", ...CHART_FIELDS.categories];
const POINTS = 600;
/** The stack, bottom up: [key, name, colour]. */
export const LAYERS = [
  ["params", FIELD_LABELS.params_bytes || "parameters", "#3b6fb6"],
  ["grads", FIELD_LABELS.grads_bytes || "gradients", "#6c9bd8"],
  ["optimizer", FIELD_LABELS.optimizer_bytes || "optimizer state", "#8e6cc0"],
  ["activations", "activations and temporaries", "#d9822b"],
  ["cache", "allocator cache", "#9aa5b1"],
  ["outside", "outside the allocator", "#5f7d5f"],
  ["foreign", "other processes", "#c0504d"],
];

export function catPanel() {
  return el("section", { class: "panel", id: "cat-panel", hidden: true },
    el("div", { class: "panel-head" }, el("h2", { text: "Memory by category" }),
      el("span", { class: "hint", text: "parameters · gradients · optimizer state · activations · allocator cache · outside it" })),
    el("div", { class: "chart", id: "chart-categories" }), el("div", { class: "chart-note", id: "categories-note" }));
}

/** A sparse field's values carried forward (null before its first value). */
export function carried(arr) {
  const out = new Array((arr || []).length);
  let v = null;
  for (let i = 0; i < out.length; i++) { if (isNum(arr[i])) v = arr[i]; out[i] = v; }
  return out;
}

/** Per point, the bytes of each layer (null where not measured). */
export function categories(s) {
  const c = {};
  for (const f of ["params_bytes", "grads_bytes", "optimizer_bytes"]) c[f] = SPARSE_FIELDS.includes(f) ? carried(s[f]) : (s[f] || []);
  const n = (s.peak_allocated_bytes || s.allocated_bytes || c.params_bytes).length;
  const out = Object.fromEntries(LAYERS.map(([k]) => [k, new Array(n).fill(null)]));
  for (let i = 0; i < n; i++) {
    const p = c.params_bytes[i], g = c.grads_bytes[i], o = c.optimizer_bytes[i];
    if (!isNum(p)) continue;
    const held = p + (g || 0) + (o || 0);
    const peak = (s.peak_allocated_bytes || [])[i], res = (s.reserved_bytes || [])[i];
    const used = (s.nvml_used_bytes || [])[i], foreign = (s.foreign_used_bytes || [])[i];
    out.params[i] = p; out.grads[i] = g || 0; out.optimizer[i] = o || 0;
    const top = isNum(peak) ? Math.max(peak, held) : held;
    out.activations[i] = isNum(peak) ? Math.max(0, peak - held) : null;
    out.cache[i] = isNum(res) ? Math.max(0, res - top) : null;
    out.foreign[i] = isNum(foreign) ? foreign : null;
    out.outside[i] = isNum(used) && isNum(res) ? Math.max(0, used - res - (isNum(foreign) ? foreign : 0)) : null;
  }
  return out;
}

function last(arr) { for (let i = (arr || []).length - 1; i >= 0; i--) if (isNum(arr[i])) return arr[i]; return null; }

export async function refreshCategories() {
  const panel = $("cat-panel");
  const r = S.selected;
  if (!panel || !r) return;
  const gen = S.gen;
  let d;
  try {
    d = await source.series(S.run, r, CAT_FIELDS, { points: POINTS });
  } catch (err) {
    if (err && err.status === 404) { panel.hidden = true; return; }
    throw err;
  }
  if (gen !== S.gen || !S.selected || S.selected.rank !== r.rank || S.selected.host !== r.host) return;
  const cats = categories(d.series);
  panel.hidden = !cats.params.some(isNum);
  if (panel.hidden) return;
  const t = chartTheme();
  const xs = d.x;
  const traces = LAYERS.filter(([k]) => cats[k].some(isNum)).map(([k, name, color]) => ({
    name, x: xs, y: toGiB(cats[k]), mode: "lines", stackgroup: "cat", line: { color, width: 1 }, fillcolor: color,
    hovertemplate: "%{y:.2f} GiB",
  }));
  drawChart($("chart-categories"), traces, baseLayout(t, {
    uirevision: uirev("categories"), xaxis: xAxis(t, { type: "linear", title: { text: "step" } }), yaxis: yAxis(t),
    margin: { l: 64, r: 14, t: 40, b: 40 },
  }), PLOT_CONFIG);
  $("categories-note").textContent = "Rank " + r.rank + " now: " +
    LAYERS.filter(([k]) => isNum(last(cats[k]))).map(([k, name]) => name + " " + gib(last(cats[k]))).join(", ") + ".";
}
