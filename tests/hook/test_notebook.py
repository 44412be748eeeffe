"""Notebooks: the incarnation is the process. A cell that calls ``vramwatch.init()`` run again, and
a training loop run again from step 0, continue the same process: no death, no restart, no
thread started twice, no sample taken for a duplicate. A real hook process, a real collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from helpers import stored

_KERNEL = """
import json, sys, threading
import vramwatch
url, spool = sys.argv[1], sys.argv[2]
def cell_init():
    return vramwatch.init(url=url, rank=0, probe="simulated", spool_dir=spool, flush_interval_s=0.1)
def cell_train(vw, n):
    for step in range(n):
        vw.step(step)
    vw.flush(10)
def threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("vramwatch"))
first = cell_init(); cell_train(first, 40); after_first = threads()
second = cell_init(); cell_train(second, 40); after_second = threads()
print(json.dumps({"same": first is second, "run": second.identity["run"], "threads": [after_first, after_second],
                  "incarnation": second.identity["incarnation"]}), flush=True)
second.close()
"""


@pytest.fixture(scope="module")
def kernel(module_collector, tmp_path_factory):
    spool = tmp_path_factory.mktemp("spool")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "VRAMWATCH_", "TORCHELASTIC"))}
    run = subprocess.run([sys.executable, "-c", _KERNEL, module_collector.url, str(spool)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_a_second_init_continues_the_process(kernel) -> None:
    assert kernel["same"] is True
    assert kernel["threads"][0] == kernel["threads"][1] and kernel["threads"][0]


def test_a_loop_run_again_is_one_process_with_every_sample_kept(kernel, module_collector) -> None:
    run = kernel["run"]
    assert stored(str(module_collector.db), run) == 81  # 2 passes x 40 steps + the clean-close marker
    with httpx.Client(base_url=module_collector.url, timeout=30) as client:
        ranks = client.get(f"/api/v1/runs/{run}/ranks").json()
        runs = {r["run"]: r for r in client.get("/api/v1/runs").json()}
        events = client.get(f"/api/v1/runs/{run}/events").json()
    (row,) = ranks
    assert row["restarts"] == 0 and row["deaths"] == 0 and row["died"] is None, row
    assert runs[run]["status"] == "finished", runs[run]
    assert [e for e in events if e.get("type") == "restart"] == []


def test_the_monitor_renders_as_its_runs_live_page(module_collector, tmp_path) -> None:
    """``vw`` as a cell's last line: an iframe of the run's page on the collector it sends to."""
    import re

    import vramwatch

    vw = vramwatch.init(url=module_collector.url, run="nb-one", rank=0, probe="simulated", spool_dir=tmp_path)
    try:
        page = vw._repr_html_()
    finally:
        vw.close()
    (src,) = re.findall(r'<iframe src="([^"]+)"', page)
    assert src == f"{module_collector.url}/#/run/nb-one"
    answer = httpx.get(src.split("#")[0], timeout=30)
    assert answer.status_code == 200 and "<script" in answer.text  # the dashboard, which routes #/run/...
    off = vramwatch.init(url=None, run="nb-two", rank=0, probe="simulated", out_dir=tmp_path)
    try:
        text = off._repr_html_()
    finally:
        off.close()
    assert "<iframe" not in text and "vramwatch serve --host 127.0.0.1" in text and str(tmp_path) in text


def test_the_notebook_view_escapes_what_it_shows() -> None:
    from vramwatch.notebook import live_view

    hostile = '"><script>alert(1)</script>'
    page = live_view('http://h:1/"onload="x', hostile)
    assert "<script>" not in page and 'onload="x' not in page
    assert "%22%3E%3Cscript%3E" in page  # the run in the URL, quoted
    assert "<script>" not in live_view(None, hostile, where="<b>")
