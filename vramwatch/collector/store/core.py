"""SQLite store: every sample, on disk, idempotent (tables and migrations: ``schema.py``).

The store is used from one writer (the collector's ingest path, serialised by a lock) and
from readers on other connections (WAL lets them run concurrently). Opened with
``exclusive=True`` (``vramwatch serve``) it also holds an advisory lock on ``<db>.lock`` so a
second collector on the same file refuses to start; ``vramwatch import`` and other writers
that do not take it stay correct because every cache miss is resolved against the database.
"""

from __future__ import annotations

import inspect
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from operator import itemgetter
from pathlib import Path
from typing import IO, Any

import orjson

from vramwatch.collector.store.aggregates import Aggregates
from vramwatch.collector.store.columns import ColumnCache
from vramwatch.collector.store.errors import (
    RunFullError,
    StoreCloseError,
    StoreError,
    StoreLockedError,
    reads_translated,
    write_error,
)
from vramwatch.collector.store.reads import Reads, SeriesRow
from vramwatch.collector.store.schema import VALUE_NAMES, insert_sql, migrate
from vramwatch.collector.store.suspected import Suspicions
from vramwatch.collector.store.transactions import Transactions
from vramwatch.runlife import MAX_INCARNATIONS
from vramwatch.wire import Sample

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

SeriesKey = tuple[str, str, int]
_VALUE_SET = frozenset(VALUE_NAMES)
#: the incarnation a rank's samples are stored under past MAX_INCARNATIONS series of it
OVERFLOW_INCARNATION = "(later incarnations)"
_RANK_COUNTS_KEPT = 65_536


#: WAL policy. The collector checkpoints (PASSIVE) every few seconds from a background
#: thread on its own connection (:meth:`Store.checkpoint`), so ingest never pays for copying
#: pages and fsync. SQLite's own automatic checkpoint inside a commit is only a backstop,
#: should that thread stall: at this many pages (~200 MB) ...
WAL_AUTOCHECKPOINT_PAGES = 50_000
#: ... and, once a checkpoint has reset it, the -wal file is truncated back to this size, so
#: a burst does not leave a huge WAL behind. TRUNCATE at clean shutdown leaves it empty.
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024


def default_db_path() -> Path:
    """``$VRAMWATCH_DB`` or ``<user data dir>/vramwatch/vramwatch.db``."""
    env = os.environ.get("VRAMWATCH_DB")
    if env:
        return Path(env)
    from platformdirs import user_data_dir

    return Path(user_data_dir("vramwatch", appauthor=False)) / "vramwatch.db"


@dataclass(frozen=True)
class InsertResult:
    """What one insert stored: ``accepted`` new samples, ``duplicates`` already present, and
    the new samples per series (``wire.series_key``), so live state counts only those."""

    accepted: int
    duplicates: int
    accepted_by_series: dict[SeriesKey, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RetentionResult:
    """What a retention pass removed: samples, the series left empty, the runs left empty."""

    samples: int
    series: list[SeriesRow]
    runs: list[str]
    #: ``wire.series_key`` of every live series with nothing left stored (all incarnations gone)
    keys: list[SeriesKey]


def _connect(path: str, *, readonly: bool = False, timeout: float = 10.0) -> sqlite3.Connection:
    if readonly:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=timeout)
    return sqlite3.connect(path, check_same_thread=False, timeout=timeout, isolation_level=None)


def thread_reader(local: threading.local, path: str) -> sqlite3.Connection:
    """This thread's read-only connection to ``path``, opened on first use (WAL readers never
    block the writer, and a connection must not be shared across threads mid-query)."""
    conn = getattr(local, "conn", None)
    if conn is None:
        conn = local.conn = _connect(path, readonly=True)
    return conn


def _take_lock(path: str) -> IO[str] | None:
    """An exclusive advisory lock on ``<path>.lock`` (released when the process dies)."""
    if fcntl is None:  # pragma: no cover
        return None
    lock_path = path + ".lock"
    try:
        fh = open(lock_path, "a+")  # noqa: SIM115 - held open for the store's lifetime
    except OSError as exc:
        raise StoreError(f"cannot open lock file {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise StoreLockedError(
            f"database {path} is already served by another vramwatch collector (pid {holder}); "
            "stop it or choose another --db") from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


