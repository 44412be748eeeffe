"""BatchSender: batching, gzip + auth, retries, spool and oldest-first replay, 4xx handling,
bounded flush/close. Status codes come from a scripted stdlib server (tests/fakes); the
end-to-end paths against the real collector are in test_hook.py."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from fakes.ingest_server import ScriptedIngest, dead_url
from helpers import make_sample

from vramwatch.delivery import (
    MAX_REPLY_BYTES,
    Backoff,
    BatchProcessor,
    BatchSender,
    ExportFailure,
    ExportOutcome,
    ExportResult,
    HttpExporter,
    InMemoryExporter,
)
from vramwatch.delivery.exporters import reply_hints


def samples(n: int, start: int = 0, **overrides) -> list[dict]:
    now = time.time()
    return [make_sample(step, ts=now, incarnation="inc-1", **overrides) for step in range(start, start + n)]


def sender_for(url: str, tmp_path: Path, **kwargs) -> BatchSender:
    kwargs.setdefault("interval_s", 0.05)
    kwargs.setdefault("backoff_initial_s", 0.05)
    kwargs.setdefault("backoff_max_s", 0.2)
    return BatchSender(HttpExporter(url, token=kwargs.pop("token", None)), spool_path=tmp_path / "spool.jsonl",
                       **kwargs)


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def ingest():
    with ScriptedIngest() as server:
        yield server


def test_gzipped_ndjson_with_bearer_token_to_the_ingest_path(ingest, tmp_path):
    sender = sender_for(ingest.url + "/prefix/", tmp_path, token="s3cret")
    for s in samples(10):
        sender.submit(s)
    assert sender.flush(5)
    sender.close(2)
    request = ingest.requests[0]
    assert request["path"] == "/prefix/api/v1/samples"
    assert request["headers"]["Content-Encoding"] == "gzip"
    assert request["headers"]["Content-Type"] == "application/x-ndjson"
    assert request["headers"]["Authorization"] == "Bearer s3cret"
    assert ingest.steps() == list(range(10))
    stats = sender.stats()
    assert (stats["delivered"], stats["accepted"], stats["send_failures"]) == (10, 10, 0)


def test_batches_by_size_without_waiting_for_the_interval(ingest, tmp_path):
    sender = sender_for(ingest.url, tmp_path, batch_size=50, interval_s=30.0)
    for s in samples(120):
        sender.submit(s)
    assert wait_for(lambda: len(ingest.steps()) >= 100, 5.0)  # woken by size, not the 30 s timer
    assert all(len(r["samples"]) <= 50 for r in ingest.requests)
    assert sender.flush(5)
    assert ingest.steps() == list(range(120))
    sender.close(2)


def test_batches_by_time(ingest, tmp_path):
    sender = sender_for(ingest.url, tmp_path, batch_size=1000, interval_s=0.1)
    for s in samples(3):
        sender.submit(s)
    assert wait_for(lambda: len(ingest.steps()) == 3, 3.0)
    assert len(ingest.requests) == 1
    sender.close(2)


def test_transient_failures_spool_then_replay_oldest_first_exactly_once(ingest, tmp_path):
    ingest.script = [503, 503, 503]
    sender = sender_for(ingest.url, tmp_path, batch_size=20)
    for chunk in range(5):  # more samples arrive while the collector is failing
        for s in samples(20, start=chunk * 20):
            sender.submit(s)
        time.sleep(0.03)
    assert sender.flush(5)
    sender.close(2)
    stats = sender.stats()
    assert stats["send_failures"] == 3
    assert stats["spooled"] > 0 and stats["replayed"] > 0
    assert ingest.steps() == list(range(100))  # all of them, once, in order
    assert stats["duplicates"] == 0 and stats["spool_pending_bytes"] == 0
    assert not (tmp_path / "spool.jsonl").exists()  # an empty spool is removed at close


def test_backoff_is_exponential_capped_and_jittered():
    backoff = Backoff(0.1, 0.8)
    delays = []
    for _ in range(6):
        backoff.failed()
        delays.append(backoff.delay_s)
    assert delays == [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    waits = set()
    for _ in range(20):
        backoff.failed()
        wait = backoff.retry_at - time.monotonic()
        assert 0.35 <= wait <= 0.81
        waits.add(round(wait, 3))
    assert len(waits) > 5  # jitter: ranks do not retry in lockstep
    backoff.succeeded()
    assert not backoff.waiting()


def test_422_drops_the_invalid_samples_counts_them_and_resends_the_rest_once(ingest, tmp_path):
    def reject_steps_3_and_7(batch):
        errors = [{"index": i, "field": "ts", "message": "in the future"}
                  for i, s in enumerate(batch) if s["step"] in (3, 7)]
        return 422, {"detail": "sample 3: ts", "accepted": 0, "rejected": 2, "errors": errors}

    ingest.script = [reject_steps_3_and_7]
    sender = sender_for(ingest.url, tmp_path)
    for s in samples(10):
        sender.submit(s)
    assert sender.flush(5)
    sender.close(2)
    assert ingest.steps() == [0, 1, 2, 4, 5, 6, 8, 9]
    stats = sender.stats()
    assert stats["rejected"] == 2 and stats["delivered"] == 8
    assert len(ingest.requests) == 2  # never retried forever


@pytest.mark.parametrize("status", [400, 404, 422])
def test_other_permanent_rejections_drop_the_batch_and_count_it(ingest, tmp_path, status):
    ingest.script = [status]
    sender = sender_for(ingest.url, tmp_path)
    for s in samples(5):
        sender.submit(s)
    assert sender.flush(5)
    for s in samples(5, start=5):
        sender.submit(s)
    assert sender.flush(5)
    sender.close(2)
    assert ingest.steps() == [5, 6, 7, 8, 9]
    stats = sender.stats()
    assert stats["rejected"] == 5 and f"HTTP {status}" in stats["last_error"]
    assert len(ingest.requests) == 2


def test_413_splits_the_batch(ingest, tmp_path):
    ingest.script = [lambda batch: (413, {"detail": "too large"}) if len(batch) > 4 else (200, None)] * 3
    sender = sender_for(ingest.url, tmp_path, batch_size=16)
    for s in samples(16):
        sender.submit(s)
    assert sender.flush(5)
    sender.close(2)
    assert sorted(ingest.steps()) == list(range(16))
    assert sender.stats()["rejected"] == 0


def test_auth_failure_keeps_the_samples_and_is_counted(ingest, tmp_path):
    ingest.script = [401, 401]
    sender = sender_for(ingest.url, tmp_path, token="wrong-then-fixed")
    for s in samples(4):
        sender.submit(s)
    assert wait_for(lambda: len(ingest.steps()) == 4, 5)
    sender.close(2)
    assert sender.stats()["auth_failures"] == 2
    assert ingest.steps() == [0, 1, 2, 3]


def test_invalid_samples_are_dropped_before_sending_and_counted(ingest, tmp_path):
    sender = sender_for(ingest.url, tmp_path)
    good = samples(3)
    bad = make_sample(99, allocated_bytes=-1)
    for s in (good[0], bad, good[1], good[2]):
        sender.submit(s)
    assert sender.flush(5)
    sender.close(2)
    stats = sender.stats()
    assert stats["invalid"] == 1 and "allocated_bytes" in stats["last_error"]
    assert ingest.steps() == [0, 1, 2]


def test_bounded_close_when_the_collector_is_down_spools_everything(tmp_path):
    spool = tmp_path / "spool.jsonl"
    sender = BatchSender(HttpExporter(dead_url()), spool_path=spool, interval_s=0.05)
    for s in samples(1000):
        sender.submit(s)
    started = time.monotonic()
    delivered = sender.close(timeout=2.0)
    elapsed = time.monotonic() - started
    assert not delivered
    assert elapsed < 2.5
    lines = spool.read_bytes().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1000))
    assert sender.stats()["send_failures"] >= 1


def test_bounded_close_when_the_collector_hangs(ingest, tmp_path):
    ingest.delay_s = 5.0  # accepts the connection, answers far too late
    spool = tmp_path / "spool.jsonl"
    sender = BatchSender(HttpExporter(ingest.url, timeout_s=10), spool_path=spool, interval_s=0.02)
    for s in samples(50):
        sender.submit(s)
    time.sleep(0.2)  # the worker is now stuck in its POST
    for s in samples(50, start=50):
        sender.submit(s)
    started = time.monotonic()
    sender.close(timeout=1.0)
    assert time.monotonic() - started < 2.0
    # the stuck batch and the queue were spooled: a later replay sends all 100 (duplicates are harmless)
    steps = sorted({json.loads(line)["step"] for line in spool.read_bytes().splitlines()})
    assert steps == list(range(100))


def test_leftover_spools_of_earlier_processes_are_replayed_first(tmp_path):
    old = tmp_path / "run.rank0.old-incarnation.jsonl"
    old.write_bytes(b"".join(json.dumps(s).encode() + b"\n" for s in samples(30)))
    with ScriptedIngest() as server:
        sender = BatchSender(HttpExporter(server.url), spool_path=tmp_path / "run.rank0.new.jsonl",
                             adopt_spools=[old], interval_s=0.05)
        for s in samples(10, start=30):
            sender.submit(s)
        assert sender.flush(5)
        sender.close(2)
        assert server.steps() == list(range(40))
    assert not old.exists()


def test_overflow_goes_to_the_spool_in_order_and_only_a_stuck_worker_drops(ingest, tmp_path):
    ingest.delay_s = 0.3  # a slow collector: training outpaces it
    sender = sender_for(ingest.url, tmp_path, batch_size=16, max_queue=32)
    for s in samples(400):
        sender.submit(s)
        time.sleep(0.0005)
    assert len(sender._queue) <= 4 * 32 + 1
    ingest.delay_s = 0.0
    assert sender.flush(10)
    sender.close(2)
    stats = sender.stats()
    assert stats["spooled"] > 0
    stored = ingest.steps()
    assert stored == sorted(stored)  # oldest first, always
    assert len(stored) + stats["dropped_overflow"] == 400


def test_spool_size_cap_drops_and_counts(tmp_path):
    spool = tmp_path / "spool.jsonl"
    sender = BatchSender(HttpExporter(dead_url()), spool_path=spool, max_spool_bytes=20_000, interval_s=0.02)
    for s in samples(200):
        sender.submit(s)
    sender.close(1.0)
    stats = sender.stats()
    assert 0 < stats["spooled"] < 200
    assert stats["spooled"] + stats["dropped_spool_full"] == 200
    assert spool.stat().st_size <= 20_000


def test_gzip_body_is_smaller_than_the_json(ingest, tmp_path):
    transport = HttpExporter(ingest.url)
    body = b"".join(json.dumps(s).encode() + b"\n" for s in samples(200))
    assert len(gzip.compress(body)) < len(body) / 4
    answer = transport.send(body, 200)
    assert answer["accepted"] == 200
    transport.close()


@pytest.mark.parametrize("url", ["ftp://collector", "http://:80", "collector:notaport"])
def test_bad_url_names_the_argument(url):
    with pytest.raises(ValueError, match=r"^url: must be http"):
        HttpExporter(url)


# ---------------------------------------------------------------- bounded replies, warn once, back off


def _raw_server(reply: bytes) -> tuple[str, threading.Thread]:
    """One-request HTTP server that sends a prebuilt reply (nothing allocated while it runs)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _addr = listener.accept()
        with conn, listener:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            with contextlib.suppress(OSError):
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


