"""The collector end to end: a real uvicorn server on loopback, SQLite on disk."""

from __future__ import annotations

import sqlite3
import time

import httpx
import orjson
import pytest
from helpers import NDJSON_HEADERS, GiB, gz, make_sample, ndjson

from vramwatch.collector.server import BackgroundServer

#: a death the hook said nothing about: no last words, no host memory to name the killer, no culprit
NO_WORDS = {"last_words": None, "killed_by": None, "culprit": None}


@pytest.fixture
def collector(tmp_path):
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        srv.client = client  # type: ignore[attr-defined]
        yield srv


def stored_count(srv) -> int:
    with sqlite3.connect(srv.settings.db_path) as conn:
        return conn.execute("SELECT count(*) FROM samples").fetchone()[0]


def post(srv, samples, *, gzip_body=False, as_array=False):
    body = orjson.dumps(samples) if as_array else ndjson(samples)
    headers = {"content-type": "application/x-ndjson"}
    if gzip_body:
        body, headers["content-encoding"] = gz(body), "gzip"
    return srv.client.post("/api/v1/samples", content=body, headers=headers)


def test_ingest_store_api_and_metrics(collector) -> None:
    t0 = time.time() - 100  # a run still going: its ranks' state families are on /metrics
    samples = [make_sample(i, rank=r, host=f"node-{r // 4}", ts=t0 + i) for r in range(8) for i in range(100)]
    r = post(collector, samples, gzip_body=True)
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 800, "duplicates": 0, "rejected": 0, "flush_interval_s": 1.0}
    assert stored_count(collector) == 800

    runs = collector.client.get("/api/v1/runs").json()
    assert [(x["run"], x["ranks"], x["hosts"], x["samples"], x["last_step"]) for x in runs] == [
        ("run-a", 8, 2, 800, 99)
    ]
    ranks = collector.client.get("/api/v1/runs/run-a/ranks").json()
    assert [x["rank"] for x in ranks] == list(range(8))
    assert ranks[3]["host"] == "node-0" and ranks[5]["host"] == "node-1"
    assert ranks[0]["last"]["step"] == 99 and "state" in ranks[0]["verdict"]

    series = collector.client.get(
        "/api/v1/runs/run-a/series", params={"rank": 2, "fields": "allocated_bytes,reserved_bytes"}
    ).json()
    assert series["x"] == list(range(100)) and not series["downsampled"]
    assert series["series"]["allocated_bytes"][10] == 100 * GiB + 10 * 1024

    text = collector.client.get("/metrics").text
    assert 'vramwatch_memory_allocated_bytes{' in text
    line = next(ln for ln in text.splitlines()
                if ln.startswith("vramwatch_memory_reserved_bytes{") and 'rank="7"' in ln)
    assert float(line.rsplit(" ", 1)[1]) == 120 * GiB
    assert collector.client.get("/healthz").json()["status"] == "ok"


def test_ingest_is_idempotent_and_accepts_array_and_single_object(collector) -> None:
    samples = [make_sample(i) for i in range(10)]
    assert post(collector, samples, as_array=True).json()["accepted"] == 10
    again = post(collector, [*samples[5:], make_sample(10)], gzip_body=True).json()
    assert again.items() >= {"accepted": 1, "duplicates": 5, "rejected": 0}.items()
    single = collector.client.post("/api/v1/samples", content=orjson.dumps(make_sample(11)),
                                   headers={"content-type": "application/json"})
    assert single.json()["accepted"] == 1
    # a different phase or incarnation at the same step is a different sample
    extra = [make_sample(11, phase="checkpoint"), make_sample(0, incarnation="restart-1")]
    assert post(collector, extra).json()["accepted"] == 2
    assert stored_count(collector) == 14


