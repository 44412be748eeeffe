"""Schemas 1 and 2: validation rules, the field table and what derives from it, body parsing, trace files."""

from __future__ import annotations

import gzip
import math
import os

import orjson
import pytest
from helpers import H200_TOTAL, GiB, make_sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramwatch import wire
from vramwatch.collector.ingest import body as wire_body
from vramwatch.wire import WireError, validate
from vramwatch.wire.validate import _canonical, _refusal


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
        ({"schema": 3}, "schema"),
        ({"reserved_bytes": None}, "reserved_bytes"),  # schema 1: only NVML may be null
        ({"exit": 1}, "exit"),
        ({"foreign_used_bytes": 10**15}, "foreign_used_bytes"),
        ({"seq": -1}, "seq"),
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
    assert wire_body.parse_body(orjson.dumps([a, b])) == [a, b]
    assert wire_body.parse_body(wire.encode_lines([a, b])) == [a, b]
    assert wire_body.parse_body(b"\n" + orjson.dumps(a) + b"\n\n") == [a]
    with pytest.raises(WireError, match="line 2"):
        wire_body.parse_body(orjson.dumps(a) + b"\n{oops\n")
    with pytest.raises(WireError, match="empty"):
        wire_body.parse_body(b"   ")


def test_gunzip_refuses_bombs_and_garbage() -> None:
    bomb = gzip.compress(b"\0" * (10 * 1024 * 1024))
    assert len(bomb) < 20_000
    with pytest.raises(WireError, match="exceeds"):
        wire_body.gunzip_limited(bomb, 1024 * 1024)
    with pytest.raises(WireError, match="gzip"):
        wire_body.gunzip_limited(b"not gzip at all", 1024)
    with pytest.raises(WireError, match="truncated"):
        wire_body.gunzip_limited(gzip.compress(b"x" * 1000)[:-12], 1 << 20)
    assert wire_body.gunzip_limited(gzip.compress(b"hello"), 10) == b"hello"


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


def sparse_sample(step: int = 0, **overrides) -> dict:
    """Schema 2 with only what a dcgm-exporter series has: device used and capacity, plus allocated."""
    sample = {"schema": 2, "run": "sparse", "host": "node-1", "rank": 0, "step": step, "ts": 1_760_000_000.0 + step,
              "phase": "train", "allocated_bytes": 40 * GiB, "total_bytes": H200_TOTAL}
    sample.update(overrides)
    return {k: v for k, v in sample.items() if v is not ...}


#: (field, value) changes that make a valid sample odd, wrong or still valid in another form
MUTATIONS = [
    ("allocated_bytes", None), ("nvml_used_bytes", None), ("schema", 2), ("schema", 1), ("exit", 1),
    ("oom_marked", True), ("seq", None), ("host_rss_bytes", None), ("host_rss_bytes", 1.5),
    ("run", "a\u202eb"), ("host", "x\u200by"), ("uuid", "GPU\ufeff"), ("total_bytes", 1),
    ("allocated_bytes", -1), ("reserved_bytes", 0), ("ts", 5.0), ("ts", 1_700_000_000), ("phase", "bad phase"),
    ("phase", ["train"]), ("run", {"a": 1}),
    ("run", ""), ("host", "x\ty"), ("uuid", 3), ("extra", {"a": "b"}), ("extra", {"a": float("inf")}),
    ("step_time_s", -1.0), ("allocator", "cudaMallocAsync"), ("nvml_used_bytes", 10**15), ("gpu", True),
    ("peak_allocated_bytes", 0), ("schema", 1.0), ("tokens", None), ("bogus", 1),
    ("step", 7.0), ("rank", 2**53 + 1), ("run", "r" * 129), ("phase", "p" * 33), ("extra", {"k" * 65: 1}),
    ("extra", {"loss": 2**60}), ("extra", {"a\u2066": 1}), ("foreign_used_bytes", 10**15),
    ("foreign_used_bytes", None), ("allocator", None), ("exit", None), ("incarnation", "i:1"), ("phase", "ckpt:2"),
    ("step_time_s", 3), ("uuid", None), ("schema", 3), ("schema", True), ("ooms", True), ("oom_marked", 0),
    ("total_bytes", 0), ("reserved_bytes", H200_TOTAL + 1),
]


