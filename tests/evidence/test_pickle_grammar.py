"""The fast proof of a snapshot's budget (the grammar of what torch writes) against the slow
one (the opcode walk): the fast path proves real snapshots, whole or in any pieces, never a
hostile one, and what it proves the C unpickler builds within the same budget."""

from __future__ import annotations

import gzip
import pickle
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fakes.fake_snapshot import Alloc, MiB, build_snapshot, user_stack
from helpers import make_sample, ndjson
from hostile_pickles import HOSTILE, distinct_frame_lists, shared_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from vramwatch.collector.server import BackgroundServer
from vramwatch.evidence import pickle_grammar, safe_pickle
from vramwatch.evidence.pickle_budget import Budget, walk
from vramwatch.evidence.pickle_grammar import Recognizer, proves


def _real(blocks: int = 300, seed: int = 0) -> dict:
    rng = random.Random(seed)
    sites = [user_stack(f"/home/op/proj/model_{s}.py", 10 + s, f"block_{s}") for s in range(40)]
    allocs = [Alloc(512 * rng.randint(1, 8192), rng.choice(sites)) for _ in range(blocks)]
    history = [{"action": "alloc", "addr": 0x7F0000000000 + i * 512, "size": 512 * (i % 7 + 1), "stream": 0,
                "time_us": 1_700_000_000_000 + i, "frames": rng.choice(sites)} for i in range(blocks)]
    snap = build_snapshot(allocs, cached_bytes=rng.randint(0, 4) * 64 * MiB, history=history)
    snap["segments"][0]["segment_pool_id"] = (0, 0)  # torch writes a tuple here
    snap["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "long": "p" * 300}
    return snap


def _pieces(data: bytes, rng: random.Random) -> Recognizer:
    recognizer, at = Recognizer(), 0
    while at < len(data):
        size = rng.choice([1, 2, 3, 7, 64, 4095, 4096, 4097, 65_536, 1 << 20])
        recognizer.feed(data[at:at + size])
        at += size
    recognizer.finish()
    return recognizer


@pytest.mark.parametrize("protocol", [4, 5])
def test_real_snapshots_are_proven_whole_and_in_any_pieces(protocol: int) -> None:
    rng = random.Random(protocol)
    for seed in range(3):
        data = pickle.dumps(_real(seed=seed), protocol=protocol)
        assert proves(data, Budget.for_size(len(data)))
        assert _pieces(data, rng).proven()
        walk(data, Budget.for_size(len(data)))  # the slow path agrees
        assert safe_pickle.loads(data) == pickle.loads(data)


def test_what_the_grammar_leaves_undecided_the_walk_decides() -> None:
    """Protocol 2 (BINPUT), a tuple holding a reference, a string of bytes: undecided, then
    walked; every hostile pickle: undecided, then refused naming its budget."""
    for data in (pickle.dumps(_real(), protocol=2), pickle.dumps({"segments": [("x", ("y",))]}, protocol=4),
                 pickle.dumps({"segments": [b"raw"]}, protocol=4)):
        assert not proves(data, Budget.for_size(len(data)))
        assert safe_pickle.check_shape(safe_pickle.loads(data)) == pickle.loads(data)
    for name, (build, limit) in HOSTILE.items():
        raw = build()
        data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        assert not proves(data, Budget.for_size(len(data))), name
        with pytest.raises(safe_pickle.UnsafePickle, match=limit):
            safe_pickle.loads(data)


def test_proven_pickles_stay_within_the_budgets_the_walk_counts() -> None:
    """Shared frames (memo references) and distinct frame lists: the grammar's byte-count bounds
    are upper bounds of the walk's exact counts, and both within the same budget."""
    for data in (gzip.decompress(shared_blocks(20_000, 64)), gzip.decompress(distinct_frame_lists(2_000, 64))):
        budget = Budget.for_size(len(data))
        assert proves(data, budget)
        walk(data, budget)
    tight = pickle.dumps({"segments": [[None] * 300_000]}, protocol=4)  # 1 byte per reference
    assert not proves(tight, Budget.for_size(len(tight)))  # more references than one per two bytes
    with pytest.raises(safe_pickle.UnsafePickle, match="refs"):
        safe_pickle.loads(tight)


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**200, 2**200) | st.floats(allow_nan=False)
                    | st.text(max_size=300) | st.tuples(st.integers(), st.text(max_size=5)),
                    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
                    max_leaves=60),
       st.integers(0, 2**32 - 1))
def test_fast_path_against_slow_path(value: object, seed: int) -> None:
    """Whatever the grammar proves, the walk accepts and the unpickler builds equal to pickle's;
    in pieces the answer is the same as whole."""
    data = pickle.dumps({"segments": [value, value]}, protocol=4)
    budget = Budget.for_size(len(data))
    fast = proves(data, budget)
    if fast:
        walk(data, budget)
        assert safe_pickle.loads(data) == pickle.loads(data)
    assert _pieces(data, random.Random(seed)).proven(budget) == fast


def test_lists_nested_a_million_deep_are_built_and_freed_without_recursion(tmp_path: Path) -> None:
    """The grammar lets lists nest (nothing hashes them); CPython builds and frees them without
    C recursion: the process survives, and the shape check or the diff refuses the file."""
    path = tmp_path / "deep.pickle"
    depth = 1_000_000
    path.write_bytes(b"\x80\x04}\x8c\x08segments]" + b"]" * depth + b"a" * depth + b"s.")
    assert proves(path.read_bytes(), Budget.for_size(path.stat().st_size))
    code = ("import sys; from vramwatch.evidence import safe_pickle, snapshot_diff as d\n"
            "s = safe_pickle.read_snapshot(sys.argv[1])\n"
            "try:\n    d.diff(s, s)\nexcept d.SnapshotFormatError as e:\n    print('refused', e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    assert "refused" in done.stdout


def test_an_upload_is_proven_while_it_arrives_and_its_reads_skip_the_proof(tmp_path: Path) -> None:
    body = gzip.compress(pickle.dumps(_real(2000), protocol=4), 6)
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        httpx.post(srv.url + "/api/v1/samples", content=ndjson([make_sample(1, run="r", host="h")]),
                   headers={"content-type": "application/x-ndjson"}).raise_for_status()
        reply = httpx.post(srv.url + "/api/v1/snapshots", params={"run": "r", "host": "h", "rank": 0, "step": 1},
                           content=body, headers={"content-type": "application/octet-stream"}, timeout=60)
        assert reply.status_code == 201, reply.text
        stored = next(tmp_path.glob(f"**/{reply.json()['id']}.pickle.gz"))
        assert safe_pickle.proven_before(stored)
        # a protocol-2 snapshot is not proven on arrival: its first read walks it
        reply = httpx.post(srv.url + "/api/v1/snapshots", params={"run": "r", "host": "h", "rank": 0, "step": 2},
                           content=gzip.compress(pickle.dumps(_real(50), protocol=2)),
                           headers={"content-type": "application/octet-stream"}, timeout=60)
        old = next(tmp_path.glob(f"**/{reply.json()['id']}.pickle.gz"))
        assert not safe_pickle.proven_before(old)
        safe_pickle.read_snapshot(old)
        assert safe_pickle.proven_before(old)
    assert pickle_grammar.HOLD < pickle_grammar.WINDOW
