"""Spike detector: marked phases (checkpoint, eval, ...) and unmarked periodic spikes.

Every phase sample raises a ``*_spike`` event with its peak, how it compares with the
plateau and with the typical training peak, and the headroom at that peak
(``verdicts.headroom_bytes``, the same formula as the step-boundary headroom, so the two
are comparable). A phase below the training peak is a non-event and the event says so
(``below_training_peak``). Unmarked spikes: the biggest normal batch is learnt from each
block's runner-up peak above the floor; four spikes on a common grid make a rhythm,
reported once per period: they need ``peak_allocated_bytes`` and are off without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vramwatch import verdicts
from vramwatch.engine.blocks import Block, keep_last
from vramwatch.engine.context import SIGNAL_FIELDS, Context
from vramwatch.engine.events import SpikeEvent, spike_kind


@dataclass(slots=True)
class CheckpointRecord:
    """Checkpoint peaks of the series (kept across restarts: a checkpoint is the run's)."""

    peak: int | None = None  # latest
    peak_max: int | None = None  # highest
    headroom: int | None = None  # at the latest
    step: int | None = None
    count: int = 0  # checkpoint phases seen (monotonic: /metrics' vramwatch_checkpoints_total)


@dataclass(slots=True)
class SpikeDetector:
    threshold: float = math.inf  # peak above the floor that counts as an unmarked spike
    normal_high: float = 0.0  # the biggest normal batch above the floor
    spikes: list[int] = field(default_factory=list)  # steps of the latest 10 unmarked spikes
    period: int = 0  # the rhythm already reported
    # phase -> peak above the floor, latest; made at the first marked phase (most series never have one)
    phase_reach: dict[str, float] | None = None
    checkpoint: CheckpointRecord = field(default_factory=CheckpointRecord)

    def reset(self) -> None:
        """A new process: forget what was learnt about its batches, keep the checkpoint record."""
        self.threshold = math.inf
        self.normal_high = 0.0
        self.spikes.clear()
        self.period = 0
        self.phase_reach = None

    def learn(self, ctx: Context, blocks: list[Block]) -> None:
        """The biggest normal batch: each block's runner-up peak (a lone spike is only ever a
        block's top), measured above the floor; it keeps learning while on the plateau."""
        highs = [b.peak2 - b.floor for b in blocks if b.peak2 is not None]
        if highs:
            self.normal_high = max(highs)
            self.threshold = self.normal_high + ctx.config.spike_margin_frac * ctx.total

    def on_block(self, ctx: Context, block: Block) -> None:
        if block.peak2 is not None and block.peak2 - block.floor > self.normal_high:
            self.normal_high = block.peak2 - block.floor
            self.threshold = self.normal_high + ctx.config.spike_margin_frac * ctx.total

    def _event(self, ctx: Context, kind: str, step: int, phase: str | None, peak: int | None,
               headroom: int | None, period: int | None = None) -> SpikeEvent:
        plateau = ctx.plateau_bytes()
        train_peak = ctx.training_peak()
        above_train = None if train_peak is None or peak is None else int(peak - train_peak)
        return SpikeEvent(
            kind=kind,
            step=step,
            phase=phase,
            peak_bytes=peak,
            above_plateau_bytes=None if plateau is None or peak is None else int(peak - plateau),
            headroom_bytes=headroom,
            plateau_bytes=plateau,
            training_peak_bytes=None if train_peak is None else int(train_peak),
            above_training_peak_bytes=above_train,
            below_training_peak=above_train is not None and above_train <= 0,
            period_steps=period,
        )

    def phase_sample(self, ctx: Context, sample: dict[str, Any]) -> SpikeEvent:
        """The event for one phase sample (a phase is a fact even when its peak is not
        measured: then the peak and what derives from it are null)."""
        peak = sample.get("peak_allocated_bytes")
        phase = sample["phase"]
        headroom = verdicts.sample_headroom(sample)
        kind = spike_kind(phase)
        event = self._event(ctx, kind, sample["step"], phase, peak, headroom)
        if kind == "checkpoint_spike":
            record = self.checkpoint
            record.peak, record.headroom, record.step = peak, headroom, sample["step"]
            record.count += 1
            if peak is not None:
                record.peak_max = peak if record.peak_max is None else max(record.peak_max, peak)
        last = ctx.last
        level = None if last is None else last.get(SIGNAL_FIELDS[ctx.signal])
        reach = self.phase_reach
        if peak is not None and level is not None and (reach is None or phase in reach or len(reach) < 16):
            # how far this phase reaches above the floor: a leak lifts it too, and a phase that
            # reaches higher than any batch is where the OOM will happen
            if reach is None:
                reach = self.phase_reach = {}
            reach[phase] = peak - level
            ctx.phase_reach = max(reach.values())
        return event

    def unmarked(self, ctx: Context, sample: dict[str, Any], on_plateau: bool) -> SpikeEvent | None:
        """A train sample whose peak exceeded the threshold: a periodic_spike once four line up."""
        step = sample["step"]
        spikes = self.spikes
        if spikes and step - spikes[-1] < ctx.config.block_steps // 2:
            return None  # one spike, several samples
        keep_last(spikes, step, 10)
        if len(spikes) < 4 or not on_plateau:
            return None
        period = rhythm(spikes)
        if not period:
            return None
        if self.period and abs(period - self.period) <= 0.1 * self.period:
            return None  # already reported this rhythm
        self.period = period
        peak = sample["peak_allocated_bytes"]
        headroom = verdicts.sample_headroom(sample)
        return self._event(ctx, "periodic_spike", step, None, peak, headroom, period)


def rhythm(spikes: list[int]) -> int:
    """A period p such that the newest spike and three earlier ones sit on a p-grid (0: none).

    Chance exceedances of a noisy peak come at random gaps and almost never line up four in
    a row; a stray one in between does not hide a real rhythm.
    """
    newest = spikes[-1]
    earlier = list(spikes)[:-1]
    for previous in reversed(earlier):
        period = newest - previous
        if period <= 0:
            continue
        slack = max(2.0, 0.03 * period)
        hits = sum(1 for k in (1, 2, 3) if any(abs(newest - k * period - t) <= slack for t in earlier))
        strays = sum(1 for t in earlier if t >= newest - 3 * period - slack) - 3
        if hits == 3 and strays <= 1:
            return period
    return 0
