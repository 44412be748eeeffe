/* The selected rank's memory over steps: allocated / reserved / per-step peak / NVML used
 * against the device total, the plateau, checkpoint and eval bands with their peaks, the
 * engine's events, the leak projection, and memory outside the allocator underneath.
 *
 * Polling costs little: after the first full answer only the steps after the last one
 * drawn are fetched and appended; the full (downsampled) range is re-fetched every
 * FULL_EVERY_MS or when the appended tail grows past TAIL_MAX points (so at most
 * MAIN_POINTS + TAIL_MAX points per line are drawn). A redraw that only adds points keeps
 * the x axis end (axisEnd) and everything but the lines as they were, so it takes plotly's
 * cheap path (chartbase.drawChart): no long task per poll. */

import { GIB, alpha, capacity as capacityText, chartMs, chartTs, clock, duration, gib, intText, isNum, plotlyText, rankKey, slopeText, toGiB } from "./format.js";
import { $, append, clear, el, markInteractive, markOnce, timed } from "./dom.js";
import { ApiError, plotlyReady, source } from "./api.js";
import { S } from "./state.js";
import { checkpointPeak, stateOf, verdictOf } from "./verdict.js";
import { PLOT_CONFIG, baseLayout, chartTheme, drawChart, labelRows, medianStepSeconds, stepToX, uirev, xAxis, yAxis } from "./chartbase.js";
import { wireZoom } from "./zoom.js";
import { EVENT_NAMES, eventDetail, eventName } from "./events.js";
import { CHART_FIELDS } from "./fields.js";

export const MAIN_FIELDS = ["ts", ...CHART_FIELDS.rank];
const MAIN_POINTS = 2000; // min/max pairs: 1000 buckets, about one per pixel column
const FULL_EVERY_MS = 30000;
const TAIL_MAX = 1000;
const SIDE_EVERY = 3; // phases and events: every few polls (they change at checkpoints and events)

const EVENT_LABELS = {
  plateau_break: "plateau break", fragmentation: "fragmentation", restart: "restart", oom: "OOM",
  suspected_oom: EVENT_NAMES.suspected_oom,
};

function appendTail(series, tail) {
  const last = series.x.length ? series.x[series.x.length - 1] : -Infinity;
  let added = 0;
  tail.x.forEach((x, i) => {
    if (x <= last) return;
    series.x.push(x);
    for (const f of Object.keys(series.series)) series.series[f].push(tail.series[f] ? tail.series[f][i] : null);
    added++;
  });
  series.raw_points += added;
  return added;
}

/** Fetch (or extend) the selected rank's chart data and draw it. */
export async function refreshMain(onDrawn) {
  const r = S.selected;
  if (!r) return;
  const gen = S.gen, sel = rankKey(r.host, r.rank), zoom = S.zoom;
  const prev = S.mainData && S.mainData.key === sel && !S.mainData.zoomed && !zoom ? S.mainData : null;
  const now = Date.now();
  const tailOnly = prev && source.live && now - prev.fullAt < FULL_EVERY_MS && prev.tail < TAIL_MAX && prev.series.x.length;
  const opts = { points: MAIN_POINTS };
  if (zoom) { opts.start = Math.floor(zoom[0]); opts.end = Math.ceil(zoom[1]); }
  if (tailOnly) opts.start = prev.series.x[prev.series.x.length - 1] + 1;
  const side = !prev || S.tick % SIDE_EVERY === 0;
  const [series, phases, events] = await Promise.all([
    source.series(S.run, r, MAIN_FIELDS, opts).catch((err) => {
      // a report embeds the charts of some ranks only: say so in the chart, not as an error
      if (source.live || !(err instanceof ApiError) || err.status !== 404) throw err;
      return null;
    }),
    side ? source.phases(S.run, r) : null,
    side ? source.events(S.run, r).catch(() => r.events || []) : null,
    plotlyReady,
  ]);
  if (gen !== S.gen || !S.selected || rankKey(S.selected.host, S.selected.rank) !== sel) return;
  if (series === null) { drawNotEmbedded(r); return; }
  markOnce("vramwatch:chart-data");
  let data;
  if (tailOnly) {
    data = prev;
    const added = appendTail(prev.series, series);
    data.tail += added;
    const sideSame = (!phases || phases.length === prev.phases.length) && (!events || events.length === prev.events.length);
    if (!added && sideSame && verdictSig(r) === prev.verdictSig) return; // nothing new: no redraw
  } else {
    data = { key: sel, series: series, zoomed: !!zoom, fullAt: now, tail: 0, phases: [], events: [] };
    if (prev) { data.phases = prev.phases; data.events = prev.events; }
  }
  if (phases) data.phases = phases;
  if (events) data.events = events;
  data.verdictSig = verdictSig(r);
  if (!zoom && data.series.x.length) S.stepTs = { steps: data.series.x, ts: data.series.series.ts };
  S.mainData = data;
  timed("rank-chart", drawMain);
  markInteractive();
  if (onDrawn) setTimeout(() => { if (gen === S.gen && S.mainData) onDrawn(); }, 0);
}

