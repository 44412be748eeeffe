"""The SQLite store: WAL, versioned schema, all-or-nothing inserts, identity per series."""

from __future__ import annotations

import sqlite3

import pytest
from helpers import make_sample

from vramwatch.collector.store import SCHEMA_VERSION, Store, StoreError


def test_new_database_is_wal_and_versioned(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    conn = sqlite3.connect(tmp_path / "a.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 1
    store.close()


def test_newer_schema_is_refused_with_a_clear_error(tmp_path) -> None:
    path = tmp_path / "future.db"
    Store(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this vramwatch"):
        Store(path)


def test_insert_is_all_or_nothing(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    good = [make_sample(i) for i in range(5)]
    broken = make_sample(5)
    del broken["total_bytes"]  # a sample that bypassed validation must not half-write a batch
    with pytest.raises(StoreError, match="NOT NULL"):  # never skipped silently as if a duplicate
        store.insert([*good, broken])
    assert store.count() == 0 and store.series() == []
    result = store.insert(good)
    assert (result.accepted, result.duplicates) == (5, 0)
    store.close()


def test_reopen_keeps_samples_and_deduplicates_across_restarts(tmp_path) -> None:
    path = tmp_path / "a.db"
    store = Store(path)
    store.insert([make_sample(i, phase=p) for i in range(10) for p in ("train", "eval")])
    store.close()
    store = Store(path)
    result = store.insert([make_sample(i, phase=p) for i in range(8, 12) for p in ("train", "eval")])
    assert (result.accepted, result.duplicates) == (4, 4)
    assert store.count() == 24 and store.count("run-a") == 24 and store.count("other") == 0
    assert [s["step"] for s in store.iter_samples("run-a") if s["phase"] == "eval"] == list(range(12))
    store.close()


def test_query_columns_merges_incarnations_of_a_rank(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    store.insert([make_sample(i, incarnation="first") for i in range(10)])
    # the rank crashed at step 9 and resumed from the step-6 checkpoint
    store.insert([make_sample(i, incarnation="second", ts=1_760_000_100.0 + i) for i in range(6, 12)])
    xs, _cols = store.query_columns("run-a", "node-1", 0, ["allocated_bytes"], x="ts")
    assert len(xs) == 16 and xs == sorted(xs)
    xs, _ = store.query_columns("run-a", None, 0, ["allocated_bytes"], start=8, end=10)
    assert xs == [8, 8, 9, 9, 10]
    store.close()


def test_read_only_store_cannot_write(tmp_path) -> None:
    path = tmp_path / "a.db"
    Store(path).close()
    ro = Store(path, readonly=True)
    with pytest.raises(StoreError, match="read-only"):
        ro.insert([make_sample(0)])
    ro.close()
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "missing.db", readonly=True)
