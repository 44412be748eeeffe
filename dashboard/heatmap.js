/* Ranks × steps: the worst value of each bucket per rank. By default a cell is coloured by
 * its headroom's deviation from the run's median in that bucket, so one bad rank stands out
 * among 512 healthy ones, and cells under the low-headroom threshold (from /api/v1/meta) are
 * coloured danger whatever their peers do. A click on a row opens that rank. */

import { GIB, chartMs, intText, isNum } from "./format.js";
import { $, markOnce, nextTask, timed } from "./dom.js";
import { plotlyReady, source } from "./api.js";
import { S, vocab } from "./state.js";
import { totalOf } from "./verdict.js";
import { PLOT_CONFIG, TICKS_AS_DRAWN, baseLayout, chartTheme, inTwoTasks, xAxis } from "./chartbase.js";

export const HEAT_MODES = [
  ["deviation", "vs run median"], ["baseline", "vs own baseline"], ["headroom", "headroom"], ["reserved", "reserved"],
];
// modes coloured by a difference from a reference (the bucket's run median, or the rank's own
// median over the range: a rank that always holds 2 GB more than its peers, as rank 0 does,
// stays neutral in "baseline" and turns red only where it departs from itself)
const RELATIVE = new Set(["deviation", "baseline"]);
const DANGER = "#67000d";
// deviation: red below the median (less headroom than the peers), neutral at it, blue above
// (zmin is the danger value, -span sits at 0.1 and the median, 0, at 0.55 of the scale)
function deviationScale(neutral) {
  // a narrow neutral band around the median (±0.16 of the span): rank-to-rank noise stays calm
  return [[0, DANGER], [0.09, DANGER], [0.1, "#d73027"], [0.3, "#fc8d59"], [0.48, neutral], [0.62, neutral], [0.8, "#91bfdb"],
    [1, "#4575b4"]];
}
const HEADROOM_SCALE = [[0, DANGER], [0.09, DANGER], [0.1, "#e66101"], [0.3, "#fdb863"], [0.6, "#80cdc1"], [1, "#1b7f79"]];
const RESERVED_SCALE = [[0, "#0d0887"], [0.5, "#9c179e"], [0.8, "#ed7953"], [1, "#f0f921"]];

// Past 256 ranks a row is about a pixel tall and plotly colours every cell one by one through
// its d3 colour scale (~80 ns a cell) before PNG-encoding the image: 100 buckets (~6 px each)
// instead of the collector's 240 keep that drawing task near 30 ms at 512 ranks. The rank
// chart has the detail; the heatmap is there to find the row.
const BIG_RUN = 256;
const BIG_RUN_COLS = 100;

export function refreshHeatmap(onRowClick) {
  const gen = S.gen, mode = S.heatMode, x = S.x;
  const field = mode === "reserved" ? "reserved" : "headroom";
  const current = () => gen === S.gen && mode === S.heatMode && x === S.x;
  const cols = S.ranks && S.ranks.length > BIG_RUN ? BIG_RUN_COLS : undefined;
  return Promise.all([source.heatmap(S.run, field, x, cols), plotlyReady]).then(([h]) => {
    if (!current()) return null;
    // the colour grid (512 ranks x the buckets) in a few tasks, then plotly's drawing in its own
    return heatmapFigure(h, mode).then((fig) => nextTask().then(() => {
      if (current()) timed("heatmap", () => drawHeatmap(fig, mode, onRowClick));
    }));
  }, (err) => {
    if (gen !== S.gen) return;
    $("heatmap-note").textContent = "heatmap unavailable: " + (err.message || err);
  });
}

const COLS_PER_TASK = 60; // column medians of 512 ranks: a few ms per task
const ROWS_PER_TASK = 128; // colour and hover values of up to 240 buckets per row

/** Run ``fn(i)`` for i in [0, n), ``per`` at a time, each batch its own task (timed as ``name``). */
async function inTasks(name, n, per, fn) {
  for (let i0 = 0; i0 < n; i0 += per) {
    if (i0) await nextTask();
    timed(name, () => { for (let i = i0; i < Math.min(n, i0 + per); i++) fn(i); });
  }
}

/**
 * Colour values. Deviation mode: the cell's headroom minus its bucket's median over ranks,
 * squashed by span·tanh(d/span) into (−span, span) (order kept, so the most deviant cell is
 * still the lowest; hover shows the real numbers), with span set by the deviations of the
 * latest quarter of the run, what the ranks do now. A cell under the low-headroom threshold
 * gets zmin, below every other value: the danger colour, whatever its peers do. Also the
 * hover values per cell ([value, deviation]). Split into tasks (inTasks): at 512 ranks x
 * 240 buckets it is 120k cells.
 */