def agreement_corpus() -> list[dict]:
    from vramwatch.probe.simulated import simulate_trace

    samples = list(simulate_trace("fragmentation", steps=300, run="r", host="h", rank=1, seed=3))
    samples += [make_sample(i, extra={"loss": 1.0 * i, "tokens_seen": i}) for i in range(50)]
    samples += [make_sample(i, host_rss_bytes=i * 4096, exit=i == 3, seq=i % 2, foreign_used_bytes=0)
                for i in range(20)]
    samples += [sparse_sample(i, **extra) for i in range(20)
                for extra in ({}, {"reserved_bytes": None}, {"allocated_bytes": None, "nvml_used_bytes": GiB})]
    # at the bounds: nothing allocated on a device of capacity 0 (only the capacity is wrong)
    samples += [make_sample(i, allocated_bytes=0, reserved_bytes=0, peak_allocated_bytes=0, nvml_used_bytes=0,
                            total_bytes=0) for i in range(20)]
    return samples


def assert_paths_agree(candidate: dict) -> tuple[bool, bool]:
    """One acceptor, three forms, one message producer, on one candidate: ``validate`` (the dict,
    what the hook, importers and ingest's per-sample path use), ``decode_line`` (its JSON line,
    what analyze and trace files use) and ``decode_samples`` (a body of it) accept the same
    samples with the same values and types; the refusal message names a fault exactly when the
    Structs refuse (never the generic one, never a fault in an accepted sample)."""
    try:
        accepted = validate(dict(candidate))
    except WireError as exc:
        accepted = None
        assert exc.field != "sample" or "not accepted" not in exc.message, candidate
    fault = _refusal(dict(candidate), None, 300.0)
    assert (accepted is None) == (fault is not None), (candidate, fault)
    line = orjson.dumps(candidate)
    try:
        expected = validate(orjson.loads(line))
    except WireError:
        expected = None
    got = wire.decode_line(line)
    if got is not None:
        assert expected is not None, line
        assert orjson.dumps(got, option=orjson.OPT_SORT_KEYS) == orjson.dumps(expected, option=orjson.OPT_SORT_KEYS)
        assert list(got) == [f.name for f in wire.FIELD_TABLE if f.name in got]  # the table's order
        assert wire.decode_samples(line + b"\n" + line) == [got, got]
    elif expected is not None:  # refused as written: only a sample not in canonical form (rewritten)
        assert _canonical(candidate) is not None, line
    return accepted is not None, got is not None


def test_every_form_accepts_what_the_acceptor_accepts_and_a_refusal_names_its_field() -> None:
    """validate(), trace lines and bodies go through one acceptor; the message producer agrees with it."""
    import random

    rng = random.Random(7)
    checked = accepted = accepted_line = 0
    for s in agreement_corpus():
        for _ in range(3):
            candidate = dict(s)
            name, value = rng.choice(MUTATIONS)
            if rng.random() < 0.7:
                candidate[name] = value
            ok, line_ok = assert_paths_agree(candidate)
            accepted += ok
            accepted_line += line_ok
            checked += 1
    assert checked > 1000 and accepted > 200 and accepted_line > 200


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 2**54), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "train", "a:b", "x\u202ey", "native", "cudaMallocAsync", "n" * 129]),
    st.dictionaries(st.sampled_from(["loss", "", "a\u200b"]), st.one_of(st.integers(-2**60, 2**60), st.floats(),
                                                                      st.text(max_size=2)), max_size=3),
)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from(agreement_corpus()[::7]),
       changes=st.dictionaries(st.sampled_from([*wire.FIELDS, "bogus"]), _VALUES, max_size=3),
       drop=st.sets(st.sampled_from(list(wire.FIELDS)), max_size=2))
def test_every_form_and_the_refusal_agree_on_generated_samples(base: dict, changes: dict, drop: set) -> None:
    candidate = {k: v for k, v in base.items() if k not in drop}
    candidate.update(changes)
    assert_paths_agree(candidate)


def test_lines_not_accepted_as_written_are_rewritten_or_named_by_validate() -> None:
    """Lines the one-pass decoder does not take as written: validate() rewrites or names the field."""
    good = make_sample(3)
    assert wire.decode_line(orjson.dumps(good)) == good
    assert validate({**good, "step": 3.0}) == good  # a whole float: the number it is
    assert validate(make_sample(3, seq=None)) == good  # an explicit null that measures nothing: absent
    odd = [
        orjson.dumps({**make_sample(3), "step": 3.0}),
        orjson.dumps(make_sample(3, seq=None)),
        orjson.dumps(make_sample(3, bogus=1)),  # unknown: validate names it
        orjson.dumps(make_sample(3))[:-1] + b',"run":"a\\u202eb"}',  # duplicate key, last wins, invisible
        b"",
        b"[]",
        b'{"a":' * 5000 + b"1" + b"}" * 5000,  # nested past the decoder's depth: refused, not raised
    ]
    for line in odd:
        assert wire.decode_line(line) is None, line[:80]
        assert wire.decode_samples(line) is None, line[:80]


