/* Several ranks of one run overlaid on one value. Which ranks: the ones ticked in the
 * verdict table, else the selected rank, the worst rank, rank 0 and the median rank.
 * Which value: by default the one the worst rank's verdict is about (allocated for an
 * allocator leak, NVML used for a leak outside the allocator, reserved otherwise). */

import { chartMs, plotlyText, rankKey, rankLabel, toGiB } from "./format.js";
import { $, el, timed } from "./dom.js";
import { plotlyReady, source } from "./api.js";
import { S } from "./state.js";
import { sortRanks, verdictOf } from "./verdict.js";
import { PLOT_CONFIG, baseLayout, chartTheme, drawChart, xAxis, yAxis } from "./chartbase.js";

export const MAX_COMPARE = 12;
export const OVERLAY_FIELDS = [
  ["allocated_bytes", "allocated"], ["reserved_bytes", "reserved"], ["peak_allocated_bytes", "per-step peak"],
  ["nvml_used_bytes", "NVML used"],
];
const SIGNAL_FIELDS = {
  allocated: "allocated_bytes", allocator: "allocated_bytes", reserved: "reserved_bytes", peak: "peak_allocated_bytes",
  nvml_used: "nvml_used_bytes", device_used: "nvml_used_bytes", outside: "nvml_used_bytes", outside_allocator: "nvml_used_bytes",
  device: "nvml_used_bytes", fragmentation: "reserved_bytes",
};
const PALETTE = ["#3b78c4", "#e8853d", "#2e9e5b", "#d64545", "#9b59b6", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#1f3a93", "#f4a261"];

/** The field a rank's verdict is about. */
export function verdictField(r) {
  const v = verdictOf(r);
  const signal = v.signal ? String(v.signal) : null;
  // a leak is about its source; otherwise the level the engine judges (its `signal`)
  if (v.state === "leak" && v.leak_source) return SIGNAL_FIELDS[v.leak_source] || "allocated_bytes";
  if (signal && OVERLAY_FIELDS.some((f) => f[0] === signal)) return signal;
  if (signal && SIGNAL_FIELDS[signal]) return SIGNAL_FIELDS[signal];
  if (v.state === "leak") return "allocated_bytes";
  if (v.state === "rising") return "allocated_bytes";
  return "reserved_bytes";
}

export function overlaySelect(onChange) {
  const select = el("select", { id: "overlay-field", "aria-label": "compared value" },
    OVERLAY_FIELDS.map((o) => el("option", { value: o[0], text: o[1] })));
  select.addEventListener("change", () => { S.overlayField = select.value; S.overlayAuto = false; onChange(); });
  return select;
}

/** Follow the worst rank's verdict until the user picks a value. */
export function syncOverlayField() {
  if (!S.overlayAuto || !S.ranks || !S.ranks.length) return;
  const worst = S.worstCard || sortRanks(S.ranks, "severity", -1)[0];
  S.overlayField = verdictField(worst);
  const select = $("overlay-field");
  if (select && select.value !== S.overlayField) select.value = S.overlayField;
}

export function compareSet() {
  if (S.compare) return S.compare;
  const set = new Set();
  const ranks = S.ranks || [];
  if (S.selected) set.add(rankKey(S.selected.host, S.selected.rank));
  const worst = sortRanks(ranks, "severity", -1)[0];
  if (worst) set.add(rankKey(worst.host, worst.rank));
  const zero = ranks.find((r) => r.rank === 0);
  if (zero) set.add(rankKey(zero.host, zero.rank));
  const byRank = ranks.slice().sort((a, b) => a.rank - b.rank);
  if (byRank.length > 1) { const mid = byRank[Math.floor(byRank.length / 2)]; set.add(rankKey(mid.host, mid.rank)); }
  return set;
}

/** Tick or untick a rank; false when the set is full. */
export function toggleCompare(key, on) {
  const set = new Set(compareSet());
  if (on) {
    if (set.size >= MAX_COMPARE) return false;
    set.add(key);
  } else set.delete(key);
  S.compare = set;
  return true;
}

export function refreshOverlay() {
  const gd = $("chart-overlay");
  if (!gd || !S.ranks) return Promise.resolve();
  syncOverlayField();
  const gen = S.gen, field = S.overlayField;
  const keys = compareSet();
  const ranks = S.ranks.filter((r) => keys.has(rankKey(r.host, r.rank))).slice(0, MAX_COMPARE);
  ranks.sort((a, b) => a.rank - b.rank);
  return Promise.all([Promise.all(ranks.map((r) => source.series(S.run, r, ["ts", field], { points: 1200 }).catch(() => null))), plotlyReady])
    .then(([all]) => {
      if (gen !== S.gen || field !== S.overlayField) return;
      const t = chartTheme();
      const traces = [];
      all.forEach((s, i) => {
        if (!s || !s.x.length) return;
        const r = ranks[i];
        const sel = S.selected && r.rank === S.selected.rank && r.host === S.selected.host;
        traces.push({ name: plotlyText(rankLabel(r)) + " (" + (r.vw ? r.vw.shown : verdictOf(r).state) + ")",
          x: S.x === "time" ? s.series.ts.map(chartMs) : s.x, y: toGiB(s.series[field]), mode: "lines",
          line: { color: PALETTE[i % PALETTE.length], width: sel ? 2.4 : 1.4 }, hovertemplate: "%{y:.2f} GiB" });
      });
      const layout = baseLayout(t, {
        uirevision: "overlay|" + S.run + "|" + S.x + "|" + field,
        xaxis: xAxis(t), // lines only: plotly's autorange ends at the data
        yaxis: yAxis(t, { rangemode: "normal" }),
        // under the plot, never over the lines
        legend: { orientation: "h", x: 0, y: -0.22, yanchor: "top", bgcolor: "rgba(0,0,0,0)" },
        margin: { l: 64, r: 10, t: 10, b: 40 },
      });
      timed("compare", () => drawChart(gd, traces, layout, PLOT_CONFIG));
      const label = (OVERLAY_FIELDS.find((f) => f[0] === field) || [field, field])[1];
      $("overlay-hint").textContent = (S.compare ? ranks.length + " ranks ticked in the verdict table"
        : "the selected rank, the worst rank, rank 0 and the median rank — tick others in the verdict table") +
        " · " + label + (S.overlayAuto ? " (what the worst rank's verdict is about)" : "");
    });
}
