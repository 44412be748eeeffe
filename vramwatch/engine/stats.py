"""Small robust estimators for short series (at most a few dozen points), in pure Python.

The engine feeds them block summaries, never raw samples, so n stays small and an O(n^2)
estimator costs tens of microseconds once per block, not per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def cv(values: Sequence[float], ddof: int = 0) -> float:
    """The coefficient of variation of ``values``: their standard deviation (over n - ``ddof``:
    0 for the values themselves, 1 for a sample's estimate) over their mean; 0 when the mean is not
    positive or there are no more values than ``ddof``."""
    n = len(values)
    mean = sum(values) / n
    if n <= ddof or mean <= 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof)) / mean


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Median of pairwise slopes: up to ~29 % of the points can be wild without moving it."""
    n = len(xs)
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(n - 1)
        for j in range(i + 1, n)
        if xs[j] != xs[i]
    ]
    return median(slopes) if slopes else 0.0


def mann_kendall_z(ys: Sequence[float]) -> float:
    """Mann-Kendall trend statistic with the Hamed-Rao (1998) autocorrelation correction.

    Positive z: an increasing trend. Autocorrelated noise makes the plain test far too
    eager (a wandering series looks monotone); Hamed-Rao inflates the variance of S by
    n/n*, estimated from the significant lag autocorrelations of the detrended ranks.
    """
    n = len(ys)
    if n < 4:
        return 0.0
    s = 0
    for i in range(n - 1):
        yi = ys[i]
        for j in range(i + 1, n):
            d = ys[j] - yi
            if d > 0:
                s += 1
            elif d < 0:
                s -= 1
    var = n * (n - 1) * (2 * n + 5) / 18.0
    var *= _hamed_rao_factor(ys)
    if s > 0:
        return (s - 1) / math.sqrt(var)
    if s < 0:
        return (s + 1) / math.sqrt(var)
    return 0.0


def _hamed_rao_factor(ys: Sequence[float]) -> float:
    n = len(ys)
    xs = range(n)
    slope = theil_sen(xs, ys)
    detrended = [y - slope * i for i, y in enumerate(ys)]
    order = sorted(range(n), key=detrended.__getitem__)
    ranks = [0.0] * n
    for rank, index in enumerate(order):
        ranks[index] = float(rank)
    mean = (n - 1) / 2.0
    centred = [r - mean for r in ranks]
    denom = sum(c * c for c in centred) or 1.0
    bound = 1.96 / math.sqrt(n)
    total = 0.0
    for lag in range(1, n - 2):
        rho = sum(centred[i] * centred[i + lag] for i in range(n - lag)) / denom
        if abs(rho) > bound:  # only significant lags, as in Hamed and Rao
            total += (n - lag) * (n - lag - 1) * (n - lag - 2) * rho
    factor = 1.0 + 2.0 * total / (n * (n - 1) * (n - 2))
    return max(factor, 1.0)  # negative autocorrelation never makes a trend more certain


def noise_sigma(ys: Sequence[float]) -> float:
    """Robust noise scale of a series from its first differences (MAD, trend-insensitive)."""
    if len(ys) < 3:
        return 0.0
    diffs = [b - a for a, b in pairwise(ys)]
    centre = median(diffs)  # a steady trend shifts every difference alike
    return 1.4826 * median([abs(d - centre) for d in diffs]) / math.sqrt(2.0)


def rolling_min(ys: Sequence[float], width: int) -> list[float]:
    """Trailing minimum over ``width`` points: the floor after each collection."""
    if width <= 1:
        return list(ys)
    return [min(ys[max(0, i - width + 1) : i + 1]) for i in range(len(ys))]