@pytest.mark.parametrize("present", [
    {"allocated_bytes": 40 * GiB}, {"nvml_used_bytes": 50 * GiB}, {"allocated_bytes": None, "nvml_used_bytes": 1},
    {"allocated_bytes": 40 * GiB, "reserved_bytes": 41 * GiB, "peak_allocated_bytes": None, "ooms": None},
])
def test_schema_2_needs_one_memory_level_and_keeps_not_measured_as_null(present: dict) -> None:
    s = sparse_sample(3, **{"allocated_bytes": ..., **present})
    out = validate(s)
    assert out == s  # null stays null (not measured), absent stays absent: never a zero
    assert all(out.get(name) != 0 for name in present if present[name] is None)


def test_schema_2_without_any_memory_level_is_refused_naming_it() -> None:
    for s in (sparse_sample(allocated_bytes=...), sparse_sample(allocated_bytes=None, nvml_used_bytes=None)):
        with pytest.raises(WireError, match="at least one memory level") as info:
            validate(s)
        assert info.value.field == "allocated_bytes"
    with pytest.raises(WireError, match="total_bytes: is required"):
        validate(sparse_sample(total_bytes=...))
    with pytest.raises(WireError, match="exceeds total_bytes"):  # allocated alone is still checked
        validate(sparse_sample(allocated_bytes=H200_TOTAL + 1))


def test_schema_1_is_accepted_exactly_as_before() -> None:
    s = make_sample(5, nvml_used_bytes=None)
    assert validate(s) == s and validate(s) is s
    for name in ("reserved_bytes", "ooms", "alloc_retries", "inactive_split_bytes", "peak_allocated_bytes"):
        missing = {k: v for k, v in s.items() if k != name}
        with pytest.raises(WireError, match=f"{name}: is required"):
            validate(missing)


INVISIBLE = ["\u202e", "\u2066", "\u2067", "\u2068", "\u2069", "\u200b", "\ufeff", "\u2028", "\u2029",
             "\x85", "\x9b", "\u00ad", "\u200d", "\U000e0041"]


@pytest.mark.parametrize("char", INVISIBLE, ids=[f"U+{ord(c):04X}" for c in INVISIBLE])
@pytest.mark.parametrize("field", ["run", "host", "uuid", "incarnation", "extra"])
def test_invisible_characters_are_refused_in_every_name_with_the_field_named(char: str, field: str) -> None:
    name = f"rank{char}0"  # no other control character: the invisible one alone must be caught
    s = make_sample(extra={name: 1.0}) if field == "extra" else make_sample(**{field: name})
    with pytest.raises(WireError) as info:
        validate(s)
    assert info.value.field == (f"extra.{name}" if field == "extra" else field)
    assert f"U+{ord(char):04X}" in info.value.message


def test_invisible_class_covers_every_control_format_and_separator_character() -> None:
    import sys
    import unicodedata

    from vramwatch.wire import invisible_character

    missed = [f"U+{cp:04X}" for cp in range(sys.maxunicode + 1)
              if unicodedata.category(chr(cp)) in ("Cc", "Cf", "Zl", "Zp") and invisible_character(chr(cp)) is None]
    assert missed == []
    # and nothing a person can see: letters, marks, numbers, punctuation, symbols, spaces pass
    visible = "训练-运行 🚀 naïve ראשון x<y>&\"' \u00a0"
    assert invisible_character(visible) is None


def test_field_table_is_the_one_definition() -> None:
    from vramwatch.collector.store import SAMPLE_COLUMNS

    names = [f.name for f in wire.FIELD_TABLE]
    assert len(names) == len(set(names))
    assert set(wire.Sample.__annotations__) == set(names)
    assert set(wire.FIELDS) == set(names)
    # every stored field has a column, and the store's column list is the table's
    assert {f.column for f in wire.FIELD_TABLE if f.table == "samples"} == set(SAMPLE_COLUMNS)
    schema = wire.sample_json_schema()
    assert set(schema["properties"]) == set(names) and set(schema["required"]) == set(wire.REQUIRED_NAMES)
    assert schema["properties"]["phase"]["pattern"] == "^" + wire.PHASE_PATTERN + "$"
    for new in ("host_rss_bytes", "host_children_rss_bytes", "host_available_bytes", "host_pinned_bytes",
                "foreign_used_bytes", "oom_marked", "exit", "seq"):
        assert new in names and new not in wire.REQUIRED_NAMES


