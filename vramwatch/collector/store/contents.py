"""The database is input: what its rows may hold, checked when a store opens.

A database file comes from anywhere (copied from a cluster, written by another version, edited
by hand, damaged), and SQLite stores any value in any column: a ``ts`` of ``'x'``, a ``rank``
of 2.5, a 64 MiB ``host``. Every reader (advise, gate, export, postmortem, compare, report,
serve's restore, demo) goes through :class:`~vramwatch.collector.store.Store`, which runs
:func:`check` on its small tables when it opens and on a run's samples when a run is first read
(``series``, ``series_ids``: every sample read goes through one of them): one C-level scan
comparing each column's ``typeof()``
and ``length()`` with the field table (:data:`vramwatch.wire.FIELD_TABLE`: integers where
integers belong, numbers, text of at most :data:`MAX_TEXT` characters, ``extra`` of at most
:data:`MAX_EXTRA` bytes), and refuses a file with any bad row, in one line that names the
table, the column, the count and the first offending key
(:class:`~vramwatch.collector.store.errors.StoreError`: the CLI's exit 2). Nothing is read into
Python but the count, so a 64 MiB value costs nothing. Cost: one scan of a run's samples the
first time a store reads it (a fraction of what reading them into Python costs), one of the
series, phases and suspected-OOM tables at open (:data:`AT_OPEN`).
"""

from __future__ import annotations

import functools
import sqlite3

from vramwatch.collector.store.errors import StoreError
from vramwatch.wire import FIELD_TABLE, MAX_NAME

#: longest text a column may hold (names are at most MAX_NAME; room for what other versions wrote)
MAX_TEXT = 8 * MAX_NAME
#: largest ``extra`` document (the wire caps its keys; this caps the bytes)
MAX_EXTRA = 1 << 20

# Each predicate tests IS NOT NULL first: most columns of a sample are empty (sparse fields), and
# the NULL test is one VM opcode where typeof() is a function call (the scan costs ~40 % less).
_INTEGER = "({c} IS NOT NULL AND typeof({c}) <> 'integer')"
_NUMBER = "({c} IS NOT NULL AND typeof({c}) NOT IN ('integer', 'real'))"
_TEXT = "({c} IS NOT NULL AND (typeof({c}) <> 'text' OR length({c}) > " + str(MAX_TEXT) + "))"
_EXTRA = ("({c} IS NOT NULL AND (typeof({c}) NOT IN ('text', 'blob') OR length(CAST({c} AS BLOB)) > "
          + str(MAX_EXTRA) + "))")
_BY_KIND = {"i": _INTEGER, "b": _INTEGER, "flag": _INTEGER, "phase": _INTEGER, "ts": _NUMBER, "f": _NUMBER,
            "s": _TEXT, "allocator": _TEXT, "extra": _EXTRA}


@functools.cache
def rules() -> dict[str, list[tuple[str, str]]]:
    """(column, SQL predicate true for a bad value) per table, from the field table."""
    out: dict[str, list[tuple[str, str]]] = {
        "samples": [("series", _INTEGER), ("seq", _INTEGER)],
        "series": [("id", _INTEGER)],
        "phases": [("id", _INTEGER), ("name", _TEXT)],
        # the suspected OOMs the collector kept (schema.LATER_TABLES): bounded per rank, checked at open
        "suspected_ooms": [("run", _TEXT), ("host", _TEXT), ("rank", _INTEGER), ("ts", _NUMBER), ("step", _INTEGER),
                           ("used_before", _INTEGER), ("used_after", _INTEGER), ("total", _INTEGER),
                           ("reason", _TEXT)],
        "suspected_dropped": [("run", _TEXT), ("host", _TEXT), ("rank", _INTEGER), ("dropped", _INTEGER)],
    }
    for f in FIELD_TABLE:
        rule = _BY_KIND.get(f.kind)
        if rule is not None and f.table in out and (f.column, rule) not in out[f.table]:
            out[f.table].append((f.column, rule))
    return out


#: the small tables checked when a store opens (a run's samples are checked when it is first read)
AT_OPEN = ("series", "phases", "suspected_ooms", "suspected_dropped")


def check(conn: sqlite3.Connection, path: str, tables: tuple[str, ...] = AT_OPEN,
          run: str | None = None) -> None:
    """:class:`StoreError` naming the first column of one of ``tables`` that holds a value of the
    wrong type or size (see the module docstring); nothing when every row is well formed.
    ``run``: only the samples of that run's series (the primary key's range: a run's check costs
    a scan of that run only)."""
    present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, columns in rules().items():
        if table not in present or table not in tables:
            continue
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        columns = [(c, rule.format(c=c)) for c, rule in columns if c in have]
        if not columns:
            continue
        where, params = ("", ()) if run is None or table != "samples" else \
            (" AND series IN (SELECT id FROM series WHERE run = ?)", (run,))
        # one pass that stops at the first bad row (OR short-circuits; half the cost of counting)
        bad_row = " OR ".join(f"({pred})" for _, pred in columns)
        if conn.execute(f"SELECT 1 FROM {table} WHERE ({bad_row}){where} LIMIT 1", params).fetchone() is None:
            continue
        for column, pred in columns:  # which column, and how many rows: only for a bad file
            bad = conn.execute(f"SELECT COUNT(*) FROM {table} WHERE ({pred}){where}", params).fetchone()[0]
            if bad:
                raise StoreError(f"database {path}: {bad:,} rows of {table} hold a {column} of the wrong type or "
                                 f"size (not what vramwatch writes); repair or remove them, e.g. "
                                 f"DELETE FROM {table} WHERE {pred}")


__all__ = ["AT_OPEN", "MAX_EXTRA", "MAX_TEXT", "check", "rules"]
