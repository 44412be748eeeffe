"""An OOM seen from device memory alone, end to end through a real collector (uvicorn + SQLite on
disk): device-only samples (what dcgm-exporter gives: device used and capacity, no allocator fields,
no OOM counter) of rank 0 climbing to near full, then its memory vanishing; rank 1 flat beside it.
The post-mortem names one incident whose cause is the suspected OOM with the engine's numbers,
``/metrics`` counts it per rank as suspected, and no confirmed-OOM count moves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import NDJSON_HEADERS, ndjson
from incident_runs import DEVICE_OOM_T, TOTAL, device_oom
from prometheus_client.parser import text_string_to_metric_families

from vramwatch import wire
from vramwatch.collector.server import BackgroundServer
from vramwatch.collector.store import Store
from vramwatch.evidence import postmortem
from vramwatch.units import capacity, gib
from vramwatch.verdicts import STATES

GiB = 1 << 30
RUN = "dcgm-oom"


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    db = tmp_path_factory.mktemp("suspected") / "vw.db"
    trace = [wire.validate(s) for s in device_oom(RUN, end=time.time() - 1)]
    with BackgroundServer(str(db)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        resp = client.post("/api/v1/samples", content=ndjson(trace), headers=NDJSON_HEADERS)
        assert resp.status_code == 200, resp.text
        yield srv.url, trace


def _metric(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by rank."""
    return {s.labels["rank"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name and s.labels.get("run") == RUN}


def test_the_suspected_oom_is_an_incident_with_the_engines_numbers_and_never_a_confirmed_oom(
        collector: tuple[str, list[dict[str, Any]]]) -> None:
    url, trace = collector
    events = httpx.get(f"{url}/api/v1/runs/{RUN}/events", params={"rank": 0}, timeout=60).json()
    (said,) = [e for e in events if e["type"] == "suspected_oom"]
    assert said["reason"] in ("near_full", "top_of_climb")
    assert said["used_before_bytes"] > 0.9 * TOTAL and said["used_after_bytes"] < GiB
    assert abs(said["ts"] - trace[0]["ts"] - DEVICE_OOM_T) <= 600  # within a few blocks of the vanish
    assert not [e for e in httpx.get(f"{url}/api/v1/runs/{RUN}/events", params={"rank": 1}).json()
                if e["type"] in ("oom", "suspected_oom")]

    pm = httpx.get(f"{url}/api/v1/runs/{RUN}/postmortem", timeout=60).json()
    (inc,) = pm["incidents"]
    assert (inc["kind"], inc["cause"], inc["rank"], inc["step"], inc["ts"]) == (
        "suspected_oom", "suspected_oom", 0, said["step"], said["ts"])
    finding = inc["finding"]
    assert (finding["used_before_bytes"], finding["used_after_bytes"], finding["total_bytes"], finding["reason"]) == (
        said["used_before_bytes"], said["used_after_bytes"], TOTAL, said["reason"])
    assert finding["headroom_bytes"] == TOTAL - said["used_before_bytes"]
    assert 1.5 * GiB < finding["headroom_bytes"] < 3.5 * GiB  # the climb met the card ~2 GiB short of full
    for words in ("a suspected OOM", gib(said["used_before_bytes"]), gib(said["used_after_bytes"]),
                  capacity(TOTAL), gib(finding["headroom_bytes"]), "no OOM counter to confirm it"):
        assert words in inc["text"], (words, inc["text"])
    assert "ran out of memory" not in inc["text"] and "Not restarted" not in inc["text"]
    actions = [n["action"] for n in pm["next"]]
    assert actions == ["capture_snapshots", "back_off", "set_allocator"]
    assert all(gib(said["used_before_bytes"]) in n["text"] for n in pm["next"][:2])
    assert pm["next"][0]["command"] == f"vramwatch capture {RUN} --rank 0"
    # never a confirmed OOM: no first failure, no OOM in the counts, the run still runs
    assert pm["first_failure"] is None and pm["tally"]["ooms"] == 0 and pm["status"] == "running"
    assert [r["ooms"] for r in pm["ranks"]] == [0, 0]
    # the CLI's text says the same sentence
    assert f"incident 1: {postmortem.when(inc['ts'])}: {inc['text']}" in postmortem.render_text(
        postmortem.from_dict(pm))

    row = next(r for r in httpx.get(f"{url}/api/v1/runs", timeout=60).json() if r["run"] == RUN)
    assert (row["incidents"], row["ooms"], row["status"]) == (1, 0, "running")
    ranks = {r["rank"]: r for r in httpx.get(f"{url}/api/v1/runs/{RUN}/ranks", timeout=60).json()}
    assert (ranks[0]["suspected_ooms"], ranks[1]["suspected_ooms"]) == (1, 0)
    assert ranks[0]["liveness"] == ranks[1]["liveness"] == "live"
    assert ranks[0]["severity"] - ranks[1]["severity"] >= len(STATES) - 1  # the suspected OOM sorts as an OOM

    text = httpx.get(f"{url}/metrics", timeout=60).text
    assert _metric(text, "vramwatch_suspected_ooms_total") == {"0": 1.0, "1": 0.0}
    assert _metric(text, "vramwatch_ooms_total") == {"0": 0.0, "1": 0.0}
    assert _metric(text, "vramwatch_last_suspected_oom_timestamp_seconds") == {"0": said["ts"]}
    assert _metric(text, "vramwatch_last_oom_timestamp_seconds") == {}
    assert "inferred from device memory alone" in text


def test_the_cli_postmortem_of_the_samples_alone_tells_the_same_incident(
        collector: tuple[str, list[dict[str, Any]]]) -> None:
    """No collector's judgement to read: the post-mortem's own engines suspect it and tell the fold."""
    url, trace = collector
    api = httpx.get(f"{url}/api/v1/runs/{RUN}/postmortem", timeout=60).json()
    pm = postmortem.build(RUN, lambda: iter(trace), now=trace[-1]["ts"] + 1)
    assert pm.incidents == api["incidents"] and pm.next == api["next"]
    assert pm.tally["ooms"] == 0 and pm.first_failure is None


def test_a_restarted_collector_counts_the_suspected_oom_without_a_replay(tmp_path) -> None:
    """The suspected OOM is kept in the store (SQLite on disk): a collector restarted on the same
    file counts it once on /metrics (the replay's and the store's are one moment); still once after
    retention took the climb's samples, so that the replay no longer sees it; and a run retired at
    start-up (not replayed, its page never opened) counts it in its runs row and tally."""
    db = str(tmp_path / "vw.db")
    trace = [wire.validate(s) for s in device_oom(RUN, end=time.time() - 1)]
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.post("/api/v1/samples", content=ndjson(trace), headers=NDJSON_HEADERS).status_code == 200
        (said,) = [e for e in client.get(f"/api/v1/runs/{RUN}/events", params={"rank": 0}).json()
                   if e["type"] == "suspected_oom"]
        row = next(r for r in client.get("/api/v1/runs").json() if r["run"] == RUN)
        assert (row["suspected_ooms"], row["tally"]["suspected_ooms"], row["ooms"]) == (1, 1, 0)
    with BackgroundServer(db) as srv:  # start-up replays the run and reads the store: one moment, counted once
        assert _metric(httpx.get(f"{srv.url}/metrics").text, "vramwatch_suspected_ooms_total") == {"0": 1.0, "1": 0.0}

    vanished = trace[0]["ts"] + DEVICE_OOM_T
    store = Store(db)
    try:  # retention takes every sample up to two minutes after the vanish: the climb is gone
        store.retain(vanished + 120)
        left = [s for s in store.iter_samples(RUN) if s["rank"] == 0]
    finally:
        store.close()
    assert left and max(s["nvml_used_bytes"] for s in left) < GiB  # what is left never climbed
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert not [e for e in client.get(f"/api/v1/runs/{RUN}/events", params={"rank": 0}).json()
                    if e["type"] == "suspected_oom"], "the replay itself no longer suspects it"
        assert _metric(client.get("/metrics").text, "vramwatch_suspected_ooms_total") == {"0": 1.0, "1": 0.0}
        assert _metric(client.get("/metrics").text, "vramwatch_last_suspected_oom_timestamp_seconds") == {
            "0": said["ts"]}
        ranks = {r["rank"]: r for r in client.get(f"/api/v1/runs/{RUN}/ranks").json()}
        assert (ranks[0]["suspected_ooms"], ranks[1]["suspected_ooms"]) == (1, 0)

    time.sleep(max(0.0, trace[-1]["ts"] + 2.5 - time.time()))
    with BackgroundServer(db, finished_after_s=1.0) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.get("/healthz").json()["series"] == 0  # retired: not replayed
        row = next(r for r in client.get("/api/v1/runs").json() if r["run"] == RUN)
        assert (row["suspected_ooms"], row["tally"]["suspected_ooms"], row["ooms"], row["tally"]["ooms"]) == (
            1, 1, 0, 0)
        assert client.get("/healthz").json()["series"] == 0  # the runs list opened no page
        pm = client.get(f"/api/v1/runs/{RUN}/postmortem").json()  # its page, rebuilt on demand, says the same
        assert pm["tally"]["suspected_ooms"] == 1 and [i["kind"] for i in pm["incidents"]] == ["suspected_oom"]