def test_export_returns_what_was_ingested(collector, tmp_path) -> None:
    from vramwatch.cli import main

    samples = [
        make_sample(i, uuid="GPU-abc", gpu=1, pid=42, local_rank=1, world_size=8, incarnation="i1",
                    step_time_s=0.98, tokens=22528, active_bytes=100 * GiB + i * 1024,
                    process_used_bytes=121 * GiB, extra={"loss": 2.5 - i / 100})
        for i in range(20)
    ] + [make_sample(5, phase="checkpoint", incarnation="i1", uuid="GPU-abc", gpu=1, pid=42, local_rank=1,
                     world_size=8, nvml_used_bytes=None)]
    assert post(collector, samples).json()["accepted"] == 21
    out = tmp_path / "export.jsonl"
    assert main(["export", "run-a", "--db", collector.settings.db_path, "--out", str(out)]) == 0
    exported = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    key = lambda s: (s["step"], s["phase"])  # noqa: E731
    assert sorted(exported, key=key) == sorted(samples, key=key)


BAD_REQUESTS = [
    # (description, body, headers, expected status, text that must appear in the detail)
    ("invalid json", b"{not json", {}, 400, "invalid JSON"),
    ("empty body", b"", {}, 400, "empty"),
    ("bad gzip", b"\x1f\x8bnope", {"content-encoding": "gzip"}, 400, "gzip"),
    ("unknown encoding", b"{}", {"content-encoding": "br"}, 415, "content-encoding"),
    ("not an object", b"[1, 2]", {}, 422, "sample"),
    ("unknown schema", orjson.dumps(make_sample(schema=9)), {}, 422, "schema"),
    ("negative bytes", orjson.dumps(make_sample(allocated_bytes=-5)), {}, 422, "allocated_bytes"),
    ("allocated above reserved", orjson.dumps(make_sample(allocated_bytes=121 * GiB)), {}, 422,
     "allocated_bytes"),
    ("peak below allocated", orjson.dumps(make_sample(peak_allocated_bytes=GiB)), {}, 422,
     "peak_allocated_bytes"),
    ("reserved above capacity", orjson.dumps(make_sample(total_bytes=80 * GiB)), {}, 422, "reserved_bytes"),
    ("missing field", orjson.dumps({k: v for k, v in make_sample().items() if k != "rank"}), {}, 422, "rank"),
    ("unknown field", orjson.dumps(make_sample(memory=1)), {}, 422, "memory"),
    ("string number", orjson.dumps({**make_sample(), "step": "10"}), {}, 422, "step"),
    ("nan", b'{"schema":1,"ts":NaN}', {}, 400, "invalid JSON"),
    ("huge integer", orjson.dumps(make_sample(reserved_bytes=2**62)), {}, 422, "reserved_bytes"),
    ("future timestamp", orjson.dumps(make_sample(ts=4_000_000_000.0)), {}, 422, "future"),
    ("ancient timestamp", orjson.dumps(make_sample(ts=1000.0)), {}, 422, "ts"),
    ("control character in run", orjson.dumps(make_sample(run="a\u0000b")), {}, 422, "run"),
    ("bad phase", orjson.dumps(make_sample(phase="<script>")), {}, 422, "phase"),
    ("non-numeric extra", orjson.dumps(make_sample(extra={"note": "x"})), {}, 422, "extra.note"),
]


