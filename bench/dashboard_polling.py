"""What one open dashboard tab costs while it polls a live 512-rank run, and cold loads.

A real ``vramwatch serve`` subprocess holds a 512-rank run (one rank leaking) and a feeder
posts one more step of every rank each second while headless Chromium keeps the run page
open. Measured over the window:

* **long tasks** in the page (``PerformanceObserver`` ``longtask``: main-thread tasks over
  50 ms): count and the longest. Limit: none over 50 ms.
* **bytes per minute per tab**: ``transferSize`` of every API response in the window (the
  wire bytes, after gzip), scaled to a minute. Limit: what the previous front-end's
  polling pattern costs on the same data, measured in the same run by fetching the same
  documents (``/ranks`` in full every 2 s, the rank's 2,000-point ``/chart`` and its
  phases and events every second, the heatmap every 5 s, four compare series every 3 s).
* **collector CPU per tab**: user + system CPU seconds of the collector process during the
  window (feeder ingest included, measured separately without a tab and subtracted).
* **cold load**: fresh browser profile, navigation start to the page's ``interactive`` and
  ``heatmap`` marks, at 8 and 512 ranks; and plotly.js alone on a blank page, the partial
  bundle the dashboard serves against the full one of the plotly package.

    python -m bench.dashboard_polling [--ranks 512] [--steps 300] [--seconds 30] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from bench.ingest_bench import start_collector
from bench.report import table, write_section
from vramwatch.collector.serving.app import dashboard_plotly_js_path, plotly_js_path
from vramwatch.collector.store import Store
from vramwatch.probe.simulated import simulate_trace

RUN = "poll-512"
SMALL_RUN = "poll-8"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]
LONG_TASK_LIMIT_MS = 50.0
OLD_FIELDS = ("ts,allocated_bytes,reserved_bytes,peak_allocated_bytes,nvml_used_bytes,total_bytes,"
              "inactive_split_bytes,alloc_retries")


def traces(run: str, ranks: int, start_ts: float) -> list[Iterator[dict[str, Any]]]:
    return [simulate_trace("demo", steps=10**7, run=run, host=f"node-{r // 8:03d}", rank=r, start_ts=start_ts,
                           step_time_s=1.0, seed=r, ckpt_every=200, leak_rank=7, leak_onset=100)
            for r in range(ranks)]


def take(gen: Iterator[dict[str, Any]], until_step: int) -> list[dict[str, Any]]:
    out = []
    for s in gen:
        out.append(s)
        if s["step"] >= until_step and s["phase"] == "train":
            break
    return out


def fill(db: str, run: str, ranks: int, steps: int) -> list[Iterator[dict[str, Any]]]:
    """``steps`` steps of every rank written through the store; the generators go on live."""
    gens = traces(run, ranks, time.time() - steps * 1.0 - steps / 200 * 10 - 5)
    store = Store(db)
    store.insert_stream((s for gen in gens for s in take(gen, steps)), 50_000)
    store.close()
    return gens


class Feeder(threading.Thread):
    """One more step of every rank each second, over HTTP like the hooks."""

    def __init__(self, url: str, gens: list[Iterator[dict[str, Any]]], step: int) -> None:
        super().__init__(daemon=True)
        self.url, self.gens, self.step = url, gens, step
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.wait(1.0):
                self.step += 1
                body = b"".join(orjson.dumps({**s, "ts": min(s["ts"], time.time())}) + b"\n"
                                for g in self.gens for s in take(g, self.step))
                client.post(self.url + "/api/v1/samples", content=body,
                            headers={"content-type": "application/x-ndjson"}).raise_for_status()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def old_pattern_bytes(url: str, run: str, seconds: float) -> float:
    """Wire bytes the previous front-end's polling would move in ``seconds`` (gzip as the browser asks)."""
    headers = {"Accept-Encoding": "gzip"}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as c:
        def size(path: str, **params: Any) -> int:
            with c.stream("GET", path, params=params) as r:
                return sum(len(chunk) for chunk in r.iter_raw())
        ranks = size(f"/api/v1/runs/{run}/ranks")
        chart = size(f"/api/v1/runs/{run}/chart", rank=7, fields=OLD_FIELDS, points=2000)
        side = size(f"/api/v1/runs/{run}/phases", rank=7) + size(f"/api/v1/runs/{run}/events", rank=7)
        heat = size(f"/api/v1/runs/{run}/heatmap", field="headroom")
        overlay = sum(size(f"/api/v1/runs/{run}/chart", rank=r, fields="ts,reserved_bytes", points=1200)
                      for r in (0, 7, 256, 511))
    return seconds * (ranks / 2 + chart + side + heat / 5 + overlay / 3)