function median(values, n) {
  if (!n) return null;
  const sorted = values.subarray(0, n).sort(); // typed: numeric order, no comparator calls
  const m = n >> 1;
  return n % 2 ? sorted[m] : (sorted[m - 1] + sorted[m]) / 2;
}

/** The reference a cell is compared with: ``ref(i, j)``, the median of bucket j over the ranks,
 * or (``own``) the median of rank i over its buckets. Computed in tasks: O(cells log). */
async function references(h, own) {
  const rows = h.z.length, cols = h.x.length;
  const scratch = new Float64Array(Math.max(rows, cols));
  if (own) {
    const base = new Array(rows).fill(null);
    await inTasks("heatmap-grid", rows, ROWS_PER_TASK, (i) => {
      let n = 0;
      for (const v of h.z[i]) if (isNum(v)) scratch[n++] = v;
      base[i] = median(scratch, n);
    });
    return (i) => base[i];
  }
  const med = new Array(cols).fill(null);
  await inTasks("heatmap-grid", cols, COLS_PER_TASK, (j) => {
    let n = 0;
    for (let i = 0; i < rows; i++) { const v = h.z[i][j]; if (isNum(v)) scratch[n++] = v; }
    med[j] = median(scratch, n);
  });
  return (i, j) => med[j];
}

async function colourGrid(h, mode, dangerGiB) {
  const rows = h.z.length, cols = h.x.length;
  const custom = new Array(rows);
  if (mode === "reserved") {
    await inTasks("heatmap-grid", rows, ROWS_PER_TASK, (i) => { custom[i] = h.z[i].map((v) => [v, null]); });
    return { z: h.z, zmin: undefined, zmax: undefined, custom };
  }
  const ref = await references(h, mode === "baseline");
  let recent = 0, top = 0;
  const from = Math.floor(cols * 0.75);
  for (let i = 0; i < rows; i++) {
    const row = h.z[i];
    for (let j = 0; j < cols; j++) {
      const v = row[j];
      if (!isNum(v)) continue;
      if (v > top) top = v;
      const m = ref(i, j);
      if (j >= from && m !== null) recent = Math.max(recent, Math.abs(v - m));
    }
  }
  const span = Math.max(0.5, recent / 2);
  let zmin, zmax;
  if (RELATIVE.has(mode)) { zmax = span; zmin = -span - (2 * span) / 9; } else {
    zmax = Math.max(top, 1);
    zmin = -zmax / 9;
  }
  const z = new Array(rows);
  await inTasks("heatmap-grid", rows, ROWS_PER_TASK, (i) => {
    const danger = dangerGiB[i];
    const dev = h.z[i].map((v, j) => { const m = ref(i, j); return isNum(v) && m !== null ? v - m : null; });
    z[i] = h.z[i].map((v, j) => {
      if (!isNum(v)) return null;
      if (isNum(danger) && v < danger) return zmin;
      return RELATIVE.has(mode) ? (dev[j] === null ? null : span * Math.tanh(dev[j] / span)) : Math.max(v, 0);
    });
    custom[i] = h.z[i].map((v, j) => [v, dev[j]]);
  });
  return { z, zmin, zmax, custom };
}

