"""Evidence on the run page (docs/evidence.md), in headless Chromium against a real collector:
the capture button, the snapshot list, the post-mortem panel, and the memory outside
torch / on the host. The run: 4 ranks, 1 s steps, checkpoints every 100; rank 2 stops at
step 200 while the others go on to 599 (killed alone); rank 1 shares its GPU with another
process (2 GiB); every rank reports host memory, higher in its checkpoints. The collector is
restarted on the database so replay makes the silence real (as in test_dashboard_operator)."""

from __future__ import annotations

import gzip
import pickle
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_dashboard import Page, browser, run_url
from test_dashboard_operator import post

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace
from vramwatch.report import report_data, write_report

pytestmark = pytest.mark.browser
__all__ = ["browser"]

GiB = 2**30
RUN = "evidence-4"
DEAD, SHARED = 2, 1
FOREIGN = 2 * GiB


def evidence_run() -> list[dict[str, Any]]:
    base = 1.75e9
    out: list[dict[str, Any]] = []
    for rank in range(4):
        for s in simulate_trace("checkpoint", steps=600, run=RUN, host="node-0", rank=rank, start_ts=base,
                                step_time_s=1.0, ckpt_every=100, seed=rank):
            if rank == DEAD and s["step"] > 200:
                break
            s = dict(s)
            ckpt = s.get("phase", "train") == "checkpoint"
            s["host_rss_bytes"] = (12 + (6 if ckpt else 0) + rank) * GiB
            s["host_children_rss_bytes"] = 3 * GiB
            s["host_available_bytes"] = 400 * GiB
            if rank == SHARED:
                s["foreign_used_bytes"] = FOREIGN
                s["nvml_used_bytes"] = min(s["total_bytes"], s["nvml_used_bytes"] + FOREIGN)
            out.append(s)
    shift = time.time() - 5 - max(s["ts"] for s in out)
    return [{**s, "ts": s["ts"] + shift} for s in out]


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = str(tmp_path_factory.mktemp("evidence") / "vw.db")
    samples = evidence_run()
    with BackgroundServer(db) as first:
        post(first.url, samples)
    with BackgroundServer(db) as server:
        snap = gzip.compress(pickle.dumps({"segments": [], "device_traces": [[]]}))
        up = httpx.post(f"{server.url}/api/v1/snapshots", content=snap, timeout=10,
                        params={"run": RUN, "host": "node-0", "rank": DEAD, "step": 200, "trigger": "oom"})
        assert up.status_code == 201, up.text
        yield {"url": server.url, "db": db, "samples": samples, "snapshot": up.json()}


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    yield p
    p.close()


def test_capture_button_snapshot_list_and_postmortem(evidence: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(evidence["url"], RUN, rank=0))
    page.ready()
    # snapshot list: the uploaded one, with its trigger and a working download link
    p.wait_for_selector("#snapshot-table tbody tr")
    cells = p.eval_on_selector_all("#snapshot-table tbody tr td", "tds => tds.map(t => t.textContent)")
    assert cells[:4] == [str(DEAD), "node-0", "200", "oom"], cells
    assert "MiB" in cells[4]
    href = p.get_attribute("#snapshot-table tbody tr a", "href")
    assert href == evidence["snapshot"]["url"].lstrip("/")
    status = p.evaluate("h => fetch(h).then(r => r.arrayBuffer().then(b => [r.status, b.byteLength]))", href)
    assert status[0] == 200 and status[1] > 0
    assert "pytorch.org/memory_viz" in p.text_content("#evidence-hint")

    # post-mortem: a rank is not live, so the panel shows who failed first and how each ended
    p.wait_for_selector("#postmortem:not([hidden]) #pm-ranks tbody tr")
    api = httpx.get(f"{evidence['url']}/api/v1/runs/{RUN}/postmortem").json()
    assert api["first_failure"]["rank"] == DEAD and api["first_failure"]["cause"] == "silent"
    first = p.text_content("#pm-first")
    assert f"rank {DEAD} on node-0" in first and "silent" in first and f"step {api['first_failure']['step']}" in first
    ends = p.eval_on_selector_all("#pm-ranks tbody tr", "trs => trs.map(t => [t.dataset.rank, t.dataset.end])")
    assert sorted(ends) == sorted([str(r["rank"]), r["end"]] for r in api["ranks"])
    cells_of = "tr => Array.from(tr.cells).map(c => c.textContent)"
    dead_row = p.eval_on_selector(f"#pm-ranks tbody tr[data-rank='{DEAD}']", cells_of)
    assert dead_row[2].startswith("silent") and "oom · step 200" in dead_row[8]
    held = next(r for r in api["ranks"] if r["rank"] == 0)["held_at_failure_bytes"]
    row0 = p.eval_on_selector("#pm-ranks tbody tr[data-rank='0']", cells_of)
    assert held >= 10 * GiB and row0[6] == f"{held / GiB:.1f} GiB"

    # capture for the selected rank: the collector's answer, then a refusal with its detail
    p.fill("#capture-steps", "4")
    p.click("#capture-btn")
    p.wait_for_function("(document.getElementById('capture-result')?.textContent ?? '').startsWith('asked')")
    assert "asked rank 0 for 4 steps" in p.text_content("#capture-result")
    p.click("#capture-btn")
    p.wait_for_function("(document.getElementById('capture-result')?.textContent ?? '').includes('capture pending')")
    p.fill("#capture-steps", "0")
    p.click("#capture-btn")
    p.wait_for_function("document.getElementById('capture-result').classList.contains('bad')")
    text = p.text_content("#capture-result")
    assert text.startswith("capture refused (422)") and "steps" in text, text
    # the directive really waits for rank 0: its next ingest reply carries it
    reply = httpx.post(f"{evidence['url']}/api/v1/samples", headers={"content-type": "application/x-ndjson"},
                       content=(__import__("orjson").dumps({**evidence["samples"][-1], "rank": 0, "step": 10_000,
                                                           "ts": time.time()}) + b"\n")).json()
    assert [(d["trigger"], d["steps"]) for d in reply["directives"]] == [("manual", 4)]
    # the only console error is the browser's own line for the refused (422) request
    assert [e for e in page.errors if "status of 422" not in e] == []
    assert len(page.errors) == 1


