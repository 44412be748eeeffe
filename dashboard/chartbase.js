/* What every plotly chart shares: the theme (read back from the CSS variables), axes,
 * the plot config, and the step <-> wall-time mapping of the selected rank. */

import { chartMs, chartTs, rankKey, timeZoneLabel } from "./format.js";
import { cssVar, nextTask } from "./dom.js";
import { S } from "./state.js";

// Read back once per theme: getComputedStyle on every redraw costs a few ms each time.
let themeCache = { key: null, value: null };

export function chartTheme() {
  const key = document.documentElement.dataset.theme || "";
  if (themeCache.key === key && themeCache.value) return themeCache.value;
  const v = (name) => cssVar(name);
  themeCache = { key, value: {
    text: v("--text"), muted: v("--muted"), grid: v("--grid"), panel: v("--panel"), border: v("--border"),
    nodata: v("--nodata"), heatNeutral: v("--heat-neutral"),
    allocated: v("--c-allocated"), reserved: v("--c-reserved"), peak: v("--c-peak"), nvml: v("--c-nvml"),
    total: v("--c-total"), gap: v("--c-gap"), plateau: v("--c-plateau"), proj: v("--c-proj"), ckpt: v("--c-ckpt"),
    ckptLine: v("--c-ckpt-line"), evalFill: v("--c-eval"), evalLine: v("--c-eval-line"), leak: v("--s-leak"),
    frag: v("--s-fragmentation"), rising: v("--s-rising"), ratchet: v("--s-ratchet"), warmup: v("--s-warmup"),
  } };
  return themeCache.value;
}

export function baseLayout(t, extra) {
  return {
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    font: { color: t.text, size: 12, family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif" },
    margin: { l: 64, r: 14, t: 10, b: 40 },
    hovermode: "x unified",
    hoverlabel: { bgcolor: t.panel, bordercolor: t.border, font: { color: t.text } },
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", bgcolor: "rgba(0,0,0,0)" },
    showlegend: true,
    ...extra,
  };
}

// Tick labels are left where plotly puts them: the margins hold them, and plotly's default
// ("hide past div") measures every label again for every label drawn, a few ms a redraw.
export const TICKS_AS_DRAWN = { ticklabeloverflow: "allow" };

export function xAxis(t, extra) {
  const time = S.x === "time";
  return { ...TICKS_AS_DRAWN,
    gridcolor: t.grid, zerolinecolor: t.grid, linecolor: t.border, tickfont: { color: t.muted },
    title: { text: time ? "wall time · " + timeZoneLabel() : "step", font: { color: t.muted, size: 11 }, standoff: 4 },
    type: time ? "date" : "linear", hoverformat: time ? "%Y-%m-%d %H:%M:%S" : ",d", tickformat: time ? "" : "~s",
    ...extra,
  };
}

export function yAxis(t, extra) {
  return { ...TICKS_AS_DRAWN, gridcolor: t.grid, zerolinecolor: t.grid, linecolor: t.border, tickfont: { color: t.muted }, ticksuffix: " GiB",
    rangemode: "tozero", ...extra };
}

// Nothing leaves the machine from a chart: PNG export stays; plotly's cloud actions ("Share
// chart...", which uploads the figure to chart-studio, and its Chart Studio links in other
// plotly versions) are off, and have no server to go to. Every chart (dashboard and report)
// takes its config from here.
export const NO_CLOUD = { showSendToCloud: false, showEditInChartStudio: false, showLink: false, plotlyServerURL: "" };
// The mode bar shows on hover, top right, over the plot's margin (never over heatmap rows:
// the heatmap has none, a click there opens a rank).
export const PLOT_CONFIG = { ...NO_CLOUD, displaylogo: false, responsive: true,
  modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d", "sendChartToCloud", "sendDataToCloud", "editInChartStudio"] };

export function uirev(which) {
  const r = S.selected;
  return which + "|" + S.run + "|" + (r ? rankKey(r.host, r.rank) : "") + "|" + S.x;
}

/** Linear interpolation of ys at v over sorted xs (extrapolating from the end segments). */
export function interp(xs, ys, v) {
  const n = xs.length;
  if (!n) return null;
  if (v <= xs[0]) return ys[0] + (n > 1 && xs[1] !== xs[0] ? (v - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]) : 0);
  if (v >= xs[n - 1]) {
    const slope = n > 1 && xs[n - 1] !== xs[n - 2] ? (ys[n - 1] - ys[n - 2]) / (xs[n - 1] - xs[n - 2]) : 0;
    return ys[n - 1] + (v - xs[n - 1]) * slope;
  }
  let lo = 0, hi = n - 1;
  while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (xs[mid] <= v) lo = mid; else hi = mid; }
  const span = xs[hi] - xs[lo];
  return span ? ys[lo] + (v - xs[lo]) * (ys[hi] - ys[lo]) / span : ys[lo];
}

/** A step as the chart's x value (the step, or epoch milliseconds on the wall-time axis). */
export function stepToX(step, ts) {
  if (S.x !== "time") return step;
  if (typeof ts === "number" && isFinite(ts)) return chartMs(ts);
  const m = S.stepTs;
  return m ? chartMs(interp(m.steps, m.ts, step)) : null;
}

