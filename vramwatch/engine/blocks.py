"""The block pyramid: bounded per-series memory from which every window is read.

Every ``block_steps`` train steps the open block (a handful of minima and maxima the
engine folds each sample into) is closed as a :class:`Block` and pushed into level 0.
Level *k* holds the last ``ring_blocks`` blocks of ``block_steps * 4**k`` steps, each
made by merging four blocks of level *k-1*. Memory per series is ``levels * ring_blocks``
blocks whatever the run length; a push costs O(levels) amortised O(1). A level is created
when its first block is merged into it (level *k* after ``4**(k-1)`` blocks): a series that
has not closed a block holds no ring at all, one of a few hundred steps only the finest.

Reads (:meth:`Pyramid.window`, :meth:`Pyramid.trend`, :meth:`Pyramid.flat`) choose the
finest level that still reaches back to the window's start and group its blocks to at
most ``fit_points`` points, so every estimator runs on <= 16 numbers: tens of
microseconds, once per block, never per sample.

A signal that was not measured in a block is ``None`` there (sparse samples: a trace
with allocated only, or device-used only); a window over such blocks is empty, so a
detector that needs the signal sees nothing and says nothing.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Literal, NamedTuple, TypeVar

from vramwatch.engine.config import EngineConfig
from vramwatch.engine.forecast import Stairs, foreign_moves, stepwise, without
from vramwatch.engine.stats import mann_kendall_z, rolling_min, theil_sen

T = TypeVar("T")

#: Signals a block carries. ``floor``: minimum of the judged level (allocated, or reserved,
#: or device used: see ``TrendEngine.signal``); ``reserved``/``peak``/``peak2``: maxima;
#: ``outside`` (device used - reserved), ``slack`` (reserved - allocated), ``split``
#: (inactive split bytes): minima; ``retries``: the counter at the block's end.
Signal = Literal["floor", "reserved", "peak", "peak2", "outside", "slack", "split", "retries"]


class Block:
    """One closed block of train steps ``start..end`` (inclusive); see :data:`Signal`."""

    __slots__ = ("end", "floor", "outside", "peak", "peak2", "reserved", "retries", "slack", "split", "start", "ts")

    def __init__(
        self,
        start: int,
        end: int,
        ts: float,
        floor: float,
        reserved: float | None,
        peak: float | None,
        peak2: float | None,
        outside: float | None,
        slack: float | None,
        split: float | None,
        retries: int | None,
    ) -> None:
        self.start = start
        self.end = end
        self.ts = ts
        self.floor = floor
        self.reserved = reserved
        self.peak = peak
        self.peak2 = peak2
        self.outside = outside
        self.slack = slack
        self.split = split
        self.retries = retries

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Block({self.start}..{self.end}, floor={self.floor}, reserved={self.reserved}, peak={self.peak})"


def _lowest(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _highest(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def merge(children: list[Block]) -> Block:
    """Four blocks of one level as one block of the next (minima stay minima, maxima maxima)."""
    return Block(
        children[0].start,
        children[-1].end,
        children[-1].ts,
        min(c.floor for c in children),
        _highest([c.reserved for c in children]),
        _highest([c.peak for c in children]),
        _highest([c.peak2 for c in children]),
        _lowest([c.outside for c in children]),
        _lowest([c.slack for c in children]),
        _lowest([c.split for c in children]),
        children[-1].retries,
    )


def keep_last(items: list[T], item: T, bound: int) -> None:
    """Append ``item`` and drop the oldest past ``bound``: a bounded ring as a plain list (an
    empty list is 56 bytes where an empty deque is ~760; ``bound`` is small, so the shift is cheap)."""
    items.append(item)
    if len(items) > bound:
        del items[0]


class Level:
    """One ring of the pyramid: ``span`` steps per block, the latest ``ring_blocks`` kept
    (:meth:`Pyramid.push` bounds it)."""

    __slots__ = ("blocks", "pending", "span")

    def __init__(self, span: int) -> None:
        self.span = span
        self.blocks: list[Block] = []
        self.pending: list[Block] = []


class Trend(NamedTuple):
    """A significant, material, linear, gradual rise found by :meth:`Pyramid.trend` (or a
    staircase found by ``staircase.staircase``)."""

    slope: float  # bytes per step (Theil-Sen over the window; a staircase's mean rate)
    span: float  # steps the window covers
    n: int  # points the verdict rests on
    last: float  # the window's last value
    cadence: float = 0.0  # a staircase's mean gap between steps (steps); 0 for a steady rise
    slope_low: float = 0.0  # the rate's range: the slower and faster of its parts (0: not estimated)
    slope_high: float = 0.0
    rate: float = 0.0  # the forecast's rate when not the slope: another process's memory that came and went out
    stairs: Stairs | None = None  # a staircase's forecast inputs (None: a steady rise)


class Pyramid:
    """The rings of one process (reset on restart) plus the sawtooth it has shown."""

    __slots__ = ("config", "levels", "ratchet_floor", "saw_drops", "saw_period", "shifts", "start")

    def __init__(self, config: EngineConfig, start: int, ratchet_floor: bool = False) -> None:
        self.config = config
        self.start = start  # first step of the process
        # the floor is a caching allocator's reserved (or device used, which holds it): it
        # grows in ratchets, and a staircase of rare ratchets has a Theil-Sen slope of zero
        self.ratchet_floor = ratchet_floor
        self.levels: list[Level] = []  # created as blocks reach them (push)
        self.saw_drops: list[int] = []  # block starts where the floor fell back (the latest 6)
        self.saw_period = 0  # longest gap between clears (0: no sawtooth seen)
        #: a ratcheting floor's sudden moves not yet undone (block start, signed size; the latest 6),
        #: None before one: another process arriving (its leaving is no clear of this one's), or a
        #: drop taken for a clear until a rise of its size shows it was another process leaving
        self.shifts: list[tuple[int, float]] | None = None

    @property
    def blocks(self) -> list[Block] | tuple[()]:
        """Level 0, the finest ring (the latest ``ring_blocks`` blocks; empty before the first)."""
        return self.levels[0].blocks if self.levels else ()

    @property
    def last(self) -> Block | None:
        ring = self.blocks
        return ring[-1] if ring else None

    @property
    def coarse_pending(self) -> bool:
        """True except on every fourth block (when level 1 just closed one): the slow checks'
        cadence."""
        return len(self.levels) > 1 and bool(self.levels[1].pending)

    def push(self, block: Block, tol: float) -> None:
        """Add a closed block to level 0 and merge upwards (creating a level when the first
        block reaches it); note a sawtooth clear."""
        levels = self.levels
        cfg = self.config
        ring = cfg.ring_blocks
        if not levels:
            levels.append(Level(cfg.block_steps))
        previous = self.last
        keep_last(levels[0].blocks, block, ring)
        child = block
        for k in range(1, cfg.levels):
            if k == len(levels):
                levels.append(Level(cfg.block_steps * 4**k))
            level = levels[k]
            pending = level.pending
            pending.append(child)
            if len(pending) < 4:
                break
            child = merge(pending)
            keep_last(level.blocks, child, ring)
            pending.clear()
        if previous is None:
            return
        move = block.floor - previous.floor
        if self.ratchet_floor and abs(move) > 2 * tol / cfg.stair_toggle_ratio and self._another(block, move):
            return
        if -move > 2 * tol:
            # a sawtooth: the floor falls back by more than the material size, repeatedly;
            # until a second drop, the time since the process started bounds the period
            keep_last(self.saw_drops, block.start, 6)
            if self.ratchet_floor:  # until a rise of its size shows it was another process leaving
                self._shift(block.start, move)
            self._period()

    def _period(self) -> None:
        drops = self.saw_drops
        marks = [self.start, *drops] if len(drops) == 1 else list(drops)
        self.saw_period = int(max(b - a for a, b in pairwise(marks))) if drops else 0

    def _shift(self, at: int, move: float) -> None:
        shifts = self.shifts if self.shifts is not None else []
        keep_last(shifts, (at, move), 6)
        self.shifts = shifts

    def _another(self, block: Block, move: float) -> bool:
        """A sudden move of a ratcheting floor that undoes an earlier one of about its size (within
        ``stair_toggle_ratio``) is another process's: a fall after a rise, it arrived and left (no
        clear: True); a rise after a fall taken for a clear, it left and came back (that fall is no
        clear: it leaves the sawtooth's drops). A rise refilling what fell in the block before is
        the sawtooth's own (a cache emptied and filled again). O(6)."""
        shifts = self.shifts if self.shifts is not None else []
        ratio = self.config.stair_toggle_ratio
        if move > 0 and self.saw_drops and self.saw_drops[-1] >= block.start - 2 * (block.end - block.start + 1):
            return False  # a refill
        for i in range(len(shifts) - 1, -1, -1):
            at, size = shifts[i]
            if (size > 0) != (move > 0) and max(abs(size), abs(move)) <= ratio * min(abs(size), abs(move)):
                del shifts[i]
                if move < 0:
                    return True
                if at in self.saw_drops:
                    self.saw_drops.remove(at)
                    self._period()
                break
        if move > 0:
            self._shift(block.start, move)
        return False

    # ------------------------------------------------------------------ reads
    def recent_peak(self, blocks: int = 4) -> float | None:
        """Highest block peak of the last ``blocks`` blocks (None without peaks)."""
        ring = self.blocks
        return _highest([b.peak for b in list(ring)[-blocks:]]) if ring else None

    def value_at(self, signal: Signal, at: float) -> float | None:
        """Signal of the latest level-0 block starting at or before ``at``."""
        ring = self.blocks
        for b in reversed(ring):
            if b.start <= at:
                return getattr(b, signal)
        return getattr(ring[0], signal)

    def value_before(self, signal: Signal, at: float) -> float | None:
        """Signal of the latest block (at the finest level that reaches back that far) starting
        at or before ``at``; the oldest block held when none does. O(levels + ring)."""
        oldest = None
        for level in self.levels:
            ring = level.blocks
            if not ring:
                break
            oldest = ring[0]
            if ring[0].start <= at:
                for b in reversed(ring):
                    if b.start <= at:
                        return getattr(b, signal)
        return None if oldest is None else getattr(oldest, signal)

    def min_since(self, signal: Signal, since: float) -> float:
        """Lowest value over blocks wholly inside ``[since, now]`` at any level (the floor after
        collection); a coarse block starting earlier would drag in older (warm-up) values.
        Falls back to the latest block."""
        best = math.inf
        for level in self.levels:
            for b in reversed(level.blocks):
                if b.start < since:
                    break
                value = getattr(b, signal)
                if value is not None and value < best:
                    best = value
        if best == math.inf and self.blocks:
            best = getattr(self.blocks[-1], signal)
        return best

    def seconds_per_step(self) -> float | None:
        """Observed wall seconds per step over the level-0 ring (phases and stalls included)."""
        ring = self.blocks
        if len(ring) >= 2:
            first, last = ring[0], ring[-1]
            if last.end > first.end and last.ts > first.ts:
                return (last.ts - first.ts) / (last.end - first.end)
        return None

    def window(self, signal: Signal, s0: float, points: int = 0) -> tuple[list[float], list[float], int]:
        """(x, y, block span) of ``signal`` for blocks starting at or after ``s0``.

        Uses the finest level that still holds ``s0``; a known sawtooth period turns the
        signal into its trailing minimum over >1 period (the floor after collection); more
        than ``points`` (default ``fit_points``) points are grouped by their minimum (every
        trended signal is a floor-like minimum). Empty when the signal is missing from any
        block of the level.
        """
        cfg = self.config
        points = points or cfg.fit_points
        chosen = None
        for level in self.levels:
            ring = level.blocks
            if not ring:
                break
            width = 1
            if self.saw_period and signal != "reserved":
                width = math.ceil(1.2 * self.saw_period / level.span) + 1
                if width * 3 > cfg.ring_blocks:
                    continue
            chosen = (level, width)
            if len(ring) < cfg.ring_blocks or ring[0].start <= s0 - (width - 1) * level.span:
                break
        if chosen is None:
            return [], [], 0
        level, width = chosen
        ring_list = list(level.blocks)
        values = [getattr(b, signal) for b in ring_list]
        if any(v is None for v in values):
            return [], [], level.span
        if width > 1:
            values = rolling_min(values, width)
        xs: list[float] = []
        ys: list[float] = []
        for b, v in zip(ring_list, values, strict=True):
            if b.start >= s0:
                xs.append(0.5 * (b.start + b.end))
                ys.append(v)
        n = len(xs)
        if n > points:
            group = math.ceil(n / points)
            gx, gy = [], []
            for i in range(0, n, group):
                chunk = xs[i : i + group]
                gx.append(sum(chunk) / len(chunk))
                gy.append(min(ys[i : i + group]))
            xs, ys = gx, gy
        return xs, ys, level.span

    def trend(
        self,
        signal: Signal,
        s0: float,
        min_span: float,
        ratio: float,
        tol: float,
        max_jump: float = 0.5,
        parts: int = 2,
    ) -> Trend | None:
        """A significant, material, linear, gradual rise of ``signal`` since ``s0``, or None.

        ``ratio``: the Theil-Sen slopes of the ``parts`` (halves) must agree within it (a step
        or a settling curve has a flat part). ``max_jump``: no single point-to-point increase may
        carry more than this share of the rise (a staircase of one-time jumps is warm-up, a
        leak creeps). ``tol``: the material size.
        """
        xs, ys, block_span = self.window(signal, s0)
        n = len(xs)
        if n < self.config.min_blocks:
            return None
        span = xs[-1] - xs[0] + block_span
        if span < min_span - block_span:  # blocks start on their own grid, not at s0
            return None
        if max(ys) - min(ys) < 0.5 * tol:
            return None  # cannot hold a material rise: skip the O(n^2) estimators
        last = ys[-1]
        foreign = foreign_moves(self.config, xs, ys, tol) if self.ratchet_floor and signal == "floor" else []
        if foreign:  # its own floor never falls: judged (and its slope read) with another process's moves out
            ys = without(xs, ys, foreign)
        slope = theil_sen(xs, ys)
        if slope <= 0 or slope * span < tol:
            return None
        cuts = [round(i * (n - 1) / parts) for i in range(parts + 1)]
        slopes = [theil_sen(xs[a : b + 1], ys[a : b + 1]) for a, b in pairwise(cuts)]
        if min(slopes) <= 0 or min(slopes) < ratio * max(slopes):
            return None  # a step, a settling curve or a burst: not a steady rise
        biggest = max(b - a for a, b in pairwise(ys))
        if biggest > max_jump * slope * span:
            return None
        if mann_kendall_z(ys) < self.config.mk_z:
            return None
        if self.ratchet_floor and signal == "floor" and stepwise(self.config, xs, ys, tol):
            return None  # a few steps, not a creep: the staircase test judges it
        return Trend(slope, span, n, last, 0.0, min(slope, *slopes), max(slope, *slopes))

    def flat(self, signal: Signal, s0: float, min_span: float, tol: float, stretch: float = 0.0) -> bool:
        """``signal`` moved less than ``tol`` since ``s0`` (its Theil-Sen slope over the window,
        or over ``stretch`` steps when longer). False when the window is too short or empty."""
        xs, ys, block_span = self.window(signal, s0)
        if len(xs) < self.config.min_blocks:
            return False
        span = xs[-1] - xs[0] + block_span
        if span < min_span - block_span:
            return False
        moved = abs(theil_sen(xs, ys)) * max(span, stretch)
        if self.ratchet_floor and signal == "floor":
            # a ratcheting level is flat only if it did not step up either: its net rise,
            # stretched like the slope
            moved = max(moved, (ys[-1] - ys[0]) * max(1.0, stretch / span))
        return moved <= tol
