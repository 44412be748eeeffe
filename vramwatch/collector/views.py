"""Dashboard-specific API: the ranks x steps heatmap.

``GET /api/v1/runs/{run}/heatmap?field=headroom|reserved|peak|allocated&x=step|ts&cols=240``
→ ``{"field", "x": [bucket centres], "bucket": width, "rows": [{"host", "rank"}],
"z": [[GiB or null, ...] per row], "unit": "GiB"}``.

One cell is the *worst* value of its bucket (lowest headroom, highest reserved): a
checkpoint spike on one rank must show even when a bucket spans thousands of steps.
Headroom is ``total - max(reserved, NVML used)``.

The heatmap is polled by every open run page and must stay cheap at 1024+ ranks, so the
per-bucket maxima are cached per (run, x axis) and grown incrementally: each refresh
only aggregates the samples newer than the last one seen (SQL ``GROUP BY`` over the
primary key range), and bucket widths are powers of two so that a growing run coarsens
its cached buckets by merging pairs instead of rescanning. Samples that arrive late
(behind the newest step of their series, e.g. a replayed spool) are picked up by a full
rebuild every ``REBUILD_S`` seconds.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request

router = APIRouter()

GIB = float(1 << 30)
HEATMAP_FIELDS = ("headroom", "reserved", "peak", "allocated")
X_MODES = ("step", "ts")
REBUILD_S = 300.0
# bucket aggregate slots: max reserved, max NVML used, max peak, max total, max allocated
_RES, _USED, _PEAK, _TOTAL, _ALLOC = range(5)


@dataclass
class _SeriesBuckets:
    host: str
    rank: int
    scanned: int = -1  # highest step already aggregated
    buckets: dict[int, list[float]] = field(default_factory=dict)


@dataclass
class _Entry:
    width: float
    built: float
    series: dict[int, _SeriesBuckets] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _merge(into: list[float], other: list[float]) -> None:
    for i in range(5):
        if other[i] > into[i]:
            into[i] = other[i]


class HeatmapCache:
    """Incrementally maintained per-bucket maxima for every series of a run."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self._local = threading.local()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, check_same_thread=False, timeout=10)
            self._local.conn = conn
        return conn

    def _x_range(self, conn: sqlite3.Connection, sid: int, xmode: str) -> tuple[float, float] | None:
        # Both ends through the (series, step, phase) primary key: O(log n) per series.
        col = "step" if xmode == "step" else "ts"
        first = conn.execute(f"SELECT {col} FROM samples WHERE series = ? ORDER BY step LIMIT 1", (sid,)).fetchone()
        if first is None:
            return None
        last = conn.execute(f"SELECT {col} FROM samples WHERE series = ? ORDER BY step DESC LIMIT 1", (sid,)).fetchone()
        return float(first[0]), float(last[0])

    @staticmethod
    def _width(span: float, cols: int, xmode: str) -> float:
        target = max(span, 1e-9) / max(cols, 1)
        width = 2.0 ** math.ceil(math.log2(target)) if target > 0 else 1.0
        # steps are integers: a bucket is at least one step; wall time: at least 1/16 s
        return max(width, 1.0 if xmode == "step" else 1.0 / 16)

    def _scan(self, conn: sqlite3.Connection, sb: _SeriesBuckets, sid: int, width: float, xmode: str) -> None:
        col = "step" if xmode == "step" else "ts"
        rows = conn.execute(
            f"SELECT CAST({col} / ? AS INTEGER) AS b, MAX(reserved), MAX(COALESCE(nvml_used, 0)), MAX(peak),"
            f" MAX(total), MAX(allocated), MAX(step) FROM samples WHERE series = ? AND step > ? GROUP BY b",
            (width, sid, sb.scanned),
        ).fetchall()
        for b, res, used, peak, total, alloc, max_step in rows:
            values = [float(res), float(used), float(peak), float(total), float(alloc)]
            have = sb.buckets.get(b)
            if have is None:
                sb.buckets[b] = values
            else:
                _merge(have, values)
            if max_step > sb.scanned:
                sb.scanned = max_step

    @staticmethod
    def _coarsen(entry: _Entry, width: float) -> None:
        factor = width / entry.width
        for sb in entry.series.values():
            merged: dict[int, list[float]] = {}
            for b, values in sb.buckets.items():
                nb = int(b // factor)
                have = merged.get(nb)
                if have is None:
                    merged[nb] = list(values)
                else:
                    _merge(have, values)
            sb.buckets = merged
        entry.width = width

    def heatmap(
        self, run: str, series: list[tuple[int, str, int]], *, field: str, xmode: str, cols: int
    ) -> dict[str, Any]:
        conn = self._conn()
        ranges = [r for r in (self._x_range(conn, sid, xmode) for sid, _, _ in series) if r is not None]
        if not ranges:
            return {"field": field, "x": [], "bucket": 1, "rows": [], "z": [], "unit": "GiB"}
        lo = min(r[0] for r in ranges)
        hi = max(r[1] for r in ranges)
        width = self._width(hi - lo, cols, xmode)
        key = (run, xmode)
        with self._lock:
            entry = self._entries.get(key)
            now = time.monotonic()
            if entry is None or entry.width > width or now - entry.built > REBUILD_S:
                entry = _Entry(width=width, built=now)
                self._entries[key] = entry
        with entry.lock:
            if width > entry.width:
                self._coarsen(entry, width)
            for sid, host, rank in series:
                sb = entry.series.get(sid)
                if sb is None:
                    sb = entry.series[sid] = _SeriesBuckets(host, rank)
                self._scan(conn, sb, sid, entry.width, xmode)
            return self._render(entry, field)

    @staticmethod
    def _render(entry: _Entry, field: str) -> dict[str, Any]:
        # one row per (host, rank): incarnations of a restarted rank merge into one row
        rows: dict[tuple[str, int], dict[int, list[float]]] = {}
        for sb in entry.series.values():
            merged = rows.setdefault((sb.host, sb.rank), {})
            for b, values in sb.buckets.items():
                have = merged.get(b)
                if have is None:
                    merged[b] = list(values)
                else:
                    _merge(have, values)
        all_buckets = [b for merged in rows.values() for b in merged]
        if not all_buckets:
            return {"field": field, "x": [], "bucket": entry.width, "rows": [], "z": [], "unit": "GiB"}
        b0, b1 = min(all_buckets), max(all_buckets)
        width = entry.width
        xs = [(b + 0.5) * width for b in range(b0, b1 + 1)]
        order = sorted(rows, key=lambda k: (k[1], k[0]))
        z: list[list[float | None]] = []
        for key in order:
            merged = rows[key]
            line: list[float | None] = []
            for b in range(b0, b1 + 1):
                v = merged.get(b)
                if v is None:
                    line.append(None)
                    continue
                if field == "headroom":
                    value = v[_TOTAL] - max(v[_RES], v[_USED])
                elif field == "reserved":
                    value = v[_RES]
                elif field == "peak":
                    value = v[_PEAK]
                else:
                    value = v[_ALLOC]
                line.append(round(value / GIB, 3))
            z.append(line)
        return {
            "field": field,
            "x": xs,
            "bucket": width,
            "rows": [{"host": host, "rank": rank} for host, rank in order],
            "z": z,
            "unit": "GiB",
        }


_caches: dict[str, HeatmapCache] = {}
_caches_lock = threading.Lock()


def heatmap_cache(db_path: str) -> HeatmapCache:
    """One cache per database file (shared by every request and by ``report``)."""
    with _caches_lock:
        cache = _caches.get(db_path)
        if cache is None:
            cache = _caches[db_path] = HeatmapCache(db_path)
        return cache


def run_heatmap(
    store: Any, run: str, *, field: str = "headroom", x: str = "step", cols: int = 240
) -> dict[str, Any] | None:
    """The heatmap document for ``run``; ``None`` when the run has no series."""
    rows = store.series(run)
    if not rows:
        return None
    series = [(r.id, r.host, r.rank) for r in rows]
    return heatmap_cache(store.path).heatmap(run, series, field=field, xmode=x, cols=cols)


@router.get("/api/v1/runs/{run}/heatmap")
def get_heatmap(
    request: Request,
    run: str,
    field: str = Query("headroom", description="headroom | reserved | peak | allocated"),
    x: str = Query("step", description="step | ts"),
    cols: int = Query(240, description="target number of buckets (16 to 1000)"),
) -> dict[str, Any]:
    if field not in HEATMAP_FIELDS:
        raise HTTPException(422, f"field: must be one of {', '.join(HEATMAP_FIELDS)}, got {field!r}")
    if x not in X_MODES:
        raise HTTPException(422, f"x: must be step or ts, got {x!r}")
    if not 16 <= cols <= 1000:
        raise HTTPException(422, f"cols: must be between 16 and 1000, got {cols}")
    doc = run_heatmap(request.app.state.store, run, field=field, x=x, cols=cols)
    if doc is None:
        raise HTTPException(404, f"run: no run named {run!r}")
    return doc


__all__ = ["HEATMAP_FIELDS", "HeatmapCache", "heatmap_cache", "router", "run_heatmap"]
