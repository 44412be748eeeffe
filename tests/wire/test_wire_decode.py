"""The one-pass decoders (a trace line, a body's text: msgspec Structs generated from the field
table) change nothing but speed: analyze, trace files and bodies give the same samples, documents,
counts and errors as ``orjson.loads`` + ``wire.validate`` (the same acceptor on the dict)."""

from __future__ import annotations

import orjson
import pytest
from helpers import GiB, make_sample

from vramwatch import wire
from vramwatch.collector.ingest import body as wire_body
from vramwatch.engine import analyze
from vramwatch.probe.simulated import simulate_trace
from vramwatch.wire import tracefile


def messy_trace(path) -> None:
    """Canonical, sparse, cudaMallocAsync, normalisable and bad lines, two series."""
    lines = [orjson.dumps(s) for s in simulate_trace("slow_leak", steps=1500, run="a", rank=0, seed=1)]
    lines += [orjson.dumps(s) for s in simulate_trace("checkpoint", steps=800, run="a", rank=1, seed=2)]
    extra = [
        make_sample(9000, run="b", allocator="cudaMallocAsync", allocated_bytes=121 * GiB,
                    peak_allocated_bytes=122 * GiB),
        {**make_sample(9001, run="b"), "step": 9001.0},  # normalised by the slow path
        {"schema": 2, "run": "b", "host": "node-1", "rank": 0, "step": 9002, "ts": 1_760_009_002.0,
         "phase": "train", "nvml_used_bytes": 50 * GiB, "total_bytes": 140 * GiB},
        make_sample(9003, run="b", ooms=-1),  # bad: named
        make_sample(9004, run="b", host="x\u202ey"),  # bad: named
        make_sample(9005, run="b", bogus=1),  # bad: unknown field
    ]
    lines += [orjson.dumps(s) for s in extra] + [b"", b"{not json", b"[1, 2]"]
    path.write_bytes(b"\n".join(lines) + b"\n")


def not_as_written(line: bytes, lazy: bool = False) -> None:
    return None  # every line through orjson.loads + wire.validate


def test_analyze_is_the_same_with_and_without_the_one_pass_decoder(tmp_path, monkeypatch) -> None:
    path = tmp_path / "messy.jsonl"
    messy_trace(path)
    fast = analyze.analyze_paths([path])
    monkeypatch.setattr(analyze, "decode_line", not_as_written)
    slow = analyze.analyze_paths([path])
    assert orjson.dumps(fast) == orjson.dumps(slow)
    assert fast["skipped_lines"] == 5 and len(fast["series"]) == 3
    assert any(": ooms: must be between 0" in line for line in fast["bad_lines"])
    assert any("bogus: unknown field" in line for line in fast["bad_lines"])


def test_iter_samples_is_the_same_with_and_without_the_one_pass_decoder(tmp_path, monkeypatch) -> None:
    path = tmp_path / "clean.jsonl"
    samples = list(simulate_trace("fragmentation", steps=400, run="r", rank=2, seed=5))
    samples.append({**make_sample(500), "step": 500.0})
    path.write_bytes(wire.encode_lines(samples))
    fast = list(wire.iter_samples(path))
    monkeypatch.setattr(tracefile, "decode_line", not_as_written)
    slow = list(wire.iter_samples(path))
    assert fast == slow and len(fast) == len(samples) and fast[-1]["step"] == 500
    assert [{k: type(v) for k, v in s.items()} for s in fast] == [{k: type(v) for k, v in s.items()} for s in slow]


def slow_body(body: bytes, now: float | None = None) -> list | None:
    try:
        return [wire.validate(x, now=now) for x in wire_body.parse_body(body)]
    except wire.WireError:
        return None


def test_body_fast_path_returns_what_parse_body_and_validate_return() -> None:
    """Batches of mutated samples (the agreement corpus of test_wire) as NDJSON and as arrays:
    the one-pass body decoder accepts only what the slow path accepts, with the same samples."""
    import random

    from test_wire import MUTATIONS, agreement_corpus

    rng = random.Random(11)
    corpus = agreement_corpus()
    accepted = refused = 0
    for _ in range(300):
        batch = []
        for s in rng.sample(corpus, 4):
            candidate = dict(s)
            if rng.random() < 0.1:
                name, value = rng.choice(MUTATIONS)
                candidate[name] = value
            batch.append(candidate)
        for body in (wire.encode_lines(batch), orjson.dumps(batch), wire.encode_lines(batch).replace(b"\n", b"\r\n")):
            expected = slow_body(body)
            got = wire.decode_samples(body)
            if got is None:
                refused += 1
                continue
            accepted += 1
            assert expected is not None, body
            assert orjson.dumps(got, option=orjson.OPT_SORT_KEYS) == orjson.dumps(expected, option=orjson.OPT_SORT_KEYS)
    assert accepted > 100 and refused > 50


def test_body_fast_path_leaves_odd_bodies_to_the_slow_path() -> None:
    decode = wire.decode_samples
    ok = [make_sample(i) for i in range(3)]
    assert decode(wire.encode_lines(ok)) == ok
    assert decode(orjson.dumps(ok[0])) == ok[:1]
    for body in (b"", b"  \n", b"[]", b"[1]\n[2]", wire.encode_lines(ok).replace(b"\n", b" \n{}\n")):
        assert decode(body) is None, body
    # blank and white lines between samples: skipped by both paths, the same samples
    for body in (wire.encode_lines(ok).replace(b"\n", b"\n\n"), b"  \n" + wire.encode_lines(ok) + b" \r\n\t\n"):
        assert decode(body) == slow_body(body) == ok, body
    # the clock: a sample 10 minutes ahead is refused only against one
    ahead = wire.encode_lines([make_sample(0, ts=2_000_000_600.0)])
    assert decode(ahead) is not None
    assert decode(ahead, now=2_000_000_000.0) is None and slow_body(ahead, now=2_000_000_000.0) is None
    assert decode(ahead, now=2_000_000_400.0) == slow_body(ahead, now=2_000_000_400.0)


@pytest.mark.parametrize("text", [b"", b"a", b"\n", b"\n\n", b"ab\ncde", b"abc\n", b"\nabcd", b"a\n" * 5 + b"xyz" * 9,
                                  b"a" * 10 + b"\n" + b"b" * 11, b"\n".join(b"x" * n for n in (3, 9, 10, 9, 1))])
@pytest.mark.parametrize("limit", [1, 3, 9, 10, 11, 100])
def test_long_line_check_by_windows_is_the_split_longest(text: bytes, limit: int, monkeypatch) -> None:
    from vramwatch.collector.ingest import body

    monkeypatch.setattr(body, "MAX_LINE_BYTES", limit)
    for start, end in ((0, len(text)), (1, len(text)), (0, max(0, len(text) - 1))):
        block = body._Block(1, text, start, end)
        assert block.has_long_line() == (max(map(len, text[start:end].split(b"\n"))) > limit)
