"""TrendEngine: online per-series verdicts on GPU memory (see docs/engine.md for the why).

Per sample the engine only folds the sample into the open block (a handful of min/max
updates on the fields the sample measures). Every ``block_steps`` steps the block closes
into the pyramid (``blocks.py``) and the state machine (:meth:`TrendEngine._evaluate`)
asks the detectors, each in its own module with its state as a dataclass:

- ``plateau.py``: warm-up -> plateau, the plateau break, the re-level after a phase's
  ratchet, the new plateau after a rise;
- ``leak.py``: a significant, material, linear, gradual rise of the floor; its runway;
- ``outside.py``: the same on device used - reserved;
- ``fragmentation.py``: reserved - allocated and split blocks growing, floor flat;
- ``spikes.py``: marked phases' peaks and unmarked periodic spikes.

Events are typed (``events.py``) and handed out as their ``to_dict()``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from vramwatch import verdicts
from vramwatch.engine.blocks import Block, Pyramid, Trend
from vramwatch.engine.config import EngineConfig
from vramwatch.engine.context import Context, choose_signal
from vramwatch.engine.events import (
    FRAGMENTATION_ADVICE,
    Event,
    OomEvent,
    PlateauBreakEvent,
    PlateauEvent,
    RestartEvent,
    SuspectedOomEvent,
)
from vramwatch.engine.fragmentation import FragmentationDetector
from vramwatch.engine.leak import OUTSIDE, LeakDetector
from vramwatch.engine.outside import OutsideLeakDetector
from vramwatch.engine.plateau import Break, PlateauDetector
from vramwatch.engine.spikes import SpikeDetector
from vramwatch.engine.summary import Summary, detectors_off

STATES = verdicts.STATES

_INF = math.inf
#: a restarted process re-finds its rank's leak at this share of the previous slope or more
INHERITED_SLOPE_FRAC = 0.5
_NOT_STARTED = object()


#: the configuration of every engine built without one (read only)
_DEFAULT_CONFIG = EngineConfig()

class TrendEngine:
    """Online verdicts for one series (run, host, rank). Feed samples in arrival order.

    ``update`` costs a few dictionary reads and comparisons per sample; once per block
    (32 steps) the detectors run on at most 16 points each (tens of microseconds). Memory is
    bounded by the pyramid (8 x 48 blocks) and ``max_events``, whatever the run length; what is
    bounded is allocated as it fills (the pyramid's levels, the event ring): a series that has
    not closed a block holds ~1.7 KB.
    """

    __slots__ = (
        "_as_sample", "_b_floor", "_b_outside", "_b_peak", "_b_peak2", "_b_resv", "_b_slack", "_b_split",
        "_blk_end", "_blk_start", "_events", "_incarnation", "_inherited", "_last",
        "_last_step", "_ooms", "_retries", "_signal",
        "_spike_threshold", "_started", "_total", "config", "ctx", "fragmentation", "last_break_cause", "leak",
        "out_of_order", "outside", "plateau", "plateau_breaks", "plateau_relevels", "samples", "spikes", "state",
    )

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or _DEFAULT_CONFIG  # shared: nothing writes a config, and one per series costs ~1 KB
        self._events: deque[dict[str, Any]] | None = None  # created with the first event
        self.state = "warmup"
        self.plateau_breaks = 0
        self.plateau_relevels = 0
        self.last_break_cause: str | None = None
        self.samples = 0
        self.out_of_order = 0
        self.spikes = SpikeDetector()  # kept across restarts for its checkpoint record
        self._last: Any = None  # latest folded train sample: a dict, or a struct until _last_sample()
        self._as_sample: Callable[[Any], dict[str, Any]] | None = None  # update_struct's converter
        self._incarnation: Any = _NOT_STARTED  # differs from any sample's: the first one is admitted
        self._started = False
        self._ooms: int | None = None
        self._retries: int | None = None
        self._total = 0
        #: the previous process's leak (slope, source): the baseline a restart is judged against
        self._inherited: tuple[float, str] | None = None
        self._reset_series(0, "allocated", 0.0)

    @property
    def events(self) -> deque[dict[str, Any]] | tuple[()]:
        """The latest ``config.max_events`` events (oldest first)."""
        return () if self._events is None else self._events

    @property
    def signal(self) -> str:
        """The level judged for this process: allocated | reserved | device_used."""
        return self.ctx.signal

    # ------------------------------------------------------------------ process lifecycle
    def _reset_series(self, step: int, signal: str, ts: float) -> None:
        """A new process (first sample or restart): warm-up again, fresh detectors."""
        cfg = self.config
        pyramid = Pyramid(cfg, step, ratchet_floor=signal != "allocated")
        self.ctx = Context(cfg, pyramid, signal, total=self._total, last=self._last_sample(), start_ts=ts)
        self.plateau = PlateauDetector(rising_since=step)
        self.plateau.floor_cusum.reset(step)
        self.leak = LeakDetector()
        self.outside = OutsideLeakDetector()
        self.outside.reset(step)
        self.fragmentation = FragmentationDetector()
        self.fragmentation.reset(step)
        self.spikes.reset()
        self._signal = signal  # read per sample: one attribute, not two
        self._spike_threshold = self.spikes.threshold  # mirrors spikes.threshold (synced where it changes)
        self._last_step = -1
        self._blk_start = step
        self._blk_end = step  # the first sample opens a block
        self._open_block()
        self.state = "warmup"

    def _open_block(self) -> None:
        self._b_floor = self._b_outside = self._b_slack = self._b_split = _INF
        self._b_resv = self._b_peak = self._b_peak2 = -1  # -1: not measured in this block (yet)

    def _emit(self, event: Event, out: list[dict[str, Any]]) -> None:
        record = event.to_dict()
        if self._events is None:
            self._events = deque(maxlen=self.config.max_events)
        self._events.append(record)
        out.append(record)

    def _last_sample(self) -> dict[str, Any] | None:
        """The latest folded train sample as a dict: one kept in its decoded form by
        :meth:`update_struct` is converted here, once (at most once per block)."""
        last = self._last
        if last is not None and not isinstance(last, Mapping):
            assert self._as_sample is not None
            last = self._last = self._as_sample(last)
        return last

    def last_sample(self) -> dict[str, Any] | None:
        """The latest folded train sample (a reader's copy is its own business: do not mutate it)."""
        return self._last_sample()

    # ------------------------------------------------------------------ feed
    def update(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold one validated sample in; return the events it raised (usually none).

        Fields other than run/host/rank/step/ts/phase may be absent or None (not measured).
        """
        self.samples += 1
        out: list[dict[str, Any]] = []
        try:  # subscripts are cheaper than .get; a sample lacking a field takes the except
            step = sample["step"]
            ooms, retries = sample["ooms"], sample["alloc_retries"]
            allocated, reserved = sample["allocated_bytes"], sample["reserved_bytes"]
            peak, split = sample["peak_allocated_bytes"], sample["inactive_split_bytes"]
            used = sample["nvml_used_bytes"]
        except KeyError:
            get = sample.get
            step = sample["step"]
            ooms, retries = get("ooms"), get("alloc_retries")
            allocated, reserved = get("allocated_bytes"), get("reserved_bytes")
            peak, split, used = get("peak_allocated_bytes"), get("inactive_split_bytes"), get("nvml_used_bytes")
        # the common case (a train step of the same process, counters unchanged) skips to
        # folding; anything else goes through the bookkeeping first
        if (
            step < self._last_step
            or ooms != self._ooms
            or retries != self._retries
            or sample["phase"] != "train"
            or sample.get("incarnation") != self._incarnation
        ) and not self._admit(sample, step, out):
            return out
        return self._fold(sample, step, allocated, reserved, peak, split, used, out)

    def update_struct(self, s: Any, as_sample: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`update` for a plainly valid schema-1 sample still in its decoded form
        (:func:`vramwatch.wire.decode_line` with ``lazy``: one attribute per field, ``msgspec.UNSET``
        when absent); ``as_sample(s)`` is the dict :meth:`update` would have been given.

        Same events, verdicts and summary as ``update(as_sample(s))``, without building the dict
        for the common sample (a train step of the same process, counters unchanged): its
        numbers are folded from the attributes, and the struct becomes a dict only if the engine
        still holds it at the next block close (1 in ``block_steps``). Any other sample is
        converted first and takes :meth:`update`.
        """
        step = s.step
        incarnation = s.incarnation
        if (
            step < self._last_step
            or s.ooms != self._ooms
            or s.alloc_retries != self._retries
            or s.phase != "train"
            or (incarnation if type(incarnation) is str else None) != self._incarnation  # UNSET: absent
        ):
            return self.update(as_sample(s))
        self.samples += 1
        self._as_sample = as_sample
        return self._fold(s, step, s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes,
                          s.inactive_split_bytes, s.nvml_used_bytes, [])

    def _fold(self, sample: Any, step: int, allocated: int | None, reserved: int | None, peak: int | None,
              split: int | None, used: int | None, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Fold an admitted train sample's numbers into the open block (closing it when the
        step left it); ``sample`` (a dict, or a struct from :meth:`update_struct`) becomes the latest."""
        signal = self._signal
        level = allocated if signal == "allocated" else reserved if signal == "reserved" else used
        if level is None:
            return out  # the judged level is not measured in this sample: nothing to fold
        if step >= self._blk_end:
            if self._b_floor != _INF:
                self._close_block(step, out)
            span = self.config.block_steps
            self._blk_start = step - (step - self.ctx.pyramid.start) % span
            self._blk_end = self._blk_start + span
        self._last_step = step
        self._last = sample
        if level < self._b_floor:
            self._b_floor = level
        if reserved is not None:
            if reserved > self._b_resv:
                self._b_resv = reserved
            if allocated is not None and reserved - allocated < self._b_slack:
                self._b_slack = reserved - allocated
            if used is not None and used - reserved < self._b_outside:
                self._b_outside = used - reserved
        if peak is not None:
            if peak > self._b_peak:
                self._b_peak2 = self._b_peak
                self._b_peak = peak
            elif peak > self._b_peak2:
                self._b_peak2 = peak  # a lone spike is the block's top; the runner-up is a normal batch
            if peak - level > self._spike_threshold:  # judged above the floor, so a leak is no spike
                event = self.spikes.unmarked(self.ctx, self._last_sample(), self.state == "plateau")
                if event is not None:
                    self._emit(event, out)
        if split is not None and split < self._b_split:
            self._b_split = split
        return out

    def _admit(self, sample: dict[str, Any], step: int, out: list[dict[str, Any]]) -> bool:
        """Restarts, OOMs, counters and phase samples; True when the sample is to be folded."""
        ooms = sample.get("ooms")
        retries = sample.get("alloc_retries")
        incarnation = sample.get("incarnation")
        stepped_back = step < self._last_step and sample["phase"] == "train"
        if stepped_back and incarnation is not None and incarnation == self._incarnation:
            last = self._last_sample()
            if last is None or sample["ts"] <= last["ts"]:
                self.out_of_order += 1  # a late (replayed) sample of this process: too old to fold in
                return False
            # newer than anything folded: the same process started its loop over (a notebook cell
            # run again): the step axis restarts, the process does not (no restart event)
            self._reset_series(step, choose_signal(sample), sample["ts"])
            stepped_back = False
        counter_back = (ooms is not None and self._ooms is not None and ooms < self._ooms) or (
            retries is not None and self._retries is not None and retries < self._retries
        )
        if not self._started or incarnation != self._incarnation or counter_back or stepped_back:
            if self._started:
                self._emit(RestartEvent(step, self._last_step, incarnation), out)
                # a restart fixes nothing by itself: the rank's leak is what the new process is
                # judged against until it shows otherwise (kept across restarts until disproved)
                leak = self.leak.current if self.state == "leak" else None
                if leak is not None and leak.source != OUTSIDE:
                    self._inherited = (leak.slope, leak.source)
            self._started = True
            self._incarnation = incarnation
            # the counter is the process's own: one already above zero on its first sample is
            # an OOM it survived before we saw it (caught, batch cut, retried), and counts
            self._ooms = None if ooms is None else 0
            self._reset_series(step, choose_signal(sample), sample["ts"])
        if ooms is not None and self._ooms is not None and ooms > self._ooms:
            self._emit(OomEvent(step, ooms, sample["phase"]), out)
        self._ooms = ooms
        self._retries = retries
        total = sample.get("total_bytes")
        if total:
            self._total = self.ctx.total = total
        if sample["phase"] != "train":
            self._phase_sample(sample, out)
            return False
        return True

    def _phase_sample(self, sample: dict[str, Any], out: list[dict[str, Any]]) -> None:
        ctx = self.ctx
        last = ctx.last = self._last_sample()
        self._emit(self.spikes.phase_sample(ctx, sample), out)
        before = None if last is None else last.get("reserved_bytes")
        self.plateau.note_phase(sample["phase"], sample["step"], before, sample.get("reserved_bytes"), ctx.reserved_tol)

    # ------------------------------------------------------------------ blocks
    def _close_block(self, step: int, out: list[dict[str, Any]]) -> None:
        last = self._last_sample()
        assert last is not None
        floor = self._b_floor
        peak = None if self._b_peak < 0 else self._b_peak
        block = Block(
            self._blk_start,
            self._last_step,
            last["ts"],  # the block's last sample: the current one opens the next block
            floor,
            None if self._b_resv < 0 else self._b_resv,
            peak,
            None if peak is None else max(self._b_peak2, floor),
            None if self._b_outside == _INF else self._b_outside,
            None if self._b_slack == _INF else max(0, self._b_slack),
            None if self._b_split == _INF else self._b_split,
            self._retries,
        )
        self._open_block()
        ctx = self.ctx
        if self._signal == "device_used" and self._vanished(block, out):
            return  # the process is gone: what comes next is a new one, judged from its warm-up
        ctx.last = last
        ctx.pyramid.push(block, ctx.tol or ctx.base_tol)
        ctx.note_horizon(block)
        if self.state == "plateau":
            self.spikes.on_block(ctx, block)
        self._evaluate(step, block, out)
        self._spike_threshold = self.spikes.threshold  # on_block and _set_levels may have moved it

    def _vanished(self, block: Block, out: list[dict[str, Any]]) -> bool:
        """Device used only: the process's memory vanished (the block's floor under ``vanish_frac``
        of the last) with the device near full or at the top of a leak's climb: a suspected
        OOM (a device has no OOM counter). The series starts over as a new process. O(1), per block."""
        cfg = self.config
        before = self.ctx.pyramid.last
        if before is None or block.floor >= cfg.vanish_frac * before.floor:
            return False
        total = self._total or None
        if total is not None and before.floor >= cfg.near_full_frac * total:
            reason = "near_full"
        elif self.state == "leak":
            reason = "top_of_climb"  # a climb followed as a leak (a rise after a break may be anything)
        else:
            return False
        self._emit(SuspectedOomEvent(block.end, int(before.floor), int(block.floor), total, reason, self.state), out)
        self._reset_series(block.end + 1, self._signal, block.ts)
        return True

    # ------------------------------------------------------------------ the state machine
    def _evaluate(self, step: int, block: Block, out: list[dict[str, Any]]) -> None:
        """warmup -> plateau -> (break) rising -> leak | plateau; plateau|rising -> fragmentation."""
        ctx, plateau, leak = self.ctx, self.plateau, self.leak
        if not ctx.tol:
            ctx.tol = ctx.base_tol
        if self.state == "warmup":
            self._judge_warmup(step, block, out)
            return
        assert ctx.plateau is not None
        floor = block.floor
        if ctx.pyramid.saw_period:  # a sawtooth is judged on its troughs
            floor = ctx.pyramid.min_since("floor", block.end - 1.2 * ctx.pyramid.saw_period)
        if self.state == "plateau":
            brk = plateau.check_break(ctx, block, floor)
            if brk is not None:
                self._on_break(step, block, brk, out)
        if self.state == "rising":
            plateau.floor_cusum.step(floor - ctx.plateau.floor, ctx.tol, block)
            trend = leak.in_rise(ctx, plateau, block)
            if trend is not None:
                self._start_leak(step, leak.source_for(ctx), trend, plateau.rising_since, out)
            else:
                window = plateau.settled_after_rise(ctx, block)
                if window is not None:
                    self._new_plateau(step, block, window, out)
        elif self.state == "leak":
            ended = leak.follow(ctx, block)
            if ended is not None:
                if ended.judged:
                    plateau.break_onsets.clear()  # that rise is over and judged: not a slow leak to re-find
                self._new_plateau(step, block, ended.window, out)
        if self.state in ("plateau", "rising"):
            trend = leak.slow(ctx, plateau, block)
            if trend is not None:
                self._start_leak(step, leak.source_for(ctx), trend, plateau.rising_since, out)
        if self.state in ("plateau", "rising"):
            trend = self.outside.check(ctx, block)
            if trend is not None:
                self._start_leak(step, OUTSIDE, trend, self.outside.onset, out)
        if self.state == "fragmentation":
            window = self.fragmentation.ended(ctx, block)
            if window is not None:
                self._new_plateau(step, block, window, out)
        elif self.state in ("plateau", "rising"):
            event = self.fragmentation.check(ctx, block, step, plateau.break_onsets)
            if event is not None:
                self.state = "fragmentation"
                self._emit(event, out)

    def _judge_warmup(self, step: int, block: Block, out: list[dict[str, Any]]) -> None:
        ctx, plateau = self.ctx, self.plateau
        age = block.end - ctx.pyramid.start
        if self._inherited is not None and self._inherited_leak(step, block, age, out):
            return
        if plateau.waiting_for_second_clear(ctx):
            return
        span = plateau.settled(ctx, age)
        if span is not None:
            ctx.first_plateau_age = age
            self._new_plateau(step, block, span, out)
            return
        trend = self.leak.never_settled(ctx, age, block)
        if trend is not None:
            self._set_levels(block, plateau.warmup_span(ctx, age))
            self._start_leak(step, self.leak.source_for(ctx), trend, plateau.rising_since, out)

    def _inherited_leak(self, step: int, block: Block, age: int, out: list[dict[str, Any]]) -> bool:
        """A restarted process of a rank that was leaking: the leak is found again as soon as the
        floor since the restart's first block (the reload) rises in a straight line at no less
        than :data:`INHERITED_SLOPE_FRAC` of the previous process's slope, over the shortest
        window any leak verdict rests on (``min_blocks`` blocks: ~300 steps), instead of after a
        fresh warm-up (hours). A flat floor (the leak was fixed) or a plateau reached clears the
        inheritance. One trend fit per block while it holds, none after."""
        assert self._inherited is not None
        slope, source = self._inherited
        ctx, cfg = self.ctx, self.config
        trend = self.leak.rise(ctx, ctx.pyramid.start + cfg.block_steps, cfg.min_blocks * cfg.block_steps)
        if trend is None or trend.slope < INHERITED_SLOPE_FRAC * slope:
            return False
        self._inherited = None
        self._set_levels(block, self.plateau.warmup_span(ctx, age))
        self._start_leak(step, source if ctx.signal != "device_used" else self.leak.source_for(ctx), trend,
                         ctx.pyramid.start, out)
        return True

    def _on_break(self, step: int, block: Block, brk: Break, out: list[dict[str, Any]]) -> None:
        ctx = self.ctx
        self.plateau_breaks += 1
        self.last_break_cause = brk.cause
        before = ctx.plateau_bytes()
        assert before is not None
        if brk.relevel:
            # a checkpoint/eval ratcheted reserved once: the allocator kept its buffers; the
            # plateau moves there now instead of the rank looking "rising" for hundreds of steps
            self.plateau.relevel(ctx, block)
            self.fragmentation.reset(block.end + 1)
            self.plateau_relevels += 1
        else:
            self.state = "rising"
            self.plateau.begin_rise(brk)
        self._emit(
            PlateauBreakEvent(
                step, brk.onset, brk.cause, before, block.reserved, self._allocated(block.floor),
                relevel=brk.relevel, new_plateau_bytes=ctx.plateau_bytes() if brk.relevel else None,
            ),
            out,
        )

    def _set_levels(self, block: Block, span: float) -> None:
        ctx = self.ctx
        ctx.plateau = self.plateau.levels(ctx, block, span)
        s0 = block.end - span
        self.spikes.learn(ctx, [b for b in ctx.pyramid.blocks if b.start >= s0] or [block])

    def _new_plateau(self, step: int, block: Block, span: float, out: list[dict[str, Any]]) -> None:
        ctx = self.ctx
        self._inherited = None  # settled: the restart did not carry the leak over
        self._set_levels(block, span)
        levels = ctx.plateau
        assert levels is not None
        self.state = "plateau"
        self.leak.current = None
        self.fragmentation.current = None
        self.plateau.start(ctx, block)
        self.outside.reset(block.end + 1)
        self.fragmentation.reset(block.end + 1)
        last = self._last_sample() or {}
        self._emit(
            PlateauEvent(
                step=step,
                plateau_bytes=levels.level_bytes(),
                allocated_bytes=self._allocated(levels.floor),
                floor_bytes=int(levels.floor),
                peak_bytes=None if levels.peak is None else int(levels.peak),
                headroom_bytes=_step_headroom(last, ctx.total),
                since_step=levels.since_step,
                signal=ctx.signal,
            ),
            out,
        )

    def _start_leak(self, step: int, source: str, trend: Trend, onset: int, out: list[dict[str, Any]]) -> None:
        self._emit(self.leak.start(self.ctx, step, source, trend, onset), out)
        self.state = "leak"

    def _allocated(self, floor: float) -> int | None:
        """The floor as ``allocated_bytes`` only when allocated is what it measures."""
        return int(floor) if self.ctx.signal == "allocated" else None

    # ------------------------------------------------------------------ read-out
    def summary(self) -> Summary:
        """The verdict now (O(1): no estimator runs here)."""
        last = self._last_sample() or {}
        total = last.get("total_bytes", self._total) or None
        leak = self.leak.current if self.state == "leak" else None
        plateau = self.ctx.plateau
        headroom = _step_headroom(last, total)
        record = self.spikes.checkpoint
        known = [h for h in (headroom, record.headroom) if h is not None]
        return Summary(
            state=self.state,
            step=last.get("step"),
            ts=last.get("ts"),
            signal=self.ctx.signal,
            detectors_off=detectors_off(self._last_sample()),
            plateau_bytes=None if plateau is None else plateau.level_bytes(),
            plateau_since_step=None if plateau is None else plateau.since_step,
            plateau_until_step=None if plateau is None else plateau.until_step,
            plateau_breaks=self.plateau_breaks,
            plateau_relevels=self.plateau_relevels,
            plateau_break_cause=self.last_break_cause,
            headroom_bytes=headroom,
            checkpoint_headroom_bytes=record.headroom,
            worst_headroom_bytes=min(known) if known else None,
            checkpoint_peak_bytes=record.peak,
            checkpoint_peak_max_bytes=record.peak_max,
            checkpoints=record.count,
            slope_bytes_per_step=round(leak.slope, 1) if leak else None,
            steps_to_oom=leak.steps if leak else None,
            seconds_to_oom=round(leak.seconds, 1) if leak and leak.seconds is not None else None,
            seconds_to_oom_low=round(leak.seconds_range[0], 1) if leak and leak.seconds_range else None,
            seconds_to_oom_high=round(leak.seconds_range[1], 1) if leak and leak.seconds_range else None,
            leak_source=leak.source if leak else None,
            leak_onset_step=leak.onset if leak else None,
            leak_detected_step=leak.detected_step if leak else None,
            fragmentation=self.state == "fragmentation",
            outside_allocator_bytes=verdicts.outside_allocator_bytes(
                last.get("reserved_bytes"), last.get("nvml_used_bytes")
            ),
            total_bytes=total,
            samples=self.samples,
        )


def _step_headroom(sample: dict[str, Any], total: int | None) -> int | None:
    """verdicts.headroom_bytes at a training step boundary (the sample's own numbers)."""
    return verdicts.sample_headroom(sample, total)


__all__ = ["FRAGMENTATION_ADVICE", "STATES", "EngineConfig", "TrendEngine"]
