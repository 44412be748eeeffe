"""Memory by category and the remedies where people look, in headless Chromium against a real
collector: the stacked chart per rank (its layers computed independently here from the same /chart
document), the remedies table in the advice panel, both in the HTML report too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from memory_runs import watched_varlen
from test_dashboard import Page, browser, chart_traces, run_url

from vramwatch.collector.server import BackgroundServer
from vramwatch.simulation.tokens import token_truth

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the fixture, re-exported for pytest

RUN = "watched"
GIB = 2**30
FIELDS = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "foreign_used_bytes",
          "params_bytes", "grads_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("memory") / "vw.db"
    floor = int(token_truth("varlen", rank=0, seed=0).floor_bytes)
    samples = watched_varlen(RUN, floor=floor, steps=1500, change_at=700)
    with BackgroundServer(str(db)) as server:
        body = b"".join(orjson.dumps(s) + b"\n" for s in samples)
        resp = httpx.post(server.url + "/api/v1/samples", content=body, timeout=120,
                          headers={"content-type": "application/x-ndjson"})
        assert resp.status_code == 200, resp.text
        yield {"url": server.url, "db": str(db)}


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def expected_layers(doc: dict[str, Any]) -> dict[str, list[float | None]]:
    """The stack from the chart document, independently: sparse fields carried forward."""
    s = doc["series"]
    held: dict[str, Any] = {}
    out: dict[str, list[float | None]] = {k: [] for k in ("parameters", "gradients", "optimizer state",
                                                          "activations and temporaries", "allocator cache",
                                                          "outside the allocator")}
    for i in range(len(doc["x"])):
        for f in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            if s[f][i] is not None:
                held[f] = s[f][i]
        p, g, o = held["params_bytes"], held["grads_bytes"], held["optimizer_bytes"]
        peak, res, used = s["peak_allocated_bytes"][i], s["reserved_bytes"][i], s["nvml_used_bytes"][i]
        foreign = s["foreign_used_bytes"][i] or 0
        for name, v in (("parameters", p), ("gradients", g), ("optimizer state", o),
                        ("activations and temporaries", max(0, peak - p - g - o)),
                        ("allocator cache", max(0, res - max(peak, p + g + o))),
                        ("outside the allocator", max(0, used - res - foreign))):
            out[name].append(v / GIB)
    return out


def test_the_stacked_chart_shows_each_category_of_the_selected_rank(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    p = page.page
    p.goto(run_url(url, RUN, rank=0))
    page.ready()
    p.locator("#cat-panel").scroll_into_view_if_needed()
    p.wait_for_function("(document.getElementById('chart-categories')?.data || []).length >= 6", timeout=30_000)
    traces = {t["name"]: t for t in chart_traces(p, "chart-categories")}
    doc = httpx.get(f"{url}/api/v1/runs/{RUN}/chart", params={"rank": 0, "host": "sim-host",
                                                               "fields": ",".join(FIELDS), "points": 600}).json()
    want = expected_layers(doc)
    assert set(traces) == set(want)  # rank 0 shares its GPU with no other process: no such layer
    for name, ys in want.items():
        assert traces[name]["y"] == pytest.approx(ys, rel=1e-9), name
    # the optimizer state doubled at step 700 (sent once then): the chart carries both values forward
    opt = traces["optimizer state"]["y"]
    assert opt[-1] == pytest.approx(2 * opt[0])
    note = p.text_content("#categories-note") or ""
    assert note.startswith("Rank 0 now: parameters ") and "optimizer state" in note
    assert page.errors == []


def test_the_advice_panel_lists_the_remedies_largest_first(collector: dict[str, Any], page: Page) -> None:
    url = collector["url"]
    advice = httpx.get(f"{url}/api/v1/runs/{RUN}/advice").json()
    p = page.page
    p.goto(run_url(url, RUN))
    page.ready()
    p.wait_for_selector("#remedies-table tbody tr", timeout=30_000)
    cells = "rs => rs.map(r => [r.dataset.remedy, ...Array.from(r.cells).map(c => c.textContent)])"
    rows = p.eval_on_selector_all("#remedies-table tbody tr", cells)
    assert [r[0] for r in rows] == [r["remedy"] for r in advice["remedies"]]
    for row, r in zip(rows, advice["remedies"], strict=True):
        after = r["tokens_per_step_after"]
        assert row[3] == (f"{after:,}" if after is not None else "—") and row[4] == r["costs"] and row[5] == r["basis"]
    assert "Inputs: rank 0's step peaks follow the longest sequence" in p.text_content("#advice-remedies")
    assert page.errors == []


def test_the_report_renders_the_chart_and_the_remedies(collector: dict[str, Any], browser: Any, tmp_path: Any) -> None:
    from vramwatch.report import report_data, write_report

    out = tmp_path / "report.html"
    write_report(collector["db"], RUN, out)
    embedded = report_data(collector["db"], RUN)["advice"]
    page = Page(browser)
    try:
        p = page.page
        p.goto(out.as_uri())
        page.ready()
        p.wait_for_selector("#remedies-table tbody tr", timeout=30_000)
        shown = p.eval_on_selector_all("#remedies-table tbody tr", "rs => rs.map(r => r.dataset.remedy)")
        assert shown == [r["remedy"] for r in embedded["remedies"]]
        p.locator("#cat-panel").scroll_into_view_if_needed()
        p.wait_for_function("(document.getElementById('chart-categories')?.data || []).length >= 6", timeout=30_000)
        assert {t["name"] for t in chart_traces(p, "chart-categories")} >= {"parameters", "gradients",
                                                                             "optimizer state"}
        assert page.errors == []
    finally:
        page.close()
