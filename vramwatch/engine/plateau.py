"""Plateau detector: warm-up -> plateau, the plateau break, the re-level, the new plateau.

Warm-up ends when the floor's Theil-Sen slope over the last 40 % of the process's age,
stretched over the whole age, is immaterial and reserved stopped growing (what a marked
phase added does not count). On the plateau a one-sided CUSUM on the block floor finds a
break; a reserved ratchet over 1 % of the device is a break too, except when a marked
phase (checkpoint, eval) caused it: then the allocator kept the phase's buffers once, and
the plateau is re-levelled on the spot instead of going ``rising`` for hundreds of steps.
See docs/engine.md for the why of each rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

from vramwatch.engine.blocks import Block, keep_last
from vramwatch.engine.context import Context, Cusum, PlateauLevels
from vramwatch.engine.stats import median, noise_sigma


class Break(NamedTuple):
    cause: str  # allocated | reserved | the phase that ratcheted reserved
    onset: int
    relevel: bool  # a marked phase's one-time ratchet: the plateau moves, no rising


@dataclass(slots=True)
class PlateauDetector:
    """State of the plateau verdict for one process."""

    floor_cusum: Cusum = field(default_factory=Cusum)
    rising_since: int = 0  # onset of the current rise (break, or a later leak window start)
    break_onsets: list[int] = field(default_factory=list)  # the latest 8
    phase_ratchet: str | None = None  # the phase whose reserved ratchet is not yet judged
    phase_bumps: list[tuple[int, int]] = field(default_factory=list)  # (step, added), the latest 16
    first_judged: int | None = None  # where the process's first plateau was judged ...
    first_young: bool = False  # ... within the warm-up horizon (wall time) ...
    first_broke: int | None = None  # ... and the onset of the first rise that left it
    levels_seen: list[float] | None = None  # the floors of the latest 4 plateaus (made at the first)

    def note_phase(self, phase: str, step: int, reserved_before: int | None, reserved: int | None, rtol: float) -> None:
        """A phase sample: remember what it added to reserved (a phase's ratchet is no growth)."""
        if reserved_before is None or reserved is None or reserved <= reserved_before:
            return
        keep_last(self.phase_bumps, (step, reserved - reserved_before), 16)
        if reserved > reserved_before + rtol:
            self.phase_ratchet = phase  # the next reserved break is this phase's doing

    def bumps_since(self, step: float) -> int:
        return sum(added for at, added in self.phase_bumps if at >= step)

    def _reserved_flat(self, ctx: Context, block: Block, window: float) -> bool:
        """Reserved grew less than 1 % of the device over ``window`` (phase ratchets excluded);
        True when reserved is not measured (nothing to hold against the plateau)."""
        if block.reserved is None:
            return True
        since = block.end - window
        before = ctx.pyramid.value_at("reserved", since)
        if before is None:
            return True
        return block.reserved - before - self.bumps_since(since) <= ctx.reserved_tol

    # ------------------------------------------------------------------ warm-up
    @staticmethod
    def waiting_for_second_clear(ctx: Context) -> bool:
        """One sawtooth clear seen: its level is trough against trough, so wait for the second
        clear (or for long enough to know there is none) before judging anything."""
        pyramid = ctx.pyramid
        last = pyramid.last
        assert last is not None
        return len(pyramid.saw_drops) == 1 and last.end - pyramid.saw_drops[0] < 1.5 * pyramid.saw_period

    @staticmethod
    def warmup_span(ctx: Context, age: int) -> float:
        """The window warm-up is judged on: 40 % of the age, at least 8 blocks and 1.5 periods."""
        cfg = ctx.config
        return max(cfg.min_blocks * cfg.block_steps, cfg.warmup_span_frac * age, 1.5 * ctx.pyramid.saw_period)

    def settled(self, ctx: Context, age: int) -> float | None:
        """The flat window's span when warm-up is over, else None."""
        pyramid = ctx.pyramid
        span = self.warmup_span(ctx, age)
        last = pyramid.last
        assert last is not None
        s0 = last.end - span
        if s0 < pyramid.start:
            return None
        # flat even with the current slope stretched over the whole age: a warm-up with a
        # long time constant is still climbing at age T by (A/tau)e^(-T/tau) per step, which
        # only becomes immaterial over T steps once T is several tau
        if not pyramid.flat("floor", s0, span, ctx.tol, stretch=age):
            return None
        # the allocator may still be filling its cache in ever rarer jumps: only its recent
        # growth counts, and what a checkpoint/eval added is a phase's ratchet
        return span if self._reserved_flat(ctx, last, span / 2) else None

    def levels(self, ctx: Context, block: Block, span: float) -> PlateauLevels:
        """The plateau's levels over the flat window ending at ``block``; sets ``ctx.tol``
        from the noise of the block floors on it."""
        pyramid = ctx.pyramid
        s0 = block.end - span
        _, floors, _ = pyramid.window("floor", s0)
        ring = [b for b in pyramid.blocks if b.start >= s0] or [block]
        sigma = noise_sigma([b.floor for b in ring])
        ctx.tol = max(ctx.base_tol, ctx.config.noise_k * sigma)
        if pyramid.saw_period:
            # a sawtooth's floor is its trough now, not the median of trailing minima that
            # still reach back into the warm-up
            floor = pyramid.min_since("floor", block.end - 1.2 * pyramid.saw_period)
        else:
            floor = median(floors) if floors else block.floor
        peaks = [b.peak for b in ring if b.peak is not None]
        outside = [b.outside for b in ring]
        slack = [b.slack for b in ring if b.slack is not None]
        return PlateauLevels(
            floor=floor,
            reserved=None if block.reserved is None else float(block.reserved),
            peak=float(median(peaks)) if peaks else None,
            outside=None if any(v is None for v in outside) else float(median(outside)),  # type: ignore[arg-type]
            slack=float(median(slack)) if slack else None,
            since_step=max(pyramid.start, int(s0)),
        )

    def start(self, ctx: Context, block: Block) -> None:
        """A new plateau: fresh CUSUM, no pending phase ratchet."""
        if self.first_judged is None:
            self.first_judged = block.end
            self.first_young = ctx.wall_age(block) < ctx.config.warmup_horizon_s
        if ctx.plateau is not None:
            if self.levels_seen is None:
                self.levels_seen = []  # allocated as it fills: most series hold a few hundred bytes
            keep_last(self.levels_seen, ctx.plateau.floor, 4)
        self.phase_ratchet = None
        self.floor_cusum.reset(block.end + 1)

    # ------------------------------------------------------------------ on the plateau
    def check_break(self, ctx: Context, block: Block, floor: float) -> Break | None:
        """A break of the plateau at this block, or None (small reserved ratchets, the
        allocator meeting a longer batch than before, are absorbed into the level)."""
        plateau = ctx.plateau
        assert plateau is not None
        if self.floor_cusum.step(floor - plateau.floor, ctx.tol, block):
            return Break("allocated", self.floor_cusum.onset, relevel=False)
        if block.reserved is None or plateau.reserved is None:
            return None
        if block.reserved - plateau.reserved > ctx.reserved_tol:
            phase = self.phase_ratchet
            self.phase_ratchet = None
            return Break(phase or "reserved", block.start, relevel=phase is not None)
        recent = ctx.pyramid.value_at("reserved", block.end - 4 * ctx.config.block_steps)
        if recent is not None:
            plateau.reserved = max(plateau.reserved, recent)
        return None

    def relevel(self, ctx: Context, block: Block) -> None:
        """Move the plateau to what a phase's ratchet left: reserved and reserved - allocated
        step up once; the floor and its CUSUM go on (a leak under the ratchet is still seen)."""
        plateau = ctx.plateau
        assert plateau is not None and plateau.reserved is not None and block.reserved is not None
        added = block.reserved - plateau.reserved
        plateau.reserved = float(block.reserved)
        if plateau.slack is not None:
            # allocated did not move: reserved - allocated steps up by what reserved added (the
            # block's own minimum may still hold samples from before the phase)
            plateau.slack += added

    def begin_rise(self, brk: Break) -> None:
        self.rising_since = brk.onset
        keep_last(self.break_onsets, brk.onset, 8)
        if self.first_judged is not None and self.first_broke is None:
            self.first_broke = brk.onset

    def warming_up(self, ctx: Context, block: Block, slope: float) -> bool:
        """Is a rise at ``slope`` still the warm-up? The process's first plateau was judged within
        the warm-up horizon and did not hold: the floor left it before it had stayed flat for as
        long as the rise needs to become material (``tol / slope``). A warm-up that looked flat
        for a while (a long ramp, a slow approach within the 1 % tolerance of a ratcheting level,
        compile jumps) goes on right away; a leak after a settled plateau shows the kink. Until
        the process has run ``warmup_leak_horizons`` horizons such a rise is no leak, unless its
        breaks come at a regular cadence (:meth:`regular_breaks`), as a warm-up's never do."""
        if self.first_judged is None or not self.first_young:
            return False
        if ctx.past_horizon(block, ctx.config.warmup_leak_horizons):
            return False
        broke = self.first_broke if self.first_broke is not None else block.end
        return (broke - self.first_judged) * slope < ctx.tol and not self.regular_breaks()

    def regular_breaks(self) -> bool:
        """The latest four breaks came at a regular cadence (the longest gap at most twice the
        shortest) and the plateaus between them rose alike (the smallest rise at least half the
        largest): a staircase of ratchets, as a leak through the allocator makes. A warm-up's
        compile or batch-length breaks come at ever longer gaps, each adding less than the last."""
        onsets, levels = self.break_onsets[-4:], self.levels_seen
        if len(onsets) < 4 or levels is None or len(levels) < 4:
            return False
        gaps = [b - a for a, b in pairwise(onsets)]
        rises = [b - a for a, b in pairwise(levels)]
        return min(gaps) > 0 and max(gaps) <= 2 * min(gaps) and min(rises) > 0 and max(rises) <= 2 * min(rises)

    # ------------------------------------------------------------------ after a break
    def settled_after_rise(self, ctx: Context, block: Block) -> float | None:
        """The window when the rise is over: at least two minimum spans after the onset, the
        later half of the rise flat even with its slope stretched over the whole rise (a slow
        creep never passes for a plateau), and reserved flat. None while still rising."""
        if block.end - self.rising_since < 2 * ctx.min_span():
            return None
        rise = block.end - self.rising_since
        window = 0.5 * rise
        if not ctx.pyramid.flat("floor", block.end - window, window, ctx.tol, stretch=rise):
            return None
        return window if self._reserved_flat(ctx, block, window) else None

    def rise_starts(self, ctx: Context, block: Block) -> list[int]:
        """Windows a leak in the rise is looked for from: the break, the floor's own change
        point (a checkpoint ratchet first, a leak after), the recent half, and the last 2 or 4
        minimum spans (a leak that began while still rising from an earlier, smaller break)."""
        since = self.rising_since
        starts = {since, max(since, self.floor_cusum.onset), int(0.5 * (since + block.end))}
        min_span = ctx.min_span()
        for multiple in (2, 4):
            if block.end - multiple * min_span > since:
                starts.add(int(block.end - multiple * min_span))
        return sorted(starts)

