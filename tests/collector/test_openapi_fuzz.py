"""Bad input, generated: schemathesis against the collector's own OpenAPI document (0 server
errors, nothing half-stored) and hypothesis for the wire parser and the trend engine (the
awkward values posted to ingest, NaN to gzip tricks: test_ingest.py)."""

from __future__ import annotations

import gzip
import time
from typing import Any

import orjson
import pytest
import schemathesis
from helpers import GiB, stored
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from vramwatch import wire
from vramwatch.collector.ingest import body as wire_body
from vramwatch.engine import STATES, EngineConfig, TrendEngine

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


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
            before = stored(server.settings.db_path) if case.method.upper() == "POST" else None
            response = case.call(base_url=server.url, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                f"{response.text[:200]}")
            if before is not None and response.status_code != 200:
                assert stored(server.settings.db_path) == before, "a refused request stored something"

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
