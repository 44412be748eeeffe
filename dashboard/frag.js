/* Fragmentation panel: memory the allocator holds but the step never used, and why.
 * "Unused at peak" is reserved − the step's peak allocation (what caching costs even at the
 * busiest moment of the step; activations reused every step are not counted as waste);
 * "inactive split" is freed blocks split too small to reuse; retries are the allocator
 * freeing its cache to satisfy a request (each one a stall, the step before an OOM). */

import { GIB, chartMs, gib, intText, isNum, toGiB } from "./format.js";
import { $ } from "./dom.js";
import { S } from "./state.js";
import { stateOf, verdictOf } from "./verdict.js";
import { PLOT_CONFIG, TICKS_AS_DRAWN, baseLayout, chartTheme, drawChart, uirev, xAxis, yAxis } from "./chartbase.js";
import { wireZoom } from "./zoom.js";

export const FRAG_HINT = "reserved − per-step peak (cached but unused even at the step's peak), inactive split blocks, allocator retries";

function lastNum(arr) {
  for (let i = arr.length - 1; i >= 0; i--) if (isNum(arr[i])) return arr[i];
  return null;
}

export function drawFrag() {
  const gd = $("chart-frag");
  const d = S.mainData;
  if (!gd || !d) return;
  const t = chartTheme();
  const s = d.series;
  const xs = S.x === "time" ? s.series.ts.map(chartMs) : s.x;
  const unused = s.x.map((_, i) => {
    const p = s.series.peak_allocated_bytes[i], rs = s.series.reserved_bytes[i];
    return isNum(p) && isNum(rs) ? Math.max(0, rs - p) / GIB : null;
  });
  const retries = s.series.alloc_retries;
  const maxRetries = retries.reduce((m, v) => (isNum(v) && v > m ? v : m), 0);
  const traces = [
    { name: "unused at peak (reserved − per-step peak)", x: xs, y: unused, mode: "lines", fill: "tozeroy",
      fillcolor: "rgba(232,133,61,0.2)", line: { color: t.reserved, width: 1.5 }, hovertemplate: "%{y:.2f} GiB" },
    { name: "inactive split", x: xs, y: toGiB(s.series.inactive_split_bytes), mode: "lines", line: { color: t.frag, width: 1.5 }, hovertemplate: "%{y:.2f} GiB" },
    { name: "alloc retries (total)", x: xs, y: retries, yaxis: "y2", mode: "lines", line: { color: t.leak, width: 1.5, shape: "hv" }, hovertemplate: "%{y:,d}" },
  ];
  const range = S.mainRange;
  const layout = baseLayout(t, {
    uirevision: uirev("frag"),
    xaxis: xAxis(t, range ? { range: range, autorange: false } : {}),
    yaxis: yAxis(t),
    yaxis2: { ...TICKS_AS_DRAWN, overlaying: "y", side: "right", showgrid: false, tickfont: { color: t.leak }, title: { text: "retries", font: { color: t.leak, size: 11 } },
      range: [0, Math.max(1, maxRetries) * 1.05], dtick: Math.max(1, Math.ceil(maxRetries / 4)), tickformat: ",d", zeroline: false },
    margin: { l: 64, r: 52, t: 30, b: 40 },
  });
  drawChart(gd, traces, layout, PLOT_CONFIG);
  wireZoom(gd);
  const v = verdictOf(S.selected);
  const retryCount = lastNum(retries) || 0;
  const nowUnused = lastNum(unused), split = lastNum(s.series.inactive_split_bytes);
  // "of which" only for a part no larger than its whole: split blocks are measured at the step's
  // end, the unused figure at its peak, so the split can exceed it
  const unusedBytes = isNum(nowUnused) ? nowUnused * GIB : null;
  const part = isNum(split) && isNum(unusedBytes) && split <= unusedBytes ? ", of which " : "; ";
  const now = "Unused at the step's peak now " + gib(unusedBytes) + " (reserved − per-step peak)" + part +
    gib(split) + " inactive split blocks; " + intText(retryCount) + " allocator retries so far.";
  $("frag-note").textContent = (v.fragmentation || stateOf(S.selected) === "fragmentation")
    ? "Fragmentation. " + now + " Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
    : now + " Memory reused every step (activations) is not counted.";
}
