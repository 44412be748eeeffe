"""The trend engine on device memory alone: what dcgm-exporter, nvidia-smi and a hook without the
allocator's fields give it (schema-2 samples with device used and capacity only).

Each series is written here, sample by sample, from a story with a known truth; time runs on the
wall clock of the source (a reading every 15 s), steps on its own clock: a row ordinal for
nvidia-smi, the unix second for dcgm, the training step for a hook.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vramwatch import wire
from vramwatch.engine import TrendEngine

MiB = 1 << 20
GiB = 1 << 30
TOTAL = 80 * GiB
START = 1.75e9
EVERY_S = 15.0
#: step clocks: nvidia-smi numbers its rows, dcgm's step is the unix second, a hook's the training step (0.5 s)
CLOCKS: dict[str, Callable[[int, float], int]] = {
    "nvidia-smi": lambda i, t: i,
    "dcgm": lambda i, t: round(START + t),
    "hook": lambda i, t: round(t / 0.5),
}
_NULL = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "active_bytes", "inactive_split_bytes",
         "alloc_retries", "ooms", "process_used_bytes")


def device_series(level: Callable[[float], float], hours: float, clock: str, jitter_mib: float = 0.0,
                  seed: int = 0) -> Iterator[dict[str, Any]]:
    """Device used every 15 s for ``hours``: ``level(t)`` (bytes at t seconds) plus uniform reading jitter
    of +- ``jitter_mib``, in whole MiB as nvidia-smi and dcgm report it."""
    rng = random.Random(seed)
    for i in range(int(hours * 3600 / EVERY_S)):
        t = i * EVERY_S
        used = level(t) + rng.uniform(-jitter_mib, jitter_mib) * MiB
        sample = {"schema": 2, "run": "r", "host": "h", "rank": 0, "step": CLOCKS[clock](i, t), "ts": START + t,
                  "phase": "train", "total_bytes": TOTAL, "nvml_used_bytes": int(used) // MiB * MiB,
                  **dict.fromkeys(_NULL)}
        yield wire.validate(sample)


def judge(samples: Iterator[dict[str, Any]]) -> tuple[TrendEngine, list[dict[str, Any]]]:
    engine = TrendEngine()
    events = []
    for sample in samples:
        events += [dict(e, ts=sample["ts"]) for e in engine.update(sample)]
    return engine, events


def leaks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "leak"]


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize("jitter_mib", [0.0, 300.0])
def test_a_leak_from_the_first_sample_is_found_within_four_hours_with_its_time_to_oom(clock: str,
                                                                                        jitter_mib: float) -> None:
    # +6 MiB per 15 s reading from the very first, on an 80 GiB card: 14 h from 60 GiB to the wall
    rate = 6 * MiB / EVERY_S

    def level(t: float) -> float:
        return 60 * GiB + rate * t

    engine, events = judge(device_series(level, 6.0, clock, jitter_mib))
    found = leaks(events)
    assert found, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    leak = found[0]
    hours = (leak["ts"] - START) / 3600
    assert hours <= 4.0
    assert leak["source"] == "device" and leak["signal"] == "device_used"
    # the time to OOM it projects against what was actually left then
    left = (TOTAL - level(leak["ts"] - START)) / rate
    assert leak["seconds_to_oom"] == pytest.approx(left, rel=0.25)
    assert leak["steps_to_oom"] > 0
    summary = engine.summary()
    assert summary["state"] == "leak" and summary["seconds_to_oom"] is not None


def _ramp(minutes: float, rise: float) -> Callable[[float], float]:
    return lambda t: 30 * GiB + rise * min(1.0, t / (60 * minutes))


def _approach(minutes: float, rise: float) -> Callable[[float], float]:
    return lambda t: 30 * GiB + rise * (1.0 - math.exp(-4.0 * t / (60 * minutes)))


def _compile_steps(minutes: float, rise: float) -> Callable[[float], float]:
    # new shapes compiled at ever longer gaps (each twice the last), the last one at `minutes`
    jumps = [60 * minutes * 2.0 ** -k for k in range(5)]
    return lambda t: 30 * GiB + rise * sum(1 for at in jumps if t >= at) / len(jumps)


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize("shape", [_ramp, _approach, _compile_steps])
@pytest.mark.parametrize("jitter_mib", [0.0, 300.0])
def test_a_forty_minute_warm_up_that_then_holds_is_no_leak(clock: str, shape: Callable[..., Any],
                                                           jitter_mib: float) -> None:
    # 12 GiB (15 % of the card) over 40 minutes, then flat for 8 hours
    engine, events = judge(device_series(shape(40.0, 12 * GiB), 8.0, clock, jitter_mib, seed=3))
    assert leaks(events) == [], [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    assert engine.summary()["state"] == "plateau"


def _staircase(onset_h: float, every_min: float, step: float) -> Callable[[float], float]:
    """A plateau, then a tensor kept every `every_min` minutes (a step of `step` bytes each)."""
    def level(t: float) -> float:
        kept = max(0, math.floor((t - 3600 * onset_h) / (60 * every_min)) + 1) if t >= 3600 * onset_h else 0
        return 40 * GiB + step * kept
    return level


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize("every_min", [10.0, 30.0])
def test_a_staircase_of_ratchets_is_a_leak_with_a_runway(clock: str, every_min: float) -> None:
    step = 1.5 * GiB  # about 2 % of the card at every step: each a plateau break of its own
    onset_h = 2.0
    level = _staircase(onset_h, every_min, step)
    engine, events = judge(device_series(level, onset_h + 9 * every_min / 60, clock, 50.0, seed=5))
    found = leaks(events)
    assert found, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    leak = found[0]
    assert leak["source"] == "device"
    rate = step / (60 * every_min)  # bytes per second, over the staircase
    oom_s = 3600 * onset_h + (TOTAL - level(0)) / rate
    # found while at least half of the way from the first step to the wall is still ahead
    assert (oom_s - (leak["ts"] - START)) / (oom_s - 3600 * onset_h) >= 0.5
    left = (TOTAL - level(leak["ts"] - START)) / rate
    assert leak["seconds_to_oom"] == pytest.approx(left, rel=0.35)
    assert engine.summary()["state"] == "leak"  # the staircase goes on: so does the verdict


def test_one_time_ratchets_and_a_decelerating_staircase_are_no_leak() -> None:
    # a checkpoint's ratchet at 1 h, an eval's at 1.6 h, then new shapes compiled at ever longer gaps
    def level(t: float) -> float:
        value = 40 * GiB + (2 * GiB if t >= 3600 else 0) + (1.5 * GiB if t >= 1.6 * 3600 else 0)
        return value + sum(GiB for at in (3.0, 6.0, 12.0) if t >= at * 3600)

    for clock in CLOCKS:
        _, events = judge(device_series(level, 14.0, clock, 100.0, seed=7))
        assert leaks(events) == [], (clock, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events])


def test_an_oom_already_counted_on_the_first_sample_raises_an_oom_event() -> None:
    engine = TrendEngine()
    sample = wire.validate({"schema": 2, "run": "r", "host": "h", "rank": 0, "step": 1200, "ts": START,
                            "phase": "train", "total_bytes": TOTAL, "nvml_used_bytes": 70 * GiB, "ooms": 2})
    events = engine.update(sample)
    assert [(e["type"], e["ooms"], e["step"]) for e in events] == [("oom", 2, 1200)]
    # the same count on the next sample is no new OOM; one more is
    assert engine.update(dict(sample, step=1201, ts=START + 15)) == []
    assert [e["type"] for e in engine.update(dict(sample, step=1202, ts=START + 30, ooms=3))] == ["oom"]


def _neighbour(seed: int, size: float) -> Callable[[float], float]:
    """Another process's ``size`` bytes on the device, on and off for 1-30 min at a time."""
    rng = random.Random(seed)
    flips, t = [], 0.0
    while t < 24 * 3600:
        t += 60 * rng.uniform(1.0, 30.0)
        flips.append(t)
    return lambda t: size * (sum(1 for at in flips if at <= t) % 2)


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_another_process_coming_and_going_builds_no_staircase(clock: str, seed: int) -> None:
    # a 40 GiB plateau on a 40 GiB-class share of the card; a neighbour's 0.4-0.8 GiB comes and goes
    other = _neighbour(seed, (0.4 + 0.1 * seed) * GiB)
    engine, events = judge(device_series(lambda t: 40 * GiB + other(t), 9.0, clock, 20.0, seed=seed))
    assert leaks(events) == [], [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    assert engine.summary()["state"] != "leak"


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize(("total_gib", "steps"), [
    (80, ((19, 2.4), (23, 2.4), (35, 1.8), (37, 2.2), (54, 2.2))),  # read as a straight line at the fit's points
    (40, ((15, 1.9), (21, 2.1), (41, 2.5), (57, 2.1))),  # a young staircase filling the card in under an hour
])
def test_nccl_buffers_set_up_in_a_few_irregular_steps_are_no_leak(clock: str, total_gib: int,
                                                                  steps: tuple[tuple[float, float], ...]) -> None:
    # a communicator's buffers outside the allocator: a few ~2 GiB steps at irregular moments over the
    # first hour (minutes, GiB), after a 10-minute warm-up, then nothing for hours
    base = 0.45 * total_gib * GiB

    def level(t: float) -> float:
        return base + 2 * GiB * (1 - math.exp(-4 * t / 600)) + GiB * sum(size for at, size in steps if 60 * at <= t)

    samples = ({**s, "total_bytes": total_gib * GiB} for s in device_series(level, 5.0, clock, 20.0, seed=7))
    engine, events = judge(samples)
    assert leaks(events) == [], [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    assert engine.summary()["state"] != "leak"


@pytest.mark.parametrize("clock", list(CLOCKS))
def test_a_staircase_whose_gaps_vary_threefold_is_a_leak_with_a_range(clock: str) -> None:
    gaps_min = [14, 40, 18, 36, 12, 33, 22, 39, 15, 30, 25, 13, 37]  # 12 to 40 min apart
    at = [3600 * 1.5 + 60 * sum(gaps_min[: k + 1]) for k in range(len(gaps_min))]
    step = 1.6 * GiB

    def level(t: float) -> float:
        return 40 * GiB + step * sum(1 for a in at if a <= t)

    _, events = judge(device_series(level, at[-1] / 3600 + 0.2, clock, 50.0, seed=9))
    found = leaks(events)
    assert found, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    leak = found[0]
    rate = step * len(at) / (at[-1] - at[0] + 60 * gaps_min[0])
    left = (TOTAL - level(leak["ts"] - START)) / rate
    assert leak["seconds_to_oom"] == pytest.approx(left, rel=0.35)
    assert leak["seconds_to_oom_low"] <= leak["seconds_to_oom"] <= leak["seconds_to_oom_high"]


@pytest.mark.parametrize("clock", list(CLOCKS))
def test_a_fast_leak_in_a_young_process_is_an_alarm_with_its_forecast(clock: str) -> None:
    # a warm-up of 10 min to 45 GiB, a leak from minute 25 filling the card in 1.5 h: the process
    # would die long before any verdict by age (two warm-up horizons)
    onset, fill = 25 * 60.0, 1.5 * 3600
    rate = (TOTAL - 45 * GiB) / fill

    def level(t: float) -> float:
        return 35 * GiB + 10 * GiB * (1 - math.exp(-4 * t / 600)) + rate * max(0.0, t - onset)

    _, events = judge(device_series(level, (onset + fill) / 3600 - 0.05, clock, 30.0, seed=4))
    found = leaks(events)
    assert found, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    leak = found[0]
    detected = leak["ts"] - START
    # found with a good part of the runway left (nvidia-smi's 15 s rows make 8-minute blocks: later)
    assert (onset + fill - detected) / fill >= (0.25 if clock == "nvidia-smi" else 0.4)
    assert leak["seconds_to_oom"] == pytest.approx(onset + fill - detected, rel=0.25)


def test_a_warm_up_fast_at_first_that_slows_down_stays_a_warm_up() -> None:
    # a quarter of the card in the first 20 minutes, slowing all the way
    for clock in CLOCKS:
        _, events = judge(device_series(_approach(30.0, 20 * GiB), 6.0, clock, 30.0, seed=6))
        assert leaks(events) == [], (clock, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events])


def test_memory_vanishing_near_full_is_a_suspected_oom_and_a_restart_at_a_plateau_is_not() -> None:
    rate = 20 * MiB / EVERY_S
    oom_t = (TOTAL - 2 * GiB - 50 * GiB) / rate  # the leak meets the card 2 GiB short of full

    def dies(t: float) -> float:
        return 0.4 * GiB if t > oom_t else 50 * GiB + rate * t

    def restarts(t: float) -> float:
        return 0.4 * GiB if 3 * 3600 < t < 3 * 3600 + 300 else 40 * GiB

    for clock in CLOCKS:
        _, events = judge(device_series(dies, oom_t / 3600 + 0.3, clock, 10.0))
        said = [e for e in events if e["type"] == "suspected_oom"]
        assert [e["reason"] for e in said] in (["near_full"], ["top_of_climb"]), (clock, said)
        assert abs(said[0]["ts"] - START - oom_t) <= 600
        assert said[0]["used_before_bytes"] > 0.9 * TOTAL and said[0]["used_after_bytes"] < GiB
        _, events = judge(device_series(restarts, 6.0, clock, 10.0))
        assert [e for e in events if e["type"] == "suspected_oom"] == []


def _kept_every(onset_h: float, gaps_min: list[float], step: float) -> list[float]:
    """Times (s) a tensor of ``step`` bytes is kept: from ``onset_h``, at ``gaps_min`` apart, over and over."""
    at, t = [], 3600 * onset_h
    while t < 24 * 3600:
        for gap in gaps_min:
            t += 60 * gap
            at.append(t)
    return at


@pytest.mark.parametrize("clock", list(CLOCKS))
def test_a_staircase_with_a_neighbour_coming_and_going_is_forecast_within_a_quarter(clock: str) -> None:
    # 1.2 GiB kept every 15-30 min from 1.5 h on a 40 GiB plateau, while another process's 0.6 GiB
    # comes and goes every 1-30 min (ten neighbours): its moves are no steps of the leak, nor its rate
    kept = _kept_every(1.5, [22.0, 15.0, 30.0, 18.0, 25.0], 1.2 * GiB)
    rate = 1.2 * GiB / (60 * 22.0)  # the mean gap: 22 min

    def own(t: float) -> float:
        return 40 * GiB + 1.2 * GiB * sum(1 for a in kept if a <= t)

    within = inside = 0
    for seed in range(1, 11):
        other = _neighbour(seed, 0.6 * GiB)
        _, events = judge(device_series(lambda t, other=other: own(t) + other(t), 12.0, clock, 20.0, seed=seed))
        found = leaks(events)
        assert found, (seed, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events])
        leak = found[0]
        left = (TOTAL - own(leak["ts"] - START)) / rate
        within += abs(leak["seconds_to_oom"] / left - 1) <= 0.25
        inside += leak["seconds_to_oom_low"] <= left <= leak["seconds_to_oom_high"]
        assert leak["seconds_to_oom_low"] <= leak["seconds_to_oom"] <= leak["seconds_to_oom_high"]
    # four or five steps seen whose gaps vary 2x: most forecasts within a quarter, the range holding most
    assert within >= 7 and inside >= 7, (within, inside)