class Store(Reads, Aggregates, Suspicions, Transactions):
    """One SQLite database file. Thread-safe: writes are serialised by a lock; each reading
    thread gets its own connection (WAL readers never block the writer)."""

    def __init__(
        self, path: str | os.PathLike[str], *, readonly: bool = False, busy_timeout_s: float = 10.0,
        exclusive: bool = False, check_contents: bool = True,
    ) -> None:
        """``busy_timeout_s``: how long a write waits for another process's lock before failing.
        ``exclusive``: refuse (:class:`StoreLockedError`) when another exclusive store has the file.
        ``check_contents``: refuse a file whose rows hold values of the wrong type or size
        (:mod:`~vramwatch.collector.store.contents`: one scan of each table)."""
        self.path = str(path)
        self.check_contents = check_contents
        self.readonly = readonly
        self._lock_file: IO[str] | None = None
        if not readonly:
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot open database {self.path}: {exc.strerror}") from None
        elif not Path(self.path).exists():
            raise StoreError(f"database {self.path} does not exist")
        if exclusive:
            self._lock_file = _take_lock(self.path)
        self._lock = threading.Lock()
        self._local = threading.local()
        # every reader connection, so close() can close those opened by other threads too
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._run_counts: dict[str, int] | None = None  # loaded on first capped insert
        self._ckpt_conn: sqlite3.Connection | None = None  # background checkpoints, off the write lock
        self._ckpt_lock = threading.Lock()
        self._busy_timeout_s = busy_timeout_s
        self._busy_ms = int(1000 * busy_timeout_s)
        self._series_ids: dict[tuple[str, str, int, str], int] = {}
        self._rank_incarnations: dict[tuple[str, str, int], int] = {}  # series rows per rank (a cache)
        self.incarnations_folded = 0  # samples stored in a rank's overflow series
        self._series_fields: dict[int, frozenset[str]] = {}  # series id -> value fields its samples carry
        self._phase_ids: dict[str, int] = {}
        self._phase_names: dict[int, str] = {}
        #: series id -> its noted fields before the transaction in progress changed them
        self._fields_before: dict[int, frozenset[str]] = {}
        self._columns = ColumnCache()  # /series: numpy columns per recently asked rank
        try:
            self._open()
        except sqlite3.Error as exc:
            self._release_lock()
            raise StoreError(f"cannot open database {self.path}: {exc}") from None
        except BaseException:
            self._release_lock()
            raise

    def _open(self) -> None:
        self._conn = _connect(self.path, readonly=self.readonly, timeout=self._busy_timeout_s)
        if self.readonly:
            from vramwatch.collector.store.schema import SAMPLE_COLUMNS, SCHEMA_VERSION

            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema {version}, newer than this vramwatch ({SCHEMA_VERSION})")
            have = {row[1] for row in self._conn.execute("PRAGMA table_info(samples)")}
            if version < SCHEMA_VERSION or not set(SAMPLE_COLUMNS) <= have:
                raise StoreError(f"{self.path} was written by an older vramwatch (schema {version}); open it once "
                                 f"for writing to migrate it, e.g. vramwatch serve --db {self.path}")
        else:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a power loss may lose the last transactions, never corrupts.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
            self._conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
            with self._lock:
                migrate(self._conn, self.path)
            # Probe writability now so a read-only file fails at start, not at first ingest.
            # BEGIN IMMEDIATE alone succeeds on a read-only file in WAL mode: write something.
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("CREATE TABLE _vramwatch_write_probe (x)")
            finally:
                self._conn.execute("ROLLBACK")
        if self.check_contents:
            from vramwatch.collector.store import contents

            contents.check(self._conn, self.path)
        for pid, name in self._conn.execute("SELECT id, name FROM phases"):
            self._phase_ids[name] = pid
            self._phase_names[pid] = name

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the descriptor releases the flock
            self._lock_file = None

    def _reader(self) -> sqlite3.Connection:
        if getattr(self._local, "conn", None) is None:
            with self._readers_lock:  # remembered so close() can close every thread's reader
                self._readers.append(thread_reader(self._local, self.path))
        return self._local.conn

    # ------------------------------------------------------------ writes
    def _series_id(self, s: Sample) -> int:
        key = (s["run"], s["host"], s["rank"], s.get("incarnation") or "")
        sid = self._series_ids.get(key)
        if sid is None:
            # another process (vramwatch import, a second writer) may have created it: ask first
            row = self._conn.execute(
                "SELECT id, fields FROM series WHERE run = ? AND host = ? AND rank = ? AND incarnation = ?", key
            ).fetchone()
            if row is not None:
                sid = row[0]
                self._series_fields[sid] = frozenset(row[1].split(",")) if row[1] else frozenset()
            elif (bounded := self._bounded_incarnation(key)) != key:
                return self._series_id({**s, "incarnation": bounded[3]})  # type: ignore[typeddict-item]
            else:
                from vramwatch.collector.store.schema import SERIES_OPTIONAL

                self._rank_incarnations[key[:3]] = self._rank_incarnations.get(key[:3], 0) + 1
                cur = self._conn.execute(
                    "INSERT INTO series (run, host, rank, incarnation, local_rank, world_size, uuid, gpu, pid,"
                    " allocator) VALUES (?,?,?,?,?,?,?,?,?,?)", (*key, *(s.get(name) for name in SERIES_OPTIONAL)),
                )
                sid = cur.lastrowid
                self._series_fields[sid] = frozenset()
            assert sid is not None
            self._series_ids[key] = sid
        return sid

    def _bounded_incarnation(self, key: tuple[str, str, int, str]) -> tuple[str, str, int, str]:
        """``key``, or past :data:`~vramwatch.runlife.MAX_INCARNATIONS` series of one rank the
        rank's overflow series (incarnation :data:`OVERFLOW_INCARNATION`): a rank that restarts
        (or claims a new incarnation with every sample) keeps at most that many series rows and
        cached ids; the later processes' samples are stored together, and one at a step already
        stored there counts as a duplicate. Called only for an incarnation not stored yet. Cost:
        one COUNT per rank per process, then O(1)."""
        rank_key = key[:3]
        count = self._rank_incarnations.get(rank_key)
        if count is None:
            count = self._conn.execute("SELECT COUNT(*) FROM series WHERE run = ? AND host = ? AND rank = ?",
                                       rank_key).fetchone()[0]
            if len(self._rank_incarnations) >= _RANK_COUNTS_KEPT:
                self._rank_incarnations.clear()
        self._rank_incarnations[rank_key] = count
        if count >= MAX_INCARNATIONS and key[3] != OVERFLOW_INCARNATION:
            self.incarnations_folded += 1
            return (*rank_key, OVERFLOW_INCARNATION)
        return key

    def _phase_id(self, name: str) -> int:
        pid = self._phase_ids.get(name)
        if pid is None:
            self._conn.execute("INSERT INTO phases (name) VALUES (?) ON CONFLICT (name) DO NOTHING", (name,))
            pid = self._conn.execute("SELECT id FROM phases WHERE name = ?", (name,)).fetchone()[0]
            self._phase_ids[name] = pid
            self._phase_names[pid] = name
        return pid

    def _rows(
        self, samples: Sequence[Sample], names: tuple[str, ...]
    ) -> tuple[list[tuple[Any, ...]], dict[int, tuple[Sample, int]]]:
        """Rows as tuples in column order (key, then the value fields ``names``), the rows of
        one series adjacent (the table is clustered on the series), and per series one of
        its samples (for its key) and its number of rows.

        Cost per sample: two cached id look-ups (series, phase) and one ``itemgetter`` call; a
        sample lacking one of ``names`` (sparse) falls back to ``dict.get`` per name."""
        groups: dict[int, list[tuple[Any, ...]]] = {}
        firsts: dict[int, Sample] = {}
        series_id, phase_id = self._series_id, self._phase_id
        values = itemgetter(*names) if len(names) > 1 else (lambda s: (s[names[0]],))
        extra_at = names.index("extra") + 4 if "extra" in names else -1
        for s in samples:
            sid = series_id(s)
            pid = phase_id(s["phase"])
            try:
                row = (sid, s["step"], pid, s.get("seq", 0), *values(s))
            except KeyError:  # sparse: a field some other sample of the batch carries
                row = (sid, s["step"], pid, s.get("seq", 0), *map(s.get, names))
            if extra_at >= 0 and row[extra_at] is not None:
                row = (*row[:extra_at], orjson.dumps(row[extra_at]) if row[extra_at] else None,
                       *row[extra_at + 1:])
            group = groups.get(sid)
            if group is None:
                group = groups[sid] = []
                firsts[sid] = s
            group.append(row)
        counts = {sid: (firsts[sid], len(group)) for sid, group in groups.items()}
        rows = next(iter(groups.values())) if len(groups) == 1 else list(chain.from_iterable(groups.values()))
        return rows, counts

    def _execute(self, sql: str, rows: list[tuple[Any, ...]],
                 firsts: dict[int, tuple[Sample, int]]) -> list[tuple[Sample, int]]:
        """Insert ``rows`` (inside the caller's transaction); per series one of its samples and
        the rows it really added. One ``executemany`` for all; only when some rows were
        duplicates (a spool replay) is it undone and redone per series, to count them."""
        conn = self._conn
        if len(firsts) == 1:  # one rank's batch (a hook's POST): its count is the whole count
            before = conn.total_changes
            conn.executemany(sql, rows)
            return [(first, conn.total_changes - before) for first, _ in firsts.values()]
        conn.execute("SAVEPOINT batch_rows")
        before = conn.total_changes
        conn.executemany(sql, rows)
        if conn.total_changes - before == len(rows):
            conn.execute("RELEASE batch_rows")
            return list(firsts.values())
        conn.execute("ROLLBACK TO batch_rows")
        conn.execute("RELEASE batch_rows")
        added, start = [], 0
        for first, n in firsts.values():  # rows are grouped by series in this order
            before = conn.total_changes
            conn.executemany(sql, rows[start:start + n])
            added.append((first, conn.total_changes - before))
            start += n
        return added

    def _note_fields(self, sid: int, names: tuple[str, ...]) -> None:
        """Record in ``series.fields`` the value fields this batch carries for the series (a write
        only when one is new; read back inside the transaction, so two writers never lose one)."""
        have = self._series_fields.get(sid, frozenset())
        if have.issuperset(names):
            return
        self._fields_before.setdefault(sid, have)
        row = self._conn.execute("SELECT fields FROM series WHERE id = ?", (sid,)).fetchone()
        stored = frozenset(row[0].split(",")) if row and row[0] else frozenset()
        fields = stored | have | set(names)
        self._conn.execute("UPDATE series SET fields = ? WHERE id = ?", (",".join(sorted(fields)), sid))
        self._series_fields[sid] = fields

    def _forget_since(self, n_series: int, n_phases: int) -> None:
        """Undo what a rolled-back transaction put in the caches: the series and phase ids it
        added (the last entries of their dicts: only an insert, under the lock, adds) and the
        fields it noted for series that existed (``_fields_before``)."""
        for key in list(islice(self._series_ids, n_series, None)):
            self._series_fields.pop(self._series_ids.pop(key), None)
        for name in list(islice(self._phase_ids, n_phases, None)):
            self._phase_names.pop(self._phase_ids.pop(name), None)
        for sid, fields in self._fields_before.items():
            if sid in self._series_fields:
                self._series_fields[sid] = fields

    @staticmethod
    def _present(samples: Sequence[Sample]) -> tuple[str, ...]:
        """The value fields any sample of the batch carries, in column order."""
        keys = _VALUE_SET.intersection(set().union(*samples))
        return tuple(name for name in VALUE_NAMES if name in keys)

    def insert_stream(self, samples: Iterable[Sample], batch_size: int = 5000) -> tuple[int, int]:
        """Insert an unbounded stream (``vramwatch import``) in transactions of ``batch_size``
        samples; memory O(batch_size). Returns ``(accepted, duplicates)`` summed over batches."""
        accepted = duplicates = 0
        batch: list[Sample] = []
        for sample in samples:
            batch.append(sample)
            if len(batch) >= batch_size:
                result = self.insert(batch)
                accepted, duplicates, batch = accepted + result.accepted, duplicates + result.duplicates, []
        if batch:
            result = self.insert(batch)
            accepted, duplicates = accepted + result.accepted, duplicates + result.duplicates
        return accepted, duplicates

    def insert(
        self, samples: Sequence[Sample], *, max_samples_per_run: int | None = None,
        busy_timeout_s: float | None = None,
    ) -> InsertResult:
        """Store validated samples in one transaction; duplicates (same key) are ignored.

        All or nothing: on any error the transaction rolls back and caches are restored.
        ``max_samples_per_run``: when storing would take a run past this many samples the
        whole batch is rolled back and :class:`RunFullError` raised (duplicates do not count).
        ``busy_timeout_s``: how long to wait for a write lock held elsewhere (default: the
        store's); past it :class:`StoreBusyError`, nothing stored.
        Cost: one ``executemany`` of tuples for the whole batch (one per series when it
        holds duplicates, see :meth:`_execute`).
        """
        if self.readonly:
            raise StoreError("store is read-only")
        if not samples:
            return InsertResult(0, 0)
        with self._lock:
            # what the caches looked like, to undo on rollback: O(what this batch changes), not
            # a copy of every series' id (that cost ~0.1 ms per POST at 4,096 series)
            n_series, n_phases = len(self._series_ids), len(self._phase_ids)
            self._fields_before = {}
            conn = self._conn
            try:
                self._wait_for_lock(busy_timeout_s)
                if max_samples_per_run is not None and self._run_counts is None:
                    self._run_counts = self._count_runs()
                conn.execute("BEGIN IMMEDIATE")
                added: dict[str, int] = {}
                by_key: dict[SeriesKey, int] = {}
                names = self._present(samples)
                rows, firsts = self._rows(samples, names)
                for sid in firsts:
                    self._note_fields(sid, names)
                for first, n in self._execute(insert_sql(names), rows, firsts):
                    key = (first["run"], first["host"], first["rank"])
                    by_key[key] = by_key.get(key, 0) + n
                    added[first["run"]] = added.get(first["run"], 0) + n
                if max_samples_per_run is not None and self._run_counts is not None:
                    for run, n in added.items():
                        stored = self._run_counts.get(run, 0)
                        if stored + n > max_samples_per_run:
                            raise RunFullError(run, stored, max_samples_per_run)
                conn.execute("COMMIT")
                if self._run_counts is not None:
                    for run, n in added.items():
                        self._run_counts[run] = self._run_counts.get(run, 0) + n
            except BaseException as exc:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                self._forget_since(n_series, n_phases)
                error = write_error(self.path, "write to", exc)
                if error is exc:
                    raise
                raise error from None
        accepted = sum(by_key.values())
        return InsertResult(accepted, len(samples) - accepted, by_key)

    def _count_runs(self) -> dict[str, int]:
        return dict(self._conn.execute(
            "SELECT s.run, count(*) FROM samples JOIN series s ON s.id = samples.series GROUP BY s.run"
        ).fetchall())

    def retain(self, cutoff_ts: float) -> RetentionResult:
        """Retention: delete samples stamped before ``cutoff_ts``, the series left empty (and the
        suspected OOMs of a rank left with none), and report which series and runs are gone (live
        state evicts them).

        One short transaction per series, so ingest is never held up for long.
        """
        if self.readonly:
            raise StoreError("store is read-only")
        deleted = 0
        gone_series: list[SeriesRow] = []
        for srow in self.series():
            with self._lock:
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                    gone = self._conn.execute(
                        "DELETE FROM samples WHERE series = ? AND ts < ?", (srow.id, cutoff_ts)
                    ).rowcount
                    emptied = self._conn.execute(
                        "DELETE FROM series WHERE id = ? AND NOT EXISTS (SELECT 1 FROM samples WHERE series = ?)",
                        (srow.id, srow.id),
                    ).rowcount
                    self._conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    try:
                        self._conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                    raise StoreError(f"cannot delete from {self.path}: {exc}") from None
                deleted += gone
                if self._run_counts is not None and gone:
                    self._run_counts[srow.run] = max(0, self._run_counts.get(srow.run, 0) - gone)
                if emptied:
                    gone_series.append(srow)
                    self._series_ids = {k: v for k, v in self._series_ids.items() if v != srow.id}
                    self._series_fields.pop(srow.id, None)
        if deleted:
            self._columns.clear()
        left = self.series() if gone_series else []
        gone_runs = sorted({s.run for s in gone_series} - {s.run for s in left})
        gone_keys = sorted({(s.run, s.host, s.rank) for s in gone_series} - {(s.run, s.host, s.rank) for s in left})
        if self._run_counts is not None:
            for run in gone_runs:
                self._run_counts.pop(run, None)
        self._forget_suspected(gone_keys)
        return RetentionResult(deleted, gone_series, gone_runs, gone_keys)

    def delete_before(self, cutoff_ts: float) -> int:
        """:meth:`retain`, returning only the number of samples deleted."""
        return self.retain(cutoff_ts).samples

    def checkpoint(self, mode: str = "PASSIVE") -> tuple[int, int, int]:
        """Fold the WAL back into the main file: (busy, wal pages, pages checkpointed).

        PASSIVE (periodic) never waits for readers; TRUNCATE (shutdown) also empties the file.
        """
        if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
            raise ValueError(f"mode: unknown checkpoint mode {mode!r}")
        try:
            if mode == "PASSIVE":
                # its own connection and lock: WAL lets a checkpoint run while the writer commits
                with self._ckpt_lock:
                    if self._ckpt_conn is None:
                        self._ckpt_conn = _connect(self.path)
                    return tuple(self._ckpt_conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone())  # type: ignore[return-value]
            with self._lock:
                return tuple(self._conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone())  # type: ignore[return-value]
        except sqlite3.Error as exc:
            raise StoreError(f"cannot checkpoint {self.path}: {exc}") from None

    def wal_bytes(self) -> int:
        """Size of the ``-wal`` file now: what a checkpoint may need to grow the main file by."""
        try:
            return os.stat(self.path + "-wal").st_size
        except OSError:
            return 0

    def reserve_bytes(self, min_free_bytes: int) -> int:
        """Free disk the collector must keep: the configured reserve plus the WAL, so that the
        final checkpoint at shutdown always has room (refuse ingest below it)."""
        return min_free_bytes + self.wal_bytes()

    def close(self) -> None:
        """Close every connection, the writer last: its close checkpoints the WAL into the main
        file and removes the -wal and -shm files (a read-only connection closing last cannot).

        Raises :class:`StoreCloseError` (one line) when that final checkpoint fails; every
        connection and the lock are released all the same.
        """
        with self._readers_lock:
            readers, self._readers = self._readers, []
        with self._ckpt_lock:
            if self._ckpt_conn is not None:
                readers.append(self._ckpt_conn)
                self._ckpt_conn = None
        for conn in readers:
            try:
                conn.close()
            except sqlite3.Error:
                pass
        self._local = threading.local()
        error: StoreCloseError | None = None
        with self._lock:
            try:
                if not self.readonly:
                    self._conn.execute("PRAGMA optimize")
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as exc:
                error = StoreCloseError(
                    f"cannot fold the write-ahead log into {self.path} at shutdown ({exc}); the samples are kept "
                    f"in {self.path}-wal and recovered on the next start once the disk has room")
            finally:
                try:
                    self._conn.close()
                finally:
                    self._release_lock()
        if error is not None:
            raise error


# every public read (Reads, Aggregates, Suspicions.suspected_records) raises StoreError, never sqlite3's
# errors: a damaged page met deep inside a command or a request is one line naming the file
for _name in sorted({name for base in (Reads, Aggregates, Suspicions) for name, value in vars(base).items()
                     if inspect.isfunction(value) and not name.startswith(("_", "keep_"))}):
    setattr(Store, _name, reads_translated(getattr(Store, _name)))
