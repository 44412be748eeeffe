"""The dashboard, end to end in a real browser: uvicorn + SQLite collector fed with the
simulated demo run (8 H200 ranks, rank 5 leaking, checkpoints every 500 steps), headless
Chromium driven by Playwright. Screenshots land in test-artifacts/ for a human to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace
from vramwatch.units import duration, rate

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
DEMO_RUN = "demo-8xH200"
LEAKING_RANK = 5  # the demo scenario's leak_rank
DEMO_STEPS = 2200
# A hostile run and host name: if any of this is parsed as HTML, window.__xss gets set.
# (no "/" in the run name: the collector's routes take the run as one path segment)
XSS_RUN = "<img src=x onerror=\"window.__xss='run'\">\"'&<script>window.__xss='script'<!--/../runs/x"
RESERVED = "document.getElementById('chart-rank').data.find(t => t.name === 'reserved')"
XSS_HOST = "<svg onload=\"window.__xss='host'\"><b>h</b>"


# ---------------------------------------------------------------- data

class DemoFeed:
    """The demo scenario, one generator per rank, posted over HTTP like the hook does."""

    def __init__(self, url: str, run: str, ranks: int = 8, scenario: str = "demo", host_of=None) -> None:
        self.url = url
        self.run = run
        steps_guess = 10**6
        self.start_ts = time.time() - (DEMO_STEPS * 0.1 + DEMO_STEPS / 500 + 5)
        self.gens = [
            simulate_trace(scenario, steps=steps_guess, run=run, host=(host_of or (lambda r: f"node-{r // 4}"))(r),
                           rank=r, start_ts=self.start_ts, step_time_s=0.1)
            for r in range(ranks)
        ]
        self.last_step = 0

    def advance(self, steps: int) -> int:
        """Post the next ``steps`` steps of every rank (train and phase samples)."""
        target = self.last_step + steps
        body: list[dict[str, Any]] = []
        for gen in self.gens:
            for sample in gen:
                body.append(sample)
                if sample["step"] >= target and sample["phase"] == "train":
                    break
        for i in range(0, len(body), 5000):
            chunk = body[i:i + 5000]
            resp = httpx.post(self.url + "/api/v1/samples", content=b"".join(orjson.dumps(s) + b"\n" for s in chunk),
                              timeout=60, headers={"content-type": "application/x-ndjson"})
            assert resp.status_code == 200, resp.text
        self.last_step = target
        return len(body)


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("dash") / "vw.db"
    with BackgroundServer(str(db)) as server:
        demo = DemoFeed(server.url, DEMO_RUN)
        demo.advance(DEMO_STEPS)
        xss = DemoFeed(server.url, XSS_RUN, ranks=2, scenario="healthy", host_of=lambda r: XSS_HOST if r else "node-0")
        xss.advance(300)
        yield {"url": server.url, "db": str(db), "demo": demo, "server": server}


# ---------------------------------------------------------------- browser

def _chromium_available() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: pip install playwright"
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        return "Chromium is missing: apt-get install chromium"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    problem = _chromium_available()
    if problem:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but the browser tests cannot run: {problem}")
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A fresh page that records console errors, page errors and dialogs."""

    def __init__(self, browser: Any, scheme: str = "light") -> None:
        self.context = browser.new_context(viewport={"width": 1440, "height": 900}, color_scheme=scheme)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))

        def on_dialog(dialog: Any) -> None:
            self.dialogs.append(dialog.message)
            dialog.dismiss()

        self.page.on("dialog", on_dialog)

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(f"console.error: {message.text}")

    def ready(self, timeout: float = 20_000) -> None:
        self.page.wait_for_function("document.documentElement.dataset.ready === '1'", timeout=timeout)

    def polled(self, polls: int = 1, timeout: float = 20_000) -> None:
        """Wait until ``polls`` more of the page's polls have finished drawing everything they asked
        for (the page counts them in ``data-polls``): a settled state, not a delay."""
        now = int(self.page.evaluate("document.documentElement.dataset.polls || '0'"))
        self.page.wait_for_function(f"+(document.documentElement.dataset.polls || 0) >= {now + polls}",
                                    timeout=timeout)

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def run_url(base: str, run: str, **params: Any) -> str:
    from urllib.parse import quote, urlencode

    query = ("?" + urlencode(params)) if params else ""
    return f"{base}/#/run/{quote(run, safe='')}{query}"


