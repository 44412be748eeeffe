"""The store's tables, derived from the wire field table, and their versioned migrations.

Layout (chosen for size and for the idempotency key):

* ``series`` holds what is constant for one process, once: its identity is
  :func:`vramwatch.wire.series_key` ``(run, host, rank)`` plus the ``incarnation`` that tells
  restarts of one rank apart (``UNIQUE (run, host, rank, incarnation)``);
* ``phases`` names phases by small integers; id :data:`TRAIN_PHASE_ID` is ``train``;
* ``samples`` is a ``WITHOUT ROWID`` table clustered on ``(series, step, phase, seq)``: the
  primary key *is* the idempotency key, so there is no second index and a duplicate is an
  ``INSERT OR IGNORE`` no-op. ``seq`` numbers same-named phases at one step, so two
  checkpoints saved at one step are two samples. A measurement that was not taken is NULL,
  never 0. Integers are SQLite varints: a typical sample costs well under 100 bytes.

Migrations are versioned (``PRAGMA user_version``) and never edited once released. A field
added to :data:`vramwatch.wire.FIELD_TABLE` later needs no migration: a nullable column is
added on open for writing (:func:`add_missing_columns`); so is a table added later
(:data:`LATER_TABLES`, :func:`add_missing_tables`), which a read-only open of a file that lacks it
reads as empty (what opening it for writing would create).

Tables added later:

* ``suspected_ooms``: the OOMs the trend engine suspected from device memory alone
  (:class:`vramwatch.runlife.SuspectedOom`), per ``(run, host, rank)`` as the run-life fold keeps
  them: at most :data:`vramwatch.runlife.MAX_SUSPECTED` a rank, the first and the latest, keyed
  by the moment (``ts``, ``step``) so a second report is a no-op;
* ``suspected_dropped``: per rank, how many were dropped past that bound (counted only).
"""

from __future__ import annotations

import functools
import sqlite3

from vramwatch.wire import FIELD_BY_NAME, FIELD_TABLE, TRAIN_PHASE, Field

#: ``phases.id`` of :data:`vramwatch.wire.TRAIN_PHASE` (seeded by the first migration).
TRAIN_PHASE_ID = 0

_V1 = f"""
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
INSERT INTO phases (id, name) VALUES ({TRAIN_PHASE_ID}, '{TRAIN_PHASE}');
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
"""

_V1_FIELDS = ("schema,ts,allocated_bytes,reserved_bytes,peak_allocated_bytes,inactive_split_bytes,alloc_retries,"
              "ooms,nvml_used_bytes,total_bytes,process_used_bytes,active_bytes,step_time_s,tokens,extra")
_V1_SAMPLE_COLUMNS = ("ts, allocated, reserved, peak, inactive_split, alloc_retries, ooms, nvml_used, total, "
                      "process_used, active, step_time, tokens, extra")

# Schema 2: series identity is wire.series_key + incarnation (the same rank from two hosts is
# two series); measurements are nullable (not measured); seq joins the idempotency key; host
# memory, foreign processes, the OOM/exit markers and the sample's wire schema get columns;
# series.fields lists the value fields its samples ever carried (reads select only those).
_V2 = f"""
CREATE TABLE series2 (
    id INTEGER PRIMARY KEY,
    run TEXT NOT NULL,
    host TEXT NOT NULL,
    rank INTEGER NOT NULL,
    incarnation TEXT NOT NULL,
    local_rank INTEGER, world_size INTEGER, uuid TEXT, gpu INTEGER, pid INTEGER,
    allocator TEXT,
    fields TEXT,
    UNIQUE (run, host, rank, incarnation)
);
INSERT INTO series2 SELECT id, run, host, rank, incarnation, local_rank, world_size, uuid, gpu, pid, allocator,
    '{_V1_FIELDS}' FROM series;
DROP TABLE series;
ALTER TABLE series2 RENAME TO series;
CREATE TABLE samples2 (
    series INTEGER NOT NULL,
    step INTEGER NOT NULL,
    phase INTEGER NOT NULL,
    seq INTEGER NOT NULL DEFAULT 0,
    ts REAL NOT NULL,
    allocated INTEGER,
    reserved INTEGER,
    peak INTEGER,
    inactive_split INTEGER,
    alloc_retries INTEGER,
    ooms INTEGER,
    nvml_used INTEGER,
    total INTEGER NOT NULL,
    process_used INTEGER,
    active INTEGER,
    step_time REAL,
    tokens INTEGER,
    extra BLOB,
    host_rss INTEGER,
    host_children_rss INTEGER,
    host_available INTEGER,
    host_pinned INTEGER,
    foreign_used INTEGER,
    oom_marked INTEGER,
    exited INTEGER,
    schema INTEGER,
    PRIMARY KEY (series, step, phase, seq)
) WITHOUT ROWID;
INSERT INTO samples2 (series, step, phase, seq, schema, {_V1_SAMPLE_COLUMNS})
    SELECT series, step, phase, 0, 1, {_V1_SAMPLE_COLUMNS} FROM samples;
DROP TABLE samples;
ALTER TABLE samples2 RENAME TO samples;
"""

