"""Evidence: capture directives → allocator snapshot → upload → listing, the OOM path, and
the post-mortem, through a real collector (uvicorn + SQLite) and torch's own Python code."""

from __future__ import annotations

import gzip
import inspect
import pickle
from pathlib import Path

import httpx
import orjson
import pytest
import torch
from fakes.fake_snapshot import MiB, fake_allocator_history, snapshot_of
from helpers import GiB, make_sample, ndjson

from vramwatch.collector.server import BackgroundServer
from vramwatch.collector.snapshots.directives import DirectiveBoard, SnapshotError, SnapshotStore
from vramwatch.evidence import postmortem
from vramwatch.evidence.allocator_history import AllocatorHistory
from vramwatch.evidence.capture import CaptureAgent, SnapshotUploader

T0 = 1_760_000_000.0


# ---------------------------------------------------------------- contracts of the fakes
def test_fake_entry_points_match_torch_sources():
    from fakes.fake_snapshot import FakeAllocatorHistory

    source = inspect.getsource(torch.cuda.memory._record_memory_history_impl)
    call = source[source.index("_C._cuda_record_memory_history(") :]
    call = call[call.index("(") + 1 : call.index("\n    )")]
    code = "\n".join(line.split("#")[0] for line in call.splitlines())
    torch_args = [a for a in (part.strip() for part in code.split(",")) if a]
    fake_params = list(inspect.signature(FakeAllocatorHistory.record_memory_history).parameters)[1:]
    assert len(fake_params) == len(torch_args)
    assert "_C._cuda_memorySnapshot(None)" in inspect.getsource(torch.cuda.memory._snapshot)
    import torch._dynamo.trace_rules as rules

    assert "torch._C._cuda_attach_out_of_memory_observer" in inspect.getsource(rules)


def test_fake_snapshot_has_the_documented_shape():
    doc = torch.cuda.memory._snapshot.__doc__
    snap = snapshot_of([MiB, 3 * MiB], [])
    for key in ("segments", "device_traces"):
        assert key in doc and key in snap
    for key in ("address", "total_size", "stream", "segment_type", "allocated_size", "active_size", "blocks"):
        assert f"{key}:" in doc and key in snap["segments"][0]
    for key in ("size", "requested_size", "address", "state", "frames"):
        assert key in snap["segments"][0]["blocks"][0]


# ---------------------------------------------------------------- post-mortem (pure)
def _rank_samples(rank: int, steps: int, *, host: str = "node-1", ooms_at: int | None = None, t0: float = T0,
                  marker: str | None = None) -> list[dict]:
    out = []
    for step in range(steps):
        s = make_sample(step, rank=rank, host=host, ts=t0 + step, ooms=0)
        if ooms_at is not None and step >= ooms_at:
            s["ooms"] = 1
        out.append(s)
    if marker:
        out[-1]["oom_marked" if marker == "oom" else "exit"] = True
    return out


def test_postmortem_names_the_rank_that_was_killed_alone():
    samples = _rank_samples(0, 2000) + _rank_samples(1, 600) + _rank_samples(2, 2000)
    pm = postmortem.build("run-a", lambda: samples, now=T0 + 5000)
    assert pm.first_failure is not None
    assert (pm.first_failure.rank, pm.first_failure.cause, pm.first_failure.step) == (1, "killed", 599)
    assert "killed alone" in pm.first_failure.detail
    assert pm.status == "crashed"
    held = {r.rank: r.held_at_failure_bytes for r in pm.ranks}
    assert held[0] == 125 * GiB and held[2] == 125 * GiB  # NVML used at that moment
    for r in pm.ranks:  # one rule: what a rank held plus its headroom is the device
        if r.held_at_failure_bytes is not None:
            assert r.held_at_failure_bytes + r.headroom_at_failure_bytes == r.last_sample["total_bytes"]


