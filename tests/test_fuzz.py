"""Bad input, generated: schemathesis against the collector's own OpenAPI document (0 server
errors, nothing half-stored), hypothesis for the wire parser and the trend engine, and the
awkward values (NaN, infinities, huge integers, unicode names, clocks far off, gzip tricks)."""

from __future__ import annotations

import contextlib
import gzip
import math
import sqlite3
import time
import urllib.parse
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
from helpers import H200_TOTAL, NDJSON_HEADERS, GiB, make_sample, ndjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from vramwatch import wire
from vramwatch.collector import body as wire_body
from vramwatch.collector.server import BackgroundServer
from vramwatch.engine import STATES, EngineConfig, TrendEngine
from vramwatch.probe.simulated import simulate_trace

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz") / "vw.db"
    with BackgroundServer(str(db)) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        now = time.time()
        for rank, scenario in enumerate(("healthy", "checkpoint", "slow_leak")):
            trace = [{**s, "ts": now - 3000 + i} for i, s in
                     enumerate(simulate_trace(scenario, steps=1500, run="fuzz", rank=rank))]
            assert client.post("/api/v1/samples", content=ndjson(trace), headers=NDJSON_HEADERS).status_code == 200
        srv.client = client  # type: ignore[attr-defined]
        yield srv


def count(srv) -> int:
    with contextlib.closing(sqlite3.connect(srv.settings.db_path)) as conn:
        return conn.execute("SELECT count(*) FROM samples").fetchone()[0]


# ------------------------------------------------------------------ schemathesis: the OpenAPI document


def _operations(srv) -> list[Any]:
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_document_describes_every_route_and_the_sample_body(server) -> None:
    spec = server.client.get("/openapi.json").json()
    sample = spec["components"]["schemas"]["Sample"]
    assert set(sample["required"]) == set(wire.REQUIRED_NAMES)
    assert set(sample["properties"]) == set(wire.FIELDS)
    ops = {(op.method.upper(), op.path) for op in _operations(server)}
    assert {("POST", "/api/v1/samples"), ("GET", "/api/v1/runs"), ("GET", "/api/v1/runs/{run}/series"),
            ("GET", "/metrics"), ("GET", "/healthz")} <= ops


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_schemathesis_finds_no_server_error_and_nothing_half_stored(server, mode) -> None:
    failures: list[str] = []
    statuses: dict[int, int] = {}
    for op in _operations(server):
        strategies = [op.as_strategy(generation_mode=mode)]
        if "{run}" in op.path:  # also aim at a run that exists, so the handlers do real work
            strategies.append(op.as_strategy(generation_mode=mode, path_parameters={"run": "fuzz"}))

        @settings(FUZZ, max_examples=40 if op.method.upper() == "GET" else 120)
        @given(case=st.one_of(strategies))
        def run(case) -> None:
            before = count(server) if case.method.upper() == "POST" else None
            response = case.call(base_url=server.url, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                f"{response.text[:200]}")
            if before is not None and response.status_code != 200:
                assert count(server) == before, "a refused request stored something"

        try:
            run()
        except Unsatisfiable:  # negative mode: an operation with nothing to break (e.g. /healthz)
            assert mode is GenerationMode.NEGATIVE
    assert not failures, failures[:5]
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0


# ------------------------------------------------------------------ hypothesis: wire format

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=10,
)


#: what a name may hold: no control, format (bidi, zero-width) or separator characters
VISIBLE = st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp"))


@st.composite
def valid_samples(draw) -> dict[str, Any]:
    total = draw(st.integers(min_value=1, max_value=2**53))
    reserved = draw(st.integers(min_value=0, max_value=total))
    allocated = draw(st.integers(min_value=0, max_value=reserved))
    names = st.text(VISIBLE, min_size=1, max_size=wire.MAX_NAME)
    sample = {
        "schema": 1, "run": draw(names), "host": draw(names), "rank": draw(st.integers(0, 100_000)),
        "step": draw(st.integers(0, 2**53)), "ts": draw(st.floats(wire.MIN_TS, 4e9)),
        "phase": draw(st.from_regex(r"\A[A-Za-z0-9_.:-]{1,32}\Z")),
        "allocated_bytes": allocated, "reserved_bytes": reserved,
        "peak_allocated_bytes": draw(st.integers(allocated, 2**53)),
        "inactive_split_bytes": draw(st.integers(0, 2**53)), "alloc_retries": draw(st.integers(0, 2**53)),
        "ooms": draw(st.integers(0, 2**53)), "total_bytes": total,
        "nvml_used_bytes": draw(st.none() | st.integers(0, total)),
    }
    if draw(st.booleans()):
        sample["incarnation"] = draw(names)
        sample["extra"] = draw(st.dictionaries(st.text(VISIBLE, min_size=1, max_size=64),
                                               st.floats(-1e15, 1e15), max_size=5))
    return sample


