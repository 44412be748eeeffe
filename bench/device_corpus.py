"""A labelled corpus of device-used-only traces, generated from seeded stories.

    from bench.device_corpus import corpus
    traces = corpus("tune")      # the set the detectors were tuned on
    traces = corpus("heldout")   # other seeds, devices, sampling, rates, cadences and warm-ups

What dcgm-exporter, ``nvidia-smi`` or a hook without the allocator's fields record of one GPU of
a training run: device used and capacity, nothing else, no phase marks. Each trace is one
:class:`Story` simulated in wall time: a caching allocator whose reserved memory grows in
segments when a step's demand does not fit what it holds (a ratchet, given back only by
``empty_cache`` or the process's death), device used = CUDA context + reserved + reading
jitter. The phenomena the engine must tell apart:

* **leaks**: a smooth rise from the first sample (with or without a warm-up on top), a smooth
  rise after a plateau, a staircase of tensors kept every few minutes to hours, a small leak
  reaching the device in whole large segments (a staircase at the cadence segment / rate),
  a slow leak under A100-like jitter (+-300 MiB), a leak in a run that also checkpoints;
* **no leak**: plateaus, warm-ups of up to an hour (an exponential approach, a linear ramp that
  then holds, a compile staircase with ever longer gaps), variable batch lengths (records,
  ever rarer), checkpoint ratchets, eval phases (a ratchet, or ``empty_cache`` after each eval),
  restarts (device used falls to 0, the new process warms up again), noisy plateaus.

Sampling: ``dcgm`` (the Prometheus importer's own conversion: whole MiB, step = unix second),
``smi`` (``nvidia-smi -l``: whole MiB, step = row ordinal) and ``hook`` (step = training step,
schema-2 samples with the allocator fields null, a new incarnation after a restart). The held-out
split draws every parameter from other ranges (other devices, 10/30 s scrapes, 5 s rows, other
cadences, rates and warm-up lengths) with other seeds. Ground truth is the story's: leak onset,
slope (bytes per second) and the time the demand meets the device (OOM; projected when the
trace ends first).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from vramwatch import wire
from vramwatch.importers.common import MiB, base_sample
from vramwatch.importers.prometheus import STEP_S, Gpu, sample_of

GiB = 1024 * MiB
START_TS = 1.75e9
#: dcgm-exporter's FB_RESERVED (driver reserve, MiB): USED + FREE + RESERVED = capacity
FB_RESERVED_MIB = 537
#: the allocator fields a hook would send; null here (not measured)
_NULL_FIELDS = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "active_bytes", "inactive_split_bytes",
                "alloc_retries", "ooms", "process_used_bytes")

LEAK_FAMILIES = ("leak_from_start", "leak_after_plateau", "staircase_leak", "segment_leak", "noisy_leak",
                 "leak_with_checkpoints")
CLEAN_FAMILIES = ("plateau", "warmup_ramp", "warmup_compile", "warmup_slow", "variable_batches", "checkpoint",
                  "eval", "restart", "noisy_plateau")
FAMILIES = LEAK_FAMILIES + CLEAN_FAMILIES


@dataclass(frozen=True)
class Story:
    """One GPU's run. Sizes are bytes, times seconds since the trace's first sample."""

    name: str
    family: str
    seed: int
    total: int
    source: str  # dcgm | smi | hook
    interval_s: float  # seconds between samples (hook: between sampled steps)
    step_time_s: float
    hours: float
    base: float  # the floor after warm-up: weights, gradients, optimizer state
    act: float  # activation demand above the floor at the longest batch
    seq_skew: float  # batch length = 0.5 + 0.5 * U**skew: larger skew, rarer long batches
    grain: int  # a ratchet allocates whole segments of this size
    warm_kind: str = "exp"  # exp | ramp | compile | none
    warm: float = 0.0  # bytes the warm-up adds
    warm_s: float = 600.0  # the warm-up is over by then
    leak_rate: float = 0.0  # bytes per second of training (a chunked leak: chunk / cadence)
    leak_onset_s: float = 0.0
    leak_chunk: float = 0.0  # 0: continuous; else bytes kept every leak_cadence_s
    leak_cadence_s: float = 0.0
    ckpt_every_s: float = 0.0
    ckpt_extra: float = 0.0  # a checkpoint's demand above the floor
    eval_every_s: float = 0.0
    eval_s: float = 0.0
    eval_extra: float = 0.0  # an eval's demand above the floor
    eval_empty_cache: bool = False  # empty_cache() after each eval: reserved falls to the floor
    restart_at_s: float | None = None
    restart_gap_s: float = 0.0
    jitter_sigma: float = 0.0  # Gaussian reading jitter (bytes)
    jitter_uniform: float = 0.0  # uniform reading jitter, +- bytes (A100 traces: 300 MiB)
    drift_sigma: float = 0.0  # slowly wandering reading offset (other contexts, driver pools): its std ...
    drift_tau_s: float = 600.0  # ... and its time constant (an Ornstein-Uhlenbeck process)
    spike_prob: float = 0.0  # a transient allocation outside the allocator at a reading
    spike_max: float = 0.0
    ctx: float = 500 * MiB  # CUDA context, NCCL, cuBLAS workspaces
    leak_gap_spread: tuple[float, float] = (0.75, 1.25)  # a chunked leak's gap: cadence times U(lo, hi)
    nccl_steps: tuple[tuple[float, float], ...] = ()  # (seconds, bytes): communicator buffers outside the allocator
    neighbour: float = 0.0  # another process's memory on the device, coming and going ...
    neighbour_s: tuple[float, float] = (60.0, 1800.0)  # ... holding each state for U(lo, hi) seconds
    tail_after_oom_s: float = 0.0  # dcgm / nvidia-smi keep scraping this long after the process died

    @property
    def leak(self) -> bool:
        return self.leak_rate > 0


@dataclass(frozen=True)
class Truth:
    leak: bool
    onset_ts: float | None = None
    slope_bytes_per_s: float | None = None
    oom_ts: float | None = None  # when the demand meets the device (projected past the trace's end)
    oom_seen: bool = False  # the process died of it within the trace


@dataclass
class DeviceTrace:
    story: Story
    truth: Truth
    samples: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.story.name


# ---------------------------------------------------------------------------------- simulation
class _Process:
    """One training process on the GPU: its floor over time and its allocator's reserved."""

    def __init__(self, story: Story, start: float, rng: random.Random) -> None:
        self.s = story
        self.start = start
        self.rng = rng
        self.reserved = 0.0
        # a compile staircase: jumps at ever longer gaps (each about twice the last), the last
        # one when the warm-up ends; a chunked leak: tensors kept at a jittered cadence
        jumps = 5
        self.jumps = [(story.warm_s * 2.0 ** (k + 1 - jumps) * (0.75 + 0.25 * rng.random()),
                       0.6 * story.warm * (jumps - k) / (jumps * (jumps + 1) / 2)) for k in range(jumps)]
        self.leak_ticks: list[float] = []
        if story.leak_chunk:
            t = max(story.leak_onset_s, start)
            end = story.hours * 3600.0
            lo, hi = story.leak_gap_spread
            while t < end:
                t += story.leak_cadence_s * (lo + (hi - lo) * rng.random())
                self.leak_ticks.append(t)

    def warm_part(self, age: float) -> float:
        s = self.s
        if s.warm_kind == "none" or s.warm <= 0:
            return 0.0
        if s.warm_kind == "ramp":
            return s.warm * min(1.0, age / s.warm_s)
        if s.warm_kind == "compile":
            smooth = 0.4 * s.warm * (1.0 - math.exp(-4.0 * age / s.warm_s))
            return smooth + sum(size for at, size in self.jumps if age >= at)
        return s.warm * (1.0 - math.exp(-4.0 * age / s.warm_s))  # exp: 98 % by warm_s

    def floor(self, t: float) -> float:
        s = self.s
        value = s.base + self.warm_part(t - self.start)
        if s.leak_rate > 0 and t > s.leak_onset_s:
            since = max(s.leak_onset_s, self.start)
            if s.leak_chunk:
                value += s.leak_chunk * sum(1 for tick in self.leak_ticks if tick <= t)
            else:
                value += s.leak_rate * (t - since)
        return value

    def demand(self, t0: float, t1: float) -> tuple[float, bool]:
        """The highest demand of the steps in (t0, t1], and whether an eval just ended there."""
        s, rng = self.s, self.rng
        floor = self.floor(t1)
        eval_end = False
        if s.eval_every_s:
            phase = (t1 - self.start) % s.eval_every_s
            if t1 - self.start > s.eval_every_s and phase < s.eval_s:
                return floor + s.eval_extra * (0.95 + 0.05 * rng.random()), False
            eval_end = phase < s.eval_s + (t1 - t0)
        steps = max(1, round((t1 - t0) / s.step_time_s))
        seq = 0.5 + 0.5 * rng.random() ** (s.seq_skew / steps)  # the longest of `steps` batches
        need = floor + s.act * seq
        if s.ckpt_every_s and (t1 - self.start) // s.ckpt_every_s > (t0 - self.start) // s.ckpt_every_s:
            need = max(need, floor + s.ckpt_extra * (0.97 + 0.03 * rng.random()))
        return need, eval_end and s.eval_empty_cache

    def outside(self, t: float) -> float:
        """The process's memory outside its allocator: context, then NCCL's buffers as they come."""
        s = self.s
        return s.ctx + sum(size for at, size in s.nccl_steps if t - self.start >= at)

    def advance(self, t0: float, t1: float, neighbour: float = 0.0) -> bool:
        """Serve (t0, t1]'s demand like the caching allocator; False when it no longer fits (OOM)."""
        need, empty_cache = self.demand(t0, t1)
        grain = self.s.grain
        if need > self.reserved:
            self.reserved = math.ceil(need / grain) * grain
        if self.reserved > self.s.total - self.outside(t1) - neighbour:
            return False
        if empty_cache:  # the cache goes back; what the floor holds stays
            self.reserved = math.ceil(self.floor(t1) / grain) * grain
        return True


