/* Memory outside torch and on the host (docs/evidence.md), for the selected rank.
 *
 * Device: NVML's used memory split into this process's allocator (reserved), what the
 * process holds outside the allocator (NVML used − reserved − foreign: CUDA context, NCCL,
 * cuBLAS workspaces), and other processes on the same GPU (foreign_used_bytes, e.g. a stale
 * notebook kernel). Host: the trainer's RSS, its children's RSS (DataLoader workers), the
 * node's available memory, pinned host memory; checkpoint-phase host peaks are marked
 * (FSDP state_dict materialisation kills hosts through the OOM-killer, no CUDA hook sees it).
 * Sources may be sparse (schema 2): a chart whose fields were never sent is hidden, and the
 * panel too when both are. One /chart request per refresh (every few polls), and the run's
 * /processes: the other processes on the selected rank's GPU by name ("a Jupyter kernel (pid
 * 4242, ipykernel_launcher) holds 38.0 GiB on GPU 3"), in the note and on the chart. */

import { GIB, chartMs, gib, isNum, plotlyText, toGiB } from "./format.js";
import { $, el, nextTask, timed } from "./dom.js";
import { getProcesses, source } from "./api.js";
import { S } from "./state.js";
import { PLOT_CONFIG, baseLayout, chartTheme, drawChart, uirev, xAxis, yAxis } from "./chartbase.js";

export const MEM_FIELDS = [
  "ts", "reserved_bytes", "nvml_used_bytes", "foreign_used_bytes",
  "host_rss_bytes", "host_children_rss_bytes", "host_available_bytes", "host_pinned_bytes",
];
const HOST_LINES = [
  ["host_rss_bytes", "trainer RSS", "#3b82c4"], ["host_children_rss_bytes", "children RSS (workers)", "#8e6cc0"],
  ["host_available_bytes", "node available", "#3a9a5b"], ["host_pinned_bytes", "pinned", "#c08a2e"],
];
const POINTS = 600;

export function memPanel() {
  return el("section", { class: "panel", id: "mem-panel", hidden: true },
    el("div", { class: "panel-head" }, el("h2", { text: "Memory outside torch & on the host" }),
      el("span", { class: "hint", text: "device: allocator · outside the allocator · other processes; host: RSS, workers, available" })),
    el("div", { class: "grid2" },
      el("div", { id: "mem-device-box" }, el("div", { class: "chart", id: "chart-device-split" }), el("div", { class: "chart-note", id: "device-split-note" })),
      el("div", { id: "mem-host-box" }, el("div", { class: "chart", id: "chart-host" }), el("div", { class: "chart-note", id: "host-note" }))));
}

function has(arr) { return (arr || []).some(isNum); }
function last(arr) { for (let i = (arr || []).length - 1; i >= 0; i--) if (isNum(arr[i])) return arr[i]; return null; }

/** Per point: [reserved, outside the allocator, foreign] in bytes (null where not measured). */
export function deviceSplit(s) {
  const res = s.reserved_bytes || [], used = s.nvml_used_bytes || [], foreign = s.foreign_used_bytes || [];
  const outside = res.map((r, i) => {
    const u = used[i];
    if (!isNum(u) || !isNum(r)) return null;
    return Math.max(0, u - r - (isNum(foreign[i]) ? foreign[i] : 0));
  });
  return { reserved: res, outside, foreign };
}

export async function refreshMem() {
  const panel = $("mem-panel");
  const r = S.selected;
  if (!panel || !r) return;
  const gen = S.gen;
  let d;
  try {
    d = await source.series(S.run, r, MEM_FIELDS, { points: POINTS });
  } catch (err) {
    if (err && err.status === 404) { panel.hidden = true; return; } // a report rank without its series
    throw err;
  }
  let phases = [];
  try { phases = await source.phases(S.run, r); } catch (err) { phases = []; }
  let named = [];
  try {
    const report = (await getProcesses(S.run)).find((p) => p.rank === r.rank && p.host === r.host);
    named = report ? report.processes : [];
  } catch (err) { named = []; } // an older collector: the split still shows, unnamed
  if (gen !== S.gen || !S.selected || S.selected.rank !== r.rank || S.selected.host !== r.host) return;
  const s = d.series;
  const devOk = has(s.nvml_used_bytes) && has(s.reserved_bytes);
  const hostOk = HOST_LINES.some(([f]) => has(s[f]));
  panel.hidden = !devOk && !hostOk;
  $("mem-device-box").hidden = !devOk;
  $("mem-host-box").hidden = !hostOk;
  if (panel.hidden) return;
  const xs = S.x === "time" ? (s.ts || []).map(chartMs) : d.x;
  // one chart per task (each is a plotly redraw)
  if (devOk) timed("memsplit", () => drawDevice(xs, s, named));
  if (!hostOk) return;
  await nextTask();
  if (gen === S.gen) timed("memhost", () => drawHost(xs, s, phases));
}

