"""What a leak's forecast rests on: its rate with another process's memory taken out, and how sure
that rate is.

On device used another process's memory (a notebook, a profiler, an eval job) comes and goes by the
same few hundred MiB. A rise undone later by a fall of about its size is that process's (a toggle),
and on a ratcheting level (reserved, device used), whose own floor never falls while it leaks, so is
a fall left unmatched (it arrived before the window). A rate read across such a move is off by its
size over the window: minutes after a leak's onset that is a large share. :func:`level_shifts` finds
those moves among the series' jumps (:func:`moves_of`), :func:`without` takes them out.

**A steady rise** is forecast at the Theil-Sen slope of its window with those moves out
(:func:`steady_rate`).

**A staircase** (``staircase.py``) is forecast from its **envelope** (:func:`stairs_of`): the net
rise since its first step (another process's moves out, any creep between the steps in: the rise a
fine staircase makes below the step threshold) over the time its steps took, and, when the next
step is overdue (more than a mean gap since the latest), the time waited past that gap as well: a
gap not over yet is at least that long. Its steps are its own: a rise under half the typical one
(one of the allocator's ratchets) is no step of its cadence, nor one over three times it (another
process arriving, a one-time ratchet), which is taken out of the level as another's move. Its spread (the
coefficient of variation of its gaps and of its sizes, a sample's, n - 1) is what the forecast's
range is made of (``leak.py``). O(points) once per verdict, and again while the leak is followed
only once the level has taken a new step, on at most ``ring_blocks`` points.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import NamedTuple

from vramwatch.engine.config import EngineConfig
from vramwatch.engine.stats import cv, median, noise_sigma, theil_sen

#: a rise under this share of the typical step is no step of the staircase's cadence
OWN_STEP_SHARE = 0.5
#: a rise over this many typical steps is no step of it either: another process arriving, a
#: one-time ratchet (a leak's chunks are alike; two landing between the same points make twice one)
ALIEN_STEP_RATIO = 3.0

Move = tuple[float, float]  # (position on the step axis, signed size in bytes)


class Stairs(NamedTuple):
    """A staircase's forecast inputs (positions on the step axis)."""

    rise: float  # bytes: its net rise since its first step (module docstring)
    first: float  # its first own step
    last: float  # its latest own step
    gaps: int  # gaps between its own steps seen (its own steps - 1)
    spread: float  # the coefficient of variation of its gaps and sizes, combined (n - 1)
    end: float  # where its window ended ...
    level: float  # ... at this level
    cadence: float  # the mean gap between its own steps
    step: float  # its mean step (bytes)

    def stepped(self, level: float) -> bool:
        """``level`` is a new step above where its window ended (half of one or more)."""
        return level - self.level > 0.5 * self.step

    def rate(self, now: float, level: float) -> float:
        """Bytes per step at ``now`` and ``level``: its rise over the time its steps took, and, while
        the next step is overdue (more than a mean gap since the latest, and none since its window
        ended), the time waited past that gap."""
        waited = 0.0 if self.stepped(level) else max(0.0, now - self.last - self.cadence)
        return self.rise / (self.last - self.first + waited)


def step_threshold(cfg: EngineConfig, ys: list[float], tol: float) -> float:
    """The smallest move that is a step: ``stair_z`` deviations above the point-to-point jitter,
    and a share of a material rise (``stair_steps`` of them add up to half of ``tol``): the minima
    of quiet blocks still wobble by a MiB or two, which is no step."""
    return max(cfg.stair_z * math.sqrt(2.0) * noise_sigma(ys), tol / (2 * cfg.stair_steps))


def moves_of(xs: list[float], ys: list[float], threshold: float) -> list[Move]:
    """(position, signed size) of each change beyond ``threshold`` between consecutive points;
    a change spread over consecutive points in one direction (a step straddling a point) is one
    move at its first position."""
    moves: list[Move] = []
    previous = -2
    for i, (a, b) in enumerate(pairwise(ys)):
        if abs(b - a) <= threshold:
            continue
        if i == previous + 1 and moves and (moves[-1][1] > 0) == (b > a):
            moves[-1] = (moves[-1][0], moves[-1][1] + b - a)
        else:
            moves.append((0.5 * (xs[i] + xs[i + 1]), b - a))
        previous = i
    return moves


def split_moves(moves: list[Move], ratio: float) -> tuple[list[Move], list[Move]]:
    """(the moves left, the toggles): each move cancels the latest unmatched opposite move of a
    similar size (within ``ratio``): a level that came back."""
    left: list[Move] = []
    toggles: list[Move] = []
    for at, size in moves:
        for j in range(len(left) - 1, -1, -1):
            other = left[j][1]
            if (other > 0) != (size > 0) and max(abs(other), abs(size)) <= ratio * min(abs(other), abs(size)):
                toggles += (left.pop(j), (at, size))
                break
        else:
            left.append((at, size))
    return left, toggles