class _Jitter:
    """What a reading adds to the level: white jitter, a slowly wandering offset, rare spikes."""

    def __init__(self, story: Story, rng: random.Random) -> None:
        self.s = story
        self.rng = rng
        self.drift = rng.gauss(0.0, story.drift_sigma)
        self.keep = math.exp(-story.interval_s / story.drift_tau_s)

    def reading(self, level: float) -> float:
        s, rng = self.s, self.rng
        self.drift = self.keep * self.drift + s.drift_sigma * math.sqrt(1.0 - self.keep**2) * rng.gauss(0.0, 1.0)
        used = level + self.drift + rng.gauss(0.0, s.jitter_sigma) + rng.uniform(-s.jitter_uniform, s.jitter_uniform)
        if s.spike_prob and rng.random() < s.spike_prob:
            used += rng.uniform(0.2, 1.0) * s.spike_max
        return min(float(s.total), max(0.0, used))


class _Neighbour:
    """Another process's memory on the same device: ``size`` on for U(lo, hi) seconds, off as long."""

    def __init__(self, story: Story) -> None:
        self.s = story
        self.rng = random.Random(story.seed ^ 0x5EED)
        self.on = self.rng.random() < 0.5
        self.until = self.rng.uniform(*story.neighbour_s)

    def at(self, t: float) -> float:
        s = self.s
        if not s.neighbour:
            return 0.0
        while t >= self.until:
            self.on = not self.on
            self.until += self.rng.uniform(*s.neighbour_s)
        return s.neighbour * (0.97 + 0.03 * self.rng.random()) if self.on else 0.0


