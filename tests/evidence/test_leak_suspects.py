"""Leak suspects where the operator looks: the second capture a leak's first snapshot asks for,
the pair's diff through a real collector (and a federating front), the suspects in the
post-mortem (API and CLI text), ``vramwatch snapshots diff`` on files and ids, and a hostile
stored snapshot refused by the collector and the CLI alike."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fakes.fake_snapshot import Alloc, MiB, build_snapshot, fake_allocator_history, user_stack
from helpers import make_sample, ndjson
from test_snapshot_diff import LEAK, PARAMS, _Reduce, leaking_pair

from vramwatch.collector.server import BackgroundServer
from vramwatch.collector.snapshots.directives import DirectiveBoard, SnapshotInfo
from vramwatch.evidence.suspects import FOLLOWUP_STEPS, FOLLOWUP_TRIGGER, SnapshotRef, pick_pairs
from vramwatch.front import FrontSettings, PeerSource, parse_peers
from vramwatch.front.server import BackgroundFront


def _cli(*argv: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", *argv], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _ref(ident: str, step: int, ts: float, trigger: str, rank: int = 0) -> SnapshotRef:
    return SnapshotRef(ident, "node-a", rank, step, ts, trigger)


# ---------------------------------------------------------------- which pair, which capture
def test_pairs_follow_the_leak_verdict_and_the_second_capture():
    refs = [_ref("a", 100, 1.0, "auto:leak"), _ref("b", 125, 2.0, FOLLOWUP_TRIGGER), _ref("c", 900, 3.0, "oom"),
            _ref("m1", 10, 1.0, "manual", rank=1), _ref("m2", 300, 2.0, "manual", rank=1),
            _ref("x1", 10, 1.0, "manual", rank=2), _ref("x2", 15, 2.0, "manual", rank=2)]
    pairs = {new.rank: (old.id, new.id) for old, new in pick_pairs(refs, leaking={("node-a", 1), ("node-a", 2)})}
    # rank 0: leak triggers say it leaks; its second capture is the newest that recorded the leak
    # rank 1: the engine's verdict; rank 2: two snapshots too close together (5 steps)
    assert pairs == {0: ("a", "b"), 1: ("m1", "m2")}
    # a restarted rank (steps went back) is never paired across the restart
    restarted = [_ref("before", 5000, 1.0, "auto:leak"), _ref("after", 40, 2.0, "manual")]
    assert pick_pairs(restarted, leaking=set()) == []


def test_a_leaks_first_snapshot_asks_for_a_second_recorded_over_more_steps():
    board = DirectiveBoard()
    info = SnapshotInfo("0" * 32, "job", "node-a", 3, 100, "auto:leak", None, 1.0, 10)
    assert board.on_snapshot(info) == 1
    (directive,) = board.take([("job", "node-a", 3)])
    assert (directive.trigger, directive.steps) == (FOLLOWUP_TRIGGER, FOLLOWUP_STEPS)
    for trigger in (FOLLOWUP_TRIGGER, "manual", "oom", "auto:fragmentation"):  # no chain, no other trigger
        assert board.on_snapshot(SnapshotInfo("1" * 32, "job", "node-a", 3, 130, trigger, None, 2.0, 10)) == 0


# ---------------------------------------------------------------- through the real hook and collector
def test_a_leaking_rank_is_captured_twice_and_its_leaking_line_named(tmp_path: Path, monkeypatch):
    """The real Monitor on a simulated leaking rank, torch's history API over the fake C++ entry
    points whose snapshot is the fixture's allocator state: the engine's leak verdict asks for
    a snapshot, that one asks for the second, and the collector names the leaking line."""
    from vramwatch import hook

    allocs = [Alloc(4 * MiB, user_stack(*PARAMS)) for _ in range(20)]
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client, \
            fake_allocator_history(monkeypatch):
        monkeypatch.setattr(torch._C, "_cuda_memorySnapshot", lambda _arg: build_snapshot(allocs, cached_bytes=8 * MiB))
        vw = hook.init(srv.url, run="leaky", host="node-a", rank=0, probe="simulated", scenario="fast_leak",
                       spool_dir=tmp_path / "spool", flush_interval_s=0.05)
        try:
            step, deadline = 0, time.monotonic() + 90

            def leak_snapshots() -> list[dict[str, Any]]:
                return [s for s in client.get("/api/v1/runs/leaky/snapshots").json()
                        if s["trigger"] in ("auto:leak", FOLLOWUP_TRIGGER)]

            while step % 25 or len(leak_snapshots()) < 2:
                assert time.monotonic() < deadline, (vw.capture.stats(), client.get("/api/v1/runs/leaky/snapshots"))
                vw.step(step)
                allocs.append(Alloc(2 * MiB, user_stack(*LEAK)))  # the leak: one tensor kept per step
                step += 1
                if step % 25 == 0:
                    vw.flush(5)
                    vw.capture.flush(5)
            old, new = leak_snapshots()
            assert (old["trigger"], new["trigger"]) == ("auto:leak", FOLLOWUP_TRIGGER)
            (suspect,) = client.get("/api/v1/runs/leaky/suspects").json()
            assert (suspect["old"], suspect["new"], suspect["steps"]) == (old["id"], new["id"],
                                                                           new["step"] - old["step"])
            assert suspect["steps"] >= FOLLOWUP_STEPS
            top = suspect["sites"][0]
            assert (top["file"], top["line"], top["function"]) == LEAK
            assert top["blocks_delta"] == suspect["steps"] and top["bytes_delta"] == 2 * MiB * suspect["steps"]
            assert len(suspect["sites"]) == 1  # the parameters did not grow
            diffed = client.get("/api/v1/runs/leaky/snapshots/diff", params={"old": old["id"], "new": new["id"]}).json()
            assert diffed["sites"][0] == top and diffed["steps"] == suspect["steps"]
        finally:
            vw.close()


# ---------------------------------------------------------------- the routes, the post-mortem, the CLI
def _upload(client: httpx.Client, snap: Any, *, step: int, trigger: str, rank: int = 0, run: str = "job",
            raw: bytes | None = None) -> dict[str, Any]:
    body = raw if raw is not None else gzip.compress(pickle.dumps(snap))
    r = client.post("/api/v1/snapshots", content=body, params={"run": run, "host": "node-1", "rank": rank,
                                                                "step": step, "trigger": trigger})
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture
def leaked(tmp_path: Path) -> Any:
    """A collector whose run ``job`` has rank 0 leaking (two snapshots from the leak triggers),
    stopped (a crashed run), and a hostile snapshot stored for rank 1."""
    db = str(tmp_path / "vw.db")
    old, new = leaking_pair()
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        t0 = time.time() - 4000
        for rank in (0, 1):
            samples = [make_sample(s, run="job", rank=rank, ts=t0 + s, pid=100 + rank) for s in range(400)]
            r = client.post("/api/v1/samples", content=ndjson(samples),
                            headers={"Content-Type": "application/x-ndjson"})
            assert r.status_code == 200
        first = _upload(client, old, step=100, trigger="auto:leak")
        second = _upload(client, new, step=400, trigger=FOLLOWUP_TRIGGER)
        marker = tmp_path / "pwned"
        hostile = _upload(client, None, step=390, trigger="manual", rank=1,
                          raw=gzip.compress(pickle.dumps({"segments": [_Reduce(marker)]})))
        yield {"srv": srv, "client": client, "db": db, "ids": (first["id"], second["id"]), "hostile": hostile["id"],
               "marker": marker, "pair": (old, new)}
    assert not marker.exists()


def test_the_diff_route_and_its_refusals(leaked: dict[str, Any]):
    client, (a, b) = leaked["client"], leaked["ids"]
    doc = client.get("/api/v1/runs/job/snapshots/diff", params={"old": a, "new": b, "top": 2}).json()
    assert (doc["old"]["step"], doc["new"]["step"], doc["steps"], doc["sites_total"]) == (100, 400, 300, 4)
    assert [(s["file"], s["line"], s["function"]) for s in doc["sites"]] == [LEAK, (LEAK[0].replace("train", "model"),
                                                                                   41, "forward")]
    assert (doc["sites"][0]["bytes_delta"], doc["sites"][0]["blocks_delta"]) == (60 * MiB, 30)
    refusals = [
        ({"old": a}, 422, "new"),
        ({"old": "f" * 32, "new": b}, 404, "old"),
        ({"old": a, "new": "nope"}, 404, "new"),
        ({"old": a, "new": b, "skip": "[unclosed"}, 422, "skip"),
        ({"old": a, "new": b, "skip": ["x"] * 17}, 422, "skip"),
        ({"old": a, "new": b, "top": 0}, 422, "top"),
        ({"old": a, "new": leaked["hostile"]}, 422, "refused"),
    ]
    for params, status, word in refusals:
        r = client.get("/api/v1/runs/job/snapshots/diff", params=params)
        assert r.status_code == status, (params, r.text)
        assert word in r.text
    other = client.get("/api/v1/runs/another/snapshots/diff", params={"old": a, "new": b})
    assert other.status_code == 404 and "not of run" in other.json()["detail"]
    assert not leaked["marker"].exists()


def test_the_postmortem_names_the_leaking_line(leaked: dict[str, Any]):
    client, srv = leaked["client"], leaked["srv"]
    pm = client.get("/api/v1/runs/job/postmortem").json()
    assert pm["status"] == "crashed"
    (suspect,) = pm["suspects"]  # rank 1 has no pair (and its one snapshot is refused, never loaded)
    assert (suspect["rank"], suspect["steps"], suspect["sites"][0]["file"], suspect["sites"][0]["line"]) == \
        (0, 300, LEAK[0], LEAK[1])
    assert client.get("/api/v1/runs/job/suspects").json() == pm["suspects"]
    line = f"+60.0 MiB in +30 blocks at {LEAK[0]}:{LEAK[1]} in {LEAK[2]}"
    code, out, err = _cli("postmortem", "job", "--url", srv.url)
    assert code == 0, err
    assert "leak suspects on rank 0 (node-1), steps 100 → 400 (300 steps):" in out and line in out
    code, out, err = _cli("postmortem", "job", "--db", leaked["db"])  # offline: the trigger says leak
    assert code == 0 and line in out, err


def test_through_a_federating_front(leaked: dict[str, Any], tmp_path: Path):
    (a, b), srv = leaked["ids"], leaked["srv"]
    with BackgroundServer(str(tmp_path / "other.db")) as other:
        settings = FrontSettings(peers=PeerSource(static=parse_peers(["A=" + srv.url, "B=" + other.url])),
                                 timeout_s=2.0, cache_ttl_s=0.0)
        with BackgroundFront(settings) as front, httpx.Client(base_url=front.url, timeout=60) as client:
            direct = leaked["client"].get("/api/v1/runs/job/snapshots/diff", params={"old": a, "new": b}).json()
            via = client.get("/api/v1/runs/job/snapshots/diff", params={"old": a, "new": b}).json()
            assert via == {**direct, "shard": "A"}
            bad = client.get("/api/v1/runs/job/snapshots/diff", params={"old": a, "new": b, "skip": "[x"})
            assert bad.status_code == 422 and "skip" in bad.text
            assert client.get("/api/v1/runs/job/snapshots/diff", params={"old": a, "new": "e" * 32}).status_code == 404
            (suspect,) = client.get("/api/v1/runs/job/suspects").json()
            assert suspect["shard"] == "A" and suspect["sites"][0]["line"] == LEAK[1]
            pm = client.get("/api/v1/runs/job/postmortem").json()
            assert [s["sites"][0]["line"] for s in pm["suspects"]] == [LEAK[1]]


def test_snapshots_diff_cli_on_files_and_ids(leaked: dict[str, Any], tmp_path: Path):
    old, new = leaked["pair"]
    (tmp_path / "old.pickle").write_bytes(pickle.dumps(old))
    (tmp_path / "new.pickle.gz").write_bytes(gzip.compress(pickle.dumps(new)))
    code, out, err = _cli("snapshots", "diff", str(tmp_path / "old.pickle"), str(tmp_path / "new.pickle.gz"),
                          "--json", "--top", "1")
    assert code == 0, err
    doc = json.loads(out)
    site = doc["sites"][0]
    assert {k: site[k] for k in ("file", "line", "function", "bytes_old", "bytes_new", "bytes_delta",
                                 "blocks_delta")} == {"file": LEAK[0], "line": LEAK[1], "function": LEAK[2],
                                                      "bytes_old": 20 * MiB, "bytes_new": 80 * MiB,
                                                      "bytes_delta": 60 * MiB, "blocks_delta": 30}
    assert len(doc["sites"]) == 1 and doc["cached"]["bytes_delta"] > 0 and isinstance(site["stack"], list)
    a, b = leaked["ids"]
    for where in (("--db", leaked["db"]), ("--url", leaked["srv"].url)):
        code, out, err = _cli("snapshots", "diff", a, b, *where)
        assert code == 0, err
        assert f"{LEAK[0]}:{LEAK[1]} in {LEAK[2]}" in out.splitlines()[2] and "+60.0 MiB" in out.splitlines()[2]
    code, out, _ = _cli("snapshots", "diff", a, b, "--db", leaked["db"], "--skip", "proj/train.py")
    assert code == 0 and f"{LEAK[0]}:{LEAK[1]}" not in out  # skipped: the site moves outward


def test_hostile_snapshots_are_refused_by_the_cli(leaked: dict[str, Any], tmp_path: Path):
    marker = tmp_path / "pwned-by-file"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(_Reduce(marker)))
    good = tmp_path / "good.pickle"
    good.write_bytes(pickle.dumps(build_snapshot([])))
    ids = (leaked["ids"][0], leaked["hostile"])
    cases = [(str(evil), str(good)), (str(good), str(evil)), (*ids, "--db", leaked["db"]),
             (*ids, "--url", leaked["srv"].url)]
    for args in cases:
        code, out, err = _cli("snapshots", "diff", *args)
        assert code == 2 and out == "" and err.count("\n") == 1, (args, err)
        assert "refusing to load a snapshot" in err and "posix.system" in err
    assert not marker.exists() and not leaked["marker"].exists()
    for bad, message in (("nope.pickle", "no such file"), (str(tmp_path), "cannot read")):
        code, _, err = _cli("snapshots", "diff", bad, str(good))
        assert code == 2 and message in err and err.count("\n") == 1
    code, _, err = _cli("snapshots", "diff", str(good), str(good), "--skip", "[")
    assert code == 2 and "skip" in err