def chart_traces(page: Any, chart: str) -> list[dict[str, Any]]:
    return page.evaluate(
        """id => (document.getElementById(id).data || []).map(t => ({name: t.name, n: (t.x || []).length,
            x: Array.from(t.x || []), y: Array.from(t.y || []), type: t.type || 'scatter'}))""",
        chart,
    )


def strip_rows(page: Any) -> list[dict[str, Any]]:
    return page.eval_on_selector_all(
        "#verdict-strip tbody tr",
        "rows => rows.map(r => ({rank: Number(r.dataset.rank), host: r.dataset.host, state: r.dataset.state,"
        " badge: r.querySelector('td.state .badge').textContent, cells: Array.from(r.cells).map(c => c.textContent)}))",
    )


# ---------------------------------------------------------------- tests

def test_run_page_tells_the_story(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    ranks = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/ranks").json()
    leaking = [r["rank"] for r in ranks if r["verdict"]["state"] == "leak"]
    assert leaking == [LEAKING_RANK], "the engine should call exactly the demo's bad rank leaking"

    p = page.page
    p.goto(run_url(url, DEMO_RUN))
    page.ready()
    p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 8")

    rows = strip_rows(p)
    assert rows[0]["rank"] == LEAKING_RANK, "worst rank first"
    assert rows[0]["state"] == "leak" and rows[0]["badge"] == "leak"
    assert all(r["state"] != "leak" for r in rows[1:])
    verdict = next(r["verdict"] for r in ranks if r["rank"] == LEAKING_RANK)
    # slope and OOM ETA are shown for the leaking rank, in human units
    # the one units rule (vramwatch/units.py, mirrored by format.js): the CLI's text reads the same
    assert "+" + rate(verdict["slope_bytes_per_step"]) in rows[0]["cells"]
    assert f"{verdict['steps_to_oom']:,} steps" in " ".join(rows[0]["cells"])
    # the forecast's 80 % range on hover, the engine's numbers in the one units rule
    assert verdict["seconds_to_oom_low"] <= verdict["seconds_to_oom"] <= verdict["seconds_to_oom_high"]
    assert p.get_attribute("#verdict-strip tbody tr:first-child td:nth-child(10)", "title") == (
        f"80 % range: {duration(verdict['seconds_to_oom_low'])} to {duration(verdict['seconds_to_oom_high'])}")
    oom_card = p.text_content("#cards .card:nth-child(3) .value")
    assert oom_card not in ("no leak", "—")

    # the default chart is the worst rank, with every trace the issue asks for
    p.wait_for_function("(document.getElementById('chart-rank').data || []).length > 5")
    traces = chart_traces(p, "chart-rank")
    names = [t["name"] for t in traces]
    for expected in ("reserved", "allocated", "per-step peak", "NVML used", "outside torch (NVML \u2212 reserved)",
                     "checkpoint peak"):
        assert expected in names, (expected, names)
    assert any(n.startswith("device total") for n in names)
    assert any(n.startswith("plateau ") for n in names)
    assert any(n.startswith("leak → OOM") for n in names)
    # plotted numbers are the API's numbers in GiB; the raw maximum survives downsampling
    series = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/series", params={
        "rank": LEAKING_RANK, "fields": "reserved_bytes", "points": 20000}).json()
    reserved = next(t for t in traces if t["name"] == "reserved")
    assert max(reserved["y"]) == pytest.approx(max(series["series"]["reserved_bytes"]) / 2**30)
    # the projection ends on the capacity line
    proj = next(t for t in traces if t["name"].startswith("leak → OOM"))
    total = next(t for t in traces if t["name"].startswith("device total"))
    assert proj["y"][-1] == pytest.approx(total["y"][0], rel=1e-6)

    # checkpoint bands: one shaded shape per checkpoint, and in the DOM (waited for: drawn with the phases)
    phases = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/phases", params={"rank": LEAKING_RANK}).json()
    checkpoints = len([ph for ph in phases if ph["phase"] == "checkpoint"])
    assert checkpoints >= 4
    p.wait_for_function(f"""(() => {{ const gd = document.getElementById('chart-rank');
        const n = ((gd.layout || {{}}).shapes || []).filter(s => (s.name || '').startsWith('checkpoint band')).length;
        return n === {checkpoints} && gd.querySelectorAll('.shapelayer path').length >= n; }})()""")
    shapes = p.evaluate("document.getElementById('chart-rank').layout.shapes.map(s => s.name || '')")
    bands = [s for s in shapes if s.startswith("checkpoint band")]
    assert len(bands) == checkpoints
    assert p.locator("#chart-rank .shapelayer path").count() >= len(bands)
    assert any(s.startswith("event leak") for s in shapes), "the leak event is annotated"

    # heatmap: one row per rank, worst (lowest) headroom on the leaking rank
    p.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1")
    heat = p.evaluate("(() => { const t = document.getElementById('chart-heatmap').data[0];"
                      " return {y: Array.from(t.y), z: t.z.map(r => Array.from(r))}; })()")
    assert heat["y"] == list(range(8))
    lowest = [min(v for v in row if v is not None) for row in heat["z"]]
    assert lowest.index(min(lowest)) == LEAKING_RANK

    page.shot("dashboard-run.png")
    assert page.errors == []


