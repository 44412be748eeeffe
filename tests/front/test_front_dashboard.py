"""The dashboard served by the federating front, in headless Chromium: one run over two shards
reads as one run (every rank in the table and the heatmap, the advice panel decided over all
ranks), through the polls that follow the first (where a collector would answer deltas)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from dashboard.test_dashboard import Page, browser, run_url, strip_rows
from helpers import ndjson

from vramwatch.collector.server import BackgroundServer
from vramwatch.front import FrontSettings, PeerSource, parse_peers
from vramwatch.front.server import BackgroundFront
from vramwatch.simulation.tokens import token_trace

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # fixture re-exported for pytest


def test_front_page_shows_one_run_over_two_shards(browser, tmp_path: Path) -> None:
    page = Page(browser)
    with BackgroundServer(str(tmp_path / "a.db")) as a, BackgroundServer(str(tmp_path / "b.db")) as b:
        for shard, ranks in ((a, (0, 1)), (b, (2, 3))):
            samples = [s for r in ranks for s in token_trace("varlen", steps=2600, run="fed", rank=r, seed=r,
                                                             world_size=4)]
            httpx.post(shard.url + "/api/v1/samples", content=ndjson(samples), timeout=60,
                       headers={"Content-Type": "application/x-ndjson"}).raise_for_status()
        settings = FrontSettings(peers=PeerSource(static=parse_peers(["A=" + a.url, "B=" + b.url])), timeout_s=5.0)
        try:
            with BackgroundFront(settings) as front:
                p = page.page
                p.goto(run_url(front.url, "fed"))
                page.ready()
                seen = len([u for u in page.requests if "/ranks" in u])
                # three more table polls: the ones a collector would answer with deltas
                p.wait_for_function("performance.getEntriesByType('resource')"
                                    f".filter(e => e.name.includes('/ranks')).length >= {seen + 3}", timeout=30_000)
                assert sorted(r["rank"] for r in strip_rows(p)) == [0, 1, 2, 3]
                p.wait_for_function("(document.getElementById('chart-heatmap').data || []).length === 1",
                                    timeout=30_000)
                assert p.evaluate("document.getElementById('chart-heatmap').data[0].z.length") == 4
                advice = httpx.get(front.url + "/api/v1/runs/fed/advice").json()
                p.locator("#advice-panel").scroll_into_view_if_needed()
                p.wait_for_function("(() => { const e = document.getElementById('advice-rec');"
                                    " return e !== null && e.textContent.length > 0; })()", timeout=30_000)
                assert p.text_content("#advice-rec") == advice["recommendation"]
                assert p.is_hidden("#banner"), p.text_content("#banner")
                assert page.errors == []
        finally:
            page.close()
