"""The fault matrix, with real parts: ``vramwatch serve`` processes that get SIGKILLed and
SIGTERMed, SQLite on disk, the real hook and delivery, a TCP relay that turns the network
slow, silent or refusing, and a spool on a disk that fills up.

The hook engineer's tests cover one plain loop across one collector kill
(tests/hook/test_hook.py); these cover many ranks, repeated kills, the engine state across a
restart, partitions, a slow collector, a full disk and a broken database.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from collector_process import CollectorProcess, FaultRelay, percentile
from helpers import NDJSON_HEADERS, ndjson

import vramwatch
from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace

# ------------------------------------------------------------------ helpers


def rows(db: str | Path, run: str) -> list[tuple[int, int, str]]:
    """(rank, step, phase) of every stored sample of ``run`` recorded by ``step()``/``phase()``.

    Left out: the markers, copies of a train sample with a later ``seq``: the exit marker a
    clean ``close()`` sends when the last sample had already left (see :func:`exit_marks`) and
    the marker that opens each phase."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute(
            "SELECT s.rank, x.step, p.name FROM samples x JOIN series s ON s.id = x.series"
            " JOIN phases p ON p.id = x.phase WHERE s.run = ? AND NOT (x.seq > 0 AND x.exited)"
            " AND x.phase_open IS NOT 1"
            " ORDER BY s.rank, x.step, p.name", (run,)
        ).fetchall()


