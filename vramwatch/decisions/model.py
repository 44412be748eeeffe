"""Memory model of one rank: a persistent floor plus a transient that follows the batch's tokens.

Per training step a rank holds its **floor** (``allocated`` at the step boundary: weights,
gradients, optimizer and EMA state, compiled-graph pools) and, during the step, a
**transient** on top of it (activations, logits and loss buffers): ``peak - allocated`` of
the same sample. Checkpoint and eval phases have transients of their own. The device must
also hold the allocator's slack (reserved beyond the largest peak: rounding, split blocks)
and memory outside the allocator (:func:`vramwatch.verdicts.outside_allocator_bytes`).

:class:`RankModelBuilder` folds samples in online, O(1) per sample and bounded memory
(one maximum per 1 %-wide token bucket, one per phase name, a short window for the
floor). :meth:`RankModelBuilder.model` fits the transient against tokens on the **upper
envelope** (the peak is a maximum, so the line must sit on the bucket maxima, not
through their middle): Theil-Sen slope over the bucket maxima, intercept raised until
no bucket lies above the line. When tokens never varied, buckets from reference runs
at other batch settings (:func:`vramwatch.decisions.views.refit`) give the spread; without
them the transient is assumed proportional to tokens, with a wider stated uncertainty.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from vramwatch.engine.blocks import keep_last
from vramwatch.verdicts import outside_allocator_bytes

#: Width of a token bucket (relative): per-step peaks are compared within 1 % of tokens.
BUCKET_WIDTH = 0.01
#: Train samples the floor and outside-allocator figures are judged over (the latest), kept as
#: the maxima of blocks of BLOCK samples so a sample costs one comparison.
WINDOW = 256
BLOCK = 32
#: Token spread (max / min) below which tokens are treated as constant.
MIN_SPREAD = 1.05
#: Stated relative uncertainty of the proportional assumption (docs/decisions.md).
PROPORTIONAL_UNCERTAINTY = 0.25
#: Smallest stated uncertainty of a fit that extrapolates (no fit is exact beyond its data).
MIN_UNCERTAINTY = 0.02
#: Stated uncertainty of a fit the hold-out check could not test (too few token settings, e.g.
#: two or three runs at different batches): the line passes through them, nothing checks its shape.
UNCHECKED_UNCERTAINTY = 0.10
#: The hold-out check fits the lower part of the token range and predicts the top part.
HOLDOUT_SPLIT = 0.7

FIT_METHODS = ("envelope", "envelope_quadratic", "across_runs", "proportional", "none")


@dataclass(frozen=True)
class TransientFit:
    """Transient bytes as ``intercept + slope * tokens`` (upper envelope of per-step peaks)."""

    method: str  # one of FIT_METHODS
    intercept_bytes: float
    bytes_per_token: float
    buckets: int  # token buckets the fit rests on
    tokens_min: int | None
    tokens_max: int | None
    residual_frac: float | None  # RMS of bucket maxima around the line / transient at tokens_max
    holdout_error_frac: float | None  # fit on the lower 70 % of tokens, error at the top buckets
    uncertainty_frac: float  # stated relative uncertainty of the transient when projected
    bytes_per_token2: float = 0.0  # curvature (bytes per token squared) when the envelope is convex

    def transient(self, tokens: float) -> float:
        """Projected transient at ``tokens`` (O(1))."""
        return self.intercept_bytes + self.bytes_per_token * tokens + self.bytes_per_token2 * tokens * tokens

    def tokens_for(self, room: float) -> int:
        """Largest tokens whose transient stays within ``room`` bytes (0 when none; O(1))."""
        a, b, c = self.intercept_bytes - room, self.bytes_per_token, self.bytes_per_token2
        if a > 0:
            return 0
        if c <= 0:
            return int(-a // b) if b > 0 else 0
        return int((-b + math.sqrt(b * b - 4 * c * a)) / (2 * c))

    @property
    def usable(self) -> bool:
        return self.method != "none" and self.bytes_per_token > 0


@dataclass(frozen=True)
class PhaseNeed:
    """A non-train phase's own transient above the floor (independent of the training batch)."""

    phase: str
    transient_bytes: int
    samples: int