def level_shifts(moves: list[Move], ratio: float) -> tuple[list[Move], list[Move]]:
    """(the rises that are the judged level's, the moves that are another process's on a ratcheting
    level): the toggles and the falls left unmatched."""
    left, toggles = split_moves(moves, ratio)
    return [m for m in left if m[1] > 0], toggles + [m for m in left if m[1] < 0]


def without(xs: list[float], ys: list[float], shifts: list[Move]) -> list[float]:
    """``ys`` with each shift taken out of every point after its position."""
    if not shifts:
        return ys
    return [y - sum(size for at, size in shifts if at < x) for x, y in zip(xs, ys, strict=True)]


def _over_creep(cfg: EngineConfig, xs: list[float], ys: list[float], tol: float) -> tuple[list[float], float]:
    """``ys`` with the rise's own creep (the median rise per step between points) taken out, and
    the smallest move there that is one: :func:`step_threshold`'s, on the jitter read on those
    differences. A steady rise is flat there; a step, a neighbour's arrival or its leaving stands
    out whole."""
    dxs = [b - a for a, b in pairwise(xs)]
    dys = [b - a for a, b in pairwise(ys)]
    creep = median([dy / dx for dx, dy in zip(dxs, dys, strict=True)])
    excess = [dy - creep * dx for dx, dy in zip(dxs, dys, strict=True)]
    sigma = 1.4826 * median([abs(e) for e in excess]) / math.sqrt(2.0)
    threshold = max(cfg.stair_z * math.sqrt(2.0) * sigma, tol / (2 * cfg.stair_steps))
    x0 = xs[0]
    return [y - creep * (x - x0) for x, y in zip(xs, ys, strict=True)], threshold


def foreign_moves(cfg: EngineConfig, xs: list[float], ys: list[float], tol: float) -> list[Move]:
    """Another process's moves on a ratcheting level (toggles, falls left unmatched: its own floor
    never falls while it rises), read over the rise's own creep (:func:`_over_creep`: a neighbour
    leaving while the leak creeps on counts its whole size). Another's moves always include a fall:
    without one (one as large as the smallest step between two points) nothing more is read."""
    if min(b - a for a, b in pairwise(ys)) >= -tol / (2 * cfg.stair_steps):
        return []
    flat, threshold = _over_creep(cfg, xs, ys, tol)
    return level_shifts(moves_of(xs, flat, threshold), cfg.stair_toggle_ratio)[1]


def steady_rate(cfg: EngineConfig, xs: list[float], ys: list[float], tol: float) -> float:
    """A ratcheting level's rise: the Theil-Sen slope with another process's moves out
    (:func:`foreign_moves`; 0 when there are none: the slope stands)."""
    foreign = foreign_moves(cfg, xs, ys, tol)
    return theil_sen(xs, without(xs, ys, foreign)) if foreign else 0.0


def stepwise(cfg: EngineConfig, xs: list[float], ys: list[float], tol: float) -> bool:
    """The rise of a ratcheting level is carried by its steps, not its creep: the rises standing
    out over the creep (:func:`_over_creep`; another process's moves out) add up to more than half
    of the net rise. Such a rise is a staircase (NCCL's set-up, a few kept tensors) and is judged
    by its cadence (``staircase.py``), however straight a line through it looks. A leak that
    creeps, or ratchets its cache every point or two, rises between most points: its creep is the
    rise. O(points log points)."""
    flat, threshold = _over_creep(cfg, xs, ys, tol)
    rises, foreign = level_shifts(moves_of(xs, flat, threshold), cfg.stair_toggle_ratio)
    net = ys[-1] - ys[0] - sum(size for _, size in foreign)
    return net > 0 and sum(size for _, size in rises) > 0.5 * net


def stairs_of(xs: list[float], ys: list[float], moves: list[Move], ratio: float) -> Stairs | None:
    """A staircase's own steps and envelope (module docstring); None with fewer than two steps or
    no net rise since the first."""
    rises, foreign = level_shifts(moves, ratio)
    if len(rises) < 2:
        return None
    typical = median([size for _, size in rises])
    own = [(at, size) for at, size in rises if size >= OWN_STEP_SHARE * typical]
    foreign += [(at, size) for at, size in own if size > ALIEN_STEP_RATIO * typical]
    own = [(at, size) for at, size in own if size <= ALIEN_STEP_RATIO * typical]
    if len(own) < 2:
        return None
    first = own[0][0]
    gaps = [b[0] - a[0] for a, b in pairwise(own)]
    last = own[-1][0]
    level = without(xs, ys, foreign)
    # the level once a step is whole: the point before it plus its size (a step straddling points
    # is one move at its first position: the point after that is halfway up)
    before_first = max(i for i, x in enumerate(xs) if x < first)
    before_last = max(i for i, x in enumerate(xs) if x < last)
    rise = level[before_last] + own[-1][1] - level[before_first] - own[0][1]
    spread = (cv(gaps, ddof=1) ** 2 + cv([size for _, size in own], ddof=1) ** 2) ** 0.5
    if rise <= 0:
        return None  # what rose since its first step went again: no rate to forecast from
    return Stairs(rise, first, last, len(gaps), spread, xs[-1], ys[-1], (last - first) / len(gaps), rise / len(gaps))

