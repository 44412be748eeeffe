"""Schema 1: validation rules, body parsing, trace files."""

from __future__ import annotations

import gzip
import math

import orjson
import pytest
from helpers import GiB, make_sample

from vramwatch import wire
from vramwatch.wire import WireError, validate


def test_valid_sample_round_trips_unchanged() -> None:
    s = make_sample(7, uuid="GPU-1234", gpu=3, extra={"loss": 1.5, "lr": 3e-4}, incarnation="abc")
    assert validate(s) == s
    assert validate(orjson.loads(wire.encode(s))) == s


def test_whole_floats_become_ints_and_null_nvml_is_kept() -> None:
    s = make_sample(allocated_bytes=float(10 * GiB), nvml_used_bytes=None)
    out = validate(s)
    assert out["allocated_bytes"] == 10 * GiB and type(out["allocated_bytes"]) is int
    assert out["nvml_used_bytes"] is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"schema": 2}, "schema"),
        ({"schema": True}, "schema"),
        ({"allocated_bytes": -1}, "allocated_bytes"),
        ({"reserved_bytes": "12"}, "reserved_bytes"),
        ({"allocated_bytes": 130 * GiB}, "allocated_bytes"),  # > reserved
        ({"peak_allocated_bytes": 1}, "peak_allocated_bytes"),  # < allocated
        ({"reserved_bytes": 200 * GiB, "peak_allocated_bytes": 200 * GiB, "allocated_bytes": 150 * GiB},
         "reserved_bytes"),  # > total
        ({"nvml_used_bytes": 10**12}, "nvml_used_bytes"),
        ({"total_bytes": 0}, "total_bytes"),
        ({"ts": math.nan}, "ts"),
        ({"ts": 12.0}, "ts"),
        ({"step": 2**60}, "step"),
        ({"step": 1.5}, "step"),
        ({"run": ""}, "run"),
        ({"run": "x" * 200}, "run"),
        ({"host": "a\nb"}, "host"),
        ({"phase": "check point!"}, "phase"),
        ({"alocated_bytes": 1}, "alocated_bytes"),
        ({"extra": {"loss": "high"}}, "extra.loss"),
        ({"extra": [1, 2]}, "extra"),
        ({"allocator": "mystery"}, "allocator"),
        ({"alloc_retries": True}, "alloc_retries"),
    ],
)
def test_impossible_samples_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(WireError) as info:
        validate(make_sample(**overrides))
    assert info.value.field == field


def test_missing_required_field_is_named() -> None:
    s = make_sample()
    del s["ooms"]
    with pytest.raises(WireError, match="ooms: is required"):
        validate(s)


def test_async_allocator_may_report_allocated_above_reserved() -> None:
    s = make_sample(allocated_bytes=121 * GiB, peak_allocated_bytes=121 * GiB, allocator="cudaMallocAsync")
    assert validate(s)["allocated_bytes"] == 121 * GiB


def test_future_timestamps_rejected_only_against_a_clock() -> None:
    s = make_sample(ts=2_000_000_000.0)
    assert validate(s)["ts"] == 2_000_000_000.0
    with pytest.raises(WireError, match="future"):
        validate(s, now=1_900_000_000.0)


def test_parse_body_accepts_array_object_and_ndjson() -> None:
    a, b = make_sample(1), make_sample(2)
    assert wire.parse_body(orjson.dumps([a, b])) == [a, b]
    assert wire.parse_body(wire.encode_lines([a, b])) == [a, b]
    assert wire.parse_body(b"\n" + orjson.dumps(a) + b"\n\n") == [a]
    with pytest.raises(WireError, match="line 2"):
        wire.parse_body(orjson.dumps(a) + b"\n{oops\n")
    with pytest.raises(WireError, match="empty"):
        wire.parse_body(b"   ")


def test_gunzip_refuses_bombs_and_garbage() -> None:
    bomb = gzip.compress(b"\0" * (10 * 1024 * 1024))
    assert len(bomb) < 20_000
    with pytest.raises(WireError, match="exceeds"):
        wire.gunzip_limited(bomb, 1024 * 1024)
    with pytest.raises(WireError, match="gzip"):
        wire.gunzip_limited(b"not gzip at all", 1024)
    with pytest.raises(WireError, match="truncated"):
        wire.gunzip_limited(gzip.compress(b"x" * 1000)[:-12], 1 << 20)
    assert wire.gunzip_limited(gzip.compress(b"hello"), 10) == b"hello"


@pytest.mark.parametrize("name", ["trace.jsonl", "trace.jsonl.gz"])
def test_trace_files_round_trip(tmp_path, name: str) -> None:
    samples = [make_sample(i) for i in range(50)]
    path = tmp_path / name
    wire.write_file(path, samples)
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert list(wire.iter_samples(path)) == samples


def test_bad_line_in_a_trace_names_file_line_and_field(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(wire.encode_lines([make_sample(0), make_sample(1, ooms=-3)]))
    with pytest.raises(WireError) as info:
        list(wire.iter_samples(path))
    assert str(path) in str(info.value) and ":2: ooms" in str(info.value)


def test_fast_path_accepts_exactly_what_the_full_check_accepts() -> None:
    """validate() short-cuts canonical samples; the short cut must never accept more."""
    import random

    from vramwatch.probe.simulated import simulate_trace
    from vramwatch.wire import _plainly_valid, _validate_slow

    rng = random.Random(7)
    samples = list(simulate_trace("fragmentation", steps=300, run="r", host="h", rank=1, seed=3))
    samples += [make_sample(i, extra={"loss": 1.0 * i, "tokens_seen": i}) for i in range(50)]
    mutations = [
        ("allocated_bytes", -1), ("reserved_bytes", 0), ("ts", 5.0), ("ts", 1_700_000_000), ("phase", "bad phase"),
        ("phase", ["train"]), ("run", {"a": 1}),
        ("run", ""), ("host", "x\ty"), ("uuid", 3), ("extra", {"a": "b"}), ("extra", {"a": float("inf")}),
        ("step_time_s", -1.0), ("allocator", "cudaMallocAsync"), ("nvml_used_bytes", 10**15), ("gpu", True),
        ("peak_allocated_bytes", 0), ("schema", 1.0), ("tokens", None), ("bogus", 1),
    ]
    checked = fast = 0
    for s in samples:
        for _ in range(3):
            candidate = dict(s)
            name, value = rng.choice(mutations)
            if rng.random() < 0.7:
                candidate[name] = value
            try:
                slow = _validate_slow(dict(candidate), None, 300.0)
            except WireError:
                slow = None
            if _plainly_valid(candidate):
                fast += 1
                assert slow == candidate, (name, value)
            checked += 1
    assert checked > 1000 and fast > 100