def test_live_update_keeps_zoom_and_fetches_detail(collector: dict[str, Any], page: Page) -> None:
    url, demo = collector["url"], collector["demo"]
    p = page.page
    p.goto(run_url(url, DEMO_RUN, rank=0))
    page.ready()
    p.wait_for_function("(document.getElementById('rank-title')?.textContent ?? '').startsWith('Rank 0')")
    # tag the DOM: a full redraw would lose these
    p.evaluate("document.getElementById('verdict-strip').__probe = 1;"
               " document.getElementById('chart-rank').querySelector('.main-svg').__probe = 1")

    # zoom like a user: plotly emits plotly_relayout, the page re-fetches that range in detail
    p.evaluate("Plotly.relayout('chart-rank', {'xaxis.range': [1000, 1100]})")
    p.wait_for_function(f"""(() => {{ const t = {RESERVED};
        return t && t.x.length > 0 && t.x[0] >= 900 && t.x[t.x.length - 1] <= 1200; }})()""", timeout=5000)
    zoomed = next(t for t in chart_traces(p, "chart-rank") if t["name"] == "reserved")
    assert zoomed["x"] == sorted(zoomed["x"])
    assert set(range(1000, 1101)) <= set(zoomed["x"]), "zoomed view has every raw step"
    # the fragmentation chart follows the zoom
    assert p.evaluate("document.getElementById('chart-frag').layout.xaxis.range") == [1000, 1100]

    before = p.evaluate(f"{RESERVED}.x.length")
    demo.advance(40)
    posted = time.monotonic()
    new_last = demo.last_step
    p.wait_for_function(
        f"document.querySelector('#cards .card:nth-child(5) .sub')?.textContent === 'step {new_last:,}'", timeout=4000)
    elapsed = time.monotonic() - posted
    assert elapsed < 2.0, f"new samples took {elapsed:.2f} s to appear"
    rows = strip_rows(p)
    assert all(r["cells"][-1] == f"{new_last:,}" for r in rows if r["rank"] != LEAKING_RANK or new_last < 4000)
    # zoom survived the update (uirevision), and nothing was rebuilt from scratch
    assert p.evaluate("document.getElementById('chart-rank').layout.xaxis.range") == [1000, 1100]
    assert p.evaluate("document.getElementById('verdict-strip').__probe") == 1
    assert p.evaluate("document.getElementById('chart-rank').querySelector('.main-svg').__probe") == 1
    assert p.evaluate(f"{RESERVED}.x.length") == before

    # reset zoom (double-click does this): the full range comes back, downsampled
    p.evaluate("Plotly.relayout('chart-rank', {'xaxis.autorange': true})")
    p.wait_for_function(f"(() => {{ const t = {RESERVED}; return t && t.x[t.x.length - 1] === {new_last}; }})()",
                        timeout=5000)
    full = next(t for t in chart_traces(p, "chart-rank") if t["name"] == "reserved")
    assert full["x"][0] < 10
    assert page.errors == []


