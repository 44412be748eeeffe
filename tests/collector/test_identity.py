"""One identity everywhere: a series is ``wire.series_key`` (run, host, rank) in the store,
live state, export, a restart and ``/metrics``; and a running collector stays correct when
another process (``vramwatch import``) writes the same database."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import orjson
from helpers import NDJSON_HEADERS, GiB, make_sample, ndjson

from vramwatch import wire
from vramwatch.collector.server import BackgroundServer


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "vramwatch", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_same_rank_on_two_hosts_is_two_series_in_every_view(tmp_path) -> None:
    db = str(tmp_path / "vw.db")
    now = time.time()
    a = [make_sample(i, host="node-a", ts=now - 20 + i) for i in range(10)]
    b = [make_sample(i, host="node-b", ts=now - 20 + i, allocated_bytes=50 * GiB) for i in range(10)]
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:
        r = client.post("/api/v1/samples", content=ndjson(a + b), headers=NDJSON_HEADERS)
        assert r.json().items() >= {"accepted": 20, "duplicates": 0, "rejected": 0}.items()
        ranks = client.get("/api/v1/runs/run-a/ranks").json()
        assert [(x["host"], x["rank"], x["samples"]) for x in ranks] == [("node-a", 0, 10), ("node-b", 0, 10)]
        metrics = client.get("/metrics").text
        allocated = {line.split("Hostname=")[1].split('"')[1]: int(line.rsplit(" ", 1)[1])
                     for line in metrics.splitlines() if line.startswith("vramwatch_memory_allocated_bytes{")}
        assert allocated == {"node-a": a[-1]["allocated_bytes"], "node-b": 50 * GiB}
    export = _cli("export", "run-a", "--db", db)
    assert export.returncode == 0, export.stderr
    exported = [orjson.loads(line) for line in export.stdout.splitlines()]
    assert sorted((wire.series_key(s), s["step"], s["allocated_bytes"]) for s in exported) == sorted(
        (wire.series_key(s), s["step"], s["allocated_bytes"]) for s in a + b)
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:  # after a restart
        ranks = client.get("/api/v1/runs/run-a/ranks").json()
        assert [(x["host"], x["rank"], x["samples"]) for x in ranks] == [("node-a", 0, 10), ("node-b", 0, 10)]


def test_import_into_a_running_collector_leaves_its_ingest_working(tmp_path) -> None:
    db = str(tmp_path / "vw.db")
    trace = tmp_path / "rank1.jsonl"
    wire.write_file(trace, [make_sample(i, rank=1) for i in range(20)])
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:
        assert client.post("/api/v1/samples", content=ndjson([make_sample(i) for i in range(5)]),
                           headers=NDJSON_HEADERS).status_code == 200
        imported = _cli("import", str(trace), "--db", db)
        assert imported.returncode == 0, imported.stderr
        # the collector never saw rank 1; the importer created its series under it
        r = client.post("/api/v1/samples", content=ndjson([make_sample(i, rank=1) for i in range(15, 25)]),
                        headers=NDJSON_HEADERS)
        assert r.status_code == 200, r.text
        assert r.json().items() >= {"accepted": 5, "duplicates": 5, "rejected": 0}.items()


def test_sparse_samples_import_and_export_exactly_as_written(tmp_path) -> None:
    """What dcgm-exporter or nvidia-smi knows (device used and capacity) round-trips through the
    database without a single invented number."""
    db = str(tmp_path / "vw.db")
    trace = tmp_path / "dcgm.jsonl"
    sparse = [{"schema": 2, "run": "dcgm", "host": "node-7", "rank": 3, "step": i, "ts": 1_760_000_000.0 + 15 * i,
               "phase": "train", "nvml_used_bytes": 60 * GiB + i * 2**20, "total_bytes": 80 * GiB} for i in range(50)]
    sparse[10]["allocated_bytes"] = 40 * GiB  # one sample that also knows the allocator
    wire.write_file(trace, sparse)
    assert _cli("import", str(trace), "--db", db).returncode == 0
    export = _cli("export", "dcgm", "--db", db)
    assert export.returncode == 0, export.stderr
    assert [orjson.loads(line) for line in export.stdout.splitlines()] == sparse