@pytest.mark.parametrize("with_length", [True, False])
def test_a_huge_reply_is_never_read_into_memory(with_length):
    import tracemalloc

    answer = b'{"accepted": 20, "padding": "' + b"x" * 40_000_000 + b'"}'  # a 40 MB "200" reply
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(answer) if with_length else b"Connection: close\r\n\r\n"
    url, thread = _raw_server(head + answer)
    exporter = HttpExporter(url)
    lines = [json.dumps(s).encode() + b"\n" for s in samples(20)]
    tracemalloc.start()
    try:
        result = exporter.export(lines)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    exporter.shutdown()
    thread.join(10)
    assert result.outcome is ExportOutcome.SUCCESS and result.delivered == 20
    assert result.failure is ExportFailure.REPLY_TOO_LARGE
    assert peak < 4 * MAX_REPLY_BYTES + 1_000_000, f"read {peak} bytes of a 40 MB reply"


@pytest.mark.parametrize("status", [301, 308])
def test_a_redirect_is_never_dropped_warns_once_and_backs_off(ingest, tmp_path, status):
    ingest.script = [status] * 1000
    ingest.location = "http://elsewhere.example/api/v1/samples"
    sender = sender_for(ingest.url, tmp_path, interval_s=0.02, backoff_max_s=30.0)
    with pytest.warns(RuntimeWarning) as caught:
        for chunk in range(10):
            for s in samples(10, start=chunk * 10):
                sender.submit(s)
            time.sleep(0.1)
        assert not sender.flush(0.3)
    stats = sender.stats()
    sender.close(0.5)
    assert len(ingest.requests) <= 3, "a redirecting collector must not be hammered"
    assert stats["redirects"] >= 1 and stats["rejected"] == 0 and stats["dropped_spool_full"] == 0
    assert "elsewhere.example" in stats["last_error"]
    kept = [json.loads(line)["step"] for line in (tmp_path / "spool.jsonl").read_bytes().splitlines()]
    assert kept == list(range(100))  # every sample kept, in order, for when the URL is fixed
    assert sum("redirects" in str(w.message) for w in caught) == 1