@pytest.mark.parametrize("clock", list(CLOCKS))
def test_a_leak_whose_neighbour_leaves_during_its_rise_is_forecast_at_its_own_rate(clock: str) -> None:
    # 4 GiB/h from 2 h on a 40 GiB plateau; another process's 0.8 GiB, there from the start, leaves
    # 20 min into the rise: read across that fall the slope is a third short, with it out it is the leak's
    rate = 4 * GiB / 3600

    def own(t: float) -> float:
        return 40 * GiB + rate * max(0.0, t - 7200)

    engine, events = judge(device_series(lambda t: own(t) + (0.8 * GiB if t < 7200 + 1200 else 0.0), 8.0,
                                         clock, 20.0, seed=1))
    found = leaks(events)
    assert found, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    leak = found[0]
    left = (TOTAL - own(leak["ts"] - START)) / rate
    assert leak["seconds_to_oom"] == pytest.approx(left, rel=0.15)
    # the summary carries the forecast and its range (the collector, /metrics and analyze read it there)
    summary = engine.summary()
    assert summary["state"] == "leak"
    assert summary["seconds_to_oom_low"] <= summary["seconds_to_oom"] <= summary["seconds_to_oom_high"]


@pytest.mark.parametrize("clock", list(CLOCKS))
@pytest.mark.parametrize(("total_gib", "size_gib", "there_first"), [(80, 1.8, False), (40, 1.0, False),
                                                                    (80, 1.8, True)])
