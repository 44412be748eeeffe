"""The SQLite store: WAL, versioned schema, all-or-nothing inserts, identity per series."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from helpers import H200_TOTAL, GiB, make_sample

from vramwatch.collector.store import (
    MIGRATIONS,
    SAMPLE_COLUMNS,
    SCHEMA_VERSION,
    RunFullError,
    Store,
    StoreError,
    StoreLockedError,
)
from vramwatch.wire import series_key, validate


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


# ------------------------------------------------------------------ schema 2, migrations, identity


def sparse(step: int, **overrides) -> dict:
    s = {"schema": 2, "run": "sparse", "host": "dcgm", "rank": 0, "step": step, "ts": 1_760_000_000.0 + step,
         "phase": "train", "nvml_used_bytes": 50 * GiB + step, "total_bytes": H200_TOTAL}
    s.update(overrides)
    return s


def test_not_measured_is_stored_as_null_never_zero_and_exported_as_sent(tmp_path) -> None:
    path = tmp_path / "a.db"
    store = Store(path)
    sent = [validate(sparse(i)) for i in range(5)] + [validate(sparse(5, allocated_bytes=GiB, host_rss_bytes=7))]
    store.insert(sent)
    with closing(sqlite3.connect(path)) as conn:
        row = conn.execute("SELECT allocated, reserved, peak, inactive_split, alloc_retries, ooms, nvml_used"
                           " FROM samples WHERE step = 0").fetchone()
    assert row == (None, None, None, None, None, None, 50 * GiB)
    assert list(store.iter_samples("sparse")) == sent  # absent stays absent, schema 2 stays schema 2
    _xs, cols = store.query_columns("sparse", None, 0, ["allocated_bytes", "host_rss_bytes"])
    assert cols["allocated_bytes"] == [None] * 5 + [GiB] and cols["host_rss_bytes"][-1] == 7
    full = make_sample(0, nvml_used_bytes=None)
    store.insert([full])
    assert list(store.iter_samples("run-a")) == [full]  # schema 1 round-trips unchanged, null NVML kept
    store.close()


def _v1_database(path) -> None:
    """A database as the first release wrote it (schema 1), with one sample."""
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(MIGRATIONS[0] + "; PRAGMA user_version=1;")
        conn.execute("INSERT INTO series (run, host, rank, incarnation) VALUES ('old', 'h', 0, '')")
        conn.execute("INSERT INTO samples VALUES (1, 7, 0, 1760000000.0, 1, 2, 3, 0, 0, 0, NULL, 10, NULL, NULL,"
                     " NULL, NULL, NULL)")
        conn.commit()


def test_a_schema_1_database_is_migrated_in_place(tmp_path) -> None:
    path = tmp_path / "old.db"
    _v1_database(path)
    store = Store(path)
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        columns = {r[1] for r in conn.execute("PRAGMA table_info(samples)")}
    assert set(SAMPLE_COLUMNS) <= columns
    old = list(store.iter_samples("old"))
    assert [(s["step"], s["allocated_bytes"], s["nvml_used_bytes"], s["schema"]) for s in old] == [(7, 1, None, 1)]
    assert store.insert(old).duplicates == 1  # the old key still deduplicates
    store.close()


def test_a_field_added_to_the_table_gets_its_column_without_a_migration(tmp_path) -> None:
    path = tmp_path / "a.db"
    Store(path).close()
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("ALTER TABLE samples DROP COLUMN host_pinned")  # as if the field were new
        conn.commit()
    Store(path).close()
    with closing(sqlite3.connect(path)) as conn:
        assert "host_pinned" in {r[1] for r in conn.execute("PRAGMA table_info(samples)")}


def test_same_rank_from_two_hosts_is_two_series_everywhere(tmp_path) -> None:
    path = tmp_path / "a.db"
    store = Store(path)
    a = [make_sample(i, host="node-a") for i in range(3)]
    b = [make_sample(i, host="node-b", allocated_bytes=GiB) for i in range(3)]
    result = store.insert(a + b)
    assert (result.accepted, result.duplicates) == (6, 0)
    assert result.accepted_by_series == {("run-a", "node-a", 0): 3, ("run-a", "node-b", 0): 3}
    store.close()
    store = Store(path)  # and after a restart
    exported = list(store.iter_samples("run-a"))
    assert sorted((series_key(s), s["step"], s["allocated_bytes"]) for s in exported) == sorted(
        (series_key(s), s["step"], s["allocated_bytes"]) for s in a + b)
    assert {r.key for r in store.series("run-a")} == {series_key(a[0]), series_key(b[0])}
    store.close()


def test_two_same_named_phases_at_one_step_both_survive(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    first = make_sample(10, phase="checkpoint", peak_allocated_bytes=115 * GiB)
    second = make_sample(10, phase="checkpoint", seq=1, peak_allocated_bytes=118 * GiB)
    assert store.insert([first, second]).accepted == 2
    assert store.insert([second]).duplicates == 1  # a resend is still a duplicate
    peaks = [p["peak_allocated_bytes"] for p in store.phase_samples("run-a")]
    assert sorted(peaks) == [115 * GiB, 118 * GiB]
    assert [s.get("seq", 0) for s in store.iter_samples("run-a")] == [0, 1]
    store.close()


def test_duplicates_are_not_counted_as_accepted_per_series(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    store.insert([make_sample(i) for i in range(5)])
    result = store.insert([make_sample(i) for i in range(3, 8)] + [make_sample(0, rank=1)])
    assert (result.accepted, result.duplicates) == (4, 2)
    assert result.accepted_by_series == {("run-a", "node-1", 0): 3, ("run-a", "node-1", 1): 1}
    store.close()


def test_one_batch_of_interleaved_sparse_and_wide_samples_is_stored_exactly(tmp_path) -> None:
    """The batch's rows are bound as tuples in one executemany: samples lacking a field another
    sample carries, extra objects, several series interleaved and a duplicate inside the batch
    all come back as sent, and the per-series counts stay exact."""
    store = Store(tmp_path / "a.db")
    store.insert([make_sample(2, rank=2)])
    batch = []
    for i in range(6):
        batch.append(make_sample(i, rank=i % 3, extra={"loss": i / 2} if i % 2 else {}))
        batch.append(validate(sparse(i, host_rss_bytes=i) if i % 3 else sparse(i)))
    batch.append(make_sample(3, rank=0, extra={"loss": 1.5}))  # the same key as batch[6]: a duplicate
    result = store.insert(batch)
    assert (result.accepted, result.duplicates) == (11, 2)  # rank 2's step 2 was stored before
    assert result.accepted_by_series == {("run-a", "node-1", 0): 2, ("run-a", "node-1", 1): 2,
                                         ("run-a", "node-1", 2): 1, ("sparse", "dcgm", 0): 6}
    assert list(store.iter_samples("sparse")) == [x for x in batch if x["run"] == "sparse"]
    stored = {(x["rank"], x["step"]): x for x in store.iter_samples("run-a")}
    assert stored[(1, 1)]["extra"] == {"loss": 0.5} and "extra" not in stored[(0, 0)]
    assert stored[(0, 3)] == {**make_sample(3, rank=0, extra={"loss": 1.5})}
    store.close()


# ------------------------------------------------------------------ several writers on one file


def test_rows_written_by_another_process_do_not_break_the_next_insert(tmp_path) -> None:
    """A running collector's caches miss what `vramwatch import` created: resolved against the DB."""
    path = tmp_path / "a.db"
    serving = Store(path)
    serving.insert([make_sample(0)])
    importer = Store(path)  # a second writer on the same file, as `vramwatch import` is
    importer.insert([make_sample(i, run="imported", phase=p) for i in range(3) for p in ("train", "flush")])
    importer.close()
    result = serving.insert([make_sample(i, run="imported", phase=p) for i in range(2, 5) for p in ("train", "flush")])
    assert (result.accepted, result.duplicates) == (4, 2)
    assert serving.count("imported") == 10
    serving.close()


