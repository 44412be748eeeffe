"""The snapshot reader's budget, tried as an attacker would: each hostile pickle is refused
quickly, in bounded memory, naming the budget (exit 2 from the CLI, 422 from the collector);
reader patterns are linear-time globs; heavy reads leave /healthz and ingest answering."""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from fakes.fake_snapshot import Alloc, MiB, build_snapshot, user_stack
from helpers import make_sample, ndjson
from hostile_pickles import HOSTILE, distinct_frame_lists, shared_blocks

from vramwatch.collector.server import BackgroundServer
from vramwatch.evidence import safe_pickle
from vramwatch.evidence.patterns import PatternError, compile_glob
from vramwatch.evidence.pickle_budget import Budget, BudgetExceeded, walk
from vramwatch.evidence.safe_pickle import UnsafePickle
from vramwatch.evidence.snapshot_diff import SiteRule, SnapshotFormatError, Work, census, diff

SITE = ("/home/op/train.py", 95, "train_step")


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_pickle_is_refused_naming_its_budget(name: str) -> None:
    build, limit = HOSTILE[name]
    data = build()
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(UnsafePickle, match=rf"snapshot budget: {limit}\)"):
            safe_pickle.load_snapshot(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    inflated = len(gzip.decompress(data)) if data[:2] == b"\x1f\x8b" else len(data)
    assert peak <= 2 * inflated + 4 * MiB, (peak, inflated)  # the input once, plus the walk's shapes
    assert time.monotonic() - t0 < 30


def test_the_walk_refuses_each_shape_and_passes_real_data() -> None:
    real = pickle.dumps(build_snapshot([Alloc(MiB, user_stack(*SITE))] * 50), protocol=4)
    walk(real, Budget.for_size(len(real)))
    for proto in (0, 2, 5):  # protocols pickle.dumps writes (sets need a global before 4)
        walk(pickle.dumps({"segments": [{"a": (1, 2.5, None, True, "y", 2**70), "l": [[], {}]}]}, protocol=proto),
             Budget())
    walk(pickle.dumps({"s": {1}, "f": frozenset({2})}, protocol=4), Budget())
    walk(pickle.dumps([b"x", bytearray(b"y")], protocol=5), Budget())
    cases = {
        b"\x80\x04}]Ns.": "keys",  # a list as a dict key
        b"\x80\x04}K\x01K\x02\x86Ns.": "keys",  # a tuple as a key: only flat atoms are hashed
        b"\x80\x04]\x94(h\x05e.": "memo",  # a get of an index never put
        b"\x80\x04" + b"]" * 3 + b"a" * 2 + b"h\x00a.": "memo",
        b"\x80\x04\x8b\x00\x00\x01\x00" + b"\x01" * 65536 + b".": "int_bytes",
        b"\x80\x04N": "bytes",  # no STOP
    }
    for data, limit in cases.items():
        with pytest.raises(BudgetExceeded) as caught:
            walk(data, Budget())
        assert caught.value.limit == limit, (data[:20], caught.value)
    with pytest.raises(BudgetExceeded, match="objects"):
        walk(pickle.dumps([[] for _ in range(70_000)], protocol=4), Budget(objects=65_536))
    with pytest.raises(BudgetExceeded, match="refs"):
        walk(pickle.dumps([[] for _ in range(70_000)], protocol=4), Budget.for_size(10))
    with pytest.raises(BudgetExceeded, match="length"):
        walk(pickle.dumps(list(range(2000)), protocol=4), Budget(length=100))
    with pytest.raises(BudgetExceeded, match="deadline"):
        walk(pickle.dumps(list(range(200_000)), protocol=4), Budget(deadline=time.monotonic() - 1))
    nested = b"\x80\x04" + b"](" * 100 + b"e" * 100 + b"."  # a list 101 deep
    with pytest.raises(BudgetExceeded, match="depth"):
        walk(nested, Budget())


def test_memo_shared_blocks_cost_one_read_and_distinct_lists_spend_the_work_budget() -> None:
    snap = safe_pickle.load_snapshot(shared_blocks(200_000, 256))  # 200k blocks, one 256-frame list
    t0 = time.monotonic()
    result = diff(snap, snap)
    assert result.live.blocks_new == 200_000 and time.monotonic() - t0 < 10
    many = safe_pickle.load_snapshot(distinct_frame_lists(2_000, 256))
    with pytest.raises(SnapshotFormatError, match="work"):
        census(many, SiteRule(), Work(units=100_000))
    with pytest.raises(SnapshotFormatError, match="deadline"):
        census(many, SiteRule(), Work(deadline_s=-1))


def test_block_sizes_and_names_are_bounded_before_arithmetic() -> None:
    big = {"segments": [{"blocks": [{"size": 2**100, "state": "active_allocated", "frames": []}]}]}
    with pytest.raises(SnapshotFormatError, match=r"blocks\[0\]\.size"):
        diff(big, big)
    name = "/x/" + "a" * 100_000 + ".py"
    long = build_snapshot([Alloc(MiB, user_stack(name, 1, "f"))])
    site = diff(long, long).sites[0]
    assert len(site.site.file) == 4096 and all(len(s) < 8300 for s in site.stack)


def test_reader_patterns_are_linear_globs() -> None:
    glob = compile_glob("(.|.)*Q")  # the backtracking regex of the report, now a literal glob
    t0 = time.monotonic()
    assert not glob.search("x" * 200_000)
    assert compile_glob("site-packages/*ning/").search("/a/site-packages/lightning/x.py")
    assert compile_glob("tra?n.py").search("/home/op/train.py")
    assert not compile_glob("tra?n.py").search("/home/op/trn.py")
    assert compile_glob("a*b*c").search("xxaxxbxxc") and not compile_glob("a*b*c").search("xxcxxbxxa")
    assert time.monotonic() - t0 < 1
    for bad in ("", "x" * 201, "[abc]", "a\nb"):
        with pytest.raises(PatternError):
            compile_glob(bad)


def _snapshot_body(blocks: int) -> bytes:
    return gzip.compress(pickle.dumps(build_snapshot([Alloc(MiB, user_stack(*SITE))] * blocks), protocol=4), 1)


def _gz(data: bytes) -> bytes:
    return data if data[:2] == b"\x1f\x8b" else gzip.compress(data)


def _upload(url: str, body: bytes, step: int) -> str:
    reply = httpx.post(url + "/api/v1/snapshots", params={"run": "r", "host": "h", "rank": 0, "step": step},
                       content=body, headers={"content-type": "application/octet-stream"}, timeout=60)
    assert reply.status_code == 201, reply.text
    return reply.json()["id"]


def test_the_collector_refuses_hostile_snapshots_and_keeps_answering(tmp_path: Path) -> None:
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        httpx.post(srv.url + "/api/v1/samples", content=ndjson([make_sample(1, run="r", host="h")]),
                   headers={"content-type": "application/x-ndjson"}).raise_for_status()
        good = _upload(srv.url, _snapshot_body(20), 1)
        evil = {name: _upload(srv.url, _gz(build()), 2 + i)
                for i, (name, (build, _)) in enumerate(sorted(HOSTILE.items()))}
        for name, ident in evil.items():
            got = httpx.get(srv.url + "/api/v1/runs/r/snapshots/diff", params={"old": good, "new": ident}, timeout=60)
            assert got.status_code == 422 and f"snapshot budget: {HOSTILE[name][1]})" in got.text, (name, got.text)
        # heavy reads run in slots off the loop: /healthz and ingest answer meanwhile
        bigger = [_upload(srv.url, _snapshot_body(4000), 10 + i) for i in range(4)]
        slowest = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                httpx.get(srv.url + "/healthz", timeout=30).raise_for_status()
                slowest.append(time.monotonic() - t0)
                time.sleep(0.02)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            def one(i: int) -> int:
                return httpx.get(srv.url + "/api/v1/runs/r/snapshots/diff", timeout=120,
                                 params={"old": bigger[i], "new": bigger[(i + 1) % 4], "skip": "(.|.)*Q"}).status_code

            results: list[int] = []
            workers = [threading.Thread(target=lambda i=i: results.append(one(i))) for i in range(4)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            ingest = httpx.post(srv.url + "/api/v1/samples", content=ndjson([make_sample(2, run="r", host="h")]),
                                headers={"content-type": "application/x-ndjson"}, timeout=30)
        finally:
            stop.set()
            prober.join()
        assert sorted(results) == [200] * 4 and ingest.status_code == 200
        assert slowest and max(slowest) < 2.0, max(slowest)


def test_the_cli_refuses_a_hostile_file_with_one_line(tmp_path: Path) -> None:
    good, evil = tmp_path / "good.pickle", tmp_path / "evil.pickle.gz"
    good.write_bytes(pickle.dumps(build_snapshot([Alloc(MiB, user_stack(*SITE))])))
    evil.write_bytes(HOSTILE["deep tuple key"][0]())
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "snapshots", "diff", str(good), str(evil)],
                          capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "snapshot budget: depth" in proc.stderr, \
        proc.stderr


def test_a_snapshot_evicted_by_the_caps_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from vramwatch.collector.snapshots.directives import SnapshotStore

    store = SnapshotStore(tmp_path / "snaps", max_snapshots=1)
    first = store.save(run="r", host="h", rank=0, step=1, trigger="manual", directive=None, gz=_snapshot_body(2))
    with caplog.at_level(logging.INFO, logger="vramwatch.collector"):
        store.save(run="r", host="h", rank=0, step=2, trigger="manual", directive=None, gz=_snapshot_body(2))
    assert store.evicted == 1 and any(first.id in r.getMessage() and "evicted" in r.getMessage()
                                      for r in caplog.records), caplog.text
