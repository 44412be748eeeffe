"""Every reader tells one story of a run's life, live and the morning after.

Each ending (tests/endings.py: a clean exit on every rank, a job killed at once, one rank killed
while the rest finish, an OOM then a restart then a clean finish, an OOM on every rank, the
collector restarted mid-run) is built three ways on a real collector (uvicorn on loopback,
SQLite on disk): posted live; then the collector restarted (start-up replays it); then restarted
with a short ``finished_after_s`` (the run is retired and judged from the store's records, its
ranks rebuilt on demand); and once more from ``vramwatch import`` of a trace file. After each,
``/api/v1/runs``, ``/api/v1/runs/{run}/ranks``, the post-mortem (API and CLI), the report's data
and ``/metrics`` must say the same: the run's status, and per rank its liveness, how its latest
process died, its OOMs and restarts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from endings import ENDINGS, STEPS, Ending, collector_restart
from helpers import NDJSON_HEADERS, ndjson
from prometheus_helpers import exposed_samples

from vramwatch import report
from vramwatch.collector.server import BackgroundServer
from vramwatch.wire import write_file

RankView = dict[int, tuple[str, str | None, int, int]]  # rank -> (liveness, died cause, ooms, restarts)


def expected(ending: Ending) -> tuple[str, RankView]:
    ranks = {r: (ending.liveness[r], ending.died[r], ending.ooms.get(r, 0), ending.restarts.get(r, 0))
             for r in ending.liveness}
    return ending.status, ranks


def _cause(died: dict | None) -> str | None:
    return None if died is None else died["cause"]


def readers(url: str, db: str, run: str, *, on_metrics: bool = True) -> dict[str, tuple[str | None, RankView]]:
    """What each reader says: (run status, {rank: (liveness, died cause, ooms, restarts)}).
    ``on_metrics``: the run is still on /metrics (else it has aged out: no series of it at all)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        (row,) = [r for r in client.get("/api/v1/runs").json() if r["run"] == run]
        ranks = client.get(f"/api/v1/runs/{run}/ranks").json()
        pm = client.get(f"/api/v1/runs/{run}/postmortem").json()
        metrics = exposed_samples(client.get("/metrics").text)
    by_rank = {r["rank"]: (r["liveness"], _cause(r["died"]), r["ooms"], r["restarts"]) for r in ranks}
    out = {
        "/ranks": (row["status"], by_rank),
        "/runs": (row["status"], {r: (v[0], v[1], v[2], v[3]) for r, v in by_rank.items()}
                  if (row["ooms"], row["restarts"], row["dead_ranks"]) == (
                      sum(v[2] for v in by_rank.values()), sum(v[3] for v in by_rank.values()),
                      sum(v[0] == "dead" for v in by_rank.values())) else {}),
        "postmortem": (pm["status"], {r["rank"]: (r["liveness"], _cause(r["died"]), r["ooms"], r["restarts"])
                                      for r in pm["ranks"]}),
    }
    data = report.report_data(db, run)
    out["report"] = (data["runs"][0]["status"], {r["rank"]: (r["liveness"], _cause(r["died"]), r["ooms"], r["restarts"])
                                                 for r in data["ranks"]})
    if "postmortem" in data:
        assert data["postmortem"]["status"] == data["runs"][0]["status"]
    if on_metrics:
        out["/metrics"] = (row["status"], _metric_ranks(metrics, run, by_rank))
    else:
        assert not [m for m in metrics if m[1].get("run") == run]
    return out


def _metric_ranks(metrics: list, run: str, by_rank: RankView) -> RankView:
    """/metrics per rank: its counters, and running (1) exactly when the API's liveness is live/silent."""
    values: dict[tuple[str, int], float] = {}
    for name, labels, value in metrics:
        if labels.get("run") == run and name in ("vramwatch_ooms_total", "vramwatch_restarts_total",
                                                 "vramwatch_rank_running", "vramwatch_trend_state"):
            values[(name, int(labels["rank"]))] = value
    out = {}
    for rank, (liveness, cause, _, _) in by_rank.items():
        running = values.get(("vramwatch_rank_running", rank))
        state_shown = ("vramwatch_trend_state", rank) in values
        agrees = running == float(liveness in ("live", "silent")) and state_shown == bool(running)
        out[rank] = (liveness if agrees else f"/metrics running={running}", cause,
                     int(values.get(("vramwatch_ooms_total", rank), -1)),
                     int(values.get(("vramwatch_restarts_total", rank), -1)))
    return out