@FUZZ
@given(valid_samples())
def test_valid_samples_validate_and_round_trip_through_every_encoding(sample) -> None:
    assert wire.validate(sample) == sample
    body = wire.encode_lines([sample, sample])
    for data in (body, orjson.dumps([sample]), gzip.compress(body)):
        raw = wire_body.gunzip_limited(data, 10**7) if data[:2] == b"\x1f\x8b" else data
        decoded = [wire.validate(x) for x in wire_body.parse_body(raw)]
        assert all(d == sample for d in decoded)


@FUZZ
@given(valid_samples(), st.sampled_from(sorted(wire.FIELDS)), json_values)
def test_any_corrupted_field_is_a_wire_error_naming_it_or_a_valid_sample(sample, field, value) -> None:
    corrupted = {**sample, field: value}
    try:
        out = wire.validate(corrupted, now=time.time())
    except wire.WireError as exc:
        assert exc.field and exc.message  # names what is wrong; nothing else escapes
    else:
        assert set(out) <= set(wire.FIELDS)


@FUZZ
@given(st.binary(max_size=2000) | json_values.map(orjson.dumps))
def test_parser_only_ever_raises_wire_errors(data) -> None:
    for parse in (wire_body.parse_body, lambda d: wire_body.gunzip_limited(d, 10_000)):
        try:
            parse(data)
        except wire.WireError:
            pass


@FUZZ
@given(st.binary(min_size=0, max_size=5000), st.integers(1, 4000))
def test_gunzip_never_returns_more_than_its_limit(payload, limit) -> None:
    packed = gzip.compress(payload)
    try:
        out = wire_body.gunzip_limited(packed, limit)
    except wire.WireError as exc:
        assert len(payload) > limit and "exceeds" in exc.message
    else:
        assert out == payload and len(out) <= limit


# ------------------------------------------------------------------ hypothesis: the engine


