"""The staircase test: a ratcheting level that rises in every part of a window, about alike.

Device used (and reserved) grow in a caching allocator's ratchets: a leak reaches them as
segment allocations, a staircase of plateau breaks, each settling on a higher plateau, at a
cadence set by segment size / leak rate. Theil-Sen is blind to it (on a staircase of rare steps
most pairwise slopes are zero, so the slope of a part holding one step is zero or not, by where
the step falls), and a steady leak's no-jump rule rejects it (every step is a jump).

What tells a leak's staircase from the one-time ratchets of a healthy run is its *cadence*: it
keeps rising at about the same rate. The window's points (<= ``fit_points`` block minima) are cut
into ``parts`` (4) equal parts and each part is summarised by its median (robust to a stray block
and to the reading jitter; of an even count the lower middle value, so one step moves one part's
level only). One step raises one part, two steps two: a staircase needs at least three, and
the test requires

1. **every part higher than the one before**, each rise significant against the measured noise:
   more than ``stair_z`` standard errors of a difference of two part medians, the noise being the
   MAD of the points' first differences (a step is an outlier there, the jitter is not);
2. **about alike**: the smallest rise at least ``stair_ratio`` of the largest. A warm-up's
   compile or batch-length records come at ever longer gaps (each about twice the last), so its
   later parts rise far less or not at all; a checkpoint's or an eval's one-time ratchet raises one
   part only; a restart's new warm-up decelerates;
3. **material**: the fitted rise over the window at least ``tol``.

The slope is the rise between the first and last part medians over the distance of their
centres: the staircase's mean rate (one step per cadence), which is what the time to OOM needs.
Cost: one window read and a sort per part, <= 16 points: microseconds, once per block at most.
"""

from __future__ import annotations

import math
from itertools import pairwise

from .blocks import Pyramid, Signal, Trend
from .stats import noise_sigma

#: Standard error of a median of m normal points is ~1.2533 sigma / sqrt(m).
_MEDIAN_SE = 1.2533


def _lower_median(values: list[float]) -> float:
    """The median, or of an even count the lower middle value: a part holding one step in its
    middle takes the level before it, never the midpoint (which would let one step raise two parts)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def staircase(pyramid: Pyramid, signal: Signal, s0: float, min_span: float, tol: float) -> Trend | None:
    """A staircase rise of ``signal`` since ``s0`` (every part higher, about alike, material), or None."""
    cfg = pyramid.config
    xs, ys, block_span = pyramid.window(signal, s0)
    n = len(xs)
    parts = cfg.stair_parts
    if n < max(cfg.min_blocks, 3 * parts):
        return None
    span = xs[-1] - xs[0] + block_span
    if span < min_span - block_span or ys[-1] - ys[0] < 0.5 * tol:
        return None
    cuts = [round(i * n / parts) for i in range(parts + 1)]
    levels = [_lower_median(ys[a:b]) for a, b in pairwise(cuts)]
    rises = [b - a for a, b in pairwise(levels)]
    smallest = min(rises)
    if smallest <= 0 or smallest < cfg.stair_ratio * max(rises):
        return None
    per_part = n / parts
    noise = _MEDIAN_SE * noise_sigma(ys) * math.sqrt(2.0 / per_part)
    if smallest <= cfg.stair_z * noise:
        return None
    centres = [sum(xs[a:b]) / (b - a) for a, b in pairwise(cuts)]
    slope = (levels[-1] - levels[0]) / (centres[-1] - centres[0])
    if slope * span < tol:
        return None
    return Trend(slope, span, n, ys[-1])