export function xToStep(x) {
  if (S.x !== "time") return Number(x);
  const text = String(x);
  const ms = typeof x === "number" ? x : Date.parse(text.replace(" ", "T") + (/[zZ]|[+-]\d\d:?\d\d$/.test(text) ? "" : "Z"));
  const m = S.stepTs;
  return m ? interp(m.ts, m.steps, chartTs(ms)) : null;
}

export function medianStepSeconds() {
  const m = S.stepTs;
  if (!m || m.steps.length < 2) return 1;
  const n = m.steps.length;
  const dt = (m.ts[n - 1] - m.ts[0]) / Math.max(1, m.steps[n - 1] - m.steps[0]);
  return dt > 0 ? dt : 1;
}

/**
 * Stack labels that would overlap: each label gets the lowest row whose previous label ends
 * far enough to its left (``minGap`` in x units). Returns the row per label, in input order.
 */
export function labelRows(xs, minGap, maxRows) {
  const order = xs.map((x, i) => i).sort((a, b) => xs[a] - xs[b]);
  const rowEnds = [];
  const rows = new Array(xs.length);
  for (const i of order) {
    let row = rowEnds.findIndex((end) => xs[i] - end >= minGap);
    if (row < 0) row = rowEnds.length < maxRows ? rowEnds.length : rowEnds.indexOf(Math.min(...rowEnds));
    rowEnds[row] = xs[i];
    rows[i] = row;
  }
  return rows;
}

/**
 * What a redraw must redo in full: every trace attribute but ``x`` / ``y``, and the layout
 * but the x range (shapes and annotations included: plotly redraws the whole figure for any
 * edit of one of them anyway). Equal signatures mean only data and the x range moved. Cost:
 * one JSON.stringify of the figure without its arrays (a few KB).
 */
export function figureSignature(traces, layout) {
  const bare = traces.map((t) => { const { x, y, ...rest } = t; return rest; });
  const { xaxis, transition, ...rest } = layout;
  const ax = xaxis ? { ...xaxis, range: null } : null;
  return JSON.stringify([bare, rest, ax]);
}

/**
 * Plotly.react, cheap when only data moved. plotly's full pipeline (defaults, margins,
 * legend, axes, shapes, annotation text measuring) costs the rank chart 25-40 ms a draw on
 * an idle 2-core machine, over 50 ms under load: a long task every poll. When the figure's
 * signature (figureSignature) equals the last one drawn into ``gd``, the same react goes
 * through plotly's transition path with a zero duration: plotly then recomputes and re-plots
 * only the traces (about half the work: no legend, shapes, labels, margins); a moved axis
 * range is redrawn in a later animation frame, its own task. Anything else that changed (a
 * new checkpoint band or event label, a renamed trace, a theme switch) takes the full path.
 * Returns plotly's promise.
 */
export function drawChart(gd, traces, layout, config) {
  const sig = figureSignature(traces, layout);
  // a hidden tab runs no animation frames: a transition there would finish late, stale
  const fast = gd.__vwSig === sig && !!gd._fullLayout && (gd.data || []).length === traces.length && !gd._transitioning &&
    document.visibilityState === "visible";
  gd.__vwSig = sig;
  // the x range as drawn: the relayout that ends an axis transition reports it (zoom.js)
  gd.__vwRange = layout.xaxis && Array.isArray(layout.xaxis.range) ? layout.xaxis.range.slice() : null;
  // counted for the tests and the benchmark: which path each draw took
  const n = gd.__vwDraws || (gd.__vwDraws = { fast: 0, full: 0 });
  n[fast ? "fast" : "full"]++;
  if (!fast) { const done = window.Plotly.react(gd, traces, layout, config); inTwoTasks(gd); return done; }
  // plotly compares arrays by identity: a rebuilt marker-size or hover-text array (equal, the
  // signature says) would count as a change it cannot animate, and it would redraw in full
  // after the transition. So only x and y are new; the rest is the trace as drawn.
  const moved = traces.map((t, i) => ({ ...gd.data[i], x: t.x, y: t.y }));
  return window.Plotly.react(gd, moved, { ...layout, transition: { duration: 0 } }, config);
}

/**
 * Every later full redraw of ``gd`` in two tasks: plotly's data preparation (defaults, calc:
 * ~7 ms for the 512-rank heatmap) in the caller's, its drawing (axes, colour bar, legend,
 * traces: ~25 ms) in the next. plotly waits for the promises in ``gd._promises`` before it
 * draws (it keeps image loads there); a pending "next task" pushed when plotly announces the
 * plot (``plotly_beforeplot``, after react has emptied that queue) is one of them. Relies on
 * plotly.js internals (``gd._promises``) of the vendored bundle (4.1.1); without them plotly
 * simply draws in one task. Call after the first draw (plotly adds ``gd.on`` then).
 */
export function inTwoTasks(gd) {
  if (gd.__vwTwoTasks || typeof gd.on !== "function") return;
  gd.__vwTwoTasks = true;
  let t0 = 0;
  gd.on("plotly_beforeplot", () => {
    if (Array.isArray(gd._promises)) gd._promises.push(nextTask().then(() => { t0 = performance.now(); }));
  });
  // the drawing task, timed for the benchmark like the other pieces (dom.timed)
  gd.on("plotly_afterplot", () => {
    if (t0 && window.__vwTiming) performance.measure("vramwatch:" + gd.id.replace("chart-", "") + " drawing", { start: t0, end: performance.now() });
    t0 = 0;
  });
}