def cli_postmortem(db: str, run: str) -> tuple[str, RankView, dict | None]:
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "postmortem", run, "--db", db, "--json"],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    return doc["status"], {r["rank"]: (r["liveness"], _cause(r["died"]), r["ooms"], r["restarts"])
                           for r in doc["ranks"]}, doc["first_failure"]


def assert_all_agree(url: str, db: str, ending: Ending, how: str, *, on_metrics: bool = True) -> None:
    run = ending.samples[0]["run"]
    want = expected(ending)
    said = readers(url, db, run, on_metrics=on_metrics)
    for reader, view in said.items():
        assert view == want, f"{ending.name}, {how}: {reader} says {view}, the model says {want}"
    with httpx.Client(base_url=url, timeout=30) as client:
        first = client.get(f"/api/v1/runs/{run}/postmortem").json()["first_failure"]
    got = None if first is None else (first["rank"], first["cause"])
    assert got == ending.first_failure, (ending.name, how, first)


def post(url: str, samples: list[dict]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(0, len(samples), 2000):
            r = client.post("/api/v1/samples", content=ndjson(samples[i:i + 2000]), headers=NDJSON_HEADERS)
            assert r.status_code == 200, r.text


def _ended_long_enough(build: Callable[..., Ending]) -> Ending:
    """The ending with sample times such that the run ended more than the silence window ago."""
    return build(t0=time.time() - STEPS - 120 - 400)


@pytest.mark.parametrize("build", [b for b in ENDINGS if b is not collector_restart], ids=lambda b: b.__name__)
def test_every_reader_agrees_live_after_a_restart_and_after_import(tmp_path: Path, build) -> None:
    ending = _ended_long_enough(build)
    run = ending.samples[0]["run"]
    db = str(tmp_path / "live.db")
    with BackgroundServer(db) as srv:
        post(srv.url, ending.samples)
        assert_all_agree(srv.url, db, ending, "live")
    with BackgroundServer(db) as srv:  # start-up replays the run
        assert_all_agree(srv.url, db, ending, "after a restart")
    with BackgroundServer(db, finished_after_s=60.0) as srv:  # retired: judged from the store's records
        assert_all_agree(srv.url, db, ending, "retired after a restart", on_metrics=False)
        assert httpx.get(f"{srv.url}/healthz").json()["series"] == 0

    trace = tmp_path / f"{run}.jsonl"
    write_file(str(trace), ending.samples)
    imported = str(tmp_path / "imported.db")
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "import", str(trace), "--db", imported],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    status, ranks, first = cli_postmortem(imported, run)
    assert (status, ranks) == expected(ending), (ending.name, "CLI after import")
    assert (None if first is None else (first["rank"], first["cause"])) == ending.first_failure
    with BackgroundServer(imported) as srv:
        assert_all_agree(srv.url, imported, ending, "imported")


def test_every_reader_agrees_when_the_collector_restarts_mid_run(tmp_path: Path) -> None:
    ending = collector_restart()
    # live sample times: the run's 900 steps squeezed into 360 s, the first half ending now
    now = time.time()
    ending.samples = [{**s, "ts": now - 180 + (s["ts"] - ending.samples[0]["ts"]) * 0.4} for s in ending.samples]
    db = str(tmp_path / "vw.db")
    ordered = sorted(ending.samples, key=lambda s: s["ts"])
    half = len(ordered) // 2
    with BackgroundServer(db) as srv:
        post(srv.url, ordered[:half])
        rows = httpx.get(f"{srv.url}/api/v1/runs/{ending.samples[0]['run']}/ranks").json()
        assert {r["liveness"] for r in rows} == {"live"}
    with BackgroundServer(db) as srv:  # restarted mid-run: the replay, then the rest of the run
        rows = httpx.get(f"{srv.url}/api/v1/runs/{ending.samples[0]['run']}/ranks").json()
        assert {r["liveness"] for r in rows} == {"live"} and {r["restarts"] for r in rows} == {0}
        post(srv.url, ordered[half - 100:])  # the hooks resend what they were not sure of
        assert_all_agree(srv.url, db, ending, "collector restarted mid-run")
    with BackgroundServer(db) as srv:
        assert_all_agree(srv.url, db, ending, "collector restarted mid-run, then again")
