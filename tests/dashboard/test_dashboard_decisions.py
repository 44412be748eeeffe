"""The decisions where people look, in headless Chromium against a real collector: the advice panel
loads with the page and renders in the HTML report; the compare page leads with a per-run
summary, one row per rank ordered by growth and one overlaid chart, its colours meaning direction
and size."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from test_dashboard import Page, browser, run_url

from vramwatch.collector.server import BackgroundServer
from vramwatch.simulation.stories import story_trace
from vramwatch.simulation.tokens import regression_overrides, token_trace

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the fixture, re-exported for pytest

STORY_RUN, LEAK_RUN = "kohrm-raise", "leaking"
WIDE, GROWN = 64, (10, 41)


def post(url: str, samples: list[dict[str, Any]]) -> None:
    for i in range(0, len(samples), 20_000):
        body = b"".join(orjson.dumps(s) + b"\n" for s in samples[i:i + 20_000])
        resp = httpx.post(url + "/api/v1/samples", content=body, timeout=120,
                          headers={"content-type": "application/x-ndjson"})
        assert resp.status_code == 200, resp.text


def wide_run(run: str, grown: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """64 ranks; the ``grown`` ones hold 6 % more at the training peak."""
    extra = regression_overrides("fixed", 0.06)
    return [s for r in range(WIDE) for s in token_trace("fixed", steps=250, run=run, rank=r, seed=r, world_size=WIDE,
                                                        host=f"node-{r // 8}", **(extra if r in grown else {}))]


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("decisions") / "vw.db"
    with BackgroundServer(str(db)) as server:
        post(server.url, story_trace("raise_ooms", run=STORY_RUN))
        post(server.url, wide_run("wide-a"))
        post(server.url, wide_run("wide-b", GROWN))
        post(server.url, [s for r in range(2) for s in token_trace(
            "fixed", steps=3000, run=LEAK_RUN, rank=r, seed=r, world_size=2, leak_onset=1200, leak_rate_frac=3.5e-5)])
        yield {"url": server.url, "db": str(db)}


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def test_the_advice_panel_loads_with_the_page_and_shows_the_next_step(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    advice = httpx.get(f"{url}/api/v1/runs/{STORY_RUN}/advice").json()
    p = page.page
    p.goto(run_url(url, STORY_RUN))
    page.ready()
    # never scrolled: the panel is below the fold and answers all the same
    p.wait_for_function("(document.getElementById('advice-rec')?.textContent ?? '').length > 0", timeout=30_000)
    assert p.evaluate("document.getElementById('advice-panel').getBoundingClientRect().top") > \
        p.evaluate("window.innerHeight")
    assert p.text_content("#advice-rec") == advice["recommendation"] == advice["next"]["sentence"]
    assert p.text_content("#advice-action") == "back off" and advice["next"]["action"] == "back_off"
    # global first, as the operator sets it
    assert p.text_content("#advice-batch") == "180,224 global · 22,528 per rank"
    assert p.get_attribute("#advice-next", "data-cause") == "batch_change"
    evidence = p.text_content("#advice-evidence")
    assert "proven 180,224 global · 22,528 per rank" in evidence
    assert "OOM at 196,608 global · 24,576 per rank (rank 0" in evidence
    assert p.text_content("#advice-max").startswith("180,224 global · 22,528 per rank")
    assert p.text_content("#advice-grid").startswith("8,192 global · 1,024 per rank (inferred)")
    reasons = p.eval_on_selector_all(".advice-reasons li", "ls => ls.map(l => [l.dataset.cause, l.textContent])")
    assert reasons and reasons[0][0] == "oom" and all("[object" not in text for _, text in reasons)
    # the try box takes the global batch the operator types; judged by the evidence first: the batch
    # that ran out of memory does not fit
    assert "global" in p.get_attribute("#advice-target", "placeholder")
    p.fill("#advice-target", "196608")
    p.press("#advice-target", "Enter")
    p.wait_for_function("(document.getElementById('advice-target-result')?.textContent ?? '').includes('196,608')")
    result = p.text_content("#advice-target-result")
    assert result.startswith("196,608 global (24,576 per rank): does not fit"), result
    # the seed's fallback is settable and judged
    p.fill("#advice-target", "172032")
    p.press("#advice-target", "Enter")
    p.wait_for_function("(document.getElementById('advice-target-result')?.textContent ?? '').includes('172,032')")
    assert p.text_content("#advice-target-result").startswith("172,032 global (21,504 per rank): fits")
    # off the grid: the route's one line naming the grid, the advice still shown
    p.fill("#advice-target", "180000")
    p.press("#advice-target", "Enter")
    p.wait_for_function("(document.getElementById('advice-target-result')?.textContent ?? '')"
                        ".includes('not on the grid')")
    result = p.text_content("#advice-target-result")
    assert "8,192 global (1,024 per rank)" in result and "nearest 172,032 or 180,224 global" in result
    assert p.text_content("#advice-rec") == advice["recommendation"]
    # the browser logs the refused request itself; nothing else went wrong
    refused = [e for e in page.errors if "status of 422" in e]
    assert len(refused) == 1 and [e for e in page.errors if e not in refused] == []


def test_during_a_leak_the_panel_hides_the_largest_batch_and_gives_the_runway_in_time(collector: dict[str, Any],
                                                                                      page: Page) -> None:
    doc = httpx.get(f"{collector['url']}/api/v1/runs/{LEAK_RUN}/advice").json()
    soonest = min((r for r in doc["readiness"]["ranks"] if r["steps_to_oom"] is not None),
                  key=lambda r: r["seconds_to_oom"])
    p = page.page
    p.goto(run_url(collector["url"], LEAK_RUN))
    page.ready()
    p.wait_for_function("(document.getElementById('advice-rec')?.textContent ?? '').length > 0", timeout=30_000)
    hidden = doc["max_tokens_hidden"]["text"]
    assert p.text_content("#advice-max") == hidden and "not shown" in hidden and doc["max_tokens_per_step"] is None
    runway = p.text_content("#advice-runway")
    steps = f"{soonest['steps_to_oom']:,} steps"
    assert runway.endswith(f" · {steps} · rank {soonest['rank']}") and (" min" in runway or " h " in runway), runway
    assert page.errors == []


def test_the_report_embeds_the_advice_and_renders_it(collector: dict[str, Any], browser: Any, tmp_path: Any) -> None:
    from vramwatch.report import report_data, write_report

    out = tmp_path / "report.html"
    write_report(collector["db"], STORY_RUN, out)
    embedded = report_data(collector["db"], STORY_RUN)["advice"]
    assert embedded["next"]["action"] == "back_off" and embedded["next"]["tokens_per_step"] == 22528
    page = Page(browser)
    try:
        p = page.page
        p.goto(out.as_uri())
        page.ready()
        p.wait_for_function("(document.getElementById('advice-rec')?.textContent ?? '').length > 0", timeout=30_000)
        assert p.text_content("#advice-rec") == embedded["recommendation"]
        assert "checking" not in p.text_content("#advice-body")
        assert p.query_selector("#advice-target") is None  # a file cannot judge a new target
        assert page.errors == []
    finally:
        page.close()


def test_the_compare_page_leads_with_the_runs_and_the_ranks_that_grew(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    doc = httpx.get(f"{url}/api/v1/compare", params={"a": "wide-a", "b": "wide-b"}).json()
    p = page.page
    p.goto(f"{url}/#/compare?a=wide-a&b=wide-b")
    p.wait_for_selector("#compare-table tbody tr", timeout=30_000)
    # the summary and the chart come before the table
    order = p.evaluate("Array.from(document.querySelectorAll('#compare-summary, #compare-chart, #compare-table'))"
                       ".map(e => e.id)")
    assert order == ["compare-summary", "compare-chart", "compare-table"]
    runs = p.eval_on_selector_all(".cmp-run", "rs => rs.map(r => r.textContent)")
    assert len(runs) == 2 and all("64 ranks" in r for r in runs)
    # one row per rank, the grown ones first
    rows = p.eval_on_selector_all("#compare-table tbody tr", "rs => rs.map(r => Number(r.dataset.rank))")
    assert len(rows) == WIDE and set(rows[:2]) == set(GROWN)
    assert rows == [g["rank"] for g in doc["ranks_by_growth"]]
    assert "largest growth +" in p.text_content("#compare-lead")
    # colours mean direction and size: +6 % red, an unchanged figure plain (never red for +0.0 %)
    cells = p.eval_on_selector_all("#compare-table .growth", "cs => cs.map(c => [c.textContent, c.className])")
    unchanged = [c for t, c in cells if t == "±0.0 %"]
    assert unchanged and all("bad" not in c and "warn" not in c for c in unchanged)
    grown = [c for t, c in cells if t.startswith("+5.") or t.startswith("+6.")]
    assert grown and all("bad" in c for c in grown)
    assert not any(t == "+0.0 %" for t, _ in cells)
    # one overlaid chart: both runs, rank by rank
    names = p.evaluate("document.getElementById('compare-chart').data.map(t => t.name)")
    assert any(n.startswith("wide-a") for n in names) and any(n.startswith("wide-b") for n in names)
    assert p.evaluate("document.getElementById('compare-chart').data[0].x.length") == WIDE
    assert page.errors == []
