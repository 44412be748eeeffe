"""Allocator snapshots as an attacker would send them: uploads stream to disk in bounded memory, a
few at once; what a crash leaves is cleaned at start and in-progress uploads count against the
cap; a file-count cap beside the byte cap; one index instead of a sidecar scan per save; any
stored body or run name downloads without a 500; a person's captures are rate-limited."""

from __future__ import annotations

import gzip
import logging
import os
import socket
import time
import tracemalloc
import urllib.parse
import uuid
from pathlib import Path

import httpx
import pytest
from helpers import make_sample, ndjson

from vramwatch.collector.server import BackgroundServer
from vramwatch.collector.snapshots.directives import SnapshotError, SnapshotStore

MiB = 2**20
QUERY = {"run": "run-a", "host": "node-1", "rank": 0, "step": 3, "trigger": "manual"}


def upload(url: str, body: bytes, **query) -> httpx.Response:
    return httpx.post(url + "/api/v1/snapshots", params={**QUERY, **query}, content=body,
                      headers={"content-type": "application/octet-stream"}, timeout=60)


def test_an_upload_streams_to_disk_in_bounded_memory(tmp_path: Path) -> None:
    import http.client
    import json

    body = gzip.compress(os.urandom(32 * MiB), 1)  # incompressible: 32 MiB on the wire
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)  # sends without copying the body
        tracemalloc.start()
        try:
            conn.request("POST", "/api/v1/snapshots?" + urllib.parse.urlencode(QUERY), body=body,
                         headers={"content-type": "application/octet-stream"})
            reply = conn.getresponse()
            answer = json.loads(reply.read())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            conn.close()
        assert reply.status == 201, answer
        assert peak < 16 * MiB, peak  # before: the chunks and their join, 64 MiB
        got = httpx.get(srv.url + answer["url"], timeout=60)
        assert got.status_code == 200 and got.content == gzip.decompress(body)


