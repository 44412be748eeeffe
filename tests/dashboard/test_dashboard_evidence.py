"""Evidence on the run page (docs/evidence.md), in headless Chromium against a real collector:
the capture button, the snapshot list, the leak suspects, the post-mortem panel, and the memory
outside torch / on the host with the other process named. The run: 4 ranks, 1 s steps,
checkpoints every 100; rank 2 stops at step 200 while the others go on to 599 (killed alone);
rank 1 shares its GPU with a Jupyter kernel (2 GiB), as its hook reports; rank 3 leaks (its two
snapshots, from the leak triggers, hold a growing allocation site); every rank reports host
memory, higher in its checkpoints. The collector is restarted on the database so replay makes
the silence real (as in test_dashboard_operator)."""

from __future__ import annotations

import gzip
import pickle
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from evidence.test_snapshot_diff import LEAK, leaking_pair
from helpers import ending_at
from test_dashboard import Page, browser, run_url
from test_dashboard_operator import post

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace
from vramwatch.report import report_data, write_report

pytestmark = pytest.mark.browser
__all__ = ["browser"]

GiB = 2**30
RUN = "evidence-4"
DEAD, SHARED, LEAKING = 2, 1, 3
FOREIGN = 2 * GiB
KERNEL_PID = 4242
KERNEL = f"a Jupyter kernel (pid {KERNEL_PID}, ipykernel_launcher) holds 2.0 GiB on GPU 1"


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
    return ending_at(out, time.time() - 5)


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = str(tmp_path_factory.mktemp("evidence") / "vw.db")
    samples = evidence_run()
    with BackgroundServer(db) as first:
        post(first.url, samples)
    with BackgroundServer(db) as server:
        triggers = ("auto:leak", "auto:leak-second")
        ids = [_upload(server.url, snap, rank=LEAKING, step=step, trigger=trigger)["id"]
               for snap, step, trigger in zip(leaking_pair(), (100, 400), triggers, strict=True)]
        oom = _upload(server.url, {"segments": [], "device_traces": [[]]}, rank=DEAD, step=200, trigger="oom")
        kernel = {"pid": KERNEL_PID, "used_bytes": FOREIGN, "name": "python3", "container": "",
                  "cmdline": "/opt/conda/bin/python3 -m ipykernel_launcher -f /root/.local/share/jupyter/kernel-1.json"}
        report = {"run": RUN, "host": "node-0", "rank": SHARED, "ts": time.time(), "gpu": 1, "uuid": None,
                  "processes": [kernel]}
        assert httpx.post(f"{server.url}/api/v1/processes", json=report, timeout=10).status_code == 200
        yield {"url": server.url, "db": db, "samples": samples, "snapshot": oom, "snapshot_ids": [*ids, oom["id"]]}


def _upload(url: str, snap: Any, *, rank: int, step: int, trigger: str) -> dict[str, Any]:
    up = httpx.post(f"{url}/api/v1/snapshots", content=gzip.compress(pickle.dumps(snap)), timeout=10,
                    params={"run": RUN, "host": "node-0", "rank": rank, "step": step, "trigger": trigger})
    assert up.status_code == 201, up.text
    return up.json()


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

    # post-mortem, during the run: a rank died (killed alone while the others go on), so the panel
    # shows who failed first and how each rank's process ended; times carry date and zone
    p.wait_for_selector("#postmortem:not([hidden]) #pm-ranks tbody tr")
    api = httpx.get(f"{evidence['url']}/api/v1/runs/{RUN}/postmortem").json()
    assert api["first_failure"]["rank"] == DEAD and api["first_failure"]["cause"] == "killed"
    assert api["status"] == "running"
    first = p.text_content("#pm-first")
    assert f"rank {DEAD} on node-0" in first and "killed" in first and f"step {api['first_failure']['step']}" in first
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC[+-]\d\d:\d\d", first), first
    assert p.text_content("#pm-zone").startswith("times in ")
    # the top bar: live, since ranks are
    ends = p.eval_on_selector_all("#pm-ranks tbody tr", "trs => trs.map(t => [t.dataset.rank, t.dataset.end])")
    assert sorted(ends) == sorted([str(r["rank"]), r["end"]] for r in api["ranks"])
    cells_of = "tr => Array.from(tr.cells).map(c => c.textContent)"
    dead_row = p.eval_on_selector(f"#pm-ranks tbody tr[data-rank='{DEAD}']", cells_of)
    assert dead_row[2].startswith("killed") and "oom · step 200" in dead_row[8]
    assert p.get_attribute("#live", "data-state") == "live" and "3 of 4 ranks" in p.text_content("#live-text")
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


