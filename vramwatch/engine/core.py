"""TrendEngine: online per-series verdicts on GPU memory (see docs/engine.md for the why).

Per sample the engine only folds the sample into the current block (a handful of
min/max updates). Every ``block_steps`` steps the block is closed and pushed into a
pyramid of rings (level k holds blocks of ``block_steps * 4**k`` steps, ``ring_blocks``
of them), so memory is bounded and any window from a few hundred to a million steps is
at most ``fit_points`` summaries away. The detectors run on those summaries:

- the **floor** (minimum ``allocated`` per block: memory at the step boundary, after the
  step's temporaries are freed) carries the leak verdict, never the noisy per-step peak;
- a one-sided CUSUM against the plateau level finds a plateau break quickly;
- a leak is a break whose growth is significant (Mann-Kendall with Hamed-Rao correction),
  material (against the noise and the device size), linear (Theil-Sen slopes of both
  halves of the window agree, which rejects one-time steps and concave warm-up), and
  longer than any sawtooth period the series has shown (judged on the lower envelope).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from .stats import mann_kendall_z, median, noise_sigma, rolling_min, theil_sen

STATES = ("warmup", "plateau", "rising", "leak", "fragmentation")

FRAGMENTATION_ADVICE = (
    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the allocator grows segments "
    "instead of splitting them"
)

# block layout (lists, for speed): indices
_START, _END, _TS, _FLOOR, _RESV, _PEAK, _OUTSIDE, _SLACK, _SPLIT, _RETRIES, _PEAK2 = range(11)
_INF = math.inf
_NOT_STARTED = object()


@dataclass
class EngineConfig:
    """Knobs of the engine; every size threshold is relative to the device or the noise."""

    block_steps: int = 32  # level-0 block length in steps
    ring_blocks: int = 48  # blocks kept per level
    levels: int = 8  # level k blocks are block_steps * 4**k steps (32 .. 524288)
    fit_points: int = 16  # estimators see at most this many (grouped) points
    min_blocks: int = 8  # fewest points a verdict rests on
    tol_frac: float = 0.001  # smallest material change: this fraction of the device ...
    noise_k: float = 4.0  # ... or this many noise sigmas of the block floor, whichever is larger
    reserved_break_frac: float = 0.01  # a reserved ratchet this large is a plateau break
    mk_z: float = 2.6  # Mann-Kendall significance for a trend
    half_ratio: float = 0.5  # slopes of the two halves must agree within this ratio (linearity)
    warmup_half_ratio: float = 0.8  # stricter while the series never settled (thirds, not halves)
    warmup_span_frac: float = 0.4  # a plateau must be flat over this fraction of the process age
    warmup_leak_min_blocks: int = 128  # a never-settled series is not called a leak before this
    spike_margin_frac: float = 0.015  # an unmarked spike is this far above the training peak
    max_events: int = 256  # events kept (most recent)


class _Level:
    __slots__ = ("blocks", "pending", "span")

    def __init__(self, span: int, ring: int) -> None:
        self.span = span
        self.blocks: deque[list[Any]] = deque(maxlen=ring)
        self.pending: list[list[Any]] = []


def _merge(children: list[list[Any]]) -> list[Any]:
    outside = [c[_OUTSIDE] for c in children if c[_OUTSIDE] is not None]
    return [
        children[0][_START],
        children[-1][_END],
        children[-1][_TS],
        min(c[_FLOOR] for c in children),
        max(c[_RESV] for c in children),
        max(c[_PEAK] for c in children),
        min(outside) if outside else None,
        min(c[_SLACK] for c in children),
        min(c[_SPLIT] for c in children),
        children[-1][_RETRIES],
        max(c[_PEAK2] for c in children),
    ]


class TrendEngine:
    """Online verdicts for one series (run, host, rank). Feed samples in arrival order."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.events: deque[dict[str, Any]] = deque(maxlen=cfg.max_events)
        self.state = "warmup"
        self.plateau_breaks = 0
        self.samples = 0
        self.out_of_order = 0
        self._last: dict[str, Any] | None = None  # latest train sample
        self._incarnation: Any = _NOT_STARTED  # differs from any sample's: the first one is admitted
        self._started = False
        self._ooms = 0
        self._retries = 0
        self._total = 0
        self._checkpoint_peak: int | None = None
        self._checkpoint_headroom: int | None = None
        self._reset_series(0)

    # ------------------------------------------------------------------ state
    def _reset_series(self, step: int) -> None:
        """A new process (first sample or restart): warm-up again, fresh trend state."""
        cfg = self.config
        self._levels = [_Level(cfg.block_steps * 4**k, cfg.ring_blocks) for k in range(cfg.levels)]
        self._inc_start = step
        self._last_step = -1
        self._blk_start = step
        self._blk_end = step  # the first sample opens a block
        self._b_floor = self._b_outside = self._b_slack = self._b_split = _INF
        self._b_resv = self._b_peak = self._b_peak2 = -1  # -1: the block has no sample yet
        self.state = "warmup"
        self._plateau: dict[str, float] | None = None
        self._first_plateau_age: int | None = None
        self._tol = 0.0
        self._cusum = {"floor": 0.0, "outside": 0.0, "slack": 0.0}
        self._cp = {"floor": step, "outside": step, "slack": step}
        self._rising_since = step
        self._break_onsets: deque[int] = deque(maxlen=4)
        self._leak: dict[str, Any] | None = None
        self._frag: dict[str, Any] | None = None
        self._phase_ratchet: str | None = None
        self._phase_bumps: deque[tuple[int, int]] = deque(maxlen=16)  # (step, reserved added by a phase)
        self._phase_above_floor: dict[str, int] = {}
        self._saw_drops: deque[int] = deque(maxlen=6)
        self._saw_period = 0
        self._spike_threshold = _INF
        self._normal_high = 0
        self._spikes: deque[int] = deque(maxlen=10)
        self._periodic_period = 0

    def _emit(self, event: dict[str, Any], out: list[dict[str, Any]]) -> None:
        self.events.append(event)
        out.append(event)

    # ------------------------------------------------------------------ feed
    def update(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold one validated sample in; return the events it raised (usually none)."""
        self.samples += 1
        out: list[dict[str, Any]] = []
        step = sample["step"]
        # the common case (a train step of the same process, counters unchanged) skips to
        # folding; anything else goes through the bookkeeping first
        if (
            step < self._last_step
            or sample["ooms"] != self._ooms
            or sample["alloc_retries"] != self._retries
            or sample["phase"] != "train"
            or sample.get("incarnation") != self._incarnation
        ) and not self._admit(sample, step, out):
            return out
        if step >= self._blk_end:
            if self._b_resv >= 0:
                self._close_block(step, out)
            span = self.config.block_steps
            self._blk_start = step - (step - self._inc_start) % span
            self._blk_end = self._blk_start + span
        self._last_step = step
        self._last = sample
        allocated = sample["allocated_bytes"]
        reserved = sample["reserved_bytes"]
        if allocated < self._b_floor:
            self._b_floor = allocated
        if reserved > self._b_resv:
            self._b_resv = reserved
        peak = sample["peak_allocated_bytes"]
        if peak > self._b_peak:
            self._b_peak2 = self._b_peak
            self._b_peak = peak
        elif peak > self._b_peak2:
            self._b_peak2 = peak  # a lone spike is the block's top; the runner-up is a normal batch
        if peak - allocated > self._spike_threshold:  # judged above the floor, so a leak is no spike
            self._unmarked_spike(step, peak, out)
        slack = reserved - allocated
        if slack < self._b_slack:
            self._b_slack = slack
        split = sample["inactive_split_bytes"]
        if split < self._b_split:
            self._b_split = split
        used = sample["nvml_used_bytes"]
        if used is not None and used - reserved < self._b_outside:
            self._b_outside = used - reserved
        return out

    def _admit(self, sample: dict[str, Any], step: int, out: list[dict[str, Any]]) -> bool:
        """Restarts, OOMs, counters and phase samples; True when the sample is to be folded."""
        ooms = sample["ooms"]
        retries = sample["alloc_retries"]
        incarnation = sample.get("incarnation")
        stepped_back = step < self._last_step and sample["phase"] == "train"
        if stepped_back and incarnation is not None and incarnation == self._incarnation:
            self.out_of_order += 1  # a late (replayed) sample of this process: too old to fold in
            return False
        if (
            not self._started
            or incarnation != self._incarnation
            or ooms < self._ooms
            or retries < self._retries
            or stepped_back
        ):
            if self._started:
                self._emit(
                    {"type": "restart", "step": step, "from_step": self._last_step, "incarnation": incarnation},
                    out,
                )
            self._started = True
            self._incarnation = incarnation
            self._ooms = ooms
            self._reset_series(step)
        if ooms > self._ooms:
            self._emit({"type": "oom", "step": step, "ooms": ooms, "phase": sample["phase"]}, out)
            self._ooms = ooms
        self._retries = retries
        self._total = sample["total_bytes"]
        if sample["phase"] != "train":
            self._phase_sample(sample, out)
            return False
        return True

    # ------------------------------------------------------------------ phases and spikes
    def _outside_now(self) -> int:
        last = self._last
        if last is None or last["nvml_used_bytes"] is None:
            return 0
        return max(0, last["nvml_used_bytes"] - last["reserved_bytes"])

    def _training_peak(self) -> float | None:
        if self._plateau is not None:
            return self._plateau["peak"]
        ring = self._levels[0].blocks
        if ring:
            return max(b[_PEAK] for b in list(ring)[-4:])
        return None

    def _phase_sample(self, sample: dict[str, Any], out: list[dict[str, Any]]) -> None:
        phase = sample["phase"]
        peak = sample["peak_allocated_bytes"]
        used = sample["nvml_used_bytes"]
        outside = max(0, used - sample["reserved_bytes"]) if used is not None else self._outside_now()
        headroom = sample["total_bytes"] - outside - peak
        train_peak = self._training_peak()
        kind = _spike_kind(phase)
        event = {
            "type": kind,
            "step": sample["step"],
            "phase": phase,
            "peak_bytes": peak,
            "above_plateau_bytes": None if train_peak is None else int(peak - train_peak),
            "headroom_bytes": int(headroom),
        }
        self._emit(event, out)
        if kind == "checkpoint_spike":
            self._checkpoint_peak = peak
            self._checkpoint_headroom = int(headroom)
        last = self._last
        if last is not None and (phase in self._phase_above_floor or len(self._phase_above_floor) < 16):
            # how far this phase reaches above the floor: a leak lifts it too, and a phase
            # that reaches higher than any batch is where the OOM will happen
            self._phase_above_floor[phase] = peak - last["allocated_bytes"]
        if last is not None and sample["reserved_bytes"] > last["reserved_bytes"]:
            self._phase_bumps.append((sample["step"], sample["reserved_bytes"] - last["reserved_bytes"]))
            if sample["reserved_bytes"] > last["reserved_bytes"] + self._reserved_tol():
                self._phase_ratchet = phase  # the next reserved break is this phase's doing

    def _unmarked_spike(self, step: int, peak: int, out: list[dict[str, Any]]) -> None:
        spikes = self._spikes
        if spikes and step - spikes[-1] < self.config.block_steps // 2:
            return  # one spike, several samples
        spikes.append(step)
        if len(spikes) < 4 or self.state != "plateau":
            return
        period = self._rhythm(spikes)
        if not period:
            return
        if self._periodic_period and abs(period - self._periodic_period) <= 0.1 * self._periodic_period:
            return  # already reported this rhythm
        self._periodic_period = period
        train_peak = self._training_peak() or peak
        self._emit(
            {
                "type": "periodic_spike",
                "step": step,
                "period_steps": period,
                "peak_bytes": peak,
                "above_plateau_bytes": int(peak - train_peak),
                "headroom_bytes": int(self._total - self._outside_now() - peak),
            },
            out,
        )

    @staticmethod
    def _rhythm(spikes: deque[int]) -> int:
        """A period p such that the newest spike and three earlier ones sit on a p-grid.

        Chance exceedances of a noisy peak come at random gaps and almost never line up
        four in a row; a stray one in between does not hide a real rhythm.
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

    # ------------------------------------------------------------------ blocks
    def _close_block(self, step: int, out: list[dict[str, Any]]) -> None:
        block = [
            self._blk_start,
            self._last_step,
            self._last["ts"],  # the block's last sample: the current one opens the next block
            self._b_floor,
            self._b_resv,
            self._b_peak,
            None if self._b_outside == _INF else self._b_outside,
            max(0, self._b_slack),
            self._b_split,
            self._retries,
            max(self._b_peak2, self._b_floor),
        ]
        self._b_floor = self._b_outside = self._b_slack = self._b_split = _INF
        self._b_resv = self._b_peak = self._b_peak2 = -1
        levels = self._levels
        prev_floor = levels[0].blocks[-1][_FLOOR] if levels[0].blocks else None
        levels[0].blocks.append(block)
        child = block
        for k in range(1, len(levels)):
            pending = levels[k].pending
            pending.append(child)
            if len(pending) < 4:
                break
            child = _merge(pending)
            levels[k].blocks.append(child)
            pending.clear()
        if prev_floor is not None:
            self._watch_drops(prev_floor, block)
        if self.state == "plateau" and block[_PEAK2] - block[_FLOOR] > self._normal_high:
            self._normal_high = block[_PEAK2] - block[_FLOOR]
            self._spike_threshold = self._normal_high + self.config.spike_margin_frac * self._total
        self._evaluate(step, block, out)

    def _watch_drops(self, prev_floor: float, block: list[Any]) -> None:
        """A sawtooth: the floor falls back by more than the material size, repeatedly."""
        tol = self._tol or self.config.tol_frac * self._total
        if prev_floor - block[_FLOOR] > 2 * tol:
            drops = self._saw_drops
            drops.append(block[_START])
            # until a second drop, the time since the process started bounds the period
            marks = [self._inc_start, *drops] if len(drops) == 1 else list(drops)
            self._saw_period = int(max(b - a for a, b in pairwise(marks)))

    def _reserved_tol(self) -> float:
        return self.config.reserved_break_frac * self._total

    # ------------------------------------------------------------------ windows
    def _window(self, index: int, s0: int) -> tuple[list[float], list[float], int]:
        """(x, y, block span) of signal ``index`` for blocks starting at or after ``s0``.

        Uses the finest level that still holds ``s0``; a known sawtooth period turns the
        signal into its trailing minimum over >1 period (the floor after collection);
        more than ``fit_points`` points are grouped by their minimum (every trended signal is
        a floor-like minimum).
        """
        cfg = self.config
        chosen = None
        for level in self._levels:
            ring = level.blocks
            if not ring:
                break
            width = 1
            if self._saw_period and index != _RESV:
                width = math.ceil(1.2 * self._saw_period / level.span) + 1
                if width * 3 > cfg.ring_blocks:
                    continue
            if len(ring) < ring.maxlen or ring[0][_START] <= s0 - (width - 1) * level.span:
                chosen = (level, width)
                break
            chosen = (level, width)
        if chosen is None:
            return [], [], 0
        level, width = chosen
        ring = list(level.blocks)
        values = [b[index] for b in ring]
        if index == _OUTSIDE and any(v is None for v in values):
            return [], [], level.span
        if width > 1:
            values = rolling_min(values, width)
        xs: list[float] = []
        ys: list[float] = []
        for b, v in zip(ring, values, strict=True):
            if b[_START] >= s0:
                xs.append(0.5 * (b[_START] + b[_END]))
                ys.append(v)
        n = len(xs)
        if n > cfg.fit_points:
            group = math.ceil(n / cfg.fit_points)
            gx, gy = [], []
            for i in range(0, n, group):
                gx.append(sum(xs[i : i + group]) / len(xs[i : i + group]))
                gy.append(min(ys[i : i + group]))
            xs, ys = gx, gy
        return xs, ys, level.span

    def _trend(
        self, index: int, s0: int, min_span: float, ratio: float, max_jump: float = 0.5, parts: int = 2
    ) -> dict[str, Any] | None:
        """A significant, material, linear, gradual rise of signal ``index`` since ``s0``, or None.

        ``ratio``: the Theil-Sen slopes of the ``parts`` (halves) must agree within it (a step
        or a settling curve has a flat part). ``max_jump``: no single point-to-point increase may
        carry more than this share of the rise (a staircase of one-time jumps is warm-up, a
        leak creeps).
        """
        cfg = self.config
        xs, ys, block_span = self._window(index, s0)
        n = len(xs)
        if n < cfg.min_blocks:
            return None
        span = xs[-1] - xs[0] + block_span
        if span < min_span - block_span:  # blocks start on their own grid, not at s0
            return None
        if max(ys) - min(ys) < 0.5 * self._tol:
            return None  # cannot hold a material rise: skip the O(n^2) estimators
        slope = theil_sen(xs, ys)
        if slope <= 0 or slope * span < self._tol:
            return None
        cuts = [round(i * (n - 1) / parts) for i in range(parts + 1)]
        slopes = [theil_sen(xs[a : b + 1], ys[a : b + 1]) for a, b in pairwise(cuts)]
        if min(slopes) <= 0 or min(slopes) < ratio * max(slopes):
            return None  # a step, a settling curve or a burst: not a steady rise
        biggest = max(b - a for a, b in pairwise(ys))
        if biggest > max_jump * slope * span:
            return None
        if mann_kendall_z(ys) < cfg.mk_z:
            return None
        return {"slope": slope, "span": span, "n": n, "last": ys[-1]}

    def _flat(self, index: int, s0: int, min_span: float, stretch: float = 0.0) -> bool:
        """Signal ``index`` moved less than the material size since ``s0`` (its Theil-Sen
        slope over the window, or over ``stretch`` steps when longer)."""
        cfg = self.config
        xs, ys, block_span = self._window(index, s0)
        if len(xs) < cfg.min_blocks:
            return False
        span = xs[-1] - xs[0] + block_span
        if span < min_span - block_span:
            return False
        return abs(theil_sen(xs, ys)) * max(span, stretch) <= self._tol

    # ------------------------------------------------------------------ verdicts
    def _evaluate(self, step: int, block: list[Any], out: list[dict[str, Any]]) -> None:
        cfg = self.config
        if not self._tol:
            self._tol = cfg.tol_frac * self._total
        age = block[_END] - self._inc_start
        state = self.state
        if state == "warmup":
            self._evaluate_warmup(step, age, out)
            return
        plateau = self._plateau
        assert plateau is not None
        floor = block[_FLOOR]
        if self._saw_period:
            floor = self._min_since(_FLOOR, block[_END] - 1.2 * self._saw_period)
        broke = None
        if state == "plateau":
            if self._cusum_step("floor", floor - plateau["floor"], block):
                broke = "allocated"
            elif block[_RESV] - plateau["reserved"] > self._reserved_tol():
                broke = self._phase_ratchet or "reserved"
            else:
                # rare small ratchets (the longest batch so far) are the plateau settling, not a break
                plateau["reserved"] = max(plateau["reserved"], self._value_at(_RESV, block[_END] - 4 * cfg.block_steps))
            if broke:
                self.state = "rising"
                self._rising_since = self._cp["floor"] if broke == "allocated" else block[_START]
                self._break_onsets.append(self._rising_since)
                self.plateau_breaks += 1
                self._emit(
                    {
                        "type": "plateau_break",
                        "step": step,
                        "onset_step": self._rising_since,
                        "cause": broke,
                        "plateau_bytes": int(plateau["reserved"]),
                        "reserved_bytes": block[_RESV],
                        "allocated_bytes": block[_FLOOR],
                    },
                    out,
                )
        # leaks (allocator), from a break or ongoing
        min_span = max(cfg.min_blocks * cfg.block_steps, 1.5 * self._saw_period)
        if self._first_plateau_age:
            min_span = max(min_span, cfg.warmup_span_frac * self._first_plateau_age)
        if self.state == "rising":
            # the floor's own change point can be later than the break (a checkpoint ratchet
            # first, a leak after): try the break, the floor's onset, and the recent half
            self._cusum_step("floor", floor - plateau["floor"], block)
            trend = None
            starts = {self._rising_since, max(self._rising_since, self._cp["floor"])}
            starts.add(int(0.5 * (self._rising_since + block[_END])))
            # a leak that began while the series was still "rising" from an earlier, smaller
            # break: recent windows of a few minimum spans find it without waiting for the
            # whole rise to look linear
            for multiple in (2, 4):
                if block[_END] - multiple * min_span > self._rising_since:
                    starts.add(int(block[_END] - multiple * min_span))
            for s0 in sorted(starts):
                trend = self._trend(_FLOOR, s0, min_span, cfg.half_ratio)
                if trend:
                    self._rising_since = s0
                    break
            if trend:
                self._start_leak(step, "allocator", trend, out)
            elif block[_END] - self._rising_since >= 2 * min_span:
                # settled again: the later half of the rise is flat even when its slope is
                # stretched over the whole rise, so a slow creep never passes for a plateau
                rise = block[_END] - self._rising_since
                window = 0.5 * rise
                settled = self._flat(_FLOOR, block[_END] - window, window, stretch=rise)
                resv_flat = block[_RESV] - self._value_at(_RESV, block[_END] - window) <= self._reserved_tol()
                if settled and resv_flat:
                    self._new_plateau(step, block, out, window)
        elif self.state == "leak":
            self._follow_leak(step, block, min_span, out)
        if self.state in ("plateau", "rising") and not self._levels[1].pending and self._break_onsets:
            # a leak slower than the noise shows up as breaks followed by "plateaus" that are
            # only short flat-looking stretches: judge the floor since the earliest break
            for s0 in sorted(self._break_onsets):
                trend = self._trend(_FLOOR, s0, 4 * min_span, cfg.half_ratio, max_jump=0.35)
                if trend:
                    self._rising_since = s0
                    self._start_leak(step, "allocator", trend, out)
                    break
        # leak outside the allocator: NVML - reserved rising while torch is flat
        if (
            self.state in ("plateau", "rising")
            and plateau.get("outside") is not None
            and block[_OUTSIDE] is not None
            and self._cusum_step("outside", block[_OUTSIDE] - plateau["outside"], block)
        ):
            trend = self._trend(_OUTSIDE, self._cp["outside"], min_span, cfg.half_ratio)
            if trend:
                self._start_leak(step, "outside_allocator", trend, out)
        # fragmentation: reserved - allocated and split blocks growing, allocated flat
        if self.state in ("plateau", "rising", "fragmentation"):
            self._check_fragmentation(step, block, min_span, out)

    def _min_since(self, index: int, since: float) -> float:
        """Lowest value of a signal over blocks starting at or after ``since`` (the floor after
        collection). Levels overlap, and a minimum does not mind; but a coarse block that
        starts before ``since`` would drag in older (e.g. warm-up) values, so only blocks
        wholly inside the window count. Falls back to the latest block."""
        best = _INF
        for level in self._levels:
            for b in reversed(level.blocks):
                if b[_START] < since:
                    break
                if b[index] < best:
                    best = b[index]
        if best == _INF and self._levels[0].blocks:
            best = self._levels[0].blocks[-1][index]
        return best

    def _value_at(self, index: int, at: float) -> Any:
        """Signal ``index`` of the latest level-0 block starting at or before ``at``."""
        ring = self._levels[0].blocks
        for b in reversed(ring):
            if b[_START] <= at:
                return b[index]
        return ring[0][index]

    def _cusum_step(self, name: str, excess: float, block: list[Any]) -> bool:
        """One-sided CUSUM (Page 1954): drift allowance tol/2, alarm at 2 tol (the classic
        choice for a shift of tol; a smaller allowance breaks on noisy plateaus)."""
        tol = self._tol
        value = self._cusum[name] + excess - 0.5 * tol
        if value <= 0:
            self._cusum[name] = 0.0
            self._cp[name] = block[_END] + 1
            return False
        self._cusum[name] = value
        return value > 2 * tol

    def _evaluate_warmup(self, step: int, age: int, out: list[dict[str, Any]]) -> None:
        cfg = self.config
        span = max(cfg.min_blocks * cfg.block_steps, cfg.warmup_span_frac * age, 1.5 * self._saw_period)
        last = self._levels[0].blocks[-1]
        s0 = last[_END] - span
        if len(self._saw_drops) == 1 and last[_END] - self._saw_drops[0] < 1.5 * self._saw_period:
            # one clear seen: a sawtooth's level is trough against trough, so wait for the
            # second clear (or for long enough to know there is none) before calling it flat
            return
        if s0 >= self._inc_start:
            # flat even with the current slope stretched over the whole age: a warm-up with
            # a long time constant is still climbing at age T by (A/tau)e^(-T/tau) per step,
            # which only becomes immaterial over T steps once T is several tau
            settled = self._flat(_FLOOR, s0, span, stretch=age)
            # the allocator may still be filling its cache in ever rarer jumps: only its
            # recent growth counts, and what a checkpoint/eval added is a phase's ratchet
            recent = last[_END] - span / 2
            bumps = sum(b for at, b in self._phase_bumps if at >= recent)
            if settled and last[_RESV] - self._value_at(_RESV, recent) - bumps <= self._reserved_tol():
                self._first_plateau_age = age
                self._new_plateau(step, last, out, span)
                return
        if age >= cfg.warmup_leak_min_blocks * cfg.block_steps:
            # never settled: a leak only if the last three quarters of the life rise in a
            # straight line (three equal slopes); a warm-up, however long, keeps decelerating
            start = self._inc_start + age // 4
            trend = self._trend(_FLOOR, start, 0.75 * age, cfg.warmup_half_ratio, max_jump=0.25, parts=3)
            if trend:
                self._plateau = self._plateau_levels(last, span)
                self._start_leak(step, "allocator", trend, out)

    def _plateau_levels(self, block: list[Any], span: float) -> dict[str, Any]:
        s0 = block[_END] - span
        _, floors, _ = self._window(_FLOOR, s0)
        ring = [b for b in self._levels[0].blocks if b[_START] >= s0] or [block]
        peaks = [b[_PEAK] for b in ring]
        outside = [b[_OUTSIDE] for b in ring]
        sigma = noise_sigma([b[_FLOOR] for b in ring])
        self._tol = max(self.config.tol_frac * self._total, self.config.noise_k * sigma)
        peak = median(peaks)
        # activations above the floor: the typical block high plus a margin; spikes are rare,
        # so the median of block maxima ignores them
        # the biggest normal batch: each block's runner-up peak (a lone spike is only ever a
        # block's top), measured above the floor; it keeps learning while on the plateau
        self._normal_high = max(b[_PEAK2] - b[_FLOOR] for b in ring)
        self._spike_threshold = self._normal_high + self.config.spike_margin_frac * self._total
        if self._saw_period:
            # a sawtooth's floor is its trough now, not the median of trailing minima that
            # still reach back into the warm-up
            floor = self._min_since(_FLOOR, block[_END] - 1.2 * self._saw_period)
        else:
            floor = median(floors) if floors else block[_FLOOR]
        return {
            "floor": floor,
            "reserved": float(block[_RESV]),
            "peak": float(peak),
            "outside": None if any(v is None for v in outside) else float(median(outside)),
            "slack": float(median([b[_SLACK] for b in ring])),
            "since": block[_END],
        }

    def _new_plateau(self, step: int, block: list[Any], out: list[dict[str, Any]], span: float) -> None:
        self._plateau = self._plateau_levels(block, span)
        self.state = "plateau"
        self._leak = None
        self._phase_ratchet = None
        for name in self._cusum:
            self._cusum[name] = 0.0
            self._cp[name] = block[_END] + 1
        last = self._last or {}
        used = last.get("nvml_used_bytes")
        self._emit(
            {
                "type": "plateau",
                "step": step,
                "plateau_bytes": int(self._plateau["reserved"]),
                "allocated_bytes": int(self._plateau["floor"]),
                "peak_bytes": int(self._plateau["peak"]),
                "headroom_bytes": int(self._total - (used if used is not None else self._plateau["reserved"])),
            },
            out,
        )

    # ------------------------------------------------------------------ leaks
    def _runway(self, source: str, slope: float) -> tuple[int | None, float | None]:
        if slope <= 0:
            return None, None
        last = self._last
        if last is None:
            return None, None
        total = last["total_bytes"]
        ring = self._levels[0].blocks
        peak_high = max(b[_PEAK] for b in list(ring)[-4:]) if ring else last["peak_allocated_bytes"]
        if source == "outside_allocator":
            used = last["nvml_used_bytes"] or last["reserved_bytes"]
            room = total - max(used, last["reserved_bytes"])
        else:
            need = max(peak_high, last["peak_allocated_bytes"])
            if self._phase_above_floor and ring:
                need = max(need, ring[-1][_FLOOR] + max(self._phase_above_floor.values()))
            room = total - self._outside_now() - need
        steps = max(0, int(room / slope))
        return steps, steps * self._seconds_per_step()

    def _seconds_per_step(self) -> float:
        ring = self._levels[0].blocks
        if len(ring) >= 2:
            first, last = ring[0], ring[-1]
            if last[_END] > first[_END] and last[_TS] > first[_TS]:
                return (last[_TS] - first[_TS]) / (last[_END] - first[_END])
        last_sample = self._last or {}
        return float(last_sample.get("step_time_s") or 0.0)

    def _start_leak(self, step: int, source: str, trend: dict[str, Any], out: list[dict[str, Any]]) -> None:
        slope = trend["slope"]
        steps, seconds = self._runway(source, slope)
        onset = self._rising_since if source == "allocator" else self._cp["outside"]
        self._leak = {"source": source, "slope": slope, "steps": steps, "seconds": seconds, "onset": onset}
        self.state = "leak"
        self._emit(
            {
                "type": "leak",
                "step": step,
                "onset_step": onset,
                "slope_bytes_per_step": round(slope, 1),
                "steps_to_oom": steps,
                "seconds_to_oom": None if seconds is None else round(seconds, 1),
                "source": source,
            },
            out,
        )

    def _follow_leak(self, step: int, block: list[Any], min_span: float, out: list[dict[str, Any]]) -> None:
        leak = self._leak
        assert leak is not None
        if self._saw_drops and self._saw_drops[-1] == block[_START] and leak["source"] == "allocator":
            # the floor just fell back by more than the material size: that memory was a
            # cache being cleared, not a leak (the first ramp of a sawtooth looks like one)
            self._new_plateau(step, block, out, min_span)
            return
        if self._levels[1].pending:
            leak["steps"], leak["seconds"] = self._runway(leak["source"], leak["slope"])
            return  # the slope moves slowly: re-fit every fourth block
        index = _FLOOR if leak["source"] == "allocator" else _OUTSIDE
        xs, ys, _ = self._window(index, leak["onset"])
        if len(xs) >= 4:
            leak["slope"] = theil_sen(xs, ys)
        # has it stopped? flat over a window long enough to see the leak's own rise
        window = max(min_span, 2 * self._tol / leak["slope"] if leak["slope"] > 0 else min_span)
        if block[_END] - leak["onset"] >= 2 * window:
            settled = self._flat(index, block[_END] - window, window)
            if settled:
                self._break_onsets.clear()  # that rise is over and judged: not a slow leak to re-find
                self._new_plateau(step, block, out, window)
                return
        leak["steps"], leak["seconds"] = self._runway(leak["source"], leak["slope"])

    # ------------------------------------------------------------------ fragmentation
    def _check_fragmentation(self, step: int, block: list[Any], min_span: float, out: list[dict[str, Any]]) -> None:
        plateau = self._plateau
        assert plateau is not None
        rising = self._cusum_step("slack", block[_SLACK] - plateau["slack"], block)
        frag = self._frag
        if self.state == "fragmentation" and frag is not None:
            # over, once neither kind of waste moved for long enough to have seen it grow
            slope = max(frag["slope"], 1.0)
            window = max(min_span, 2 * self._reserved_tol() / slope)
            if block[_END] - frag["onset"] >= 2 * window:
                s0 = block[_END] - window
                slack_flat = self._flat(_SLACK, s0, window)
                split_flat = self._flat(_SPLIT, s0, window)
                if slack_flat and split_flat and self._value_at(_RETRIES, s0) == block[_RETRIES]:
                    self._frag = None
                    self._new_plateau(step, block, out, window)
            return
        if not rising:
            return
        growth = block[_SLACK] - plateau["slack"]
        if growth < self._reserved_tol():
            return
        if self._trend(_FLOOR, self._cp["slack"], min_span, self.config.half_ratio):
            return  # the allocated floor rises too: a leak, not fragmentation
        half = self.config.half_ratio
        trend = None
        onset = self._cp["slack"]
        for s0 in sorted({onset, *self._break_onsets, int(0.5 * (onset + block[_END]))}):
            if s0 < onset:
                continue
            # reserved grows in ratchets, so the slack is a staircase; split blocks creep
            trend = self._trend(_SLACK, s0, min_span, half, max_jump=1.0) or self._trend(_SPLIT, s0, min_span, half)
            if trend:
                onset = s0
                break
        first_retries = self._value_at(_RETRIES, onset)
        retries_up = block[_RETRIES] > first_retries
        split_growth = block[_SPLIT] - self._value_at(_SPLIT, onset)
        # cached-but-unusable memory: split blocks piling up, or the allocator already retrying
        if not retries_up and (trend is None or split_growth < 0.25 * growth):
            return
        slope = trend["slope"] if trend else 0.0
        self.state = "fragmentation"
        self._frag = {"slope": slope, "onset": onset}
        last = self._last or {}
        self._emit(
            {
                "type": "fragmentation",
                "step": step,
                "onset_step": onset,
                "reserved_bytes": last.get("reserved_bytes", block[_RESV]),
                "allocated_bytes": last.get("allocated_bytes", block[_FLOOR]),
                "reserved_minus_allocated_bytes": block[_SLACK],
                "growth_bytes": int(block[_SLACK] - plateau["slack"]),
                "growth_bytes_per_step": round(slope, 1),
                "inactive_split_bytes": last.get("inactive_split_bytes", block[_SPLIT]),
                "alloc_retries": block[_RETRIES],
                "alloc_retries_in_window": block[_RETRIES] - first_retries,
                "recommendation": FRAGMENTATION_ADVICE,
            },
            out,
        )

    # ------------------------------------------------------------------ read-out
    def summary(self) -> dict[str, Any]:
        last = self._last or {}
        total = last.get("total_bytes", self._total) or None
        used = last.get("nvml_used_bytes")
        reserved = last.get("reserved_bytes")
        leak = self._leak if self.state == "leak" else None
        plateau = self._plateau
        if used is not None:
            headroom = total - used if total else None
        elif reserved is not None and total:
            headroom = total - reserved
        else:
            headroom = None
        return {
            "state": self.state,
            "step": last.get("step"),
            "ts": last.get("ts"),
            "plateau_bytes": int(plateau["reserved"]) if plateau else None,
            "headroom_bytes": headroom,
            "slope_bytes_per_step": round(leak["slope"], 1) if leak else None,
            "steps_to_oom": leak["steps"] if leak else None,
            "seconds_to_oom": round(leak["seconds"], 1) if leak and leak["seconds"] is not None else None,
            "leak_source": leak["source"] if leak else None,
            "fragmentation": self.state == "fragmentation",
            "outside_allocator_bytes": (used - reserved) if used is not None and reserved is not None else None,
            "plateau_breaks": self.plateau_breaks,
            "checkpoint_peak_bytes": self._checkpoint_peak,
            "checkpoint_headroom_bytes": self._checkpoint_headroom,
            "total_bytes": total,
            "samples": self.samples,
        }


def _spike_kind(phase: str) -> str:
    """checkpoint / eval by the usual names (Lightning, HF Trainer, hand-written loops)."""
    lowered = phase.lower()
    if lowered.startswith(("checkpoint", "ckpt", "save")):
        return "checkpoint_spike"
    if lowered.startswith(("eval", "val", "test")):
        return "eval_spike"
    return "phase_spike"