def test_postmortem_prefers_the_oom_over_its_silent_victims():
    # rank 3 OOMs at step 500 and dies; the others hang in the next collective and are killed later
    samples = [s for r in (0, 1, 2) for s in _rank_samples(r, 502)] + _rank_samples(3, 501, ooms_at=500)
    pm = postmortem.build("run-a", lambda: samples, now=T0 + 5000)
    f = pm.first_failure
    assert (f.rank, f.cause, f.step) == (3, "oom", 500)
    ends = {r.rank: r.end for r in pm.ranks}
    assert ends == {0: "stopped", 1: "stopped", 2: "stopped", 3: "oom"}
    assert next(r for r in pm.ranks if r.rank == 3).ooms == 1


def test_postmortem_clean_exit_and_running():
    samples = _rank_samples(0, 100, marker="exit") + _rank_samples(1, 100, marker="exit")
    pm = postmortem.build("run-a", lambda: samples, now=T0 + 10_000)
    assert pm.first_failure is None and pm.status == "finished"
    assert {r.end for r in pm.ranks} == {"exited"} and {r.liveness for r in pm.ranks} == {"exited"}
    live = postmortem.build("run-a", lambda: _rank_samples(0, 100), now=T0 + 120)
    assert live.status == "running" and live.ranks[0].end == "running"


def test_postmortem_counts_an_oom_marked_by_the_observer():
    samples = _rank_samples(0, 50) + _rank_samples(1, 40, marker="oom")
    pm = postmortem.build("run-a", lambda: samples, now=T0 + 10_000)
    assert (pm.first_failure.rank, pm.first_failure.cause) == (1, "oom")
    assert "rank 1" in postmortem.render_text(pm)


# ---------------------------------------------------------------- directive board + store (pure)
def test_board_rate_limits_automatic_triggers_and_fans_out_an_oom():
    board = DirectiveBoard(auto_interval_s=600)
    keys = [("r", "h", i) for i in range(4)]
    leak = {"type": "leak", "run": "r", "host": "h", "rank": 2}
    assert board.on_events([leak], lambda run: keys, now=0) == 1
    assert board.on_events([leak], lambda run: keys, now=10) == 0  # rate-limited
    assert board.on_events([{**leak, "type": "plateau_break", "cause": "checkpoint"}], lambda run: keys, now=900) == 0
    oom = {"type": "oom", "run": "r", "host": "h", "rank": 0}
    assert board.on_events([oom], lambda run: keys, now=20) == 3  # every other rank (rank 2 had one queued)
    got = board.take([("r", "h", 2)], now=30)
    assert sorted(d.trigger for d in got) == ["auto:leak", "auto:oom"]
    assert board.take([("r", "h", 2)], now=30) == []
    fresh = DirectiveBoard()
    fresh.request([keys[3]], steps=5, trigger="manual", now=0)
    assert fresh.take([keys[3]], now=fresh.directive_ttl_s + 1) == []  # expired, never handed out
    with pytest.raises(SnapshotError):
        board.request(keys, steps=0, trigger="manual")


def test_snapshot_store_caps_and_evicts(tmp_path: Path):
    store = SnapshotStore(tmp_path / "snaps", max_snapshot_bytes=4096, max_total_bytes=10_000)
    blob = gzip.compress(b"x" * 100_000)  # ~ 130 bytes
    with pytest.raises(SnapshotError) as err:
        store.save(run="r", host="h", rank=0, step=1, trigger="manual", directive=None, gz=gzip.compress(
            bytes(range(256)) * 64, compresslevel=0))
    assert err.value.status == 413
    with pytest.raises(SnapshotError) as err:
        store.save(run="r", host="h", rank=0, step=1, trigger="manual", directive=None, gz=b"not gzip")
    assert err.value.status == 415
    for i in range(100):
        store.save(run="r", host="h", rank=0, step=i, trigger="manual", directive=None, gz=blob)
    infos = store.list("r")
    assert sum(i.bytes for i in infos) <= 10_000 and infos[-1].step == 99 and infos[0].step > 0


