/* Where the data come from: the collector's JSON API (live page) or the responses a
 * `vramwatch report` file embeds as window.VRAMWATCH_STATIC (nothing is fetched there).
 * Both sources answer the same calls with the same documents. */

import { isNum, rankKey } from "./format.js";
import { markOnce, timed } from "./dom.js";

export const STATIC = window.VRAMWATCH_STATIC || null;

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export function query(params) {
  const parts = [];
  for (const key of Object.keys(params)) {
    const v = params[key];
    if (v === null || v === undefined) continue;
    parts.push(encodeURIComponent(key) + "=" + encodeURIComponent(v));
  }
  return parts.length ? "?" + parts.join("&") : "";
}

function runPath(run) { return "api/v1/runs/" + encodeURIComponent(run); }

/** Bytes received by this page's API calls (decoded size; the benchmark reads transfer sizes). */
export const traffic = { requests: 0, bytes: 0 };

async function getJSON(url) {
  let resp;
  try {
    resp = await fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" });
  } catch (err) {
    throw new ApiError(0, "cannot reach the collector (" + (err && err.message ? err.message : err) + ")");
  }
  const body = await resp.text();
  traffic.requests++;
  traffic.bytes += body.length;
  if (!resp.ok) {
    let detail = body;
    try { detail = JSON.parse(body).detail || body; } catch (e) { /* plain text body */ }
    throw new ApiError(resp.status, typeof detail === "string" ? detail : JSON.stringify(detail));
  }
  return timed("parse", () => JSON.parse(body));
}

const httpSource = {
  live: true,
  meta: () => getJSON("api/v1/meta"),
  runs: () => getJSON("api/v1/runs"),
  /** Every rank's full row; ``delta``: ``{since, compact}`` for the rows changed since a version. */
  ranks: (run, delta) => getJSON(runPath(run) + "/ranks" + query(delta ? { since: delta.since, compact: delta.compact ? 1 : null } : {})),
  // /chart: /series with x=step, answered from the collector's min/max envelope cache
  series: (run, r, fields, opts) => getJSON(runPath(run) + "/chart" + query({
    host: r.host, rank: r.rank, fields: fields.join(","), points: opts.points || 2000, start: opts.start, end: opts.end,
  })),
  phases: (run, r) => getJSON(runPath(run) + "/phases" + query({ host: r.host, rank: r.rank })),
  events: (run, r) => getJSON(runPath(run) + "/events" + query({ host: r.host, rank: r.rank })),
  heatmap: (run, field, x, cols) => getJSON(runPath(run) + "/heatmap" + query({ field: field, x: x === "time" ? "ts" : "step", cols: cols })),
};

// Routes a collector may not have (an older version): asked for only when its OpenAPI
// document lists them, once per page, so an absent one costs no 404 per poll.
let routes = null;
function hasRoute(path) {
  if (STATIC) return Promise.resolve(false);
  if (!routes) {
    routes = getJSON("openapi.json").then((doc) => new Set(Object.keys(doc.paths || {})), () => new Set());
  }
  return routes.then((set) => set.has(path));
}
const NOT_FOUND = () => Promise.reject(new ApiError(404, "Not Found"));

/** Readiness and the next step (GET /api/v1/runs/{run}/advice); a report embeds the document. */
export async function getAdvice(run, targetGlobalTokens) {
  if (STATIC) return STATIC.advice || NOT_FOUND();
  if (!(await hasRoute("/api/v1/runs/{run}/advice"))) return NOT_FOUND();
  return getJSON(runPath(run) + "/advice" + query({ target_global_tokens: targetGlobalTokens }));
}

/** Two runs side by side (GET /api/v1/compare?a=&b=). */
export async function getCompare(a, b) {
  if (!(await hasRoute("/api/v1/compare"))) return NOT_FOUND();
  return getJSON("api/v1/compare" + query({ a: a, b: b }));
}