/** The chart's note on who holds the foreign memory: the largest named process at the last point. */
function foreignAnnotation(xs, split, named, t) {
  if (!named.length || !xs.length) return [];
  const y = (last(split.reserved) || 0) + (last(split.outside) || 0) + (last(split.foreign) || 0);
  const more = named.length > 1 ? " (+" + (named.length - 1) + " more)" : "";
  return [{ x: xs[xs.length - 1], y: y / GIB, xanchor: "right", yanchor: "bottom", showarrow: true, ax: -30, ay: -24,
    text: plotlyText(named[0].summary + more), font: { size: 11, color: t.leak }, arrowcolor: t.leak }];
}

function drawDevice(xs, s, named) {
  const t = chartTheme();
  const split = deviceSplit(s);
  const area = (name, y, color) => ({ name, x: xs, y: toGiB(y), mode: "lines", stackgroup: "dev", line: { color, width: 1 },
    hovertemplate: "%{y:.2f} GiB" });
  const traces = [
    area("allocator reserved (this process)", split.reserved, t.reserved),
    area("outside the allocator (context, NCCL, workspaces)", split.outside, t.nvml),
  ];
  if (has(split.foreign)) traces.push(area("other processes on this GPU", split.foreign, t.leak));
  drawChart($("chart-device-split"), traces, baseLayout(t, {
    uirevision: uirev("devsplit"), xaxis: xAxis(t), yaxis: yAxis(t), margin: { l: 64, r: 14, t: 40, b: 40 },
    annotations: foreignAnnotation(xs, split, named, t),
  }), PLOT_CONFIG);
  const f = last(split.foreign), o = last(split.outside);
  const who = named.length ? ": " + named.map((p) => p.summary).join("; ") : "";
  $("device-split-note").textContent = "Now: allocator " + gib(last(split.reserved)) + ", outside the allocator " + gib(o) +
    (has(split.foreign) ? ", other processes " + gib(f) + (f > 0 ? " — another process holds memory on this training GPU" + who : "") : "") +
    " (NVML used = the sum).";
}

function drawHost(xs, s, phases) {
  const t = chartTheme();
  const traces = HOST_LINES.filter(([f]) => has(s[f])).map(([f, name, color]) => ({
    name, x: xs, y: toGiB(s[f]), mode: "lines", line: { color, width: 1.5 }, hovertemplate: "%{y:.2f} GiB",
  }));
  const peaks = phases.filter((p) => isNum(p.host_rss_bytes));
  if (peaks.length) {
    traces.push({ name: "host RSS at " + (peaks.every((p) => p.phase === "checkpoint") ? "checkpoints" : "phases"),
      x: peaks.map((p) => (S.x === "time" ? chartMs(p.ts) : p.step)), y: peaks.map((p) => p.host_rss_bytes / GIB),
      text: peaks.map((p) => p.phase), mode: "markers", marker: { symbol: "triangle-up", size: 9, color: t.ckptLine },
      hovertemplate: "%{text}: RSS %{y:.2f} GiB" });
  }
  drawChart($("chart-host"), traces, baseLayout(t, {
    uirevision: uirev("host"), xaxis: xAxis(t), yaxis: yAxis(t), margin: { l: 64, r: 14, t: 40, b: 40 },
  }), PLOT_CONFIG);
  const top = peaks.reduce((m, p) => (p.host_rss_bytes > (m ? m.host_rss_bytes : -1) ? p : m), null);
  $("host-note").textContent = "Now: trainer RSS " + gib(last(s.host_rss_bytes)) +
    (has(s.host_children_rss_bytes) ? ", workers " + gib(last(s.host_children_rss_bytes)) : "") +
    (has(s.host_available_bytes) ? ", node available " + gib(last(s.host_available_bytes)) : "") +
    (top ? "; highest RSS in a " + top.phase + ": " + gib(top.host_rss_bytes) + " at step " + top.step : "") + ".";
}
