"""SQLite store: every sample, on disk, idempotent.

Layout chosen for size and for the idempotency key (run, rank, incarnation, step, phase):

* ``series`` holds what is constant for one process (run, host, rank, incarnation, uuid,
  gpu, pid, ...), once;
* ``samples`` is a ``WITHOUT ROWID`` table clustered on (series, step, phase): the
  primary key *is* the idempotency key, so there is no second index and a duplicate is
  an ``INSERT OR IGNORE`` no-op. Integers are stored as SQLite varints, so a typical
  sample costs well under 100 bytes on disk (see docs/benchmarks.md).

The store is used from one writer (the collector's ingest path, serialised by a lock)
and from readers on other connections (WAL lets them run concurrently).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from vramwatch.wire import Sample

# Versioned migrations: index i brings the schema from version i to i+1.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE series (
        id INTEGER PRIMARY KEY,
        run TEXT NOT NULL,
        host TEXT NOT NULL,
        rank INTEGER NOT NULL,
        incarnation TEXT NOT NULL,
        local_rank INTEGER, world_size INTEGER, uuid TEXT, gpu INTEGER, pid INTEGER,
        allocator TEXT,
        UNIQUE (run, rank, incarnation)
    );
    CREATE INDEX series_by_run ON series (run, host, rank);
    CREATE TABLE phases (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
    INSERT INTO phases (id, name) VALUES (0, 'train');
    CREATE TABLE samples (
        series INTEGER NOT NULL,
        step INTEGER NOT NULL,
        phase INTEGER NOT NULL,
        ts REAL NOT NULL,
        allocated INTEGER NOT NULL,
        reserved INTEGER NOT NULL,
        peak INTEGER NOT NULL,
        inactive_split INTEGER NOT NULL,
        alloc_retries INTEGER NOT NULL,
        ooms INTEGER NOT NULL,
        nvml_used INTEGER,
        total INTEGER NOT NULL,
        process_used INTEGER,
        active INTEGER,
        step_time REAL,
        tokens INTEGER,
        extra BLOB,
        PRIMARY KEY (series, step, phase)
    ) WITHOUT ROWID;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)

# Column order of `samples` after the key, paired with wire names.
VALUE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("ts", "ts"),
    ("allocated", "allocated_bytes"),
    ("reserved", "reserved_bytes"),
    ("peak", "peak_allocated_bytes"),
    ("inactive_split", "inactive_split_bytes"),
    ("alloc_retries", "alloc_retries"),
    ("ooms", "ooms"),
    ("nvml_used", "nvml_used_bytes"),
    ("total", "total_bytes"),
    ("process_used", "process_used_bytes"),
    ("active", "active_bytes"),
    ("step_time", "step_time_s"),
    ("tokens", "tokens"),
)
#: Wire field -> column, for series queries.
FIELD_COLUMNS: dict[str, str] = {wire: col for col, wire in VALUE_COLUMNS}
SERIES_OPTIONAL = ("local_rank", "world_size", "uuid", "gpu", "pid", "allocator")


class StoreError(RuntimeError):
    """The database cannot be opened or written (locked, read-only, newer schema)."""


class StoreBusyError(StoreError):
    """Another connection or process holds the write lock past the busy timeout."""


class RunFullError(StoreError):
    """A run reached its cap of stored samples (``max_samples_per_run``); nothing was stored."""

    def __init__(self, run: str, stored: int, cap: int) -> None:
        super().__init__(f"run: {run!r} holds {stored} samples, its cap is {cap} (max_samples_per_run)")
        self.run = run
        self.stored = stored
        self.cap = cap


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
class SeriesRow:
    id: int
    run: str
    host: str
    rank: int
    incarnation: str
    local_rank: int | None
    world_size: int | None
    uuid: str | None
    gpu: int | None
    pid: int | None
    allocator: str | None


@dataclass(frozen=True)
class InsertResult:
    accepted: int
    duplicates: int


def _connect(path: str, *, readonly: bool = False, timeout: float = 10.0) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=timeout)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, timeout=timeout, isolation_level=None)
    return conn


def thread_reader(local: threading.local, path: str) -> sqlite3.Connection:
    """This thread's read-only connection to ``path``, opened on first use (WAL readers never
    block the writer, and a connection must not be shared across threads mid-query)."""
    conn = getattr(local, "conn", None)
    if conn is None:
        conn = local.conn = _connect(path, readonly=True)
    return conn


class Store:
    """One SQLite database file. Thread-safe: writes are serialised by a lock; each reading
    thread gets its own connection (WAL readers never block the writer)."""

    def __init__(
        self, path: str | os.PathLike[str], *, readonly: bool = False, busy_timeout_s: float = 10.0
    ) -> None:
        """``busy_timeout_s``: how long a write waits for another process's lock before failing."""
        self.path = str(path)
        self.readonly = readonly
        if not readonly:
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot open database {self.path}: {exc.strerror}") from None
        elif not Path(self.path).exists():
            raise StoreError(f"database {self.path} does not exist")
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
        try:
            self._conn = _connect(self.path, readonly=readonly, timeout=busy_timeout_s)
            if not readonly:
                self._conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL in WAL mode: a power loss may lose the last transactions, never corrupts.
                self._conn.execute("PRAGMA synchronous=NORMAL")
                self._conn.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
                self._conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
                self._migrate()
                # Probe writability now so a read-only file fails at start, not at first ingest.
                # BEGIN IMMEDIATE alone succeeds on a read-only file in WAL mode: write something.
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    self._conn.execute("CREATE TABLE _vramwatch_write_probe (x)")
                finally:
                    self._conn.execute("ROLLBACK")
            else:
                version = self._conn.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise StoreError(f"{self.path} has schema {version}, newer than this vramwatch ({SCHEMA_VERSION})")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open database {self.path}: {exc}") from None
        self._series_ids: dict[tuple[str, int, str], int] = {}
        self._phase_ids: dict[str, int] = {}
        self._phase_names: dict[int, str] = {}
        self._load_caches()

    # ------------------------------------------------------------ setup
    def _migrate(self) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} has schema {version}, newer than this vramwatch ({SCHEMA_VERSION})")
        for target in range(version, SCHEMA_VERSION):
            with self._lock:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in MIGRATIONS[target].split(";"):
                        if statement.strip():
                            self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version={target + 1}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    def _load_caches(self) -> None:
        for sid, run, rank, inc in self._conn.execute("SELECT id, run, rank, incarnation FROM series"):
            self._series_ids[(run, rank, inc)] = sid
        for pid, name in self._conn.execute("SELECT id, name FROM phases"):
            self._phase_ids[name] = pid
            self._phase_names[pid] = name

    def _reader(self) -> sqlite3.Connection:
        if getattr(self._local, "conn", None) is None:
            with self._readers_lock:  # remembered so close() can close every thread's reader
                self._readers.append(thread_reader(self._local, self.path))
        return self._local.conn

    # ------------------------------------------------------------ writes
    def _series_id(self, s: Sample) -> int:
        key = (s["run"], s["rank"], s.get("incarnation", ""))
        sid = self._series_ids.get(key)
        if sid is None:
            cur = self._conn.execute(
                "INSERT INTO series (run, host, rank, incarnation, local_rank, world_size, uuid, gpu, pid, allocator)"
                " VALUES (?,?,?,?,?,?,?,?,?,?)",
                (key[0], s["host"], key[1], key[2], *(s.get(name) for name in SERIES_OPTIONAL)),
            )
            sid = cur.lastrowid
            assert sid is not None
            self._series_ids[key] = sid
        return sid

    def _phase_id(self, name: str) -> int:
        pid = self._phase_ids.get(name)
        if pid is None:
            cur = self._conn.execute("INSERT INTO phases (name) VALUES (?)", (name,))
            pid = cur.lastrowid
            assert pid is not None
            self._phase_ids[name] = pid
            self._phase_names[pid] = name
        return pid

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
        """
        if self.readonly:
            raise StoreError("store is read-only")
        if not samples:
            return InsertResult(0, 0)
        with self._lock:
            series_before = dict(self._series_ids)
            phases_before = dict(self._phase_ids)
            conn = self._conn
            try:
                busy_ms = int(1000 * (self._busy_timeout_s if busy_timeout_s is None else busy_timeout_s))
                if busy_ms != self._busy_ms:
                    conn.execute(f"PRAGMA busy_timeout={busy_ms}")
                    self._busy_ms = busy_ms
                if max_samples_per_run is not None and self._run_counts is None:
                    self._run_counts = self._count_runs()
                conn.execute("BEGIN IMMEDIATE")
                rows_by_run: dict[str, list[tuple[Any, ...]]] = {}
                for s in samples:
                    extra = s.get("extra")
                    rows = rows_by_run.setdefault(s["run"], [])
                    rows.append((
                        self._series_id(s), s["step"], self._phase_id(s["phase"]), s["ts"],
                        s["allocated_bytes"], s["reserved_bytes"], s["peak_allocated_bytes"],
                        s["inactive_split_bytes"], s["alloc_retries"], s["ooms"], s["nvml_used_bytes"],
                        s["total_bytes"], s.get("process_used_bytes"), s.get("active_bytes"),
                        s.get("step_time_s"), s.get("tokens"), orjson.dumps(extra) if extra else None,
                    ))
                inserted = 0
                added: dict[str, int] = {}
                for run, rows in rows_by_run.items():
                    before = conn.total_changes
                    conn.executemany(
                        "INSERT OR IGNORE INTO samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows
                    )
                    added[run] = conn.total_changes - before
                    inserted += added[run]
                    if max_samples_per_run is not None and self._run_counts is not None:
                        stored = self._run_counts.get(run, 0)
                        if stored + added[run] > max_samples_per_run:
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
                self._series_ids = series_before
                self._phase_ids = phases_before
                self._phase_names = {v: k for k, v in phases_before.items()}
                if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
                    raise StoreBusyError(f"cannot write to {self.path}: {exc}") from None
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"cannot write to {self.path}: {exc}") from None
                raise
        return InsertResult(inserted, len(samples) - inserted)

    def _count_runs(self) -> dict[str, int]:
        return dict(self._conn.execute(
            "SELECT s.run, count(*) FROM samples JOIN series s ON s.id = samples.series GROUP BY s.run"
        ).fetchall())

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

    def delete_before(self, cutoff_ts: float) -> int:
        """Retention: delete samples stamped before ``cutoff_ts`` and series left empty.

        One short transaction per series, so ingest is never held up for long.
        """
        if self.readonly:
            raise StoreError("store is read-only")
        deleted = 0
        ids = [row[0] for row in self._reader().execute("SELECT id FROM series ORDER BY id")]
        for sid in ids:
            with self._lock:
                try:
                    run = self._conn.execute("SELECT run FROM series WHERE id = ?", (sid,)).fetchone()
                    if run is None:
                        continue
                    self._conn.execute("BEGIN IMMEDIATE")
                    gone = self._conn.execute(
                        "DELETE FROM samples WHERE series = ? AND ts < ?", (sid, cutoff_ts)
                    ).rowcount
                    emptied = self._conn.execute(
                        "DELETE FROM series WHERE id = ? AND NOT EXISTS (SELECT 1 FROM samples WHERE series = ?)",
                        (sid, sid),
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
                    self._run_counts[run[0]] = max(0, self._run_counts.get(run[0], 0) - gone)
                if emptied:
                    self._series_ids = {k: v for k, v in self._series_ids.items() if v != sid}
        return deleted

    def close(self) -> None:
        """Close every connection, the writer last: its close checkpoints the WAL into the main
        file and removes the -wal and -shm files (a read-only connection closing last cannot)."""
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
        with self._lock:
            try:
                if not self.readonly:
                    self._conn.execute("PRAGMA optimize")
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._conn.close()

    # ------------------------------------------------------------ reads
    def series(self, run: str | None = None) -> list[SeriesRow]:
        conn = self._reader()
        sql = "SELECT id, run, host, rank, incarnation, local_rank, world_size, uuid, gpu, pid, allocator FROM series"
        rows = conn.execute(sql + " WHERE run = ? ORDER BY id", (run,)) if run else conn.execute(sql + " ORDER BY id")
        return [SeriesRow(*row) for row in rows]

    def runs(self) -> list[str]:
        return [r[0] for r in self._reader().execute("SELECT DISTINCT run FROM series ORDER BY run")]

    def count(self, run: str | None = None) -> int:
        conn = self._reader()
        if run is None:
            return conn.execute("SELECT count(*) FROM samples").fetchone()[0]
        return conn.execute(
            "SELECT count(*) FROM samples WHERE series IN (SELECT id FROM series WHERE run = ?)", (run,)
        ).fetchone()[0]

    def phase_name(self, phase_id: int) -> str:
        name = self._phase_names.get(phase_id)
        if name is None:
            row = self._reader().execute("SELECT name FROM phases WHERE id = ?", (phase_id,)).fetchone()
            name = row[0] if row else "?"
            self._phase_names[phase_id] = name
        return name

    def _series_ids_for(self, run: str, host: str | None, rank: int | None) -> list[int]:
        clauses, params = ["run = ?"], [run]
        if host is not None:
            clauses.append("host = ?")
            params.append(host)
        if rank is not None:
            if not -(2**63) <= rank < 2**63:  # beyond SQLite's integers: no such series
                return []
            clauses.append("rank = ?")
            params.append(rank)
        sql = f"SELECT id FROM series WHERE {' AND '.join(clauses)} ORDER BY id"
        return [r[0] for r in self._reader().execute(sql, params)]

    def iter_samples(
        self, run: str | None = None, *, host: str | None = None, rank: int | None = None, batch: int = 5000
    ) -> Iterator[Sample]:
        """Samples as wire dicts, series by series in insertion order, each by (step, phase).

        What was ingested comes back unchanged (identity fields from ``series``).
        """
        conn = self._reader()
        rows = self.series(run)
        for srow in rows:
            if (host is not None and srow.host != host) or (rank is not None and srow.rank != rank):
                continue
            ident: dict[str, Any] = {"schema": 1, "run": srow.run, "host": srow.host, "rank": srow.rank}
            optional = {
                name: getattr(srow, name) for name in SERIES_OPTIONAL if getattr(srow, name) is not None
            }
            if srow.incarnation:
                optional["incarnation"] = srow.incarnation
            cur = conn.execute(
                "SELECT step, phase, ts, allocated, reserved, peak, inactive_split, alloc_retries, ooms,"
                " nvml_used, total, process_used, active, step_time, tokens, extra"
                " FROM samples WHERE series = ? ORDER BY step, phase",
                (srow.id,),
            )
            while True:
                chunk = cur.fetchmany(batch)
                if not chunk:
                    break
                for (step, phase, ts, alloc, resv, peak, inact, retries, ooms, used, total,
                     proc, active, step_time, tokens, extra) in chunk:
                    s: dict[str, Any] = {
                        **ident, "step": step, "ts": ts, "phase": self.phase_name(phase),
                        "allocated_bytes": alloc, "reserved_bytes": resv, "peak_allocated_bytes": peak,
                        "inactive_split_bytes": inact, "alloc_retries": retries, "ooms": ooms,
                        "nvml_used_bytes": used, "total_bytes": total, **optional,
                    }
                    if proc is not None:
                        s["process_used_bytes"] = proc
                    if active is not None:
                        s["active_bytes"] = active
                    if step_time is not None:
                        s["step_time_s"] = step_time
                    if tokens is not None:
                        s["tokens"] = tokens
                    if extra is not None:
                        s["extra"] = orjson.loads(extra)
                    yield s  # type: ignore[misc]

    def iter_replay(self, batch: int = 10000) -> Iterator[Sample]:
        """Every sample, for rebuilding live state after a restart: per series, by step."""
        yield from self.iter_samples(batch=batch)

    def query_columns(
        self,
        run: str,
        host: str | None,
        rank: int | None,
        fields: Iterable[str],
        *,
        phase: str | None = "train",
        x: str = "step",
        start: float | None = None,
        end: float | None = None,
    ) -> tuple[list[float], dict[str, list[Any]]]:
        """Columns for charts: x values and one list per wire field, ordered by x.

        Several incarnations of one rank are merged by x (a restarted rank continues).
        """
        fields = list(fields)
        cols = [FIELD_COLUMNS[f] for f in fields]
        ids = self._series_ids_for(run, host, rank)
        if not ids:
            return [], {f: [] for f in fields}
        xcol = "step" if x == "step" else "ts"
        clauses = [f"series IN ({','.join('?' * len(ids))})"]
        params: list[Any] = list(ids)
        if phase is not None:
            pid = self._phase_ids.get(phase)
            if pid is None:
                row = self._reader().execute("SELECT id FROM phases WHERE name = ?", (phase,)).fetchone()
                if row is None:
                    return [], {f: [] for f in fields}
                pid = row[0]
            clauses.append("phase = ?")
            params.append(pid)
        if start is not None:
            clauses.append(f"{xcol} >= ?")
            params.append(start)
        if end is not None:
            clauses.append(f"{xcol} <= ?")
            params.append(end)
        select = ", ".join([xcol, *cols]) if cols else xcol
        order = f" ORDER BY {xcol}" if len(ids) > 1 or xcol == "ts" else ""
        rows = self._reader().execute(f"SELECT {select} FROM samples WHERE {' AND '.join(clauses)}{order}", params)
        data = rows.fetchall()
        xs = [r[0] for r in data]
        out = {f: [r[i + 1] for r in data] for i, f in enumerate(fields)}
        return xs, out

    def phase_samples(self, run: str, host: str | None = None, rank: int | None = None) -> list[Sample]:
        """Every non-train sample (checkpoint, eval, ...) of a run, for bands and markers."""
        return list(self._phase_rows(run, host, rank))

    def _phase_rows(self, run: str, host: str | None, rank: int | None) -> Iterator[Sample]:
        ids = self._series_ids_for(run, host, rank)
        if not ids:
            return
        by_id = {r.id: r for r in self.series(run)}
        cur = self._reader().execute(
            "SELECT series, step, phase, ts, allocated, reserved, peak, nvml_used, total FROM samples"
            f" WHERE series IN ({','.join('?' * len(ids))}) AND phase != 0 ORDER BY ts",
            ids,
        )
        for sid, step, phase, ts, alloc, resv, peak, used, total in cur:
            srow = by_id[sid]
            yield {  # type: ignore[misc]
                "run": srow.run, "host": srow.host, "rank": srow.rank, "step": step, "ts": ts,
                "phase": self.phase_name(phase), "allocated_bytes": alloc, "reserved_bytes": resv,
                "peak_allocated_bytes": peak, "nvml_used_bytes": used, "total_bytes": total,
            }

    def file_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal", "-shm"):
            p = Path(self.path + suffix)
            if p.exists():
                total += p.stat().st_size
        return total

