"""``vramwatch report``: one self-contained HTML file of a run's dashboard page, checked
as text (nothing external, hostile names escaped) and in headless Chromium from file://
(renders offline with the same verdicts as the live collector)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_dashboard import (  # shared fixtures: the fed collector and the browser
    DEMO_RUN,
    LEAKING_RANK,
    XSS_HOST,
    XSS_RUN,
    Page,
    browser,
    collector,
    strip_rows,
)

from vramwatch.collector.reads import rundoc
from vramwatch.collector.serving.app import dashboard_plotly_js_path
from vramwatch.report import ReportError, build_report, report_data, write_report

__all__ = ["browser", "collector"]  # fixtures re-exported for pytest


@pytest.fixture(scope="module")
def demo_report(collector: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "report.html"
    size = write_report(collector["db"], DEMO_RUN, out)
    assert size == out.stat().st_size
    return out


def test_report_is_self_contained(demo_report: Path) -> None:
    text = demo_report.read_text(encoding="utf-8")
    assert text.startswith("<!doctype html>")
    # plotly.js, the CSS and the app are inlined: no src/href that would need a server
    refs = re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="([^"]+)"', text)
    assert [r for r in refs if not r.startswith("data:")] == []
    # the partial (cartesian) plotly bundle the dashboard serves, not the full 4.8 MB one
    partial = dashboard_plotly_js_path().read_text(encoding="utf-8")
    assert partial[:2000] in text and partial[-2000:] in text
    import plotly  # the test extra's: the full bundle, which the report must not inline

    full = (Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    assert full[:2000] != partial[:2000] and full[:2000] not in text
    assert len(text.encode()) < len(partial.encode()) + 4_000_000
    assert "window.VRAMWATCH_STATIC = " in text
    assert f"<title>vramwatch report · {DEMO_RUN}</title>" in text
    # only one closing script tag per script element: nothing inside ends one early
    assert text.count("</script>") == text.count("<script>") == 3


def test_report_data_matches_the_live_api(collector: dict[str, Any]) -> None:
    data = report_data(collector["db"], DEMO_RUN)
    live = httpx.get(f"{collector['url']}/api/v1/runs/{DEMO_RUN}/ranks").json()
    # the live collector may have seen more steps (other tests feed it): compare the state
    assert {r["rank"]: r["verdict"]["state"] for r in data["ranks"]}[LEAKING_RANK] == "leak"
    assert sorted(r["rank"] for r in data["ranks"]) == sorted(r["rank"] for r in live)
    assert [r["rank"] for r in data["ranks"] if r["verdict"]["state"] == "leak"] == [LEAKING_RANK]
    key = f"node-1\u0000{LEAKING_RANK}"
    series = data["series"][key]
    # spike-preserving downsampling: the raw maximum is in the embedded points
    raw = httpx.get(f"{collector['url']}/api/v1/runs/{DEMO_RUN}/series", params={
        "rank": LEAKING_RANK, "fields": "reserved_bytes,peak_allocated_bytes", "points": 20000,
        "end": series["x"][-1]}).json()
    assert max(series["series"]["peak_allocated_bytes"]) == max(raw["series"]["peak_allocated_bytes"])
    assert max(series["series"]["reserved_bytes"]) == max(raw["series"]["reserved_bytes"])
    assert any(p["phase"] == "checkpoint" for p in data["phases"][key])
    heat = data["heatmap"]["step"]["headroom"]
    assert [r["rank"] for r in heat["rows"]] == list(range(8)) and len(heat["z"]) == 8


def test_report_renders_offline_in_chromium(demo_report: Path, browser: Any) -> None:
    page = Page(browser, scheme="dark")
    try:
        p = page.page
        p.goto(demo_report.as_uri())
        page.ready()
        p.wait_for_function("document.querySelectorAll('#verdict-strip tbody tr').length === 8")
        rows = strip_rows(p)
        assert rows[0]["rank"] == LEAKING_RANK and rows[0]["state"] == "leak"
        p.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1")
        shapes = p.evaluate("document.getElementById('chart-rank').layout.shapes.map(s => s.name || '')")
        assert any(s.startswith("checkpoint band") for s in shapes)
        assert p.get_attribute("#live", "data-state") == "static"
        # switching rank and axis works from the embedded data alone
        p.click("#verdict-strip tbody tr[data-rank='0']")
        p.wait_for_function("(document.getElementById('rank-title')?.textContent ?? '').startsWith('Rank 0 ')")
        p.click("button[data-x='time']")
        p.wait_for_function("document.getElementById('chart-rank').layout.xaxis.type === 'date'")
        assert [u for u in page.requests if not u.startswith(("file:", "data:"))] == []
        page.shot("report-dark.png")
        assert page.errors == []
    finally:
        page.close()


def test_report_escapes_hostile_names(collector: dict[str, Any], browser: Any, tmp_path: Path) -> None:
    text = build_report(collector["db"], XSS_RUN)
    assert XSS_RUN not in text and XSS_HOST not in text
    assert "<img src=x" not in text and "<svg onload" not in text
    out = tmp_path / "xss.html"
    out.write_text(text, encoding="utf-8")
    page = Page(browser)
    try:
        p = page.page
        p.goto(out.as_uri())
        page.ready()
        assert p.text_content("#crumbs .cur") == XSS_RUN
        assert XSS_HOST in p.eval_on_selector_all("#verdict-strip tbody td.name", "tds => tds.map(t => t.textContent)")
        assert p.evaluate("window.__xss") is None
        assert page.dialogs == [] and page.errors == []
    finally:
        page.close()


def test_report_errors_name_the_problem(collector: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"run: no run named 'nope'.*demo-8xH200"):
        build_report(collector["db"], "nope")
    with pytest.raises(ReportError, match=r"db: database .* does not exist"):
        build_report(str(tmp_path / "missing.db"), DEMO_RUN)
    assert not (tmp_path / "missing.db").exists(), "a report never creates a database"



def test_remote_report_pages_through_every_rank_and_stops_on_a_front() -> None:
    """``report --url``: a collector pages /ranks; a front answers every page with the full list."""
    from vramwatch.collector.state.rows import MAX_RANK_ROWS
    from vramwatch.report import _all_rank_rows

    everyone = [{"host": f"h{i // 8}", "rank": i} for i in range(MAX_RANK_ROWS + 10)]
    asked = []

    def collector(what: str, **params):
        asked.append(params.get("offset", 0))
        start = params.get("offset", 0)
        return everyone[start:start + MAX_RANK_ROWS]

    assert _all_rank_rows(collector) == everyone and asked == [0, MAX_RANK_ROWS]
    asked.clear()

    def front(what: str, **params):
        asked.append(params.get("offset", 0))
        return everyone  # full list whatever the page

    assert _all_rank_rows(front) == everyone and len(asked) == 2


def test_a_rank_that_went_silent_is_embedded_first_as_the_live_page_orders_it(tmp_path, monkeypatch) -> None:
    """The embedded ranks are the rank rows' worst-first order (severity with liveness, then
    headroom): the order ``report --url`` and the dashboard use. A rank that stopped while the
    others go on is "silent" and comes first, though it has the most headroom."""
    import time as _time

    from helpers import GiB, make_sample

    from vramwatch import report
    from vramwatch.collector.store import Store

    now = _time.time()
    samples = []
    for rank in range(4):
        # rank 2 went quiet 20 s before the others' last step (within its 30 s window: silent, not dead)
        last = 190 if rank == 2 else 200
        for step in range(last + 1):
            allocated = (40 if rank == 2 else 100 + rank) * GiB
            samples.append(make_sample(step, rank=rank, ts=now - 420 + 2 * step, allocated_bytes=allocated,
                                       peak_allocated_bytes=allocated + GiB, reserved_bytes=allocated + 2 * GiB,
                                       nvml_used_bytes=allocated + 3 * GiB))
    db = str(tmp_path / "vw.db")
    store = Store(db)
    store.insert(samples)
    store.close()
    monkeypatch.setattr(rundoc, "MAX_SERIES_RANKS", 2)  # what the documents embed
    data = report.report_data(db, "run-a")
    rows = {r["rank"]: r for r in data["ranks"]}
    assert rows[2]["liveness"] == "silent" and {rows[r]["liveness"] for r in (0, 1, 3)} == {"live"}
    order = [r["rank"] for r in sorted(data["ranks"], key=report.row_order)]
    assert order[0] == 2 and order[1:] == [3, 1, 0]  # then least headroom first
    assert sorted(key.split("\u0000")[1] for key in data["series"]) == ["0", "2", "3"]  # + rank 0, always