/** POST a JSON body (the capture request); the error detail comes back as the ApiError message. */
async function postJSON(url, body) {
  let resp;
  try {
    resp = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json", Accept: "application/json" },
      body: JSON.stringify(body), cache: "no-store", credentials: "same-origin" });
  } catch (err) {
    throw new ApiError(0, "cannot reach the collector (" + (err && err.message ? err.message : err) + ")");
  }
  const text = await resp.text();
  let doc = null;
  try { doc = JSON.parse(text); } catch (e) { /* plain text body */ }
  if (!resp.ok) {
    const detail = doc && doc.detail !== undefined ? doc.detail : text;
    throw new ApiError(resp.status, typeof detail === "string" ? detail : JSON.stringify(detail));
  }
  return doc;
}

/** Ask a rank for an allocator snapshot (POST /api/v1/runs/{run}/capture); live page only. */
export function requestCapture(run, rank, host, steps) {
  if (STATIC) return Promise.reject(new ApiError(0, "a report cannot ask for captures"));
  return postJSON(runPath(run) + "/capture", { rank: rank, host: host, steps: steps });
}

/** The run's snapshots (GET /api/v1/runs/{run}/snapshots); a report embeds its list. */
export async function getSnapshots(run) {
  if (STATIC) return STATIC.snapshots || [];
  if (!(await hasRoute("/api/v1/runs/{run}/snapshots"))) return NOT_FOUND();
  return getJSON(runPath(run) + "/snapshots");
}

/** The run's post-mortem (GET /api/v1/runs/{run}/postmortem); a report embeds it when it has one. */
export async function getPostmortem(run) {
  if (STATIC) return STATIC.postmortem || NOT_FOUND();
  if (!(await hasRoute("/api/v1/runs/{run}/postmortem"))) return NOT_FOUND();
  return getJSON(runPath(run) + "/postmortem");
}

/** Leaking ranks' growing allocation sites (GET /api/v1/runs/{run}/suspects); a report embeds them. */
export async function getSuspects(run) {
  if (STATIC) return STATIC.suspects || [];
  if (!(await hasRoute("/api/v1/runs/{run}/suspects"))) return [];
  return getJSON(runPath(run) + "/suspects");
}

/** Per rank, the other processes on its GPU by name (GET /api/v1/runs/{run}/processes). */
export async function getProcesses(run) {
  if (STATIC) return STATIC.processes || [];
  if (!(await hasRoute("/api/v1/runs/{run}/processes"))) return [];
  return getJSON(runPath(run) + "/processes");
}

/** Report files: every response is embedded; zoom slices the embedded (downsampled) data. */
function staticSource(data) {
  const missing = (what) => Promise.reject(new ApiError(404, what + " is not included in this report"));
  return {
    live: false,
    meta: () => (data.meta ? Promise.resolve(data.meta) : missing("the verdict vocabulary")),
    runs: () => Promise.resolve(data.runs || []),
    ranks: () => Promise.resolve(data.ranks || []),
    series: (run, r, fields, opts) => {
      const s = (data.series || {})[rankKey(r.host, r.rank)];
      if (!s) return missing("the chart of rank " + r.rank + " on " + r.host);
      let lo = 0, hi = s.x.length;
      if (isNum(opts.start)) while (lo < hi && s.x[lo] < opts.start) lo++;
      if (isNum(opts.end)) while (hi > lo && s.x[hi - 1] > opts.end) hi--;
      const out = { x: s.x.slice(lo, hi), series: {}, raw_points: s.raw_points, downsampled: s.downsampled };
      for (const f of fields) out.series[f] = (s.series[f] || []).slice(lo, hi);
      return Promise.resolve(out);
    },
    phases: (run, r) => Promise.resolve((data.phases || {})[rankKey(r.host, r.rank)] || []),
    events: (run, r) => Promise.resolve((data.events || {})[rankKey(r.host, r.rank)] || []),
    heatmap: (run, field, x) => {
      const h = ((data.heatmap || {})[x === "time" ? "ts" : "step"] || {})[field];
      return h ? Promise.resolve(h) : missing("the " + field + " heatmap");
    },
  };
}

