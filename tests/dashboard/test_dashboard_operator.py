"""The operator's view, in headless Chromium against real collectors.

Runs are built by POSTing simulated samples (``vramwatch.probe.simulated``) to a real
collector. For the run with deaths the collector is then restarted on the same database:
replay stamps each rank's last-seen time with its last sample's time, so a rank that went
quiet 10 minutes of run time ago is silent by the collector's own rule and the page's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from test_dashboard import DEMO_RUN, LEAKING_RANK, Page, browser, chart_traces, collector, run_url, strip_rows

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace

pytestmark = pytest.mark.browser
__all__ = ["browser", "collector"]  # fixtures re-exported for pytest

GiB = 2**30
DEATHS_RUN = "deaths-8"
SILENT_RANK, RESTARTED_RANK, OOM_DEAD_RANK = 3, 5, 6
RATCHET_RUN = "ratchet-4"
WIDE_RUN = "wide-512"
WIDE_RANKS, WIDE_BAD = 512, 300
TIMES, MINUS = "\u00d7", "\u2212"


def post(url: str, samples: list[dict[str, Any]]) -> None:
    for i in range(0, len(samples), 20_000):
        body = b"".join(orjson.dumps(s) + b"\n" for s in samples[i:i + 20_000])
        resp = httpx.post(url + "/api/v1/samples", content=body, timeout=120,
                          headers={"content-type": "application/x-ndjson"})
        assert resp.status_code == 200, resp.text


def deaths_run() -> tuple[list[dict[str, Any]], int]:
    """8 ranks, 0.5 s steps, checkpoints every 500: rank 3 goes silent at step 600, rank 5
    runs out of memory at its step-1000 checkpoint and a new process resumes from there, rank
    6 runs out of memory early and dies (its step is returned). The run's newest sample is 5 s old."""
    base = 1.75e9

    def trace(scenario: str, rank: int, steps: int = 2000, **kw: Any) -> list[dict[str, Any]]:
        kw.setdefault("seed", rank)
        return list(simulate_trace(scenario, steps=steps, run=DEATHS_RUN, host=f"node-{rank // 4}", rank=rank,
                                   start_ts=base, step_time_s=0.5, ckpt_every=500, **kw))

    out: list[dict[str, Any]] = []
    for rank in (0, 1, 2, 4, 7):
        out += trace("checkpoint", rank)
    end = max(s["ts"] for s in out)
    out += [s for s in trace("checkpoint", SILENT_RANK) if s["step"] <= 600]
    first = trace("leak_to_oom", RESTARTED_RANK, leak_onset=200, leak_rate_frac=1.2e-4)
    assert first[-1]["ooms"] == 1
    out += first
    resumed = first[-1]["step"]
    for s in trace("checkpoint", RESTARTED_RANK, seed=99):
        s = {**s, "step": resumed + s["step"], "ts": first[-1]["ts"] + 60 + (s["ts"] - base),
             "incarnation": f"{DEATHS_RUN}-{RESTARTED_RANK}-1"}
        if s["ts"] > end:
            break
        out.append(s)
    died = trace("leak_to_oom", OOM_DEAD_RANK, leak_onset=200, leak_rate_frac=2.5e-4)
    assert died[-1]["ooms"] == 1
    out += died
    shift = time.time() - 5 - end
    return [{**s, "ts": s["ts"] + shift} for s in out], died[-1]["step"]