def test_leak_suspects_and_the_process_on_a_ranks_gpu_by_name(evidence: dict[str, Any], page: Page) -> None:
    p = page.page
    p.goto(run_url(evidence["url"], RUN, rank=SHARED))
    page.ready()
    p.wait_for_selector("#suspects:not([hidden]) .suspect-table tbody tr")
    api = httpx.get(f"{evidence['url']}/api/v1/runs/{RUN}/suspects").json()
    assert len(api) == 1 and api[0]["rank"] == LEAKING
    assert f"rank {LEAKING} · node-0 · steps 100 → 400 (300 steps)" in p.text_content(".suspect-head")
    rows = p.eval_on_selector_all(".suspect-table tbody tr",
                                  "trs => trs.map(t => Array.from(t.cells).map(c => c.textContent))")
    assert rows[0] == [f"{LEAK[0]}:{LEAK[1]}", LEAK[2], "+60.0 MiB", "+30", "20.0 → 80.0 MiB"]
    assert len(rows) == len(api[0]["sites"]) == 1  # only sites that grew are suspects
    assert "train.py:95:train_step" in p.get_attribute(".suspect-table td.site", "title")  # the stack on hover
    # the memory split names the other process on this rank's GPU, in the note and on the chart
    p.wait_for_function("(document.getElementById('device-split-note')?.textContent ?? '').includes('Jupyter')")
    assert KERNEL in p.text_content("#device-split-note")
    assert p.evaluate("document.getElementById('chart-device-split').layout.annotations[0].text") == KERNEL
    # the post-mortem lists it under the rank it shares the GPU with
    p.wait_for_selector("#postmortem:not([hidden]) #pm-foreign li")
    assert p.text_content(f"#pm-foreign li[data-rank='{SHARED}']") == f"rank {SHARED}: {KERNEL}"
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
            page.polled(2)  # every panel asked on the first polls has drawn (or stayed hidden)
            # NVML used and reserved exist (the device split shows); no host fields: that chart hides
            assert p.evaluate("document.getElementById('mem-host-box').hidden")
            assert p.evaluate("document.getElementById('postmortem').hidden")  # every rank live, not crashed
            assert p.evaluate("document.getElementById('suspects').hidden")  # no leaking rank, no pair
            assert page.errors == []
        finally:
            page.close()


def test_report_has_the_postmortem_and_snapshots(evidence: dict[str, Any], browser: Any, tmp_path: Any) -> None:
    data = report_data(evidence["db"], RUN)
    pm = data["postmortem"]
    assert (pm["first_failure"]["rank"], pm["first_failure"]["cause"]) == (DEAD, "killed")
    assert [s["id"] for s in pm["snapshots"]] == evidence["snapshot_ids"] == [s["id"] for s in data["snapshots"]]
    assert [s["sites"][0]["line"] for s in data["suspects"]] == [LEAK[1]]
    assert [p["summary"] for p in data["processes"][0]["processes"]] == [KERNEL]
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
        assert p.eval_on_selector_all("#pm-ranks tbody tr", "trs => trs.map(t => t.dataset.end)").count("killed") == 1
        # the snapshot is listed; offline there is no link to follow, the cell names where it lives
        p.wait_for_selector("#snapshot-table tbody tr")
        assert p.query_selector("#snapshot-table a") is None
        assert p.query_selector("#capture-btn") is None  # a report asks no rank for anything
        p.wait_for_selector("#mem-panel:not([hidden]) #chart-host .main-svg")
        p.wait_for_selector("#suspects:not([hidden]) .suspect-table tbody tr")
        assert p.text_content("#suspects .suspect-table tbody tr td.site") == f"{LEAK[0]}:{LEAK[1]}"
        assert [u for u in page.requests if not u.startswith(("file:", "data:"))] == []
        assert page.errors == []
    finally:
        page.close()
