"""Dashboard-specific API: the ranks x steps heatmap and a fast chart series.

``GET /api/v1/runs/{run}/chart?rank=&host=&fields=&points=2000&start=&end=`` answers like
``/series`` with ``x=step`` (same document) but from a per-rank min/max envelope cache,
see :class:`EnvelopeCache`: a 100k-step rank is answered without reading 100k rows.

``GET /api/v1/runs/{run}/heatmap?field=headroom|reserved|peak|allocated&x=step|ts&cols=240``
→ ``{"field", "x": [bucket centres], "bucket": width, "rows": [{"host", "rank"}],
"z": [[GiB or null, ...] per row], "unit": "GiB"}``.

One cell is the *worst* value of its bucket (lowest headroom, highest reserved): a
checkpoint spike on one rank must show even when a bucket spans thousands of steps.
Headroom is :func:`vramwatch.verdicts.headroom_bytes` on the bucket's maxima.

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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Query, Request

from vramwatch.collector.reads.heavy import heavy
from vramwatch.collector.serving.params import Bound, Points, Rank, check_range, field_list, require_rank
from vramwatch.collector.store import FIELD_COLUMNS, Store
from vramwatch.verdicts import headroom_bytes

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
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _width(span: float, cols: int, xmode: str) -> float:
        target = max(span, 1e-9) / max(cols, 1)
        width = 2.0 ** math.ceil(math.log2(target)) if target > 0 else 1.0
        # steps are integers: a bucket is at least one step; wall time: at least 1/16 s
        return max(width, 1.0 if xmode == "step" else 1.0 / 16)

    def _scan(self, store: Store, sb: _SeriesBuckets, sid: int, width: float, xmode: str) -> None:
        for b, res, used, peak, total, alloc, max_step in store.bucket_maxima(sid, width, xmode, sb.scanned):
            # -inf: not measured in this bucket (a max over nothing)
            values = [_NONE if v is None else float(v) for v in (res, used, peak, total, alloc)]
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
        self, store: Store, run: str, series: list[tuple[int, str, int]], *, field: str, xmode: str, cols: int
    ) -> dict[str, Any]:
        ranges = [r for r in (store.x_range(sid, xmode) for sid, _, _ in series) if r is not None]
        if not ranges:
            return {"field": field, "x": [], "bucket": 1, "rows": [], "z": [], "unit": "GiB", "outside": 0}
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
                self._scan(store, sb, sid, entry.width, xmode)
            # scattered timestamps give every sample its own bucket: coarsen until the cache is bounded
            while entry.width < 2.0**62 and any(len(sb.buckets) > MAX_CACHED_BUCKETS for sb in entry.series.values()):
                self._coarsen(entry, entry.width * 2)
            return self._render(entry, field, cols)

    @staticmethod
    def _render(entry: _Entry, field: str, cols: int) -> dict[str, Any]:
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
        width = entry.width
        empty = {"field": field, "x": [], "bucket": entry.width, "rows": [], "z": [], "unit": "GiB", "outside": 0}
        if not any(rows.values()):
            return empty
        b0, b1, outside = _window(rows.values(), max_columns(cols))
        xs = [(b + 0.5) * width for b in range(b0, b1 + 1)]
        order = sorted(rows, key=lambda k: (k[1], k[0]))
        z = [[_cell(rows[key].get(b), field) for b in range(b0, b1 + 1)] for key in order]
        return {
            **empty,
            "x": xs,
            "bucket": int(width) if float(width).is_integer() else width,
            "rows": [{"host": host, "rank": rank} for host, rank in order],
            "z": z,
            "outside": outside,
        }


_NONE = -math.inf  # an aggregate slot with nothing measured
#: buckets cached per series at most (memory: ~200 bytes each), whatever the timestamps
MAX_CACHED_BUCKETS = 16_384


def max_columns(cols: int) -> int:
    """The most columns a heatmap asked for ``cols`` may have: bucket widths are powers of two
    (up to 2x the target), and whatever the timestamps, never more than this."""
    return 2 * cols


def _window(rows: Any, limit: int) -> tuple[int, int, int]:
    """The range of at most ``limit`` bucket indices holding the most cells, and how many
    cells fall outside it. Samples far from the rest (a clock stepped by days) would
    otherwise stretch the axis into millions of empty columns. Cost: O(cells log cells)."""
    weight: dict[int, int] = {}
    for merged in rows:
        for b in merged:
            weight[b] = weight.get(b, 0) + 1
    keys = sorted(weight)
    if keys[-1] - keys[0] < limit:
        return keys[0], keys[-1], 0
    best, best_lo, lo, inside = -1, 0, 0, 0
    for key in keys:  # two pointers over the occupied buckets
        inside += weight[key]
        while key - keys[lo] >= limit:
            inside -= weight[keys[lo]]
            lo += 1
        if inside > best:
            best, best_lo = inside, lo
    start = keys[best_lo]
    end = max(k for k in keys[best_lo:] if k - start < limit)
    return start, end, sum(weight.values()) - best


def _cell(v: list[float] | None, field: str) -> float | None:
    if v is None:
        return None
    def get(i: int) -> int | None:
        return None if v[i] == _NONE else int(v[i])
    if field == "headroom":
        # the one headroom formula, on the bucket's maxima (the worst moment of the bucket)
        value = headroom_bytes(get(_TOTAL), allocated=get(_ALLOC), reserved=get(_RES), nvml_used=get(_USED))
    else:
        value = get({"reserved": _RES, "peak": _PEAK, "allocated": _ALLOC}[field])
    return None if value is None else round(value / GIB, 3)


_caches: dict[str, HeatmapCache] = {}
_caches_lock = threading.Lock()


def _cache_for(registry: dict[str, Any], factory: Callable[[str], Any], db_path: str) -> Any:
    """One cache per database file, shared by every request and by ``report``."""
    with _caches_lock:
        cache = registry.get(db_path)
        if cache is None:
            cache = registry[db_path] = factory(db_path)
        return cache


def heatmap_cache(db_path: str) -> HeatmapCache:
    return _cache_for(_caches, HeatmapCache, db_path)


def run_heatmap(
    store: Store, run: str, *, field: str = "headroom", x: str = "step", cols: int = 240
) -> dict[str, Any] | None:
    """The heatmap document for ``run``; ``None`` when the run has no series."""
    rows = store.series(run)
    if not rows:
        return None
    series = [(r.id, r.host, r.rank) for r in rows]
    return heatmap_cache(store.path).heatmap(store, run, series, field=field, xmode=x, cols=cols)


@router.get("/api/v1/runs/{run:path}/heatmap")
async def get_heatmap(
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
    doc = await heavy(request.app.state).run(
        "heatmap", lambda: run_heatmap(request.app.state.store, run, field=field, x=x, cols=cols))
    if doc is None:
        raise HTTPException(404, f"run: no run named {run!r}")
    return doc





# ====================================================================== chart envelope

#: Wire fields the chart endpoint serves, and their store columns (every numeric field but the
#: markers and counters no chart draws).
_NOT_CHARTED = ("seq", "oom_marked", "exit", "ooms", "tokens", "step_time_s")
CHART_FIELDS: dict[str, str] = {name: col for name, col in FIELD_COLUMNS.items() if name not in _NOT_CHARTED}
_CHART_NAMES = tuple(CHART_FIELDS)
_NCOL = len(_CHART_NAMES)
# aggregate row layout: min step, max step, then (min, max) per column, then row count
_WIDTH = 2 + 2 * _NCOL + 1
_MIN_IDX = np.array([0, *range(2, 2 + 2 * _NCOL, 2)])
_MAX_IDX = np.array([1, *range(3, 3 + 2 * _NCOL, 2)])
_COUNT = _WIDTH - 1
#: buckets kept per rank; requests for up to twice this many points are served from it
CACHE_BUCKETS = 4096
CACHED_RANKS = 64  # ~0.75 MB each at CACHE_BUCKETS


def _combine(keys: np.ndarray, agg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge rows with equal bucket keys: min of the min columns, max of the max columns,
    sum of counts (NaN = no value, ignored)."""
    if keys.size == 0:
        return keys, agg
    order = np.argsort(keys, kind="stable")
    keys, agg = keys[order], agg[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    if starts.size == keys.size:
        return keys, agg
    out = np.empty((starts.size, _WIDTH))
    with np.errstate(invalid="ignore"):
        out[:, _MIN_IDX] = np.fmin.reduceat(agg[:, _MIN_IDX], starts, axis=0)
        out[:, _MAX_IDX] = np.fmax.reduceat(agg[:, _MAX_IDX], starts, axis=0)
    out[:, _COUNT] = np.add.reduceat(agg[:, _COUNT], starts)
    return keys[starts], out


def _rows_to_array(rows: list[tuple[Any, ...]]) -> tuple[np.ndarray, np.ndarray]:
    if not rows:
        return np.empty(0, dtype=np.int64), np.empty((0, _WIDTH))
    keys = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    agg = np.array([r[1:] for r in rows], dtype=np.float64)  # None -> nan
    return keys, agg


@dataclass
class _RankEnvelope:
    width: int
    built: float
    keys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    agg: np.ndarray = field(default_factory=lambda: np.empty((0, _WIDTH)))
    scanned: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class EnvelopeCache:
    """Per-rank min/max buckets of the train samples, grown incrementally.

    Every bucket holds the minimum and maximum of each chart column (and the first and
    last step), so any coarser downsampling keeps every bucket's extremes: the biggest
    spike of the raw data is always in the answer. Bucket widths are powers of two steps
    (at most ``CACHE_BUCKETS`` buckets per rank); a growing run merges pairs instead of
    rescanning. A refresh aggregates only rows past the last step seen (``GROUP BY`` in
    SQLite over the primary-key range). Late rows behind that step are picked up by a
    rebuild every ``REBUILD_S`` seconds. Zoom windows finer than the cache are answered
    from SQLite directly (raw rows when they fit, else a ``GROUP BY`` over the window).
    """

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self._lock = threading.Lock()
        self._ranks: OrderedDict[tuple[str, str | None, int], _RankEnvelope] = OrderedDict()

    def _envelope(
        self, store: Store, key: tuple[str, str | None, int], ids: list[int], lo: int, hi: int
    ) -> _RankEnvelope:
        width = max(1, 2 ** math.ceil(math.log2(max(1, (hi - lo + 1) / CACHE_BUCKETS))))
        now = time.monotonic()
        with self._lock:
            env = self._ranks.get(key)
            if env is None or env.width > width or now - env.built > REBUILD_S:
                env = _RankEnvelope(width=width, built=now)
                self._ranks[key] = env
            self._ranks.move_to_end(key)
            while len(self._ranks) > CACHED_RANKS:
                self._ranks.popitem(last=False)
        with env.lock:
            if width > env.width:
                env.keys, env.agg = _combine(env.keys // (width // env.width), env.agg)
                env.width = width
            fresh_keys, fresh = [env.keys], [env.agg]
            for sid in ids:
                seen = env.scanned.get(sid, -1)
                rows = store.train_envelope(sid, env.width, seen, _CHART_NAMES)
                if rows:
                    keys, agg = _rows_to_array(rows)
                    fresh_keys.append(keys)
                    fresh.append(agg)
                    env.scanned[sid] = int(np.nanmax(agg[:, 1]))
            if len(fresh) > 1:
                env.keys, env.agg = _combine(np.concatenate(fresh_keys), np.vstack(fresh))
            return env

    def chart(
        self, store: Store, key: tuple[str, str | None, int], ids: list[int], fields: list[str], points: int,
        start: float | None, end: float | None,
    ) -> dict[str, Any]:
        span = store.train_step_range(ids)
        out: dict[str, Any] = {"run": key[0], "host": key[1], "rank": key[2], "x_axis": "step"}
        if span is None:
            return {**out, "x": [], "series": {f: [] for f in fields}, "raw_points": 0, "downsampled": False}
        a = span[0] if start is None else max(span[0], math.ceil(start))
        b = span[1] if end is None else min(span[1], math.floor(end))
        if b < a:
            return {**out, "x": [], "series": {f: [] for f in fields}, "raw_points": 0, "downsampled": False}
        groups = max(1, points // 2)  # two points (min and max) per group
        bucket = -(-(b - a + 1) // groups)  # ceil: at most `groups` buckets
        env = self._envelope(store, key, ids, *span)
        with env.lock:
            keys, agg, width = env.keys, env.agg, env.width
        starts = keys * width
        inner = (starts >= a) & (starts + width - 1 <= b)
        partial = ((starts + width - 1 >= a) & (starts <= b)) & ~inner
        estimate = int(agg[inner | partial, _COUNT].sum())
        if estimate <= points or b - a + 1 <= points:
            # the estimate counts whole edge buckets, so it is never below the true count
            rows = store.train_rows(ids, a, b, fields)
            if len(rows) <= points:
                return {**out, **self._raw_doc(rows, fields)}
        if width > bucket or not inner.any():
            # zoomed in finer than the cache holds: aggregate the window in SQLite
            _, window = self._window_agg(store, ids, a, b, bucket)
            return {**out, **self._envelope_doc(window, fields)}
        # whole cached buckets inside [a, b], plus exact aggregates of the partial edges
        parts = [agg[inner]]
        first, last = int(starts[inner].min()), int(starts[inner].max()) + width - 1
        if first > a:
            parts.append(self._window_agg(store, ids, a, first - 1, first - a)[1])
        if last < b:
            parts.append(self._window_agg(store, ids, last + 1, b, b - last)[1])
        merged = np.vstack(parts)
        group_of = ((merged[:, 0] - a) * groups // (b - a + 1)).astype(np.int64)
        _, merged = _combine(group_of, merged)
        return {**out, **self._envelope_doc(merged, fields)}

    @staticmethod
    def _window_agg(store: Store, ids: list[int], a: int, b: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        return _combine(*_rows_to_array(store.train_window_envelope(ids, a, b, bucket, _CHART_NAMES)))

    @staticmethod
    def _raw_doc(rows: list[tuple[Any, ...]], fields: list[str]) -> dict[str, Any]:
        return {
            "x": [r[0] for r in rows],
            "series": {f: [r[i + 1] for r in rows] for i, f in enumerate(fields)},
            "raw_points": len(rows),
            "downsampled": False,
        }

    @staticmethod
    def _envelope_doc(agg: np.ndarray, fields: list[str]) -> dict[str, Any]:
        # Two points per bucket: every column's minimum at the bucket's first step and its
        # maximum at the last step (one point when the bucket holds a single row).
        two = agg[:, 0] != agg[:, 1]
        n = agg.shape[0]
        take_max = np.zeros(n + int(two.sum()), dtype=bool)
        row_of = np.repeat(np.arange(n), np.where(two, 2, 1))
        first = np.r_[True, row_of[1:] != row_of[:-1]]
        take_max[~first] = True
        take_max[first & ~two[row_of]] = False
        x = np.where(take_max, agg[row_of, 1], agg[row_of, 0]).astype(np.int64).tolist()
        series: dict[str, list[Any]] = {}
        for f in fields:
            j = _CHART_NAMES.index(f)
            values = np.where(take_max, agg[row_of, 3 + 2 * j], agg[row_of, 2 + 2 * j])
            if f == "ts":
                series[f] = [None if v != v else v for v in values.tolist()]
            else:
                series[f] = [None if v != v else int(v) for v in values.tolist()]
        return {"x": x, "series": series, "raw_points": int(agg[:, _COUNT].sum()), "downsampled": True}


_envelopes: dict[str, EnvelopeCache] = {}


def envelope_cache(db_path: str) -> EnvelopeCache:
    return _cache_for(_envelopes, EnvelopeCache, db_path)


def run_chart(
    store: Store, run: str, rank: int, *, host: str | None = None, fields: list[str], points: int = 2000,
    start: float | None = None, end: float | None = None,
) -> dict[str, Any] | None:
    """Chart series of one rank (train samples, x = step); ``None`` when the run is unknown."""
    rows = store.series(run)
    if not rows:
        return None
    ids = [r.id for r in rows if r.rank == rank and (host is None or r.host == host)]
    return envelope_cache(store.path).chart(store, (run, host, rank), ids, fields, points, start, end)


@router.get("/api/v1/runs/{run:path}/chart")
def get_chart(
    request: Request,
    run: str,
    rank: Rank,
    host: str | None = None,
    fields: str = "allocated_bytes,reserved_bytes,peak_allocated_bytes,nvml_used_bytes,total_bytes",
    points: Points = 2000,
    start: Bound = None,
    end: Bound = None,
) -> dict[str, Any]:
    names = field_list(fields, CHART_FIELDS, CHART_FIELDS)
    check_range(start, end)
    store = request.app.state.store
    known = store.series(run)
    if not known:
        raise HTTPException(404, f"run: no run named {run!r}")
    require_rank(((r.host, r.rank) for r in known), run, rank, host)
    return run_chart(store, run, rank, host=host, fields=names, points=points, start=start, end=end) or {}


__all__ = [
    "CHART_FIELDS", "HEATMAP_FIELDS", "EnvelopeCache", "HeatmapCache", "envelope_cache", "heatmap_cache", "router",
    "run_chart", "run_heatmap",
]