export const source = STATIC ? staticSource(STATIC) : httpSource;

/**
 * Rank rows kept across polls. A plain ``/ranks`` answer is the full list of row objects.
 * A collector with delta polling stamps rows with a ``version``; then most polls ask
 * ``?compact=1&since=V`` and get only the changed ranks, as value lists under ``columns``,
 * which are merged into the full rows (top-level keys, ``verdict`` keys and ``last`` keys by
 * name); every FULL_EVERY polls (and when a rank appears) the full rows are read again, for
 * what the compact table leaves out (events, checkpoint peak, memory outside the allocator).
 */
const FULL_EVERY = 30;
const LAST_KEYS = new Set(["allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes"]);
const TOP_KEYS = new Set(["host", "rank", "liveness", "ooms", "restarts", "severity", "died", "last_step", "last_seen", "version"]);

export class RankRows {
  constructor() { this.byKey = new Map(); this.version = null; this.list = null; this.polls = 0; }

  async poll(run) {
    const delta = this.version !== null && this.polls++ % FULL_EVERY !== 0;
    const answer = await source.ranks(run, delta ? { since: this.version, compact: true } : null);
    if (Array.isArray(answer)) return this.full(answer);
    if (!answer.columns) return this.full(answer.rows || []);
    let changed = 0, unknown = false;
    for (const values of answer.rows || []) {
      const c = {};
      answer.columns.forEach((name, i) => { c[name] = values[i]; });
      const row = this.byKey.get(rankKey(c.host, c.rank));
      if (!row) { unknown = true; continue; }
      const merged = { ...row, verdict: { ...row.verdict }, last: { ...(row.last || {}) } };
      for (const name of answer.columns) {
        if (TOP_KEYS.has(name)) merged[name] = c[name];
        else if (LAST_KEYS.has(name)) merged.last[name] = c[name];
        else merged.verdict[name] = c[name];
      }
      this.byKey.set(rankKey(c.host, c.rank), merged);
      changed++;
    }
    this.version = answer.version === undefined ? this.version : answer.version;
    if (unknown) this.polls = 0; // a new rank: read the full rows next time
    if (changed) this.list = Array.from(this.byKey.values()).sort((a, b) => a.rank - b.rank || (a.host < b.host ? -1 : 1));
    return { rows: this.list, changed };
  }

  full(rows) {
    this.byKey = new Map(rows.map((r) => [rankKey(r.host, r.rank), r]));
    const versions = rows.map((r) => r.version).filter(isNum);
    this.version = versions.length === rows.length && rows.length ? Math.max(...versions) : null;
    this.list = rows;
    return { rows, changed: rows.length };
  }
}

// plotly.js loads async (a separate <script>): the first API requests and the verdict
// table do not wait for it; charts are drawn once both their data and Plotly are there.
export const plotlyReady = new Promise((resolve, reject) => {
  const done = () => { markOnce("vramwatch:plotly"); resolve(); };
  if (window.Plotly) { done(); return; }
  const tag = document.getElementById("plotly-js");
  if (!tag) { reject(new Error("the page has no plotly.js script")); return; }
  tag.addEventListener("load", () => {
    if (window.Plotly) done(); else reject(new Error("vendor/plotly.min.js did not define Plotly"));
  });
  tag.addEventListener("error", () => reject(new Error("vendor/plotly.min.js could not be loaded")));
  // the script may have failed before this module ran (its error event is gone): look again later
  const started = Date.now();
  const check = setInterval(() => {
    if (window.Plotly) { clearInterval(check); done(); } else if (Date.now() - started > 60000) {
      clearInterval(check);
      reject(new Error("vendor/plotly.min.js did not load within 60 s"));
    }
  }, 250);
});