def test_json_schema_agrees_with_validation() -> None:
    """The OpenAPI schema accepts what validate accepts, and refuses what it refuses for a
    per-field reason (cross-field rules are validation's alone)."""
    import jsonschema
    checker = jsonschema.Draft202012Validator(wire.sample_json_schema())
    good = [make_sample(1), make_sample(2, nvml_used_bytes=None, exit=True, host_rss_bytes=None),
            sparse_sample(1), sparse_sample(2, allocated_bytes=None, nvml_used_bytes=GiB)]
    for s in good:
        validate(s)
        assert checker.is_valid(s), s
    bad = [make_sample(reserved_bytes=None), {k: v for k, v in make_sample().items() if k != "ooms"},
           sparse_sample(allocated_bytes=...), sparse_sample(schema=3), sparse_sample(phase="a b"),
           sparse_sample(oops=1)]
    for s in bad:
        with pytest.raises(WireError):
            validate(s)
        assert not checker.is_valid(s), s


def test_docs_field_table_is_up_to_date() -> None:
    from pathlib import Path

    from vramwatch.wire.schema import REGENERATE

    doc = Path(__file__).resolve().parents[2] / "docs" / "fields.md"
    assert doc.read_text(encoding="utf-8") == wire.fields_markdown(), f"docs/fields.md is stale: run {REGENERATE}"


def test_name_caches_are_bounded_and_every_sample_is_still_judged() -> None:
    """Names already checked are remembered up to a bound; past it every sample is still judged,
    just without remembering: a client varying its names cannot grow memory."""
    from vramwatch.wire import structs

    for i in range(5000):
        sample = make_sample(5, run=f"run-{i}", extra={f"k{i}": 1.0})
        assert validate(sample) is sample
        with pytest.raises(WireError) as info:
            validate(dict(sample, host=f"h\u202e{i}"))
        assert info.value.field == "host"
    assert len(structs._known_names) <= 4096 and len(structs._known_keys) <= 4096


def test_dashboard_field_lists_are_up_to_date() -> None:
    from pathlib import Path

    from vramwatch.wire.schema import REGENERATE_JS

    module = Path(__file__).resolve().parents[2] / "dashboard" / "fields.js"
    assert module.read_text(encoding="utf-8") == wire.fields_js(), f"dashboard/fields.js is stale: run {REGENERATE_JS}"


def test_a_field_declared_once_reaches_the_probe_store_metrics_report_and_charts() -> None:
    """The lists other modules keep of sample fields are the table's, not retyped."""
    from vramwatch import report
    from vramwatch.collector.exporters.metrics import SERIES_FAMILIES
    from vramwatch.collector.store import reads
    from vramwatch.probe import host

    assert wire.fields_of(group="host") == host.HOST_FIELDS and len(host.HOST_FIELDS) == 4
    assert set(host.read_host(os.getpid(), pinned=lambda: 4096)) == set(host.HOST_FIELDS)  # what the poller reads
    families = {family.name: (family.kind, family.help, family.always) for family in SERIES_FAMILIES}
    for f in wire.FIELD_TABLE:
        if f.metric is not None:
            assert families[f.metric.name] == (f.metric.kind, f.metric.help, f.metric.always)
    assert families["vramwatch_alloc_retries"][0] == "counter" and families["vramwatch_host_pinned_bytes"][0] == "gauge"
    assert wire.fields_of(phase_marker=True) == reads._PHASE_FIELDS
    assert {"ts", "peak_allocated_bytes", "host_rss_bytes"} <= set(reads._PHASE_FIELDS)
    charted = {f.name for f in wire.FIELD_TABLE if f.charts}
    assert set(report.SERIES_FIELDS) == {"ts", *charted} and set(wire.fields_of(group="host")) <= charted
    assert all(set(f.charts) <= set(wire.CHARTS) for f in wire.FIELD_TABLE)
    assert all(f.label for f in wire.FIELD_TABLE if "host" in f.charts)  # the host chart names each line