@pytest.mark.parametrize(
    ("desc", "body", "headers", "status", "needle"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_is_a_clear_4xx_and_stores_nothing(collector, desc, body, headers, status, needle) -> None:
    r = collector.client.post("/api/v1/samples", content=body, headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert stored_count(collector) == 0


def test_one_bad_sample_rejects_the_whole_batch(collector) -> None:
    batch = [make_sample(i) for i in range(5)] + [make_sample(5, ooms=-1)] + [make_sample(6, run="")]
    r = post(collector, batch)
    assert r.status_code == 422
    body = r.json()
    assert body["rejected"] == 2 and body["accepted"] == 0
    assert [(e["index"], e["field"]) for e in body["errors"]] == [(5, "ooms"), (6, "run")]
    assert stored_count(collector) == 0
    assert collector.client.get("/api/v1/runs").json() == []


def test_oversize_bodies_and_gzip_bombs_get_413(tmp_path) -> None:
    import gzip

    with BackgroundServer(str(tmp_path / "vw.db"), max_body_bytes=64 * 1024,
                          max_decompressed_bytes=1024 * 1024) as srv:
        with httpx.Client(base_url=srv.url) as client:
            big = ndjson([make_sample(i) for i in range(1000)])
            assert len(big) > 64 * 1024
            r = client.post("/api/v1/samples", content=big, headers=NDJSON_HEADERS)
            assert r.status_code == 413 and "body" in r.json()["detail"]
            bomb = gzip.compress(b" " * (50 * 1024 * 1024))
            r = client.post("/api/v1/samples", content=bomb, headers={"content-encoding": "gzip", **NDJSON_HEADERS})
            assert r.status_code == 413 and "exceeds" in r.json()["detail"]
        with sqlite3.connect(srv.settings.db_path) as conn:
            assert conn.execute("SELECT count(*) FROM samples").fetchone()[0] == 0


def test_read_api_errors_name_the_parameter(collector) -> None:
    post(collector, [make_sample(i) for i in range(3)])
    r = collector.client.get("/api/v1/runs/nope/ranks")
    assert r.status_code == 404 and "run" in r.json()["detail"]
    r = collector.client.get("/api/v1/runs/run-a/series", params={"rank": 0, "fields": "bogus"})
    assert r.status_code == 422 and "fields" in r.json()["detail"]
    r = collector.client.get("/api/v1/runs/run-a/series", params={"rank": -1})
    assert r.status_code == 422
    r = collector.client.get("/api/v1/runs/run-a/series", params={"rank": 0, "x": "bogus"})
    assert r.status_code == 422


def test_series_downsampling_keeps_the_biggest_spike(collector) -> None:
    samples = [make_sample(i, peak_allocated_bytes=110 * GiB + (i % 7) * GiB) for i in range(20000)]
    samples[12345]["peak_allocated_bytes"] = 140 * GiB
    for start in range(0, len(samples), 5000):
        assert post(collector, samples[start:start + 5000], gzip_body=True).status_code == 200
    data = collector.client.get(
        "/api/v1/runs/run-a/series", params={"rank": 0, "fields": "peak_allocated_bytes", "points": 500}
    ).json()
    assert data["downsampled"] and data["raw_points"] == 20000 and len(data["x"]) <= 500
    peaks = data["series"]["peak_allocated_bytes"]
    assert max(peaks) == 140 * GiB and data["x"][peaks.index(140 * GiB)] == 12345
    zoom = collector.client.get(
        "/api/v1/runs/run-a/series",
        params={"rank": 0, "fields": "peak_allocated_bytes", "start": 12300, "end": 12400},
    ).json()
    assert zoom["x"] == list(range(12300, 12401)) and not zoom["downsampled"]


def test_state_is_rebuilt_from_the_database_after_restart(tmp_path) -> None:
    db = str(tmp_path / "vw.db")
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:
        client.post("/api/v1/samples", content=ndjson([make_sample(i, rank=r) for r in range(2) for i in range(50)]),
                    headers=NDJSON_HEADERS)
        before = client.get("/api/v1/runs/run-a/ranks").json()
    with BackgroundServer(db) as srv, httpx.Client(base_url=srv.url) as client:
        after = client.get("/api/v1/runs/run-a/ranks").json()
        assert [(r["rank"], r["last_step"], r["samples"], r["verdict"]) for r in after] == [
            (r["rank"], r["last_step"], r["samples"], r["verdict"]) for r in before
        ]
        r = client.post("/api/v1/samples", content=ndjson([make_sample(49, rank=0)]), headers=NDJSON_HEADERS)
        assert r.json()["duplicates"] == 1


def test_large_responses_are_gzipped_for_clients_that_ask(collector) -> None:
    post(collector, [make_sample(0, rank=r, uuid=f"GPU-{r:04d}", ts=time.time()) for r in range(200)])
    r = collector.client.get("/metrics", headers={"accept-encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert r.text.count("vramwatch_memory_reserved_bytes{") == 200  # httpx inflated it
    plain = collector.client.get("/metrics", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers and len(plain.content) > 16 * 1024


# ------------------------------------------------------------------ deaths stay visible


def _live_with(samples_by_time):
    from vramwatch.collector.state.live import LiveState

    live = LiveState()
    for received_at, samples in samples_by_time:
        live.ingest(samples, received_at=received_at)
    return live


def _rows_at(live, now, run="run-a"):
    from vramwatch.collector.state.rows import rank_rows

    return {r["rank"]: r for r in rank_rows(live.freeze(run, now, events=50))}


def test_an_oom_and_restart_stick_to_the_rank_and_the_run() -> None:
    t0 = 1_760_000_000.0
    first = [make_sample(i, rank=r, ts=t0 + i) for r in range(4) for i in range(50)]
    oom = [make_sample(50, rank=2, ts=t0 + 50, ooms=1)]
    again = [make_sample(i, rank=2, ts=t0 + i, incarnation="restart-1") for i in range(51, 60)]
    live = _live_with([(t0 + 49, first), (t0 + 50, oom), (t0 + 60, again)])
    rows = _rows_at(live, t0 + 61)
    assert rows[2]["ooms"] == 1 and rows[2]["restarts"] == 1 and rows[2]["liveness"] == "live"
    assert rows[2]["died"] is None and rows[2]["deaths"] == 1 and rows[2]["outcome"] == "running"
    assert rows[0]["ooms"] == 0 and rows[2]["severity"] > rows[0]["severity"]
    run = live.run_summaries(now=t0 + 61)[0]
    assert run["ooms"] == 1 and run["restarts"] == 1 and run["status"] == "running" and run["worst_rank"] == 2
    # every rank closes cleanly: the run recovered from its OOM (not "finished", not "crashed")
    live.ingest([{**make_sample(59, rank=r, ts=t0 + 60, incarnation="restart-1" if r == 2 else ""), "seq": 1,
                  "exit": True} for r in range(4)], received_at=t0 + 61)
    assert live.run_summaries(now=t0 + 700)[0]["status"] == "recovered"
    assert {r["liveness"] for r in _rows_at(live, t0 + 700).values()} == {"exited"}


def test_a_dead_rank_is_dead_sorts_worst_and_has_no_time_to_oom() -> None:
    t0 = 1_760_000_000.0
    early = [make_sample(i, rank=r, ts=t0 + i) for r in range(3) for i in range(20)]
    later = [make_sample(i, rank=r, ts=t0 + i) for r in (0, 1) for i in range(20, 400)]
    live = _live_with([(t0 + 20, early), (t0 + 400, later)])
    rows = _rows_at(live, t0 + 401)
    assert rows[2]["liveness"] == "dead" and rows[0]["liveness"] == "live"
    assert rows[2]["severity"] > max(rows[0]["severity"], rows[1]["severity"])
    assert rows[2]["verdict"]["seconds_to_oom"] is None and rows[2]["died"] == {"cause": "killed", "step": 19,
                                                                                "ts": t0 + 19, **NO_WORDS}
    run = live.run_summaries(now=t0 + 401)[0]
    assert run["dead_ranks"] == 1 and run["worst_rank"] == 2 and run["status"] == "running"
    # the run ends with no clean close: it crashed, and the killed rank is still the one killed
    assert live.run_summaries(now=t0 + 1000)[0]["status"] == "crashed"
    rows = _rows_at(live, t0 + 5000)
    assert rows[2]["died"]["cause"] == "killed" and {rows[0]["died"]["cause"], rows[1]["died"]["cause"]} == {"stopped"}


def test_a_clean_exit_is_exited_not_silent_and_the_run_finishes() -> None:
    t0 = 1_760_000_000.0
    samples = [make_sample(i, rank=r, ts=t0 + i) for r in range(2) for i in range(10)]
    # the hook's clean close: a copy of the last train sample (same step, next seq) marked exit
    closing = [{**make_sample(9, rank=r, ts=t0 + 10), "seq": 1, "exit": True} for r in range(2)]
    live = _live_with([(t0 + 10, samples), (t0 + 11, closing)])
    assert [r["liveness"] for r in _rows_at(live, t0 + 12).values()] == ["exited", "exited"]
    assert live.run_summaries(now=t0 + 12)[0]["status"] == "finished"


def test_the_silent_rule_reads_the_models_window_of_each_rank(collector) -> None:
    """The alert, /metrics, /ranks and the model use one window per rank: its cadence's."""
    import re
    from pathlib import Path

    from vramwatch import verdicts

    rules = (Path(__file__).resolve().parents[2] / "deploy/prometheus/rules/vramwatch.rules.yml").read_text()
    block = rules[rules.index("alert: VramwatchHookSilent"):]
    block = block[:block.index("- alert:", 10)]
    assert "vramwatch_last_received_timestamp_seconds > vramwatch_silence_window_seconds" in block
    assert "< max by (run) (vramwatch_silence_window_seconds)" in block
    now = time.time()
    for rank, step_s in ((0, 6.0), (1, 0.5)):
        samples = [make_sample(i, run="cadence", rank=rank, ts=now - 40 * step_s + i * step_s,
                               step_time_s=step_s if i else None) for i in range(40)]
        assert collector.client.post("/api/v1/samples", content=ndjson(samples), headers=NDJSON_HEADERS).is_success
    rows = {r["rank"]: r for r in collector.client.get("/api/v1/runs/cadence/ranks").json()}
    assert rows[0]["silence_window_s"] == verdicts.silence_window(6.0) == 60.0
    assert rows[1]["silence_window_s"] == verdicts.SILENT_FLOOR_S and rows[1]["cadence_s"] == pytest.approx(0.5)
    text = collector.client.get("/metrics").text
    exposed = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'vramwatch_silence_window_seconds\{run="cadence",rank="(\d+)"[^}]*\} (\S+)', text)}
    assert exposed == {0: 60.0, 1: verdicts.SILENT_FLOOR_S}


def test_runs_and_ranks_over_http_carry_status_liveness_and_ooms(collector) -> None:
    import time as _time

    now = _time.time()
    post(collector, [make_sample(i, rank=r, ts=now - 20 + i) for r in range(2) for i in range(10)])
    post(collector, [make_sample(10, rank=1, ts=now - 5, ooms=1)])
    runs = collector.client.get("/api/v1/runs").json()
    assert runs[0]["status"] == "running" and runs[0]["ooms"] == 1
    ranks = collector.client.get("/api/v1/runs/run-a/ranks").json()
    assert [(r["rank"], r["liveness"], r["ooms"]) for r in ranks] == [(0, "live", 0), (1, "dead", 1)]
    assert ranks[1]["died"]["cause"] == "oom" and ranks[1]["verdict"]["seconds_to_oom"] is None


def test_a_rank_that_goes_on_after_an_oom_keeps_the_count_but_is_not_dead() -> None:
    t0 = 1_760_000_000.0
    live = _live_with([(t0 + 5, [make_sample(i, ts=t0 + i) for i in range(5)]),
                       (t0 + 6, [make_sample(5, ts=t0 + 5, ooms=1)])])
    row = _rows_at(live, t0 + 7)[0]
    assert row["died"] == {"cause": "oom", "step": 5, "ts": t0 + 5, **NO_WORDS} and row["liveness"] == "dead"
    live.ingest([make_sample(i, ts=t0 + i, ooms=1) for i in range(6, 9)], received_at=t0 + 9)
    row = _rows_at(live, t0 + 10)[0]
    assert row["died"] is None and row["ooms"] == 1 and row["liveness"] == "live"


def _bad_bodies() -> list[tuple[str, bytes, bool]]:
    """(what, body, gzipped): bodies the one-pass decoder does not take whole."""
    good = [make_sample(i, rank=1) for i in range(3)]  # the test's collector takes at most 3 per batch
    padded = ndjson(good[:1])[:-2] + b" " * (70 * 1024) + b"}\n"  # valid JSON, line over the 64 KiB cap
    return [
        ("bad field", ndjson([*good[:2], make_sample(2, rank=1, ooms=-1)]), True),
        ("unknown field", ndjson([*good[:2], make_sample(3, rank=1, bogus=1)]), False),
        ("not JSON", ndjson(good[:2]) + b"{not json\n", True),
        ("from the future", ndjson([make_sample(0, rank=1, ts=4_000_000_000.0)]), False),
        ("array of arrays", orjson.dumps([[make_sample(0)]]), False),
        ("blank body", b"\n \n", False),
        ("bad gzip", b"\x1f\x8b" + b"junk" * 10, True),
        ("line too long", padded, False),
        ("too many samples", ndjson([make_sample(i, rank=1) for i in range(4)]), True),
    ]


def test_bad_bodies_are_refused_the_same_by_the_one_pass_decoder_and_line_by_line(tmp_path, monkeypatch) -> None:
    """Each block is decoded in one C pass; one with a refused sample is parsed again line by line
    to name it. Forcing every block through the line-by-line parse changes no reply."""
    from vramwatch.collector.ingest import body as body_module

    cases = _bad_bodies()
    import re

    replies: dict[bool, list[tuple[int, str]]] = {}
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(body_module, "decode_samples", lambda *args, **kwargs: None)
        with BackgroundServer(str(tmp_path / f"vw-{fast}.db"), max_batch_samples=3) as srv, \
                httpx.Client(base_url=srv.url, timeout=10) as client:
            srv.client = client  # type: ignore[attr-defined]
            ok = post(srv, [make_sample(i) for i in range(3)], gzip_body=True)
            assert ok.status_code == 200 and ok.json()["accepted"] == 3
            replies[fast] = []
            for what, body, gzipped in cases:
                headers = {**NDJSON_HEADERS, **({"content-encoding": "gzip"} if gzipped else {})}
                r = client.post("/api/v1/samples", content=gz(body) if gzipped and what != "bad gzip" else body,
                                headers=headers)
                assert r.status_code in (400, 413, 422), (what, r.status_code, r.text)
                # the clock moves between the two collectors: "is N s in the future" differs by a second
                replies[fast].append((r.status_code, re.sub(r"is \d+ s in", "is N s in", r.text)))
            assert stored_count(srv) == 3  # nothing half-written
            codes = srv.app.state.ingest_metrics.requests
            assert sum(codes.labels(code=str(c))._value.get() for c in (200, 400, 413, 422)) == 1 + len(cases)
    assert replies[True] == replies[False]
    by_case = {c[0]: (code, orjson.loads(text)) for c, (code, text) in zip(cases, replies[True], strict=True)}
    assert by_case["bad field"][0] == 422 and by_case["bad field"][1]["errors"][0]["index"] == 2
    assert by_case["bad field"][1]["errors"][0]["field"] == "ooms"
    assert by_case["unknown field"][1]["errors"][0]["field"] == "bogus"
    assert by_case["from the future"][1]["errors"][0]["field"] == "ts"
    assert by_case["line too long"][0] == 413 and by_case["too many samples"][0] == 413
    assert by_case["not JSON"][0] == 400 and "line 3" in by_case["not JSON"][1]["detail"]


def test_a_serving_collector_collects_its_young_generation_less_often(tmp_path) -> None:
    """Full collections paused a 4,096-rank collector for up to 190 ms (docs/reliability.md):
    the app raises the young threshold once, and never lowers a higher one."""
    import gc

    from vramwatch.collector.state.live import GC_YOUNG_THRESHOLD

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, before[1], before[2])
        with BackgroundServer(str(tmp_path / "vw.db")):
            assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        gc.set_threshold(50_000, before[1], before[2])
        with BackgroundServer(str(tmp_path / "vw.db")):
            assert gc.get_threshold()[0] == 50_000
    finally:
        gc.set_threshold(*before)


def test_a_hook_sized_body_is_decoded_once_on_the_event_loop_and_a_bigger_one_once_in_a_thread(
        collector, monkeypatch) -> None:
    """Where decoding runs (ingest.INLINE_BYTES, the one threshold): a hook's batch on the event loop
    (no thread hop), bad or good; past 1 MiB of text in a worker thread (so a big body never freezes
    /healthz). Each body is decoded once, except a gzip body whose trailer understates its size."""
    import asyncio
    import random

    from vramwatch.collector.ingest import routes as ingest

    where: list[bool] = []

    def traced(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            where.append(True)
        except RuntimeError:
            where.append(False)
        return decode_body(*args, **kwargs)

    decode_body = ingest.decode_body
    monkeypatch.setattr(ingest, "decode_body", traced)
    rng = random.Random(7)

    def batch(start: int, n: int, **overrides) -> list[dict]:
        return [make_sample(i, allocated_bytes=100 * GiB + rng.randrange(GiB), **overrides)
                for i in range(start, start + n)]

    hook_sized = batch(0, 1000)
    assert len(ndjson(hook_sized)) < ingest.INLINE_BYTES
    r = post(collector, hook_sized, gzip_body=True)
    assert r.status_code == 200 and r.json()["accepted"] == 1000
    assert where == [True]

    where.clear()
    big = batch(1000, 4000)
    assert len(ndjson(big)) > ingest.INLINE_BYTES
    r = post(collector, big, gzip_body=True)
    assert r.status_code == 200 and r.json()["accepted"] == 4000
    assert where == [False]

    where.clear()
    bad = batch(5000, 1000)
    bad[500]["reserved_bytes"] = -1
    r = post(collector, bad, gzip_body=True)
    assert r.status_code == 422 and "sample 500: reserved_bytes" in r.json()["detail"]
    assert where == [True]

    where.clear()  # two gzip members: the trailer declares the last one's size only
    members = batch(6000, 4000)
    assert len(ndjson(members)) > ingest.INLINE_BYTES
    body = gz(ndjson(members[:3999])) + gz(ndjson(members[3999:]))
    r = collector.client.post("/api/v1/samples", content=body,
                              headers={**NDJSON_HEADERS, "content-encoding": "gzip"})
    assert r.status_code == 200 and r.json()["accepted"] == 4000
    assert where == [True, False]
    assert stored_count(collector) == 9000  # the refused batch: nothing


def test_every_json_write_route_refuses_another_content_type_naming_the_header(collector) -> None:
    """Every POST route of the collector but the snapshot upload (gzip bytes) takes JSON only: no
    content type, text/plain, a form or multipart is a 415 naming ``content-type``, and changes
    nothing (a browser's cross-site "simple" POST never reaches a handler)."""
    from test_input_inventory import route_keys

    now = time.time()
    assert post(collector, [make_sample(0, run="job", ts=now)]).status_code == 200
    posts = sorted(key.split(" ", 1)[1] for key in route_keys(collector.app.routes) if key.startswith("POST "))
    assert posts == ["/api/v1/processes", "/api/v1/runs/{run}/capture", "/api/v1/samples", "/api/v1/snapshots"]
    bodies = {"/api/v1/processes": {"run": "job", "host": "node-1", "rank": 0, "ts": now,
                                    "processes": [{"pid": 7, "used_bytes": GiB, "name": "other"}]},
              "/api/v1/runs/{run}/capture": {"rank": 0, "steps": 1},
              "/api/v1/samples": make_sample(1, run="job", ts=now)}
    done = {}
    for path, body in bodies.items():
        url = path.replace("{run}", "job")
        for media in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b"):
            r = collector.client.post(url, content=orjson.dumps(body), headers={"content-type": media} if media else {})
            assert r.status_code == 415 and r.json()["detail"].startswith("content-type: "), (url, media, r.text)
        r = collector.client.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 200, (url, r.text)
        done[path] = r.json()
    assert stored_count(collector) == 2 and done["/api/v1/runs/{run}/capture"]["directives"] == 1
    assert len(collector.app.state.processes.run("job")) == 1