/** The selected rank's verdict as drawn (markers, plateau, projection follow it). */
function verdictSig(r) { return JSON.stringify(verdictOf(r)) + "|" + JSON.stringify(r.vw || null); }

function drawNotEmbedded(r) {
  S.mainData = null;
  const t = chartTheme();
  $("rank-title").textContent = "Rank " + r.rank + " · " + r.host;
  clear($("rank-hint"));
  const text = "This report embeds the charts of the worst ranks and rank 0 only; rank " + r.rank +
    "'s verdict is in the table. Open the run on the collector for its chart.";
  const empty = (note) => baseLayout(t, { xaxis: xAxis(t), yaxis: yAxis(t), uirevision: uirev("main"), showlegend: false,
    annotations: [{ text: plotlyText(note), showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { color: t.muted } }] });
  window.Plotly.react($("chart-rank"), [], empty("no chart of rank " + r.rank + " in this report"), PLOT_CONFIG);
  // the panels that follow the selected rank say the same instead of showing the previous rank
  if ($("chart-frag").data) window.Plotly.react($("chart-frag"), [], empty("no chart of rank " + r.rank + " in this report"), PLOT_CONFIG);
  $("frag-note").textContent = "";
  const events = $("events-table");
  if (events && events.tBodies[0]) { clear(events.tBodies[0]); events.tBodies[0].dataset.sig = ""; }
  $("rank-note").textContent = text;
  markInteractive();
}

function phaseGroups(phases) {
  // Consecutive samples of one phase form one band; a band keeps its highest peak.
  const sorted = phases.slice().sort((a, b) => a.step - b.step || a.ts - b.ts);
  const groups = [];
  for (const p of sorted) {
    const g = groups[groups.length - 1];
    const peak = p.peak_allocated_bytes || 0;
    if (g && g.phase === p.phase && p.step - g.step1 <= 1) {
      g.step1 = p.step; g.ts1 = p.ts;
      if (peak > g.peak) { g.peak = peak; g.peakStep = p.step; g.peakTs = p.ts; }
    } else {
      groups.push({ phase: p.phase, step0: p.step, step1: p.step, ts0: p.ts, ts1: p.ts, peak: peak, peakStep: p.step, peakTs: p.ts });
    }
  }
  return groups;
}

function lastOf(events, type) {
  for (let i = events.length - 1; i >= 0; i--) if (events[i].type === type) return events[i];
  return null;
}

/** Where the current plateau starts: the engine's step when it says, else its latest plateau event. */
function plateauSpan(r, v, events, x0, xEnd) {
  if (!isNum(v.plateau_bytes)) return null;
  const since = isNum(v.plateau_since_step) ? v.plateau_since_step : (lastOf(events, "plateau") || {}).step;
  const st = stateOf(r);
  const brk = lastOf(events, "plateau_break");
  // where the plateau ended: the engine's step when it says, else the latest break's onset
  const until = isNum(v.plateau_until_step) ? v.plateau_until_step
    : (st === "rising" || st === "leak") && brk ? (isNum(brk.onset_step) ? brk.onset_step : brk.step) : null;
  const broken = until !== null;
  const from = isNum(since) ? stepToX(since) : x0;
  const to = broken ? stepToX(until) : xEnd;
  const label = broken ? "plateau " + gib(v.plateau_bytes) + " (until the break)" : "plateau " + gib(v.plateau_bytes);
  return isNum(from) && isNum(to) && to >= from ? { from, to, label } : null;
}

