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
