/* vramwatch dashboard entry module: routing, page layout, polling. Native ES modules, no
 * build step, no framework; each panel lives in its own module.
 *
 * Two pages, routed by the URL hash: the runs list (#/) and one run (#/run/NAME?rank=..).
 * Data come from the collector's JSON API, polled every second; charts are updated with
 * Plotly.react and a constant `uirevision`, so zoom and legend state survive updates.
 * The same modules render `vramwatch report` files: there window.VRAMWATCH_STATIC holds
 * every response and nothing is fetched.
 *
 * Safety rule: run, host and any other data string reaches the DOM only through
 * textContent / attribute setters (dom.js), and reaches plotly (which renders a small
 * HTML subset in labels) only through plotlyText(), which entity-escapes it. */

import { age, clock, isNum, rankLabel, timeZoneLabel } from "./format.js";
import { $, append, clear, el, markOnce, timed } from "./dom.js";
import { ApiError, RankRows, STATIC, plotlyReady, source } from "./api.js";
import { S, resetState, setVocab } from "./state.js";
import { annotate, isRunning, lastHeard, sortRanks } from "./verdict.js";
import { drawRuns, runHref } from "./runs.js";
import { drawCards } from "./cards.js";
import { drawStrip, stripHooks } from "./ranktable.js";
import { drawMain, refreshMain } from "./rankchart.js";
import { FRAG_HINT, drawFrag } from "./frag.js";
import { drawEvents } from "./events.js";
import { HEAT_MODES, refreshHeatmap } from "./heatmap.js";
import { MAX_COMPARE, overlaySelect, refreshOverlay, toggleCompare } from "./compare.js";
import { onZoomChange } from "./zoom.js";
import { advicePanel, refreshAdvice } from "./advice.js";
import { renderComparePage } from "./comparepage.js";
import { evidencePanel, refreshEvidence } from "./evidence.js";
import { memPanel, refreshMem } from "./memsplit.js";
import { catPanel, refreshCategories } from "./categories.js";

const POLL_MS = 1000; // new samples must show within 2 s
const BIG_RUN = 256; // ranks: past this, overview panels refresh less often
const ADVICE_EVERY = 5; // polls: the collector decides on the tracks it holds (a copy per rank, a fit each)
const MEM_EVERY = 5; // polls: device split and host memory of the selected rank
const EVIDENCE_EVERY = 3; // polls: snapshot list (a directory listing); the post-mortem less often