#: Versioned migrations: index i brings the schema from version i to i+1.
MIGRATIONS: tuple[str, ...] = (_V1, _V2)
SCHEMA_VERSION = len(MIGRATIONS)

#: samples columns that are the idempotency key (besides ``series``)
KEY_FIELDS = ("step", "phase", "seq")
#: value fields of ``samples`` (wire names), in column order of INSERT and SELECT
VALUE_FIELDS: tuple[Field, ...] = tuple(f for f in FIELD_TABLE if f.table == "samples" and f.name not in KEY_FIELDS)
VALUE_NAMES: tuple[str, ...] = tuple(f.name for f in VALUE_FIELDS)
VALUE_SQL: str = ", ".join(f.column for f in VALUE_FIELDS)
#: every column of ``samples`` the field table defines
SAMPLE_COLUMNS: tuple[str, ...] = tuple(f.column for f in FIELD_TABLE if f.table == "samples")
#: numeric wire field -> ``samples`` column: what series queries may ask for
FIELD_COLUMNS: dict[str, str] = {
    f.name: f.column for f in VALUE_FIELDS if f.kind in ("i", "b", "ts", "f", "flag") and f.name != "schema"
}
#: identity fields kept per series besides the key (run, host, rank, incarnation)
SERIES_OPTIONAL: tuple[str, ...] = tuple(
    f.name for f in FIELD_TABLE if f.table == "series" and f.name not in ("run", "host", "rank", "incarnation")
)
FLAG_NAMES = frozenset(f.name for f in FIELD_TABLE if f.kind == "flag")


@functools.lru_cache(maxsize=64)
def insert_sql(names: tuple[str, ...]) -> str:
    """INSERT of the key and the value fields ``names``; the other columns stay NULL (every
    bound parameter costs, and most batches carry the same few fields: one statement each)."""
    cols = ", ".join(["series", "step", "phase", "seq", *(FIELD_BY_NAME[n].column for n in names)])
    # ON CONFLICT DO NOTHING skips only a duplicate key; OR IGNORE would also drop a row that
    # breaks NOT NULL without a word
    return f"INSERT INTO samples ({cols}) VALUES ({', '.join('?' * (4 + len(names)))}) ON CONFLICT DO NOTHING"


#: tables added after the last migration, created on open for writing (:func:`add_missing_tables`)
LATER_TABLES: dict[str, str] = {
    "suspected_ooms": """CREATE TABLE IF NOT EXISTS suspected_ooms (
    run TEXT NOT NULL,
    host TEXT NOT NULL,
    rank INTEGER NOT NULL,
    ts REAL NOT NULL,
    step INTEGER NOT NULL,
    used_before INTEGER NOT NULL,
    used_after INTEGER NOT NULL,
    total INTEGER,
    reason TEXT NOT NULL,
    PRIMARY KEY (run, host, rank, ts, step)
) WITHOUT ROWID""",
    "suspected_dropped": """CREATE TABLE IF NOT EXISTS suspected_dropped (
    run TEXT NOT NULL,
    host TEXT NOT NULL,
    rank INTEGER NOT NULL,
    dropped INTEGER NOT NULL,
    PRIMARY KEY (run, host, rank)
) WITHOUT ROWID""",
}

_SQL_TYPES = {"i": "INTEGER", "b": "INTEGER", "flag": "INTEGER", "s": "TEXT", "phase": "INTEGER",
              "allocator": "TEXT", "ts": "REAL", "f": "REAL", "extra": "BLOB"}


def migrate(conn: sqlite3.Connection, path: str) -> None:
    """Bring ``conn``'s database to :data:`SCHEMA_VERSION`, one transaction per migration.

    Cost: migration 2 copies every sample once (a table rebuild; ~1 s per million samples).
    """
    from vramwatch.collector.store.errors import StoreError

    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(f"{path} has schema {version}, newer than this vramwatch ({SCHEMA_VERSION})")
    for target in range(version, SCHEMA_VERSION):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[target].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version={target + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    add_missing_columns(conn)
    add_missing_tables(conn)


def add_missing_columns(conn: sqlite3.Connection) -> list[str]:
    """Add a nullable column for every field of the table the database does not have yet
    (a field added after the last migration); returns the columns added."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(samples)")}
    added = []
    for f in VALUE_FIELDS:
        if f.column not in have:
            conn.execute(f"ALTER TABLE samples ADD COLUMN {f.column} {_SQL_TYPES[f.kind]}")
            added.append(f.column)
    return added


def add_missing_tables(conn: sqlite3.Connection) -> list[str]:
    """Create every table of :data:`LATER_TABLES` the database does not have yet; returns those created."""
    have = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    added = []
    for name, ddl in LATER_TABLES.items():
        if name not in have:
            conn.execute(ddl)
            added.append(name)
    return added
