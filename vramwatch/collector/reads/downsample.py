"""Spike-preserving downsampling for chart series.

A memory chart that averages away a 2-second checkpoint spike lies about the only moment
that matters. So each bucket keeps the sample with the minimum *and* the one with the
maximum of every requested field: every bucket's extremes (and therefore the global
peak) survive, at their true x positions. A few lines of numpy; no native dependency.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def minmax_indices(columns: Sequence[Sequence[float | None]], max_points: int) -> np.ndarray:
    """Indices (sorted, unique) to keep so that at most ``max_points`` rows remain and each
    bucket's min and max of every column is among them. ``None`` values are ignored."""
    n = len(columns[0]) if columns else 0
    if n <= max_points or n == 0:
        return np.arange(n)
    per_bucket = 2 * max(1, len(columns))
    buckets = max(1, (max_points - 2) // per_bucket)  # 2: first and last point
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    starts = edges[:-1]
    keep = [np.array([0, n - 1])]
    for col in columns:
        values = np.array(col, dtype=np.float64)  # None -> nan
        nan = np.isnan(values)
        if nan.all():
            continue
        hi = np.where(nan, -np.inf, values)
        lo = np.where(nan, np.inf, values)
        # argmax per bucket via reduceat on values, then locate the index inside each bucket
        bucket_of = np.repeat(np.arange(buckets), np.diff(edges))
        max_per = np.maximum.reduceat(hi, starts)
        min_per = np.minimum.reduceat(lo, starts)
        is_max = hi == max_per[bucket_of]
        is_min = lo == min_per[bucket_of]
        # first index of each bucket that attains the extreme
        keep.append(_first_true_per_bucket(is_max, bucket_of, buckets))
        keep.append(_first_true_per_bucket(is_min, bucket_of, buckets))
    return np.unique(np.concatenate(keep))


def _first_true_per_bucket(mask: np.ndarray, bucket_of: np.ndarray, buckets: int) -> np.ndarray:
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return idx
    _, first = np.unique(bucket_of[idx], return_index=True)
    return idx[first]


def downsample(
    xs: Sequence[float], columns: dict[str, Sequence[float | None]], max_points: int
) -> tuple[list[float], dict[str, list[float | None]], bool]:
    """Downsample aligned columns; returns (x, columns, downsampled?)."""
    if len(xs) <= max_points:
        return list(xs), {k: list(v) for k, v in columns.items()}, False
    keep = minmax_indices(list(columns.values()), max_points)
    x_arr = list(xs)
    out_x = [x_arr[i] for i in keep]
    out = {k: [v[i] for i in keep] for k, v in columns.items()}
    return out_x, out, True