OBSERVER = """
window.__long = [];
window.__vwTiming = true;
new PerformanceObserver(l => { for (const e of l.getEntries()) window.__long.push([e.startTime, e.duration]); })
  .observe({type: 'longtask', buffered: true});
performance.setResourceTimingBufferSize(100000);
"""


#: where the tab looks while it is measured: the top of the run page (cards, rank chart,
#: verdict table; what the page shows when opened), then scrolled to the panels below the
#: fold, which refresh only while on screen (heatmap, fragmentation; memory, compare chart)
VIEWS = (("top", None), ("heatmap & fragmentation", "chart-heatmap"), ("memory & compare", "chart-overlay"))


def poll_windows(url: str, run: str, seconds: float, others: float) -> dict[str, dict[str, Any]]:
    """One tab, measured over ``seconds`` at the top of the page, then ``others`` seconds at each other view."""
    from playwright.sync_api import sync_playwright

    out: dict[str, dict[str, Any]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 900})
            context.add_init_script(OBSERVER)
            page = context.new_page()
            page.goto(f"{url}/#/run/{run}")
            page.wait_for_function("performance.getEntriesByName('vramwatch:heatmap').length > 0", timeout=120_000)
            page.wait_for_timeout(3000)  # settle: the first full answers are in
            for name, anchor in VIEWS:
                if anchor:
                    page.evaluate("id => document.getElementById(id).scrollIntoView({block: 'start'})", anchor)
                    page.wait_for_timeout(2000)  # the panels that came into view catch up
                before = os.getloadavg()[0]
                out[name] = measure_view(page, seconds if anchor is None else others)
                out[name]["load"] = (before, os.getloadavg()[0])
        finally:
            browser.close()
    return out


def measure_view(page: Any, seconds: float) -> dict[str, Any]:
    t0 = page.evaluate("performance.now()")
    page.wait_for_timeout(seconds * 1000)
    return page.evaluate("""t0 => {
                const api = performance.getEntriesByType('resource')
                  .filter(e => e.startTime >= t0 && e.name.includes('/api/'));
                const longAt = window.__long.filter(([s]) => s >= t0);
                const long = longAt.map(([, d]) => d);
                // what ran inside each long task: the timed pieces that overlap it
                const inside = longAt.map(([s, d]) => Math.round(d) + ' ms: ' + (performance.getEntriesByType('measure')
                  .filter(m => m.startTime < s + d && m.startTime + m.duration > s)
                  .map(m => m.name.replace('vramwatch:', '') + ' ' + Math.round(m.duration))
                  .join(', ') || 'no timed piece'));
                const parts = {};
                for (const m of performance.getEntriesByType('measure')) {
                  if (m.startTime < t0) continue;
                  const k = m.name.replace('vramwatch:', '');
                  parts[k] = Math.max(parts[k] || 0, m.duration);
                }
                const by = {};
                for (const e of api) {
                  const k = new URL(e.name).pathname.split('/').pop();
                  by[k] = (by[k] || 0) + e.transferSize;
                }
                const draws = {};
                for (const gd of document.querySelectorAll('.js-plotly-plot')) {
                  if (gd.__vwDraws) draws[gd.id] = gd.__vwDraws;
                }
                return {parts, by, bytes: api.reduce((a, e) => a + e.transferSize, 0), requests: api.length,
                        long_tasks: long.length, longest: long.length ? Math.max(...long) : 0,
                        long: long.map(Math.round), inside, window_ms: performance.now() - t0, draws};
            }""", t0)


