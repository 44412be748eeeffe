"""The staircase test: a ratcheting level that keeps stepping up at a regular cadence.

Device used (and reserved) grow in a caching allocator's ratchets: a leak reaches them as
segment allocations, a staircase of plateau breaks, each settling on a higher plateau, at a
cadence set by segment size / leak rate (or by how often the program keeps a tensor). Theil-Sen
is blind to it (on a staircase of rare steps most pairwise slopes are zero), and a steady leak's
no-jump rule rejects it (every step is a jump).

What tells a leak's staircase from the ratchets of a healthy run is its **cadence**. A warm-up's
compile or batch-length records come at ever longer gaps (each about twice the last); a
checkpoint's or an eval's ratchet comes once. On the window's points (<= ``ring_blocks`` block
minima: steps need the resolution, and the test is linear in them) the test finds the
**steps**: rises from one point to the next above ``stair_z`` standard deviations of the
measured noise (the MAD of the points' first differences: a step is an outlier there, the
jitter is not) and above a share of the material size, consecutive ones merged. It requires

1. **several steps**: at least ``stair_steps`` (4: three gaps to judge a cadence by);
2. **a cadence that goes on**: gaps may wander (a leak kept at irregular moments: up to
   ``stair_spread`` times the shortest), but do not grow every time to several times the first,
   nor do the steps' rate fall to a quarter (a warm-up's records, ever rarer and smaller); and
   the staircase is **still going**: the time since the last step at most the longest gap (or
   1.5 mean gaps);
3. **material on the net rise**: rises minus falls add up to at least ``tol``. Another process's
   memory that comes and goes (a rise undone later by a fall of about its size, or the reverse)
   is taken out first (:func:`without_toggles`): its "steps" are no leak, however regular.

The slope is the staircase's rate, its steps after the first over the time they took (what the
leak is followed by); its ``slope_low``..``slope_high`` an 80 % interval of that mean rate from
the spread of its gaps and step sizes. The time to OOM and its range come from its envelope and
the spread of its own steps (``forecast.py``: :class:`~vramwatch.engine.forecast.Stairs`, read on
the same window and moves). Steps closer than one point apart are a smooth rise at
this resolution and are left to ``Pyramid.trend``. Cost: one window read and a pass over
<= 48 points (a sort for the noise): tens of microseconds, every fourth block at most.
"""

from __future__ import annotations

import math
from itertools import pairwise

from vramwatch.engine.blocks import Pyramid, Signal, Trend
from vramwatch.engine.forecast import Stairs, moves_of, split_moves, stairs_of, step_threshold
from vramwatch.engine.stats import cv


def without_toggles(moves: list[tuple[float, float]], ratio: float) -> tuple[list[tuple[float, float]], float]:
    """The moves left once every level that came back is taken out, and what those left fell by.

    Another process's memory on the device (a notebook, a profiler, an eval job) comes and goes: a
    rise later undone by a fall of about its size (within ``ratio``), or a fall later undone by a
    rise, is that component's, not the judged process's. Each move cancels the latest unmatched
    opposite move of a similar size. Returns (the rises left, in order; the sum of falls left)."""
    left, _ = split_moves(moves, ratio)
    return [m for m in left if m[1] > 0], -sum(size for _, size in left if size < 0)


def half_rates(positions: list[float], sizes: list[float]) -> tuple[float, float]:
    """The rate of the staircase's earlier and later halves: each half's steps (the first step
    excluded: it opens the count) over the time they took."""
    half = len(sizes) // 2
    early = sum(sizes[1 : half + 1]) / max(positions[half] - positions[0], 1e-9)
    if half + 1 >= len(sizes):
        return early, early
    return early, sum(sizes[half + 1 :]) / max(positions[-1] - positions[half], 1e-9)


def decelerating(gaps: list[float], early: float, late: float) -> bool:
    """A warm-up's records: gaps growing every time (each about twice the last) to several times
    the first, or the later half's rate under a quarter of the earlier's. A leak's cadence wanders
    both ways and keeps its rate."""
    growing = all(y > x for x, y in pairwise(gaps))
    return (growing and gaps[-1] >= 2.5 * gaps[0]) or late < 0.25 * early


def _window(pyramid: Pyramid, signal: Signal, s0: float) -> tuple[list[float], list[float], int]:
    """The staircase's window since ``s0`` (at most ``ring_blocks`` points: steps need the
    resolution), from a little before it: a window opened at a break's onset must see the level
    before the step that broke the plateau, or it misses one step of the staircase."""
    cfg = pyramid.config
    last = pyramid.last
    lead = 2 * max(cfg.block_steps, (last.end - s0) / cfg.ring_blocks) if last is not None else 0
    return pyramid.window(signal, max(pyramid.start, s0 - lead), points=cfg.ring_blocks)


def stairs_since(pyramid: Pyramid, signal: Signal, s0: float, tol: float) -> Stairs | None:
    """A followed staircase's forecast inputs, read again on its window since ``s0`` (no test:
    it was found; :func:`vramwatch.engine.forecast.stairs_of`)."""
    xs, ys, _ = _window(pyramid, signal, s0)
    if len(xs) < pyramid.config.min_blocks:
        return None
    return stairs_of(xs, ys, moves_of(xs, ys, step_threshold(pyramid.config, ys, tol)),
                     pyramid.config.stair_toggle_ratio)


def staircase(pyramid: Pyramid, signal: Signal, s0: float, min_span: float, tol: float) -> Trend | None:
    """A staircase of ``signal`` since ``s0`` (several steps, a regular cadence still going,
    material), or None."""
    cfg = pyramid.config
    last = pyramid.last
    before = pyramid.value_before(signal, s0)
    if last is None or before is None or getattr(last, signal) - before < 0.5 * tol:
        return None  # no material rise since s0: no window to read
    xs, ys, block_span = _window(pyramid, signal, s0)
    n = len(xs)
    if n < cfg.min_blocks:
        return None
    span = xs[-1] - xs[0] + block_span
    if span < min_span - block_span or ys[-1] - ys[0] < 0.5 * tol:
        return None
    moves = moves_of(xs, ys, step_threshold(cfg, ys, tol))
    rises, falls = without_toggles(moves, cfg.stair_toggle_ratio)
    net = sum(size for _, size in rises) - falls  # judged on the net rise: what went and came back is no leak
    if len(rises) < cfg.stair_steps or net < tol or falls > 0.5 * net:
        return None
    positions = [at for at, _ in rises]
    gaps = [b - a for a, b in pairwise(positions)]
    if min(gaps) <= 0 or max(gaps) > cfg.stair_spread * min(gaps):
        return None
    cadence = sum(gaps) / len(gaps)
    # still going: a wandering cadence may be late by half its mean gap more than the longest seen
    if xs[-1] + 0.5 * block_span - positions[-1] > max(max(gaps), 1.5 * cadence):
        return None
    sizes = [size for _, size in rises]
    early, late = half_rates(positions, sizes)
    if decelerating(gaps, early, late):
        return None
    # the rate the staircase keeps: its steps after the first over the time they took (what came
    # and went is out; a fall left is no rate of the leak's). Its range: an 80 % interval of a mean
    # rate from this many gaps and sizes (z 1.28 times their spread over the root of the count)
    rate = sum(sizes[1:]) / (positions[-1] - positions[0])
    u = min(0.8, 1.28 * math.hypot(cv(gaps), cv(sizes)) / math.sqrt(len(gaps)))  # population CV
    return Trend(rate, span, n, ys[-1], cadence, rate * (1.0 - u), rate * (1.0 + u),
                 stairs=stairs_of(xs, ys, moves, cfg.stair_toggle_ratio))