@pytest.fixture(scope="module")
def deaths(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = str(tmp_path_factory.mktemp("deaths") / "vw.db")
    with BackgroundServer(db) as first:
        samples, oom_step = deaths_run()
        post(first.url, samples)
    with BackgroundServer(db) as server:  # replay: last seen = last sample's time
        ranks = {r["rank"]: r for r in httpx.get(f"{server.url}/api/v1/runs/{DEATHS_RUN}/ranks").json()}
        yield {"url": server.url, "ranks": ranks, "oom_step": oom_step}


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def cards(p: Any) -> dict[str, dict[str, str]]:
    return p.evaluate("""Object.fromEntries(Array.from(document.querySelectorAll('#cards .card')).map(c =>
        [c.querySelector('.label').textContent, {value: c.querySelector('.value').textContent,
         sub: c.querySelector('.sub').textContent, alert: c.classList.contains('alert')}]))""")


# ---------------------------------------------------------------- deaths stay visible

def test_deaths_stick_to_rank_table_and_cards(deaths: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(deaths["url"], DEATHS_RUN))
    page.ready()
    p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 8")
    rows = strip_rows(p)
    by_rank = {r["rank"]: r for r in rows}
    # the dead ranks sort worst (killed alone while the others went on, and dead of an OOM), then
    # the rank that hit an OOM and came back
    assert {rows[0]["rank"], rows[1]["rank"]} == {SILENT_RANK, OOM_DEAD_RANK}
    assert rows[2]["rank"] == RESTARTED_RANK
    killed = " ".join(by_rank[SILENT_RANK]["cells"])
    assert "dead" in killed and "died: killed alone · step 600" in killed, killed
    # the OOM and the restart stick although the new process reports ooms = 0
    assert deaths["ranks"][RESTARTED_RANK]["last"]["ooms"] == 0
    restarted = " ".join(by_rank[RESTARTED_RANK]["cells"])
    assert f"OOM {TIMES}1" in restarted and f"restart {TIMES}1" in restarted
    # a rank that died of OOM says when and how, not a time to OOM
    oom_cell = by_rank[OOM_DEAD_RANK]["cells"][9]
    assert oom_cell.startswith(f"died: OOM · step {deaths['oom_step']}"), oom_cell
    assert "steps)" not in oom_cell
    # healthy ranks carry no flags
    assert all("OOM" not in " ".join(by_rank[r]["cells"]) for r in (0, 1, 2, 4, 7))

    c = cards(p)
    assert c["Worst rank"]["alert"] and "all ranks stable" not in c["Worst rank"]["sub"]
    assert "2 dead" in c["Ranks"]["sub"] and f"OOM {TIMES}2 on 2 ranks" in c["Ranks"]["sub"], c["Ranks"]
    assert c["Out of memory"]["value"] == f"rank {OOM_DEAD_RANK} died"
    assert f"OOM at step {deaths['oom_step']}" in c["Out of memory"]["sub"]

    # the filter finds the dead ranks, and the OOM ones
    p.fill("#strip-filter", "dead")
    p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 2")
    assert sorted(r["rank"] for r in strip_rows(p)) == [SILENT_RANK, OOM_DEAD_RANK]
    p.fill("#strip-filter", "oom")
    p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 2")
    assert sorted(r["rank"] for r in strip_rows(p)) == [RESTARTED_RANK, OOM_DEAD_RANK]
    page.shot("dashboard-deaths.png")
    assert page.errors == []


def test_dead_rank_chart_shows_the_death_not_a_projection(deaths: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(deaths["url"], DEATHS_RUN, rank=OOM_DEAD_RANK))
    page.ready()
    p.wait_for_function(f"(document.getElementById('rank-title')?.textContent ?? '')"
                        f".startsWith('Rank {OOM_DEAD_RANK} ')")
    names = [t["name"] for t in chart_traces(p, "chart-rank")]
    assert not any(n.startswith("leak → OOM") for n in names), names
    labels = p.evaluate("document.getElementById('chart-rank').layout.annotations.map(a => a.text)")
    assert "died: OOM" in labels
    assert f"This rank's process died (OOM) at step {deaths['oom_step']}, " in p.text_content("#rank-note")
    assert page.errors == []


def test_runs_list_shows_status_and_ooms_from_the_api(deaths: dict[str, Any], page: Page) -> None:
    api = next(r for r in httpx.get(f"{deaths['url']}/api/v1/runs").json() if r["run"] == DEATHS_RUN)
    p = page.page
    p.goto(deaths["url"] + "/")
    p.wait_for_selector("#runs-table tbody tr")
    row = p.locator("#runs-table tbody tr", has_text=DEATHS_RUN)
    cells = row.locator("td").all_text_contents()
    # the collector's status (with its dead ranks while it runs) and OOM count
    assert api["status"] == "running" and api["dead_ranks"] == 2
    assert cells[1] == "running · 2 dead"
    assert cells[2] == (f"{api['ooms']:,}" if "ooms" in api else "—")
    if "ooms" in api:
        assert api["ooms"] >= 2 and "bad" in row.locator("td").nth(2).get_attribute("class")
    assert page.errors == []


# ---------------------------------------------------------------- the bad rank stands out

@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """512 healthy ranks (the demo's model, no leak: rank 0 ~2 GB higher); rank 300 holds 3 GiB more from
    step 60 on: less headroom than its peers, nowhere near the device's end."""
    with BackgroundServer(str(tmp_path_factory.mktemp("wide") / "vw.db")) as server:
        start = time.time() - 200
        body: list[dict[str, Any]] = []
        for r in range(WIDE_RANKS):
            for s in simulate_trace("demo", steps=300, run=WIDE_RUN, host=f"node-{r // 8:03d}", rank=r,
                                    start_ts=start, step_time_s=0.5, seed=r, leak_onset=None, ckpt_every=0):
                if r == WIDE_BAD and s["step"] >= 60:
                    extra = 3 * GiB
                    s = {**s, "allocated_bytes": s["allocated_bytes"] + extra,
                         "reserved_bytes": s["reserved_bytes"] + extra,
                         "peak_allocated_bytes": s["peak_allocated_bytes"] + extra,
                         "nvml_used_bytes": s["nvml_used_bytes"] + extra if s["nvml_used_bytes"] is not None else None}
                body.append(s)
        post(server.url, body)
        yield {"url": server.url}


def test_512_ranks_bad_rank_stands_out_and_table_is_virtual(wide: dict[str, Any], browser: Any) -> None:
    page = Page(browser)
    try:
        p = page.page
        p.goto(run_url(wide["url"], WIDE_RUN))
        page.ready(timeout=60_000)
        p.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1", timeout=30_000)
        heat = p.evaluate("""(() => { const t = document.getElementById('chart-heatmap').data[0];
            const q = Math.floor(t.x.length * 3 / 4);  // the latest quarter: what the ranks do now
            const mean = row => { const v = row.slice(q).filter(x => x !== null);
                                  return v.reduce((a, b) => a + b, 0) / v.length; };
            return {y: Array.from(t.y), z: t.z.map(mean), zmin: t.zmin, zmax: t.zmax}; })()""")
        assert len(heat["y"]) == WIDE_RANKS
        rows = dict(zip(heat["y"], heat["z"], strict=True))
        bad = rows.pop(WIDE_BAD)
        rank0 = rows.pop(0)  # the demo model's rank 0 holds ~2 GB more than the others, by design
        others = sorted(rows.values())
        # coloured by deviation from the run's median: the bad rank sits at the red end of the
        # scale, alone; its 511 peers around the neutral middle (some bluer: more headroom)
        span = heat["zmax"]  # colour values are span * tanh(deviation / span), danger below -span
        assert bad <= -0.9 * span and heat["zmin"] < -span and bad < rank0 < -0.5 * span
        assert others[0] > -0.5 * span, (others[:5], span)
        assert sorted(abs(v) for v in others)[len(others) // 2] < 0.15 * span
        note = p.text_content("#heatmap-note")
        assert "median" in note and "Grey cells: no sample" in note and "under 5 %" in note
        assert p.evaluate("document.getElementById('chart-heatmap')._fullLayout.plot_bgcolor") != "rgba(0, 0, 0, 0)"
        # no mode bar over the heatmap's rows
        assert p.locator("#chart-heatmap .modebar").count() == 0

        # the verdict table keeps only the rows in view in the DOM, and updates them in place
        n_rows = p.locator("#verdict-strip tbody tr").count()
        assert 8 <= n_rows <= 60, n_rows
        assert f"{WIDE_RANKS} ranks" in p.text_content("#strip-foot")
        p.evaluate("document.querySelector('#verdict-strip tbody tr').__probe = 1")
        first_rank = p.get_attribute("#verdict-strip tbody tr", "data-rank")
        p.wait_for_function("window.performance.getEntriesByType('resource')"
                            ".filter(e => e.name.includes('/ranks')).length >= 3", timeout=10_000)
        assert p.evaluate("document.querySelector('#verdict-strip tbody tr').__probe") == 1
        assert p.get_attribute("#verdict-strip tbody tr", "data-rank") == first_rank
        # scrolling reaches the last ranks
        p.evaluate("const w = document.querySelector('.table-wrap.strip'); w.scrollTop = w.scrollHeight")
        p.click("#verdict-strip th[data-key='rank']")
        p.evaluate("const w = document.querySelector('.table-wrap.strip'); w.scrollTop = w.scrollHeight")
        p.wait_for_function(f"Array.from(document.querySelectorAll('#verdict-strip tbody tr'))"
                            f".some(r => r.dataset.rank === '{WIDE_RANKS - 1}')", timeout=5000)
        page.shot("dashboard-512-ranks.png")
        assert page.errors == []
    finally:
        page.close()


@pytest.fixture(scope="module")
def ratchet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """4 ranks just after their first checkpoint on a plateau: reserved ratcheted up once."""
    with BackgroundServer(str(tmp_path_factory.mktemp("ratchet") / "vw.db")) as server:
        start = time.time() - 1000
        post(server.url, [s for r in range(4) for s in simulate_trace(
            "checkpoint", steps=1800, run=RATCHET_RUN, host="node-0", rank=r, start_ts=start, step_time_s=0.5,
            ckpt_every=1500, seed=r)])
        yield {"url": server.url}


def test_checkpoint_ratchet_shows_its_cause(ratchet: dict[str, Any], page: Page) -> None:
    ranks = httpx.get(f"{ratchet['url']}/api/v1/runs/{RATCHET_RUN}/ranks").json()
    breaks = [next(e for e in reversed(r["events"]) if e["type"] == "plateau_break") for r in ranks]
    assert all(b["cause"] == "checkpoint" for b in breaks)
    p = page.page
    p.goto(run_url(ratchet["url"], RATCHET_RUN))
    page.ready()
    p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 4")
    rows = strip_rows(p)
    for row, api in zip(sorted(rows, key=lambda r: r["rank"]), sorted(ranks, key=lambda r: r["rank"]), strict=True):
        if api["verdict"]["state"] == "rising":
            # not amber "rising" with a red slope: the cause, and no alarm colours
            assert row["badge"] == "ratchet"
            slope = f"#verdict-strip tbody tr[data-rank='{row['rank']}'] td:nth-child(9)"
            assert p.get_attribute(slope, "class") == "num muted"
        else:
            assert row["badge"] == api["verdict"]["state"]
    assert any(r["badge"] == "ratchet" for r in rows) or all(r["verdict"]["state"] != "rising" for r in ranks)
    labels = p.evaluate("document.getElementById('chart-rank').layout.annotations.map(a => a.text)")
    assert "plateau break · checkpoint" in labels
    assert "ratchet" in p.text_content("#cards .card:nth-child(1)") or all(
        r["verdict"]["state"] != "rising" for r in ranks)
    assert page.errors == []


# ---------------------------------------------------------------- numbers agree with labels

def test_labels_agree_with_numbers(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    meta = httpx.get(f"{url}/api/v1/meta").json()
    ranks = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/ranks").json()
    p = page.page
    p.goto(run_url(url, DEMO_RUN))
    page.ready()
    p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 8")
    # tooltips are the collector's own definitions
    # with the scope of each figure: the checkpoint peak and its headroom are one checkpoint's
    scopes, where = meta["scopes"], meta["figure_scopes"]
    assert p.get_attribute("#verdict-strip th[data-key='headroom']", "title") == (
        meta["headroom"]["headroom_bytes"] + " — " + scopes[where["headroom_bytes"]])
    assert (p.get_attribute("#verdict-strip th[data-key='ckpt_headroom']", "title")
            == meta["headroom"]["checkpoint_headroom_bytes"] + " — " + scopes[where["checkpoint_headroom_bytes"]])
    assert p.get_attribute("#verdict-strip th[data-key='ckpt']", "title") == (
        "peak allocated at the latest checkpoint — " + scopes[where["checkpoint_peak_bytes"]])
    assert where["checkpoint_peak_bytes"] == where["checkpoint_headroom_bytes"]
    # one low-headroom threshold: a headroom cell is red exactly when under the meta fraction
    frac = meta["low_headroom_fraction"]
    assert f"under {round(frac * 100)} % of the device" in p.text_content("#strip-foot")
    for r in ranks:
        v = r["verdict"]
        cls = p.get_attribute(f"#verdict-strip tbody tr[data-rank='{r['rank']}'] td:nth-child(6)", "class")
        assert ("bad" in cls) == (v["headroom_bytes"] < frac * v["total_bytes"]), (r["rank"], cls)
    # the min-headroom card: the smallest of the API's numbers, and where it was measured
    values = [(v, r["rank"]) for r in ranks for v in (r["verdict"]["headroom_bytes"],
                                                       r["verdict"]["checkpoint_headroom_bytes"]) if v is not None]
    card = cards(p)["Min headroom"]
    assert card["value"] == f"{min(values)[0] / GiB:.2f} GiB" or card["value"] == f"{min(values)[0] / GiB:.1f} GiB"
    assert "plateau" not in card["sub"] and ("step boundary" in card["sub"] or "checkpoint peak" in card["sub"])

    # the leak is marked at its onset and at its detection
    leak = next(e for e in reversed(next(r for r in ranks if r["rank"] == LEAKING_RANK)["events"])
                if e["type"] == "leak")
    p.goto(run_url(url, DEMO_RUN, rank=LEAKING_RANK))
    page.ready()
    ann = p.evaluate("document.getElementById('chart-rank').layout.annotations.map(a => [a.text, a.x])")
    xs = {text.split(" +")[0]: x for text, x in ann}
    assert xs.get("leak onset") == leak["onset_step"] and xs.get("leak detected") == leak["step"], ann
    # the plateau line starts where the plateau does (not at step 0) and stops at the break
    plateau = next(t for t in chart_traces(p, "chart-rank") if t["name"].startswith("plateau "))
    leaking = next(r for r in ranks if r["rank"] == LEAKING_RANK)
    v = leaking["verdict"]
    since = v.get("plateau_since_step", next(e for e in leaking["events"] if e["type"] == "plateau")["step"])
    assert plateau["x"][0] == since > 10 and "until the break" in plateau["name"]
    if v.get("plateau_until_step") is not None:
        assert plateau["x"][-1] == v["plateau_until_step"]
    # fragmentation: what is wasted (reserved - per-step peak), named as such
    frag = next(t for t in chart_traces(p, "chart-frag") if t["name"].startswith("unused at peak"))
    main = {t["name"]: t for t in chart_traces(p, "chart-rank")}
    expect = main["reserved"]["y"][-1] - main["per-step peak"]["y"][-1]
    assert frag["y"][-1] == pytest.approx(max(0.0, expect), abs=1e-6)
    assert f"reserved {MINUS} per-step peak" in p.text_content("#frag-note")
    # checkpoint events are measured against the training peak, and say so
    events = p.eval_on_selector_all("#events-table tbody tr[data-type='checkpoint_spike'] td:nth-child(3)",
                                    "tds => tds.map(td => td.textContent)")
    assert events and all("training peak" in e and "above plateau" not in e for e in events)
    # the compare chart follows what the verdict is about: an allocator leak -> allocated
    p.wait_for_function("(document.getElementById('chart-overlay').data || []).length >= 2")
    assert p.input_value("#overlay-field") == "allocated_bytes"
    assert page.errors == []


def test_labels_do_not_pile_and_axes_end_at_the_data(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(collector["url"], DEMO_RUN, rank=LEAKING_RANK))
    page.ready()
    p.wait_for_function("(document.getElementById('chart-overlay').data || []).length >= 2")
    boxes = p.evaluate("""Array.from(document.querySelectorAll('#chart-rank .annotation')).map(a => {
        const r = a.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })""")
    assert len(boxes) >= 3
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = min(a[2], b[2]) - max(a[0], b[0]) > 1 and min(a[3], b[3]) - max(a[1], b[1]) > 1
            assert not overlap, (a, b)
    # the x axis ends at the data (the leak projection runs off the plot, labelled)
    last = p.evaluate(f"{RESERVED_X}[{RESERVED_X}.length - 1]")
    end = p.evaluate("document.getElementById('chart-rank')._fullLayout.xaxis.range[1]")
    assert last <= end <= last * 1.03
    # the compare legend sits under the plot, not on it
    plot = p.evaluate("document.querySelector('#chart-overlay .nsewdrag').getBoundingClientRect().toJSON()")
    legend = p.evaluate("document.querySelector('#chart-overlay .legend').getBoundingClientRect().toJSON()")
    assert legend["top"] >= plot["bottom"] - 1
    assert page.errors == []


RESERVED_X = "document.getElementById('chart-rank').data.find(t => t.name === 'reserved').x"


def test_small_screens(collector: dict[str, Any], browser: Any) -> None:
    for width, height in ((1280, 720), (390, 844)):
        context = browser.new_context(viewport={"width": width, "height": height})
        try:
            p = context.new_page()
            errors: list[str] = []
            p.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            p.goto(run_url(collector["url"], DEMO_RUN))
            p.wait_for_function("document.documentElement.dataset.ready === '1'", timeout=20_000)
            chart = p.evaluate("document.getElementById('chart-rank').getBoundingClientRect().toJSON()")
            if width == 1280:
                assert chart["bottom"] <= height, chart  # the rank chart is above the fold
            else:
                # nothing wider than the phone; the theme button is on screen; the breadcrumb
                # does not overlap the live status or the theme button
                assert p.evaluate("document.documentElement.scrollWidth") <= width
                button = p.evaluate("document.getElementById('theme-toggle').getBoundingClientRect().toJSON()")
                assert button["left"] >= 0 and button["right"] <= width
                crumbs = p.evaluate("document.getElementById('crumbs').getBoundingClientRect().toJSON()")
                for other in (button, p.evaluate("document.getElementById('live').getBoundingClientRect().toJSON()")):
                    assert crumbs["top"] >= other["bottom"] - 1 or crumbs["right"] <= other["left"] + 1
                assert chart["right"] <= width
                p.screenshot(path=_artifact("dashboard-390px.png"), full_page=False)
            assert errors == []
        finally:
            context.close()


def _artifact(name: str) -> str:
    from test_dashboard import ARTIFACTS

    ARTIFACTS.mkdir(exist_ok=True)
    return str(ARTIFACTS / name)


# ---------------------------------------------------------------- weight

def test_polling_fetches_deltas_and_a_partial_plotly(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    js = httpx.get(url + "/vendor/plotly.min.js")
    assert js.status_code == 200 and len(js.content) < 2_000_000 and b"cartesian" in js.content[:300]
    p = page.page
    p.goto(run_url(url, DEMO_RUN, rank=0))
    page.ready()
    page.requests.clear()
    collector["demo"].advance(20)
    new_last = collector["demo"].last_step
    p.wait_for_function(f"{RESERVED_X}[{RESERVED_X}.length - 1] === {new_last}", timeout=5000)
    page.polled(2)  # polls after the new step drew: each asked the chart for what came after
    main = [u for u in page.requests if "/chart?" in u and "rank=0" in u and "inactive_split_bytes" in u]
    assert main, page.requests
    # after the first full answer the rank chart asks only for the steps after the last one drawn
    assert all("start=" in u for u in main), main
    assert page.errors == []


# ---------------------------------------------------------------- calm under updates

def test_worst_card_holds_and_rows_stay_under_the_cursor(browser: Any, tmp_path: Any) -> None:
    """Warm-up: every rank is equally "warmup" and their order by headroom changes every
    poll. The worst-rank card keeps its rank (a rank must be strictly more severe to take
    it); the table re-sorts, except while the pointer is over it."""
    run = "warm-8"
    with BackgroundServer(str(tmp_path / "warm.db")) as server:
        # sample times well inside the silence window (0.2 s steps: 30 s, verdicts.silence_window): the
        # 250 steps below span 50 s from now, so however slowly the machine runs the loop, no rank is
        # judged stopped while the test looks at the cards
        gens = [simulate_trace("long_warmup", steps=10**6, run=run, host="node-0", rank=r, start_ts=time.time() - 5,
                               step_time_s=0.2, seed=r) for r in range(8)]
        step = 0

        def advance(n: int) -> None:
            nonlocal step
            step += n
            batch = []
            for g in gens:
                for s in g:
                    batch.append(s)
                    if s["step"] >= step:
                        break
            post(server.url, batch)

        advance(30)
        page = Page(browser)
        try:
            p = page.page
            p.goto(run_url(server.url, run))
            page.ready()
            p.mouse.move(5, 5)
            cards_seen, tops = set(), set()
            for _ in range(8):
                advance(25)
                p.wait_for_function(f"document.querySelector('#cards .card:nth-child(5) .sub')?.textContent === "
                                    f"'step {step}'", timeout=5000)
                page.polled()  # the poll that showed the step has drawn the strip and the cards
                cards_seen.add(p.text_content("#cards .card:nth-child(1) .value"))
                tops.add(p.get_attribute("#verdict-strip tbody tr", "data-rank"))
            states = {r["verdict"]["state"] for r in httpx.get(f"{server.url}/api/v1/runs/{run}/ranks").json()}
            assert states == {"warmup"}
            assert len(tops) > 1, "the order must change under the card for this test to mean anything"
            assert len(cards_seen) == 1, cards_seen

            # the pointer over the third row: polls update the cells but not the order
            row = p.locator("#verdict-strip tbody tr").nth(2)
            row.scroll_into_view_if_needed()
            box = row.bounding_box()
            p.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            order = p.eval_on_selector_all("#verdict-strip tbody tr", "rs => rs.map(r => r.dataset.rank)")
            under = p.evaluate(f"document.elementFromPoint({box['x'] + 20}, {box['y'] + box['height'] / 2})"
                               ".closest('tr').dataset.rank")
            for _ in range(4):
                advance(25)
                p.wait_for_function(f"document.querySelector('#cards .card:nth-child(5) .sub')?.textContent === "
                                    f"'step {step}'", timeout=5000)
                assert p.eval_on_selector_all("#verdict-strip tbody tr", "rs => rs.map(r => r.dataset.rank)") == order
                assert p.evaluate(f"document.elementFromPoint({box['x'] + 20}, {box['y'] + box['height'] / 2})"
                                  ".closest('tr').dataset.rank") == under
                assert p.evaluate("document.querySelector('#verdict-strip tbody tr td:last-child').textContent") \
                    == f"{step:,}"
            assert page.errors == []
        finally:
            page.close()


# ---------------------------------------------------------------- decisions (the advice panel and the compare view)

def test_advice_panel_and_compare_view_follow_the_collector(collector: dict[str, Any], page: Page) -> None:
    """With the collector's advice route the panel shows its readiness verdict and
    recommendation; without it (an older collector) the panel hides itself, with no 404s."""
    url = collector["url"]
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    p = page.page
    p.goto(run_url(url, DEMO_RUN))
    page.ready()
    p.locator("#advice-panel").scroll_into_view_if_needed()
    if "/api/v1/runs/{run}/advice" in paths:
        advice = httpx.get(f"{url}/api/v1/runs/{DEMO_RUN}/advice").json()
        p.wait_for_function("(() => { const e = document.getElementById('advice-rec');"
                            " return e !== null && e.textContent.length > 0; })()", timeout=30_000)
        assert p.text_content("#advice-verdict") == advice["readiness"]["verdict"].replace("_", " ")
        assert p.text_content("#advice-rec") == advice["recommendation"]
    else:
        p.wait_for_function("document.getElementById('advice-panel').hidden === true", timeout=10_000)
    p.goto(f"{url}/#/compare?a={DEMO_RUN}&b={DEMO_RUN}")
    p.wait_for_function("(() => { const b = document.querySelector('#compare-body');"
                        " return b !== null && !b.textContent.includes('loading'); })()", timeout=30_000)
    if "/api/v1/compare" in paths:
        doc = httpx.get(f"{url}/api/v1/compare", params={"a": DEMO_RUN, "b": DEMO_RUN}).json()
        assert p.locator("#compare-table tbody tr").count() == len({m["rank"] for m in doc["metrics"]})  # one per rank
    else:
        assert "no compare route" in p.text_content("#compare-body")
    assert p.input_value("#cmp-a") == DEMO_RUN
    assert page.errors == []


def test_report_rank_without_embedded_chart_says_so(browser: Any, tmp_path: Any) -> None:
    """A report embeds the charts of some ranks only: choosing another one shows its title and a
    note, never an error banner or the previous rank's chart."""
    from vramwatch.report import MAX_SERIES_RANKS, write_report

    ranks = MAX_SERIES_RANKS + 6
    db = str(tmp_path / "wide.db")
    with BackgroundServer(db) as server:
        post(server.url, [s for r in range(ranks) for s in simulate_trace(
            "healthy", steps=12, run="wide-report", host="node-0", rank=r, start_ts=time.time() - 60, seed=r)])
    out = tmp_path / "report.html"
    write_report(db, "wide-report", out)
    page = Page(browser)
    try:
        p = page.page
        p.goto(out.as_uri())
        page.ready()
        embedded = p.evaluate("Object.keys(window.VRAMWATCH_STATIC.series).map(k => Number(k.split('\\u0000')[1]))")
        missing = next(r for r in range(ranks) if r not in embedded)
        index = p.evaluate(f"Array.from(document.getElementById('rank-select').options)"
                           f".findIndex(o => o.textContent.startsWith('rank {missing} '))")
        p.select_option("#rank-select", str(index))
        p.wait_for_function(f"(document.getElementById('rank-title')?.textContent ?? '').startsWith('Rank {missing} ')")
        p.wait_for_function("(document.getElementById('rank-note')?.textContent ?? '').includes('embeds the charts')")
        assert p.evaluate("document.getElementById('chart-rank').data.length") == 0
        assert p.is_hidden("#banner")
        assert page.errors == []
    finally:
        page.close()
