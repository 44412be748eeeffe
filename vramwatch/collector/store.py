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


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=10)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, timeout=10, isolation_level=None)
    return conn


class Store:
    """One SQLite database file. Thread-safe: writes are serialised by a lock; each reading
    thread gets its own connection (WAL readers never block the writer)."""

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False) -> None:
        self.path = str(path)
        self.readonly = readonly
        if not readonly:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        elif not Path(self.path).exists():
            raise StoreError(f"database {self.path} does not exist")
        self._lock = threading.Lock()
        self._local = threading.local()
        try:
            self._conn = _connect(self.path, readonly=readonly)
            if not readonly:
                self._conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL in WAL mode: a power loss may lose the last transactions, never corrupts.
                self._conn.execute("PRAGMA synchronous=NORMAL")
                self._conn.execute("PRAGMA wal_autocheckpoint=4000")
                self._migrate()
                # Probe writability now so a read-only file fails at start, not at first ingest.
                self._conn.execute("BEGIN IMMEDIATE")
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
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _connect(self.path, readonly=True)
            self._local.conn = conn
        return conn

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

    def insert(self, samples: Sequence[Sample]) -> InsertResult:
        """Store validated samples in one transaction; duplicates (same key) are ignored.

        All or nothing: on any error the transaction rolls back and caches are restored.
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
                conn.execute("BEGIN IMMEDIATE")
                rows = []
                for s in samples:
                    extra = s.get("extra")
                    rows.append((
                        self._series_id(s), s["step"], self._phase_id(s["phase"]), s["ts"],
                        s["allocated_bytes"], s["reserved_bytes"], s["peak_allocated_bytes"],
                        s["inactive_split_bytes"], s["alloc_retries"], s["ooms"], s["nvml_used_bytes"],
                        s["total_bytes"], s.get("process_used_bytes"), s.get("active_bytes"),
                        s.get("step_time_s"), s.get("tokens"), orjson.dumps(extra) if extra else None,
                    ))
                after_series = conn.total_changes
                conn.executemany(
                    "INSERT OR IGNORE INTO samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows
                )
                inserted = conn.total_changes - after_series
                conn.execute("COMMIT")
            except BaseException as exc:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                self._series_ids = series_before
                self._phase_ids = phases_before
                self._phase_names = {v: k for k, v in phases_before.items()}
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"cannot write to {self.path}: {exc}") from None
                raise
        return InsertResult(inserted, len(samples) - inserted)

    def checkpoint(self) -> None:
        """Fold the WAL back into the main file (called at shutdown and periodically)."""
        with self._lock:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._lock:
            try:
                if not self.readonly:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    self._conn.execute("PRAGMA optimize")
            finally:
                self._conn.close()
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

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

