"""Leak detector (the judged floor), its runway to OOM, and following a leak until it ends.

A leak is a significant, material, linear, gradual rise of the block floor over a window
long enough (``Pyramid.trend``). It is looked for in a rise after a plateau break, over the
earliest recent break onsets on the coarse levels (leaks slower than the noise), and, for a
series that never settled, over the last three quarters of its life. The outside-allocator
leak (``outside.py``) shares :class:`LeakState` and :meth:`LeakDetector.follow`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from vramwatch import verdicts
from vramwatch.engine.blocks import Block, Signal, Trend
from vramwatch.engine.context import Context
from vramwatch.engine.events import LeakEvent
from vramwatch.engine.forecast import Stairs, steady_rate
from vramwatch.engine.plateau import PlateauDetector
from vramwatch.engine.staircase import staircase, stairs_since
from vramwatch.engine.stats import theil_sen

ALLOCATOR = "allocator"
OUTSIDE = "outside_allocator"
DEVICE = "device"  # device-used only: the leak's side of the allocator is not measured


@dataclass(slots=True)
class LeakState:
    """The leak being followed."""

    source: str  # allocator | outside_allocator | device
    slope: float  # bytes per step, re-fitted by Theil-Sen since the onset every fourth block
    onset: int
    detected_step: int
    steps: int | None = None  # projected steps to OOM
    seconds: float | None = None
    cadence: float = 0.0  # a staircase's mean gap between steps (steps); 0 for a steady rise
    spread: tuple[float, float] = (1.0, 1.0)  # the slope's range as multiples of it (slower, faster part)
    seconds_range: tuple[float, float] | None = None  # the time to OOM at the faster and the slower rate
    rate: float = 0.0  # the forecast's rate when not the slope (another process's moves out)
    stairs: Stairs | None = None  # a staircase's forecast inputs
    stairs_u: float = 0.0  # its forecast's relative uncertainty (_stairs_spread)

    @property
    def signal(self) -> Signal:
        """The block signal this leak rises in."""
        return "outside" if self.source == OUTSIDE else "floor"


class Ended(NamedTuple):
    window: float  # the flat window the new plateau is judged on
    judged: bool  # the rise is over and judged (not a sawtooth clear): forget its break onsets


@dataclass(slots=True)
class LeakDetector:
    current: LeakState | None = None
    stairs_read: int = -1  # the step at which the slow path last read a staircase window

    @staticmethod
    def source_for(ctx: Context) -> str:
        return DEVICE if ctx.signal == "device_used" else ALLOCATOR

    # ------------------------------------------------------------------ finding
    @staticmethod
    def rise(ctx: Context, s0: float, min_span: float, max_jump: float = 0.5,
             shape: tuple[float, int] | None = None) -> Trend | None:
        """A leak's rise of the floor since ``s0``: a steady one (``Pyramid.trend``) or, on a
        ratcheting level (reserved, device used), a staircase (``staircase.py``)."""
        ratio, parts = shape or ctx.leak_shape
        pyramid = ctx.pyramid
        trend = pyramid.trend("floor", s0, min_span, ratio, ctx.tol, max_jump=max_jump, parts=parts)
        if trend is None and pyramid.ratchet_floor and not pyramid.coarse_pending:
            trend = staircase(pyramid, "floor", s0, min_span, ctx.tol)  # a slow pattern: every fourth block
        return trend

    def in_rise(self, ctx: Context, plateau: PlateauDetector, block: Block) -> Trend | None:
        """A leak in the rise after a break; moves ``plateau.rising_since`` to the window found.
        A young process's rise that is still warm-up by its age is a leak when it fills the card
        fast (:meth:`fast_fill`)."""
        for s0 in plateau.rise_starts(ctx, block):
            trend = self.rise(ctx, s0, ctx.min_span())
            if trend and (plateau.warming_up(ctx, block, trend.slope) or self._device_young(ctx, trend)):
                trend = self.young(ctx, s0, trend)
            if trend:
                plateau.rising_since = s0
                return trend
        return None

    def young(self, ctx: Context, s0: float, trend: Trend) -> Trend | None:
        """A rise in a process still within its warm-up allowance (by age, or its first plateau
        not holding) is judged on its fill: a steady one by :meth:`fast_fill`, a staircase by
        its rate (NCCL's buffers, compile records come in irregular steps in the first hour,
        then stop: only a staircase that would fill the card before the allowance is out, seen
        for long enough, is a leak that young)."""
        if not trend.cadence:
            return self.fast_fill(ctx, s0)
        return trend if self._fills(ctx, trend) else None

    @staticmethod
    def _device_young(ctx: Context, trend: Trend) -> bool:
        """Device used only, young: a rise there may be NCCL's set-up or a warm-up's records in
        steps (allocator fields tell those apart; device used cannot). A steady rise is young
        within the first warm-up horizon; a staircase within the whole allowance
        (``warmup_leak_horizons``): set-up steps can come through the first hour and still look
        like a staircase going on just past it."""
        last = ctx.pyramid.last
        horizons = ctx.config.warmup_leak_horizons if trend.cadence else 1.0
        return ctx.signal == "device_used" and last is not None and not ctx.past_horizon(last, horizons)

    def _fills(self, ctx: Context, trend: Trend) -> bool:
        """``trend`` fills the card within the warm-up allowance and has been seen for at least
        ``young_fill_ratio`` of the time it still needs (a staircase: twice that). A staircase's
        fill is judged at the slow end of its range (:func:`_stairs_spread`): a few irregular steps
        (NCCL's set-up) say little about a rate, a leak's regular chunks say much."""
        cfg = ctx.config
        steps, seconds = self.runway(ctx, self.source_for(ctx), trend.slope)
        per_step = ctx.pyramid.seconds_per_step()
        if seconds is None or steps is None or not per_step:
            return False
        slowest = seconds
        if trend.stairs is not None and steps:
            slowest = seconds / (1.0 - _stairs_spread(trend.stairs, steps))
        if slowest > cfg.warmup_leak_horizons * cfg.warmup_horizon_s:
            return False
        # a staircase's steps come when they come (NCCL's set-up, compile records: a handful, then
        # none): seen for as long as it still needs, twice a steady rise's share
        ratio = cfg.young_fill_ratio * (2.0 if trend.cadence else 1.0)
        return trend.span * per_step >= ratio * seconds

    def fast_fill(self, ctx: Context, s0: float) -> Trend | None:
        """A young process's rise since ``s0`` judged by its rate against the time left to fill the
        card: steady (thirds agreeing within ``warmup_half_ratio``, no jump over a quarter of the
        rise: a warm-up that slows down, compile or NCCL steps fail), filling the card within the
        warm-up allowance (``warmup_leak_horizons`` horizons: it would die before any verdict by
        age), and gone on for at least ``young_fill_ratio`` of the time it still needs. Whatever
        the age: a fast fill is an alarm."""
        cfg = ctx.config
        trend = ctx.pyramid.trend("floor", s0, cfg.min_blocks * cfg.block_steps, cfg.warmup_half_ratio, ctx.tol,
                                  max_jump=0.25, parts=3)
        return trend if trend is not None and self._fills(ctx, trend) else None

    def slow(self, ctx: Context, plateau: PlateauDetector, block: Block) -> Trend | None:
        """A leak slower than the noise shows up as breaks followed by "plateaus" that are only
        short flat-looking stretches (on a ratcheting level: a staircase of breaks): judge the
        floor since the earliest recent break, on the coarse levels, every fourth block: a steady
        rise from each of the latest four, a staircase from the earliest of the latest eight (its
        cadence needs steps) or of the latest four."""
        if ctx.pyramid.coarse_pending or not plateau.break_onsets:
            return None
        onsets = plateau.break_onsets
        ratio, parts = ctx.leak_shape
        min_span = 4 * ctx.min_span()
        for s0 in sorted(onsets[-4:]):
            trend = ctx.pyramid.trend("floor", s0, min_span, ratio, ctx.tol, max_jump=0.35, parts=parts)
            if trend and self._device_young(ctx, trend):
                trend = self.young(ctx, s0, trend)
            if trend and not plateau.warming_up(ctx, block, trend.slope):
                plateau.rising_since = s0
                return trend
        # a staircase window (ring_blocks points) changes when it gains a point: read it no more often
        point = (block.end - onsets[0]) / ctx.config.ring_blocks
        if not ctx.pyramid.ratchet_floor or block.end - self.stairs_read < point:
            return None
        self.stairs_read = block.end
        for s0 in sorted({onsets[0], onsets[-4:][0]}):  # the most steps; the latest four breaks
            trend = staircase(ctx.pyramid, "floor", s0, min_span, ctx.tol)
            if trend and self._device_young(ctx, trend):
                trend = self.young(ctx, s0, trend)
            if trend and not plateau.warming_up(ctx, block, trend.slope):
                plateau.rising_since = s0
                return trend
        return None

    def never_settled(self, ctx: Context, age: int, block: Block) -> Trend | None:
        """A series that never settled leaks only if it keeps rising long past any warm-up:
        once the process has run ``warmup_leak_horizons`` warm-up horizons of wall time, the
        floor since the later of the first horizon and a quarter of its life rises in a
        straight line (three slopes within 20 %) or, on a ratcheting level, in a staircase. A
        warm-up, however long, keeps decelerating; steps are not the clock here (dcgm's step is
        a second, nvidia-smi's a row)."""
        if not ctx.past_horizon(block, ctx.config.warmup_leak_horizons):
            if ctx.signal != "device_used":
                return None
            latest = block.end - ctx.config.min_blocks * ctx.config.block_steps  # the latest 8 blocks
            for s0 in sorted({ctx.pyramid.start + age // 2, max(ctx.pyramid.start, latest)}):
                trend = self.fast_fill(ctx, s0)
                if trend is not None:
                    return trend
            return None
        assert ctx.horizon_step is not None
        start = max(ctx.pyramid.start + age // 4, ctx.horizon_step)
        return self.rise(ctx, start, ctx.config.min_blocks * ctx.config.block_steps, max_jump=0.25,
                         shape=(ctx.config.warmup_half_ratio, 3))

    # ------------------------------------------------------------------ runway
    @staticmethod
    def runway(ctx: Context, source: str, slope: float) -> tuple[int | None, float | None]:
        """Steps and seconds until the highest demand to come meets the device's capacity.

        Allocator leak: room = capacity - memory outside the allocator - the highest demand,
        the recent training peak or, when higher, the floor plus how far a marked phase reached
        above it last time (a checkpoint needing more than any batch is where a leaking rank
        dies). Without a measured peak the demand is the floor itself. Outside leak: room =
        capacity - device used.
        """
        last = ctx.last
        if slope <= 0 or last is None:
            return None, None
        total = last["total_bytes"]
        latest = ctx.pyramid.last
        if source == OUTSIDE:
            # what is left of the device (nvidia-smi's free): the step-boundary headroom
            room = verdicts.headroom_bytes(
                total, reserved=last.get("reserved_bytes"), nvml_used=last.get("nvml_used_bytes")
            ) or 0
        else:
            # not the headroom: cached-but-free reserved memory is handed back before an OOM, so
            # the demand (peak) meets capacity - outside, whatever reserved holds
            peaks = [p for p in (ctx.pyramid.recent_peak(), last.get("peak_allocated_bytes")) if p is not None]
            floor = latest.floor if latest is not None else 0.0
            if latest is not None:
                # a rising block's minimum is its first reading: the level now is a block's rise higher
                floor += slope * (latest.end - latest.start)
            need = max(peaks) if peaks else floor
            if ctx.phase_reach is not None and latest is not None:
                need = max(need, floor + ctx.phase_reach)
            room = total - ctx.outside_now() - need
        steps = max(0, int(room / slope))
        return steps, steps * LeakDetector.per_step(ctx)

    @staticmethod
    def per_step(ctx: Context) -> float:
        """Wall seconds per step: observed, else the sample's own step time, else 0."""
        per_step = ctx.pyramid.seconds_per_step()
        if per_step is None:
            per_step = float((ctx.last or {}).get("step_time_s") or 0.0)
        return per_step

    # ------------------------------------------------------------------ start / follow
    def _forecast(self, ctx: Context, leak: LeakState, refit: bool = False) -> None:
        """Steps and seconds to OOM at the leak's forecast rate (``forecast.py``: a staircase's
        envelope, a ratcheting level's slope with another process's moves out, else the slope), and
        the seconds' range. A steady rise's range: the runway at its faster and its slower part. A
        staircase's: an 80 % interval (:func:`_stairs_spread`, read again on ``refit``: every fourth
        block), and one cadence either way (it meets the card at one of its steps, not in between)."""
        stairs, latest = leak.stairs, ctx.pyramid.last
        if stairs is not None and latest is not None:
            rate = stairs.rate(latest.end, latest.floor)
        else:
            rate = leak.rate or leak.slope
        leak.steps, leak.seconds = steps, seconds = self.runway(ctx, leak.source, rate)
        if seconds is None or steps is None:
            leak.seconds_range = None
        elif stairs is not None:
            if refit:
                leak.stairs_u = _stairs_spread(stairs, steps)
            u = leak.stairs_u
            pad = stairs.cadence * seconds / steps if steps else 0.0
            leak.seconds_range = (max(0.0, seconds / (1.0 + u) - pad), seconds / (1.0 - u) + pad)
        elif leak.spread != (1.0, 1.0):
            low, high = leak.spread
            leak.seconds_range = (seconds / high, seconds / low)
        else:
            leak.seconds_range = None

    def start(self, ctx: Context, step: int, source: str, trend: Trend, onset: int) -> LeakEvent:
        spread = (1.0, 1.0)
        if trend.slope > 0 and 0 < trend.slope_low <= trend.slope <= trend.slope_high:
            spread = (trend.slope_low / trend.slope, trend.slope_high / trend.slope)
        leak = self.current = LeakState(source, trend.slope, onset, step, cadence=trend.cadence, spread=spread,
                                        rate=trend.rate, stairs=trend.stairs)
        self._forecast(ctx, leak, refit=True)
        steps, seconds = leak.steps, leak.seconds
        low_high = leak.seconds_range
        plateau = ctx.plateau
        if plateau is not None and plateau.until_step is None:
            plateau.until_step = onset  # the plateau the leak grew from ends where it began
        return LeakEvent(
            step=step,
            onset_step=onset,
            slope_bytes_per_step=round(trend.slope, 1),
            steps_to_oom=steps,
            seconds_to_oom=None if seconds is None else round(seconds, 1),
            source=source,
            leak_onset_step=onset,
            plateau_bytes=ctx.plateau_bytes(),
            plateau_since_step=None if plateau is None else plateau.since_step,
            signal=ctx.signal,
            cadence_steps=round(trend.cadence) if trend.cadence else None,
            seconds_to_oom_low=None if low_high is None else round(low_high[0], 1),
            seconds_to_oom_high=None if low_high is None else round(low_high[1], 1),
        )

    def follow(self, ctx: Context, block: Block) -> Ended | None:
        """Update slope and runway; the settling window when the leak has ended, else None.

        A sawtooth's clear ends a leak called on its first ramp (that memory was a cache); a
        leak ends when the floor is flat over a window long enough to have seen its own rise,
        and a staircase's over two of its gaps (between its steps it is flat by nature). A
        staircase's slope is its net rise since the onset over the time (Theil-Sen reads a
        staircase of rare steps as flat).
        """
        leak = self.current
        assert leak is not None
        pyramid = ctx.pyramid
        min_span = ctx.min_span()
        if pyramid.saw_drops and pyramid.saw_drops[-1] == block.start and leak.source != OUTSIDE:
            return Ended(min_span, judged=False)
        if pyramid.coarse_pending:
            self._forecast(ctx, leak)
            return None  # the slope moves slowly: re-fit every fourth block
        xs, ys, _ = pyramid.window(leak.signal, leak.onset)
        if len(xs) >= 4:
            leak.slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if leak.cadence else theil_sen(xs, ys)
            self._refit(ctx, leak, xs, ys)
        window = max(min_span, 2 * ctx.tol / leak.slope if leak.slope > 0 else min_span, 2 * leak.cadence)
        if block.end - leak.onset >= 2 * window and pyramid.flat(leak.signal, block.end - window, window, ctx.tol):
            return Ended(window, judged=True)
        self._forecast(ctx, leak, refit=True)
        return None

    @staticmethod
    def _refit(ctx: Context, leak: LeakState, xs: list[float], ys: list[float]) -> None:
        """The forecast's rate again, on the window since the onset (every fourth block): a
        staircase's steps once the level has taken a new one (half a step above where their window
        ended; kept when the window no longer shows two of them), a ratcheting level's slope with
        another process's moves out."""
        stairs, latest, cfg = leak.stairs, ctx.pyramid.last, ctx.config
        if stairs is not None:
            # a new step, once its window can show it: a point later (ring_blocks points since the onset)
            if latest is not None and stairs.stepped(latest.floor) and latest.end - stairs.end >= max(
                    cfg.block_steps, (latest.end - leak.onset) / cfg.ring_blocks):
                leak.stairs = stairs_since(ctx.pyramid, "floor", leak.onset, ctx.tol) or stairs
        elif ctx.pyramid.ratchet_floor and leak.source != OUTSIDE:
            leak.rate = max(0.0, steady_rate(cfg, xs, ys, ctx.tol))


#: the 80 % two-sided normal quantile
_Z80 = 1.2816


def _stairs_spread(stairs: Stairs, steps: int) -> float:
    """A staircase forecast's relative uncertainty (at most 0.8): its mean rate's from the gaps and
    sizes seen (Student's t on their spread over the root of the count), with the spread of the
    steps still to come (``steps`` ahead at its cadence)."""
    ahead = max(1.0, steps / stairs.cadence) if stairs.cadence > 0 else 1.0
    return min(0.8, stairs.spread * math.hypot(_t80(stairs.gaps - 1) / math.sqrt(stairs.gaps),
                                               _Z80 / math.sqrt(ahead)))


def _t80(dof: int) -> float:
    """Student's t 80 % two-sided quantile (Cornish-Fisher to the second order; 3.08 at one degree
    of freedom, where that expansion is short)."""
    if dof <= 1:
        return 3.078
    z = _Z80
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