def simulate(story: Story) -> DeviceTrace:
    """The story as its source records it, with its ground truth."""
    rng = random.Random(story.seed)
    neighbour = _Neighbour(story)
    end = story.hours * 3600.0
    process = _Process(story, 0.0, rng)
    samples: list[dict[str, Any]] = []
    writer = _Writer(story)
    jitter = _Jitter(story, random.Random(story.seed ^ 0x7177))
    t = 0.0
    dead_until = None
    oom_at = None
    incarnation = 0
    while t < end:
        t1 = t + story.interval_s
        if story.restart_at_s is not None and t < story.restart_at_s <= t1 and incarnation == 0:
            dead_until = story.restart_at_s + story.restart_gap_s  # the process dies
            incarnation = 1
        if dead_until is not None:
            if t1 < dead_until:
                writer.emit(samples, t1, neighbour.at(t1), alive=False)
                t = t1
                continue
            process = _Process(story, dead_until, rng)  # a new process: fresh allocator, warm-up again
            writer.restart()
            dead_until = None
        other = neighbour.at(t1)
        if not process.advance(t, t1, other):
            oom_at = t1
            break
        writer.emit(samples, t1, jitter.reading(process.outside(t1) + process.reserved + other), alive=True)
        t = t1
    if oom_at is not None and story.tail_after_oom_s and story.source != "hook":
        while t < oom_at + story.tail_after_oom_s:  # the process is gone; the exporter keeps scraping
            t += story.interval_s
            writer.emit(samples, t, jitter.reading(neighbour.at(t)), alive=False)
    return DeviceTrace(story, _truth(story, process, oom_at, t if oom_at is None else oom_at), samples)


