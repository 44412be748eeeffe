"""The live page tells a run's life as the collector's model judges it (headless Chromium
against a real collector): a run whose ranks all closed 40 s ago is not "live" in the top bar
and reads finished; a run that hit an OOM, restarted and finished reads recovered, its
post-mortem names the OOM; times carry their date and the viewer's zone, on the wall-time axis
too."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from endings import STEPS, clean_exit, culprit_and_victims, oom_restart_finish
from test_dashboard import Page, browser, run_url
from test_dashboard_operator import post

from vramwatch.collector.server import BackgroundServer

pytestmark = pytest.mark.browser
__all__ = ["browser"]

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC[+-]\d\d:\d\d"


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with BackgroundServer(str(tmp_path_factory.mktemp("runlife") / "vw.db")) as srv:
        post(srv.url, clean_exit("closed", t0=time.time() - STEPS - 40).samples)  # every rank exited 40 s ago
        post(srv.url, oom_restart_finish("recovered", t0=time.time() - STEPS - 100).samples)
        post(srv.url, culprit_and_victims("victims", t0=time.time() - STEPS - 100).samples)
        yield srv.url


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def test_runs_list_reads_the_models_statuses(collector: str, page: Page) -> None:
    p = page.page
    p.goto(collector + "/#/")
    p.wait_for_selector("#runs-table tbody tr[data-run='recovered']")
    statuses = p.eval_on_selector_all("#runs-table tbody tr", "trs => trs.map(t => [t.dataset.run, "
                                      "t.querySelector('.pill').dataset.status])")
    assert sorted(statuses) == [["closed", "finished"], ["recovered", "recovered"], ["victims", "crashed"]]
    assert "every rank closed cleanly, after an OOM" in p.get_attribute("tr[data-run='recovered'] .pill", "title")
    # no run is running: the top bar does not say live
    p.wait_for_function("document.getElementById('live').dataset.state === 'ended'")
    assert p.text_content("#live-text").startswith("no run running")
    assert re.search(STAMP, p.text_content("#live-text"))
    assert page.errors == []


def test_a_closed_run_is_not_live_and_says_when_it_ended(collector: str, page: Page) -> None:
    p = page.page
    p.goto(run_url(collector, "closed", x="time"))
    page.ready()
    p.wait_for_function("document.getElementById('live').dataset.state === 'ended'")
    text = p.text_content("#live-text")
    assert text.startswith("ended") and re.search(STAMP, text), text
    flags = p.eval_on_selector_all("#verdict-strip tbody tr .flag", "fs => fs.map(f => f.textContent)")
    assert flags.count("exited") == 4
    # every rank ended: the post-mortem says how (no failure), with the viewer's zone stated
    p.wait_for_selector("#postmortem:not([hidden]) #pm-ranks tbody tr")
    assert p.eval_on_selector_all("#pm-ranks tbody tr", "trs => trs.map(t => t.dataset.end)") == ["exited"] * 4
    assert p.text_content("#pm-first").startswith("No failure")
    assert all(re.fullmatch(STAMP, c) for c in p.eval_on_selector_all(
        "#pm-ranks tbody tr td:nth-child(5)", "tds => tds.map(t => t.textContent)"))
    # the wall-time axis states the zone its clock is in
    title = p.evaluate("document.getElementById('chart-rank').layout.xaxis.title.text")
    assert title.startswith("wall time · ") and re.search(r"UTC[+-]\d\d:\d\d", title), title
    assert page.errors == []


def test_an_oom_restart_and_finish_reads_recovered_with_the_oom_first(collector: str, page: Page) -> None:
    p = page.page
    p.goto(run_url(collector, "recovered", rank=1))
    page.ready()
    p.wait_for_selector("#postmortem:not([hidden]) #pm-ranks tbody tr")
    p.wait_for_function("document.querySelector('#postmortem h3').textContent.includes('recovered')")
    first = p.text_content("#pm-first")
    assert "rank 1 on node-1" in first and "oom" in first and re.search(STAMP, first), first
    row = p.eval_on_selector("#pm-ranks tbody tr[data-rank='1']", "tr => tr.cells[2].textContent")
    assert row == "exited · OOM \u00d71 · restart \u00d71"
    flags = p.eval_on_selector("#verdict-strip tbody tr[data-rank='1'] td.state", "td => td.textContent")
    assert "OOM \u00d71" in flags and "restart \u00d71" in flags and "exited" in flags
    assert page.errors == []


def test_a_dead_ranks_last_words_and_its_culprit_are_shown(collector: str, page: Page) -> None:
    p = page.page
    p.goto(run_url(collector, "victims", rank=0))
    page.ready()
    p.wait_for_selector("#postmortem:not([hidden]) #pm-ranks tbody tr")
    first = p.text_content("#pm-first")
    assert "rank 1 on node-1" in first and "oom" in first, first
    assert "3 rank(s) then timed out waiting for it in a collective: 0, 2, 3" in p.text_content("#pm-detail")
    strip = p.eval_on_selector("#verdict-strip tbody tr[data-rank='0']", "tr => tr.textContent")
    assert "collective timeout, waiting for rank 1" in strip, strip
    assert "torch.distributed.DistBackendError: [Rank 0] Watchdog caught collective operation timeout" in strip
    culprit = p.eval_on_selector("#verdict-strip tbody tr[data-rank='1']", "tr => tr.textContent")
    assert "died: OOM" in culprit
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in culprit
    p.wait_for_function("document.getElementById('rank-note').textContent.includes('Its last words')")
    assert "Its last words: torch.distributed.DistBackendError" in p.text_content("#rank-note")
    title = p.get_attribute("#pm-ranks tbody tr[data-rank='0'] .badge", "title")
    assert "NCCL watchdog" in title and "Watchdog caught collective operation timeout" in title, title
    assert page.errors == []
