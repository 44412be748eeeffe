"""The store's read side: every query the API, the dashboard views, export and replay make.

Methods of :class:`vramwatch.collector.store.Store` (a mixin, so ``store.series(run)``
keeps working). Each runs on the calling thread's own read-only connection: WAL readers
never block the writer. Costs are stated per method; "per series" means one primary-key
range scan of the ``samples`` table, which is clustered on ``(series, step, phase, seq)``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from vramwatch.collector.reads.downsample import minmax_indices
from vramwatch.collector.store.columns import NULL_SENTINEL, ColumnCache, as_lists, rows_to_block, window
from vramwatch.collector.store.schema import (
    FIELD_COLUMNS,
    FLAG_NAMES,
    SERIES_OPTIONAL,
    TRAIN_PHASE_ID,
    VALUE_NAMES,
)
from vramwatch.wire import FIELD_BY_NAME, FULL_MEASUREMENTS, TRAIN_PHASE, Sample, fields_of

_FLAGS = tuple(sorted(FLAG_NAMES))
#: the fields of a phase marker (``/phases``): the table's ``phase_marker`` fields (a phase's own
#: peak, its levels and its host peaks)
_PHASE_FIELDS = fields_of(phase_marker=True)


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
    #: value fields any of its samples carried, comma-separated (None: unknown, read them all)
    fields: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        """``wire.series_key`` of this series (incarnations of one rank share it)."""
        return (self.run, self.host, self.rank)


@dataclass(frozen=True)
class SeriesWindow:
    """One rank's columns over an x range, downsampled (the ``/series`` document's data)."""

    x: list[Any]
    series: dict[str, list[Any]]
    raw_points: int
    downsampled: bool


def _in(ids: Sequence[int]) -> str:
    """``series IN`` the ids, passed as ONE parameter (:func:`in_param`, a JSON array read by
    SQLite's ``json_each``): a statement's variable count never grows with the data (past
    32,766 variables SQLite refuses the statement)."""
    return "series IN (SELECT value FROM json_each(?))"


def in_param(ids: Sequence[int]) -> str:
    """The one parameter :func:`_in` reads."""
    return json.dumps(list(ids))


class Reads:
    """Read queries; mixed into ``Store`` (which provides ``_reader``, ``path`` and the phase caches)."""

    path: str
    _phase_ids: dict[str, int]
    _phase_names: dict[int, str]
    _columns: ColumnCache

    def _reader(self) -> sqlite3.Connection:  # pragma: no cover - provided by Store
        raise NotImplementedError

    # ------------------------------------------------------------ series and runs
    def _check_run(self, run: str | None) -> None:
        """The run's samples (all samples for None) checked once per store against the field
        table (:mod:`~vramwatch.collector.store.contents`); StoreError naming a bad column."""
        checked: set[str | None] = self.__dict__.setdefault("_checked_runs", set())
        if not getattr(self, "check_contents", False) or run in checked or None in checked:
            return
        from vramwatch.collector.store import contents

        contents.check(self._reader(), self.path, ("samples",), run)
        checked.add(run)

    def series(self, run: str | None = None) -> list[SeriesRow]:
        """Every series (of ``run``), in creation order, its samples checked on the first read
        (:meth:`_check_run`). Cost: one index range scan."""
        self._check_run(run)
        conn = self._reader()
        sql = ("SELECT id, run, host, rank, incarnation, local_rank, world_size, uuid, gpu, pid, allocator, fields"
               " FROM series")
        rows = conn.execute(sql + " WHERE run = ? ORDER BY id", (run,)) if run else conn.execute(sql + " ORDER BY id")
        return [SeriesRow(*row) for row in rows]

    def runs(self) -> list[str]:
        return [r[0] for r in self._reader().execute("SELECT DISTINCT run FROM series ORDER BY run")]

    def count(self, run: str | None = None) -> int:
        """Stored samples (of ``run``). Cost: a scan of the samples' primary key."""
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

    def phase_id(self, name: str) -> int | None:
        """The id of phase ``name``, None when no sample ever had it."""
        pid = self._phase_ids.get(name)
        if pid is None:
            row = self._reader().execute("SELECT id FROM phases WHERE name = ?", (name,)).fetchone()
            pid = None if row is None else row[0]
        return pid

    def series_ids(self, run: str, host: str | None = None, rank: int | None = None) -> list[int]:
        """Ids of the series of ``run`` (one rank's incarnations when ``rank`` is given)."""
        self._check_run(run)
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

    # ------------------------------------------------------------ whole samples
    def _to_sample(self, ident: dict[str, Any], names: tuple[str, ...], row: tuple[Any, ...]) -> Sample:
        # C-level dict building, Python work only for what is there (the replay after a
        # restart reads every stored sample through here)
        s: dict[str, Any] = ident.copy()
        s.update(zip(names, row, strict=True))
        if None in row:
            for key in [k for k, v in s.items() if v is None]:
                del s[key]  # not measured: absent
        s["phase"] = self._phase_names.get(row[1]) or self.phase_name(row[1])
        if not row[2]:
            del s["seq"]
        if "extra" in s:
            s["extra"] = orjson.loads(s["extra"])
        for name in _FLAGS:
            if name in s:
                s[name] = bool(s[name])
        schema = s.get("schema") or (1 if all(name in s for name in FULL_MEASUREMENTS) else 2)
        s["schema"] = schema  # rows migrated from the first store version have none: schema 1
        if schema == 1 and "nvml_used_bytes" not in s:
            s["nvml_used_bytes"] = None  # schema 1 writes null for "no NVML"
        return s  # type: ignore[return-value]

    def iter_samples(
        self, run: str | None = None, *, host: str | None = None, rank: int | None = None, batch: int = 5000
    ) -> Iterator[Sample]:
        """Samples as wire dicts, series by series in insertion order, each by (step, phase, seq).

        What was ingested comes back with the same values (identity fields from ``series``);
        a sample with every schema-1 measurement comes back as schema 1, any other as schema 2
        with the fields that were not measured left out. Memory: ``batch`` rows at a time.
        """
        conn = self._reader()
        for srow in self.series(run):
            if (host is not None and srow.host != host) or (rank is not None and srow.rank != rank):
                continue
            ident: dict[str, Any] = {"schema": None, "run": srow.run, "host": srow.host, "rank": srow.rank}
            for name in SERIES_OPTIONAL:
                if getattr(srow, name) is not None:
                    ident[name] = getattr(srow, name)
            if srow.incarnation:
                ident["incarnation"] = srow.incarnation
            # only the columns this series ever filled: each value fetched costs, most are NULL
            used = None if srow.fields is None else set(srow.fields.split(","))
            names = tuple(n for n in VALUE_NAMES if used is None or n in used)
            cols = ", ".join(["step", "phase", "seq", *(FIELD_BY_NAME[n].column for n in names)])
            cur = conn.execute(f"SELECT {cols} FROM samples WHERE series = ? ORDER BY step, phase, seq", (srow.id,))
            names = ("step", "phase", "seq", *names)
            while chunk := cur.fetchmany(batch):
                for row in chunk:
                    yield self._to_sample(ident, names, row)

    def iter_replay(self, batch: int = 10000) -> Iterator[Sample]:
        """Every sample, for rebuilding live state after a restart: per series, by step."""
        yield from self.iter_samples(batch=batch)

    def phase_samples(self, run: str, host: str | None = None, rank: int | None = None) -> list[Sample]:
        """Every non-train sample (checkpoint, eval, ...) of a run, by time, for bands and markers.
        Fields not measured are null."""
        ids = self.series_ids(run, host, rank)
        if not ids:
            return []
        by_id = {r.id: r for r in self.series(run)}
        cols = ", ".join(FIELD_COLUMNS[f] for f in _PHASE_FIELDS)
        cur = self._reader().execute(
            f"SELECT series, step, phase, seq, {cols} FROM samples WHERE {_in(ids)} AND phase != ? ORDER BY ts",
            [in_param(ids), TRAIN_PHASE_ID],
        )
        out = []
        for sid, step, phase, seq, *values in cur:
            srow = by_id[sid]
            doc: dict[str, Any] = {"run": srow.run, "host": srow.host, "rank": srow.rank, "step": step,
                                   "phase": self.phase_name(phase), **dict(zip(_PHASE_FIELDS, values, strict=True))}
            if seq:
                doc["seq"] = seq
            out.append(doc)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------ columns for charts
    def _column_query(
        self, run: str, host: str | None, rank: int | None, fields: list[str], phase: str | None, x: str,
        start: float | None, end: float | None,
    ) -> tuple[str, list[Any]] | None:
        ids = self.series_ids(run, host, rank)
        if not ids:
            return None
        xcol = "step" if x == "step" else "ts"
        clauses, params = [_in(ids)], [in_param(ids)]
        if phase is not None:
            pid = self.phase_id(phase)
            if pid is None:
                return None
            clauses.append("phase = ?")
            params.append(pid)
        if start is not None:
            clauses.append(f"{xcol} >= ?")
            params.append(start)
        if end is not None:
            clauses.append(f"{xcol} <= ?")
            params.append(end)
        select = ", ".join([xcol, *(FIELD_COLUMNS[f] for f in fields)])
        order = f" ORDER BY {xcol}" if len(ids) > 1 or xcol == "ts" else ""
        return f"SELECT {select} FROM samples WHERE {' AND '.join(clauses)}{order}", params

    def query_columns(
        self, run: str, host: str | None, rank: int | None, fields: Iterable[str], *,
        phase: str | None = TRAIN_PHASE, x: str = "step", start: float | None = None, end: float | None = None,
    ) -> tuple[list[float], dict[str, list[Any]]]:
        """Columns for charts: x values and one list per wire field, ordered by x (None = not
        measured). Several incarnations of one rank are merged by x (a restarted rank continues).
        Cost: one range scan per series; reads only the requested columns."""
        fields = list(fields)
        query = self._column_query(run, host, rank, fields, phase, x, start, end)
        if query is None:
            return [], {f: [] for f in fields}
        data = self._reader().execute(*query).fetchall()
        return [r[0] for r in data], {f: [r[i + 1] for r in data] for i, f in enumerate(fields)}

    def series_window(
        self, run: str, host: str | None, rank: int, fields: Sequence[str], *, phase: str | None = TRAIN_PHASE,
        x: str = "step", start: float | None = None, end: float | None = None, points: int = 2000,
    ) -> SeriesWindow:
        """``/series``: the rank's ``fields`` by ``x`` within [start, end], at most ``points`` rows
        chosen so every bucket's min and max of every field survive at their true x (as
        :func:`~vramwatch.collector.reads.downsample.downsample` on :meth:`query_columns`, same answer).

        Cost: served from numpy columns cached per rank (:mod:`.columns`); a repeated request
        reads only the rows stored since, so a 100k-step rank costs a binary search and a
        vectorised min/max pass instead of 100k Python rows. The first request pays the full read.
        """
        fields = list(fields)
        ids = self.series_ids(run, host, rank)
        pid = None if phase is None else self.phase_id(phase)
        if not ids or (phase is not None and pid is None):
            return SeriesWindow([], {f: [] for f in fields}, 0, False)
        xcol = "step" if x == "step" else "ts"
        # every value as REAL: sqlite3 then makes a float (from a free list) where it made an int
        # object (a 100 GiB count is a two-digit int), and fromiter copies it as is: the cold read
        # of a 100k-step rank costs ~25 % less. Exact: every stored number is at most 2**53.
        values = (f"IFNULL(CAST({FIELD_COLUMNS[f]} AS REAL), {NULL_SENTINEL})" for f in fields)
        cols = ", ".join(["CAST(step AS REAL)", *(() if xcol == "step" else (xcol,)), *values])
        where = "series = ? AND step > ?" + ("" if pid is None else " AND phase = ?")
        sql = f"SELECT {cols} FROM samples WHERE {where} ORDER BY step"
        conn = self._reader()

        def fetch(sid: int, after: int) -> np.ndarray:
            cursor = conn.execute(sql, (sid, after) if pid is None else (sid, after, pid))
            return rows_to_block(cursor, len(fields) + 2, step_is_x=xcol == "step")

        xs, values = self._columns.columns((tuple(ids), -1 if pid is None else pid, xcol, tuple(fields)), fetch)
        xs, values = window(xs, values, start, end)
        raw = int(xs.size)
        if raw > points:
            keep = minmax_indices([values[:, j] for j in range(values.shape[1])], points)
            xs, values = xs[keep], values[keep]
        ints = frozenset(f for f in fields if FIELD_BY_NAME[f].kind in ("i", "b"))
        out_x, out = as_lists(xs, values, fields, int_fields=ints, int_x=xcol == "step")
        for f in fields:
            if FIELD_BY_NAME[f].kind == "flag":
                out[f] = [None if v is None else bool(v) for v in out[f]]
        return SeriesWindow(out_x, out, raw, raw > points)

    def file_bytes(self) -> int:
        """Bytes on disk: the database, its WAL and shared-memory index."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            p = Path(self.path + suffix)
            if p.exists():
                total += p.stat().st_size
        return total