/** Vertical markers: engine events, the leak's onset and detection, the rank's death. */
function markers(r, v, events) {
  const out = [];
  for (const e of events.slice(-40)) {
    if (EVENT_LABELS[e.type]) {
      let text = EVENT_LABELS[e.type];
      if (e.type === "plateau_break" && e.cause) text += " · " + plotlyText(e.cause);
      // after a restart from a checkpoint the step axis runs twice: name the attempt
      if (isNum(e.attempt) && e.attempt > 1) text += " · attempt " + e.attempt;
      // a suspected OOM says its numbers on hover: it is a suspicion, the numbers are its grounds
      const why = e.type === "suspected_oom" ? " · " + plotlyText(eventDetail(e)) : "";
      out.push({ step: e.step, ts: e.ts, text, kind: e.type, hover: plotlyText(eventName(e.type)) + " at step " +
        intText(e.step) + (isNum(e.ts) ? " · " + clock(e.ts) : "") + why });
    }
  }
  const leak = lastOf(events, "leak");
  const onset = isNum(v.leak_onset_step) ? v.leak_onset_step : leak && isNum(leak.onset_step) ? leak.onset_step : null;
  if (leak || isNum(onset)) {
    if (isNum(onset)) out.push({ step: onset, text: "leak onset", kind: "leak", hover: "leak started at step " + intText(onset) });
    const detected = isNum(v.leak_detected_step) ? v.leak_detected_step : leak ? leak.step : null;
    if (isNum(detected)) {
      const slope = isNum(v.slope_bytes_per_step) ? v.slope_bytes_per_step : leak ? leak.slope_bytes_per_step : null;
      out.push({ step: detected, ts: leak && leak.step === detected ? leak.ts : undefined, kind: "leak",
        hover: "leak detected at step " + intText(detected), text: "leak detected" + (isNum(slope) ? " " + slopeText(slope) : "") });
    }
  }
  const death = r.vw && r.vw.death;
  if (death && isNum(death.step)) {
    // the OOM that killed the process is one marker, not two
    const same = out.find((m) => m.kind === "oom" && m.step === death.step);
    if (same) same.text = "died: OOM";
    else out.push({ step: death.step, ts: death.ts, kind: "oom", text: "died: " + death.how,
      hover: "last sample at step " + intText(death.step) + " · " + clock(death.ts) + (death.said ? " · " + death.said : "") });
  }
  return out;
}

