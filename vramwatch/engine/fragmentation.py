"""Fragmentation detector: cached-but-unusable memory grows while the allocated floor is flat.

Reserved - allocated rising (its own CUSUM) by at least 1 % of the device, with a steady
rise of it or of inactive split bytes, and either split blocks carrying a quarter of the
growth or the allocator already retrying. Needs allocated, reserved and inactive split
bytes; off (and saying so in ``summary()["detectors_off"]``) without them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vramwatch.engine.blocks import Block
from vramwatch.engine.context import Context, Cusum
from vramwatch.engine.events import FragmentationEvent


@dataclass(slots=True)
class FragmentationState:
    slope: float  # growth of reserved - allocated (or split) per step
    onset: int


@dataclass(slots=True)
class FragmentationDetector:
    cusum: Cusum = field(default_factory=Cusum)
    current: FragmentationState | None = None

    def reset(self, onset: int) -> None:
        self.cusum.reset(onset)

    def ended(self, ctx: Context, block: Block) -> float | None:
        """While fragmenting: the settling window once neither kind of waste moved and no retry
        happened for long enough to have seen it grow; else None."""
        frag = self.current
        assert frag is not None
        slope = max(frag.slope, 1.0)
        window = max(ctx.min_span(), 2 * ctx.reserved_tol / slope)
        if block.end - frag.onset < 2 * window:
            return None
        s0 = block.end - window
        pyramid = ctx.pyramid
        if (
            pyramid.flat("slack", s0, window, ctx.tol)
            and pyramid.flat("split", s0, window, ctx.tol)
            and pyramid.value_at("retries", s0) == block.retries
        ):
            self.current = None
            return window
        return None

    def check(self, ctx: Context, block: Block, step: int, break_onsets: Iterable[int]) -> FragmentationEvent | None:
        """Fragmentation starting at this block (the CUSUM runs on every block), or None."""
        plateau = ctx.plateau
        if plateau is None or plateau.slack is None or block.slack is None or block.split is None:
            return None
        if not self.cusum.step(block.slack - plateau.slack, ctx.tol, block):
            return None
        growth = block.slack - plateau.slack
        if growth < ctx.reserved_tol:
            return None
        pyramid = ctx.pyramid
        min_span, half = ctx.min_span(), ctx.config.half_ratio
        onset = self.cusum.onset
        if pyramid.trend("floor", onset, min_span, half, ctx.tol):
            return None  # the allocated floor rises too: a leak, not fragmentation
        trend = None
        for s0 in sorted({onset, *break_onsets, int(0.5 * (onset + block.end))}):
            if s0 < onset:
                continue
            # reserved grows in ratchets, so the slack is a staircase; split blocks creep
            trend = pyramid.trend("slack", s0, min_span, half, ctx.tol, max_jump=1.0) or pyramid.trend(
                "split", s0, min_span, half, ctx.tol
            )
            if trend:
                onset = s0
                break
        first_retries = pyramid.value_at("retries", onset)
        retries_up = block.retries is not None and first_retries is not None and block.retries > first_retries
        split_before = pyramid.value_at("split", onset) or 0
        # cached-but-unusable memory: split blocks piling up, or the allocator already retrying
        if not retries_up and (trend is None or block.split - split_before < 0.25 * growth):
            return None
        slope = trend.slope if trend else 0.0
        self.current = FragmentationState(slope, onset)
        last = ctx.last or {}
        return FragmentationEvent(
            step=step,
            onset_step=onset,
            reserved_bytes=last.get("reserved_bytes", block.reserved),
            allocated_bytes=last.get("allocated_bytes", block.floor),
            reserved_minus_allocated_bytes=int(block.slack),
            growth_bytes=int(growth),
            growth_bytes_per_step=round(slope, 1),
            inactive_split_bytes=last.get("inactive_split_bytes", block.split),
            alloc_retries=block.retries,
            alloc_retries_in_window=(block.retries or 0) - (first_retries or 0),
        )
