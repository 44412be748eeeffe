"""Incidents through a real collector (uvicorn + SQLite on disk): the post-mortem's ``incidents``,
``open_findings`` and ``next``; ``/runs`` rows count incidents, not per-rank deaths; ``/events``
in time order, each with its time, process and attempt (a step axis that ran twice)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import NDJSON_HEADERS, ndjson
from incident_runs import SCENARIOS, Truth

from vramwatch.collector.server import BackgroundServer

#: every run ended long enough ago to be judged (the silence window is 300 s)
AGO = 4000.0


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, Truth]]]:
    db = tmp_path_factory.mktemp("incidents") / "vw.db"
    truths = {}
    with BackgroundServer(str(db)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for fn in SCENARIOS.values():
            probe = fn()
            span = probe.last_ts - probe.samples[0]["ts"]
            truth = fn(t0=time.time() - AGO - span)
            truths[truth.samples[0]["run"]] = truth
            for i in range(0, len(truth.samples), 20_000):
                resp = client.post("/api/v1/samples", content=ndjson(truth.samples[i:i + 20_000]),
                                   headers=NDJSON_HEADERS)
                assert resp.status_code == 200, resp.text
        yield srv.url, str(db), truths


def test_the_postmortem_tells_each_runs_incidents_and_next_step(collector: tuple[str, str, dict[str, Truth]]) -> None:
    url, _, truths = collector
    for run, truth in truths.items():
        doc = httpx.get(f"{url}/api/v1/runs/{run}/postmortem", timeout=60).json()
        assert [i["kind"] for i in doc["incidents"]] == truth.kinds, run
        assert [i["cause"] for i in doc["incidents"]] == truth.causes, run
        assert [len(i["ranks_affected"]) for i in doc["incidents"]] == truth.ranks_affected, run
        assert [f["kind"] for f in doc["open_findings"]] == truth.open_kinds, run
        actions = [n["action"] for n in doc["next"]]
        assert [a for a in actions if a in truth.next_actions] == truth.next_actions, (run, actions)
        for inc in doc["incidents"]:
            assert set(inc) >= {"kind", "rank", "step", "ts", "phase", "cause", "since_step", "ranks_affected",
                                "restarted", "text"}


def test_runs_rows_count_incidents_not_per_rank_deaths(collector: tuple[str, str, dict[str, Truth]]) -> None:
    url, _, truths = collector
    rows = {r["run"]: r for r in httpx.get(f"{url}/api/v1/runs", timeout=60).json()}
    for run, truth in truths.items():
        assert rows[run]["incidents"] == len(truth.kinds), run
    leak = rows["leak-ckpt"]
    assert leak["deaths"] == 8 and leak["restarts"] == 8 and leak["incidents"] == 1


def test_events_are_in_time_order_with_their_process_and_attempt(collector: tuple[str, str, dict[str, Truth]]
                                                                 ) -> None:
    url, _, _ = collector
    events = httpx.get(f"{url}/api/v1/runs/leak-ckpt/events", params={"rank": 5}, timeout=60).json()
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts) and all(isinstance(t, float) for t in ts)
    oom = next(e for e in events if e["type"] == "oom")
    restart = next(e for e in events if e["type"] == "restart")
    # the restart resumed at an earlier step than the OOM, and still comes after it
    assert restart["step"] < oom["step"] and restart["ts"] > oom["ts"]
    assert oom["attempt"] == 1 and oom["incarnation"] == "a5"
    assert restart["attempt"] == 2 and restart["incarnation"] == "b5"
    again = [e for e in events if e["type"] == "leak" and e["attempt"] == 2]
    assert again and again[0]["step"] <= 1201 + 400  # the restarted process re-found the leak


def test_the_cli_postmortem_json_reads_the_same_from_the_database(collector: tuple[str, str, dict[str, Truth]]
                                                                  ) -> None:
    url, db, _ = collector
    api = httpx.get(f"{url}/api/v1/runs/leak-ckpt/postmortem", timeout=60).json()
    out = subprocess.run([sys.executable, "-m", "vramwatch", "postmortem", "leak-ckpt", "--db", db, "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    doc = json.loads(out.stdout)
    assert doc["incidents"] == api["incidents"] and doc["next"] == api["next"]
    text = subprocess.run([sys.executable, "-m", "vramwatch", "postmortem", "leak-ckpt", "--url", url],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert "incident 1:" in text and "still open: rank 5 leaks" in text and "$ vramwatch capture leak-ckpt" in text


def test_advise_says_no_oom_never_after_one_and_retries_only_when_they_rose(
        collector: tuple[str, str, dict[str, Truth]]) -> None:
    _, db, truths = collector
    for run, truth in truths.items():
        out = subprocess.run([sys.executable, "-m", "vramwatch", "advise", run, "--db", db],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode in (0, 1), out.stderr
        oomed = any(s.get("ooms") or s.get("oom_marked") for s in truth.samples)
        if oomed:
            assert "no OOM" not in out.stdout, (run, out.stdout)
        retried = any((s.get("alloc_retries") or 0) > 0 for s in truth.samples)
        if not retried:
            assert "retries climbing" not in out.stdout, (run, out.stdout)