/** The heatmap's trace and layout: colour grid, hover data, colour bar, the selected row. */
async function heatmapFigure(h, mode) {
  const t = chartTheme();
  const rowsByRank = {};
  const uniqueRanks = new Set(h.rows.map((r) => r.rank)).size === h.rows.length;
  // y is the rank number (ranks are unique within a run); duplicates fall back to row index
  const ys = h.rows.map((r, i) => { const y = uniqueRanks ? r.rank : i; rowsByRank[y] = r; return y; });
  const xs = h.x.map((x) => (S.x === "time" ? chartMs(x) : x));
  const totals = {};
  for (const r of S.ranks || []) totals[r.host + "\u0000" + r.rank] = totalOf(r);
  const fraction = vocab.low_headroom_fraction;
  const dangerGiB = h.rows.map((r) => {
    const total = totals[r.host + "\u0000" + r.rank];
    return isNum(fraction) && isNum(total) ? (fraction * total) / GIB : null;
  });
  const grid = await colourGrid(h, mode, dangerGiB);
  const custom = grid.custom;
  const isHeadroom = mode !== "reserved";
  const against = mode === "baseline" ? "its own median" : "the run's median";
  const colorbar = { title: { text: RELATIVE.has(mode) ? (mode === "baseline" ? "vs own GiB" : "vs median GiB") : mode + " GiB", side: "right", font: { color: t.muted, size: 11 } },
    tickfont: { color: t.muted }, thickness: 12, outlinewidth: 0, ...TICKS_AS_DRAWN };
  if (isHeadroom) {
    const s = grid.zmax;
    colorbar.tickvals = RELATIVE.has(mode) ? [grid.zmin, -0.76 * s, 0, 0.76 * s] : [grid.zmin, s / 2, s];
    colorbar.ticktext = RELATIVE.has(mode) ? ["danger", "−" + s.toFixed(1), mode === "baseline" ? "own" : "median", "+" + s.toFixed(1)]
      : ["danger", (s / 2).toFixed(0), s.toFixed(0)];
  }
  const trace = {
    type: "heatmap", x: xs, y: ys, z: grid.z, customdata: custom, zmin: grid.zmin, zmax: grid.zmax,
    colorscale: RELATIVE.has(mode) ? deviationScale(t.heatNeutral || "#e6f0e9") : mode === "headroom" ? HEADROOM_SCALE : RESERVED_SCALE,
    hoverongaps: false, xgap: 0, ygap: h.rows.length <= 64 ? 1 : 0, colorbar,
    hovertemplate: (uniqueRanks ? "rank %{y}" : "row %{y}") + "<br>" + (S.x === "time" ? "%{x|%Y-%m-%d %H:%M:%S}" : "step %{x:,d}") + "<br>" +
      (isHeadroom ? "min headroom %{customdata[0]:.2f} GiB<br>%{customdata[1]:+.2f} GiB vs " + against : "max reserved %{customdata[0]:.2f} GiB") +
      "<extra></extra>",
  };
  const layout = baseLayout(t, {
    uirevision: "heat|" + S.run + "|" + S.x + "|" + mode,
    hovermode: "closest", showlegend: false,
    plot_bgcolor: t.nodata, // gaps (no sample in that bucket) show as this, explained in the note
    xaxis: xAxis(t, { showgrid: false }),
    yaxis: { ...TICKS_AS_DRAWN, autorange: "reversed", tickfont: { color: t.muted }, title: { text: "rank", font: { color: t.muted, size: 11 }, standoff: 2 },
      tickformat: "d", gridcolor: "rgba(0,0,0,0)", zeroline: false, nticks: Math.min(h.rows.length, 20),
      tickvals: h.rows.length <= 40 ? ys : undefined }, // few rows: label every one; many: plotly thins them
    margin: { l: 52, r: 8, t: 8, b: 40 },
  });
  if (S.selected && uniqueRanks) {
    const sy = S.selected.rank;
    layout.shapes = [{ type: "rect", xref: "paper", x0: 0, x1: 1, yref: "y", y0: sy - 0.5, y1: sy + 0.5, line: { color: t.text, width: 1.5 }, name: "selected rank" }];
  }
  return { trace, layout, rows: h.rows.length, bucket: h.bucket, fraction, rowsByRank };
}

function drawHeatmap(fig, mode, onRowClick) {
  const gd = $("chart-heatmap");
  if (!gd) return;
  const tall = Math.min(720, Math.max(300, 90 + fig.rows * 14));
  if (gd.style.height !== tall + "px") gd.style.height = tall + "px";
  // no mode bar: it would sit over the first rows, where a click means "open this rank"
  window.Plotly.react(gd, [fig.trace], fig.layout, { ...PLOT_CONFIG, displayModeBar: false });
  inTwoTasks(gd);
  S.heat = { rowsByRank: fig.rowsByRank }; // what a click on a row opens, as drawn
  wireClicks(gd, onRowClick);
  markOnce("vramwatch:heatmap");
  const fraction = fig.fraction;
  const unit = intText(fig.bucket) + (S.x === "time" ? " s" : " steps");
  const threshold = isNum(fraction) ? "dark red: headroom under " + Math.round(fraction * 100) + " % of the device (the low-headroom threshold)" : "";
  const what = mode === "deviation"
    ? "Worst headroom per bucket of " + unit + ", as its difference from the run's median in that bucket: red rows have less headroom than their peers, blue more; " + threshold + "."
    : mode === "baseline" ? "Worst headroom per bucket of " + unit + ", as its difference from the same rank's own median over the range: a rank that always holds more than its peers stays neutral, red is where a rank has less headroom than it usually has; " + threshold + "."
    : mode === "headroom" ? "Worst headroom per bucket of " + unit + "; " + threshold + "."
      : "Highest reserved per bucket of " + unit + ".";
  $("heatmap-note").textContent = what + " Grey cells: no sample from that rank in that bucket (not started yet, a gap, or the rank went silent).";
}

function wireClicks(gd, onRowClick) {
  if (gd.__vwWired) return;
  gd.__vwWired = true;
  gd.on("plotly_click", (ev) => {
    const p = ev && ev.points && ev.points[0];
    if (!p || !S.heat) return;
    const row = S.heat.rowsByRank[p.y];
    if (row && onRowClick) onRowClick(row);
  });
}
