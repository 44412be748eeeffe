"""The story of a failure on the page (headless Chromium against a real collector): the
post-mortem panel tells the incidents in order with the collector's own sentences and ends with
the next step and its command; the runs list and the run card count incidents, not per-rank
deaths; the wall-time chart places the OOM before the restart that followed it; the step
chart names the attempt; an OOM suspected from device memory reads as a suspicion with its
numbers; the report renders the same story; format.js reads numbers as vramwatch/units.py does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from incident_runs import SCENARIOS, device_oom
from test_dashboard import Page, browser, run_url
from test_dashboard_operator import post

from vramwatch import units
from vramwatch.collector.server import BackgroundServer
from vramwatch.report import write_report

pytestmark = pytest.mark.browser
__all__ = ["browser"]

RUNS = ("leak_checkpoint_restart", "lone_death")


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("incidents") / "vw.db"
    with BackgroundServer(str(db)) as srv:
        for name in RUNS:
            probe = SCENARIOS[name]()
            span = probe.last_ts - probe.samples[0]["ts"]
            post(srv.url, SCENARIOS[name](t0=time.time() - span - 900).samples)
        post(srv.url, device_oom("dcgm-oom", end=time.time() - 1))  # device memory only: a suspected OOM
        yield {"url": srv.url, "db": str(db)}


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def _story(p: Any) -> dict[str, Any]:
    p.wait_for_selector("#postmortem:not([hidden]) #pm-story li")
    return p.evaluate("""() => ({
        incidents: [...document.querySelectorAll('#pm-incidents li')].map(li => ({text: li.textContent,
            cause: li.dataset.cause, kind: li.dataset.kind})),
        open: [...document.querySelectorAll('#pm-open li')].map(li => li.textContent),
        next: [...document.querySelectorAll('#pm-next li')].map(li => ({action: li.dataset.action,
            command: (li.querySelector('code') || {}).textContent || null}))})""")


def test_the_postmortem_panel_tells_the_story_and_the_next_step(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    api = httpx.get(f"{url}/api/v1/runs/leak-ckpt/postmortem", timeout=60).json()
    p = page.page
    p.goto(run_url(url, "leak-ckpt", rank=5))
    page.ready()
    story = _story(p)
    assert [(i["kind"], i["cause"]) for i in story["incidents"]] == [("oom", "leak")]
    assert api["incidents"][0]["text"] in story["incidents"][0]["text"]
    assert story["open"] == [f["text"] for f in api["open_findings"]]
    assert [n["action"] for n in story["next"]] == [n["action"] for n in api["next"]]
    assert story["next"][0]["command"] == "vramwatch capture leak-ckpt --rank 5"
    # the run card counts one incident, the per-rank counts beside it
    p.wait_for_function("document.getElementById('cards').textContent.includes('incident')")
    cards = p.text_content("#cards")
    assert "1 incident (" in cards and "OOM \u00d71" in cards, cards
    assert "ended while leaking" in cards and "no leak" not in cards, cards
    assert page.errors == []


def test_a_suspected_oom_reads_as_a_suspicion_with_its_numbers(collector: dict[str, Any], page: Page) -> None:
    """Device memory only: the rank's flag, the events table's row and the chart's marker say
    "suspected OOM" with the device's numbers; the post-mortem panel tells the collector's sentence."""
    url = collector["url"]
    api = httpx.get(f"{url}/api/v1/runs/dcgm-oom/postmortem", timeout=60).json()
    (inc,) = api["incidents"]
    f = inc["finding"]
    p = page.page
    p.goto(run_url(url, "dcgm-oom", rank=0))
    page.ready()
    story = _story(p)
    assert [(i["kind"], i["cause"]) for i in story["incidents"]] == [("suspected_oom", "suspected_oom")]
    assert story["incidents"][0]["text"].startswith("suspected OOM · suspected OOM (device memory)")
    assert inc["text"] in story["incidents"][0]["text"]
    assert [n["action"] for n in story["next"]] == [n["action"] for n in api["next"]]
    p.wait_for_selector("#events-table tbody tr[data-type='suspected_oom']")
    name, detail = p.eval_on_selector("#events-table tbody tr[data-type='suspected_oom']",
                                      "tr => [tr.cells[1].textContent, tr.cells[2].textContent]")
    assert name == "suspected OOM"
    assert (f"device used fell from {units.gib(f['used_before_bytes'])} of {units.capacity(f['total_bytes'])} to "
            f"{units.gib(f['used_after_bytes'])}") in detail, detail
    assert "no OOM counter" in detail and f"reason: {f['reason'].replace('_', ' ')}" in detail
    assert "suspected OOM \u00d71" in p.text_content("#verdict-strip"), "the rank flag"
    p.wait_for_function("document.getElementById('cards').textContent.includes('incident')")
    assert "1 incident (suspected OOM \u00d71)" in p.text_content("#cards")
    p.wait_for_function("""() => { const gd = document.getElementById('chart-rank');
        return gd && gd.layout && (gd.layout.annotations || []).some(a => a.name === 'label suspected_oom'); }""")
    marks = p.evaluate("""() => document.getElementById('chart-rank').layout.annotations
        .filter(a => a.name === 'label suspected_oom').map(a => [a.text, a.hovertext || ''])""")
    assert marks and "suspected OOM" in marks[0][0], marks
    assert page.errors == []


def test_a_lone_death_reads_as_one_not_a_job_stop(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(collector["url"], "lone", rank=3))
    page.ready()
    story = _story(p)
    assert [(i["kind"], i["cause"]) for i in story["incidents"]] == [("death", "not_memory")]
    assert "job-wide" not in p.text_content("#pm-story")
    assert page.errors == []


def test_runs_list_counts_incidents(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(collector["url"] + "/#/")
    p.wait_for_selector("#runs-table tbody tr[data-run='leak-ckpt']")
    head = p.eval_on_selector_all("#runs-table thead th", "ths => ths.map(t => t.textContent)")
    col = head.index("Incidents")
    cells = p.locator("#runs-table tbody tr[data-run='leak-ckpt'] td").all_text_contents()
    assert cells[col] == "1"
    assert page.errors == []


def test_runs_list_shows_suspected_ooms_beside_the_oom_count(collector: dict[str, Any], page: Page) -> None:
    """The device-only run: its OOMs cell reads "0 + 1 suspected" (the collector's row, never an OOM)
    and says what a suspicion is; a run without one shows its OOM count alone."""
    p = page.page
    p.goto(collector["url"] + "/#/")
    p.wait_for_selector("#runs-table tbody tr[data-run='dcgm-oom']")
    head = p.eval_on_selector_all("#runs-table thead th", "ths => ths.map(t => t.textContent)")
    col = head.index("OOMs")
    row = next(r for r in httpx.get(collector["url"] + "/api/v1/runs", timeout=30).json() if r["run"] == "dcgm-oom")
    assert (row["ooms"], row["suspected_ooms"]) == (0, 1)
    cell = p.locator("#runs-table tbody tr[data-run='dcgm-oom'] td").nth(col)
    assert cell.text_content() == "0 + 1 suspected"
    assert "bad" in (cell.get_attribute("class") or "").split()
    assert "1 suspected OOM (device memory only, not confirmed)" in (cell.get_attribute("title") or "")
    other = p.locator("#runs-table tbody tr[data-run='leak-ckpt'] td").nth(col).text_content()
    assert "suspected" not in other and other.strip().isdigit()
    assert page.errors == []


def test_the_wall_time_chart_puts_the_oom_before_the_restart(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(collector["url"], "leak-ckpt", rank=5, x="time"))
    page.ready()
    p.wait_for_function("""() => { const gd = document.getElementById('chart-rank');
        return gd && gd.layout && (gd.layout.annotations || []).some(a => (a.name || '') === 'label restart'); }""")
    marks = p.evaluate("""() => document.getElementById('chart-rank').layout.annotations
        .filter(a => ['label oom', 'label restart'].includes(a.name)).map(a => [a.name, a.x, a.text])""")
    oom = [m for m in marks if m[0] == "label oom"]
    restart = [m for m in marks if m[0] == "label restart"]
    assert oom and restart
    assert _ms(oom[0][1]) < _ms(restart[0][1]), marks
    assert "attempt 2" in restart[0][2]
    # the events table: newest first by time, the restart above the OOM though its step is lower
    rows = p.eval_on_selector_all("#events-table tbody tr",
                                  "trs => trs.map(t => [t.dataset.type, t.cells[0].textContent])")
    order = [t for t, _ in rows]
    assert order.index("restart") < order.index("oom")
    assert any("(attempt 2)" in step for t, step in rows if t == "restart")
    assert page.errors == []


def _ms(x: Any) -> float:
    if isinstance(x, (int, float)):
        return float(x)
    from datetime import datetime

    return datetime.fromisoformat(str(x).replace(" ", "T")).timestamp()


def test_the_report_renders_the_same_story(collector: dict[str, Any], browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    write_report(collector["db"], "leak-ckpt", out)
    page = Page(browser)
    try:
        page.page.goto(out.as_uri())
        story = _story(page.page)
        assert [(i["kind"], i["cause"]) for i in story["incidents"]] == [("oom", "leak")]
        assert story["next"][0]["command"] == "vramwatch capture leak-ckpt --rank 5"
        # a suspected OOM reads in the report as on the page, with the collector's sentence
        api = httpx.get(f"{collector['url']}/api/v1/runs/dcgm-oom/postmortem", timeout=60).json()
        device = tmp_path / "device.html"
        write_report(collector["db"], "dcgm-oom", device)
        page.page.goto(device.as_uri() + "#/run/dcgm-oom?rank=0&host=node-a")
        story = _story(page.page)
        assert [(i["kind"], i["cause"]) for i in story["incidents"]] == [("suspected_oom", "suspected_oom")]
        assert api["incidents"][0]["text"] in story["incidents"][0]["text"]
        row = page.page.wait_for_selector("#events-table tbody tr[data-type='suspected_oom']")
        assert row.eval_on_selector("td:nth-child(2)", "td => td.textContent") == "suspected OOM"
    finally:
        page.close()


#: ties included (0.125 GiB, 2.5 MiB whole): the two languages round them alike only by the rule
VALUES = [0, 1536, 6.03e6, 60 * 2**20, 128 * 2**20, 2**30 // 8, 250.5 * 2**20, 143_771 * 2**20, 80 * 2**30,
          -3 * 2**20, -(2**30) // 8]


#: ties (30.5 s, 2.5 min, 3 h 0.5 min), a carry into the hour (7,199 s), days, negatives
DURATIONS = [0, 30.5, 89.4, 150, 300, 4000, 7199, 10_830, 8280, 90_000, 172_800, 200_000, -5]


def test_format_js_reads_numbers_as_units_py(collector: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(collector["url"] + "/#/")
    p.wait_for_selector("#runs-table")
    got = p.evaluate("""async ([values, DURATIONS]) => { const f = await import('./static/format.js');
        return { mib: values.map(f.mib), rate: values.map(f.rate), smi: values.map(f.smiMib),
                 capacity: values.map(f.capacity), gib: values.map(v => f.gib(v)),
                 duration: DURATIONS.map(f.duration),
                 runway: [[1234, 8280], [0, 0], [5, null]].map(([s, t]) => f.runway(s, t)) }; }""", [VALUES, DURATIONS])
    assert got["mib"] == [units.mib(v) for v in VALUES]
    assert got["rate"] == [units.rate(v) for v in VALUES]
    assert got["smi"] == [units.smi_mib(v) for v in VALUES]
    assert got["capacity"] == [units.capacity(v) for v in VALUES]
    assert got["gib"] == [units.gib(v) for v in VALUES]
    assert got["duration"] == [units.duration(s) for s in DURATIONS]
    assert units.duration(7199) == "2 h 0 min" and units.duration(30.5) == "31 s"
    assert got["runway"] == [units.runway(s, t) for s, t in ((1234, 8280), (0, 0), (5, None))]
    assert units.capacity(143_771 * 2**20) == "140.4 GiB (143,771 MiB)"