def test_an_always_413_collector_costs_log2_requests_and_keeps_the_samples(ingest, tmp_path):
    ingest.script = [413] * 1000
    sender = sender_for(ingest.url, tmp_path, batch_size=256, backoff_max_s=30.0)
    with pytest.warns(RuntimeWarning, match="413 even for one sample"):
        for s in samples(256):
            sender.submit(s)
        assert not sender.flush(1.0)
    stats = sender.stats()
    sender.close(0.5)
    assert len(ingest.requests) <= 8 + 1 + 1  # halving down to one sample, once; then backoff
    assert stats["rejected"] == 0
    assert len((tmp_path / "spool.jsonl").read_bytes().splitlines()) == 256


def test_the_spool_cap_holds_per_rank_across_restarts(tmp_path):
    """A crash-looping rank adopts its earlier spools: all of them together stay under one cap."""
    cap = 30_000
    line = json.dumps(samples(1)[0]).encode() + b"\n"
    for restart in range(4):  # four earlier incarnations, each left ~cap/2 behind
        old = tmp_path / f"run.rank0.old{restart}.jsonl"
        old.write_bytes(line * (cap // 2 // len(line)))
        os.utime(old, (1000 + restart, 1000 + restart))
    files = sorted(tmp_path.glob("run.rank0.*.jsonl"))
    sender = BatchSender(HttpExporter(dead_url()), spool_path=tmp_path / "run.rank0.new.jsonl",
                         adopt_spools=files, max_spool_bytes=cap, interval_s=0.02)
    for s in samples(100, start=1000):
        sender.submit(s)
    sender.close(1.0)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("run.rank0.*.jsonl"))
    assert on_disk <= cap
    stats = sender.stats()
    assert stats["dropped_spool_full"] > 0  # the oldest files and what did not fit, counted
    assert not (tmp_path / "run.rank0.old0.jsonl").exists()  # oldest discarded first
    assert (tmp_path / "run.rank0.old3.jsonl").exists()  # newest kept for replay


# ---------------------------------------------------------------- adaptive flush, hints, directives


def test_the_collectors_interval_hint_is_honoured_and_directives_parsed_safely(ingest, tmp_path):
    ingest.reply_extra = {"flush_interval_s": 0.4,
                          "directives": [{"type": "snapshot", "steps": 5}, {"type": "from-the-future"}, "garbage", 7]}
    sender = sender_for(ingest.url, tmp_path, interval_s=0.02)
    for s in samples(2):
        sender.submit(s)
    assert sender.flush(5)
    assert sender.stats()["flush_interval_s"] == 0.4
    before = len(ingest.requests)
    for s in samples(30, start=2):  # a slow trickle for 1.2 s
        sender.submit(s)
        time.sleep(0.04)
    requests = len(ingest.requests) - before
    assert requests <= 5, f"{requests} POSTs in 1.2 s with a 0.4 s hint (the 0.02 s default would make ~50)"
    assert sender.flush(5)
    stats = sender.stats()
    sender.close(2)
    assert [d.type for d in list(sender.directives)[:2]] == ["snapshot", "from-the-future"]
    assert sender.directives[0].args == {"steps": 5}
    assert stats["worker_errors"] == 0 and ingest.steps() == list(range(32))


def test_the_hint_only_lengthens_the_configured_interval(ingest, tmp_path):
    """A collector's hint asks a fleet for fewer requests; a rank configured for a longer
    interval keeps it (the hint shorter than the configured interval is not taken)."""
    ingest.reply_extra = {"flush_interval_s": 0.1}
    sender = sender_for(ingest.url, tmp_path, interval_s=0.6)
    sender.submit(samples(1)[0])
    assert sender.flush(5)
    assert sender.stats()["flush_interval_s"] == 0.6
    before = len(ingest.requests)
    for s in samples(30, start=1):  # a slow trickle for 1.2 s
        sender.submit(s)
        time.sleep(0.04)
    requests = len(ingest.requests) - before
    assert requests <= 4, f"{requests} POSTs in 1.2 s: the 0.1 s hint shortened a 0.6 s interval"
    sender.close(2)


@pytest.mark.parametrize("hint", [-1, 0, "soon", float("inf"), True, 10_000])
def test_a_bad_interval_hint_is_ignored_or_clamped(hint):
    interval, directives = reply_hints({"flush_interval_s": hint, "directives": {"not": "a list"}})
    assert directives == ()
    assert interval is None or 0.05 <= interval <= 60.0


def test_the_in_memory_exporter_behind_the_processor():
    exporter = InMemoryExporter()
    exporter.script = [ExportResult(ExportOutcome.RETRY, failures=1, failure=ExportFailure.SERVER)]
    processor = BatchProcessor(exporter, interval_s=0.02)
    for s in samples(5):
        processor.submit(s)
    assert processor.force_flush(5)
    processor.shutdown(2)
    assert [s["step"] for s in exporter.samples] == [] or exporter.shut
    # without a spool a failed batch is counted, not kept
    assert processor.stats()["dropped_unsendable"] == 5 and processor.stats()["send_failures"] == 1


def test_one_shared_worker_drives_many_processors_each_with_its_own_queue_and_interval(ingest, tmp_path):
    """A load generator's many ranks in one process: one thread, the real processor code per rank."""
    from vramwatch.delivery import SharedWorker

    worker = SharedWorker()
    threads_before = threading.active_count()
    senders = [BatchSender(HttpExporter(ingest.url), spool_path=tmp_path / f"r{rank}.jsonl", interval_s=0.05,
                           worker=worker) for rank in range(40)]
    assert threading.active_count() == threads_before  # no thread per sender
    for rank, sender in enumerate(senders):
        for s in samples(5, rank=rank):
            sender.submit(s)
    assert wait_for(lambda: len(ingest.stored) == 200, 10)  # timed cycles, no flush asked
    for rank, sender in enumerate(senders):
        for s in samples(5, start=5, rank=rank):
            sender.submit(s)
    assert all(sender.flush(5) for sender in senders)
    assert all(sender.close(5) for sender in senders)
    assert len(ingest.stored) == 400
    assert sum(sender.stats()["delivered"] for sender in senders) == 400


def test_a_keep_alive_connection_the_server_closed_is_replaced_at_once_not_backed_off():
    """Servers close idle keep-alive connections; reusing one must cost a reconnect, not a failure."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    served = []

    def serve() -> None:
        with listener:
            for _ in range(3):
                conn, _addr = listener.accept()
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    if not data:
                        continue
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                      if line.lower().startswith(b"content-length")))
                    while len(body) < length:
                        body += conn.recv(65536)
                    served.append(len(body))
                    reply = b'{"accepted": 3, "duplicates": 0}'
                    # no "Connection: close": the client keeps the socket, which we close right away
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    exporter = HttpExporter(f"http://127.0.0.1:{listener.getsockname()[1]}")
    lines = [json.dumps(s).encode() + b"\n" for s in samples(3)]
    first = exporter.export(lines)
    time.sleep(0.1)  # the server has closed its end by now
    second = exporter.export(lines)
    exporter.shutdown()
    assert first.outcome is second.outcome is ExportOutcome.SUCCESS
    assert (first.failures, second.failures, second.accepted) == (0, 0, 3)
    assert len(served) == 2


def test_requests_are_bounded_by_bytes_as_well_as_by_count(ingest, tmp_path):
    big = {f"metric_{i}": float(i) for i in range(60)}  # samples with many extra numbers: ~2 KB each
    sender = BatchSender(HttpExporter(ingest.url), spool_path=tmp_path / "s.jsonl", interval_s=30,
                         batch_size=512)
    sender.max_batch_bytes = 20_000
    for s in samples(100, extra=big):
        sender.submit(s)
    assert sender.flush(10)
    sender.close(2)
    import orjson

    sizes = [len(r["samples"]) for r in ingest.requests]
    body_bytes = [sum(len(orjson.dumps(s)) + 1 for s in r["samples"]) for r in ingest.requests]
    assert sum(sizes) == 100 and len(sizes) >= 5  # > 1 KB x 100 in requests of <= 20 KB
    assert max(body_bytes) <= 20_000 and min(body_bytes[:-1]) > 20_000 - 2_000  # full, never over
    assert ingest.steps() == list(range(100))