def cold_loads(url: str, runs: list[str], loads: int) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    out: dict[str, float] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            for run in runs:
                marks = []
                for _ in range(loads):
                    context = browser.new_context(viewport={"width": 1440, "height": 900})  # cold caches
                    page = context.new_page()
                    page.goto(f"{url}/#/run/{run}")
                    page.wait_for_function("performance.getEntriesByName('vramwatch:heatmap').length > 0"
                                           " && performance.getEntriesByName('vramwatch:interactive').length > 0",
                                           timeout=120_000)
                    marks.append(page.evaluate("Object.fromEntries(performance.getEntriesByType('mark')"
                                               ".map(m => [m.name.replace('vramwatch:', ''), m.startTime]))"))
                    context.close()
                out[f"{run} interactive"] = statistics.median(m["interactive"] for m in marks)
                out[f"{run} heatmap"] = statistics.median(m["heatmap"] for m in marks)
            for name, path in (("partial", dashboard_plotly_js_path()), ("full", plotly_js_path())):
                times = []
                for _ in range(loads):
                    context = browser.new_context()
                    page = context.new_page()
                    body = path.read_bytes()

                    def serve(route: Any, _request: Any, body: bytes = body) -> None:
                        route.fulfill(body=body, content_type="application/javascript")

                    page.route("**/plotly-under-test.js", serve)
                    page.goto(f"{url}/healthz")
                    page.set_content("<script>window.t0 = performance.now()</script>"
                                     f"<script src='{url}/plotly-under-test.js'></script>"
                                     "<script>window.t1 = performance.now()</script>")
                    times.append(page.evaluate("window.t1 - window.t0"))
                    context.close()
                out[f"plotly {name}"] = statistics.median(times)
                out[f"plotly {name} bytes"] = path.stat().st_size
        finally:
            browser.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--others", type=float, default=20.0, help="seconds at each view below the fold")
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "poll.db")
        gens = fill(db, RUN, args.ranks, args.steps)
        fill(db, SMALL_RUN, 8, args.steps)
        proc, url = start_collector(db)
        feeder = Feeder(url, gens, args.steps)
        try:
            feeder.start()
            time.sleep(3)
            c0 = cpu_seconds(proc.pid)
            time.sleep(args.seconds)
            idle_cpu = cpu_seconds(proc.pid) - c0  # ingest of the feeder alone
            c0 = cpu_seconds(proc.pid)
            w0 = time.monotonic()
            load0 = os.getloadavg()[0]
            views = poll_windows(url, RUN, args.seconds, args.others)
            load1 = os.getloadavg()[0]
            print("views:", views, flush=True)
            tab_cpu = cpu_seconds(proc.pid) - c0
            wall = time.monotonic() - w0
            old = old_pattern_bytes(url, RUN, 60.0)
            feeder.stop.set()
            feeder.join(10)
            loads = cold_loads(url, [SMALL_RUN, RUN], args.loads)
        finally:
            feeder.stop.set()
            proc.terminate()
            proc.wait(30)

    tab = views["top"]
    per_min = tab["bytes"] * 60000 / tab["window_ms"]
    cpu_share = max(0.0, tab_cpu - idle_cpu * wall / args.seconds) / wall
    load = os.getloadavg()

    def pieces(view: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(view["parts"].items(), key=lambda kv: -kv[1]))

    rows = []
    for name, view in views.items():
        rows += [
            (f"long tasks, {name} ({view['window_ms'] / 1000:.0f} s, load {view['load'][0]:.1f} → "
             f"{view['load'][1]:.1f}): count, longest",
             f"{view['long_tasks']}, {view['longest']:.0f} ms", f"{LONG_TASK_LIMIT_MS:.0f} ms",
             f"{view['longest'] / LONG_TASK_LIMIT_MS:.2f}"),
            ("  longest piece per component: " + pieces(view), "", "", ""),
        ]
        rows += [("  inside a long task of " + what, "", "", "") for what in view["inside"]]
    worst = max((v, k, name) for name, view in views.items() for k, v in view["parts"].items())
    rows.append((f"longest timed piece of any view: {worst[1]} ({worst[2]})", f"{worst[0]:.0f} ms",
                 f"{LONG_TASK_LIMIT_MS:.0f} ms", f"{worst[0] / LONG_TASK_LIMIT_MS:.2f}"))
    last = views[VIEWS[-1][0]]["draws"]
    draws = ", ".join(f"{k.replace('chart-', '')} {v['fast']} / {v['full']}" for k, v in last.items())
    rows += [
        ("  chart redraws since load, cheap (data only) / full: " + draws, "", "", ""),
        ("API bytes per minute per tab (wire, gzip)", f"{per_min / 1e6:.2f} MB",
         f"{old / 1e6:.2f} MB (previous polling)", f"{per_min / old:.2f}"),
        ("API requests per minute per tab", f"{tab['requests'] * 60000 / tab['window_ms']:.0f}", "", ""),
        ("  of the bytes: " + ", ".join(f"`{k}` {v * 60000 / tab['window_ms'] / 1e6:.2f} MB/min"
                                       for k, v in sorted(tab["by"].items(), key=lambda kv: -kv[1])), "", "", ""),
        ("collector CPU per open tab", f"{cpu_share * 100:.1f} % of a core", "", ""),
    ]
    def marks(run: str) -> str:
        return f"{loads[run + ' interactive']:.0f} / {loads[run + ' heatmap']:.0f} ms"

    cold = [
        (f"{SMALL_RUN} (8 ranks): interactive / heatmap", marks(SMALL_RUN)),
        (f"{RUN} ({args.ranks} ranks): interactive / heatmap", marks(RUN)),
        ("plotly.js partial (cartesian) bundle alone, blank page",
         f"{loads['plotly partial']:.0f} ms ({loads['plotly partial bytes'] / 1e6:.1f} MB)"),
        ("plotly.js full bundle alone, blank page",
         f"{loads['plotly full']:.0f} ms ({loads['plotly full bytes'] / 1e6:.1f} MB)"),
    ]
    body = (
        f"Machine load average (1 min) when the tab's windows began / ended: {load0:.1f} / {load1:.1f}; at the end "
        f"of the run {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min), on {os.cpu_count()} cores shared "
        f"with other work; absolute times (long tasks too) scale with it.\n\n"
        f"{args.ranks} ranks x {args.steps} steps (demo model, rank 7 leaking, checkpoints every 200 steps) in "
        f"SQLite, served by a `vramwatch serve` subprocess; a feeder posts one more step of every rank each second. "
        f"One headless Chromium tab (1440x900) keeps the run page open: {args.seconds:.0f} s at the top of the page "
        f"after it settled (bytes and requests are of this window), then {args.others:.0f} s scrolled to each group "
        f"of panels below the fold. Long tasks: `PerformanceObserver('longtask')`; pieces: `window.__vwTiming`.\n\n"
        + table(["while polling", "measured", "limit", "ratio"], rows)
        + "\n\nThe page polls `/ranks` every second (past 256 ranks: the full list every third second, or, when"
        " the collector offers deltas, the compact rows of the changed ranks every other second and the full rows"
        " every 30 polls); the rank chart asks only for"
        " the steps after its last point (`/chart?start=`) and re-reads the full range every 30 s; phases and"
        " events every 3 s; the heatmap every 15 s and the compare chart every 10 s past 256 ranks, and only"
        " while on screen (panels below the fold catch up when scrolled to). A chart with no new points is not"
        " redrawn. A redraw that only moves data (the figure's signature without its x/y arrays and x range is"
        " unchanged; the rank chart's axis end stays put while new points fit) goes through plotly's transition"
        " path with zero duration: plotly recomputes and re-plots the traces only, a moved axis in a later frame,"
        " and leaves legend, shapes and annotations as drawn (the chart's time-to-OOM label has two significant"
        " digits, so it changes every ~100 steps, not every poll). The"
        " heatmap's colour grid (in tasks of 60 columns / 128 rows) and its drawing are separate tasks, and so"
        " are the memory panel's two charts; every full plotly redraw is two tasks, its data preparation"
        " (defaults, calc) and its drawing (`<chart> drawing`). The heatmap's drawing is the longest task"
        " left: plotly colours every cell through its d3 colour scale (~80 ns a cell, ~10 ms at 150 buckets"
        " x 512 ranks in a CPU profile) and PNG-encodes the image (~3 ms), then axes ~5 ms, colour bar"
        " ~3 ms; past 256 ranks the page asks for 100 buckets (a row is about a pixel tall there)."
        " The verdict table keeps only the rows in view in the DOM and rewrites only the cells that"
        " changed. Pieces are timed with `performance.measure` (`window.__vwTiming`).\n\n"
        f"**Cold load** (fresh browser profile each time, median of {args.loads}; ms from navigation start):\n\n"
        + table(["page", "time"], cold)
    )
    print(body)
    if not args.no_write:
        write_section("Dashboard polling (512 ranks)", body, "python -m bench.dashboard_polling")


if __name__ == "__main__":
    main()