// ------------------------------------------------------------------ routing
function parseRoute() {
  const hash = location.hash.replace(/^#/, "");
  const qpos = hash.indexOf("?");
  const path = qpos >= 0 ? hash.slice(0, qpos) : hash;
  const params = new URLSearchParams(qpos >= 0 ? hash.slice(qpos + 1) : "");
  const m = /^\/run\/(.+)$/.exec(path);
  const route = { page: "runs", run: null, rank: null, host: null, x: params.get("x") === "time" ? "time" : "step" };
  if (path === "/compare") Object.assign(route, { page: "compare", a: params.get("a"), b: params.get("b") });
  if (m) {
    route.page = "run";
    try { route.run = decodeURIComponent(m[1]); } catch (e) { route.run = m[1]; }
    const rank = params.get("rank");
    route.rank = rank !== null && /^\d+$/.test(rank) ? Number(rank) : null;
    route.host = params.get("host");
  }
  if (STATIC) { route.page = "run"; route.run = STATIC.run; }
  return route;
}

function setRouteParams() {
  // Keep rank / axis choice in the URL (reload and sharing keep the view) without a reload.
  const sel = S.selected;
  const href = runHref(S.run, { rank: sel ? sel.rank : null, host: sel ? sel.host : null, x: S.x === "time" ? "time" : null });
  if (location.hash !== href) history.replaceState(null, "", href);
}

// ------------------------------------------------------------------ page chrome
function setLive(kind, text) {
  $("live").dataset.state = kind;
  $("live-text").textContent = text;
}
function setBanner(text) {
  const banner = $("banner");
  banner.hidden = !text;
  banner.textContent = text || "";
}
function setCrumbs(parts) {
  const crumbs = $("crumbs");
  clear(crumbs);
  parts.forEach((p, i) => {
    if (i) append(crumbs, el("span", { class: "sep", "aria-hidden": "true", text: "›" }));
    append(crumbs, p.href ? el("a", { href: p.href, text: p.text }) : el("span", { class: p.plain ? "muted" : "cur", text: p.text, title: p.text }));
  });
}
function collectorUrl() {
  return location.origin + location.pathname.replace(/\/index\.html$/, "").replace(/\/$/, "");
}
function startHint() {
  return el("pre", { text: "import vramwatch\n\nvw = vramwatch.init(url=\"" + collectorUrl() + "\", run=\"my-run\")\nfor step, batch in enumerate(loader):\n    ...; optimizer.step()\n    vw.step(step)" });
}
function stateMsg(title, body, extra) {
  return el("div", { class: "state-msg" }, el("h2", { text: title }), body ? el("p", { text: body }) : null, extra || null);
}
function loadingMsg(text) {
  return el("div", { class: "state-msg" }, el("div", { class: "spinner", "aria-hidden": "true" }), el("p", { text: text }));
}

function schedule(fn) {
  if (!source.live) return;
  const gen = S.gen;
  S.pollTimer = setTimeout(() => { if (gen === S.gen) fn(); }, POLL_MS);
}

function handleError(err) {
  const msg = err instanceof ApiError ? err.message : String(err && err.message ? err.message : err);
  S.error = msg;
  if (STATIC) { setBanner(msg.charAt(0).toUpperCase() + msg.slice(1) + "."); return; }
  setLive("error", "offline · retrying");
  setBanner("Cannot load data from the collector at " + collectorUrl() + ": " + msg +
    (S.lastOk ? " — showing data from " + age(S.lastOk) + "; retrying every 2 s." : " — retrying every 2 s."));
  console.warn("vramwatch:", msg, err && err.stack ? err.stack : "");
}
function clearError() {
  S.error = null;
  S.lastOk = Date.now() / 1000;
  setBanner(null);
}

// ================================================================== runs page
function renderRunsPage() {
  setCrumbs([{ text: "runs" }]);
  document.title = "vramwatch · runs";
  clear($("view"));
  append($("view"), loadingMsg("loading runs…"));
  pollRuns();
}

function pollRuns() {
  const gen = S.gen;
  source.runs().then((runs) => {
    if (gen !== S.gen) return;
    clearError();
    drawRuns(runs, startHint, stateMsg);
    const newest = runs.reduce((m, r) => Math.max(m, r.last_ts || 0), 0);
    const running = runs.filter((r) => r.status === "running").length;
    $("live").title = "times in " + timeZoneLabel();
    if (!runs.length) setLive("live", "collector up · waiting for samples");
    else if (running) setLive("live", "live · " + running + " run" + (running === 1 ? "" : "s") + " running · last sample " + age(newest));
    else setLive("ended", "no run running · last sample " + clock(newest));
  }, (err) => {
    if (gen !== S.gen) return;
    handleError(err);
    if (!S.rendered.runs) {
      clear($("view"));
      append($("view"), stateMsg("Cannot reach the collector", "The dashboard could not load the list of runs (" +
        (err.message || err) + "). Is `vramwatch serve` still running? Retrying every 2 s."));
    }
  }).then(() => { if (gen === S.gen) schedule(pollRuns); });
}

// ================================================================== run page
function renderRunPage() {
  setCrumbs(STATIC ? [{ text: "report", plain: true }, { text: S.run }] : [{ text: "runs", href: "#/" }, { text: S.run }]);
  document.title = "vramwatch · " + S.run;
  clear($("view"));
  append($("view"), loadingMsg("loading run…"));
  if (STATIC) setLive("static", "static report · generated " + clock(STATIC.generated_at) + " · times in " + timeZoneLabel());
  S.rankRows = new RankRows();
  pollRun();
}

function seg(label, attr, options) {
  const box = el("div", { class: "seg", role: "group", "aria-label": label },
    options.map(([value, text]) => el("button", { type: "button", dataset: { [attr]: value }, text: text })));
  return box;
}

function buildRunLayout() {
  const view = $("view");
  clear(view);
  const xSeg = seg("x axis", "x", [["step", "step"], ["time", "wall time"]]);
  xSeg.addEventListener("click", (ev) => {
    const x = ev.target && ev.target.dataset ? ev.target.dataset.x : null;
    if (!x || x === S.x) return;
    S.x = x;
    S.zoom = null;
    S.zoomRange = null;
    S.mainData = null;
    syncButtons();
    setRouteParams();
    refreshCharts(true);
  });
  const rankSelect = el("select", { id: "rank-select", "aria-label": "rank" });
  rankSelect.addEventListener("change", () => { const r = S.ranks[Number(rankSelect.value)]; if (r) selectRank(r); });
  const heatSeg = seg("heatmap value", "field", HEAT_MODES);
  heatSeg.addEventListener("click", (ev) => {
    const f = ev.target && ev.target.dataset ? ev.target.dataset.field : null;
    if (!f || f === S.heatMode) return;
    S.heatMode = f;
    syncButtons();
    refreshPanel("chart-heatmap", true);
  });
  const panel = (h2, hint, tools, ...body) => el("section", { class: "panel" },
    el("div", { class: "panel-head" }, h2, hint, tools ? el("div", { class: "tools" }, tools) : null), ...body);
  append(view,
    el("section", { class: "cards", id: "cards" }),
    panel(el("h2", { id: "rank-title", text: "Rank" }), el("span", { class: "hint", id: "rank-hint" }),
      [el("label", { class: "tool" }, "rank", rankSelect), el("label", { class: "tool" }, "x axis", xSeg)],
      el("div", { class: "chart", id: "chart-rank" }), el("div", { class: "chart-note", id: "rank-note" })),
    panel(el("h2", { text: "Verdict per rank" }), el("span", { class: "hint", text: "worst first · click a row to chart that rank · tick to compare" }),
      el("label", { class: "tool" }, "filter", el("input", { type: "search", id: "strip-filter", placeholder: "rank, host, state, silent, oom", size: 22 })),
      el("div", { class: "table-wrap strip" }, el("table", { class: "data", id: "verdict-strip" }, el("thead"), el("tbody"))),
      el("div", { class: "strip-foot", id: "strip-foot" })),
    advicePanel(() => refreshAdvice().catch(handleError)),
    evidencePanel(),
    el("div", { class: "grid2" },
      panel(el("h2", { text: "Ranks × steps" }), el("span", { class: "hint", text: "click a row to open that rank" }), heatSeg,
        el("div", { class: "chart", id: "chart-heatmap" }), el("div", { class: "chart-note", id: "heatmap-note" })),
      panel(el("h2", { text: "Fragmentation" }), el("span", { class: "hint", id: "frag-hint", text: FRAG_HINT }), null,
        el("div", { class: "chart", id: "chart-frag" }), el("div", { class: "chart-note", id: "frag-note" }))),
    memPanel(),
    catPanel(),
    panel(el("h2", { text: "Compare ranks" }), el("span", { class: "hint", id: "overlay-hint" }),
      el("label", { class: "tool" }, "value", overlaySelect(() => refreshOverlay().catch(handleError))),
      el("div", { class: "chart", id: "chart-overlay" })),
    panel(el("h2", { text: "Events" }), el("span", { class: "hint", id: "events-hint" }), null,
      el("div", { class: "table-wrap events" }, el("table", { class: "data", id: "events-table" }, el("thead"), el("tbody")))));
  $("strip-filter").addEventListener("input", () => drawStrip({ user: true }));
  S.rendered.layout = true;
  syncButtons();
  watchPanels();
}

function syncButtons() {
  document.querySelectorAll(".seg button[data-x]").forEach((b) => b.setAttribute("aria-pressed", b.dataset.x === S.x ? "true" : "false"));
  document.querySelectorAll(".seg button[data-field]").forEach((b) => b.setAttribute("aria-pressed", b.dataset.field === S.heatMode ? "true" : "false"));
}

function showNoRun(err) {
  clear($("view"));
  const notFound = err instanceof ApiError && err.status === 404;
  append($("view"), el("div", { class: "panel" }, notFound
    ? stateMsg("Run \u201c" + S.run + "\u201d not found", "no samples yet — start your training with vramwatch.init(url=...) and this run name, or pick a run from the list.", startHint())
    : stateMsg("Cannot load this run", String(err.message || err) + " — retrying every 2 s.")));
}

async function pollRun() {
  const gen = S.gen;
  try {
    // Big jobs: every rank's verdict (MBs at 1000+ ranks) every third second, or with delta
    // polling (compact rows of the ranks that changed) every other second; the chart still
    // every second.
    const big = S.ranks && S.ranks.length > BIG_RUN;
    const reuse = big && (S.rankRows.version === null ? S.tick % 3 !== 0 : S.tick % 2 === 1);
    const answer = reuse ? { rows: S.ranks, changed: 0 } : await S.rankRows.poll(S.run);
    if (gen !== S.gen) return;
    clearError();
    const ranks = answer.rows;
    if (!ranks.length) {
      S.rendered.layout = false;
      clear($("view"));
      append($("view"), el("div", { class: "panel" }, stateMsg("No samples for run \u201c" + S.run + "\u201d yet",
        "no samples yet — start your training with vramwatch.init(url=...) and this run name; this page fills in as soon as the first step arrives.", startHint())));
      setLive("live", "live · waiting for samples");
      return;
    }
    markOnce("vramwatch:ranks");
    if (!S.rendered.layout) buildRunLayout();
    if (!reuse) {
      timed("verdicts", () => {
        annotate(ranks);
        S.ranks = ranks;
        chooseSelection();
        drawCards();
        drawStrip();
        drawRankSelect();
      });
    }
    updateLiveText();
    const main = refreshMain(drawSecondary);
    const work = [main];
    const heatEvery = big ? 15 : 5, overlayEvery = big ? 10 : 3;
    if (S.tick === 0) {
      // first load: the rank chart first, the overview panels right after it, so their
      // (heavier, cold-cache) requests do not delay the chart
      // the advice is the run's verdict: asked with the page, not when scrolled into view
      work.push(refreshPanel("advice-panel", true));
      work.push(main.then(() => Promise.all([refreshPanel("chart-heatmap", true), refreshPanel("chart-overlay", true),
        refreshPanel("evidence-panel", true), refreshPanel("mem-panel", true), refreshPanel("cat-panel", true)])));
    } else {
      if (S.tick % heatEvery === 0) work.push(refreshPanel("chart-heatmap"));
      if (S.tick % overlayEvery === 0) work.push(refreshPanel("chart-overlay"));
      if (S.tick % ADVICE_EVERY === 1) work.push(refreshPanel("advice-panel"));
      if (S.tick % EVIDENCE_EVERY === 0) work.push(refreshPanel("evidence-panel"));
      // a hidden panel never scrolls into view: ask while it has no data, then only on screen
      if (S.tick % MEM_EVERY === 0) work.push(refreshPanel("mem-panel", $("mem-panel").hidden));
      if (S.tick % MEM_EVERY === 0) work.push(refreshPanel("cat-panel", $("cat-panel").hidden));
    }
    S.tick++;
    await Promise.all(work);
    // every panel this poll asked for has drawn: what a test waits for instead of a delay
    if (gen === S.gen) document.documentElement.dataset.polls = String(S.tick);
  } catch (err) {
    if (gen !== S.gen) return;
    const runMissing = err instanceof ApiError && err.status === 404 && !S.rendered.layout;
    if (runMissing) { clearError(); setLive("live", "live · waiting for this run"); } else handleError(err);
    if (!S.rendered.layout) showNoRun(err);
  } finally {
    if (gen === S.gen) schedule(pollRun);
  }
}

// Panels below the fold refresh only while on (or near) the screen: off screen they cost
// neither requests nor main-thread time, and catch up as soon as they scroll into view.
const PANEL_REFRESH = {
  "chart-heatmap": () => refreshHeatmap(openRow),
  "chart-overlay": () => refreshOverlay(),
  "chart-frag": () => timed("frag", drawFrag),
  "events-table": () => timed("events", drawEvents),
  "advice-panel": () => refreshAdvice(),
  "evidence-panel": () => refreshEvidence(),
  "mem-panel": () => refreshMem(),
  "cat-panel": () => refreshCategories(),
};
let panelObserver = null;

function watchPanels() {
  if (!window.IntersectionObserver) return;
  if (panelObserver) panelObserver.disconnect();
  S.inView = new Set();
  S.stale = new Set();
  panelObserver = new IntersectionObserver((entries) => {
    if (!S.inView) return; // a later page: this observer is about to be disconnected
    for (const e of entries) {
      const id = e.target.id;
      if (!e.isIntersecting) { S.inView.delete(id); continue; }
      S.inView.add(id);
      if (S.stale.delete(id)) Promise.resolve(PANEL_REFRESH[id]()).catch(handleError);
    }
  }, { rootMargin: "0px" });
  for (const id of Object.keys(PANEL_REFRESH)) panelObserver.observe($(id));
}

/** Refresh a panel now if it is on screen (or ``always``), else when it comes into view. */
function refreshPanel(id, always) {
  if (always || !S.inView || S.inView.has(id)) return Promise.resolve(PANEL_REFRESH[id]());
  S.stale.add(id);
  return Promise.resolve();
}

function drawSecondary() { refreshPanel("chart-frag", S.tick <= 1); refreshPanel("events-table", S.tick <= 1); }

/** The skip link: past the charts' toolbars to the first rank row (or run row), focused. */
function skipToRows() {
  const row = document.querySelector("#verdict-strip tbody tr[tabindex]") || document.querySelector("#runs-table tbody tr a");
  if (row) { row.scrollIntoView({ block: "center" }); row.focus(); }
}

/** The top bar says "live" only while a rank of the run is live (the collector's liveness);
 * once every rank exited, died or ended it says how the run ended and when. A job whose every
 * rank stopped together without a clean close (each within its silence window, from its own
 * step time) gets the "job stopped" banner. */
function updateLiveText() {
  if (STATIC) return;
  const newest = S.ranks.reduce((m, r) => Math.max(m, lastHeard(r)), 0);
  const live = S.ranks.filter((r) => r.liveness === "live").length;
  $("live").title = "times in " + timeZoneLabel();
  setJobBanner(null);
  if (live) { setLive("live", "live · " + live + " of " + S.ranks.length + " ranks · last sample " + age(newest)); return; }
  if (S.ranks.some(isRunning)) { setLive("stale", "no rank live · silent since " + clock(newest)); return; }
  const stopped = S.ranks.length && S.ranks.every((r) => r.died && r.died.cause === "stopped");
  if (stopped) {
    const windows = S.ranks.map((r) => r.silence_window_s).filter(isNum);
    const within = windows.length ? " (silence window " + Math.round(Math.max(...windows)) + " s)" : "";
    setLive("stopped", "job stopped · no clean close · last sample " + clock(newest));
    setJobBanner("Job stopped: every rank went quiet at " + clock(newest) + " without a clean close" + within +
      ". A hang in a collective, then a kill of the job, or a launcher restarting every rank.");
    return;
  }
  const status = S.runStatus ? S.runStatus + " · " : "";
  setLive("ended", "ended · " + status + "last sample " + clock(newest));
}

function setJobBanner(text) {
  const banner = $("job-banner");
  banner.hidden = !text;
  banner.textContent = text || "";
}

function chooseSelection() {
  const ranks = S.ranks;
  const sel = S.selected;
  if (sel) {
    const found = ranks.find((r) => r.rank === sel.rank && r.host === sel.host);
    if (found) { S.selected = found; return; }
  }
  const want = S.want;
  S.want = null;
  let pick = null;
  if (want) pick = ranks.find((r) => r.rank === want.rank && (want.host === null || r.host === want.host)) || null;
  if (!pick) pick = sortRanks(ranks, "severity", -1)[0]; // default: the worst rank
  S.selected = pick;
  S.zoom = null;
  S.zoomRange = null;
  setRouteParams();
}

function selectRank(r) {
  if (S.selected && S.selected.rank === r.rank && S.selected.host === r.host) return;
  S.selected = r;
  S.zoom = null;
  S.zoomRange = null;
  S.stepTs = null;
  S.mainData = null;
  setRouteParams();
  drawStrip({ user: true, reveal: true });
  drawRankSelect();
  refreshCharts(true);
}

function openRow(row) {
  const r = S.ranks.find((x) => x.rank === row.rank && x.host === row.host);
  if (!r) return;
  selectRank(r);
  $("chart-rank").scrollIntoView({ behavior: "smooth", block: "center" });
}

function refreshCharts(all) {
  const work = [refreshMain(drawSecondary)];
  if (all) { work.push(refreshPanel("chart-heatmap")); work.push(refreshPanel("chart-overlay")); work.push(refreshPanel("mem-panel", true)); work.push(refreshPanel("cat-panel", true)); }
  return Promise.all(work).catch(handleError);
}

function drawRankSelect() {
  const select = $("rank-select");
  if (!select) return;
  const ranks = S.ranks;
  if (select.dataset.sig !== String(ranks.length)) {
    clear(select);
    const frag = document.createDocumentFragment();
    ranks.forEach((r, i) => frag.appendChild(el("option", { value: i, text: rankLabel(r) })));
    select.appendChild(frag);
    select.dataset.sig = String(ranks.length);
  }
  const idx = ranks.findIndex((r) => S.selected && r.rank === S.selected.rank && r.host === S.selected.host);
  if (idx >= 0 && select.value !== String(idx)) select.value = String(idx);
}

// ------------------------------------------------------------------ theme
function initTheme() {
  let saved = null;
  try { saved = localStorage.getItem("vramwatch-theme"); } catch (e) { /* private mode */ }
  const prefersDark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
  document.documentElement.dataset.theme = saved || (prefersDark ? "dark" : "light");
  $("skip").addEventListener("click", skipToRows);
  $("theme-toggle").addEventListener("click", () => {
    const theme = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    document.documentElement.dataset.theme = theme;
    try { localStorage.setItem("vramwatch-theme", theme); } catch (e) { /* private mode */ }
    if (S.page === "run" && S.mainData) {
      drawMain();
      for (const id of Object.keys(PANEL_REFRESH)) refreshPanel(id);
    }
  });
}

// ------------------------------------------------------------------ boot
function route() {
  const r = parseRoute();
  if (S.page === "run" && S.page === r.page && S.run === r.run) {
    // same run: only the rank or axis changed (e.g. back button)
    if (r.x !== S.x) { S.x = r.x; S.zoom = null; S.zoomRange = null; S.mainData = null; syncButtons(); }
    if (r.rank !== null && S.ranks) {
      const found = S.ranks.find((x) => x.rank === r.rank && (r.host === null || x.host === r.host));
      if (found) selectRank(found);
    }
    refreshCharts(true);
    return;
  }
  if (panelObserver) { panelObserver.disconnect(); panelObserver = null; }
  resetState(r);
  setBanner(null);
  setJobBanner(null);
  document.documentElement.dataset.ready = "0";
  if (r.page === "run") renderRunPage();
  else if (r.page === "compare") renderComparePage(r.a, r.b, { setCrumbs, setLive, handleError });
  else renderRunsPage();
}

async function boot() {
  initTheme();
  plotlyReady.catch((err) => {
    setBanner("Charts unavailable: " + err.message + ". Reinstall the server extra: pip install 'vramwatch[server]'.");
  });
  try {
    setVocab(await source.meta());
  } catch (err) {
    // an older collector: no vocabulary, so no severity order or threshold (shown unranked)
    console.warn("vramwatch: /api/v1/meta unavailable:", err && err.message ? err.message : err);
    setVocab(null);
  }
  stripHooks({
    select: (r) => selectRank(r),
    compare: (key, on) => {
      if (!toggleCompare(key, on)) { setBanner("At most " + MAX_COMPARE + " ranks can be compared at once."); drawStrip(); return; }
      refreshOverlay().catch(handleError);
    },
  });
  onZoomChange(() => refreshMain(drawSecondary), handleError);
  window.addEventListener("hashchange", route);
  route();
}

boot();
