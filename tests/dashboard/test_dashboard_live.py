"""Live in seconds, by keyboard and on a phone, in headless Chromium against a real collector:
a job that stopped reads "job stopped" with its banner, rank rows open with Enter past a skip
link, the status is words at 390 px, and the heatmap can colour each rank against itself."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest
from test_dashboard import Page, browser, run_url  # noqa: F401  (browser: a fixture)

from vramwatch.collector.server import BackgroundServer

GiB = 2**30
TOTAL = 140 * GiB
STOPPED_RUN, HEAT_RUN = "job-stopped", "rank0-heavier"


def _samples(run: str, ranks: int, steps: int, end_ts: float, extra_rank0: int = 0) -> list[dict[str, Any]]:
    out = []
    for i in range(steps):
        for r in range(ranks):
            held = 60 * GiB + (extra_rank0 if r == 0 else 0) + (i % 7) * 2**20
            out.append({"schema": 2, "run": run, "host": "node-0", "rank": r, "step": i, "phase": "train",
                        "ts": end_ts - (steps - 1 - i) + r * 0.01, "step_time_s": 1.0 if i else None,
                        "allocated_bytes": held, "reserved_bytes": held + GiB, "peak_allocated_bytes": held + GiB // 2,
                        "nvml_used_bytes": held + 2 * GiB, "total_bytes": TOTAL, "ooms": 0, "alloc_retries": 0})
    return out


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory):
    with BackgroundServer(str(tmp_path_factory.mktemp("live") / "vw.db")) as server:
        now = time.time()
        body = _samples(STOPPED_RUN, 4, 300, now - 60) + _samples(HEAT_RUN, 4, 300, now, extra_rank0=2 * GiB)
        answer = httpx.post(server.url + "/api/v1/samples", content=b"".join(orjson.dumps(s) + b"\n" for s in body),
                            headers={"content-type": "application/x-ndjson"}, timeout=60)
        assert answer.status_code == 200, answer.text
        yield server.url


def test_a_job_that_stopped_at_one_step_a_second_reads_job_stopped(collector, browser) -> None:  # noqa: F811
    p = Page(browser)
    try:
        p.page.goto(run_url(collector, STOPPED_RUN))
        p.page.wait_for_function("document.getElementById('live-text').textContent.startsWith('job stopped')")
        banner = p.page.locator("#job-banner")
        assert banner.is_visible() and "without a clean close" in banner.text_content()
        assert "silence window 30 s" in banner.text_content()
        assert not p.errors, p.errors
    finally:
        p.close()


def test_rank_rows_open_with_the_keyboard_past_a_skip_link(collector, browser) -> None:  # noqa: F811
    p = Page(browser)
    try:
        p.page.goto(run_url(collector, HEAT_RUN))
        p.ready()
        p.page.keyboard.press("Tab")
        assert p.page.evaluate("document.activeElement.id") == "skip"
        p.page.keyboard.press("Enter")
        first = p.page.evaluate("document.activeElement.dataset.rank")
        assert first is not None and p.page.evaluate("document.activeElement.closest('#verdict-strip') !== null")
        p.page.keyboard.press("Tab")  # the row's compare box
        p.page.keyboard.press("Tab")  # the next row
        second = p.page.evaluate("document.activeElement.dataset.rank")
        assert second is not None and second != first
        p.page.keyboard.press("Enter")
        p.page.wait_for_function(f"location.hash.includes('rank={second}')")
    finally:
        p.close()


def test_at_390_px_the_status_is_words_and_the_runs_state_column_is_on_screen(collector, browser) -> None:  # noqa: F811
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    try:
        page.goto(run_url(collector, STOPPED_RUN))
        page.wait_for_function("document.getElementById('live-text').textContent.startsWith('job stopped')")
        box = page.locator("#live-text").bounding_box()
        assert box is not None and box["width"] > 40 and box["x"] + box["width"] <= 390
        page.goto(collector + "/#/")
        page.wait_for_selector("#runs-table tbody tr")
        state = page.locator("#runs-table thead th").nth(4).bounding_box()
        status = page.locator("#runs-table tbody tr td").nth(1).bounding_box()
        assert state is not None and state["x"] + state["width"] <= 390, state
        assert status is not None and status["x"] + status["width"] <= 390
    finally:
        context.close()


def test_the_heatmap_colours_a_heavier_rank_0_against_its_own_baseline(collector, browser) -> None:  # noqa: F811
    p = Page(browser)
    try:
        p.page.goto(run_url(collector, HEAT_RUN))
        p.ready()
        p.page.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1")
        rows = "document.getElementById('chart-heatmap').data[0].z.map(r => r.filter(v => v !== null))"
        vs_run = p.page.evaluate(rows)
        assert max(vs_run[0]) < -0.5  # rank 0 holds 2 GiB more than its peers: red against the run
        p.page.click("button[data-field='baseline']")
        p.page.wait_for_function("document.getElementById('chart-heatmap').layout.uirevision.endsWith('baseline')")
        vs_own = p.page.evaluate(rows)
        assert all(abs(v) < 0.05 for v in vs_own[0])  # neutral against itself
        assert "own median" in p.page.locator("#heatmap-note").text_content()
    finally:
        p.close()