@st.composite
def sample_streams(draw) -> list[dict[str, Any]]:
    """Valid samples in arrival order, with restarts, counters going backwards, phases,
    gaps, step repeats and memory that does anything a device allows."""
    total = 80 * GiB
    n = draw(st.integers(1, 400))
    out, step, incarnation = [], 0, "a"
    retries = ooms = 0
    alloc = draw(st.integers(0, total // 2))
    for _ in range(n):
        op = draw(st.sampled_from(["step"] * 12 + ["jump", "phase", "restart", "backwards", "gap", "same"]))
        if op == "restart":
            incarnation += "x"
            step = draw(st.integers(0, step))
        elif op == "backwards":  # counters reset without a new incarnation: a restart too
            retries, ooms = draw(st.integers(0, retries)), draw(st.integers(0, ooms))
        elif op == "gap":
            step += draw(st.integers(1, 100_000))
        elif op != "same":
            step += 1
        alloc = max(0, min(total - GiB, alloc + draw(st.integers(-GiB, GiB))))
        reserved = min(total, alloc + draw(st.integers(0, 4 * GiB)))
        retries += draw(st.integers(0, 1))
        ooms += draw(st.sampled_from([0] * 20 + [1]))
        out.append({
            "schema": 1, "run": "p", "host": "h", "rank": 0, "step": step, "ts": 1.7e9 + len(out),
            "phase": "checkpoint" if op == "phase" else "train", "allocated_bytes": alloc,
            "reserved_bytes": reserved, "peak_allocated_bytes": min(reserved, alloc + draw(st.integers(0, GiB))),
            "inactive_split_bytes": draw(st.integers(0, reserved - alloc)), "alloc_retries": retries,
            "ooms": ooms, "nvml_used_bytes": draw(st.none() | st.just(min(total, reserved + GiB // 2))),
            "total_bytes": total, "incarnation": incarnation,
        })
    return out


@settings(FUZZ, max_examples=50)
@given(sample_streams(), st.sampled_from([EngineConfig(), EngineConfig(block_steps=4, min_blocks=3, max_events=8)]))
def test_engine_takes_any_sequence_of_valid_samples(stream, config) -> None:
    engine = TrendEngine(config)
    previous: dict[str, Any] | None = None
    for sample in stream:
        assert wire.validate(sample) == sample  # the generator only makes valid samples
        events = engine.update(sample)
        assert engine.state in STATES
        assert len(engine.events) <= config.max_events
        if previous is not None and sample["phase"] == "train" and (
            sample["alloc_retries"] < previous["alloc_retries"] or sample["ooms"] < previous["ooms"]
        ):
            # monotone counters going backwards mean the process restarted
            assert "restart" in [e["type"] for e in events], (previous, sample, events)
        if sample["phase"] == "train":
            previous = sample
        for event in events:
            assert isinstance(event["type"], str) and "step" in event
    summary = engine.summary()
    assert summary["state"] in STATES
    orjson.dumps(summary, option=orjson.OPT_SERIALIZE_NUMPY)  # the API can always serve it


# ------------------------------------------------------------------ the awkward values, over HTTP


def _post(srv, body: bytes, headers: dict | None = None) -> httpx.Response:
    return srv.client.post("/api/v1/samples", content=body, headers={**NDJSON_HEADERS, **(headers or {})})


AWKWARD = [
    # (description, raw body, expected status, text in the detail)
    ("NaN literal", b'{"schema":1,"allocated_bytes":NaN}', 400, "invalid JSON"),
    ("Infinity literal", orjson.dumps(make_sample()).replace(b'"ts":', b'"ts":Infinity,"x":'), 400, "invalid JSON"),
    ("minus Infinity", orjson.dumps(make_sample()).replace(b'"ooms":0', b'"ooms":-Infinity'), 400, "invalid JSON"),
    ("1e999 overflows to inf", orjson.dumps(make_sample()).replace(b'"step":0', b'"step":1e999'), 400, "JSON"),
    ("2**64", orjson.dumps(make_sample()).replace(b'"step":0', b'"step":18446744073709551616'), 422, "step"),
    ("10**400", orjson.dumps(make_sample()).replace(b'"step":0', b'"step":1' + b"0" * 400), 400, "JSON"),
    ("2**53 + 1", orjson.dumps(make_sample(step=2**53 + 1)), 422, "step"),
    ("-2**63", orjson.dumps(make_sample(rank=-(2**63))), 422, "rank"),
    ("1e300 bytes", orjson.dumps(make_sample()).replace(b'"alloc_retries":0', b'"alloc_retries":1e300'), 422,
     "alloc_retries"),
    ("fractional step", orjson.dumps(make_sample(step=1.5)), 422, "step"),
    ("bool as count", orjson.dumps(make_sample(ooms=True)), 422, "ooms"),
    ("129-character run", orjson.dumps(make_sample(run="r" * 129)), 422, "run"),
    ("empty host", orjson.dumps(make_sample(host="")), 422, "host"),
    ("lone surrogate", b'{"schema":1,"run":"\\ud800"}', 400, "invalid JSON"),
    ("bidi control in run", orjson.dumps(make_sample(run="a\u202eb\x1b")), 422, "run"),
    ("ts 6 minutes ahead", None, 422, "future"),
    ("ts in 1999", orjson.dumps(make_sample(ts=915148800.0)), 422, "2000"),
    ("ts in milliseconds", orjson.dumps(make_sample(ts=time.time() * 1000)), 422, "future"),
    ("extra NaN-free but huge", orjson.dumps(make_sample(extra={"loss": 1e300})), 422, "extra.loss"),
    ("gzip of gzip", gzip.compress(gzip.compress(ndjson([make_sample()]))), 400, "JSON"),
    ("gzip then garbage", gzip.compress(ndjson([make_sample()])) + b"trailing", 400, "trailing"),
    ("truncated gzip", gzip.compress(ndjson([make_sample(i) for i in range(50)]))[:-20], 400, "gzip"),
]


@pytest.mark.parametrize(("desc", "body", "status", "needle"), AWKWARD, ids=[a[0] for a in AWKWARD])
def test_awkward_values_are_a_clear_4xx_and_store_nothing(server, desc, body, status, needle) -> None:
    if body is None:
        body = orjson.dumps(make_sample(ts=time.time() + 360))
    headers = {"content-encoding": "gzip"} if body[:2] == b"\x1f\x8b" else {}
    before = count(server)
    r = _post(server, body, headers)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"], r.json()["detail"]
    assert count(server) == before


def test_unicode_names_are_stored_and_served_unchanged(server) -> None:
    names = ["训练-运行", "🚀 run/1", "naïve café", "ראשון", "a" * 128, "x<y>&\"'"]
    now = time.time()
    batch = [make_sample(i, run=name, host=f"hôst-{i}", ts=now - 10, extra={"λ": 0.5}) for i, name in enumerate(names)]
    r = _post(server, ndjson(batch))
    assert r.status_code == 200 and r.json()["accepted"] == len(names)
    runs = {row["run"] for row in server.client.get("/api/v1/runs").json()}
    assert set(names) <= runs
    for i, name in enumerate(names):
        quoted = urllib.parse.quote(name, safe="")  # as the dashboard's encodeURIComponent
        ranks = server.client.get(f"/api/v1/runs/{quoted}/ranks")
        assert ranks.status_code == 200, name
        assert ranks.json()[0]["host"] == f"hôst-{i}" and ranks.json()[0]["last"]["extra"] == {"λ": 0.5}
        series = server.client.get(f"/api/v1/runs/{quoted}/series", params={"rank": 0})
        assert series.status_code == 200 and series.json()["x"] == [i], name


def test_clock_limits_are_inclusive_of_plausible_and_reject_the_rest(server) -> None:
    now = time.time()
    ok = [make_sample(0, run="clock", ts=now + 290), make_sample(1, run="clock", ts=946684801.0)]
    assert _post(server, ndjson(ok)).json()["accepted"] == 2  # slightly ahead, or very old: stored
    mixed = [make_sample(2, run="clock", ts=now), make_sample(3, run="clock", ts=now + 3600)]
    r = _post(server, ndjson(mixed))
    assert r.status_code == 422 and r.json()["errors"][0]["index"] == 1
    assert r.json()["errors"][0]["field"] == "ts"


def test_concatenated_gzip_members_are_one_body(server) -> None:
    now = time.time()
    first = gzip.compress(ndjson([make_sample(i, run="members", ts=now) for i in range(5)]))
    second = gzip.compress(ndjson([make_sample(i, run="members", ts=now) for i in range(5, 9)]))
    r = _post(server, first + second, {"content-encoding": "gzip"})
    assert r.status_code == 200 and r.json()["accepted"] == 9


def test_a_gzip_bomb_split_over_members_is_still_caught(tmp_path) -> None:
    with BackgroundServer(str(tmp_path / "vw.db"), max_decompressed_bytes=1024 * 1024) as srv, \
            httpx.Client(base_url=srv.url) as client:
        member = gzip.compress(b" " * (600 * 1024))  # each alone is under the limit
        r = client.post("/api/v1/samples", content=member * 3, headers={"content-encoding": "gzip", **NDJSON_HEADERS})
        assert r.status_code == 413 and "exceeds" in r.json()["detail"]


def test_finite_float_extremes_never_break_the_series_api(server) -> None:
    now = time.time()
    batch = [make_sample(i, run="extremes", ts=now - 5, step_time_s=v, extra={"v": v})
             for i, v in enumerate([0.0, 5e-324, 1e15, 1.7976931348623157e308 / 1e294])]
    assert _post(server, ndjson(batch)).status_code == 200
    r = server.client.get("/api/v1/runs/extremes/series", params={"rank": 0, "fields": "step_time_s"})
    assert r.status_code == 200
    values = r.json()["series"]["step_time_s"]
    assert all(math.isfinite(v) for v in values) and len(values) == 4
    assert H200_TOTAL > 0
