"""Aggregate queries behind the dashboard views (``collector/views.py``): the heatmap's
per-bucket maxima and the chart's min/max envelope. Mixed into ``Store``.

Buckets are computed in SQLite (``GROUP BY`` over a primary-key range of one series), so a
100k-step rank is answered without moving 100k rows into Python. Train samples are
``phase = TRAIN_PHASE_ID``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from vramwatch.collector.store.schema import FIELD_COLUMNS, TRAIN_PHASE_ID
from vramwatch.runlife import IncarnationRecord, Moment

Row = tuple[Any, ...]


def _envelope_sql(fields: Sequence[str]) -> str:
    # row layout after the bucket: min step, max step, (min, max) per field, row count
    cols = [FIELD_COLUMNS[f] for f in fields]
    return ", ".join(["MIN(step)", "MAX(step)", *(f"MIN({c}), MAX({c})" for c in cols), "COUNT(*)"])


class Aggregates:
    """Bucketed reads; ``Store`` provides ``_reader``."""

    def _reader(self) -> sqlite3.Connection:  # pragma: no cover - provided by Store
        raise NotImplementedError

    # ------------------------------------------------------------ heatmap (all phases)
    def x_range(self, series_id: int, x: str) -> tuple[float, float] | None:
        """The ``x`` (step or ts) of a series' first and last step. Cost: O(log n), both ends
        through the primary key."""
        col = "step" if x == "step" else "ts"
        conn = self._reader()
        first = conn.execute(f"SELECT {col} FROM samples WHERE series = ? ORDER BY step LIMIT 1",
                             (series_id,)).fetchone()
        if first is None:
            return None
        last = conn.execute(f"SELECT {col} FROM samples WHERE series = ? ORDER BY step DESC LIMIT 1",
                            (series_id,)).fetchone()
        return float(first[0]), float(last[0])

    def bucket_maxima(self, series_id: int, width: float, x: str, after_step: int) -> list[Row]:
        """Per ``x // width`` bucket of the series' samples past ``after_step``: (bucket, max
        reserved, max NVML used, max peak, max total, max allocated, max step). A maximum is
        None when no sample of the bucket measured it. Cost: one range scan of the new rows."""
        col = "step" if x == "step" else "ts"
        return self._reader().execute(
            f"SELECT CAST({col} / ? AS INTEGER) AS b, MAX(reserved), MAX(nvml_used), MAX(peak), MAX(total),"
            " MAX(allocated), MAX(step) FROM samples WHERE series = ? AND step > ? GROUP BY b",
            (width, series_id, after_step),
        ).fetchall()

    # ------------------------------------------------------------ chart envelope (train samples)
    def train_step_range(self, series_ids: Sequence[int]) -> tuple[int, int] | None:
        """First and last train step over the series. Cost: O(log n) per series."""
        lo = hi = None
        conn = self._reader()
        for sid in series_ids:
            first = conn.execute("SELECT step FROM samples WHERE series = ? AND phase = ? ORDER BY step LIMIT 1",
                                 (sid, TRAIN_PHASE_ID)).fetchone()
            if first is None:
                continue
            last = conn.execute("SELECT step FROM samples WHERE series = ? AND phase = ? ORDER BY step DESC LIMIT 1",
                                (sid, TRAIN_PHASE_ID)).fetchone()
            lo = first[0] if lo is None else min(lo, first[0])
            hi = last[0] if hi is None else max(hi, last[0])
        return None if lo is None else (lo, hi)

    def train_envelope(self, series_id: int, width: int, after_step: int, fields: Sequence[str]) -> list[Row]:
        """Per ``step // width`` bucket of train samples past ``after_step``: (bucket, min step,
        max step, (min, max) of each field, count). Cost: one range scan of the new rows."""
        return self._reader().execute(
            f"SELECT step / ? AS b, {_envelope_sql(fields)} FROM samples WHERE series = ? AND phase = ?"
            " AND step > ? GROUP BY b", (width, series_id, TRAIN_PHASE_ID, after_step)).fetchall()

    def train_window_envelope(
        self, series_ids: Sequence[int], a: int, b: int, bucket: int, fields: Sequence[str]
    ) -> list[Row]:
        """As :meth:`train_envelope` over steps ``a..b`` in buckets of ``bucket`` steps from ``a``."""
        rows: list[Row] = []
        conn = self._reader()
        for sid in series_ids:
            rows += conn.execute(
                f"SELECT (step - ?) / ? AS b, {_envelope_sql(fields)} FROM samples WHERE series = ? AND phase = ?"
                " AND step BETWEEN ? AND ? GROUP BY b", (a, bucket, sid, TRAIN_PHASE_ID, a, b)).fetchall()
        return rows

    def train_rows(self, series_ids: Sequence[int], a: int, b: int, fields: Sequence[str]) -> list[Row]:
        """Raw train rows (step, *fields) with ``a <= step <= b``, ordered by step."""
        cols = ", ".join(FIELD_COLUMNS[f] for f in fields)
        rows: list[Row] = []
        conn = self._reader()
        for sid in series_ids:
            rows += conn.execute(
                f"SELECT step, {cols} FROM samples WHERE series = ? AND phase = ? AND step BETWEEN ? AND ?"
                " ORDER BY step", (sid, TRAIN_PHASE_ID, a, b)).fetchall()
        if len(series_ids) > 1:
            rows.sort(key=lambda r: r[0])
        return rows

    # ------------------------------------------------------------ a run's life, without a replay
    def life_records(self, run: str) -> tuple[list[tuple[str, int, IncarnationRecord]], float | None]:
        """Every process of ``run`` as the model's fold records it (one store series is one
        incarnation), and the run's newest sample time: what start-up needs to judge a finished
        run without replaying it. Equal to :class:`vramwatch.runlife.RankLife`'s records of the
        same samples (tests/test_runlife_readers.py). Cost: one C-level scan of the run's samples
        plus O(log n) look-ups per series (a partial scan for a series that hit an OOM)."""
        conn = self._reader()
        series = conn.execute("SELECT id, host, rank, incarnation FROM series WHERE run = ? ORDER BY id", (run,)
                              ).fetchall()
        if not series:
            return [], None
        ident = {sid: (host, rank, inc) for sid, host, rank, inc in series}
        sql = ("SELECT series, MIN(step), MAX(step), MAX(ts), MAX(ooms), COUNT(ooms), MAX(oom_marked), MAX(exited)"
               f" FROM samples WHERE series IN ({','.join('?' * len(ident))}) GROUP BY series")
        out: list[tuple[str, int, IncarnationRecord]] = []
        newest: float | None = None
        for sid, lo, hi, latest, max_ooms, counted, marked, exited in conn.execute(sql, tuple(ident)):
            newest = latest if newest is None else max(newest, latest)
            host, rank, incarnation = ident[sid]
            out.append((host, rank, self._record(conn, sid, incarnation, lo, hi, max_ooms, counted, marked, exited)))
        return out, newest

    @staticmethod
    def _record(conn: sqlite3.Connection, sid: int, incarnation: str, lo: int, hi: int, max_ooms: int | None,
                counted: int, marked: int | None, exited: int | None) -> IncarnationRecord:
        first = conn.execute("SELECT step, MIN(ts) FROM samples WHERE series = ? AND step = ?", (sid, lo)).fetchone()
        last = conn.execute("SELECT step, ts, exited, oom_marked FROM samples WHERE series = ? AND step = ?"
                            " ORDER BY ts DESC, seq DESC LIMIT 1", (sid, hi)).fetchone()
        ooms = max(max_ooms or 0, 1 if marked else 0)  # a marked OOM counts where no counter was sent

        def first_reaching(count: int) -> Moment | None:
            row = conn.execute("SELECT step, ts FROM samples WHERE series = ?"
                               " AND (ooms >= ? OR (oom_marked AND ? <= 1))"
                               " ORDER BY step, ts, seq LIMIT 1",
                               (sid, count, count)).fetchone()
            return None if row is None else Moment(row[0], row[1])

        return IncarnationRecord(
            incarnation, Moment(first[0], first[1]), Moment(last[0], last[1]), bool(last[2]), bool(last[3]), ooms,
            first_reaching(ooms) if ooms else None, first_reaching(1) if ooms else None,
            bool(counted or marked or exited))