def test_memory_split_and_host_panel(evidence: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(evidence["url"], RUN, rank=SHARED))
    page.ready()
    p.wait_for_selector("#mem-panel:not([hidden]) #chart-device-split .main-svg")
    traces = p.evaluate("document.getElementById('chart-device-split').data.map(t => [t.name, t.y[t.y.length - 1]])")
    names = [n for n, _ in traces]
    assert names == ["allocator reserved (this process)", "outside the allocator (context, NCCL, workspaces)",
                     "other processes on this GPU"]
    last = next(s for s in reversed(evidence["samples"]) if s["rank"] == SHARED and s.get("phase", "train") == "train")
    vals = dict(traces)
    assert vals["other processes on this GPU"] == pytest.approx(FOREIGN / GiB)
    assert vals["allocator reserved (this process)"] == pytest.approx(last["reserved_bytes"] / GiB, rel=0.02)
    outside = last["nvml_used_bytes"] - last["reserved_bytes"] - FOREIGN
    assert vals["outside the allocator (context, NCCL, workspaces)"] == pytest.approx(outside / GiB, rel=0.05, abs=0.05)
    assert "another process holds memory on this training GPU" in p.text_content("#device-split-note")
    host = p.evaluate("document.getElementById('chart-host').data.map(t => [t.name, t.y.length, Math.max(...t.y)])")
    by_name = {n: (k, top) for n, k, top in host}
    assert by_name["trainer RSS"][1] == pytest.approx(13, abs=0.01)  # train samples: 12 + rank
    assert by_name["node available"][1] == pytest.approx(400)
    peaks = by_name["host RSS at checkpoints"]
    assert peaks[0] >= 5 and peaks[1] == pytest.approx(19)  # 12 + 6 + rank, one marker per checkpoint
    assert "highest RSS in a checkpoint: 19.0 GiB" in p.text_content("#host-note")
    assert page.errors == []


def test_panels_without_data_stay_hidden(browser: Any, tmp_path: Any) -> None:
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        post(srv.url, list(simulate_trace("healthy", steps=50, run="plain", host="h", rank=0,
                                          start_ts=time.time() - 60, step_time_s=1.0)))
        page = Page(browser)
        try:
            p = page.page
            p.goto(run_url(srv.url, "plain"))
            page.ready()
            p.wait_for_function("(e => e && !e.hidden)(document.getElementById('snapshot-empty'))")
            p.wait_for_timeout(1500)
            # NVML used and reserved exist (the device split shows); no host fields: that chart hides
            assert p.evaluate("document.getElementById('mem-host-box').hidden")
            assert p.evaluate("document.getElementById('postmortem').hidden")  # every rank live, not crashed
            assert page.errors == []
        finally:
            page.close()


def test_report_has_the_postmortem_and_snapshots(evidence: dict[str, Any], browser: Any, tmp_path: Any) -> None:
    data = report_data(evidence["db"], RUN)
    pm = data["postmortem"]
    assert (pm["first_failure"]["rank"], pm["first_failure"]["cause"]) == (DEAD, "silent")
    assert [s["id"] for s in pm["snapshots"]] == [evidence["snapshot"]["id"]] == [s["id"] for s in data["snapshots"]]
    assert all("last_sample" not in r for r in pm["ranks"])
    out = tmp_path / "evidence.html"
    write_report(evidence["db"], RUN, out)
    page = Page(browser)
    try:
        p = page.page
        p.goto(out.as_uri())
        page.ready()
        p.wait_for_selector("#postmortem:not([hidden]) #pm-ranks tbody tr")
        assert f"First failure: rank {DEAD} on node-0" in p.text_content("#pm-first")
        assert p.eval_on_selector_all("#pm-ranks tbody tr", "trs => trs.map(t => t.dataset.end)").count("silent") >= 1
        # the snapshot is listed; offline there is no link to follow, the cell names where it lives
        p.wait_for_selector("#snapshot-table tbody tr")
        assert p.query_selector("#snapshot-table a") is None
        assert p.query_selector("#capture-btn") is None  # a report asks no rank for anything
        p.wait_for_selector("#mem-panel:not([hidden]) #chart-host .main-svg")
        assert [u for u in page.requests if not u.startswith(("file:", "data:"))] == []
        assert page.errors == []
    finally:
        page.close()