def exit_marks(db: str | Path, run: str) -> dict[int, int]:
    """rank -> number of stored samples marked ``exit`` (a clean close marks exactly one)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return dict(conn.execute(
            "SELECT s.rank, count(*) FROM samples x JOIN series s ON s.id = x.series"
            " WHERE s.run = ? AND x.exited GROUP BY s.rank", (run,)
        ).fetchall())


def integrity(db: str | Path) -> str:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


def monitors(url: str, run: str, ranks: int, spool: Path, **kw) -> list[vramwatch.Monitor]:
    kw.setdefault("flush_interval_s", 0.1)
    kw.setdefault("backoff_max_s", 0.5)
    return [vramwatch.init(url=url, run=run, rank=r, world_size=ranks, host=f"node-{r // 4}",
                           probe="simulated", spool_dir=spool, **kw) for r in range(ranks)]


class Trainer:
    """Steps a set of monitors at a fixed rate on one thread (the ranks' training threads),
    recording how long each ``step()`` call took."""

    def __init__(self, vws: list[vramwatch.Monitor], rate: float = 20.0, checkpoint_every: int = 25) -> None:
        self.vws = vws
        self.period = 1.0 / rate
        self.checkpoint_every = checkpoint_every
        self.costs: list[tuple[float, float]] = []  # (time, seconds in step())
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            for vw in self.vws:
                c0 = time.perf_counter()
                vw.step(self.step)
                if self.checkpoint_every and self.step % self.checkpoint_every == self.checkpoint_every - 1:
                    with vw.phase("checkpoint"):
                        pass
                self.costs.append((time.monotonic(), time.perf_counter() - c0))
            self.step += 1
            delay = t0 + self.step * self.period - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def __enter__(self) -> Trainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def costs_between(self, start: float, end: float) -> list[float]:
        return [c for t, c in self.costs if start <= t < end]


def expected_rows(ranks: int, steps: int, checkpoint_every: int = 25) -> list[tuple[int, int, str]]:
    out = []
    for r in range(ranks):
        for s in range(steps):
            if checkpoint_every and s % checkpoint_every == checkpoint_every - 1:
                out.append((r, s, "checkpoint"))
            out.append((r, s, "train"))
    return sorted(out)


# ------------------------------------------------------------------ kill -9 and restarts


def test_kill_9_during_heavy_ingest_leaves_an_intact_database_with_every_acknowledged_batch(tmp_path) -> None:
    db = tmp_path / "vw.db"
    server = CollectorProcess(db).start()
    acknowledged = [0]
    stop = threading.Event()

    def hammer() -> None:
        step = 0
        with httpx.Client(base_url=server.url, timeout=10) as client:
            while not stop.is_set():
                now = time.time()
                batch = [{**s, "ts": now} for s in simulate_trace("healthy", steps=2000, run="hammer",
                                                                   rank=step // 2000)]
                try:
                    r = client.post("/api/v1/samples", content=ndjson(batch), headers=NDJSON_HEADERS)
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    acknowledged[0] += r.json()["accepted"]
                step += 2000

    writer = threading.Thread(target=hammer, daemon=True)
    writer.start()
    time.sleep(2.5)
    server.kill()  # most likely mid-transaction: the writer never stops sending
    stop.set()
    writer.join(15)
    assert acknowledged[0] >= 4000
    assert integrity(db) == "ok"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        stored = conn.execute("SELECT count(*) FROM samples").fetchone()[0]
    # every batch that got its 200 is on disk; at most the one in flight committed unanswered
    assert acknowledged[0] <= stored <= acknowledged[0] + 2000
    # and the collector starts again on the same file
    with CollectorProcess(db) as again, httpx.Client(base_url=again.url) as client:
        runs = client.get("/api/v1/runs").json()
        assert runs[0]["run"] == "hammer" and runs[0]["samples"] == stored


def test_collector_killed_twice_under_multi_rank_load_every_sample_arrives_exactly_once(tmp_path) -> None:
    db = tmp_path / "vw.db"
    server = CollectorProcess(db).start()
    port = server.port
    vws = monitors(server.url, "kill-twice", 12, tmp_path / "spool")
    try:
        with Trainer(vws, rate=20) as trainer:
            for up_for, down_for in ((1.5, 1.5), (1.0, 2.0)):
                time.sleep(up_for)
                server.kill()
                assert integrity(db) == "ok"
                time.sleep(down_for)
                server = CollectorProcess(db, port=port).start()  # same port, same DB
            time.sleep(1.0)
        steps = trainer.step
        assert all(vw.flush(20) for vw in vws)
        stats = [vw.stats() for vw in vws]
    finally:
        for vw in vws:
            vw.close(5)
        server.terminate()
    assert sum(s["send_failures"] for s in stats) >= 12 and sum(s["replayed"] for s in stats) > 0
    assert sum(s["dropped_overflow"] + s["dropped_spool_full"] + s["rejected"] for s in stats) == 0
    got = rows(db, "kill-twice")
    assert len(got) == len(set(got))  # the primary key would refuse a second copy anyway
    assert got == expected_rows(12, steps)  # every step and checkpoint of every rank
    assert exit_marks(db, "kill-twice") == dict.fromkeys(range(12), 1)  # each close marked once
    assert integrity(db) == "ok"


def _events(client: httpx.Client, run: str) -> list[tuple]:
    return [(e["rank"], e["type"], e.get("step")) for e in client.get(f"/api/v1/runs/{run}/events").json()]


def _verdicts(client: httpx.Client, run: str) -> list[tuple]:
    return [(r["rank"], r["verdict"]["state"], r["verdict"].get("plateau_breaks"), r["last_step"])
            for r in client.get(f"/api/v1/runs/{run}/ranks").json()]


def test_restart_rebuilds_engine_state_from_the_database_without_spurious_events(tmp_path) -> None:
    """A collector restarted halfway must end with the same events and verdicts as one that
    saw the whole stream: no new plateau break, leak or warm-up after the restart."""
    scenarios = ["healthy", "checkpoint", "slow_leak", "fragmentation"]
    traces = {rank: list(simulate_trace(scenario, steps=1600, run="restart", rank=rank, start_ts=time.time() - 2000))
              for rank, scenario in enumerate(scenarios)}

    def feed(client: httpx.Client, start: int, end: int) -> None:
        for trace in traces.values():
            part = [s for s in trace if start <= s["step"] < end]
            assert client.post("/api/v1/samples", content=ndjson(part), headers=NDJSON_HEADERS).status_code == 200

    with BackgroundServer(str(tmp_path / "reference.db")) as srv, httpx.Client(base_url=srv.url) as client:
        feed(client, 0, 1600)
        reference_events, reference_verdicts = _events(client, "restart"), _verdicts(client, "restart")
    db = str(tmp_path / "restarted.db")
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:
        feed(client, 0, 900)
        before = _events(client, "restart")
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:
        assert _events(client, "restart") == before  # rebuilt, not re-detected differently
        feed(client, 800, 1600)  # the hooks' spool replays some samples the DB already has
        events, verdicts = _events(client, "restart"), _verdicts(client, "restart")
    assert events == reference_events
    assert verdicts == reference_verdicts


def test_sigterm_with_hooks_sending_shuts_down_cleanly_and_loses_nothing(tmp_path) -> None:
    db = tmp_path / "vw.db"
    server = CollectorProcess(db).start()
    vws = monitors(server.url, "sigterm", 6, tmp_path / "spool")
    try:
        with Trainer(vws, rate=20):
            time.sleep(1.5)
            started = time.monotonic()
            code = server.terminate(30)
            shutdown_s = time.monotonic() - started
            log = server.log()
            # clean: exit 0, the DB closed and checkpointed, no WAL left behind
            assert code == 0, log
            assert shutdown_s < 12
            assert "closed cleanly" in log and "Traceback" not in log
            assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()
            assert integrity(db) == "ok"
            time.sleep(1.0)
            server = CollectorProcess(db, port=server.port).start()
            time.sleep(1.0)
            steps = None
        assert all(vw.flush(20) for vw in vws)
        steps = vws[0].stats()["samples"]
    finally:
        for vw in vws:
            vw.close(5)
        server.terminate()
    got = rows(db, "sigterm")
    opened = sum(1 for r in got if r[0] == 0 and r[2] == "checkpoint")  # each phase sent its opening marker
    assert len(got) == 6 * (steps - opened) and got == sorted(set(got))


def test_database_locked_while_running_stalls_only_ingest_and_loses_nothing(tmp_path) -> None:
    db = tmp_path / "vw.db"
    with CollectorProcess(db) as server, httpx.Client(base_url=server.url, timeout=5) as client:
        vws = monitors(server.url, "locked", 6, tmp_path / "spool")
        try:
            with Trainer(vws, rate=20) as trainer:
                time.sleep(1.0)
                holder = sqlite3.connect(db, isolation_level=None)
                holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock for 12 s
                t_locked = time.monotonic()
                answers = []
                while time.monotonic() < t_locked + 12:
                    c0 = time.monotonic()
                    health = client.get("/healthz")
                    runs = client.get("/api/v1/runs")
                    answers.append((time.monotonic() - c0, health.status_code, runs.status_code))
                    time.sleep(0.5)
                holder.execute("ROLLBACK")
                holder.close()
                t_free = time.monotonic()
                time.sleep(2.0)
            assert all(vw.flush(30) for vw in vws)
            stats = [vw.stats() for vw in vws]
        finally:
            for vw in vws:
                vw.close(5)
        log = server.log()
    # health and reads kept answering at once: only ingest waited for the lock
    assert all(h == r == 200 for _, h, r in answers)
    assert max(t for t, _, _ in answers) < 1.0, answers
    # past SQLite's 10 s busy timeout ingest answered 503 and the hooks kept the samples
    assert "database is locked" in log
    assert sum(s["send_failures"] for s in stats) > 0
    assert sum(s["dropped_overflow"] + s["dropped_spool_full"] + s["rejected"] for s in stats) == 0
    assert rows(db, "locked") == expected_rows(6, trainer.step)
    locked = trainer.costs_between(t_locked, t_free)
    assert len(locked) > 6 * 20 * 10 and percentile(locked, 99) < 0.005


# ------------------------------------------------------------------ broken database at start


def _serve_once(db: Path, *, prefix: list[str] | None = None, timeout: float = 30) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-m", "vramwatch", "serve", "--db", str(db), "--port", "0"],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return proc.returncode, proc.stderr, time.monotonic() - started


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_locked_database_fails_fast_with_one_clear_line_and_exit_2(tmp_path) -> None:
    db = tmp_path / "vw.db"
    CollectorProcess(db).start().terminate()  # create it
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        code, stderr, took = _serve_once(db)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert code == 2, stderr
    assert "Traceback" not in stderr and took < 15
    assert _last_line(stderr) == f"vramwatch serve: error: cannot open database {db}: database is locked"


def _without_root_file_override() -> list[str]:
    """Root ignores file modes: run the collector without CAP_DAC_OVERRIDE so they bind it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("setpriv (util-linux) is needed to test read-only files as root")
        pytest.skip("running as root without setpriv (util-linux): file modes cannot be enforced")
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("what", ["file", "directory"])
def test_read_only_database_fails_with_one_clear_line_and_exit_2(tmp_path, what) -> None:
    prefix = _without_root_file_override()
    base = tmp_path / "data"
    base.mkdir()
    db = base / "vw.db"
    CollectorProcess(db).start().terminate()
    if what == "file":
        db.chmod(0o444)
    else:
        base.chmod(0o555)  # the file is writable, but SQLite cannot create its -wal next to it
    try:
        code, stderr, _ = _serve_once(db, prefix=prefix)
    finally:
        base.chmod(0o755)
        db.chmod(0o644)
    assert code == 2, stderr
    assert "Traceback" not in stderr
    line = _last_line(stderr)
    assert line.startswith(f"vramwatch serve: error: cannot open database {db}: "), line
    assert "readonly" in line or "read-only" in line or "unable to open" in line, line


# ------------------------------------------------------------------ network: partition, slow


def test_network_partition_never_blocks_training_and_loses_nothing(tmp_path) -> None:
    db = tmp_path / "vw.db"
    with CollectorProcess(db) as server:
        relay = FaultRelay(server.port)
        vws = monitors(relay.url, "partition", 8, tmp_path / "spool")
        try:
            with Trainer(vws, rate=20) as trainer:
                time.sleep(1.0)
                t_black = time.monotonic()
                relay.set("blackhole")  # packets vanish: requests hang until the hook's timeout
                time.sleep(6.0)
                t_refuse = time.monotonic()
                relay.set("refuse")  # then the port is closed outright
                time.sleep(3.0)
                t_back = time.monotonic()
                relay.set("forward")
                time.sleep(2.0)
            assert all(vw.flush(30) for vw in vws)
            stats = [vw.stats() for vw in vws]
        finally:
            for vw in vws:
                vw.close(5)
            relay.close()
    normal = trainer.costs_between(0, t_black)
    partitioned = trainer.costs_between(t_black, t_back)
    assert len(partitioned) > 8 * 20 * 8  # the loop kept its pace through 9 s without a collector
    # the training thread never waited on the network: step() stays in the microseconds
    assert percentile(partitioned, 99) < 0.005 and max(partitioned) < 0.1, (percentile(normal, 99),)
    assert sum(s["spooled"] for s in stats) > 0 and sum(s["send_failures"] for s in stats) > 0
    assert sum(s["dropped_overflow"] + s["dropped_spool_full"] for s in stats) == 0
    assert rows(db, "partition") == expected_rows(8, trainer.step)
    assert t_refuse > t_black


def test_slow_collector_does_not_slow_the_training_thread(tmp_path) -> None:
    db = tmp_path / "vw.db"
    with CollectorProcess(db) as server:
        relay = FaultRelay(server.port)
        vws = monitors(relay.url, "slow", 8, tmp_path / "spool")
        try:
            with Trainer(vws, rate=20) as trainer:
                time.sleep(1.0)
                t_slow = time.monotonic()
                relay.set("delay", delay_s=3.0)  # every answer takes 3 s (hook timeout is 5 s)
                time.sleep(6.0)
                t_fast = time.monotonic()
                relay.set("forward")
                time.sleep(2.0)
            assert all(vw.flush(30) for vw in vws)
            stats = [vw.stats() for vw in vws]
        finally:
            for vw in vws:
                vw.close(5)
            relay.close()
    slow = trainer.costs_between(t_slow, t_fast)
    assert len(slow) > 8 * 20 * 5
    assert percentile(slow, 99) < 0.005 and max(slow) < 0.1
    assert sum(s["dropped_overflow"] + s["dropped_spool_full"] for s in stats) == 0
    assert rows(db, "slow") == expected_rows(8, trainer.step)


# ------------------------------------------------------------------ disk full under the spool


FULL_DISK_SCRIPT = textwrap.dedent("""
    import json, os, resource, signal, sys, time, warnings
    limit = int(os.environ.get("FSIZE_LIMIT", "0"))
    if limit:  # no tmpfs available: a per-process file size limit fails writes the same way
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    import vramwatch
    warnings.simplefilter("always")
    url, spool, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with warnings.catch_warnings(record=True) as caught:
        vw = vramwatch.init(url=url, run="disk-full", rank=0, probe="simulated", spool_dir=spool,
                            flush_interval_s=0.05, backoff_max_s=0.3)
        costs = []
        t0 = time.monotonic()
        for step in range(steps):
            c0 = time.perf_counter()
            vw.step(step)
            costs.append(time.perf_counter() - c0)
            time.sleep(0.001)
        loop_s = time.monotonic() - t0
        with open(os.environ["READY"], "w") as fh:
            fh.write("x")
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.05)
        vw.flush(20)
        stats = vw.stats()
        vw.close(5)
    costs.sort()
    print(json.dumps({"stats": stats, "loop_s": loop_s, "p99": costs[int(len(costs) * 0.99)],
                      "max": costs[-1], "warnings": [str(w.message) for w in caught]}))
""")


def _small_filesystem(path: Path, size: str = "256k") -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_spool_disk_full_training_goes_on_and_every_drop_is_counted(tmp_path) -> None:
    import json

    db = tmp_path / "vw.db"
    spool = tmp_path / "spoolfs"
    mounted = _small_filesystem(spool)
    env = dict(os.environ, READY=str(tmp_path / "ready"), GO=str(tmp_path / "go"), PYTHONDONTWRITEBYTECODE="1")
    if not mounted:
        spool.mkdir(exist_ok=True)
        env["FSIZE_LIMIT"] = str(256 * 1024)
    port = CollectorProcess(tmp_path / "probe.db").start()
    port.terminate()  # a port that was just free: the collector is down while training runs
    steps = 3000  # ~1.5 MB of spool against 256 KiB of disk
    try:
        proc = subprocess.Popen([sys.executable, "-c", FULL_DISK_SCRIPT, port.url, str(spool), str(steps)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with CollectorProcess(db, port=port.port):  # the collector comes back: what fit is delivered
            (tmp_path / "go").write_text("x")
            out, err = proc.communicate(timeout=60)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(spool)], capture_output=True)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    stats = result["stats"]
    # training went on at full speed: every step recorded, step() never waited for the disk
    assert stats["samples"] == steps and result["p99"] < 0.005
    dropped = stats["dropped_spool_full"]
    assert dropped > 0, stats
    # every sample is accounted for: delivered or counted as dropped, none silently lost
    assert stats["worker_errors"] == 0, stats
    stored = len(rows(db, "disk-full"))
    assert stored + dropped == steps, (stored, stats)
    # and it said so
    said = " ".join(result["warnings"]) + str(stats["last_delivery_error"])
    assert "spool" in said.lower() and ("full" in said.lower() or "space" in said.lower()), said
    # what was kept is the oldest (replay is oldest-first and the spool keeps whole lines)
    assert [s for _, s, _ in rows(db, "disk-full")] == sorted(s for _, s, _ in rows(db, "disk-full"))


# ------------------------------------------------------------------ WAL checkpoint policy


def test_wal_is_checkpointed_periodically_and_removed_at_clean_shutdown(tmp_path) -> None:
    db = str(tmp_path / "vw.db")
    wal = Path(db + "-wal")
    with BackgroundServer(db, checkpoint_interval_s=0.3) as srv, httpx.Client(base_url=srv.url) as client:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        now = time.time()
        for rank in range(8):
            batch = [{**s, "ts": now} for s in simulate_trace("healthy", steps=5000, run="wal", rank=rank)]
            assert client.post("/api/v1/samples", content=ndjson(batch), headers=NDJSON_HEADERS).status_code == 200
        time.sleep(1.0)  # a maintenance pass has run since the last write
        with contextlib.closing(sqlite3.connect(db)) as conn:
            busy, frames, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0 and frames == done  # nothing was left un-checkpointed
        assert wal.stat().st_size <= 64 * 1024 * 1024
    assert not wal.exists()  # clean stop: folded in and removed
    assert integrity(db) == "ok"