def test_a_second_exclusive_open_is_refused_with_one_line(tmp_path) -> None:
    path = tmp_path / "a.db"
    first = Store(path, exclusive=True)
    with pytest.raises(StoreLockedError, match="already served by another vramwatch collector") as info:
        Store(path, exclusive=True)
    assert "\n" not in str(info.value) and str(os.getpid()) in str(info.value)
    other = subprocess.run([sys.executable, "-c", "import sys; from vramwatch.collector.store import Store\n"
                            "try: Store(sys.argv[1], exclusive=True)\n"
                            "except Exception as e: print(type(e).__name__); sys.exit(2)", str(path)],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and other.stdout.strip() == "StoreLockedError"
    Store(path).close()  # a non-exclusive writer (import) is still allowed
    first.close()
    Store(path, exclusive=True).close()  # released on close


_CLOSE_ON_A_FULL_DISK = """
import os, resource, signal, sys
from vramwatch.collector.store import Store, StoreCloseError
sys.path.insert(0, sys.argv[2])
from helpers import make_sample
store = Store(sys.argv[1])
store.insert([make_sample(i) for i in range(3000)])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
# the main file may not grow: the final checkpoint hits the limit as it would a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sys.argv[1]) + 4096, resource.RLIM_INFINITY))
try:
    store.close()
except StoreCloseError as exc:
    print(exc)
    sys.exit(1)
"""


def test_a_failed_final_checkpoint_is_a_typed_error_and_nothing_is_lost(tmp_path) -> None:
    path = tmp_path / "a.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", _CLOSE_ON_A_FULL_DISK, str(path), str(Path(__file__).parents[1])],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1, run.stderr
    assert "cannot fold the write-ahead log" in run.stdout and run.stdout.count("\n") == 1
    assert Path(str(path) + "-wal").stat().st_size > 0
    store = Store(path)  # room again: every sample is recovered from the WAL
    assert store.count() == 3000
    store.close()