def test_heatmap_row_click_opens_that_rank_and_sorting(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(collector["url"], DEMO_RUN))
    page.ready()
    p.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1")
    # a real mouse click on the row of rank 2, at the pixel plotly drew it
    xy = p.evaluate("""(() => { const gd = document.getElementById('chart-heatmap'); const fl = gd._fullLayout;
        const box = gd.getBoundingClientRect();
        return [box.left + fl._size.l + fl._size.w / 2, box.top + fl._size.t + fl.yaxis.d2p(2)]; })()""")
    p.evaluate("window.scrollTo(0, 0)")
    p.locator("#chart-heatmap").scroll_into_view_if_needed()
    xy = p.evaluate("""(() => { const gd = document.getElementById('chart-heatmap'); const fl = gd._fullLayout;
        const box = gd.getBoundingClientRect();
        return [box.left + fl._size.l + fl._size.w / 2, box.top + fl._size.t + fl.yaxis.d2p(2)]; })()""")
    p.mouse.click(xy[0], xy[1])
    p.wait_for_function("(document.getElementById('rank-title')?.textContent ?? '').startsWith('Rank 2 ')",
                        timeout=5000)
    assert "rank=2" in p.evaluate("location.hash")
    assert p.get_attribute("#verdict-strip tbody tr.selected", "data-rank") == "2"

    # sortable strip: by rank ascending, then descending; state again puts the leak first
    p.click("#verdict-strip th[data-key='rank']")
    assert [r["rank"] for r in strip_rows(p)] == list(range(8))
    p.click("#verdict-strip th[data-key='rank']")
    assert [r["rank"] for r in strip_rows(p)] == list(range(7, -1, -1))
    p.click("#verdict-strip th[data-key='headroom']")
    headrooms = [float(r["cells"][5].split()[0]) for r in strip_rows(p)]
    assert headrooms == sorted(headrooms)

    # wall-time axis: the x values become timestamps (ms) and the axis a date axis
    p.click("button[data-x='time']")
    p.wait_for_function("document.getElementById('chart-rank').layout.xaxis.type === 'date'")
    p.wait_for_function(f"{RESERVED}.x[0] > 1e12")
    assert "x=time" in p.evaluate("location.hash")
    assert page.errors == []