# ---------------------------------------------------------------- end to end through a real collector
def _post(client: httpx.Client, samples: list[dict]) -> dict:
    r = client.post("/api/v1/samples", content=ndjson(samples), headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    return r.json()


def test_capture_directive_to_listing_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client, \
            fake_allocator_history(monkeypatch) as fake:
        t0 = __import__("time").time() - 100
        for rank in (0, 1):
            assert "directives" not in _post(client, [make_sample(0, rank=rank, ts=t0)])
        r = client.post("/api/v1/runs/run-a/capture", json={"rank": 1, "steps": 3})
        assert r.status_code == 200 and r.json()["ranks"] == [1]
        assert client.post("/api/v1/runs/run-a/capture", json={"rank": 7}).status_code == 404
        assert client.post("/api/v1/runs/run-a/capture", json={"steps": 0}).status_code == 422
        assert "directives" not in _post(client, [make_sample(1, rank=0, ts=t0 + 1)])  # not for rank 0
        reply = _post(client, [make_sample(1, rank=1, ts=t0 + 1)])
        assert [d["trigger"] for d in reply["directives"]] == ["manual"]
        assert "directives" not in _post(client, [make_sample(2, rank=1, ts=t0 + 2)])  # handed out once

        agent = CaptureAgent(AllocatorHistory(max_entries=100),
                             SnapshotUploader(srv.url, run="run-a", host="node-1", rank=1))
        agent.offer(reply["directives"] + [{"type": "unknown"}, "junk"])
        agent.on_step(2)  # starts recording
        assert fake.recording and fake.max_entries == 100
        for step in (3, 4):
            fake.alloc(8 * MiB)
            agent.on_step(step)
        assert fake.recording
        agent.on_step(5)  # 3 steps later: snapshot at the step boundary, recording off
        assert not fake.recording
        assert agent.flush(10)
        assert agent.stats()["uploaded"] == 1

        listed = client.get("/api/v1/runs/run-a/snapshots").json()
        assert [(s["rank"], s["step"], s["trigger"]) for s in listed] == [(1, 5, "manual")]
        blob = client.get(listed[0]["url"])
        assert blob.status_code == 200 and "attachment" in blob.headers["content-disposition"]
        snap = pickle.loads(blob.content)
        assert [e["size"] for e in snap["device_traces"][0]] == [8 * MiB, 8 * MiB]
        assert client.get("/api/v1/snapshots/" + "0" * 32).status_code == 404
        bad = client.post("/api/v1/snapshots", params={"run": "r", "host": "h", "rank": 0, "step": 1},
                          content=b"plain")
        assert bad.status_code == 415 and "gzip" in bad.json()["detail"]
        bad = client.post("/api/v1/snapshots", params={"run": "r", "host": "h", "rank": -1, "step": 1},
                          content=gzip.compress(b"x"))
        assert bad.status_code == 422
        assert client.get("/api/v1/runs/run-a/snapshots").json() == listed  # nothing half-written


def test_oom_snapshots_the_failing_rank_and_asks_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client, \
            fake_allocator_history(monkeypatch) as fake:
        t0 = __import__("time").time() - 100
        for rank in range(3):
            _post(client, [make_sample(s, rank=rank, ts=t0 + s) for s in range(5)])
        history = AllocatorHistory()
        agent = CaptureAgent(history, SnapshotUploader(srv.url, run="run-a", host="node-1", rank=0))
        assert AllocatorHistory.attach_oom_observer(lambda *a: agent.on_oom(*a, step=5))
        with pytest.raises(torch.OutOfMemoryError):
            fake.raise_oom(40 * GiB)
        assert agent.flush(10)
        # the hook's last sample carries the risen OOM counter and the observer's mark
        _post(client, [make_sample(5, rank=0, ts=t0 + 5, ooms=1, oom_marked=True)])
        replies = [_post(client, [make_sample(5, rank=r, ts=t0 + 5)]) for r in (1, 2)]
        assert all([d["trigger"] for d in rep["directives"]] == ["auto:oom"] for rep in replies)
        listed = client.get("/api/v1/runs/run-a/snapshots").json()
        assert [(s["rank"], s["trigger"]) for s in listed] == [(0, "oom")]
        snap = pickle.loads(client.get(listed[0]["url"]).content)
        assert snap["vramwatch_oom"]["alloc"] == 40 * GiB

        pm = client.get("/api/v1/runs/run-a/postmortem", params={"silent_after_s": 1}).json()
        assert pm["first_failure"]["rank"] == 0 and pm["first_failure"]["cause"] == "oom"
        assert pm["first_failure"]["step"] == 5 and len(pm["snapshots"]) == 1
        assert {r["rank"]: r["end"] for r in pm["ranks"]}[0] == "oom"
        assert client.get("/api/v1/runs/nope/postmortem").status_code == 404


def test_upload_size_cap_drops_history_first():
    up = SnapshotUploader("http://127.0.0.1:9", run="r", host="h", rank=0, max_bytes=20_000)
    big_history = [{"action": "alloc", "addr": i, "size": i, "stream": 0, "frames": [{"filename": f"f{i}.py",
                   "line": i, "name": f"n{i}"}]} for i in range(5000)]
    gz = up.encode(snapshot_of([MiB], big_history))
    assert pickle.loads(gzip.decompress(gz))["device_traces"] == []
    assert orjson.dumps(len(gz))  # encodes without error, under the cap
    with pytest.raises(ValueError):
        SnapshotUploader("ftp://x", run="r", host="h", rank=0)


# ---------------------------------------------------------------- CLI
def _cli(*argv: str, env: dict | None = None) -> tuple[int, str, str]:
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_postmortem_and_capture_cli(tmp_path: Path):
    db = str(tmp_path / "vw.db")
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        t0 = __import__("time").time() - 3000
        _post(client, _rank_samples(0, 1000, t0=t0) + _rank_samples(1, 200, t0=t0))
        code, out, err = _cli("capture", "run-a", "--rank", "1", "--steps", "4", "--url", srv.url)
        assert code == 0, err
        assert "rank(s) 1" in out
        reply = _post(client, [make_sample(200, rank=1, ts=t0 + 200)])
        assert reply["directives"][0]["steps"] == 4
        code, _, err = _cli("capture", "nope", "--url", srv.url)
        assert code == 2 and "404" in err and err.count("\n") == 1, err
    code, _, err = _cli("capture", "run-a", "--url", "ftp://x")
    assert code == 2 and "--url" in err
    code, _, err = _cli("capture", "run-a", "--url", srv.url)  # collector gone
    assert code == 1 and "cannot reach" in err

    code, out, err = _cli("postmortem", "run-a", "--db", db, "--json")
    assert code == 0, err
    doc = orjson.loads(out)
    assert doc["first_failure"]["rank"] == 1 and doc["first_failure"]["cause"] == "killed"
    assert doc["status"] == "crashed"
    assert [(r["rank"], r["end"]) for r in doc["ranks"]] == [(0, "stopped"), (1, "killed")]
    code, out, _ = _cli("postmortem", "run-a", "--db", db)
    assert code == 0 and "first failure: rank 1" in out
    code, _, err = _cli("postmortem", "nope", "--db", db)
    assert code == 2 and "no run named" in err


# ---------------------------------------------------------------- through the real hook
def test_monitor_runs_a_capture_and_the_oom_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The real Monitor (simulated allocator numbers, torch's history API behind the fake
    C++ entry points): directive in a reply → capture on the training thread → upload; then
    an OOM: snapshot, OOM-marked sample, and the other rank asked for its snapshot."""
    from vramwatch import hook

    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client, \
            fake_allocator_history(monkeypatch) as fake:
        monitors = [hook.init(srv.url, run="live", host="node-1", rank=r, probe="simulated",
                              spool_dir=tmp_path / f"spool{r}", flush_interval_s=0.05) for r in (0, 1)]
        try:
            assert all(vw.capture is not None for vw in monitors)
            for step in range(3):
                for vw in monitors:
                    vw.step(step)
            assert all(vw.flush(10) for vw in monitors)
            assert client.post("/api/v1/runs/live/capture", json={"rank": 0, "steps": 2}).status_code == 200
            step = 3
            deadline = __import__("time").monotonic() + 20
            while not client.get("/api/v1/runs/live/snapshots").json():
                assert __import__("time").monotonic() < deadline, monitors[0].capture.stats()
                for vw in monitors:
                    vw.step(step)
                    fake.alloc(MiB)
                step += 1
                monitors[0].flush(5)
            listed = client.get("/api/v1/runs/live/snapshots").json()
            assert [(s["rank"], s["trigger"]) for s in listed] == [(0, "manual")]
            assert not fake.recording  # history is off again after the capture

            with pytest.raises(torch.OutOfMemoryError):
                fake.raise_oom(80 * GiB)  # both monitors' observers run (one process here)
            assert monitors[0].capture.flush(10)
            for vw in monitors:
                vw.flush(5)
                vw.step(step)  # rank 1's next reply carries the directive the OOM raised
                vw.flush(5)
            oom_snaps = [s for s in client.get("/api/v1/runs/live/snapshots").json() if s["trigger"] == "oom"]
            assert {s["rank"] for s in oom_snaps} == {0, 1}
            pm = client.get("/api/v1/runs/live/postmortem").json()
            assert pm["first_failure"]["cause"] == "oom"
        finally:
            for vw in monitors:
                vw.close()
        assert all(vw.capture.closed for vw in monitors)


def test_snapshots_off_by_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from vramwatch import hook

    monkeypatch.setenv("VRAMWATCH_SNAPSHOTS", "off")
    with fake_allocator_history(monkeypatch):
        vw = hook.init("http://127.0.0.1:9", run="x", probe="simulated", spool_dir=tmp_path)
        try:
            assert vw.capture is None
        finally:
            vw.close(timeout=0.5)


def test_capture_takes_the_dashboards_read_credentials_and_only_json(tmp_path: Path):
    """A cookie-authenticated browser may ask for a capture (read auth), never write samples;
    the capture body must be declared JSON (a cross-site form post cannot, without a preflight)."""
    token = "s3cret-token-for-capture"
    with BackgroundServer(str(tmp_path / "vw.db"), token=token, auth_read=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as client:
        t0 = __import__("time").time() - 100
        assert client.post("/api/v1/samples", content=ndjson([make_sample(0, rank=0, ts=t0)]),
                           headers={"content-type": "application/x-ndjson", "authorization": f"Bearer {token}"}
                           ).status_code == 200
        url = "/api/v1/runs/run-a/capture"
        assert client.post(url, json={"rank": 0, "steps": 2}).status_code == 401  # no credentials
        assert client.get("/", params={"token": token}).status_code == 200  # the browser's cookie
        ok = client.post(url, json={"rank": 0, "steps": 2})
        assert ok.status_code == 200 and ok.json() == {"run": "run-a", "directives": 1, "ranks": [0]}
        form = client.post(url, content=b'{"rank": 0}', headers={"content-type": "text/plain"})
        assert form.status_code == 415 and "content-type" in form.json()["detail"]
        assert client.post(url, data={"rank": "0"}).status_code == 415  # urlencoded form
        assert client.post(url, content=b'{"rank": 0}').status_code == 415  # none declared
        # the cookie still writes nothing
        assert client.post("/api/v1/samples", content=ndjson([make_sample(1, rank=0, ts=t0 + 1)]),
                           headers={"content-type": "application/x-ndjson"}).status_code == 401
    with BackgroundServer(str(tmp_path / "vw.db"), token=token, auth_read=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=10, headers={"authorization": f"Bearer {token}"}) as cli:
        assert cli.post(url, json={"rank": 0}).status_code == 200  # the CLI's bearer token still works
        assert cli.post(url, content=b'{"rank": 0}').status_code == 415


def test_the_capture_agent_keeps_its_own_interval(monkeypatch):
    from vramwatch.evidence import capture as capture_mod
    with fake_allocator_history(monkeypatch) as fake:
        agent = CaptureAgent(AllocatorHistory(max_entries=10), None, min_interval_s=3600)
        agent.offer([{"type": "capture", "steps": 1, "trigger": "manual"}] * 6)  # a collector asking every reply
        for step in range(20):
            fake.alloc(MiB)
            agent.on_step(step)
        assert agent.stats()["captured"] == 1 and len(agent._inbox) == 5  # the others wait their turn
        for _ in range(3):  # an OOM caught and retried in a loop: one snapshot
            agent.on_oom(0, GiB, 0, 0, step=20)
        assert agent.stats()["captured"] == 2 and agent.stats()["too_soon"] == 2
        agent.min_interval_s = 0  # once the interval has passed, the next directive runs
        for step in range(20, 24):
            agent.on_step(step)
        assert agent.stats()["captured"] >= 3
        assert capture_mod.MIN_INTERVAL_S > 0
