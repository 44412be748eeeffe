"""The OOMs the trend engine suspected from device memory alone, kept in the store as the run-life
fold keeps them (:meth:`vramwatch.runlife.RankLife.suspect`), so a run listed or restored without
its engine being replayed (a retired run, start-up, the runs list) counts them. Mixed into ``Store``.

Per ``(run, host, rank)``: at most :data:`~vramwatch.runlife.MAX_SUSPECTED` records, by moment
(``ts``, then ``step``); past it the second-oldest is dropped (the first and the latest stay) and
counted in ``suspected_dropped``, the fold's rule, so :meth:`Suspicions.suspected_records` equals
the fold's records and count for the same reports in any order (tests/runlife/test_runlife_readers.py).
A report of a kept moment is a no-op (the primary key). Tables: ``schema.LATER_TABLES``, created on
open for writing; a read-only open of a file without them reads none.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from vramwatch.collector.store.errors import StoreError
from vramwatch.collector.store.transactions import Transactions
from vramwatch.runlife import MAX_SUSPECTED, SuspectedOom, SuspectedRecords

#: one report: the rank (run, host, rank) and what was suspected there
SuspectedReport = tuple[str, str, int, SuspectedOom]

_INSERT = ("INSERT INTO suspected_ooms (run, host, rank, ts, step, used_before, used_after, total, reason)"
           " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING")
_RANK = "run = ? AND host = ? AND rank = ?"
#: a row's rank has a process stored in the run (its run bound as the second parameter)
_HAS_SERIES = "(host, rank) IN (SELECT host, rank FROM series WHERE run = ?)"
#: the run's records a rank at a time, at most MAX_SUSPECTED of them (the first and the latest),
#: each with the count of its rank's rows (the rest are counted as dropped)
_BOUNDED_READ = f"""SELECT host, rank, ts, step, used_before, used_after, total, reason, n FROM (
    SELECT *, ROW_NUMBER() OVER w AS i, COUNT(*) OVER (PARTITION BY host, rank) AS n
    FROM suspected_ooms WHERE run = ? AND {_HAS_SERIES}
    WINDOW w AS (PARTITION BY host, rank ORDER BY ts, step))
WHERE i = 1 OR i > n - {MAX_SUSPECTED - 1} ORDER BY host, rank, ts, step"""


class Suspicions(Transactions):
    """Writes and reads of the suspected OOMs; ``Store`` provides the connections and the lock,
    :class:`~vramwatch.collector.store.transactions.Transactions` the write transaction."""

    path: str
    readonly: bool

    def _reader(self) -> sqlite3.Connection:  # pragma: no cover - provided by Store
        raise NotImplementedError

    def keep_suspected(self, reports: Iterable[SuspectedReport], *, busy_timeout_s: float | None = None) -> int:
        """Store suspected OOMs in one transaction (the fold's bound per rank); returns how many
        were new. ``busy_timeout_s``: how long to wait for a write lock held elsewhere (default: the
        store's); past it :class:`StoreBusyError`, nothing stored. Cost: per new report an insert,
        a count of its rank's rows (at most MAX_SUSPECTED + 1) and, past the bound, one delete."""
        reports = list(reports)
        if self.readonly:
            raise StoreError("store is read-only")
        if not reports:
            return 0
        new = 0
        with self._writing(busy_timeout_s, "write to") as conn:
            for run, host, rank, found in reports:
                new += self._keep_one(conn, (run, host, rank), found)
        return new

    @staticmethod
    def _keep_one(conn: sqlite3.Connection, key: tuple[str, str, int], found: SuspectedOom) -> int:
        before = conn.total_changes
        conn.execute(_INSERT, (*key, found.ts, found.step, found.used_before_bytes, found.used_after_bytes,
                               found.total_bytes, found.reason))
        if conn.total_changes == before:
            return 0  # a moment already kept
        if conn.execute(f"SELECT COUNT(*) FROM suspected_ooms WHERE {_RANK}", key).fetchone()[0] > MAX_SUSPECTED:
            # the fold's rule: the second-oldest goes, the first and the latest stay
            conn.execute(f"DELETE FROM suspected_ooms WHERE {_RANK} AND (ts, step) = (SELECT ts, step FROM"
                         f" suspected_ooms WHERE {_RANK} ORDER BY ts, step LIMIT 1 OFFSET 1)", (*key, *key))
            conn.execute("INSERT INTO suspected_dropped (run, host, rank, dropped) VALUES (?, ?, ?, 1)"
                         " ON CONFLICT (run, host, rank) DO UPDATE SET dropped = dropped + 1", key)
        return 1

    def suspected_records(self, run: str) -> SuspectedRecords:
        """Every rank of ``run`` with a process stored and a suspected OOM: the records kept (by
        moment) and the count dropped past the bound, as :class:`vramwatch.runlife.RankLife` keeps
        them. Bounded whatever the file holds (a database is input too): at most MAX_SUSPECTED
        records a rank, the first and the latest, the rows past them counted as dropped (what the
        writer's rule keeps), and only ranks with a series in the run. Cost: one scan of the run's
        rows in SQLite (a window over each rank's), at most MAX_SUSPECTED per rank into Python."""
        conn = self._reader()
        have = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ('suspected_ooms', 'suspected_dropped')")}
        if "suspected_ooms" not in have:
            return {}  # a file no writer of this version opened: none kept (what a migration would create)
        kept: dict[tuple[str, int], list[SuspectedOom]] = {}
        dropped: dict[tuple[str, int], int] = {}
        for host, rank, ts, step, before, after, total, reason, n in conn.execute(_BOUNDED_READ, (run, run)):
            kept.setdefault((host, rank), []).append(SuspectedOom(step, ts, before, after, total, reason))
            dropped[(host, rank)] = max(0, n - MAX_SUSPECTED)
        if "suspected_dropped" in have:
            for host, rank, count in conn.execute(
                    f"SELECT host, rank, dropped FROM suspected_dropped WHERE run = ? AND {_HAS_SERIES}", (run, run)):
                dropped[(host, rank)] = dropped.get((host, rank), 0) + count
        return {key: (tuple(kept.get(key, ())), count) for key, count in dropped.items()}

    def _forget_suspected(self, keys: Iterable[tuple[str, str, int]]) -> None:
        """Delete the suspected OOMs of ranks with nothing left stored (retention: the live state
        forgets those ranks too). One transaction."""
        keys = list(keys)
        if keys:
            with self._writing(None, "delete from") as conn:
                for key in keys:
                    conn.execute(f"DELETE FROM suspected_ooms WHERE {_RANK}", key)
                    conn.execute(f"DELETE FROM suspected_dropped WHERE {_RANK}", key)
