/* vramwatch dashboard: plain browser JavaScript, no build step, no framework.
 *
 * Two pages, routed by the URL hash: the runs list (#/) and one run (#/run/NAME?rank=..).
 * Data comes from the collector's JSON API, polled every 1.5 s; charts are updated with
 * Plotly.react and a constant `uirevision`, so zoom and legend state survive updates.
 * The same code renders `vramwatch report` files: there window.VRAMWATCH_STATIC holds
 * every response and nothing is fetched.
 *
 * Safety rule: run, host and any other data string reaches the DOM only through
 * textContent / attribute setters, and reaches plotly (which renders a small HTML
 * subset in labels) only through plotlyText(), which entity-escapes it.
 */
(function () {
  "use strict";

  var STATIC = window.VRAMWATCH_STATIC || null;
  var marked = {}; // performance marks already set (see markOnce)
  var POLL_MS = 1000; // new samples must show within 2 s
  var HEATMAP_EVERY = 5; // ticks between heatmap refreshes (it is an overview)
  var OVERLAY_EVERY = 3;
  var MAX_COMPARE = 12;
  var STRIP_ROWS = 256; // verdict rows drawn per refresh; the rest are reached by sorting or filtering
  var GIB = 1073741824;
  var MIB = 1048576;
  var SEVERITY = { leak: 5, fragmentation: 4, rising: 3, warmup: 1, plateau: 0 };
  var MAIN_FIELDS = [
    "ts", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes",
    "total_bytes", "inactive_split_bytes", "alloc_retries",
  ];
  var MAIN_POINTS = 2000; // min/max pairs: 1000 buckets, about one per pixel column

  // ------------------------------------------------------------------ DOM helpers
  function el(tag, attrs) {
    var node = document.createElement(tag);
    if (attrs) {
      for (var key in attrs) {
        if (!Object.prototype.hasOwnProperty.call(attrs, key)) continue;
        var value = attrs[key];
        if (value === null || value === undefined || value === false) continue;
        if (key === "text") node.textContent = String(value);
        else if (key === "class") node.className = value;
        else if (key === "on") {
          for (var ev in value) node.addEventListener(ev, value[ev]);
        } else if (key === "dataset") {
          for (var d in value) node.dataset[d] = String(value[d]);
        } else node.setAttribute(key, value === true ? "" : String(value));
      }
    }
    for (var i = 2; i < arguments.length; i++) append(node, arguments[i]);
    return node;
  }
  function append(node, child) {
    if (arguments.length > 2) {
      for (var i = 1; i < arguments.length; i++) append(node, arguments[i]);
      return;
    }
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) child.forEach(function (c) { append(node, c); });
    else if (typeof child === "string" || typeof child === "number") node.appendChild(document.createTextNode(String(child)));
    else node.appendChild(child);
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function $(id) { return document.getElementById(id); }

  /** Entity-escape a data string for plotly labels (plotly renders a small HTML subset). */
  function plotlyText(value) {
    // No tag can form without "<"; plotly shows quotes literally (and "&quot;" too), so only these three.
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  // ------------------------------------------------------------------ formatting
  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function gib(bytes, digits) {
    if (!isNum(bytes)) return "—";
    var g = bytes / GIB;
    if (digits === undefined) digits = Math.abs(g) >= 10 ? 1 : 2;
    return g.toFixed(digits) + " GiB";
  }
  function slopeText(bytesPerStep) {
    if (!isNum(bytesPerStep)) return "—";
    var sign = bytesPerStep > 0 ? "+" : "";
    if (Math.abs(bytesPerStep) >= MIB) return sign + (bytesPerStep / MIB).toFixed(1) + " MiB/step";
    return sign + (bytesPerStep / 1024).toFixed(1) + " KiB/step";
  }
  function duration(seconds) {
    if (!isNum(seconds)) return "—";
    if (seconds < 0) seconds = 0;
    if (seconds < 90) return Math.round(seconds) + " s";
    if (seconds < 90 * 60) return Math.round(seconds / 60) + " min";
    if (seconds < 48 * 3600) {
      var h = Math.floor(seconds / 3600);
      return h + " h " + Math.round((seconds - h * 3600) / 60) + " min";
    }
    return (seconds / 86400).toFixed(1) + " days";
  }
  function age(ts) {
    if (!isNum(ts)) return "—";
    var s = Date.now() / 1000 - ts;
    if (s < 1.5) return "just now";
    return duration(s) + " ago";
  }
  function intText(n) { return isNum(n) ? Math.round(n).toLocaleString("en-US") : "—"; }
  function toGiB(arr) {
    var out = new Array(arr.length);
    for (var i = 0; i < arr.length; i++) out[i] = isNum(arr[i]) ? arr[i] / GIB : null;
    return out;
  }
  function rankKey(host, rank) { return host + "\u0000" + rank; }
  function rankLabel(r) { return "rank " + r.rank + " · " + r.host; }
  /** "#rrggbb" -> "rgba(r,g,b,a)" for translucent fills (other colour forms pass through). */
  function alpha(color, a) {
    var m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(color);
    return m ? "rgba(" + parseInt(m[1], 16) + "," + parseInt(m[2], 16) + "," + parseInt(m[3], 16) + "," + a + ")" : color;
  }
  function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  // ------------------------------------------------------------------ data sources
  function ApiError(status, message) { this.status = status; this.message = message; }

  function query(params) {
    var parts = [];
    for (var key in params) {
      var v = params[key];
      if (v === null || v === undefined) continue;
      parts.push(encodeURIComponent(key) + "=" + encodeURIComponent(v));
    }
    return parts.length ? "?" + parts.join("&") : "";
  }
  function runPath(run) { return "api/v1/runs/" + encodeURIComponent(run); }

  function getJSON(url) {
    return fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" }).then(function (resp) {
      if (!resp.ok) {
        return resp.text().then(function (body) {
          var detail = body;
          try { detail = JSON.parse(body).detail || body; } catch (e) { /* plain text body */ }
          throw new ApiError(resp.status, typeof detail === "string" ? detail : JSON.stringify(detail));
        });
      }
      return resp.json();
    }, function (err) {
      throw new ApiError(0, "cannot reach the collector (" + (err && err.message ? err.message : err) + ")");
    });
  }

  var httpSource = {
    live: true,
    runs: function () { return getJSON("api/v1/runs"); },
    ranks: function (run) { return getJSON(runPath(run) + "/ranks"); },
    series: function (run, r, fields, opts) {
      // /chart: /series with x=step, answered from the collector's min/max envelope cache
      return getJSON(runPath(run) + "/chart" + query({
        host: r.host, rank: r.rank, fields: fields.join(","), points: opts.points || 2000,
        start: opts.start, end: opts.end,
      }));
    },
    phases: function (run, r) { return getJSON(runPath(run) + "/phases" + query({ host: r.host, rank: r.rank })); },
    events: function (run, r) { return getJSON(runPath(run) + "/events" + query({ host: r.host, rank: r.rank })); },
    heatmap: function (run, field, x) {
      return getJSON(runPath(run) + "/heatmap" + query({ field: field, x: x === "time" ? "ts" : "step" }));
    },
  };

  /** Report files: every response is embedded; zoom slices the embedded (downsampled) data. */
  function staticSource(data) {
    function resolved(v) { return Promise.resolve(v); }
    function missing(what) { return Promise.reject(new ApiError(404, what + " is not included in this report")); }
    return {
      live: false,
      runs: function () { return resolved(data.runs || []); },
      ranks: function () { return resolved(data.ranks || []); },
      series: function (run, r, fields, opts) {
        var s = (data.series || {})[rankKey(r.host, r.rank)];
        if (!s) return missing("rank " + r.rank + " on " + r.host);
        var lo = 0, hi = s.x.length;
        if (isNum(opts.start)) while (lo < hi && s.x[lo] < opts.start) lo++;
        if (isNum(opts.end)) while (hi > lo && s.x[hi - 1] > opts.end) hi--;
        var out = { x: s.x.slice(lo, hi), series: {}, raw_points: s.raw_points, downsampled: s.downsampled };
        fields.forEach(function (f) { out.series[f] = (s.series[f] || []).slice(lo, hi); });
        return resolved(out);
      },
      phases: function (run, r) { return resolved((data.phases || {})[rankKey(r.host, r.rank)] || []); },
      events: function (run, r) { return resolved((data.events || {})[rankKey(r.host, r.rank)] || []); },
      heatmap: function (run, field, x) {
        var h = ((data.heatmap || {})[x === "time" ? "ts" : "step"] || {})[field];
        return h ? resolved(h) : missing("the " + field + " heatmap");
      },
    };
  }

  var source = STATIC ? staticSource(STATIC) : httpSource;

  // plotly.js (4.8 MB) loads async: the first API requests and the verdict table do not
  // wait for it; charts are drawn once both their data and Plotly are there.
  var plotlyReady = new Promise(function (resolve, reject) {
    if (window.Plotly) { resolve(); return; }
    var done = resolve;
    resolve = function () { markOnce("vramwatch:plotly"); done(); };
    var tag = document.getElementById("plotly-js");
    if (!tag) { reject(new Error("the page has no plotly.js script")); return; }
    tag.addEventListener("load", function () {
      if (window.Plotly) resolve(); else reject(new Error("vendor/plotly.min.js did not define Plotly"));
    });
    tag.addEventListener("error", function () { reject(new Error("vendor/plotly.min.js could not be loaded")); });
  });

  // ------------------------------------------------------------------ routing
  function parseRoute() {
    var hash = location.hash.replace(/^#/, "");
    var qpos = hash.indexOf("?");
    var path = qpos >= 0 ? hash.slice(0, qpos) : hash;
    var params = new URLSearchParams(qpos >= 0 ? hash.slice(qpos + 1) : "");
    var m = /^\/run\/(.+)$/.exec(path);
    var route = { page: "runs", run: null, rank: null, host: null, x: params.get("x") === "time" ? "time" : "step" };
    if (m) {
      route.page = "run";
      try { route.run = decodeURIComponent(m[1]); } catch (e) { route.run = m[1]; }
      var rank = params.get("rank");
      route.rank = rank !== null && /^\d+$/.test(rank) ? Number(rank) : null;
      route.host = params.get("host");
    }
    if (STATIC) { route.page = "run"; route.run = STATIC.run; }
    return route;
  }
  function runHref(run, extra) {
    var q = extra ? query(extra) : "";
    return "#/run/" + encodeURIComponent(run) + q;
  }
  function setRouteParams() {
    // Keep rank / axis choice in the URL (reload and sharing keep the view) without a reload.
    var sel = state.selected;
    var href = runHref(state.run, { rank: sel ? sel.rank : null, host: sel ? sel.host : null, x: state.x === "time" ? "time" : null });
    if (location.hash !== href) history.replaceState(null, "", href);
  }

  // ------------------------------------------------------------------ page state
  var state = null;
  var pollTimer = null;
  var generation = 0;

  function resetState(route) {
    generation++;
    if (pollTimer) clearTimeout(pollTimer);
    pollTimer = null;
    state = {
      gen: generation, page: route.page, run: route.run, x: route.x,
      want: route.rank !== null ? { rank: route.rank, host: route.host } : null,
      ranks: null, selected: null, sort: { key: "severity", dir: -1 }, compare: null,
      zoom: null, stepTs: null, heatField: "headroom", overlayField: "reserved_bytes",
      tick: 0, lastOk: null, error: null, mainData: null, frag: null, rendered: {},
    };
  }

  function setLive(kind, text) {
    var live = $("live");
    live.dataset.state = kind;
    $("live-text").textContent = text;
  }
  function setBanner(text) {
    var banner = $("banner");
    if (!text) { banner.hidden = true; banner.textContent = ""; return; }
    banner.hidden = false;
    banner.textContent = text;
  }
  function setCrumbs(parts) {
    var crumbs = $("crumbs");
    clear(crumbs);
    parts.forEach(function (p, i) {
      if (i) append(crumbs, el("span", { class: "sep", "aria-hidden": "true", text: "›" }));
      append(crumbs, p.href ? el("a", { href: p.href, text: p.text })
        : el("span", { class: p.plain ? "muted" : "cur", text: p.text, title: p.text }));
    });
  }

  function collectorUrl() {
    return location.origin + location.pathname.replace(/\/index\.html$/, "").replace(/\/$/, "");
  }
  function startHint() {
    var url = collectorUrl();
    return el("pre", {
      text: "import vramwatch\n\nvw = vramwatch.init(url=\"" + url + "\", run=\"my-run\")\nfor step, batch in enumerate(loader):\n    ...; optimizer.step()\n    vw.step(step)",
    });
  }
  function stateMsg(title, body, extra) {
    return el("div", { class: "state-msg" }, el("h2", { text: title }), body ? el("p", { text: body }) : null, extra || null);
  }
  function loadingMsg(text) {
    return el("div", { class: "state-msg" }, el("div", { class: "spinner", "aria-hidden": "true" }), el("p", { text: text }));
  }

  function schedule(fn) {
    if (!source.live) return;
    var gen = state.gen;
    pollTimer = setTimeout(function () { if (gen === state.gen) fn(); }, POLL_MS);
  }

  function handleError(err) {
    var msg = err instanceof ApiError ? err.message : String(err && err.message ? err.message : err);
    state.error = msg;
    if (STATIC) { setBanner(msg.charAt(0).toUpperCase() + msg.slice(1) + "."); return; }
    setLive("error", "offline · retrying");
    setBanner("Cannot load data from the collector at " + collectorUrl() + ": " + msg +
      (state.lastOk ? " — showing data from " + age(state.lastOk) + "; retrying every 2 s." : " — retrying every 2 s."));
    if (!STATIC) console.warn("vramwatch:", msg, err && err.stack ? err.stack : "");
  }
  function clearError() {
    state.error = null;
    state.lastOk = Date.now() / 1000;
    setBanner(null);
  }

  // ================================================================== runs page
  function renderRunsPage() {
    setCrumbs([{ text: "runs" }]);
    document.title = "vramwatch · runs";
    var view = $("view");
    clear(view);
    append(view, loadingMsg("loading runs…"));
    pollRuns();
  }

  function pollRuns() {
    var gen = state.gen;
    source.runs().then(function (runs) {
      if (gen !== state.gen) return;
      clearError();
      drawRuns(runs);
      var newest = runs.reduce(function (m, r) { return Math.max(m, r.last_ts || 0); }, 0);
      setLive("live", runs.length ? "live · last sample " + age(newest) : "live · waiting for samples");
    }, function (err) {
      if (gen !== state.gen) return;
      handleError(err);
      if (!state.rendered.runs) {
        var view = $("view");
        clear(view);
        append(view, stateMsg("Cannot reach the collector", "The dashboard could not load the list of runs (" +
          (err.message || err) + "). Is `vramwatch serve` still running? Retrying every 2 s."));
      }
    }).then(function () { if (gen === state.gen) schedule(pollRuns); });
  }

  function drawRuns(runs) {
    var view = $("view");
    if (!runs.length) {
      state.rendered.runs = "empty";
      clear(view);
      append(view, el("div", { class: "panel" }, stateMsg(
        "No runs yet",
        "no samples yet — start your training with vramwatch.init(url=...) pointing at this collector:",
        startHint(),
      )));
      return;
    }
    var tbody;
    if (state.rendered.runs !== "table") {
      clear(view);
      tbody = el("tbody");
      var head = el("tr", null, ["Run", "State (worst rank)", "Ranks", "Hosts", "Min headroom", "Time to OOM",
        "Last step", "Last sample", "Samples"].map(function (h, i) {
        return el("th", { class: i >= 2 && i !== 7 ? "num" : null, text: h });
      }));
      append(view, el("section", { class: "panel" },
        el("div", { class: "panel-head" }, el("h2", { text: "Runs" }),
          el("span", { class: "hint", text: "updated live · click a run for its ranks" })),
        el("div", { class: "table-wrap" }, el("table", { class: "data", id: "runs-table" }, el("thead", null, head), tbody))));
      state.rendered.runs = "table";
    } else {
      tbody = document.querySelector("#runs-table tbody");
    }
    var sorted = runs.slice().sort(function (a, b) { return (b.last_ts || 0) - (a.last_ts || 0); });
    var frag = document.createDocumentFragment();
    sorted.forEach(function (r) {
      var href = runHref(r.run);
      var headroomBad = isNum(r.min_headroom_bytes) && r.min_headroom_bytes < 4 * GIB;
      var tr = el("tr", { dataset: { run: r.run }, on: { click: function () { location.hash = href; } } },
        el("td", { class: "name", title: r.run }, el("a", { href: href, text: r.run })),
        el("td", null, el("span", { class: "badge", dataset: { state: r.worst_state || "unknown" }, text: r.worst_state || "no verdict" })),
        el("td", { class: "num", text: intText(r.ranks) }),
        el("td", { class: "num", text: intText(r.hosts) }),
        el("td", { class: "num" + (headroomBad ? " bad" : ""), text: gib(r.min_headroom_bytes) }),
        el("td", { class: "num" + (isNum(r.seconds_to_oom) ? " bad" : " muted"), text: isNum(r.seconds_to_oom) ? duration(r.seconds_to_oom) : "no leak" }),
        el("td", { class: "num", text: intText(r.last_step) }),
        el("td", { text: age(r.last_ts) }),
        el("td", { class: "num", text: intText(r.samples) }));
      frag.appendChild(tr);
    });
    clear(tbody);
    tbody.appendChild(frag);
  }

  // ================================================================== run page
  function renderRunPage() {
    var run = state.run;
    setCrumbs(STATIC ? [{ text: "report", plain: true }, { text: run }] : [{ text: "runs", href: "#/" }, { text: run }]);
    document.title = "vramwatch · " + run;
    var view = $("view");
    clear(view);
    append(view, loadingMsg("loading run…"));
    if (STATIC) setLive("static", "static report · generated " + new Date(STATIC.generated_at * 1000).toLocaleString());
    pollRun();
  }

  function buildRunLayout() {
    var view = $("view");
    clear(view);
    var xSeg = el("div", { class: "seg", role: "group", "aria-label": "x axis" },
      el("button", { type: "button", dataset: { x: "step" }, text: "step" }),
      el("button", { type: "button", dataset: { x: "time" }, text: "wall time" }));
    xSeg.addEventListener("click", function (ev) {
      var x = ev.target && ev.target.dataset ? ev.target.dataset.x : null;
      if (!x || x === state.x) return;
      state.x = x;
      state.zoom = null;
      syncButtons();
      setRouteParams();
      refreshCharts(true);
    });
    var rankSelect = el("select", { id: "rank-select", "aria-label": "rank" });
    rankSelect.addEventListener("change", function () {
      var r = state.ranks[Number(rankSelect.value)];
      if (r) selectRank(r);
    });
    var heatSeg = el("div", { class: "seg", role: "group", "aria-label": "heatmap value" },
      el("button", { type: "button", dataset: { field: "headroom" }, text: "headroom" }),
      el("button", { type: "button", dataset: { field: "reserved" }, text: "reserved" }));
    heatSeg.addEventListener("click", function (ev) {
      var f = ev.target && ev.target.dataset ? ev.target.dataset.field : null;
      if (!f || f === state.heatField) return;
      state.heatField = f;
      syncButtons();
      refreshHeatmap();
    });
    var overlaySelect = el("select", { id: "overlay-field", "aria-label": "compared value" },
      [["reserved_bytes", "reserved"], ["allocated_bytes", "allocated"], ["peak_allocated_bytes", "per-step peak"],
        ["nvml_used_bytes", "NVML used"], ["headroom", "headroom"]].map(function (o) {
        return el("option", { value: o[0], text: o[1] });
      }));
    overlaySelect.addEventListener("change", function () { state.overlayField = overlaySelect.value; refreshOverlay(); });

    append(view,
      el("section", { class: "cards", id: "cards" }),
      el("section", { class: "panel" },
        el("div", { class: "panel-head" }, el("h2", { text: "Verdict per rank" }),
          el("span", { class: "hint", text: "worst first · click a row to chart that rank · tick to compare" }),
          el("div", { class: "tools" }, el("label", { class: "tool" }, "filter",
            el("input", { type: "search", id: "strip-filter", placeholder: "rank, host or state", size: 18 })))),
        el("div", { class: "table-wrap strip" }, el("table", { class: "data", id: "verdict-strip" }, el("thead"), el("tbody"))),
        el("div", { class: "strip-foot", id: "strip-foot" })),
      el("section", { class: "panel" },
        el("div", { class: "panel-head" }, el("h2", { id: "rank-title", text: "Rank" }),
          el("span", { class: "hint", id: "rank-hint" }),
          el("div", { class: "tools" }, el("label", { class: "tool" }, "rank", rankSelect), el("label", { class: "tool" }, "x axis", xSeg))),
        el("div", { class: "chart", id: "chart-rank" }),
        el("div", { class: "chart-note", id: "rank-note" })),
      el("div", { class: "grid2" },
        el("section", { class: "panel" },
          el("div", { class: "panel-head" }, el("h2", { text: "Ranks × steps" }),
            el("span", { class: "hint", text: "click a row to open that rank" }), el("div", { class: "tools" }, heatSeg)),
          el("div", { class: "chart", id: "chart-heatmap" }),
          el("div", { class: "chart-note", id: "heatmap-note" })),
        el("section", { class: "panel" },
          el("div", { class: "panel-head" }, el("h2", { text: "Fragmentation" }),
            el("span", { class: "hint", id: "frag-hint", text: "cached but unused memory, and allocator retries" })),
          el("div", { class: "chart", id: "chart-frag" }),
          el("div", { class: "chart-note", id: "frag-note" }))),
      el("section", { class: "panel" },
        el("div", { class: "panel-head" }, el("h2", { text: "Compare ranks" }),
          el("span", { class: "hint", id: "overlay-hint" }),
          el("div", { class: "tools" }, el("label", { class: "tool" }, "value", overlaySelect))),
        el("div", { class: "chart", id: "chart-overlay" })),
      el("section", { class: "panel" },
        el("div", { class: "panel-head" }, el("h2", { text: "Events" }), el("span", { class: "hint", id: "events-hint" })),
        el("div", { class: "table-wrap events" }, el("table", { class: "data", id: "events-table" }, el("thead"), el("tbody")))));

    $("strip-filter").addEventListener("input", function () { drawStrip(); });
    state.rendered.layout = true;
    syncButtons();
  }

  function syncButtons() {
    document.querySelectorAll(".seg button[data-x]").forEach(function (b) {
      b.setAttribute("aria-pressed", b.dataset.x === state.x ? "true" : "false");
    });
    document.querySelectorAll(".seg button[data-field]").forEach(function (b) {
      b.setAttribute("aria-pressed", b.dataset.field === state.heatField ? "true" : "false");
    });
  }

  // ------------------------------------------------------------------ polling
  function pollRun() {
    var gen = state.gen;
    // Big jobs: the verdicts of every rank (MBs at 1000+ ranks) every other second; the
    // chosen rank's chart still every second.
    var reuse = state.ranks && state.ranks.length > 256 && state.tick % 2 === 1;
    (reuse ? Promise.resolve(state.ranks) : source.ranks(state.run)).then(function (ranks) {
      if (gen !== state.gen) return null;
      clearError();
      if (!ranks.length) {
        state.rendered.layout = false;
        var view = $("view");
        clear(view);
        append(view, el("div", { class: "panel" }, stateMsg("No samples for run \u201c" + state.run + "\u201d yet",
          "no samples yet — start your training with vramwatch.init(url=...) and this run name; this page fills in as soon as the first step arrives.",
          startHint())));
        setLive("live", "live · waiting for samples");
        return null;
      }
      markOnce("vramwatch:ranks");
      if (!state.rendered.layout) buildRunLayout();
      state.ranks = ranks;
      chooseSelection();
      drawCards();
      drawStrip();
      drawRankSelect();
      updateLiveText();
      var main = refreshMain();
      var work = [main];
      if (state.tick === 0) {
        // first load: the rank chart first, the overview panels right after it, so their
        // (heavier, cold-cache) requests do not delay the chart
        work.push(main.then(function () { return Promise.all([refreshHeatmap(), refreshOverlay()]); }));
      } else {
        if (state.tick % HEATMAP_EVERY === 0) work.push(refreshHeatmap());
        if (state.tick % OVERLAY_EVERY === 0) work.push(refreshOverlay());
      }
      state.tick++;
      return Promise.all(work);
    }).catch(function (err) {
      if (gen !== state.gen) return;
      var runMissing = err instanceof ApiError && err.status === 404 && !state.rendered.layout;
      if (runMissing) { clearError(); setLive("live", "live · waiting for this run"); } else handleError(err);
      if (!state.rendered.layout) {
        var view = $("view");
        clear(view);
        var notFound = err instanceof ApiError && err.status === 404;
        append(view, el("div", { class: "panel" }, notFound
          ? stateMsg("Run \u201c" + state.run + "\u201d not found",
            "no samples yet — start your training with vramwatch.init(url=...) and this run name, or pick a run from the list.", startHint())
          : stateMsg("Cannot load this run", String(err.message || err) + " — retrying every 2 s.")));
      }
    }).then(function () { if (gen === state.gen) schedule(pollRun); });
  }

  function updateLiveText() {
    if (STATIC) return;
    var newest = state.ranks.reduce(function (m, r) { return Math.max(m, r.last_ts || 0); }, 0);
    var stale = Date.now() / 1000 - newest > 120;
    setLive(stale ? "stale" : "live", (stale ? "no new samples · last " : "live · last sample ") + age(newest));
  }

  function chooseSelection() {
    var ranks = state.ranks;
    var sel = state.selected;
    if (sel) {
      var found = ranks.find(function (r) { return r.rank === sel.rank && r.host === sel.host; });
      if (found) { state.selected = found; return; }
    }
    var want = state.want;
    state.want = null;
    var pick = null;
    if (want) {
      pick = ranks.find(function (r) { return r.rank === want.rank && (want.host === null || r.host === want.host); }) || null;
    }
    if (!pick) pick = sortRanks(ranks, "severity", -1)[0]; // default: the worst rank
    state.selected = pick;
    state.zoom = null;
    setRouteParams();
  }

  function selectRank(r) {
    if (state.selected && state.selected.rank === r.rank && state.selected.host === r.host) return;
    state.selected = r;
    state.zoom = null;
    state.stepTs = null;
    setRouteParams();
    drawStrip();
    drawRankSelect();
    refreshCharts(true);
  }

  function refreshCharts(all) {
    var work = [refreshMain()];
    if (all) { work.push(refreshHeatmap()); work.push(refreshOverlay()); }
    return Promise.all(work).catch(handleError);
  }

  // ------------------------------------------------------------------ verdict helpers
  function verdictOf(r) { return r.verdict || {}; }
  function stateOf(r) { return verdictOf(r).state || "unknown"; }
  function worstHeadroom(r) {
    var v = verdictOf(r);
    var values = [v.headroom_bytes, v.checkpoint_headroom_bytes].filter(isNum);
    return values.length ? Math.min.apply(null, values) : null;
  }
  function sortValue(r, key) {
    var v = verdictOf(r);
    switch (key) {
      case "rank": return r.rank;
      case "host": return r.host;
      case "state": return SEVERITY[stateOf(r)] !== undefined ? SEVERITY[stateOf(r)] : -1;
      case "plateau": return v.plateau_bytes;
      case "headroom": return v.headroom_bytes;
      case "ckpt": return v.checkpoint_peak_bytes;
      case "ckpt_headroom": return v.checkpoint_headroom_bytes;
      case "slope": return v.slope_bytes_per_step;
      case "oom": return isNum(v.seconds_to_oom) ? v.seconds_to_oom : v.steps_to_oom;
      case "outside": return v.outside_allocator_bytes;
      case "step": return r.last_step;
      default: return null;
    }
  }
  /** Worst first: severity of the state, then earliest OOM, then least headroom. */
  function severityCompare(a, b) {
    var sa = sortValue(a, "state"), sb = sortValue(b, "state");
    if (sa !== sb) return sb - sa;
    var oa = sortValue(a, "oom"), ob = sortValue(b, "oom");
    if (isNum(oa) !== isNum(ob)) return isNum(oa) ? -1 : 1;
    if (isNum(oa) && oa !== ob) return oa - ob;
    var ha = worstHeadroom(a), hb = worstHeadroom(b);
    if (isNum(ha) !== isNum(hb)) return isNum(ha) ? -1 : 1;
    if (isNum(ha) && ha !== hb) return ha - hb;
    return a.rank - b.rank;
  }
  function sortRanks(ranks, key, dir) {
    var copy = ranks.slice();
    if (key === "severity") {
      copy.sort(function (a, b) { return dir < 0 ? severityCompare(a, b) : severityCompare(b, a); });
      return copy;
    }
    copy.sort(function (a, b) {
      var va = sortValue(a, key), vb = sortValue(b, key);
      var na = va === null || va === undefined, nb = vb === null || vb === undefined;
      if (na !== nb) return na ? 1 : -1; // blanks last either way
      if (!na && va !== vb) return (va < vb ? -1 : 1) * dir;
      return severityCompare(a, b);
    });
    return copy;
  }

  // ------------------------------------------------------------------ summary cards
  function drawCards() {
    var ranks = state.ranks;
    var worst = sortRanks(ranks, "severity", -1)[0];
    var wv = verdictOf(worst);
    var byState = {};
    ranks.forEach(function (r) { byState[stateOf(r)] = (byState[stateOf(r)] || 0) + 1; });
    var hosts = new Set(ranks.map(function (r) { return r.host; })).size;
    var minHead = null, minHeadRank = null, minHeadAtCkpt = false;
    ranks.forEach(function (r) {
      var v = verdictOf(r);
      [[v.headroom_bytes, false], [v.checkpoint_headroom_bytes, true]].forEach(function (pair) {
        if (isNum(pair[0]) && (minHead === null || pair[0] < minHead)) { minHead = pair[0]; minHeadRank = r; minHeadAtCkpt = pair[1]; }
      });
    });
    var oomRank = null;
    ranks.forEach(function (r) {
      var s = verdictOf(r).seconds_to_oom;
      if (isNum(s) && (oomRank === null || s < verdictOf(oomRank).seconds_to_oom)) oomRank = r;
    });
    if (!oomRank) {
      ranks.forEach(function (r) {
        var s = verdictOf(r).steps_to_oom;
        if (isNum(s) && (oomRank === null || s < verdictOf(oomRank).steps_to_oom)) oomRank = r;
      });
    }
    var newest = ranks.reduce(function (m, r) { return Math.max(m, r.last_ts || 0); }, 0);
    var lastStep = ranks.reduce(function (m, r) { return Math.max(m, r.last_step || 0); }, 0);
    var worstState = stateOf(worst);
    var worstWhy = worstState === "leak" ? slopeText(wv.slope_bytes_per_step) + (wv.leak_source ? " · " + wv.leak_source : "")
      : worstState === "fragmentation" ? "reserved far above allocated"
        : worstState === "plateau" ? "all ranks stable" : worstState === "warmup" ? "still warming up" : "";

    var oomV = oomRank ? verdictOf(oomRank) : null;
    var cards = [
      { label: "Worst rank", alert: worstState === "leak",
        value: el("span", null, el("span", { class: "badge", dataset: { state: worstState }, text: worstState }), " ", el("span", { text: "rank " + worst.rank })),
        sub: worst.host + (worstWhy ? " · " + worstWhy : "") },
      { label: "Min headroom", alert: isNum(minHead) && minHead < 4 * GIB, value: gib(minHead),
        sub: minHeadRank ? "rank " + minHeadRank.rank + (minHeadAtCkpt ? " at checkpoint peak" : " on its plateau") : "no verdict yet" },
      { label: "Time to OOM", alert: !!oomRank, value: oomRank ? (isNum(oomV.seconds_to_oom) ? duration(oomV.seconds_to_oom) : intText(oomV.steps_to_oom) + " steps") : "no leak",
        sub: oomRank ? "rank " + oomRank.rank + " · ≈ " + intText(oomV.steps_to_oom) + " steps" : "no rank trending to OOM" },
      { label: "Ranks", value: intText(ranks.length),
        sub: hosts + (hosts === 1 ? " host" : " hosts") + " · " + Object.keys(byState).sort(function (a, b) { return (SEVERITY[b] || 0) - (SEVERITY[a] || 0); })
          .map(function (k) { return byState[k] + " " + k; }).join(", ") },
      // a report is read long after it was made: there the time itself, not "… ago"
      { label: "Last sample", value: STATIC ? new Date(newest * 1000).toLocaleString() : age(newest), sub: "step " + intText(lastStep) },
    ];
    var box = $("cards");
    clear(box);
    cards.forEach(function (c) {
      append(box, el("div", { class: "card" + (c.alert ? " alert" : "") },
        el("div", { class: "label", text: c.label }),
        el("div", { class: "value" }, c.value),
        el("div", { class: "sub", text: c.sub, title: c.sub })));
    });
  }

  // ------------------------------------------------------------------ verdict strip
  var STRIP_COLUMNS = [
    { key: null, title: "cmp", tip: "compare this rank in the overlay chart" },
    { key: "rank", title: "Rank", num: true },
    { key: "host", title: "Host" },
    { key: "state", title: "State" },
    { key: "plateau", title: "Plateau", num: true, tip: "plateau level of reserved memory" },
    { key: "headroom", title: "Headroom", num: true, tip: "device capacity minus plateau" },
    { key: "ckpt", title: "Ckpt peak", num: true, tip: "highest checkpoint / eval peak" },
    { key: "ckpt_headroom", title: "Ckpt headroom", num: true, tip: "headroom left at that peak" },
    { key: "slope", title: "Slope", num: true, tip: "growth at step boundaries" },
    { key: "oom", title: "OOM in", num: true, tip: "projected time (and steps) until the device is full" },
    { key: "outside", title: "Outside torch", num: true, tip: "NVML used − reserved: CUDA context, NCCL, other libraries" },
    { key: "step", title: "Last step", num: true },
  ];

  function compareSet() {
    if (state.compare) return state.compare;
    // Default comparison: the chosen rank, the worst rank and rank 0 (is rank 0 different?).
    var set = new Set();
    var ranks = state.ranks || [];
    if (state.selected) set.add(rankKey(state.selected.host, state.selected.rank));
    var worst = sortRanks(ranks, "severity", -1)[0];
    if (worst) set.add(rankKey(worst.host, worst.rank));
    var zero = ranks.find(function (r) { return r.rank === 0; });
    if (zero) set.add(rankKey(zero.host, zero.rank));
    var byRank = ranks.slice().sort(function (a, b) { return a.rank - b.rank; });
    if (byRank.length > 1) { var mid = byRank[Math.floor(byRank.length / 2)]; set.add(rankKey(mid.host, mid.rank)); }
    return set;
  }

  function drawStrip() {
    var table = $("verdict-strip");
    if (!table || !state.ranks) return;
    var thead = table.tHead;
    if (!thead.rows.length) {
      var tr = el("tr");
      STRIP_COLUMNS.forEach(function (c) {
        var th = el("th", { class: (c.num ? "num " : "") + (c.key ? "sortable" : ""), title: c.tip || null, dataset: { key: c.key || "" }, text: c.title });
        if (c.key) th.addEventListener("click", function () {
          if (state.sort.key === c.key) state.sort.dir = -state.sort.dir;
          else state.sort = { key: c.key, dir: c.key === "rank" || c.key === "host" || c.key === "headroom" || c.key === "ckpt_headroom" || c.key === "oom" ? 1 : -1 };
          drawStrip();
        });
        tr.appendChild(th);
      });
      thead.appendChild(tr);
    }
    Array.prototype.forEach.call(thead.rows[0].cells, function (th) {
      var key = th.dataset.key;
      var sortKey = state.sort.key === "severity" ? "state" : state.sort.key;
      if (key && key === sortKey) th.setAttribute("aria-sort", state.sort.dir < 0 ? "descending" : "ascending");
      else th.removeAttribute("aria-sort");
    });
    var filter = ($("strip-filter").value || "").trim().toLowerCase();
    var rows = sortRanks(state.ranks, state.sort.key === "state" ? "severity" : state.sort.key, state.sort.dir);
    if (filter) {
      rows = rows.filter(function (r) {
        return String(r.rank) === filter || r.host.toLowerCase().indexOf(filter) >= 0 || stateOf(r).indexOf(filter) >= 0;
      });
    }
    var cmp = compareSet();
    var sel = state.selected;
    var newest = state.ranks.reduce(function (m, r) { return Math.max(m, r.last_ts || 0); }, 0);
    var maxStep = state.ranks.reduce(function (m, r) { return Math.max(m, r.last_step || 0); }, 0);
    var frag = document.createDocumentFragment();
    var matching = rows.length;
    if (rows.length > STRIP_ROWS) {
      // keep the chosen rank visible even when it is not among the first rows
      var shown = rows.slice(0, STRIP_ROWS);
      var chosen = sel && rows.find(function (r) { return r.rank === sel.rank && r.host === sel.host; });
      if (chosen && shown.indexOf(chosen) < 0) shown.push(chosen);
      rows = shown;
    }
    rows.forEach(function (r) {
      var v = verdictOf(r);
      var st = stateOf(r);
      var key = rankKey(r.host, r.rank);
      var total = v.total_bytes || (r.last && r.last.total_bytes);
      var headClass = function (b) {
        if (!isNum(b) || !isNum(total)) return "num";
        return "num" + (b < 0.03 * total ? " bad" : b < 0.08 * total ? " warn" : "");
      };
      var leaking = st === "leak" || st === "rising";
      var box = el("input", { type: "checkbox", "aria-label": "compare rank " + r.rank, title: "compare in the overlay chart" });
      box.checked = cmp.has(key);
      box.addEventListener("click", function (ev) { ev.stopPropagation(); toggleCompare(key, box.checked); });
      var oomText = "—";
      if (isNum(v.seconds_to_oom)) oomText = duration(v.seconds_to_oom) + " (" + intText(v.steps_to_oom) + " steps)";
      else if (isNum(v.steps_to_oom)) oomText = intText(v.steps_to_oom) + " steps";
      var tr = el("tr", {
        class: sel && sel.rank === r.rank && sel.host === r.host ? "selected" : null,
        dataset: { rank: r.rank, host: r.host, state: st },
        on: { click: function () { selectRank(r); } },
      },
        el("td", null, box),
        el("td", { class: "num", text: r.rank }),
        el("td", { class: "name", title: r.host, text: r.host }),
        el("td", { class: "state" },
          el("span", { class: "badge", dataset: { state: st }, text: st === "unknown" ? "no verdict" : st }),
          v.fragmentation && st !== "fragmentation" ? [" ", el("span", { class: "flag", title: "fragmentation: reserved − allocated growing, allocator retries", text: "frag" })] : null,
          r.last && r.last.ooms > 0 ? [" ", el("span", { class: "flag oom", title: "the allocator reported out-of-memory errors", text: "OOM ×" + r.last.ooms })] : null,
          isNum(r.last_ts) && r.last_step < maxStep && newest - r.last_ts > 60 ? [" ", el("span", { class: "flag silent", title: "no sample from this rank for " + duration(newest - r.last_ts) + " while others report", text: "silent " + duration(newest - r.last_ts) })] : null),
        el("td", { class: "num", text: gib(v.plateau_bytes) }),
        el("td", { class: headClass(v.headroom_bytes), text: gib(v.headroom_bytes) }),
        el("td", { class: "num", text: gib(v.checkpoint_peak_bytes) }),
        el("td", { class: headClass(v.checkpoint_headroom_bytes), text: gib(v.checkpoint_headroom_bytes) }),
        el("td", { class: "num" + (leaking ? " bad" : " muted"), text: leaking || isNum(v.slope_bytes_per_step) && Math.abs(v.slope_bytes_per_step) >= MIB ? slopeText(v.slope_bytes_per_step) : "—" }),
        el("td", { class: "num" + (oomText !== "—" ? " bad" : " muted"), text: oomText }),
        el("td", { class: "num", text: gib(v.outside_allocator_bytes) }),
        el("td", { class: "num", text: intText(r.last_step) }));
      frag.appendChild(tr);
    });
    var tbody = table.tBodies[0];
    clear(tbody);
    tbody.appendChild(frag);
    var foot = $("strip-foot");
    clear(foot);
    var counts = {};
    state.ranks.forEach(function (r) { counts[stateOf(r)] = (counts[stateOf(r)] || 0) + 1; });
    append(foot, el("span", { text: (matching > rows.length ? "first " + rows.length + " of " + matching + " matching ranks; sort or filter to see others · "
      : rows.length + " of ") + state.ranks.length + " ranks" + (matching > rows.length ? " in the run" : " shown") }),
      Object.keys(counts).sort(function (a, b) { return (SEVERITY[b] || 0) - (SEVERITY[a] || 0); }).map(function (k) {
        return el("span", null, el("span", { class: "badge", dataset: { state: k }, text: k }), " " + counts[k]);
      }));
  }

  function toggleCompare(key, on) {
    var set = new Set(compareSet());
    if (on) {
      if (set.size >= MAX_COMPARE) { setBanner("At most " + MAX_COMPARE + " ranks can be compared at once."); drawStrip(); return; }
      set.add(key);
    } else set.delete(key);
    state.compare = set;
    refreshOverlay();
  }

  function drawRankSelect() {
    var select = $("rank-select");
    if (!select) return;
    var ranks = state.ranks;
    if (select.options.length !== ranks.length || select.dataset.sig !== String(ranks.length)) {
      clear(select);
      ranks.forEach(function (r, i) { select.appendChild(el("option", { value: i, text: rankLabel(r) })); });
      select.dataset.sig = String(ranks.length);
    }
    var idx = ranks.findIndex(function (r) { return state.selected && r.rank === state.selected.rank && r.host === state.selected.host; });
    if (idx >= 0) select.value = String(idx);
  }

  // ------------------------------------------------------------------ theme for plotly
  function chartTheme() {
    return {
      text: cssVar("--text"), muted: cssVar("--muted"), grid: cssVar("--grid"), panel: cssVar("--panel"),
      border: cssVar("--border"),
      allocated: cssVar("--c-allocated"), reserved: cssVar("--c-reserved"), peak: cssVar("--c-peak"),
      nvml: cssVar("--c-nvml"), total: cssVar("--c-total"), gap: cssVar("--c-gap"), plateau: cssVar("--c-plateau"),
      proj: cssVar("--c-proj"), ckpt: cssVar("--c-ckpt"), ckptLine: cssVar("--c-ckpt-line"), evalFill: cssVar("--c-eval"),
      evalLine: cssVar("--c-eval-line"), leak: cssVar("--s-leak"), frag: cssVar("--s-fragmentation"), rising: cssVar("--s-rising"),
    };
  }
  function baseLayout(t, extra) {
    var layout = {
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      font: { color: t.text, size: 12, family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif" },
      margin: { l: 72, r: 18, t: 10, b: 40 },
      hovermode: "x unified",
      hoverlabel: { bgcolor: t.panel, bordercolor: t.border, font: { color: t.text } },
      legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", bgcolor: "rgba(0,0,0,0)" },
      showlegend: true,
    };
    for (var k in extra) layout[k] = extra[k];
    return layout;
  }
  function xAxis(t, extra) {
    var ax = {
      gridcolor: t.grid, zerolinecolor: t.grid, linecolor: t.border, tickfont: { color: t.muted },
      title: { text: state.x === "time" ? "" : "step", font: { color: t.muted, size: 11 }, standoff: 4 },
      type: state.x === "time" ? "date" : "linear", hoverformat: state.x === "time" ? "%H:%M:%S" : ",d",
      tickformat: state.x === "time" ? "" : "~s",
    };
    for (var k in extra) ax[k] = extra[k];
    return ax;
  }
  function yAxis(t, extra) {
    var ax = { gridcolor: t.grid, zerolinecolor: t.grid, linecolor: t.border, tickfont: { color: t.muted }, ticksuffix: " GiB", rangemode: "tozero" };
    for (var k in extra) ax[k] = extra[k];
    return ax;
  }
  var PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"] };

  // ------------------------------------------------------------------ x mapping (step <-> wall time)
  /** Map steps to the chart's x values (steps, or epoch milliseconds in time mode). */
  function interp(xs, ys, v) {
    var n = xs.length;
    if (!n) return null;
    if (v <= xs[0]) return ys[0] + (n > 1 && xs[1] !== xs[0] ? (v - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]) : 0);
    if (v >= xs[n - 1]) {
      var slope = n > 1 && xs[n - 1] !== xs[n - 2] ? (ys[n - 1] - ys[n - 2]) / (xs[n - 1] - xs[n - 2]) : 0;
      return ys[n - 1] + (v - xs[n - 1]) * slope;
    }
    var lo = 0, hi = n - 1;
    while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (xs[mid] <= v) lo = mid; else hi = mid; }
    var span = xs[hi] - xs[lo];
    return span ? ys[lo] + (v - xs[lo]) * (ys[hi] - ys[lo]) / span : ys[lo];
  }
  function stepToX(step, ts) {
    if (state.x !== "time") return step;
    if (isNum(ts)) return ts * 1000;
    var m = state.stepTs;
    return m ? interp(m.steps, m.ts, step) * 1000 : null;
  }
  function xToStep(x) {
    if (state.x !== "time") return Number(x);
    var ms = typeof x === "number" ? x : Date.parse(String(x).replace(" ", "T") + (/[zZ]|[+-]\d\d:?\d\d$/.test(String(x)) ? "" : "Z"));
    var m = state.stepTs;
    return m ? interp(m.ts, m.steps, ms / 1000) : null;
  }

  // ------------------------------------------------------------------ main rank chart
  function refreshMain() {
    var r = state.selected;
    if (!r) return Promise.resolve();
    var gen = state.gen, sel = rankKey(r.host, r.rank), zoom = state.zoom;
    var opts = { points: MAIN_POINTS };
    if (zoom) { opts.start = Math.floor(zoom[0]); opts.end = Math.ceil(zoom[1]); }
    return Promise.all([
      source.series(state.run, r, MAIN_FIELDS, opts),
      source.phases(state.run, r),
      source.events(state.run, r).catch(function () { return r.events || []; }),
      plotlyReady,
    ]).then(function (res) {
      if (gen !== state.gen || !state.selected || rankKey(state.selected.host, state.selected.rank) !== sel) return;
      var series = res[0];
      markOnce("vramwatch:chart-data");
      if (!zoom && series.x.length) state.stepTs = { steps: series.x, ts: series.series.ts };
      state.mainData = { series: series, phases: res[1] || [], events: res[2] || [], zoomed: !!zoom };
      drawMain();
      markInteractive();
      // the secondary panels after the main chart is on screen
      setTimeout(function () {
        if (gen !== state.gen || !state.mainData) return;
        drawFrag();
        drawEvents();
      }, 0);
    });
  }

  function phaseGroups(phases) {
    // Consecutive samples of one phase form one band; a band keeps its highest peak.
    // Peak and headroom as the engine judges them: the allocator's peak during the phase,
    // and capacity minus that peak minus memory outside the allocator (NVML used − reserved).
    var sorted = phases.slice().sort(function (a, b) { return a.step - b.step || a.ts - b.ts; });
    var groups = [];
    sorted.forEach(function (p) {
      var g = groups[groups.length - 1];
      var peak = p.peak_allocated_bytes || 0;
      var outside = isNum(p.nvml_used_bytes) && isNum(p.reserved_bytes) ? Math.max(0, p.nvml_used_bytes - p.reserved_bytes) : 0;
      var headroom = isNum(p.total_bytes) ? p.total_bytes - outside - peak : null;
      if (g && g.phase === p.phase && p.step - g.step1 <= 1) {
        g.step1 = p.step; g.ts1 = p.ts;
        if (peak > g.peak) { g.peak = peak; g.headroom = headroom; g.peakStep = p.step; g.peakTs = p.ts; }
      } else {
        groups.push({ phase: p.phase, step0: p.step, step1: p.step, ts0: p.ts, ts1: p.ts, peak: peak, headroom: headroom,
          peakStep: p.step, peakTs: p.ts });
      }
    });
    return groups;
  }

  function medianStepSeconds() {
    var m = state.stepTs;
    if (!m || m.steps.length < 2) return 1;
    var n = m.steps.length;
    var dt = (m.ts[n - 1] - m.ts[0]) / Math.max(1, m.steps[n - 1] - m.steps[0]);
    return dt > 0 ? dt : 1;
  }

  var EVENT_LABELS = {
    plateau_break: "plateau break", leak: "leak", fragmentation: "fragmentation", restart: "restart", oom: "OOM",
    plateau: "plateau", periodic_spike: "periodic spike",
  };

  function drawMain() {
    var gd = $("chart-rank");
    var d = state.mainData;
    if (!gd || !d) return;
    var t = chartTheme();
    var r = state.selected;
    var v = verdictOf(r);
    var s = d.series;
    var timeMode = state.x === "time";
    var xs = timeMode ? s.series.ts.map(function (ts) { return ts * 1000; }) : s.x;
    var title = $("rank-title");
    title.textContent = "Rank " + r.rank + " · " + r.host;
    var hint = $("rank-hint");
    clear(hint);
    append(hint, el("span", { class: "badge", dataset: { state: stateOf(r) }, text: stateOf(r) }),
      " " + (s.downsampled ? intText(s.x.length) + " of " + intText(s.raw_points) + " points (min/max per bucket kept)" : intText(s.x.length) + " points") +
      (d.zoomed ? " · zoomed: double-click to reset" : ""));
    if (!s.x.length) {
      Plotly.react(gd, [], baseLayout(t, { xaxis: xAxis(t), yaxis: yAxis(t), uirevision: uirev("main"),
        annotations: [{ text: "no training samples in this range yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { color: t.muted } }] }), PLOT_CONFIG);
      return;
    }
    var alloc = toGiB(s.series.allocated_bytes), resv = toGiB(s.series.reserved_bytes), peak = toGiB(s.series.peak_allocated_bytes);
    var used = toGiB(s.series.nvml_used_bytes), total = s.series.total_bytes;
    var haveNvml = used.some(isNum);
    var capacity = total.reduce(function (m, b) { return isNum(b) && b > m ? b : m; }, 0) || v.total_bytes || 0;
    var gap = new Array(xs.length);
    for (var i = 0; i < xs.length; i++) {
      var u = s.series.nvml_used_bytes[i], rs = s.series.reserved_bytes[i];
      gap[i] = isNum(u) && isNum(rs) ? (u - rs) / GIB : null;
    }
    var hoverG = "%{y:.2f} GiB";
    var traces = [];
    var x0 = xs[0], x1 = xs[xs.length - 1];

    // leak projection: from the current level to the capacity line
    var projection = null;
    if ((stateOf(r) === "leak" || stateOf(r) === "rising") && isNum(v.slope_bytes_per_step) && v.slope_bytes_per_step > 0 && isNum(v.steps_to_oom) && capacity) {
      var lastStep = isNum(v.step) ? v.step : r.last_step;
      var lastTs = isNum(v.ts) ? v.ts : r.last_ts;
      var startLevel = capacity - v.slope_bytes_per_step * v.steps_to_oom;
      var span = Math.max(1, (isNum(lastStep) ? lastStep : 0) - (state.stepTs ? state.stepTs.steps[0] : 0));
      var shown = Math.min(v.steps_to_oom, 1.5 * span); // a far-off OOM would squash the data
      var endStep = lastStep + shown;
      var endX, startX;
      if (timeMode) {
        var secPerStep = isNum(v.seconds_to_oom) && v.steps_to_oom > 0 ? v.seconds_to_oom / v.steps_to_oom : medianStepSeconds();
        startX = lastTs * 1000; endX = (lastTs + shown * secPerStep) * 1000;
      } else { startX = lastStep; endX = endStep; }
      projection = {
        x: [startX, endX], y: [startLevel / GIB, (startLevel + v.slope_bytes_per_step * shown) / GIB],
        reachesCapacity: shown >= v.steps_to_oom,
      };
      if (!d.zoomed) x1 = Math.max(x1, endX);
    }

    if (capacity) {
      traces.push({ name: "device total " + gib(capacity), x: [x0, x1], y: [capacity / GIB, capacity / GIB], mode: "lines",
        line: { color: t.total, width: 1.5, dash: "dash" }, hovertemplate: "device total " + gib(capacity) + "<extra></extra>" });
    }
    if (haveNvml) {
      traces.push({ name: "NVML used", x: xs, y: used, mode: "lines", line: { color: t.nvml, width: 1.3 }, hovertemplate: hoverG, connectgaps: false });
    }
    traces.push({ name: "reserved", x: xs, y: resv, mode: "lines", line: { color: t.reserved, width: 2 }, hovertemplate: hoverG });
    traces.push({ name: "per-step peak", x: xs, y: peak, mode: "lines", line: { color: t.peak, width: 0.8 }, opacity: 0.5, hovertemplate: hoverG });
    traces.push({ name: "allocated", x: xs, y: alloc, mode: "lines", line: { color: t.allocated, width: 2 }, hovertemplate: hoverG });
    if (isNum(v.plateau_bytes)) {
      traces.push({ name: "plateau " + gib(v.plateau_bytes), x: [x0, x1], y: [v.plateau_bytes / GIB, v.plateau_bytes / GIB], mode: "lines",
        line: { color: t.plateau, width: 1.5, dash: "dot" }, hovertemplate: "plateau " + gib(v.plateau_bytes) + "<extra></extra>" });
    }
    if (projection) {
      var label = "leak → OOM " + (isNum(v.seconds_to_oom) ? "in " + duration(v.seconds_to_oom) : "") + " (" + intText(v.steps_to_oom) + " steps)";
      traces.push({ name: label, x: projection.x, y: projection.y, mode: "lines+markers", line: { color: t.proj, width: 2, dash: "dot" },
        marker: { size: [0, projection.reachesCapacity ? 10 : 0], symbol: "x", color: t.proj },
        hovertemplate: "projection %{y:.1f} GiB<extra></extra>" });
    }

    // checkpoint / eval phases: bands plus a marker at each peak
    var groups = phaseGroups(d.phases);
    var half = timeMode ? medianStepSeconds() * 500 : 0.5;
    var shapes = [];
    var markers = {};
    var zoomLo = d.zoomed ? Math.min.apply(null, xs) : -Infinity, zoomHi = d.zoomed ? Math.max.apply(null, xs) : Infinity;
    var worstGroup = null;
    groups.forEach(function (g) {
      var gx0 = timeMode ? g.ts0 * 1000 : g.step0, gx1 = timeMode ? g.ts1 * 1000 : g.step1;
      if (gx1 < zoomLo || gx0 > zoomHi) return;
      var isCkpt = /ckpt|checkpoint|save/i.test(g.phase);
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: gx0 - half, x1: gx1 + half, y0: 0, y1: 1, layer: "below",
        name: (isCkpt ? "checkpoint" : "phase") + " band " + g.phase, fillcolor: isCkpt ? t.ckpt : t.evalFill,
        line: { width: 1, color: isCkpt ? t.ckptLine : t.evalLine }, opacity: 0.55 });
      var m = markers[g.phase] || (markers[g.phase] = { x: [], y: [], text: [], isCkpt: isCkpt });
      m.x.push(timeMode ? g.peakTs * 1000 : g.peakStep);
      m.y.push(g.peak / GIB);
      m.text.push(plotlyText(g.phase) + " at step " + intText(g.peakStep) + " · peak " + gib(g.peak) + (isNum(g.headroom) ? " · headroom " + gib(g.headroom) : ""));
      if (!worstGroup || g.peak > worstGroup.peak) worstGroup = g;
    });
    Object.keys(markers).forEach(function (phase) {
      var m = markers[phase];
      traces.push({ name: plotlyText(phase) + " peak", x: m.x, y: m.y, text: m.text, mode: "markers",
        marker: { symbol: "diamond", size: 8, color: m.isCkpt ? t.ckptLine : t.evalLine, line: { width: 1, color: t.panel } },
        hovertemplate: "%{text}<extra></extra>" });
    });
    var annotations = [];
    if (worstGroup) {
      annotations.push({ x: timeMode ? worstGroup.peakTs * 1000 : worstGroup.peakStep, y: worstGroup.peak / GIB, xref: "x", yref: "y",
        text: "highest " + plotlyText(worstGroup.phase) + " peak " + gib(worstGroup.peak) + (isNum(worstGroup.headroom) ? " · " + gib(worstGroup.headroom) + " left" : ""),
        showarrow: true, arrowhead: 0, arrowcolor: t.ckptLine, ax: 0, ay: -26, font: { size: 11, color: t.text }, bgcolor: t.panel, bordercolor: t.ckptLine, borderpad: 3 });
    }

    // engine events: vertical markers with a short label
    var evs = (d.events || []).filter(function (e) { return EVENT_LABELS[e.type] && e.type !== "plateau" && e.type !== "periodic_spike"; });
    evs = evs.slice(-12);
    evs.forEach(function (e, idx) {
      var ex = stepToX(e.step, e.ts);
      if (!isNum(ex) || ex < zoomLo || ex > zoomHi) return;
      var color = e.type === "leak" || e.type === "oom" ? t.leak : e.type === "fragmentation" ? t.frag : t.rising;
      shapes.push({ type: "line", xref: "x", yref: "paper", x0: ex, x1: ex, y0: 0.24, y1: 1, name: "event " + e.type,
        line: { color: color, width: 1.5, dash: "dashdot" } });
      var text = EVENT_LABELS[e.type];
      if (e.type === "leak" && isNum(e.slope_bytes_per_step)) text += " " + slopeText(e.slope_bytes_per_step);
      annotations.push({ x: ex, y: 1, xref: "x", yref: "paper", yanchor: "top", xanchor: "left", text: text, showarrow: false,
        font: { size: 11, color: color }, bgcolor: t.panel, borderpad: 2, yshift: -(idx % 3) * 16,
        hovertext: plotlyText(e.type) + " at step " + intText(e.step) });
    });
    if (projection && projection.reachesCapacity) {
      annotations.push({ x: projection.x[1], y: projection.y[1], xref: "x", yref: "y", text: "OOM" + (isNum(v.seconds_to_oom) ? " in " + duration(v.seconds_to_oom) : ""),
        showarrow: true, arrowhead: 0, ax: -30, ay: 22, arrowcolor: t.proj, font: { size: 11, color: t.proj }, bgcolor: t.panel, bordercolor: t.proj, borderpad: 3 });
    }

    // lower panel: memory outside the torch allocator (NVML used − reserved)
    if (haveNvml) {
      traces.push({ name: "outside torch (NVML − reserved)", x: xs, y: gap, yaxis: "y2", mode: "lines", fill: "tozeroy",
        fillcolor: alpha(t.gap, 0.22), line: { color: t.gap, width: 1.3 }, hovertemplate: hoverG });
    }
    var layout = baseLayout(t, {
      uirevision: uirev("main"),
      xaxis: xAxis(t, { anchor: "y2" }),
      yaxis: yAxis(t, { domain: haveNvml ? [0.3, 1] : [0, 1], rangemode: "normal", autorange: true }),
      yaxis2: yAxis(t, { domain: [0, 0.2], title: { text: haveNvml ? "outside torch" : "", font: { color: t.muted, size: 11 }, standoff: 2 }, visible: haveNvml }),
      shapes: shapes,
      annotations: annotations,
      margin: { l: 72, r: 18, t: 36, b: 40 },
    });
    Plotly.react(gd, traces, layout, PLOT_CONFIG);
    wireZoom(gd);
    var note = $("rank-note");
    clear(note);
    var notes = [];
    if (!haveNvml) notes.push("NVML is unavailable on this host: device-wide used memory and the outside-torch gap are not shown.");
    if (groups.length) notes.push(groups.length + " checkpoint/eval phase" + (groups.length === 1 ? "" : "s") + " shaded; diamonds mark each peak.");
    if (projection && !projection.reachesCapacity) notes.push("Leak projection drawn part-way; the device fills in " + intText(v.steps_to_oom) + " steps.");
    if (v.leak_source === "outside_allocator" || v.leak_source === "outside") notes.push("The leak is outside the torch allocator (NVML used − reserved is growing): look at NCCL, CUDA graphs, or native extensions.");
    append(note, notes.join(" "));
  }

  function uirev(which) {
    var r = state.selected;
    return which + "|" + state.run + "|" + (r ? rankKey(r.host, r.rank) : "") + "|" + state.x;
  }

  // ------------------------------------------------------------------ fragmentation panel
  function drawFrag() {
    var gd = $("chart-frag");
    var d = state.mainData;
    if (!gd || !d) return;
    var t = chartTheme();
    var s = d.series;
    var xs = state.x === "time" ? s.series.ts.map(function (ts) { return ts * 1000; }) : s.x;
    var cached = new Array(xs.length);
    for (var i = 0; i < xs.length; i++) {
      var a = s.series.allocated_bytes[i], rs = s.series.reserved_bytes[i];
      cached[i] = isNum(a) && isNum(rs) ? (rs - a) / GIB : null;
    }
    var traces = [
      { name: "reserved − allocated", x: xs, y: cached, mode: "lines", fill: "tozeroy", fillcolor: alpha(t.reserved, 0.2), line: { color: t.reserved, width: 1.5 }, hovertemplate: "%{y:.2f} GiB" },
      { name: "inactive split", x: xs, y: toGiB(s.series.inactive_split_bytes), mode: "lines", line: { color: t.frag, width: 1.5 }, hovertemplate: "%{y:.2f} GiB" },
      { name: "alloc retries (total)", x: xs, y: s.series.alloc_retries, yaxis: "y2", mode: "lines", line: { color: t.leak, width: 1.5, shape: "hv" }, hovertemplate: "%{y:,d}" },
    ];
    var maxRetries = s.series.alloc_retries.reduce(function (m, v) { return isNum(v) && v > m ? v : m; }, 0);
    var layout = baseLayout(t, {
      uirevision: uirev("frag"),
      xaxis: xAxis(t),
      yaxis: yAxis(t),
      yaxis2: { overlaying: "y", side: "right", showgrid: false, tickfont: { color: t.leak }, title: { text: "retries", font: { color: t.leak, size: 11 } },
        range: [0, Math.max(1, maxRetries) * 1.05], dtick: Math.max(1, Math.ceil(maxRetries / 4)), tickformat: ",d", zeroline: false },
      margin: { l: 72, r: 52, t: 30, b: 40 },
    });
    Plotly.react(gd, traces, layout, PLOT_CONFIG);
    wireZoom(gd);
    var v = verdictOf(state.selected);
    var retries = s.series.alloc_retries.filter(isNum);
    var retryCount = retries.length ? retries[retries.length - 1] : 0;
    var lastCached = cached.filter(isNum).pop();
    var note = $("frag-note");
    note.textContent = (v.fragmentation || stateOf(state.selected) === "fragmentation")
      ? "Fragmentation: " + gib(isNum(lastCached) ? lastCached * GIB : null) + " cached but unused, " + intText(retryCount) +
        " allocator retries. Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
      : "Now " + gib(isNum(lastCached) ? lastCached * GIB : null) + " cached but unused; " + intText(retryCount) + " allocator retries so far.";
  }

  // ------------------------------------------------------------------ events table
  function eventDetail(e) {
    var parts = [];
    if (isNum(e.slope_bytes_per_step)) parts.push(slopeText(e.slope_bytes_per_step));
    if (isNum(e.steps_to_oom)) parts.push("OOM in " + intText(e.steps_to_oom) + " steps");
    if (isNum(e.seconds_to_oom)) parts.push("(" + duration(e.seconds_to_oom) + ")");
    if (e.source) parts.push("source: " + e.source);
    if (isNum(e.peak_bytes)) parts.push("peak " + gib(e.peak_bytes));
    if (isNum(e.above_plateau_bytes)) parts.push(gib(e.above_plateau_bytes) + " above plateau");
    if (isNum(e.headroom_bytes)) parts.push(gib(e.headroom_bytes) + " headroom");
    if (isNum(e.level_bytes)) parts.push("level " + gib(e.level_bytes));
    if (isNum(e.plateau_bytes)) parts.push("plateau " + gib(e.plateau_bytes));
    if (e.message) parts.push(String(e.message));
    return parts.join(" · ");
  }
  function drawEvents() {
    var table = $("events-table");
    if (!table) return;
    var events = (state.mainData.events || []).slice().sort(function (a, b) { return (b.step || 0) - (a.step || 0); });
    if (!table.tHead.rows.length) {
      table.tHead.appendChild(el("tr", null, el("th", { class: "num", text: "Step" }), el("th", { text: "Event" }), el("th", { text: "Details" })));
    }
    var tbody = table.tBodies[0];
    clear(tbody);
    $("events-hint").textContent = "rank " + state.selected.rank + " · " + events.length + " event" + (events.length === 1 ? "" : "s") + ", newest first";
    if (!events.length) {
      tbody.appendChild(el("tr", null, el("td", { colspan: 3, class: "muted", text: "no events yet: the engine reports plateaus, breaks, leaks and phase spikes here." })));
      return;
    }
    events.slice(0, 500).forEach(function (e) {
      var tr = el("tr", { dataset: { type: e.type }, on: { click: function () { zoomToStep(e.step); } }, title: "zoom the chart to this event" },
        el("td", { class: "num", text: intText(e.step) }),
        el("td", { text: String(e.type).replace(/_/g, " ") }),
        el("td", { text: eventDetail(e) }));
      tbody.appendChild(tr);
    });
  }
  function zoomToStep(step) {
    var m = state.stepTs;
    var span = m ? Math.max(50, (m.steps[m.steps.length - 1] - m.steps[0]) / 20) : 200;
    var a = step - span, b = step + span;
    state.zoom = [a, b];
    var range = [stepToX(a), stepToX(b)];
    applyingZoom = true;
    Promise.all([Plotly.relayout($("chart-rank"), { "xaxis.range": range }), Plotly.relayout($("chart-frag"), { "xaxis.range": range })])
      .then(function () { applyingZoom = false; return refreshMain(); }, function () { applyingZoom = false; });
  }

  // ------------------------------------------------------------------ zoom: re-fetch detail, keep charts in step
  var applyingZoom = false;
  // Handlers are attached right after a chart's first draw (plotly creates gd.on then),
  // so no click can fall between the first draw and the wiring.
  function wireZoom(gd) {
    if (gd.__vwWired) return;
    gd.__vwWired = true;
    gd.on("plotly_relayout", function (ev) { onZoom(gd.id, ev); });
  }
  function wireHeatmap(gd) {
    if (gd.__vwWired) return;
    gd.__vwWired = true;
    gd.on("plotly_click", function (ev) {
      var p = ev && ev.points && ev.points[0];
      if (!p || !state.heat) return;
      var row = state.heat.rowsByRank[p.y];
      if (!row) return;
      var r = state.ranks.find(function (x) { return x.rank === row.rank && x.host === row.host; });
      if (r) {
        selectRank(r);
        $("chart-rank").scrollIntoView({ behavior: "smooth", block: "center" });
      }
    });
  }
  function onZoom(id, ev) {
    if (applyingZoom || !ev) return;
    var lo = ev["xaxis.range[0]"], hi = ev["xaxis.range[1]"];
    if (ev["xaxis.range"]) { lo = ev["xaxis.range"][0]; hi = ev["xaxis.range"][1]; }
    var other = $(id === "chart-rank" ? "chart-frag" : "chart-rank");
    if (ev["xaxis.autorange"]) {
      state.zoom = null;
      applyingZoom = true;
      Plotly.relayout(other, { "xaxis.autorange": true }).then(function () { applyingZoom = false; }, function () { applyingZoom = false; });
      refreshMain().catch(handleError);
      return;
    }
    if (lo === undefined || hi === undefined) return;
    var a = xToStep(lo), b = xToStep(hi);
    if (!isNum(a) || !isNum(b)) return;
    // fetch a little beyond the visible range so panning a bit does not show empty edges
    var pad = (b - a) * 0.1;
    state.zoom = [Math.max(0, a - pad), b + pad];
    applyingZoom = true;
    Plotly.relayout(other, { "xaxis.range": [lo, hi] }).then(function () { applyingZoom = false; }, function () { applyingZoom = false; });
    refreshMain().catch(handleError);
  }

  // ------------------------------------------------------------------ heatmap
  function refreshHeatmap() {
    var gen = state.gen, field = state.heatField, x = state.x;
    return Promise.all([source.heatmap(state.run, field, x), plotlyReady]).then(function (res) {
      if (gen !== state.gen || field !== state.heatField || x !== state.x) return;
      drawHeatmap(res[0]);
    }, function (err) {
      if (gen !== state.gen) return;
      $("heatmap-note").textContent = "heatmap unavailable: " + (err.message || err);
    });
  }
  function drawHeatmap(h) {
    var gd = $("chart-heatmap");
    if (!gd) return;
    var t = chartTheme();
    var rowsByRank = {};
    var uniqueRanks = new Set(h.rows.map(function (r) { return r.rank; })).size === h.rows.length;
    // y is the rank number (ranks are unique within a run); duplicates fall back to row index
    var ys = h.rows.map(function (r, i) { var y = uniqueRanks ? r.rank : i; rowsByRank[y] = r; return y; });
    state.heat = { rowsByRank: rowsByRank };
    var xs = h.x.map(function (x) { return state.x === "time" ? x * 1000 : x; });
    var isHeadroom = h.field === "headroom";
    var zmax = 0;
    h.z.forEach(function (row) { row.forEach(function (z) { if (isNum(z) && z > zmax) zmax = z; }); });
    var colors = isHeadroom
      ? [[0, "#b2182b"], [0.12, "#e66101"], [0.3, "#fdb863"], [0.6, "#80cdc1"], [1, "#1b7f79"]]
      : [[0, "#0d0887"], [0.5, "#9c179e"], [0.8, "#ed7953"], [1, "#f0f921"]];
    var trace = {
      type: "heatmap", x: xs, y: ys, z: h.z, colorscale: colors, zmin: isHeadroom ? 0 : undefined, zmax: isHeadroom ? Math.max(zmax, 1) : undefined,
      hoverongaps: false, xgap: 0, ygap: h.rows.length <= 64 ? 1 : 0,
      colorbar: { title: { text: (isHeadroom ? "headroom" : "reserved") + " GiB", side: "right", font: { color: t.muted, size: 11 } }, tickfont: { color: t.muted }, thickness: 12, outlinewidth: 0 },
      hovertemplate: (uniqueRanks ? "rank %{y}" : "row %{y}") + "<br>" + (state.x === "time" ? "%{x|%H:%M:%S}" : "step %{x:,d}") + "<br>" +
        (isHeadroom ? "min headroom" : "max reserved") + " %{z:.2f} GiB<extra></extra>",
    };
    var tall = Math.min(720, Math.max(300, 90 + h.rows.length * 14));
    if (gd.style.height !== tall + "px") gd.style.height = tall + "px";
    var layout = baseLayout(t, {
      uirevision: "heat|" + state.run + "|" + state.x + "|" + h.field,
      hovermode: "closest", showlegend: false,
      xaxis: xAxis(t),
      yaxis: { autorange: "reversed", tickfont: { color: t.muted }, title: { text: "rank", font: { color: t.muted, size: 11 }, standoff: 2 },
        tickformat: "d", gridcolor: "rgba(0,0,0,0)", zeroline: false, nticks: Math.min(h.rows.length, 20),
        // few rows: label every one; many: let plotly thin the labels
        tickvals: h.rows.length <= 40 ? ys : undefined },
      margin: { l: 52, r: 8, t: 8, b: 40 },
    });
    if (state.selected && uniqueRanks) {
      var sy = state.selected.rank;
      layout.shapes = [{ type: "rect", xref: "paper", x0: 0, x1: 1, yref: "y", y0: sy - 0.5, y1: sy + 0.5, line: { color: t.text, width: 1.5 }, name: "selected rank" }];
    }
    Plotly.react(gd, [trace], layout, PLOT_CONFIG);
    wireHeatmap(gd);
    markOnce("vramwatch:heatmap");
    var note = $("heatmap-note");
    note.textContent = isHeadroom
      ? "Worst headroom per bucket of " + intText(h.bucket) + (state.x === "time" ? " s" : " steps") + " (capacity − max(reserved, NVML used)); red rows are the ranks to look at."
      : "Highest reserved per bucket of " + intText(h.bucket) + (state.x === "time" ? " s" : " steps") + ".";
  }

  // ------------------------------------------------------------------ overlay of several ranks
  function refreshOverlay() {
    var gd = $("chart-overlay");
    if (!gd || !state.ranks) return Promise.resolve();
    var gen = state.gen, field = state.overlayField;
    var keys = compareSet();
    var ranks = state.ranks.filter(function (r) { return keys.has(rankKey(r.host, r.rank)); }).slice(0, MAX_COMPARE);
    ranks.sort(function (a, b) { return a.rank - b.rank; });
    var fields = field === "headroom" ? ["ts", "reserved_bytes", "nvml_used_bytes", "total_bytes"] : ["ts", field];
    return Promise.all([Promise.all(ranks.map(function (r) {
      return source.series(state.run, r, fields, { points: 1200 }).catch(function () { return null; });
    })), plotlyReady]).then(function (res) {
      var all = res[0];
      if (gen !== state.gen || field !== state.overlayField) return;
      var t = chartTheme();
      var palette = ["#3b78c4", "#e8853d", "#2e9e5b", "#d64545", "#9b59b6", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#1f3a93", "#f4a261"];
      var traces = [];
      all.forEach(function (s, i) {
        if (!s || !s.x.length) return;
        var r = ranks[i];
        var y;
        if (field === "headroom") {
          y = s.x.map(function (_, j) {
            var u = s.series.nvml_used_bytes[j], rs = s.series.reserved_bytes[j], tot = s.series.total_bytes[j];
            return isNum(tot) ? (tot - Math.max(rs || 0, isNum(u) ? u : 0)) / GIB : null;
          });
        } else y = toGiB(s.series[field]);
        var sel = state.selected && r.rank === state.selected.rank && r.host === state.selected.host;
        traces.push({ name: plotlyText(rankLabel(r)) + " (" + stateOf(r) + ")", x: state.x === "time" ? s.series.ts.map(function (v) { return v * 1000; }) : s.x,
          y: y, mode: "lines", line: { color: palette[i % palette.length], width: sel ? 2.4 : 1.4 }, hovertemplate: "%{y:.2f} GiB" });
      });
      var layout = baseLayout(t, {
        uirevision: "overlay|" + state.run + "|" + state.x + "|" + field,
        xaxis: xAxis(t), yaxis: yAxis(t, { rangemode: "normal" }),
        legend: { orientation: "v", x: 1.01, y: 1, xanchor: "left", bgcolor: "rgba(0,0,0,0)" },
        margin: { l: 72, r: 10, t: 10, b: 40 },
      });
      Plotly.react(gd, traces, layout, PLOT_CONFIG);
      $("overlay-hint").textContent = state.compare ? ranks.length + " ranks ticked in the verdict table"
        : "the selected rank, the worst rank, rank 0 and the median rank — tick others in the verdict table";
    });
  }

  // ------------------------------------------------------------------ readiness marker (tests, benchmark)
  // "interactive": verdicts, cards and the rank chart are drawn and respond to input.
  function markInteractive() {
    if (document.documentElement.dataset.ready === "1") return;
    document.documentElement.dataset.ready = "1";
    markOnce("vramwatch:interactive");
  }
  function markOnce(name) {
    if (marked[name]) return;
    marked[name] = true;
    try { performance.mark(name); } catch (e) { /* old browsers */ }
  }

  // ------------------------------------------------------------------ theme toggle
  function applyTheme(theme) {
    document.documentElement.dataset.theme = theme;
    try { localStorage.setItem("vramwatch-theme", theme); } catch (e) { /* private mode */ }
  }
  function initTheme() {
    var saved = null;
    try { saved = localStorage.getItem("vramwatch-theme"); } catch (e) { /* private mode */ }
    var prefersDark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
    document.documentElement.dataset.theme = saved || (prefersDark ? "dark" : "light");
    $("theme-toggle").addEventListener("click", function () {
      applyTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark");
      if (state && state.page === "run" && state.mainData) { drawMain(); drawFrag(); refreshHeatmap(); refreshOverlay(); }
    });
  }

  // ------------------------------------------------------------------ boot
  function route() {
    var r = parseRoute();
    if (state && state.page === r.page && state.run === r.run && state.page === "run") {
      // same run: only the rank or axis changed (e.g. back button)
      if (r.x !== state.x) { state.x = r.x; state.zoom = null; syncButtons(); }
      if (r.rank !== null && state.ranks) {
        var found = state.ranks.find(function (x) { return x.rank === r.rank && (r.host === null || x.host === r.host); });
        if (found) selectRank(found);
      }
      refreshCharts(true);
      return;
    }
    resetState(r);
    setBanner(null);
    document.documentElement.dataset.ready = "0";
    if (r.page === "run") renderRunPage(); else renderRunsPage();
  }

  function boot() {
    initTheme();
    plotlyReady.catch(function (err) {
      setBanner("Charts unavailable: " + err.message + ". Reinstall the server extra: pip install 'vramwatch[server]'.");
    });
    window.addEventListener("hashchange", route);
    route();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", boot);
  else boot();
})();