def test_a_large_neighbour_coming_and_going_is_no_sawtooth_and_the_leak_beneath_is_found(
        clock: str, total_gib: int, size_gib: float, there_first: bool) -> None:
    # another process's memory, more than twice the material size, on and off for 1-30 min at a time:
    # its leaving is no clear of this process's memory (its floor only ratchets), so the rise is not
    # judged on the troughs of a two-hour "sawtooth"; a leak from 1.5 h filling the card by 7 h is found.
    # There first, its first leaving looks like a clear until it comes back
    total = total_gib * GiB
    off_first = _neighbour(11, size_gib * GiB)
    other = (lambda t: size_gib * GiB - off_first(t)) if there_first else off_first
    rate = 0.45 * total / (5.5 * 3600)

    def level(t: float) -> float:
        return 0.45 * total + rate * max(0.0, t - 5400) + other(t)

    samples = ({**s, "total_bytes": total} for s in device_series(level, 6.0, clock, 20.0, seed=5))
    engine, events = judge(samples)
    assert engine.ctx.pyramid.saw_period == 0
    found = leaks(events)
    assert found, [(e["type"], round((e["ts"] - START) / 3600, 2)) for e in events]
    detected = found[0]["ts"] - START
    assert 5400 < detected < 5 * 3600
    left = (total - 0.45 * total - rate * (detected - 5400)) / rate
    assert found[0]["seconds_to_oom"] == pytest.approx(left, rel=0.25)
