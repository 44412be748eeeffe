"""Aggregate queries behind the dashboard views (``collector/reads/charts.py``): the heatmap's
per-bucket maxima and the chart's min/max envelope. Mixed into ``Store``.

Buckets are computed in SQLite (``GROUP BY`` over a primary-key range of one series), so a
100k-step rank is answered without moving 100k rows into Python. Train samples are
``phase = TRAIN_PHASE_ID``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from vramwatch.causes import LastWords, last_words_of
from vramwatch.collector.store.schema import FIELD_COLUMNS, TRAIN_PHASE_ID
from vramwatch.runlife import IncarnationRecord, Moment
from vramwatch.wire import FIELD_BY_NAME

Row = tuple[Any, ...]
#: the latest sample's columns a process's record needs besides its end markers
_LAST_WORDS_COLUMNS = ", ".join(FIELD_BY_NAME[f].column for f in (
    "last_words_type", "last_words_message", "last_words_phase", "host_available_bytes", "host_rss_bytes"))


def _envelope_sql(fields: Sequence[str]) -> str:
    # row layout after the bucket: min step, max step, (min, max) per field, row count
    cols = [FIELD_COLUMNS[f] for f in fields]
    return ", ".join(["MIN(step)", "MAX(step)", *(f"MIN({c}), MAX({c})" for c in cols), "COUNT(*)"])


class Aggregates:
    """Bucketed reads; ``Store`` provides ``_reader``."""

    _phase_names: dict[int, str]  # provided by Store

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
        same samples (tests/runlife/test_runlife_readers.py). Cost: three C-level scans of the run's
        samples (SQLite takes a bare column from the row holding a lone MIN/MAX), plus a partial
        scan of each series that hit an OOM."""
        conn = self._reader()
        series = conn.execute("SELECT id, host, rank, incarnation FROM series WHERE run = ? ORDER BY id", (run,)
                              ).fetchall()
        if not series:
            return [], None
        ident = {sid: (host, rank, inc) for sid, host, rank, inc in series}
        where = "FROM samples WHERE series IN (SELECT id FROM series WHERE run = ?) GROUP BY series"
        ids = (run,)  # one variable, however many incarnations the run has
        first = {r[0]: r[1:] for r in conn.execute(f"SELECT series, MIN(ts), step {where}", ids)}
        last = {r[0]: r[1:] for r in conn.execute(
            f"SELECT series, MAX(ts), step, exited, oom_marked, phase_open, phase, {_LAST_WORDS_COLUMNS} {where}",
            ids)}
        timed = where.replace("GROUP BY", "AND step_time IS NOT NULL AND phase {} ? GROUP BY")
        step_s = {r[0]: r[2] for r in conn.execute(f"SELECT series, MAX(ts), step_time {timed.format('=')}",
                                                      (*ids, TRAIN_PHASE_ID))}
        phase_s = dict(conn.execute(f"SELECT series, MAX(step_time) {timed.format('!=')}", (*ids, TRAIN_PHASE_ID)))
        counts = conn.execute(f"SELECT series, MAX(ooms), COUNT(ooms), MAX(oom_marked), MAX(exited) {where}", ids)
        out: list[tuple[str, int, IncarnationRecord]] = []
        for sid, max_ooms, counted, marked, exited in counts:
            host, rank, incarnation = ident[sid]
            (first_ts, first_step), (last_ts, last_step, last_exit, last_oom, in_phase, *said) = first[sid], last[sid]
            ooms = max(max_ooms or 0, 1 if marked else 0)  # a marked OOM counts where no counter was sent
            out.append((host, rank, IncarnationRecord(
                incarnation, Moment(first_step, first_ts), Moment(last_step, last_ts), bool(last_exit),
                bool(last_oom), ooms, self._first_reaching(conn, sid, ooms) if ooms else None,
                self._first_reaching(conn, sid, 1) if ooms else None, bool(counted or marked or exited or said[1]),
                step_s.get(sid), phase_s.get(sid), *self._last_words(said), bool(in_phase))))
        return out, max((r[0] for r in last.values()), default=None)

    def _last_words(self, said: list[Any]) -> tuple[LastWords | None, int | None, int | None]:
        """The latest sample's last words and host memory, from its phase id and the columns of
        :data:`_LAST_WORDS_COLUMNS`."""
        phase_id, kind, message, phase, available, rss = said
        sample = {"phase": self._phase_names.get(phase_id, "train"), "last_words_type": kind,
                  "last_words_message": message, "last_words_phase": phase}
        return last_words_of(sample), available, rss

    @staticmethod
    def _first_reaching(conn: sqlite3.Connection, sid: int, count: int) -> Moment | None:
        """The first sample (by time) whose OOM count reached ``count`` (a marked one counts 1)."""
        row = conn.execute("SELECT step, ts FROM samples WHERE series = ? AND (ooms >= ? OR (oom_marked AND ? <= 1))"
                           " ORDER BY ts, step, seq LIMIT 1", (sid, count, count)).fetchone()
        return None if row is None else Moment(row[0], row[1])