def _truth(story: Story, process: _Process, oom_at: float | None, last: float) -> Truth:
    if not story.leak:
        return Truth(False)
    if oom_at is not None:
        return Truth(True, START_TS + story.leak_onset_s, story.leak_rate, START_TS + oom_at, oom_seen=True)
    if oom_at is None:  # projected: when the floor plus the longest batch meets the device
        room = story.total - story.ctx - (process.floor(last) + story.act)
        oom_at = last + max(0.0, room) / story.leak_rate
    return Truth(True, START_TS + story.leak_onset_s, story.leak_rate, START_TS + oom_at)


class _Writer:
    """Samples as the story's source records them."""

    def __init__(self, story: Story) -> None:
        self.s = story
        self.ordinal = 0
        self.step = 0
        self.incarnation = 0
        self.uuid = f"GPU-{story.seed:08x}"

    def restart(self) -> None:
        self.incarnation += 1
        self.step = max(0, self.step - 200)  # the new process resumes from its last checkpoint

    def emit(self, out: list[dict[str, Any]], t: float, used: float, alive: bool) -> None:
        s = self.s
        ts = START_TS + t
        if s.source == "hook":
            if not alive:
                return  # a dead process sends nothing
            self.step += max(1, round(s.interval_s / s.step_time_s))
            sample = {"schema": 2, "run": s.name, "host": "node", "rank": 0, "step": self.step, "ts": ts,
                      "phase": "train", "total_bytes": s.total, "nvml_used_bytes": int(used),
                      "incarnation": f"{s.name}-{self.incarnation}", **dict.fromkeys(_NULL_FIELDS)}
            out.append(wire.validate(sample))
            return
        total_mib = s.total // MiB
        used_mib = min(int(used // MiB), total_mib - FB_RESERVED_MIB)
        if s.source == "dcgm":
            values = {"used": float(used_mib), "free": float(total_mib - used_mib - FB_RESERVED_MIB),
                      "reserved": float(FB_RESERVED_MIB)}
            out.append(wire.validate(sample_of(Gpu("node", self.uuid, 0), round(ts, 3), values, s.name, STEP_S)))
            return
        sample = base_sample(s.name, "node", 0, self.ordinal, round(ts, 3))  # nvidia-smi: the row ordinal
        self.ordinal += 1
        sample.update(nvml_used_bytes=used_mib * MiB, total_bytes=total_mib * MiB, uuid=self.uuid, gpu=0)
        out.append(wire.validate(sample))


# ---------------------------------------------------------------------------------- the draws
@dataclass(frozen=True)
class Ranges:
    """Where a split draws its parameters from (the held-out split's are other values)."""

    seed_base: int
    devices_mib: tuple[int, ...]
    sources: tuple[tuple[str, float], ...]  # (source, seconds between samples)
    hook_step_s: tuple[float, float]
    hours: tuple[float, float]
    start_rise_mib_per_min: tuple[float, float]  # a leak from the first sample
    oom_hours: tuple[float, float]  # a leak after a plateau: onset -> OOM
    cadences_min: tuple[float, ...]  # staircase leaks
    warm_min: tuple[float, float]  # warm-up lengths (minutes)
    noisy_mib: float  # uniform jitter of the noisy stories


SPLITS = {
    "tune": Ranges(1000, (81920, 143771), (("dcgm", 15.0), ("smi", 15.0), ("hook", 0.0)), (1.0, 2.0),
                   (8.0, 20.0), (4.0, 40.0), (4.0, 60.0), (5.0, 15.0, 30.0, 60.0, 120.0), (10.0, 60.0), 300.0),
    "heldout": Ranges(70000, (40960, 81559, 24576, 97871), (("dcgm", 30.0), ("smi", 5.0), ("dcgm", 10.0),
                                                           ("hook", 0.0)),
                      (0.5, 3.0), (7.0, 24.0), (3.0, 50.0), (3.0, 72.0), (8.0, 20.0, 45.0, 90.0), (5.0, 65.0), 280.0),
}


def _base_story(family: str, index: int, ranges: Ranges) -> tuple[Story, random.Random]:
    seed = ranges.seed_base + 97 * FAMILIES.index(family) + index
    rng = random.Random(seed)
    total = rng.choice(ranges.devices_mib) * MiB
    source, interval = ranges.sources[index % len(ranges.sources)]
    step_time = rng.uniform(*ranges.hook_step_s)
    hours = rng.uniform(*ranges.hours)
    if source == "hook":  # every n-th step, at least a second apart; a hook trace holds <= 30k samples
        interval = step_time * max(1, math.ceil(rng.choice((1.0, 2.0, 4.0)) / step_time))
        hours = min(hours, rng.uniform(6.0, 9.0))
    else:
        step_time = rng.uniform(0.3, 3.0)
    story = Story(
        name=f"{family}-{index}", family=family, seed=seed, total=total, source=source, interval_s=interval,
        step_time_s=step_time, hours=hours,
        base=rng.uniform(0.25, 0.55) * total, act=rng.uniform(0.08, 0.2) * total, seq_skew=rng.uniform(1.0, 3.0),
        grain=rng.choice((2, 20, 20, 64)) * MiB, warm_kind=rng.choice(("exp", "compile")),
        warm=rng.uniform(0.02, 0.12) * total, warm_s=60.0 * rng.uniform(5.0, 20.0),
        jitter_sigma=rng.uniform(2.0, 40.0) * MiB, ctx=rng.uniform(300.0, 900.0) * MiB,
        drift_sigma=rng.uniform(0.0, 30.0) * MiB, drift_tau_s=60.0 * rng.uniform(2.0, 30.0),
    )
    return story, rng


def _leak_rate_for_oom(story: Story, rng: random.Random, ranges: Ranges) -> float:
    room = story.total - story.ctx - story.base - story.warm - story.act
    return room / (3600.0 * rng.uniform(*ranges.oom_hours))


def _noisy(story: Story, ranges: Ranges) -> Story:
    """A100-like readings: +-300 MiB of white jitter, a third of it wandering slowly, rare spikes."""
    return replace(story, jitter_uniform=ranges.noisy_mib * MiB, drift_sigma=ranges.noisy_mib * MiB / 3,
                   spike_prob=0.02, spike_max=0.012 * story.total)


def _leaking(family: str, story: Story, rng: random.Random, ranges: Ranges) -> Story:
    hours = story.hours
    onset = 3600.0 * rng.uniform(1.5, min(5.0, hours / 2))  # after a plateau
    if family == "leak_from_start":
        rate = rng.uniform(*ranges.start_rise_mib_per_min) * MiB / 60.0
        return replace(story, leak_rate=rate, leak_onset_s=0.0, warm_kind=rng.choice(("none", "exp")),
                       base=min(story.base, story.total * 0.4))
    if family == "staircase_leak":
        cadence = 60.0 * rng.choice(ranges.cadences_min)
        chunk = rng.uniform(0.012, 0.04) * story.total
        onset = rng.choice((0.0, onset))
        chunk = min(chunk, 0.8 * (story.total - story.base - story.warm - story.act) / max(1.0, (hours * 3600 - onset)
                                                                                           / cadence))
        return replace(story, leak_chunk=chunk, leak_cadence_s=cadence, leak_rate=chunk / cadence, leak_onset_s=onset)
    if family == "segment_leak":
        grain = int(rng.uniform(0.012, 0.03) * story.total) // MiB * MiB
        rate = _leak_rate_for_oom(story, rng, ranges)
        return replace(story, grain=grain, leak_rate=rate, leak_onset_s=onset, seq_skew=rng.uniform(1.0, 1.5))
    rate = _leak_rate_for_oom(story, rng, ranges)
    story = replace(story, leak_rate=rate, leak_onset_s=onset)
    if family == "noisy_leak":
        return _noisy(story, ranges)
    if family == "leak_with_checkpoints":
        return replace(story, ckpt_every_s=60.0 * rng.uniform(20.0, 60.0), ckpt_extra=story.act * rng.uniform(1.1, 1.6),
                       eval_every_s=60.0 * rng.uniform(30.0, 90.0), eval_s=60.0 * rng.uniform(2.0, 8.0),
                       eval_extra=story.act * rng.uniform(0.5, 1.3))
    return story  # leak_after_plateau


def _clean(family: str, story: Story, rng: random.Random, ranges: Ranges) -> Story:
    warm_s = 60.0 * rng.uniform(*ranges.warm_min)
    if family == "warmup_ramp":
        return replace(story, warm_kind="ramp", warm_s=warm_s, warm=rng.uniform(0.05, 0.25) * story.total)
    if family == "warmup_compile":
        return replace(story, warm_kind="compile", warm_s=warm_s, warm=rng.uniform(0.05, 0.2) * story.total)
    if family == "warmup_slow":
        return replace(story, warm_kind="exp", warm_s=warm_s, warm=rng.uniform(0.05, 0.25) * story.total)
    if family == "variable_batches":
        return replace(story, act=rng.uniform(0.15, 0.3) * story.total, seq_skew=rng.uniform(3.0, 8.0))
    if family == "checkpoint":
        return replace(story, ckpt_every_s=60.0 * rng.uniform(15.0, 120.0),
                       ckpt_extra=story.act * rng.uniform(1.1, 1.8))
    if family == "eval":
        return replace(story, eval_every_s=60.0 * rng.uniform(20.0, 90.0), eval_s=60.0 * rng.uniform(2.0, 10.0),
                       eval_extra=story.act * rng.uniform(0.5, 1.5), eval_empty_cache=rng.random() < 0.5)
    if family == "restart":
        return replace(story, restart_at_s=3600.0 * rng.uniform(1.5, story.hours - 3.0),
                       restart_gap_s=60.0 * rng.uniform(1.0, 10.0))
    if family == "noisy_plateau":
        return _noisy(story, ranges)
    return story  # plateau


def story(family: str, index: int, split: str = "tune") -> Story:
    """The ``index``-th story of ``family`` in ``split`` (deterministic)."""
    ranges = SPLITS[split]
    base, rng = _base_story(family, index, ranges)
    base = replace(base, name=f"{split}/{family}-{index}")
    if family in LEAK_FAMILIES:
        return _leaking(family, base, rng, ranges)
    return _clean(family, base, rng, ranges)


def stories(split: str = "tune", per_family: int = 6) -> list[Story]:
    return [story(family, i, split) for family in FAMILIES for i in range(per_family)]


def corpus(split: str = "tune", per_family: int = 6) -> Iterator[DeviceTrace]:
    """Every story of the split, simulated (one at a time: a trace holds up to ~40k samples)."""
    for s in stories(split, per_family):
        yield simulate(s)