def test_hostile_names_render_as_text(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(collector["url"] + "/")
    p.wait_for_selector("#runs-table tbody tr")
    names = p.eval_on_selector_all("#runs-table tbody td.name", "tds => tds.map(td => td.textContent)")
    assert XSS_RUN in names and DEMO_RUN in names
    demo_row = p.locator("#runs-table tbody tr", has_text=DEMO_RUN)
    assert demo_row.locator(".badge").text_content() == "leak"
    page.shot("dashboard-runs.png")

    # open the hostile run through its link: the route decodes the name exactly
    p.locator("#runs-table tbody tr", has=p.locator("td.name", has_text="onerror")).locator("a").click()
    page.ready()
    assert p.text_content("#crumbs .cur") == XSS_RUN
    assert p.title() == "vramwatch · " + XSS_RUN
    p.wait_for_function("(document.getElementById('chart-overlay').data || []).length >= 2")
    hosts = p.eval_on_selector_all("#verdict-strip tbody td.name", "tds => tds.map(td => td.textContent)")
    assert XSS_HOST in hosts
    # plotly legends show the host literally (entity-escaped, not parsed)
    legend = p.eval_on_selector_all("#chart-overlay .legendtext", "ts => ts.map(t => t.textContent)")
    assert any(XSS_HOST in t for t in legend), legend
    p.wait_for_load_state("networkidle")  # an injected image or script would have loaded (or failed) by now
    page.polled()
    assert p.evaluate("window.__xss") is None
    assert p.locator("img[src='x'], svg[onload], script:not([src])").count() == 0
    assert page.dialogs == []
    page.shot("dashboard-xss.png")
    assert page.errors == []


def test_empty_and_error_states(browser: Any, tmp_path: Path) -> None:
    page = Page(browser, scheme="dark")
    try:
        with BackgroundServer(str(tmp_path / "empty.db")) as server:
            p = page.page
            p.goto(server.url + "/")
            p.wait_for_selector(".state-msg h2")
            text = p.text_content("#view")
            assert "No runs yet" in text
            assert "no samples yet — start your training with vramwatch.init(url=...)" in text
            assert f'vramwatch.init(url="{server.url}"' in text, "the hint names this collector's URL"
            p.goto(run_url(server.url, "nope"))
            p.wait_for_function("document.querySelector('#view .state-msg h2') !== null")
            assert "not found" in p.text_content("#view .state-msg h2")
            page.shot("dashboard-empty.png")
            p.goto(server.url + "/")
            p.wait_for_selector(".state-msg h2")
        # the collector is gone: the page says so and keeps retrying
        p.wait_for_selector("#banner:not([hidden])", timeout=6000)
        assert "Cannot load data from the collector" in p.text_content("#banner")
        assert p.get_attribute("#live", "data-state") == "error"
        page.shot("dashboard-offline.png")
        # the browser itself logs the refused fetches; nothing else may go wrong
        assert [e for e in page.errors if "Failed to load resource" not in e] == []
    finally:
        page.close()


def test_dashboard_static_files_and_api_guards(collector: dict[str, Any]) -> None:
    url = collector["url"]
    index = httpx.get(url + "/")
    assert index.status_code == 200 and "text/html" in index.headers["content-type"]
    # no CDN: every script and stylesheet is served by the collector itself
    refs = re.findall(r'(?:src|href)="([^"]+)"', index.text)
    assert refs and not [r for r in refs if re.match(r"(https?:)?//", r)], refs
    for path in ("/static/app.js", "/static/style.css", "/vendor/plotly.min.js"):
        assert httpx.get(url + path).status_code == 200, path
    # the dashboard asks for ts alongside step to offer a wall-time axis
    params = {"rank": 0, "fields": "ts,reserved_bytes", "points": 50}
    s = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/series", params=params).json()
    assert len(s["series"]["ts"]) == len(s["x"]) and s["series"]["ts"] == sorted(s["series"]["ts"])
    bad = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/heatmap", params={"field": "bogus"})
    assert bad.status_code == 422 and "field" in bad.json()["detail"]
    assert httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/heatmap", params={"x": "wall"}).status_code == 422
    assert httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/heatmap", params={"cols": 3}).status_code == 422
    missing = httpx.get(f"{url}/api/v1/runs/nope/heatmap")
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


def test_thousand_ranks_stay_usable(browser: Any, tmp_path: Path) -> None:
    """1024 ranks: the heatmap has a row per rank and a click opens it; the verdict table
    draws a bounded number of rows and says how to reach the others."""
    ranks = 1024
    with BackgroundServer(str(tmp_path / "wide.db")) as server:
        body = [s for r in range(ranks)
                for s in simulate_trace("healthy", steps=12, run="wide", host=f"node-{r // 8:03d}", rank=r,
                                        start_ts=time.time() - 60, seed=r)]
        resp = httpx.post(server.url + "/api/v1/samples", content=b"".join(orjson.dumps(s) + b"\n" for s in body),
                          timeout=120, headers={"content-type": "application/x-ndjson"})
        assert resp.status_code == 200, resp.text
        page = Page(browser)
        try:
            p = page.page
            p.goto(run_url(server.url, "wide"))
            page.ready(timeout=60_000)
            p.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1", timeout=30_000)
            assert p.evaluate("document.getElementById('chart-heatmap').data[0].y.length") == ranks
            assert p.locator("#verdict-strip tbody tr").count() <= 257
            assert "1024 ranks" in p.text_content("#strip-foot")
            p.locator("#chart-heatmap").scroll_into_view_if_needed()
            xy = p.evaluate("""(() => { const gd = document.getElementById('chart-heatmap'); const fl = gd._fullLayout;
                const box = gd.getBoundingClientRect();
                return [box.left + fl._size.l + fl._size.w / 2, box.top + fl._size.t + fl.yaxis.d2p(700)]; })()""")
            p.mouse.click(xy[0], xy[1])
            p.wait_for_function("/^Rank (69[89]|70[0-2]) /"
                                ".test(document.getElementById('rank-title')?.textContent ?? '')",
                                timeout=10_000)
            # the chosen rank is in the table even though it is not among the first rows
            chosen = p.get_attribute("#verdict-strip tbody tr.selected", "data-rank")
            assert chosen is not None and abs(int(chosen) - 700) <= 2
            page.shot("dashboard-1024-ranks.png")
            assert page.errors == []
        finally:
            page.close()


FIGURE = """id => { const gd = document.getElementById(id);
    const xs = (t) => Array.from(t.x || []);
    return {traces: gd.data.map(t => ({name: t.name, x: xs(t), y: Array.from(t.y || [])})),
            shapes: JSON.stringify(gd.layout.shapes || []),
            labels: (gd.layout.annotations || []).map(a => [a.text, a.name === 'oom projection' ? null : a.x]),
            drawnLabels: Array.from(gd.querySelectorAll('.annotation-text')).map(a => a.textContent),
            drawnShapes: gd.querySelectorAll('.shapelayer path').length,
            draws: gd.__vwDraws,
            calcLengths: gd.calcdata.map(c => c.length),
            range: gd._fullLayout.xaxis.range.slice()}; }"""
COUNT_PLOTS = """(() => { const gd = document.getElementById('chart-rank'); gd.__plots = 0;
    gd.on('plotly_beforeplot', () => { gd.__plots++; }); return gd.__vwDraws.full; })()"""
# the last vertex of a trace's drawn line, back in data units
LAST_DRAWN_X = """name => { const gd = document.getElementById('chart-rank');
    const i = gd._fullData.findIndex(t => t.name === name);
    const path = gd.querySelectorAll('.scatterlayer .trace')[i].querySelector('path.js-line').getAttribute('d');
    const nums = path.match(/-?[0-9.]+/g).map(Number);
    return gd._fullLayout.xaxis.p2d(nums[nums.length - 2]); }"""


def test_polled_chart_equals_a_fresh_draw(browser: Any, tmp_path: Path) -> None:
    """The rank chart's cheap per-poll redraw (data only, plotly's transition path) leaves
    what a full draw of the same data leaves: the same x/y arrays, bands, event lines and
    labels; the new points are drawn; markers and labels are on the page."""
    run, steps = "fast-path", 785  # the leak is detected at step 769; a checkpoint comes at 800, while polled
    start = time.time() - steps * 0.1 - 5  # its latest sample within the run's 30 s silence window
    gens = [simulate_trace("demo", steps=10**6, run=run, host="node-0", rank=r, start_ts=start, step_time_s=0.1,
                           leak_rank=1, leak_onset=500, ckpt_every=400) for r in range(2)]
    last = 0

    def advance(n: int) -> None:
        nonlocal last
        last += n
        body = []
        for gen in gens:
            for s in gen:
                body.append(s)
                if s["step"] >= last and s["phase"] == "train":
                    break
        resp = httpx.post(server.url + "/api/v1/samples", content=b"".join(orjson.dumps(s) + b"\n" for s in body),
                          timeout=60, headers={"content-type": "application/x-ndjson"})
        assert resp.status_code == 200, resp.text

    reserved_last = ("(() => { const t = (document.getElementById('chart-rank').data || [])"
                     ".find(t => t.name === 'reserved'); return t ? t.x[t.x.length - 1] : null; })()")
    with BackgroundServer(str(tmp_path / "fast.db")) as server:
        advance(steps)
        polled, fresh = Page(browser), Page(browser)
        try:
            p = polled.page
            p.goto(run_url(server.url, run, rank=1))
            polled.ready()
            p.wait_for_function(f"{reserved_last} === {last}", timeout=10_000)
            end = p.evaluate("document.getElementById('chart-rank')._fullLayout.xaxis.range[1]")
            # plotly announces each run of its full pipeline (_doPlot) with plotly_beforeplot
            full0 = p.evaluate(COUNT_PLOTS)
            for _ in range(8):  # past the axis end (2 % of the steps): the axis moves on the cheap path too
                advance(4)
                p.wait_for_function(f"{reserved_last} === {last}", timeout=10_000)
            assert last > end
            # the last redraw has finished (its transition and live label), then nothing moves
            p.wait_for_function("!document.getElementById('chart-rank')._transitioning")
            polled.polled(2)  # two more polls drew nothing new
            p.wait_for_function("!document.getElementById('chart-rank')._transitioning")
            a = p.evaluate(FIGURE, "chart-rank")
            assert a["draws"]["fast"] >= 4, a["draws"]  # the polls took the cheap path
            # ... and plotly redrew in full only for the draws that asked for it (none behind a cheap one)
            assert p.evaluate("document.getElementById('chart-rank').__plots") == a["draws"]["full"] - full0
            assert abs(p.evaluate(LAST_DRAWN_X, "reserved") - last) < 0.5  # and drew the new points
            # the relayout that ends plotly's axis transition is not taken for a user's zoom
            assert "zoomed" not in p.text_content("#rank-hint")
            f = fresh.page
            f.goto(run_url(server.url, run, rank=1))
            fresh.ready()
            f.wait_for_function(f"{reserved_last} === {last}", timeout=10_000)
            fresh.polled()
            f.wait_for_function("!document.getElementById('chart-rank')._transitioning")
            b = f.evaluate(FIGURE, "chart-rank")
        finally:
            polled.close()
            fresh.close()
    assert [t["name"] for t in a["traces"]] == [t["name"] for t in b["traces"]]
    for ta, tb in zip(a["traces"], b["traces"], strict=True):
        assert ta["y"] == tb["y"], ta["name"]
        # lines drawn to the axis end (device total, plateau) end where each page's axis does
        if ta["name"].startswith(("device total", "plateau ")) and len(ta["x"]) == 2:
            assert ta["x"][0] == tb["x"][0] and ta["x"][1] <= a["range"][1] and tb["x"][1] <= b["range"][1]
        else:
            assert ta["x"] == tb["x"], ta["name"]
    assert len(next(t for t in a["traces"] if t["name"] == "reserved")["x"]) > steps  # raw steps, none downsampled
    assert a["calcLengths"] == b["calcLengths"]  # plotly computed the same points
    assert a["shapes"] == b["shapes"] and a["labels"] == b["labels"]
    assert last <= a["range"][1] <= last * 1.03 and last <= b["range"][1] <= last * 1.03
    # markers and labels are on the page: leak onset and detection, the OOM projection, checkpoints
    texts = " | ".join(a["drawnLabels"])
    assert "leak onset" in texts and "leak detected" in texts and "OOM in ~" in texts, texts
    assert sorted(a["drawnLabels"]) == sorted(b["drawnLabels"])
    assert a["drawnShapes"] == b["drawnShapes"] >= 3
    assert a["shapes"].count("checkpoint band") == 2  # the one of step 800 came while polling
    assert polled.errors == [] and fresh.errors == []
