/* Zoom of the rank chart and the fragmentation chart: they share one x range. A zoom
 * re-fetches that window in detail; double-click (autorange) returns to the full run. */

import { isNum } from "./format.js";
import { $ } from "./dom.js";
import { S } from "./state.js";
import { stepToX, xToStep } from "./chartbase.js";

const LINKED = ["chart-rank", "chart-frag"];
const hooks = { refresh: () => Promise.resolve(), error: () => {} };
let applying = false;

/** What to call when the zoom window changes (app.js: re-fetch the rank's series). */
export function onZoomChange(refresh, error) { hooks.refresh = refresh; hooks.error = error; }

// Handlers are attached right after a chart's first draw (plotly creates gd.on then),
// so no click can fall between the first draw and the wiring.
export function wireZoom(gd) {
  if (gd.__vwWired) return;
  gd.__vwWired = true;
  gd.on("plotly_relayout", (ev) => onRelayout(gd.id, ev));
}

function relayoutOthers(id, update) {
  applying = true;
  const others = LINKED.filter((o) => o !== id && $(o) && $(o).data);
  return Promise.all(others.map((o) => window.Plotly.relayout($(o), update)))
    .then(() => { applying = false; }, () => { applying = false; });
}

function onRelayout(id, ev) {
  if (applying || !ev) return;
  if (ev["xaxis.autorange"]) {
    S.zoom = null;
    S.zoomRange = null;
    relayoutOthers(id, { "xaxis.autorange": true });
    hooks.refresh().catch(hooks.error);
    return;
  }
  let lo = ev["xaxis.range[0]"], hi = ev["xaxis.range[1]"];
  if (ev["xaxis.range"]) { lo = ev["xaxis.range"][0]; hi = ev["xaxis.range"][1]; }
  if (lo === undefined || hi === undefined) return;
  if (ownRange($(id), lo, hi)) return; // the end of plotly's axis transition to the range we drew
  const a = xToStep(lo), b = xToStep(hi);
  if (!isNum(a) || !isNum(b)) return;
  // fetch a little beyond the visible range so panning a bit does not show empty edges
  const pad = (b - a) * 0.1;
  S.zoom = [Math.max(0, a - pad), b + pad];
  S.zoomRange = [lo, hi];
  relayoutOthers(id, { "xaxis.range": [lo, hi] });
  hooks.refresh().catch(hooks.error);
}

/**
 * Whether a relayout event only reports the x range the page itself drew: a cheap redraw
 * (chartbase.drawChart) that moves the axis finishes with a relayout to that range, which
 * is no zoom. Compared in plotly's linear units (a date axis reports date strings).
 */
function ownRange(gd, lo, hi) {
  const drawn = gd && gd.__vwRange;
  const ax = gd && gd._fullLayout && gd._fullLayout.xaxis;
  if (!drawn || !ax || !ax.r2l) return false;
  const near = (a, b) => Math.abs(ax.r2l(a) - ax.r2l(b)) <= 1e-9 * Math.max(1, Math.abs(ax.r2l(b)));
  return near(lo, drawn[0]) && near(hi, drawn[1]);
}

/** Zoom both charts to a window around ``step`` (a click on an event row). */
export function zoomToStep(step) {
  const m = S.stepTs;
  const span = m ? Math.max(50, (m.steps[m.steps.length - 1] - m.steps[0]) / 20) : 200;
  const a = step - span, b = step + span;
  S.zoom = [a, b];
  S.zoomRange = [stepToX(a), stepToX(b)];
  applying = true;
  const charts = LINKED.filter((o) => $(o) && $(o).data);
  return Promise.all(charts.map((o) => window.Plotly.relayout($(o), { "xaxis.range": S.zoomRange })))
    .then(() => { applying = false; return hooks.refresh(); }, () => { applying = false; });
}