def _stalled_upload(port: int, size: int) -> socket.socket:
    """An upload that sends its headers and half its body, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port))
    query = "&".join(f"{k}={v}" for k, v in QUERY.items())
    sock.sendall(f"POST /api/v1/snapshots?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n".encode())
    sock.sendall(gzip.compress(b"x" * 100)[:10])
    return sock


def test_uploads_past_the_concurrency_cap_wait_then_get_503_and_a_stalled_one_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vramwatch.collector.snapshots.routes.UPLOAD_QUEUE_S", 0.5)
    with BackgroundServer(str(tmp_path / "vw.db"), max_concurrent_uploads=1, body_timeout_s=2.0) as srv:
        store = srv.app.state.snapshots
        stalled = _stalled_upload(srv.port, 4096)
        deadline = time.monotonic() + 5
        while store.usage()["uploads"] != 1:  # its temporary file is counted while it exists
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.monotonic()
        busy = upload(srv.url, gzip.compress(b"y" * 100))
        assert busy.status_code == 503 and "--max-concurrent-uploads" in busy.json()["detail"]
        assert busy.headers["retry-after"] and time.monotonic() - started < 3
        assert stalled.recv(100).startswith(b"HTTP/1.1 408")  # the body deadline ends the stalled one
        stalled.close()
        deadline = time.monotonic() + 5
        while store.usage()["uploads"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert upload(srv.url, gzip.compress(b"z" * 100)).status_code == 201  # the slot is free again
        folder = Path(str(tmp_path / "vw.db") + ".snapshots")
        assert sorted(p.suffix for p in folder.iterdir()) == [".gz", ".json"]  # nothing half-stored


def test_what_a_crash_left_is_removed_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    store = SnapshotStore(folder)
    kept = store.save(run="r", host="h", rank=0, step=1, trigger="manual", directive=None, gz=gzip.compress(b"a"))
    orphan, lonely = uuid.uuid4().hex, uuid.uuid4().hex
    (folder / f".upload-{uuid.uuid4().hex}.tmp").write_bytes(b"x" * 5000)   # an upload cut by the crash
    (folder / f".{orphan}.pickle.gz.tmp").write_bytes(b"x")                # an older version's temp file
    (folder / f"{orphan}.pickle.gz").write_bytes(gzip.compress(b"b"))       # renamed, sidecar never written
    (folder / f"{lonely}.json").write_text(f'{{"id": "{lonely}", "run": "r", "host": "h", "rank": 0, "step": 2, '
                                           '"trigger": "manual", "directive": null, "ts": 1.0, "bytes": 9}')
    reader = SnapshotStore(folder)  # a reader (snapshots diff --db beside a running collector) removes nothing
    assert [i.id for i in reader.list()] == [kept.id] and len(list(folder.iterdir())) == 6
    reopened = SnapshotStore(folder, owner=True)
    assert [i.id for i in reopened.list()] == [kept.id]
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{kept.id}.json", f"{kept.id}.pickle.gz"])
    assert reopened.usage() == {"snapshots": 1, "bytes": kept.bytes, "uploads": 0, "upload_bytes": 0}


def test_a_file_count_cap_beside_the_byte_cap(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", max_snapshots=3)
    for step in range(5):
        store.save(run="r", host="h", rank=0, step=step, trigger="manual", directive=None, gz=gzip.compress(b"a"))
    assert [i.step for i in store.list()] == [2, 3, 4]  # the oldest evicted
    assert len(list((tmp_path / "snaps").iterdir())) == 6


def test_an_upload_that_evicts_many_snapshots_leaves_one_line_with_count_and_bytes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """200 small snapshots, then one that needs all their room under the byte cap: one log line
    says how many went and how many bytes, naming the oldest and the newest of them."""
    store = SnapshotStore(tmp_path / "snaps", max_total_bytes=200_000)
    small = [store.save(run="r", host="h", rank=0, step=step, trigger="manual", directive=None,
                        gz=gzip.compress(os.urandom(900), 1)) for step in range(200)]
    assert store.evicted == 0
    with caplog.at_level(logging.INFO, logger="vramwatch.collector"):
        big = store.save(run="r", host="h", rank=1, step=999, trigger="manual", directive=None,
                         gz=gzip.compress(os.urandom(190_000), 1))
    kept = {i.id for i in store.list()}
    gone = [i for i in small if i.id not in kept]
    lines = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert len(gone) > 150 and store.evicted == len(gone) and big.id in kept
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{len(gone)} snapshot(s), {sum(i.bytes for i in gone)} bytes, evicted")
    assert gone[0].id in lines[0] and gone[-1].id in lines[0] and "max_snapshots_bytes 200000" in lines[0]


def test_saves_read_one_index_not_every_sidecar(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    store = SnapshotStore(folder)
    for step in range(50):
        store.save(run="r", host="h", rank=0, step=step, trigger="manual", directive=None, gz=gzip.compress(b"a"))
    for sidecar in folder.glob("*.json"):
        sidecar.write_text("damaged")  # a save that re-read them would now see none
    store.save(run="r", host="h", rank=0, step=50, trigger="manual", directive=None, gz=gzip.compress(b"a"))
    assert len(store.list("r")) == 51
    assert [i.step for i in SnapshotStore(folder, owner=True).list()] == [50]  # a restart reads them once


def test_a_bomb_or_a_non_gzip_upload_is_refused_and_stores_nothing(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snaps", max_inflated_bytes=4 * MiB)
    for body, status, words in ((gzip.compress(b"\0" * (64 * MiB), 9), 413, "max_snapshot_inflated_bytes"),
                                (b"plain pickle bytes", 415, "not gzip"),
                                (gzip.compress(b"abc" * 1000)[:-8], 400, "truncated")):
        with pytest.raises(SnapshotError) as err:
            store.save(run="r", host="h", rank=0, step=1, trigger="manual", directive=None, gz=body)
        assert err.value.status == status and words in str(err.value)
    assert list((tmp_path / "snaps").iterdir()) == [] and store.usage()["uploads"] == 0


def test_a_damaged_stored_body_or_any_run_name_downloads_without_a_500(tmp_path: Path, caplog) -> None:
    names = ["学習-ラン", "run \"quoted\"/x", "emoji-🚀"]
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        urls = {}
        for name in names:
            reply = upload(srv.url, gzip.compress(b"pickle of " + name.encode()), run=name)
            assert reply.status_code == 201, reply.text
            urls[name] = srv.url + reply.json()["url"]
        for name, url in urls.items():
            got = httpx.get(url, timeout=10)
            assert got.status_code == 200 and got.content == b"pickle of " + name.encode()  # before: a 500
            disposition = got.headers["content-disposition"]
            assert disposition.isascii() and "filename*=UTF-8''" in disposition
            assert urllib.parse.unquote(disposition.split("filename*=UTF-8''")[1]) == f"{name}-rank0-step3.pickle"
        folder = Path(str(tmp_path / "vw.db") + ".snapshots")
        ident = urls[names[0]].rsplit("/", 1)[1]
        (folder / f"{ident}.pickle.gz").write_bytes(b"not gzip at all")
        damaged = httpx.get(urls[names[0]], timeout=10)
        assert damaged.status_code == 409 and "not readable gzip" in damaged.json()["detail"]
        ident = urls[names[1]].rsplit("/", 1)[1]  # a good start, damaged further in
        start = gzip.compress(os.urandom(3 * MiB), 1)
        (folder / f"{ident}.pickle.gz").write_bytes(start[: 2 * MiB] + b"\0" * MiB)
        with caplog.at_level(logging.WARNING, logger="vramwatch.collector"):
            cut = httpx.get(urls[names[1]], timeout=10)
        assert cut.status_code == 200 and len(cut.content) < 3 * MiB
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_persons_captures_are_rate_limited_per_rank(tmp_path: Path) -> None:
    t0 = time.time() - 100
    with BackgroundServer(str(tmp_path / "vw.db"), capture_interval_s=60) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as client:
        def step(n: int) -> dict:
            return client.post("/api/v1/samples", content=ndjson([make_sample(n, ts=t0 + n)]),
                               headers={"content-type": "application/x-ndjson"}).json()

        step(0)
        handed = 0
        for n in range(1, 31):  # 30 clicks, each followed by a step that would take the directive
            reply = client.post("/api/v1/runs/run-a/capture", json={"rank": 0, "steps": 2})
            if n == 1:
                assert reply.status_code == 200 and reply.json()["directives"] == 1
            else:
                assert reply.status_code == 429 and "--capture-interval" in reply.json()["detail"], reply.text
                assert 0 < int(reply.headers["retry-after"]) <= 60
            handed += len(step(n).get("directives", []))
        assert handed == 1  # before: 30 directives, a snapshot every other step
        pending = client.post("/api/v1/runs/run-a/capture", json={"rank": 0})
        assert pending.status_code == 429


def test_snapshot_flags_reach_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vramwatch.cli import main
    from vramwatch.collector import server

    seen = []
    monkeypatch.setattr(server, "serve", lambda settings, **kw: seen.append(settings))
    assert main(["serve", "--db", str(tmp_path / "vw.db"), "--max-snapshots", "7", "--snapshots-max-mb", "100",
                 "--max-concurrent-uploads", "2", "--capture-interval", "5"]) == 0
    s = seen[0]
    assert (s.max_snapshots, s.max_snapshots_bytes, s.max_concurrent_uploads, s.capture_interval_s) == (
        7, 100 * MiB, 2, 5.0)