export function drawMain() {
  const gd = $("chart-rank");
  const d = S.mainData;
  if (!gd || !d) return;
  const t = chartTheme();
  const r = S.selected;
  const v = verdictOf(r);
  const s = d.series;
  const timeMode = S.x === "time";
  const xs = timeMode ? s.series.ts.map(chartMs) : s.x;
  drawTitle(r, s, d.zoomed);
  if (!s.x.length) {
    window.Plotly.react(gd, [], baseLayout(t, { xaxis: xAxis(t), yaxis: yAxis(t), uirevision: uirev("main"),
      annotations: [{ text: "no training samples in this range yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { color: t.muted } }] }), PLOT_CONFIG);
    return;
  }
  const used = toGiB(s.series.nvml_used_bytes);
  const haveNvml = used.some(isNum);
  const capacity = s.series.total_bytes.reduce((m, b) => (isNum(b) && b > m ? b : m), 0) || v.total_bytes || 0;
  const gap = s.x.map((_, i) => {
    const u = s.series.nvml_used_bytes[i], rs = s.series.reserved_bytes[i];
    return isNum(u) && isNum(rs) ? (u - rs) / GIB : null;
  });
  const hoverG = "%{y:.2f} GiB";
  const x0 = xs[0], dataEnd = xs[xs.length - 1];
  const traces = [];
  const shapes = [];
  const annotations = [];
  const xEnd = axisEnd(x0, dataEnd, timeMode);

  if (capacity) {
    // also in the MiB nvidia-smi prints: the number operators quote for the card
    traces.push({ name: "device total " + capacityText(capacity), x: [x0, xEnd], y: [capacity / GIB, capacity / GIB], mode: "lines",
      line: { color: t.total, width: 1.5, dash: "dash" }, hovertemplate: "device total " + capacityText(capacity) + "<extra></extra>" });
  }
  if (haveNvml) traces.push({ name: "NVML used", x: xs, y: used, mode: "lines", line: { color: t.nvml, width: 1.3 }, hovertemplate: hoverG });
  traces.push({ name: "reserved", x: xs, y: toGiB(s.series.reserved_bytes), mode: "lines", line: { color: t.reserved, width: 2 }, hovertemplate: hoverG });
  // translucent by its colour, not by trace opacity (a group opacity layer doubles the redraw)
  traces.push({ name: "per-step peak", x: xs, y: toGiB(s.series.peak_allocated_bytes), mode: "lines", line: { color: alpha(t.peak, 0.5), width: 0.8 }, hovertemplate: hoverG });
  traces.push({ name: "allocated", x: xs, y: toGiB(s.series.allocated_bytes), mode: "lines", line: { color: t.allocated, width: 2 }, hovertemplate: hoverG });
  const plateau = plateauSpan(r, v, d.events, x0, xEnd);
  if (plateau) {
    traces.push({ name: plateau.label, x: [plateau.from, plateau.to], y: [v.plateau_bytes / GIB, v.plateau_bytes / GIB], mode: "lines",
      line: { color: t.plateau, width: 1.5, dash: "dot" }, hovertemplate: plotlyText(plateau.label) + "<extra></extra>" });
  }
  const projection = leakProjection(r, v, capacity, timeMode);
  if (projection) {
    traces.push({ name: "leak → OOM projection", x: projection.x, y: projection.y, mode: "lines+markers", line: { color: t.proj, width: 2, dash: "dot" },
      marker: { size: [0, 10], symbol: "x", color: t.proj }, hovertemplate: "projection %{y:.1f} GiB<extra></extra>" });
    const shownEnd = d.zoomed && S.zoomRange ? S.zoomRange[1] : xEnd;
    const inView = projection.x[1] <= shownEnd;
    // a phone has no room for it among the event labels: the note below the chart says it
    if (gd.clientWidth > 600) annotations.push({ x: inView ? projection.x[1] : 1, xref: inView ? "x" : "paper", y: capacity / GIB, yref: "y", xanchor: "right", yanchor: "bottom",
      text: (inView ? "" : "→ ") + "OOM " + projection.roughly, showarrow: false, font: { size: 11, color: t.proj }, bgcolor: t.panel, borderpad: 2,
      name: "oom projection" });
  }
  const groups = phaseBands(d, t, timeMode, xs, traces, shapes);
  eventMarkers(r, v, d, t, x0, xEnd, shapes, annotations);
  if (haveNvml) {
    traces.push({ name: "outside torch (NVML \u2212 reserved)", x: xs, y: gap, yaxis: "y2", mode: "lines", fill: "tozeroy",
      fillcolor: alpha(t.gap, 0.22), line: { color: t.gap, width: 1.3 }, hovertemplate: hoverG });
  }
  const range = d.zoomed && S.zoomRange ? S.zoomRange : [x0, xEnd];
  const layout = baseLayout(t, {
    uirevision: uirev("main"),
    xaxis: xAxis(t, { anchor: "y2", range: range, autorange: false }),
    yaxis: yAxis(t, { domain: haveNvml ? [0.3, 1] : [0, 1], rangemode: "normal", autorange: true }),
    yaxis2: yAxis(t, { domain: [0, 0.2], title: { text: haveNvml ? "outside torch" : "", font: { color: t.muted, size: 11 }, standoff: 2 }, visible: haveNvml }),
    shapes: shapes,
    annotations: annotations,
    margin: { l: 64, r: 14, t: 36, b: 40 },
    // a phone has no room for the legend over the chart: hover names the lines there
    showlegend: gd.clientWidth > 600,
  });
  S.mainRange = range;
  drawChart(gd, traces, layout, PLOT_CONFIG);
  wireZoom(gd);
  writeNote(r, v, haveNvml, groups, projection);
}

/**
 * Where the x axis ends: at the data, with 2 % of the span to spare (a far-off projection
 * leaves the plot). The end stays where it was while the new points still fit, so a poll
 * that only appends points leaves the axis alone and the redraw stays on the cheap path
 * (chartbase.drawChart); it moves on once the data reach it.
 */
function axisEnd(x0, dataEnd, timeMode) {
  const key = uirev("main") + "|" + x0;
  const end = dataEnd + Math.max((dataEnd - x0) * 0.02, timeMode ? 1000 : 1);
  const kept = S.mainEnd;
  if (kept && kept.key === key && kept.end >= dataEnd && kept.end <= end) return kept.end;
  S.mainEnd = { key, end };
  return end;
}

function drawTitle(r, s, zoomed) {
  $("rank-title").textContent = "Rank " + r.rank + " · " + r.host;
  const hint = $("rank-hint");
  clear(hint);
  const shown = r.vw ? r.vw.shown : stateOf(r);
  append(hint, el("span", { class: "badge", dataset: { state: shown }, text: shown }),
    " " + (s.downsampled ? intText(s.x.length) + " of " + intText(s.raw_points) + " points (min/max per bucket kept)" : intText(s.x.length) + " points") +
    (zoomed ? " · zoomed: double-click to reset" : ""));
}

function leakProjection(r, v, capacity, timeMode) {
  const st = stateOf(r);
  if (r.vw && r.vw.death) return null; // a dead rank has nothing left to project
  if ((st !== "leak" && st !== "rising") || !isNum(v.slope_bytes_per_step) || v.slope_bytes_per_step <= 0 || !isNum(v.steps_to_oom) || !capacity) return null;
  // A polling page's delta rows (?compact=1) refresh steps_to_oom and last_step but not the
  // verdict's own step / ts: project from the newest step, as a freshly loaded page does.
  const behind = isNum(r.last_step) && (!isNum(v.step) || r.last_step > v.step);
  const lastStep = behind ? r.last_step : v.step;
  const stepX = behind && timeMode ? stepToX(lastStep) : null;
  const lastTs = isNum(stepX) ? chartTs(stepX) : isNum(v.ts) ? v.ts : r.last_ts;
  const startLevel = capacity - v.slope_bytes_per_step * v.steps_to_oom;
  let x;
  if (timeMode) {
    const secPerStep = isNum(v.seconds_to_oom) && v.steps_to_oom > 0 ? v.seconds_to_oom / v.steps_to_oom : medianStepSeconds();
    x = [chartMs(lastTs), chartMs(lastTs + v.steps_to_oom * secPerStep)];
  } else x = [lastStep, lastStep + v.steps_to_oom];
  // the label on the chart in two significant digits (the note below says it exactly): it
  // changes every hundred steps or so, not every step, so a poll does not redraw the figure
  const roughly = (isNum(v.seconds_to_oom) ? "in ~" + duration(rough(v.seconds_to_oom, 10)) + " " : "in ") +
    "(~" + intText(rough(v.steps_to_oom, 1)) + " steps)";
  return { x, y: [startLevel / GIB, capacity / GIB], roughly };
}

/** ``n`` to two significant digits, and to a multiple of ``unit`` at least. */
function rough(n, unit) {
  const step = Math.max(unit, n >= 100 ? 10 ** (Math.floor(Math.log10(n)) - 1) : 1);
  return Math.round(n / step) * step;
}

function phaseBands(d, t, timeMode, xs, traces, shapes) {
  // checkpoint / eval phases: bands plus a marker at each peak
  const groups = phaseGroups(d.phases);
  const half = timeMode ? medianStepSeconds() * 500 : 0.5;
  const lo = d.zoomed ? Math.min(...xs) : -Infinity, hi = d.zoomed ? Math.max(...xs) : Infinity;
  const byPhase = {};
  for (const g of groups) {
    const gx0 = timeMode ? chartMs(g.ts0) : g.step0, gx1 = timeMode ? chartMs(g.ts1) : g.step1;
    if (gx1 < lo || gx0 > hi) continue;
    const isCkpt = /ckpt|checkpoint|save/i.test(g.phase);
    shapes.push({ type: "rect", xref: "x", yref: "paper", x0: gx0 - half, x1: gx1 + half, y0: 0, y1: 1, layer: "below",
      name: (isCkpt ? "checkpoint" : "phase") + " band " + g.phase, fillcolor: isCkpt ? t.ckpt : t.evalFill,
      line: { width: 1, color: isCkpt ? t.ckptLine : t.evalLine }, opacity: 0.55 });
    const m = byPhase[g.phase] || (byPhase[g.phase] = { x: [], y: [], text: [], isCkpt });
    m.x.push(timeMode ? chartMs(g.peakTs) : g.peakStep);
    m.y.push(g.peak / GIB);
    m.text.push(plotlyText(g.phase) + " at step " + intText(g.peakStep) + " · peak " + gib(g.peak));
  }
  for (const phase of Object.keys(byPhase)) {
    const m = byPhase[phase];
    traces.push({ name: plotlyText(phase) + " peak", x: m.x, y: m.y, text: m.text, mode: "markers",
      marker: { symbol: "diamond", size: 8, color: m.isCkpt ? t.ckptLine : t.evalLine, line: { width: 1, color: t.panel } },
      hovertemplate: "%{text}<extra></extra>" });
  }
  return groups;
}

function eventMarkers(r, v, d, t, x0, xEnd, shapes, annotations) {
  const lo = d.zoomed && S.zoomRange ? S.zoomRange[0] : x0, hi = d.zoomed && S.zoomRange ? S.zoomRange[1] : xEnd;
  const marks = markers(r, v, d.events || []).map((m) => ({ ...m, x: stepToX(m.step, m.ts) }))
    .filter((m) => isNum(m.x) && m.x >= lo && m.x <= hi);
  // labels far enough apart (in pixels, for the longest label) share a row; closer ones stack
  const plotPx = Math.max(100, $("chart-rank").clientWidth - 80);
  const labelPx = Math.max(60, ...marks.map((m) => 6.5 * m.text.length + 10));
  const rows = labelRows(marks.map((m) => m.x), (hi - lo) * Math.min(0.9, labelPx / plotPx), 5);
  marks.forEach((m, i) => {
    const color = m.kind === "leak" || m.kind === "oom" || m.kind === "suspected_oom" ? t.leak : m.kind === "fragmentation" ? t.frag
      : m.kind === "restart" ? t.warmup : r.vw && r.vw.shown === "ratchet" ? t.ratchet : t.rising;
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: m.x, x1: m.x, y0: 0.24, y1: 1, name: "event " + m.kind,
      line: { color: color, width: 1.5, dash: "dashdot" } });
    // labels in the right fifth of the plot read leftwards, so none runs off the edge
    const right = m.x > lo + 0.8 * (hi - lo);
    annotations.push({ x: m.x, y: 1, xref: "x", yref: "paper", yanchor: "top", xanchor: right ? "right" : "left", text: m.text, showarrow: false,
      font: { size: 11, color: color }, bgcolor: t.panel, borderpad: 2, yshift: -rows[i] * 17, hovertext: m.hover,
      name: "label " + m.kind });
  });
}

function writeNote(r, v, haveNvml, groups, projection) {
  const notes = [];
  if (!haveNvml) notes.push("NVML is unavailable on this host: device-wide used memory and the outside-torch gap are not shown.");
  if (groups.length) {
    const ck = checkpointPeak(r);
    notes.push(groups.length + " checkpoint/eval phase" + (groups.length === 1 ? "" : "s") + " shaded; diamonds mark each peak" +
      (isNum(ck) ? " (latest checkpoint peak " + gib(ck) + ")" : "") +
      (isNum(v.checkpoint_headroom_bytes) ? "; headroom at the latest checkpoint peak " + gib(v.checkpoint_headroom_bytes) : "") + ".");
  }
  if (projection) notes.push("Leak projection: the device fills in " + intText(v.steps_to_oom) + " steps at " + slopeText(v.slope_bytes_per_step) + ".");
  const death = r.vw && r.vw.death;
  if (death) notes.push("This rank's process died (" + death.how + ") at step " + intText(death.step) + ", " + clock(death.ts) + "." + (death.said ? " Its last words: " + death.said + "." : ""));
  else if (r.vw && r.vw.liveness === "exited") notes.push("This rank's process closed cleanly.");
  const off = v.detectors_off && typeof v.detectors_off === "object" ? Object.keys(v.detectors_off) : [];
  if (off.length) notes.push("Not judged, the samples do not measure what they need: " + off.map((k) => k.replace(/_/g, " ") + " (" + v.detectors_off[k] + ")").join("; ") + ".");
  if (v.leak_source === "outside_allocator" || v.leak_source === "outside") notes.push("The leak is outside the torch allocator (NVML used − reserved is growing): look at NCCL, CUDA graphs, or native extensions.");
  const note = $("rank-note");
  note.textContent = notes.join(" ");
}