@dataclass(frozen=True)
class RankModel:
    """The fitted model of one rank; every projection is O(phases)."""

    run: str
    host: str
    rank: int
    total_bytes: int
    floor_bytes: int
    outside_bytes: int  # memory outside the allocator (0 when NVML is unavailable)
    outside_measured: bool
    slack_bytes: int  # reserved beyond the largest peak (allocator rounding, split blocks)
    train: TransientFit
    train_transient_bytes: int  # largest training transient observed
    phases: tuple[PhaseNeed, ...]
    tokens_seen_max: int | None
    tokens_last: int | None
    world_size: int | None
    step: int | None
    step_time_s: float | None  # median of recent train steps

    def _fixed(self) -> int:
        return self.floor_bytes + self.slack_bytes + self.outside_bytes

    def as_dict(self) -> dict[str, Any]:
        """The model as JSON (the ``models`` of an advice document); :meth:`from_dict` reads it back
        exactly (no rounding), so a front can decide over the models of several collectors."""
        t = self.train
        return {
            "run": self.run, "rank": self.rank, "host": self.host, "total_bytes": self.total_bytes,
            "floor_bytes": self.floor_bytes, "outside_allocator_bytes": self.outside_bytes,
            "outside_measured": self.outside_measured, "allocator_slack_bytes": self.slack_bytes,
            "transient": {"method": t.method, "intercept_bytes": t.intercept_bytes,
                          "bytes_per_token": t.bytes_per_token, "bytes_per_token2": t.bytes_per_token2,
                          "buckets": t.buckets, "tokens_min": t.tokens_min,
                          "tokens_max": t.tokens_max, "residual_frac": t.residual_frac,
                          "holdout_error_frac": t.holdout_error_frac, "uncertainty_frac": t.uncertainty_frac},
            "phases": {p.phase: p.transient_bytes for p in self.phases},
            "phase_samples": {p.phase: p.samples for p in self.phases},
            "train_transient_bytes": self.train_transient_bytes, "tokens_seen_max": self.tokens_seen_max,
            "tokens_last": self.tokens_last, "world_size": self.world_size, "step": self.step,
            "step_time_s": self.step_time_s,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RankModel:
        """Inverse of :meth:`as_dict`; raises KeyError/TypeError/ValueError on a malformed document."""
        t = doc["transient"]
        samples = doc.get("phase_samples") or {}
        fit = TransientFit(str(t["method"]), float(t["intercept_bytes"]), float(t["bytes_per_token"]),
                           int(t["buckets"]), t.get("tokens_min"), t.get("tokens_max"), t.get("residual_frac"),
                           t.get("holdout_error_frac"), float(t["uncertainty_frac"]),
                           float(t.get("bytes_per_token2", 0.0)))
        return cls(
            run=str(doc.get("run", "")), host=str(doc["host"]), rank=int(doc["rank"]),
            total_bytes=int(doc["total_bytes"]),
            floor_bytes=int(doc["floor_bytes"]), outside_bytes=int(doc["outside_allocator_bytes"]),
            outside_measured=bool(doc["outside_measured"]), slack_bytes=int(doc["allocator_slack_bytes"]), train=fit,
            train_transient_bytes=int(doc["train_transient_bytes"]),
            phases=tuple(PhaseNeed(str(name), int(v), int(samples.get(name, 0))) for name, v in doc["phases"].items()),
            tokens_seen_max=doc.get("tokens_seen_max"), tokens_last=doc.get("tokens_last"),
            world_size=doc.get("world_size"), step=doc.get("step"), step_time_s=doc.get("step_time_s"),
        )

    def phase_needs(self, tokens: float | None = None) -> dict[str, float]:
        """Device need per phase (bytes); ``train`` at ``tokens`` (else at the largest observed)."""
        base = self._fixed()
        if tokens is not None and self.train.usable:
            train = base + self.train.transient(tokens)
        else:
            train = base + self.train_transient_bytes
        needs = {"train": float(train)}
        for p in self.phases:
            needs[p.phase] = float(base + p.transient_bytes)
        return needs

    def worst_need(self, tokens: float | None = None) -> tuple[float, str]:
        """(bytes, phase) of the phase that needs the most at ``tokens``."""
        needs = self.phase_needs(tokens)
        phase = max(needs, key=needs.__getitem__)
        return needs[phase], phase

    def max_tokens(self, margin: float) -> tuple[int | None, str]:
        """Largest tokens per step that keeps ``margin`` x device free at every phase.

        Returns (tokens, binding phase). ``None`` when the model cannot say (no usable fit);
        0 when a phase independent of the batch already breaks the margin. The model alone:
        what the runs proved or saw fail bounds it (:mod:`vramwatch.decisions.proven`).
        """
        if not self.total_bytes:
            return None, "train"  # device size unknown: nothing to fit into
        limit = self.total_bytes * (1.0 - margin)
        for p in self.phases:
            if self._fixed() + p.transient_bytes > limit:
                return 0, p.phase
        if not self.train.usable:
            return None, "train"
        return self.train.tokens_for(limit - self._fixed()), "train"


@dataclass(slots=True)
class Bucket:
    """The largest transient seen within one 1 %-wide token bucket (at ``tokens``)."""

    tokens: int
    transient: int


def _step_times() -> array[float]:
    return array("d")


def folded_fields(sample: dict[str, Any]) -> tuple[Any, int | None, int | None, int | None, int | None, int | None]:
    """(incarnation, ooms, peak, allocated, reserved, NVML used) of a sample, as the model reads
    them: absent fields as None, an absent incarnation as ``""``. Subscripts for the common
    sample that has them all (cheaper than six ``dict.get``), ``get`` for a sparse one."""
    try:
        return (sample["incarnation"], sample["ooms"], sample["peak_allocated_bytes"], sample["allocated_bytes"],
                sample["reserved_bytes"], sample["nvml_used_bytes"])
    except KeyError:
        get = sample.get
        return (get("incarnation", ""), get("ooms"), get("peak_allocated_bytes"), get("allocated_bytes"),
                get("reserved_bytes"), get("nvml_used_bytes"))


@dataclass(slots=True)
class RankModelBuilder:
    """Online accumulator for one series; feed samples in arrival order with :meth:`update`.

    Memory: ~1 KB before the first samples, then grows with what it has seen: 8 bytes per step
    time (the latest :data:`WINDOW`), one bucket per 1 % of tokens, one entry per phase name.
    """

    run: str = ""
    host: str = ""
    rank: int = 0
    buckets: dict[int, Bucket] = field(default_factory=dict)
    phase_max: dict[str, list[int]] = field(default_factory=dict)  # phase -> [transient, samples]
    no_token_max: int = 0
    floors: list[int] = field(default_factory=list)  # block maxima, the latest WINDOW // BLOCK
    outsides: list[int] = field(default_factory=list)
    block_floor: int = -1  # the open block's maxima (-1: none yet)
    block_outside: int = -1
    block_fill: int = 0
    step_times: array[float] = field(default_factory=_step_times)  # the latest WINDOW, as a ring
    step_times_next: int = 0  # where the ring writes next once full
    timing: bool = True  # keep step times (for model(timing=True)); the live engine never reads them
    incarnation: Any = None
    #: (floor, outside) of the latest healthy process that ran a full window (:meth:`settle`): a new
    #: process warms up from below its floor, so for the model it is at least what that one held
    settled: tuple[int, int] | None = None
    inc_peak: int = 0  # largest peak of the current process (any phase)
    reserved: int = 0
    total: int = 0
    world_size: int | None = None
    step: int | None = None
    tokens_last: int | None = None
    tokens_max: int | None = None  # largest tokens of this run's own samples
    train_transient_max: int = 0
    samples: int = 0
    version: int = 0  # bumped when a bucket or phase maximum changes: the fit is stale
    inc_ooms: int = 0  # the process's OOM counter at the previous sample
    #: samples without allocated and per-step peak (sparse sources): not used by the fit
    unmeasured: int = 0

    def update(self, sample: dict[str, Any]) -> None:
        """Fold one schema-1 sample in: O(1), no allocation beyond the bounded buckets."""
        self.fold(sample, sample["phase"], *folded_fields(sample))

    def fold(self, sample: dict[str, Any], phase: str, incarnation: Any, ooms: int | None, peak: int | None,
             allocated: int | None, reserved: int | None, used: int | None) -> None:
        """:meth:`update` with the phase and :func:`folded_fields` already read (``RankTrack`` reads
        them once for itself and the builder)."""
        self.samples += 1
        if incarnation != self.incarnation:
            # a new process starts with a fresh allocator: floor and slack are its own
            self.incarnation = incarnation
            self.floors.clear()
            self.outsides.clear()
            self.block_floor = self.block_outside = -1
            self.block_fill = 0
            self.inc_peak = 0
            self.inc_ooms = 0
            self.run, self.host, self.rank = sample["run"], sample["host"], sample["rank"]
            self.world_size = sample.get("world_size", self.world_size)
            self.total = sample["total_bytes"] or self.total
        self.step = sample["step"]
        if peak is None or allocated is None:
            # the model splits floor from transient: without both it learns nothing (sparse
            # sources such as nvidia-smi or dcgm); the advice then says the fit is unknown
            self.unmeasured += 1
            return
        reserved = self.reserved = max(peak, allocated) if reserved is None else reserved
        if peak > self.inc_peak:
            self.inc_peak = peak
        transient = peak - allocated if peak > allocated else 0
        if ooms is not None and ooms > self.inc_ooms:
            # the allocation failed: this peak is the device's ceiling, not the step's demand; it
            # never joins the envelope (the OOM itself is evidence: trials.record_oom)
            self.inc_ooms = ooms
            tokens = sample.get("tokens") if phase == "train" else None
            if tokens and (self.tokens_max is None or tokens > self.tokens_max):
                self.tokens_max = tokens  # the run did ask for this batch
            return
        if phase != "train":
            entry = self.phase_max.setdefault(phase, [0, 0])
            if transient > entry[0]:
                entry[0] = transient
                self.version += 1
            entry[1] += 1
            return
        if allocated > self.block_floor:
            self.block_floor = allocated
        if used is not None and used - reserved > self.block_outside:
            self.block_outside = outside_allocator_bytes(reserved, used) or 0
        self.block_fill += 1
        if self.block_fill == BLOCK:
            keep_last(self.floors, self.block_floor, WINDOW // BLOCK)
            if self.block_outside >= 0:
                keep_last(self.outsides, self.block_outside, WINDOW // BLOCK)
            self.block_floor = self.block_outside = -1
            self.block_fill = 0
        if self.timing:
            step_time = sample.get("step_time_s")
            if step_time:
                times = self.step_times
                if len(times) < WINDOW:
                    times.append(step_time)
                else:  # full: overwrite the oldest (the median reads them in any order)
                    times[self.step_times_next] = step_time
                    self.step_times_next = (self.step_times_next + 1) % WINDOW
        if transient > self.train_transient_max:
            self.train_transient_max = transient
        tokens = sample.get("tokens")
        if tokens:
            self.tokens_last = tokens
            if self.tokens_max is None or tokens > self.tokens_max:
                self.tokens_max = tokens
            key = int(math.log(tokens) * _INV_LOG_WIDTH)  # _fold, inlined: the per-sample path
            entry = self.buckets.get(key)
            if entry is None:
                self.buckets[key] = Bucket(tokens, transient)
                self.version += 1
            elif transient > entry.transient:
                entry.tokens, entry.transient = tokens, transient
                self.version += 1
        elif transient > self.no_token_max:
            self.no_token_max = transient

    def settle(self) -> None:
        """The process now ending was healthy (no OOM, leak or fragmentation: the caller knows):
        its floor, when it ran a full window, is the least a later process settles at."""
        if len(self.floors) == WINDOW // BLOCK:
            self.settled = (max(self.floors), max(self.outsides, default=0))

    def points(self) -> list[Bucket]:
        """The token-bucket maxima (copies): what a fit rests on, O(buckets)."""
        return [Bucket(b.tokens, b.transient) for b in self.buckets.values()]

    def fit(self) -> TransientFit:
        """The transient fit on the current buckets: O(buckets) plus Theil-Sen on ≤ MAX_FIT_POINTS."""
        return fit_transient(list(self.buckets.values()))

    def model(self, fit: TransientFit | None = None, *, timing: bool = True) -> RankModel:
        """Freeze the model; ``fit`` reuses an earlier :meth:`fit` (the floor, slack and
        outside figures are always current). O(phases + window blocks) given a fit; ``timing``
        adds the median step time (a sort of the latest 256)."""
        fit = fit if fit is not None else self.fit()
        settled_floor, settled_outside = self.settled or (0, 0)
        floor = max((*self.floors, self.block_floor, settled_floor))
        outsides = (*self.outsides, *((self.block_outside,) if self.block_outside >= 0 else ()))
        outside = max((*outsides, settled_outside))
        slack = max(0, self.reserved - self.inc_peak)
        return RankModel(
            run=self.run, host=self.host, rank=self.rank, total_bytes=self.total, floor_bytes=floor,
            outside_bytes=outside, outside_measured=bool(outsides), slack_bytes=slack, train=fit,
            train_transient_bytes=self.train_transient_max,
            phases=tuple(PhaseNeed(name, v[0], v[1]) for name, v in sorted(self.phase_max.items())),
            tokens_seen_max=self.tokens_max, tokens_last=self.tokens_last,
            world_size=self.world_size, step=self.step,
            step_time_s=median(self.step_times) if timing and self.step_times else None,
        )


_INV_LOG_WIDTH = 1.0 / math.log1p(BUCKET_WIDTH)


def fold_points(points: list[Bucket]) -> list[Bucket]:
    """Points of several runs folded into 1 %-wide buckets, keeping each bucket's maximum."""
    buckets: dict[int, Bucket] = {}
    for p in points:
        key = int(math.log(p.tokens) * _INV_LOG_WIDTH)
        entry = buckets.get(key)
        if entry is None:
            buckets[key] = Bucket(p.tokens, p.transient)
        elif p.transient > entry.transient:
            entry.tokens, entry.transient = p.tokens, p.transient
    return list(buckets.values())


#: Theil-Sen runs on at most this many bucket maxima (evenly spread over the token range):
#: O(n²) pairs, so the fit stays well under a millisecond whatever the bucket count.
MAX_FIT_POINTS = 48


def _theil_sen(points: list[Bucket]) -> float:
    if len(points) > MAX_FIT_POINTS:
        stride = len(points) / MAX_FIT_POINTS
        points = [points[int(i * stride)] for i in range(MAX_FIT_POINTS)] + [points[-1]]
    slopes = [
        (b.transient - a.transient) / (b.tokens - a.tokens)
        for i, a in enumerate(points)
        for b in points[i + 1:]
        if b.tokens != a.tokens
    ]
    return median(slopes) if slopes else 0.0


def _upper_hull(points: list[Bucket]) -> list[Bucket]:
    """Vertices of the upper convex hull of points sorted by tokens (monotone chain, O(n))."""
    hull: list[Bucket] = []
    for p in points:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or under the segment a -> p
            rise_ab, rise_ap = b.transient - a.transient, p.transient - a.transient
            if (b.tokens - a.tokens) * rise_ap >= (p.tokens - a.tokens) * rise_ab:
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def _envelope(points: list[Bucket]) -> tuple[float, float, float]:
    """(intercept, slope, 0) of the upper envelope, no point above the line.

    The slope is Theil-Sen over the vertices of the upper convex hull: the buckets that
    carry the worst batch composition at their token count (the cloud below them, e.g.
    shorter sequences at equal tokens, does not pull the slope down), robust to one vertex
    an outlier made.
    """
    hull = _upper_hull(points)
    slope = max(0.0, _theil_sen(hull if len(hull) >= 2 else points))
    intercept = max(p.transient - slope * p.tokens for p in points)
    return intercept, slope, 0.0


def fit_transient(points: list[Bucket], *, across_runs: bool = False, force: str | None = None) -> TransientFit:
    """Fit the transient against tokens on bucket maxima; states its own error.

    ``force`` ("proportional" or "envelope", no convex switch) is for ablations (the benchmark).
    """
    points = sorted(points, key=lambda b: b.tokens)
    if not points:
        return TransientFit("none", 0.0, 0.0, 0, None, None, None, None, 1.0)
    lo, hi = points[0].tokens, points[-1].tokens
    fewest = 2 if across_runs else 3  # two batch settings determine a line; one run's buckets need more
    if len(points) < fewest or hi < lo * MIN_SPREAD or force == "proportional":
        # tokens never varied: the transient is assumed to scale with them
        best = max(points, key=lambda b: b.transient)
        return TransientFit("proportional", 0.0, best.transient / best.tokens, len(points), lo, hi,
                            None, None, PROPORTIONAL_UNCERTAINTY)
    method = "across_runs" if across_runs else "envelope"
    coef = _envelope(points)
    residual = _residual(points, coef)
    holdout = _holdout_error(points, _envelope)
    if holdout is not None and holdout < -0.01 and len(points) >= 6 and force is None:
        # the line under-projects the top of the range beyond the data's own scatter (judged
        # around a parabola, which a convex envelope does not inflate): memory grows faster
        # than tokens (attention without flash, per-sequence buffers)
        quad = _envelope_quadratic(points)
        quad_residual = _residual(points, quad)
        if quad[2] > 0 and holdout < -2 * quad_residual:
            coef, method, residual = quad, "envelope_quadratic", quad_residual
            holdout = _holdout_error(points, _envelope_quadratic)
    floor = MIN_UNCERTAINTY if holdout is not None else UNCHECKED_UNCERTAINTY
    uncertainty = max(floor, residual, abs(holdout) if holdout is not None else 0.0)
    return TransientFit(method, coef[0], coef[1], len(points), lo, hi, round(residual, 5),
                        None if holdout is None else round(holdout, 5), round(uncertainty, 5), coef[2])


def _value(coef: tuple[float, float, float], tokens: float) -> float:
    return coef[0] + coef[1] * tokens + coef[2] * tokens * tokens


def _residual(points: list[Bucket], coef: tuple[float, float, float]) -> float:
    """RMS of the bucket maxima around the envelope, relative to the envelope at the top."""
    scale = max(1.0, _value(coef, points[-1].tokens))
    return math.sqrt(sum((_value(coef, p.tokens) - p.transient) ** 2 for p in points) / len(points)) / scale


def _envelope_quadratic(points: list[Bucket]) -> tuple[float, float, float]:
    """Least-squares parabola through the bucket maxima, raised until none lies above it."""
    import numpy as np

    t = np.array([p.tokens for p in points], dtype=float)
    y = np.array([p.transient for p in points], dtype=float)
    c, b, _ = np.polyfit(t, y, 2)
    a = float(np.max(y - b * t - c * t * t))
    return a, float(b), float(c)


def _holdout_error(points: list[Bucket], fit: Any) -> float | None:
    """Fit the lower part of the token range, predict the top buckets: signed relative error."""
    lo, hi = points[0].tokens, points[-1].tokens
    cut = lo + HOLDOUT_SPLIT * (hi - lo)
    train = [p for p in points if p.tokens <= cut]
    test = [p for p in points if p.tokens > cut]
    if len(train) < 3 or not test or train[-1].tokens < train[0].tokens * MIN_SPREAD:
        return None
    coef = fit(train)
    worst = max(test, key=lambda b: b.transient - _value(coef, b.tokens))
    predicted = _value(coef, worst.tokens)
    return (predicted - worst.transient) / max(1.0, worst.transient)


__all__ = ["FIT_METHODS", "Bucket", "PhaseNeed", "RankModel", "RankModelBuilder", "TransientFit", "fit_transient",
           "fold_points"]