def test_the_disk_reserve_covers_the_wal(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    store.insert([make_sample(i) for i in range(2000)])
    assert store.wal_bytes() > 0
    assert store.reserve_bytes(256 * 2**20) == 256 * 2**20 + store.wal_bytes()
    store.close()
    assert not Path(str(tmp_path / "a.db") + "-wal").exists()


def test_retention_reports_the_runs_and_series_it_removed(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    store.insert([make_sample(i, run="old", ts=1_700_000_000.0 + i) for i in range(5)])
    store.insert([make_sample(i, run="mixed", ts=1_700_000_000.0 + 10 * i) for i in range(5)])
    store.insert([make_sample(i, run="mixed", rank=1, ts=1_800_000_000.0) for i in range(2)])
    gone = store.retain(1_700_000_025.0)
    assert gone.samples == 5 + 3
    assert gone.runs == ["old"] and gone.keys == [("old", "node-1", 0)]
    assert [s.run for s in gone.series] == ["old"]
    assert store.runs() == ["mixed"] and store.count("mixed") == 4
    store.close()


def test_series_window_is_query_columns_downsampled_and_follows_new_rows(tmp_path) -> None:
    from vramwatch.collector.reads.downsample import downsample

    store = Store(tmp_path / "a.db")
    spiky = [make_sample(i, peak_allocated_bytes=110 * GiB + (i % 37) * 2**20 + (20 * GiB if i == 4321 else 0),
                         nvml_used_bytes=None if i % 11 == 0 else 125 * GiB + i) for i in range(6000)]
    store.insert(spiky)
    store.insert([make_sample(i, incarnation="second", ts=1_760_100_000.0 + i) for i in range(5000, 7000)])
    store.insert([make_sample(i, phase="checkpoint") for i in range(0, 6000, 500)])
    fields = ["allocated_bytes", "peak_allocated_bytes", "nvml_used_bytes", "ts"]
    cases = [dict(), dict(points=500), dict(start=100, end=3000, points=300), dict(x="ts", points=400),
             dict(phase="checkpoint"), dict(phase=None, points=1000), dict(start=6500, points=10)]
    for _ in range(2):  # the second round is answered from the column cache
        for case in cases:
            points = case.pop("points", 2000)
            xs, cols = store.query_columns("run-a", None, 0, fields, **case)
            want_x, want, downsampled = downsample(xs, cols, points)
            got = store.series_window("run-a", None, 0, fields, points=points, **case)
            assert (got.x, got.series, got.raw_points, got.downsampled) == (want_x, want, len(xs), downsampled), case
            case["points"] = points
    assert 130 * GiB + 4321 % 37 * 2**20 in store.series_window("run-a", None, 0, fields, points=100).series[
        "peak_allocated_bytes"]
    store.insert([make_sample(i, incarnation="second", ts=1_760_200_000.0 + i) for i in range(7000, 7100)])
    got = store.series_window("run-a", None, 0, fields)
    assert got.raw_points == 6000 + 2000 + 100 and got.x[-1] == 7099  # new rows are read on the next request
    store.close()


def test_a_read_only_open_of_an_old_database_says_how_to_migrate(tmp_path) -> None:
    path = tmp_path / "old.db"
    _v1_database(path)
    with pytest.raises(StoreError, match=r"older vramwatch.*open it once for writing"):
        Store(path, readonly=True).series("run-a")  # series and phases at open; samples when a run is read
    Store(path).close()
    assert [s["step"] for s in Store(path, readonly=True).iter_samples("old")] == [7]


def test_a_database_without_the_suspected_oom_tables_reads_none_and_gets_them_when_opened_for_writing(
        tmp_path) -> None:
    """The suspected-OOM tables came after the last migration: a file written before them opens
    read-only (the CLI's commands) and reads no suspected OOM, what a writer's open then creates."""
    from vramwatch.collector.store.schema import LATER_TABLES
    from vramwatch.runlife import SuspectedOom

    path = tmp_path / "before.db"
    store = Store(path)
    store.insert([make_sample(i) for i in range(5)])
    store.close()
    with closing(sqlite3.connect(path)) as conn, conn:
        for table in LATER_TABLES:
            conn.execute(f"DROP TABLE {table}")
    store = Store(path, readonly=True)
    try:
        assert store.suspected_records("run-a") == {} and len(store.life_records("run-a")[0]) == 1
    finally:
        store.close()
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "postmortem", "run-a", "--db", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    store = Store(path)  # a writer's open creates them
    try:
        found = SuspectedOom(3, 1_760_000_003.0, 78 * GiB, GiB // 2, 80 * GiB, "near_full")
        assert store.keep_suspected([("run-a", "node-1", 0, found)]) == 1
        assert store.suspected_records("run-a") == {("node-1", 0): ((found,), 0)}
    finally:
        store.close()
    store = Store(path, readonly=True)
    try:
        with pytest.raises(StoreError, match="read-only"):
            store.keep_suspected([("run-a", "node-1", 0, found)])
    finally:
        store.close()


def test_a_database_holding_more_suspected_ooms_than_any_writer_keeps_is_read_bounded(tmp_path) -> None:
    """A database file is input too: 200,000 suspected OOMs on one rank and 20,000 ranks that have
    no process in the run are read as the writer's rule keeps them: the first and the latest 63
    records, the rest counted as dropped, and only the ranks with a series."""
    from vramwatch.runlife import MAX_SUSPECTED

    path = tmp_path / "hostile.db"
    store = Store(path)
    store.insert([make_sample(i) for i in range(5)])  # run-a, node-1, rank 0
    store.close()
    rows = 200_000
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany("INSERT INTO suspected_ooms VALUES ('run-a', 'node-1', 0, ?, ?, 1, 1, NULL, 'near_full')",
                         ((float(i), i) for i in range(rows)))
        conn.execute("INSERT INTO suspected_dropped VALUES ('run-a', 'node-1', 0, 5)")
        conn.executemany("INSERT INTO suspected_dropped VALUES ('run-a', 'elsewhere', ?, 1)",
                         ((r,) for r in range(20_000)))
        conn.executemany("INSERT INTO suspected_ooms VALUES ('run-a', 'elsewhere', ?, 1.0, 1, 1, 1, NULL, 'near_full')",
                         ((r,) for r in range(20_000)))
    store = Store(path, readonly=True)
    try:
        records = store.suspected_records("run-a")
    finally:
        store.close()
    assert list(records) == [("node-1", 0)]
    kept, dropped = records[("node-1", 0)]
    assert len(kept) == MAX_SUSPECTED and dropped == 5 + rows - MAX_SUSPECTED
    assert [k.step for k in kept] == [0, *range(rows - MAX_SUSPECTED + 1, rows)]


def test_the_wire_schema_of_each_sample_is_kept(tmp_path) -> None:
    store = Store(tmp_path / "a.db")
    v2_full = {**make_sample(1), "schema": 2}
    v1 = make_sample(2)
    store.insert([v2_full, v1])
    assert list(store.iter_samples("run-a")) == [v2_full, v1]
    store.close()


def test_export_reads_only_the_fields_a_series_carried_and_still_returns_everything(tmp_path) -> None:
    path = tmp_path / "a.db"
    store = Store(path)
    plain = [make_sample(i) for i in range(3)]
    store.insert(plain)
    later = [make_sample(i, host_rss_bytes=2**30, extra={"loss": 0.5}, exit=i == 5) for i in range(3, 6)]
    other = Store(path)  # a second writer adds fields to the same series
    other.insert(later)
    other.close()
    store.insert([make_sample(6, tokens=10)])
    assert list(store.iter_samples("run-a")) == [*plain, *later, make_sample(6, tokens=10)]
    row = store.series("run-a")[0]
    assert {"host_rss_bytes", "extra", "exit", "tokens", "allocated_bytes"} <= set(row.fields.split(","))
    store.close()


def test_a_rolled_back_batch_leaves_no_trace_in_the_caches(tmp_path) -> None:
    """A batch refused after its rows were written (here: a run's cap) rolls back, and so do the
    store's caches: the series it created and the fields it noted for an existing series. A
    retry then records them in the database (reads select only a series' noted fields)."""
    store = Store(str(tmp_path / "vw.db"))
    store.insert([make_sample(i) for i in range(3)])
    sparse_field = "host_rss_bytes"
    batch = [make_sample(3, **{sparse_field: 7 * GiB}), make_sample(0, rank=1)]
    with pytest.raises(RunFullError):
        store.insert(batch, max_samples_per_run=4)
    assert len(store._series_ids) == 1 and sparse_field not in store._series_fields[1]
    store.insert(batch)
    (noted,) = store._conn.execute("SELECT fields FROM series WHERE rank = 0").fetchone()
    assert sparse_field in noted.split(",")
    xs, cols = store.query_columns("run-a", None, 0, [sparse_field])
    assert xs == [0, 1, 2, 3] and cols[sparse_field] == [None, None, None, 7 * GiB]
    store.close()


def test_incarnations_are_bounded_per_rank_and_no_statement_grows_with_them(tmp_path) -> None:
    from vramwatch.collector.store.core import OVERFLOW_INCARNATION
    from vramwatch.runlife import MAX_INCARNATIONS

    store = Store(tmp_path / "a.db")
    n = MAX_INCARNATIONS + 400
    store.insert([make_sample(i, incarnation=f"p{i}", ts=1000.0 + i) for i in range(n)])
    store.insert([make_sample(0, rank=1, incarnation="x", ts=1000.0)])  # another rank: its own count
    rows = store.series("run-a")
    assert sum(1 for r in rows if r.rank == 0) == MAX_INCARNATIONS + 1
    assert [r.incarnation for r in rows if r.rank == 0][-1] == OVERFLOW_INCARNATION
    assert store.count("run-a") == n + 1  # nothing lost: the later processes' samples share one series
    assert len(store._series_ids) <= MAX_INCARNATIONS + 2 and store.incarnations_folded == 400
    records, _ = store.life_records("run-a")  # one statement for the run, whatever its series
    assert len(records) == MAX_INCARNATIONS + 2
    assert store.phase_samples("run-a") == []  # one JSON parameter for any number of series
    x, _ = store.query_columns("run-a", None, 0, ["allocated_bytes"])
    assert len(x) == n
    store.close()
    store = Store(tmp_path / "a.db")  # the count is read back after a restart
    store.insert([make_sample(5000, incarnation="again", ts=9000.0)])
    assert sum(1 for r in store.series("run-a") if r.rank == 0) == MAX_INCARNATIONS + 1
    store.close()


@pytest.mark.parametrize(("sql", "column"), [
    ("UPDATE samples SET ts = 'yesterday' WHERE step = 3", "ts"),
    ("UPDATE samples SET allocated = 2.5 WHERE step = 3", "allocated"),
    ("UPDATE series SET host = zeroblob(64 * 1024 * 1024)", "host"),
    ("UPDATE series SET rank = 'zero'", "rank"),
    ("UPDATE samples SET extra = zeroblob(8 * 1024 * 1024) WHERE step = 1", "extra"),
    ("UPDATE phases SET name = zeroblob(10) WHERE id = 0", "name"),
    ("INSERT INTO suspected_ooms VALUES ('run-a', 'node-1', 0, 1.0, 1, 'lots', 0, NULL, 'near_full')", "used_before"),
])
def test_a_database_with_wrong_values_is_one_line_and_exit_2(tmp_path, sql: str, column: str) -> None:
    path = tmp_path / "bad.db"
    store = Store(path)
    store.insert([make_sample(i) for i in range(5)])
    store.close()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(sql)
    with pytest.raises(StoreError, match=rf"hold a {column} of the wrong type or size"):
        Store(path, readonly=True).series("run-a")  # series and phases at open; samples when a run is read
    for command in (["advise", "run-a", "--db", str(path)], ["export", "run-a", "--db", str(path)],
                    ["postmortem", "run-a", "--db", str(path)], ["gate", "run-a", "run-a", "--db", str(path)],
                    ["compare", "run-a", "run-a", "--db", str(path)],
                    ["report", "run-a", "--db", str(path), "--out", str(tmp_path / "r.html")]):
        proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", *command], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
        assert f"a {column} of the wrong type" in proc.stderr, (command, proc.stderr)


def test_demo_opens_its_database_through_the_store(tmp_path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database " * 100)
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "demo", "--db", str(bad), "--duration", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a database" in proc.stderr, proc.stderr
