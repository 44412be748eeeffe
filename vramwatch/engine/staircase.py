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
2. **a regular cadence**: the longest gap between steps at most ``stair_spread`` times the
   shortest (a doubling warm-up fails at once), and the staircase **still going**: the time since
   the last step at most the longest gap;
3. **material**: the steps add up to at least ``tol``.

The slope is the staircase's mean rate, the steps' mean size over their mean gap (one step per
cadence): what the time to OOM needs. Steps closer than one point apart are a smooth rise at
this resolution and are left to ``Pyramid.trend``. Cost: one window read and a pass over
<= 48 points (a sort for the noise): tens of microseconds, every fourth block at most.
"""

from __future__ import annotations

import math
from itertools import pairwise

from vramwatch.engine.blocks import Pyramid, Signal, Trend
from vramwatch.engine.stats import noise_sigma


def steps_of(xs: list[float], ys: list[float], threshold: float) -> list[tuple[float, float]]:
    """(position, size) of each rise above ``threshold`` between consecutive points; a rise spread
    over consecutive points (a step straddling a point) is one step at its first position."""
    steps: list[tuple[float, float]] = []
    previous = -2
    for i, (a, b) in enumerate(pairwise(ys)):
        if b - a <= threshold:
            continue
        at = 0.5 * (xs[i] + xs[i + 1])
        if i == previous + 1 and steps:
            steps[-1] = (steps[-1][0], steps[-1][1] + b - a)
        else:
            steps.append((at, b - a))
        previous = i
    return steps


def staircase(pyramid: Pyramid, signal: Signal, s0: float, min_span: float, tol: float) -> Trend | None:
    """A staircase of ``signal`` since ``s0`` (several steps, a regular cadence still going,
    material), or None."""
    cfg = pyramid.config
    last = pyramid.last
    before = pyramid.value_before(signal, s0)
    if last is None or before is None or getattr(last, signal) - before < 0.5 * tol:
        return None  # no material rise since s0: no window to read
    # from a little before s0: a window opened at a break's onset must see the level before the
    # step that broke the plateau, or it misses one step of the staircase
    lead = 2 * max(cfg.block_steps, (last.end - s0) / cfg.ring_blocks)
    xs, ys, block_span = pyramid.window(signal, max(pyramid.start, s0 - lead), points=cfg.ring_blocks)
    n = len(xs)
    if n < cfg.min_blocks:
        return None
    span = xs[-1] - xs[0] + block_span
    if span < min_span - block_span or ys[-1] - ys[0] < 0.5 * tol:
        return None
    # a step stands out of the point-to-point jitter, and is a share of a material rise (a
    # staircase of ``stair_steps`` steps adds up to ``tol``): the minima of quiet blocks still
    # wobble by a MiB or two, which is no step
    threshold = max(cfg.stair_z * math.sqrt(2.0) * noise_sigma(ys), tol / (2 * cfg.stair_steps))
    steps = steps_of(xs, ys, threshold)
    if len(steps) < cfg.stair_steps:
        return None
    positions = [at for at, _ in steps]
    gaps = [b - a for a, b in pairwise(positions)]
    if max(gaps) > cfg.stair_spread * min(gaps) or xs[-1] + 0.5 * block_span - positions[-1] > max(gaps):
        return None
    rise = sum(size for _, size in steps)
    if rise < tol:
        return None
    cadence = sum(gaps) / len(gaps)
    return Trend((rise / len(steps)) / cadence, span, n, ys[-1], cadence)
