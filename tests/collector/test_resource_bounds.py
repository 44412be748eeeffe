"""Every resource a client can reach is bounded — connections, live series, responses — and
shutdown tells the truth (the ingest route's own limits: test_ingest.py). Real uvicorn on
loopback, real SQLite, real sockets; each test fails on the collector before the hardening."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import tracemalloc

import httpx
import pytest
from collector_process import CollectorProcess
from helpers import make_sample, ndjson
from prometheus_helpers import need_module

from vramwatch.collector.server import BackgroundServer

NDJSON = {"content-type": "application/x-ndjson"}


def _connect(srv: BackgroundServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything until the server closes; and when it closed (monotonic)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic()


# ------------------------------------------------------------------ connections

#: the guard's two protocols (vramwatch/collector/serving/guard.py): each test below runs on both
PROTOCOLS = ["httptools", "h11"]


def _need(http: str) -> None:
    if http == "httptools":
        need_module("httptools", "httptools")  # the server extra: under CI=true its absence fails


@pytest.mark.parametrize("http", PROTOCOLS)
@pytest.mark.parametrize("how", ["idle", "trickled headers", "trickled body"])
def test_slow_clients_are_cut_off_at_the_read_deadline(tmp_path, how, http) -> None:
    _need(http)
    with BackgroundServer(str(tmp_path / "vw.db"), http=http, header_timeout_s=1.0, body_timeout_s=1.0) as srv:
        sock = _connect(srv)
        started = time.monotonic()
        stop = threading.Event()

        def trickle() -> None:
            if how == "trickled headers":
                for byte in b"POST /api/v1/samples HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                    if stop.wait(0.2):
                        return
                    try:
                        sock.send(bytes([byte]))
                    except OSError:
                        return
            elif how == "trickled body":
                sock.send(b"POST /api/v1/samples HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/x-ndjson\r\nContent-Length: 100000\r\n\r\n")
                for _ in range(100):
                    if stop.wait(0.2):
                        return
                    try:
                        sock.send(b" ")
                    except OSError:
                        return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        reply, closed = _read_all(sock, timeout=8.0)
        stop.set()
        sock.close()
        assert closed - started < 4.0, f"{how}: held for {closed - started:.1f} s"
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert httpx.get(srv.url + "/healthz", timeout=5).status_code == 200


@pytest.mark.parametrize("http", PROTOCOLS)
def test_connection_cap_answers_503_fast_and_healthz_still_answers(tmp_path, caplog, http) -> None:
    _need(http)
    caplog.set_level(logging.WARNING, logger="vramwatch.collector")
    with BackgroundServer(str(tmp_path / "vw.db"), http=http, max_connections=20, health_reserve=2,
                          header_timeout_s=30.0) as srv:
        idle = [_connect(srv) for _ in range(20)]
        time.sleep(0.3)
        # the reserve: /healthz answers, anything else is a 503 naming the cap
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            assert client.get("/healthz").status_code == 200
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            r = client.get("/api/v1/runs")
            assert r.status_code == 503 and "max-connections" in r.json()["detail"]
        # past cap + reserve: 503 at once, then closed
        more = [_connect(srv) for _ in range(3)]
        started = time.monotonic()
        reply, _ = _read_all(more[-1], timeout=5)
        assert reply.startswith(b"HTTP/1.1 503") and time.monotonic() - started < 2.0
        for s in idle + more:
            s.close()
        time.sleep(0.3)
        assert httpx.get(srv.url + "/api/v1/runs", timeout=5).status_code == 200
    refusals = [r for r in caplog.records if "connection cap" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # one rate-limited line
    assert not [r for r in caplog.records if r.exc_info]


def test_accept_failures_are_one_line_not_a_traceback_each(caplog) -> None:
    import asyncio

    from vramwatch.collector.serving.guard import ConnectionGuard
    from vramwatch.collector.settings import Settings

    caplog.set_level(logging.WARNING)
    guard = ConnectionGuard(Settings(db_path="x"))
    loop = asyncio.new_event_loop()
    try:
        for _ in range(500):
            guard.loop_exception(loop, {"message": "socket.accept() out of system resource",
                                        "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None


# ------------------------------------------------------------------ cardinality


def test_quiet_runs_are_evicted_listed_and_revived_on_demand(tmp_path) -> None:
    from vramwatch.collector.state.live import LiveState
    from vramwatch.collector.store import Store

    store = Store(str(tmp_path / "vw.db"))
    samples = [make_sample(i, run=run, rank=r) for run in ("old", "new") for r in range(4) for i in range(20)]
    samples += [{**make_sample(19, run="old", rank=r), "seq": 1, "exit": True} for r in range(4)]  # clean closes
    store.insert(samples)
    live = LiveState()
    live.ingest([s for s in samples if s["run"] == "old"], received_at=1000.0)
    live.ingest([s for s in samples if s["run"] == "new"], received_at=5000.0)
    assert live.evict_quiet(cutoff=2000.0, now=5000.0) == ["old"]
    assert len(live) == 4 and not live.for_run("old")
    runs = {r["run"]: r for r in live.run_summaries(now=5000.0)}
    assert set(runs) == {"old", "new"} and runs["old"]["ranks"] == 4 and runs["old"]["status"] == "finished"
    revived = live.revived("old", store.iter_samples)
    assert [s.rank for s in revived] == [0, 1, 2, 3] and revived[0].last["step"] == 19
    assert live.revived("never", store.iter_samples) == []
    store.close()


def test_resident_cost_of_a_series_outside_its_engine_is_small() -> None:
    from vramwatch.collector.state.live import LiveState

    class NoEngine:
        def update(self, sample):
            return []

    live = LiveState(engine_factory=NoEngine)
    batches = [[make_sample(0, rank=r)] for r in range(2000)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for batch in batches:
        live.ingest(batch)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    per_series = sum(s.size_diff for s in after.compare_to(before, "filename")) / 2000
    # was ~2 KB (dataclass __dict__, an empty 500-slot deque, a set); now ~770 B: the series'
    # slots (~260 B with its key), the run-life fold's rank and process records (~300 B: last
    # words, host memory, suspected OOMs, an open phase) and the indexes; the engine is measured
    # in docs/reliability.md
    assert per_series < 800, per_series


# ------------------------------------------------------------------ shutdown


def test_sigterm_with_hanging_requests_exits_0_without_a_traceback(tmp_path) -> None:
    db = tmp_path / "vw.db"
    with CollectorProcess(db, args=("--shutdown-timeout", "1", "--body-timeout", "60")) as srv:
        hanging = []
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            sock.send(b"POST /api/v1/samples HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/x-ndjson\r\nContent-Length: 1000\r\n\r\n{")
            hanging.append(sock)
        time.sleep(0.5)
        code = srv.terminate(30)
        log = srv.log()
        for sock in hanging:
            sock.close()
    assert code == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "closed cleanly" in log


def test_a_database_that_cannot_be_closed_is_one_line_and_a_nonzero_exit(tmp_path) -> None:
    import subprocess

    script = (
        "import sys\n"
        "from vramwatch.collector import store\n"
        "real = store.Store.close\n"
        "calls = []\n"
        "def full(self):\n"
        "    real(self)\n"
        "    calls.append(1)\n"
        "    if len(calls) > 1:  # the start-up check closes once; the server's close fails\n"
        "        raise store.StoreError('cannot checkpoint: database or disk is full')\n"
        "store.Store.close = full\n"
        "from vramwatch.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, "serve", "--db", str(tmp_path / "vw.db"), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "startup complete" in line:
            break
    proc.terminate()
    rest = proc.communicate(timeout=60)[1]
    err = "".join(lines) + rest
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    assert "disk is full" in err.splitlines()[-1]


# ------------------------------------------------------------------ responses


def test_ranks_compact_is_small_at_1024_ranks_and_delta_polls_only_send_changes(tmp_path) -> None:
    now = time.time()
    samples = [make_sample(i, rank=r, ts=now - 30 + i, host=f"node-{r // 8}") for r in range(1024) for i in range(3)]
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.post("/api/v1/samples", content=ndjson(samples), headers=NDJSON).status_code == 200
        full = client.get("/api/v1/runs/run-a/ranks", headers={"accept-encoding": "identity"})
        compact = client.get("/api/v1/runs/run-a/ranks", params={"compact": 1},
                             headers={"accept-encoding": "identity"})
        assert len(compact.content) <= 200 * 1024, len(compact.content)
        doc = compact.json()
        assert doc["total"] == 1024 and len(doc["rows"]) == 1024 and len(compact.content) < len(full.content) / 5
        row = dict(zip(doc["columns"], doc["rows"][5], strict=True))
        assert row["rank"] == 5 and row["liveness"] == "live" and row["ooms"] == 0 and row["state"] == "warmup"
        assert row["reserved_bytes"] == full.json()[5]["last"]["reserved_bytes"]
        delta = client.get("/api/v1/runs/run-a/ranks", params={"compact": 1, "since": doc["version"]}).json()
        assert delta["rows"] == []
        client.post("/api/v1/samples", content=ndjson([make_sample(3, rank=7, ts=now, host="node-0")]),
                    headers=NDJSON)
        delta = client.get("/api/v1/runs/run-a/ranks", params={"compact": 1, "since": doc["version"]}).json()
        assert [r[1] for r in delta["rows"]] == [7] and delta["version"] > doc["version"]
        page = client.get("/api/v1/runs/run-a/ranks", params={"compact": 1, "limit": 100, "offset": 1000}).json()
        assert [r[1] for r in page["rows"]] == list(range(1000, 1024))
        assert client.get("/api/v1/runs/run-a/ranks", params={"limit": 10**6}).status_code == 422


def test_meta_serves_the_verdict_vocabulary(tmp_path) -> None:
    from vramwatch import verdicts

    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        meta = httpx.get(srv.url + "/api/v1/meta", timeout=10).json()
    assert meta["states"] == list(verdicts.STATES) and meta["severity"] == verdicts.SEVERITY
    assert meta["liveness"] == list(verdicts.LIVENESS) and meta["silent_after_s"] == verdicts.SILENT_AFTER_S


def test_restart_replays_only_running_runs_and_lists_the_rest(tmp_path) -> None:
    from vramwatch.collector.state.live import LiveState
    from vramwatch.collector.state.restore import restore
    from vramwatch.collector.store import Store

    now = time.time()
    store = Store(str(tmp_path / "vw.db"))
    store.insert([make_sample(i, run=f"old-{k}", rank=r, ts=now - 7200 + i) for k in range(50) for r in range(8)
                  for i in range(5)])
    store.insert([{**make_sample(4, run=f"old-{k}", rank=r, ts=now - 7195), "seq": 1, "exit": True}
                  for k in range(50) for r in range(8)])  # every old run closed cleanly
    store.insert([make_sample(i, run="running", rank=r, ts=now - 40 + i) for r in range(4) for i in range(30)])
    built = []

    class CountingEngine:
        def __init__(self) -> None:
            built.append(self)

        def update(self, sample):
            return []

        def summary(self):
            return {"state": "warmup"}

    live = LiveState(engine_factory=CountingEngine)
    done = restore(live, store, cutoff=now - 3600)
    assert done["samples"] == 120 and done["retired_runs"] == 50
    assert len(built) == 4 and len(live) == 4  # only the running run's engines
    runs = {r["run"]: r for r in live.run_summaries(now=now)}
    assert len(runs) == 51 and runs["old-7"]["status"] == "finished" and runs["old-7"]["ranks"] == 8
    assert runs["running"]["status"] == "running"
    assert [s.rank for s in live.revived("old-7", store.iter_samples)] == list(range(8))
    store.close()


def test_a_second_collector_on_the_same_database_refuses_to_start(tmp_path) -> None:
    from vramwatch.collector.store import StoreError

    db = str(tmp_path / "vw.db")
    with BackgroundServer(db), pytest.raises(StoreError, match=r"lock|another"):
        BackgroundServer(db).start()


def test_the_live_sample_count_leaves_out_duplicates(tmp_path) -> None:
    now = time.time()
    batch = ndjson([make_sample(i, ts=now - 50 + i) for i in range(20)])
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        for _ in range(3):  # a replayed spool resends what was already stored
            assert client.post("/api/v1/samples", content=batch, headers=NDJSON).status_code == 200
        assert client.get("/api/v1/runs/run-a/ranks").json()[0]["samples"] == 20
        assert client.get("/api/v1/runs").json()[0]["samples"] == 20


def test_a_burst_of_new_series_does_not_cause_long_gc_pauses() -> None:
    import gc

    from vramwatch.collector.state.live import LiveState

    pauses: list[tuple[float, int]] = []
    started: dict[str, float] = {}

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started["t"], info["generation"]))

    live = LiveState()
    now = time.time()
    gc.callbacks.append(timer)
    try:
        for b in range(8):
            live.ingest([make_sample(0, run=f"r{i // 64}", rank=i % 64, ts=now)
                         for i in range(b * 1000, (b + 1) * 1000)])
    finally:
        gc.callbacks.remove(timer)
        gc.unfreeze()
    # full collections only ever scan the series created since the last freeze (was: all of them)
    full = [p for p, generation in pauses if generation == 2]
    assert not full or max(full) < 0.25, sorted(full)[-3:]


def test_forgetting_a_run_leaves_no_cyclic_garbage() -> None:
    # what makes gc.freeze() safe for engines: evicted state is freed by reference counting
    import gc

    from vramwatch.collector.state.live import LiveState

    live = LiveState()
    for i in range(600):
        live.ingest([make_sample(i, rank=r, ts=1.76e9 + i, phase="checkpoint" if i % 200 == 0 else "train")
                     for r in range(4)])
    gc.collect()
    live.forget(["run-a"])
    assert gc.collect() == 0


def test_a_finished_run_leaves_memory_but_stays_listed_and_readable(tmp_path) -> None:
    now = time.time()
    with BackgroundServer(str(tmp_path / "vw.db"), finished_after_s=1.0, maintenance_interval_s=0.2,
                          checkpoint_interval_s=0.2) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        samples = [make_sample(i, rank=r, ts=now - 40 + i * 0.1) for r in range(4) for i in range(300)]
        samples += [{**make_sample(299, rank=r, ts=now - 10), "seq": 1, "exit": True} for r in range(4)]
        assert client.post("/api/v1/samples", content=ndjson(samples), headers=NDJSON).status_code == 200
        assert client.get("/healthz").json()["series"] == 4
        deadline = time.monotonic() + 10
        while client.get("/healthz").json()["series"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/healthz").json()["series"] == 0  # evicted
        runs = client.get("/api/v1/runs").json()
        assert [(r["run"], r["status"], r["ranks"]) for r in runs] == [("run-a", "finished", 4)]
        ranks = client.get("/api/v1/runs/run-a/ranks").json()  # rebuilt from the database
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and ranks[0]["last_step"] == 299
        assert client.get("/api/v1/runs/run-a/advice").status_code == 200
        assert client.get("/healthz").json()["series"] == 0  # the rebuild is not live state




# ------------------------------------------------------------------ heavy reads


def test_a_burst_of_heavy_reads_gets_503_past_the_slots_while_healthz_answers(tmp_path, monkeypatch) -> None:
    """Every CPU-heavy read (advice, figures, compare, heatmap, post-mortem, suspects) takes one of
    the same slots: with one slot held by a compare, a burst of the others waits its queue time,
    then gets 503 with Retry-After naming the read; /healthz and a light read answer meanwhile, and
    the held read ends with its answer."""
    from helpers import ending_at

    from vramwatch.collector.reads import advice
    from vramwatch.collector.reads.heavy import HeavyReads

    release = threading.Event()
    real_compare = advice.compare_runs

    def held_compare(a, b):  # the real compare, once the test lets it go on
        assert release.wait(30)
        return real_compare(a, b)

    monkeypatch.setattr(advice, "compare_runs", held_compare)
    trace = [make_sample(i, run=run, rank=r) for run in ("a", "b") for r in range(2) for i in range(40)]
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.post("/api/v1/samples", content=ndjson(ending_at(trace, time.time())),
                           headers=NDJSON).status_code == 200
        srv.app.state.heavy = slots = HeavyReads(slots=1, queue_s=0.5)
        held: list[httpx.Response] = []
        holder = threading.Thread(target=lambda: held.append(client.get("/api/v1/compare?a=a&b=b")))
        holder.start()
        time.sleep(0.2)  # the compare holds the one slot (it waits for `release` inside it)
        burst = ["/api/v1/runs/a/advice", "/api/v1/runs/a/figures", "/api/v1/runs/a/heatmap",
                 "/api/v1/runs/a/postmortem", "/api/v1/runs/a/suspects", "/api/v1/compare?a=b&b=a"]
        answers: list[tuple[str, httpx.Response]] = []

        def ask(path: str) -> None:
            with httpx.Client(base_url=srv.url, timeout=30) as own:
                answers.append((path, own.get(path)))

        askers = [threading.Thread(target=ask, args=(p,)) for p in burst * 4]
        for t in askers:
            t.start()
        while any(t.is_alive() for t in askers):
            assert client.get("/healthz").status_code == 200
            assert client.get("/api/v1/runs").status_code == 200
            time.sleep(0.02)
        assert len(answers) == len(burst) * 4
        for path, r in answers:
            assert r.status_code == 503, (path, r.status_code, r.text[:200])
            assert r.headers["retry-after"] == "5" and "1 heavy reads already running" in r.json()["detail"], path
        assert slots.refused == len(burst) * 4
        release.set()
        holder.join(30)
        assert held[0].status_code == 200 and {m["rank"] for m in held[0].json()["metrics"]} == {0, 1}
        # the slot is free again: each read answers
        for path in burst:
            assert client.get(path).status_code == 200, path
