"""Estimators, robustness (hypothesis), bounded memory and `analyze` streaming."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramwatch import wire
from vramwatch.engine import EngineConfig, TrendEngine
from vramwatch.engine.analyze import analyze_paths, format_table
from vramwatch.engine.stats import mann_kendall_z, noise_sigma, rolling_min, theil_sen
from vramwatch.probe.simulated import simulate_trace
from vramwatch.wire.structs import as_sample

GB = 1_000_000_000
TOTAL = 80 * GB

# ---------------------------------------------------------------- estimators


def test_theil_sen_ignores_a_minority_of_wild_points() -> None:
    xs = list(range(20))
    ys = [3.0 * x + 10 for x in xs]
    for i in (2, 7, 13, 17):
        ys[i] = 1e6  # four wild points out of twenty
    assert theil_sen(xs, ys) == pytest.approx(3.0)
    ols = sum((x - 9.5) * (y - sum(ys) / 20) for x, y in zip(xs, ys, strict=True)) / sum((x - 9.5) ** 2 for x in xs)
    assert abs(ols - 3.0) > 100  # least squares is dragged away by the same points


def test_mann_kendall_sees_trend_and_hamed_rao_discounts_autocorrelation() -> None:
    rng = random.Random(7)
    trend = [0.5 * i + rng.gauss(0, 1) for i in range(16)]
    assert mann_kendall_z(trend) > 3
    flat = [rng.gauss(0, 1) for _ in range(16)]
    assert abs(mann_kendall_z(flat)) < 2.6
    # a random walk wanders monotonically for a while: the plain test would call it a trend
    walk, level = [], 0.0
    for _ in range(16):
        level = 0.95 * level + rng.gauss(0.6, 0.2)
        walk.append(level)
    plain_var = 16 * 15 * 37 / 18
    s = sum((walk[j] > walk[i]) - (walk[j] < walk[i]) for i in range(16) for j in range(i + 1, 16))
    plain_z = (s - 1) / plain_var**0.5
    assert mann_kendall_z(walk) <= plain_z


def test_noise_sigma_is_trend_insensitive_and_rolling_min_is_the_floor() -> None:
    rng = random.Random(3)
    ys = [1000.0 * i + rng.gauss(0, 10) for i in range(200)]
    assert 5 < noise_sigma(ys) < 20  # the slope of 1000 per point does not leak in
    assert rolling_min([5, 3, 4, 9, 1, 2], 3) == [5, 3, 3, 3, 1, 1]


# ---------------------------------------------------------------- property: never raises


def _sample(step: int, **fields: Any) -> dict[str, Any]:
    base = {
        "schema": 1, "run": "r", "host": "h", "rank": 0, "step": step, "ts": 1.7e9 + step,
        "phase": "train", "allocated_bytes": 0, "reserved_bytes": 0, "peak_allocated_bytes": 0,
        "inactive_split_bytes": 0, "alloc_retries": 0, "ooms": 0, "nvml_used_bytes": None,
        "total_bytes": TOTAL,
    }
    base.update(fields)
    return base


@st.composite
def sample_sequences(draw: st.DrawFn) -> list[dict[str, Any]]:
    n = draw(st.integers(1, 150))
    out = []
    step = draw(st.integers(0, 10))
    for _ in range(n):
        step = max(0, step + draw(st.sampled_from([1, 1, 1, 2, 7, 0, -3, -50, 300])))
        reserved = draw(st.integers(0, TOTAL))
        # cudaMallocAsync reports reserved only as a bound: allocated may exceed it
        allocator = draw(st.sampled_from(["native", "native", "cudaMallocAsync"]))
        allocated = draw(st.integers(0, reserved if allocator == "native" else TOTAL))
        peak = draw(st.integers(allocated, max(allocated, reserved)))
        used = draw(st.one_of(st.none(), st.integers(reserved, TOTAL)))
        out.append(
            _sample(
                step,
                ts=1.7e9 + draw(st.floats(0, 1e7)),
                phase=draw(st.sampled_from(["train", "train", "train", "checkpoint", "eval", "x:y"])),
                allocated_bytes=allocated,
                reserved_bytes=reserved,
                peak_allocated_bytes=peak,
                inactive_split_bytes=draw(st.integers(0, max(0, reserved - allocated))),
                allocator=allocator,
                alloc_retries=draw(st.integers(0, 5)),
                ooms=draw(st.integers(0, 3)),
                nvml_used_bytes=used,
                incarnation=draw(st.sampled_from([None, "a", "b"])),
            )
        )
    return out


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample_sequences(), st.sampled_from([4, 32]))
def test_engine_never_raises_on_valid_samples(samples: list[dict[str, Any]], block: int) -> None:
    engine = TrendEngine(EngineConfig(block_steps=block, min_blocks=4))
    for raw in samples:
        sample = wire.validate(raw)
        events = engine.update(sample)
        for event in events:
            assert isinstance(event["step"], int) and event["type"]
        assert engine.state in ("warmup", "plateau", "rising", "leak", "fragmentation")
    summary = engine.summary()
    json.dumps(summary)  # serialisable for the API
    assert summary["total_bytes"] == TOTAL


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 40)), min_size=2, max_size=120))
def test_any_counter_going_backwards_is_a_restart(counters: list[tuple[int, int, int]]) -> None:
    engine = TrendEngine()
    step, previous = 0, None
    for retries, ooms, advance in counters:
        step += advance
        events = engine.update(_sample(step, alloc_retries=retries, ooms=ooms, reserved_bytes=GB,
                                       allocated_bytes=GB // 2, peak_allocated_bytes=GB))
        kinds = [e["type"] for e in events]
        went_back = previous is not None and (retries < previous[0] or ooms < previous[1])
        assert ("restart" in kinds) == went_back
        # a new OOM in the same process is reported; a new process counts from its own start, so
        # one that already counts OOMs on its first sample (the trace's first, or after a restart) had one
        baseline = 0 if previous is None or went_back else previous[1]
        assert ("oom" in kinds) == (ooms > baseline)
        previous = (retries, ooms)


def test_counters_going_backwards_are_a_restart() -> None:
    engine = TrendEngine()
    for step in range(1, 50):
        engine.update(_sample(step, alloc_retries=4, ooms=1, reserved_bytes=GB, allocated_bytes=GB // 2,
                              peak_allocated_bytes=GB))
    events = engine.update(_sample(50, alloc_retries=0, ooms=0, reserved_bytes=GB, allocated_bytes=GB // 2,
                                   peak_allocated_bytes=GB))
    assert [e["type"] for e in events] == ["restart"]
    assert engine.state == "warmup"
    # step going back without an incarnation id: a restart too
    events = engine.update(_sample(10, reserved_bytes=GB, allocated_bytes=GB // 2, peak_allocated_bytes=GB))
    assert [e["type"] for e in events] == ["restart"] and events[0]["from_step"] == 50
    # an OOM counted by the new process is reported once
    events = engine.update(_sample(11, ooms=1, reserved_bytes=GB, allocated_bytes=GB // 2, peak_allocated_bytes=GB))
    assert [e["type"] for e in events] == ["oom"]


def test_late_sample_of_the_same_process_is_not_a_restart() -> None:
    engine = TrendEngine()
    for step in range(1, 100):
        engine.update(_sample(step, incarnation="p1", reserved_bytes=GB, allocated_bytes=GB // 2,
                              peak_allocated_bytes=GB))
    assert engine.update(_sample(40, incarnation="p1", reserved_bytes=GB, allocated_bytes=GB // 2,
                                 peak_allocated_bytes=GB)) == []
    assert engine.out_of_order == 1
    assert engine.update(_sample(40, incarnation="p2"))[0]["type"] == "restart"


def test_memory_stays_bounded_over_a_long_series() -> None:
    engine = TrendEngine(EngineConfig(max_events=50))
    rng = random.Random(1)
    level = 30 * GB
    for step in range(1, 200_001):
        if step % 5000 == 0:
            level += GB  # a staircase: breaks and plateaus, many events
        allocated = level + rng.randrange(0, 50_000_000)
        engine.update(_sample(step, allocated_bytes=allocated, reserved_bytes=level + 20 * GB,
                              peak_allocated_bytes=allocated + 10 * GB, nvml_used_bytes=level + 21 * GB))
    assert len(engine.events) <= 50
    assert all(len(level.blocks) <= engine.config.ring_blocks for level in engine.ctx.pyramid.levels)
    assert all(len(level.pending) < 4 for level in engine.ctx.pyramid.levels)
    # the coarsest level covers the whole run in at most ring_blocks summaries
    assert engine.ctx.pyramid.levels[-1].span * engine.config.ring_blocks >= 200_000


def test_irregular_sampling_every_tenth_step_still_finds_a_leak() -> None:
    engine = TrendEngine()
    events = []
    for sample in simulate_trace("fast_leak", steps=7000, seed=5, sample_every=10, stall_prob=0.05,
                                 step_time_jitter=0.5):
        events += engine.update(sample)
    leaks = [e for e in events if e["type"] == "leak"]
    assert leaks and 1500 < leaks[0]["step"] < 3000
    assert leaks[0]["slope_bytes_per_step"] == pytest.approx(2.5e-5 * 143_771 * 2**20, rel=0.3)


def test_without_nvml_the_engine_still_judges_the_allocator() -> None:
    engine = TrendEngine()
    events = []
    for sample in simulate_trace("fast_leak", steps=5000, seed=2, total_bytes=80 * 2**30):
        sample["nvml_used_bytes"] = None
        sample.pop("process_used_bytes")
        events += engine.update(sample)
    assert any(e["type"] == "leak" and e["source"] == "allocator" for e in events)
    assert engine.summary()["outside_allocator_bytes"] is None


# ---------------------------------------------------------------- analyze


def _write_run(path: Path, scenario: str, ranks: range, steps: int = 4000, gz: bool = False, **kw: Any) -> None:
    lines = []
    for rank in ranks:
        lines += [orjson.dumps(s) for s in simulate_trace(scenario, steps=steps, rank=rank, seed=9, run="job", **kw)]
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if gz else data)


def test_analyze_streams_files_and_reports_per_series(tmp_path: Path) -> None:
    _write_run(tmp_path / "a.jsonl", "multi_rank", range(0, 2))
    _write_run(tmp_path / "b.jsonl.gz", "multi_rank", range(2, 4), gz=True)
    doc = analyze_paths([tmp_path / "a.jsonl", str(tmp_path / "b.jsonl.gz")])
    assert [(s["run"], s["host"], s["rank"]) for s in doc["series"]] == [("job", "sim-host", r) for r in range(4)]
    by_rank = {s["rank"]: s for s in doc["series"]}
    assert by_rank[3]["state"] == "leak"
    leak = next(e for e in by_rank[3]["events"] if e["type"] == "leak")
    assert set(leak) >= {"type", "step", "slope_bytes_per_step", "steps_to_oom", "seconds_to_oom", "source"}
    for rank in (0, 1, 2):
        assert by_rank[rank]["state"] == "plateau"
        assert not any(e["type"] == "leak" for e in by_rank[rank]["events"])
    spikes = [e for e in by_rank[0]["events"] if e["type"] == "checkpoint_spike"]
    assert [e["step"] for e in spikes] == [1000, 2000, 3000, 4000]
    assert all(set(e) >= {"peak_bytes", "above_plateau_bytes", "headroom_bytes"} for e in spikes)
    json.dumps(doc)
    table = format_table(doc)
    assert "LEAK" in table and "rank 3" in table and "MiB/step" in table
    rows = [line.split() for line in table.splitlines() if line.startswith("job ")]
    assert [row[2] for row in rows if row[2].isdigit()] == ["0", "1", "2", "3"]  # one row per series
    assert [row[3] for row in rows if row[2].isdigit()] == ["plateau", "plateau", "plateau", "LEAK"]


def test_analyze_names_the_bad_line_and_field(tmp_path: Path) -> None:
    good = next(simulate_trace("healthy", steps=1))
    bad = dict(good, reserved_bytes=-5)
    path = tmp_path / "t.jsonl"
    path.write_bytes(orjson.dumps(good) + b"\n" + orjson.dumps(bad) + b"\n")
    with pytest.raises(wire.WireError) as info:
        analyze_paths([path], strict=True)
    assert info.value.field == f"{path}:2: reserved_bytes"
    path.write_bytes(orjson.dumps(good) + b"\n{not json\n")
    with pytest.raises(wire.WireError, match=r"t\.jsonl:2"):
        analyze_paths([path], strict=True)


def test_analyze_skips_and_counts_bad_lines_by_default(tmp_path: Path) -> None:
    samples = [dict(s, run="r") for s in simulate_trace("healthy", steps=600, seed=2)]
    lines = [orjson.dumps(s) for s in samples]
    lines[9] = b"{not json"
    lines[99] = orjson.dumps(dict(samples[99], reserved_bytes=-5))
    lines[199] = b"   "  # a blank line is no sample and no error
    lines[299] = b"[1, 2]"
    path = tmp_path / "messy.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    doc = analyze_paths([path])
    assert doc["skipped_lines"] == 3
    assert doc["bad_lines"][0].startswith(f"{path}:10: invalid JSON")
    assert doc["bad_lines"][1] == f"{path}:100: reserved_bytes: must be between 0 and 2**53, got -5"
    assert doc["bad_lines"][2].startswith(f"{path}:300: sample: must be a JSON object")
    (item,) = doc["series"]
    assert item["samples"] == len(samples) - 4
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"\n".join(orjson.dumps(s) for i, s in enumerate(samples) if i not in (9, 99, 199, 299)))
    assert analyze_paths([clean])["series"][0]["summary"] == item["summary"]  # skipping changes nothing else
    # the CLI: exit 0 with the count on stderr; --strict stops at the first bad line with exit 2
    run = [sys.executable, "-m", "vramwatch", "analyze", str(path)]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "skipped 3 bad lines" in result.stderr and f"{path}:10" in result.stderr
    strict = subprocess.run([*run, "--strict"], capture_output=True, text=True, timeout=120)
    assert strict.returncode == 2 and f"{path}:10" in strict.stderr and "Traceback" not in strict.stderr
    assert len(strict.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), (b"\x1f\x8b\x08\x00garbage", "cannot read"), ("dir", "directory")],
)
def test_analyze_rejects_unreadable_input(tmp_path: Path, content: bytes | str | None, message: str) -> None:
    path = tmp_path / "x.jsonl.gz"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(wire.WireError, match=message):
        analyze_paths([path])


def test_format_table_without_samples() -> None:
    assert format_table({"series": []}) == "no samples\n"


def test_phase_names_map_to_spike_kinds_and_stay_out_of_the_trend() -> None:
    engine = TrendEngine()
    for step in range(1, 40):
        engine.update(_sample(step, reserved_bytes=40 * GB, allocated_bytes=20 * GB, peak_allocated_bytes=30 * GB,
                              nvml_used_bytes=42 * GB))
    kinds = {}
    for phase in ("validation", "ckpt_save", "checkpoint", "profile"):
        (event,) = engine.update(_sample(39, phase=phase, reserved_bytes=40 * GB, allocated_bytes=20 * GB,
                                         peak_allocated_bytes=38 * GB, nvml_used_bytes=42 * GB))
        kinds[phase] = event["type"]
        assert event["peak_bytes"] == 38 * GB
        # still warming up: no plateau to be above, but the training peak seen so far is known
        assert event["above_plateau_bytes"] is None and event["plateau_bytes"] is None
        assert event["training_peak_bytes"] == 30 * GB
        assert event["above_training_peak_bytes"] == 8 * GB and event["below_training_peak"] is False
        # verdicts.headroom_bytes: capacity - what the allocator holds (reserved 40) - outside it (2)
        assert event["headroom_bytes"] == TOTAL - 40 * GB - 2 * GB
    assert kinds == {"validation": "eval_spike", "ckpt_save": "checkpoint_spike", "checkpoint": "checkpoint_spike",
                     "profile": "phase_spike"}
    assert engine.summary()["checkpoint_peak_bytes"] == 38 * GB
    assert engine.ctx.pyramid.blocks[-1].peak == 30 * GB  # the phase peaks never entered a block


# ---------------------------------------------------------------- phase ratchets, labels


def _run(scenario: str, **kw: Any) -> tuple[TrendEngine, list[dict[str, Any]], list[str]]:
    engine = TrendEngine()
    events: list[dict[str, Any]] = []
    states: list[str] = []
    for sample in simulate_trace(scenario, **kw):
        events += engine.update(sample)
        states.append(engine.state)
    return engine, events, states


def test_checkpoint_ratchet_relevels_the_plateau_and_never_shows_rising() -> None:
    engine, events, states = _run("checkpoint", steps=5000, seed=1)
    assert "rising" not in states  # the old engine sat in "rising" for ~700 steps after the first save
    (brk,) = [e for e in events if e["type"] == "plateau_break"]
    assert brk["cause"] == "checkpoint" and brk["relevel"] is True
    assert 1000 <= brk["step"] <= 1100
    summary = engine.summary()
    assert summary["state"] == "plateau" and summary["plateau_relevels"] == 1
    assert summary["plateau_break_cause"] == "checkpoint"
    assert brk["new_plateau_bytes"] - brk["plateau_bytes"] > 0.02 * summary["total_bytes"]  # the ratchet
    # later small ratchets settle the level upwards, nothing more
    assert summary["plateau_bytes"] == pytest.approx(brk["new_plateau_bytes"], rel=0.001)
    assert not any(e["type"] in ("leak", "fragmentation") for e in events)
    doc = {"series": [{"run": "r", "host": "h", "rank": 0, "state": "plateau", "events": events,
                       "samples": engine.samples, "summary": summary}]}
    assert f"step {brk['step']}: plateau re-levelled (checkpoint ratcheted reserved once)" in format_table(doc)


@pytest.mark.parametrize("onset", [1010, 1100, 1500])
def test_leak_after_a_checkpoint_is_found_as_fast_as_without_one(onset: int) -> None:
    found = {}
    for every in (1000, 0):
        _engine, events, _ = _run("checkpoint", steps=4000, seed=1, leak_onset=onset, leak_rate_frac=2e-5,
                                 ckpt_every=every)
        leak = next(e for e in events if e["type"] == "leak")
        assert leak["leak_onset_step"] == leak["onset_step"] >= onset - 32
        found[every] = leak["step"]
    assert found[1000] - found[0] <= 32  # at most one block later than with no checkpoint at all


def test_a_leaking_rank_reports_the_plateau_it_grew_from_and_the_onset() -> None:
    healthy, _, _ = _run("demo", steps=2400, seed=0, rank=1)
    leaking, events, _ = _run("demo", steps=2400, seed=0, rank=5)
    h, s = healthy.summary(), leaking.summary()
    # identical ranks: the leaking one's plateau is not stale (it was 4 GB lower before)
    assert s["plateau_bytes"] == pytest.approx(h["plateau_bytes"], rel=0.002)
    assert s["state"] == "leak"
    assert 700 <= s["leak_onset_step"] < s["leak_detected_step"] <= 1100
    assert s["plateau_since_step"] < s["plateau_until_step"] == s["leak_onset_step"]
    leak = next(e for e in events if e["type"] == "leak")
    assert leak["step"] == s["leak_detected_step"] and leak["leak_onset_step"] == s["leak_onset_step"]
    assert leak["plateau_bytes"] == s["plateau_bytes"] and leak["plateau_since_step"] == s["plateau_since_step"]
    assert h["plateau_until_step"] is None and h["leak_onset_step"] is None
    doc = {"series": [{"run": "r", "host": "h", "rank": 5, "state": "leak", "events": events,
                       "samples": leaking.samples, "summary": s}]}
    assert f"step {leak['step']}: LEAK (allocator) since step {leak['leak_onset_step']}," in format_table(doc)
    # the forecast's range rides in the summary beside it, and the table shows it beside the forecast
    assert s["seconds_to_oom_low"] <= s["seconds_to_oom"] <= s["seconds_to_oom_high"]
    row = next(line for line in format_table(doc).splitlines() if line.startswith("r "))
    assert row.rstrip().endswith(")") and " to " in row.split("  ")[-1]
    # one headroom formula: worst is the lower of step boundary and checkpoint peak
    assert s["worst_headroom_bytes"] == min(s["headroom_bytes"], s["checkpoint_headroom_bytes"])
    assert s["checkpoint_peak_max_bytes"] >= s["checkpoint_peak_bytes"]


def test_a_phase_below_the_training_peak_is_a_non_event_in_words() -> None:
    engine = TrendEngine()
    for step in range(1, 40):
        engine.update(_sample(step, reserved_bytes=40 * GB, allocated_bytes=20 * GB, peak_allocated_bytes=30 * GB,
                              nvml_used_bytes=42 * GB))
    (event,) = engine.update(_sample(39, phase="checkpoint", reserved_bytes=40 * GB, allocated_bytes=20 * GB,
                                     peak_allocated_bytes=25 * GB, nvml_used_bytes=42 * GB))
    assert event["below_training_peak"] is True and event["above_training_peak_bytes"] == -5 * GB
    doc = {"series": [{"run": "r", "host": "h", "rank": 0, "state": "warmup", "events": [event], "samples": 40,
                       "summary": engine.summary()}]}
    text = format_table(doc)
    assert "below the training peak (27.9 GiB)" in text  # 30e9 bytes, in GiB like the dashboard
    assert "+-" not in text and "above plateau" not in text
    # a phase sample that measured no peak is still a phase: an event with nulls, and words to match
    (unmeasured,) = engine.update({k: v for k, v in _sample(40, phase="eval", allocated_bytes=20 * GB).items()
                                   if k not in ("peak_allocated_bytes", "reserved_bytes", "nvml_used_bytes")})
    assert unmeasured["peak_bytes"] is None and unmeasured["above_training_peak_bytes"] is None
    doc["series"][0]["events"] = [unmeasured, event]
    assert "tightest: step 39" in format_table(doc)


@pytest.mark.parametrize("variant", ["allocated_only", "device_used_only"])
def test_analyze_judges_sparse_trace_files_and_says_which_signal(tmp_path: Path, variant: str) -> None:
    from corpus import make_case

    case = make_case("fast_leak", "h200", variant=variant)
    path = tmp_path / f"{variant}.jsonl.gz"
    wire.write_file(path, case.trace(1))
    doc = analyze_paths([path])
    assert doc["skipped_lines"] == 0, doc["bad_lines"]  # schema 2 samples validate as they are
    (item,) = doc["series"]
    summary = item["summary"]
    assert summary["signal"] == ("allocated" if variant == "allocated_only" else "device_used")
    assert "fragmentation" in summary["detectors_off"]
    leak = next(e for e in item["events"] if e["type"] == "leak")
    assert leak["step"] >= case.truth[1]["leak"]["onset"]
    assert "LEAK" in format_table(doc)


# ---------------------------------------------------------------- the decoded-struct path


def _messy_lines() -> list[bytes]:
    """Lines of several processes and sources: leaks, phases, restarts, OOMs, stepped-back and
    replayed samples, lines without incarnation, cudaMallocAsync and sparse (schema 2) lines."""
    rng = random.Random(7)
    samples: list[dict[str, Any]] = []
    for rank, scenario in enumerate(("checkpoint", "crash_resume", "periodic_spikes", "leak_to_oom", "sawtooth")):
        samples += simulate_trace(scenario, steps=2500, rank=rank, seed=rank, total_bytes=TOTAL)
    out = []
    for s in samples:
        roll = rng.random()
        if roll < 0.01:
            s = {k: v for k, v in s.items() if k != "incarnation"}  # one line without it
        elif roll < 0.02:
            s = dict(s, step=max(0, s["step"] - rng.randrange(1, 200)))  # late or stepped back
        elif roll < 0.025:
            s = dict(s, allocator="cudaMallocAsync")  # general rules: a dict, not a struct
        elif roll < 0.03:
            s = dict(s, schema=2, inactive_split_bytes=None, alloc_retries=None)  # sparse
        out.append(orjson.dumps(s))
    return out


def test_the_struct_path_gives_the_same_events_and_summaries_as_the_dict_path() -> None:
    def lazy(line: bytes) -> Any:
        return wire.decode_line(line, lazy=True)

    fast, sample_of = wire.decode_line, as_sample
    by_dict: dict[Any, TrendEngine] = {}
    by_struct: dict[Any, TrendEngine] = {}
    events: dict[str, list[Any]] = {"dict": [], "struct": []}
    structs = 0
    for number, line in enumerate(_messy_lines()):
        plain = fast(line) or wire.validate(orjson.loads(line))
        key = (plain["run"], plain["host"], plain["rank"])
        events["dict"].append(by_dict.setdefault(key, TrendEngine()).update(plain))
        decoded = lazy(line) or wire.validate(orjson.loads(line))
        engine = by_struct.setdefault(key, TrendEngine())
        if isinstance(decoded, dict):
            events["struct"].append(engine.update(decoded))
        else:
            structs += 1
            assert sample_of(decoded) == plain
            events["struct"].append(engine.update_struct(decoded, sample_of))
        if number % 499 == 0:  # a summary mid-block converts the kept struct: nothing may change
            assert engine.summary() == by_dict[key].summary()
    assert structs > 0.9 * len(events["dict"])  # the struct path was taken, not only the fallback
    assert sum(map(len, events["dict"])) > 50  # and the trace raised events to compare
    assert events["struct"] == events["dict"]
    for key, engine in by_dict.items():
        other = by_struct[key]
        assert other.summary() == engine.summary()
        assert list(other.events) == list(engine.events)
        assert (other.samples, other.out_of_order) == (engine.samples, engine.out_of_order)


def test_analyze_gives_the_same_document_with_and_without_the_struct_path(tmp_path, monkeypatch) -> None:
    from vramwatch.engine import analyze

    path = tmp_path / "messy.jsonl"
    path.write_bytes(b"\n".join(_messy_lines()) + b"\n{not json\n")
    lazy_doc = analyze_paths([path])
    monkeypatch.setattr(analyze, "decode_line", lambda line, lazy=False: wire.decode_line(line))  # dicts only
    assert analyze_paths([path]) == lazy_doc
    assert lazy_doc["skipped_lines"] == 1 and sum(len(s["events"]) for s in lazy_doc["series"]) > 50


def test_a_new_series_holds_no_ring_until_its_first_block_closes() -> None:
    engine = TrendEngine()
    for step in range(1, 20):
        engine.update(_sample(step, allocated_bytes=GB, reserved_bytes=2 * GB, peak_allocated_bytes=GB))
    assert engine.ctx.pyramid.levels == [] and len(engine.events) == 0
    for step in range(20, 40):
        engine.update(_sample(step, allocated_bytes=GB, reserved_bytes=2 * GB, peak_allocated_bytes=GB))
    assert [len(level.blocks) for level in engine.ctx.pyramid.levels] == [1, 0]  # level 1 holds it pending
    assert len(engine.ctx.pyramid.levels[1].pending) == 1


def test_a_level_that_comes_back_is_taken_out_of_a_staircase_and_the_net_rise_is_left() -> None:
    from vramwatch.engine.staircase import decelerating, moves_of, without_toggles

    gib = float(1 << 30)
    # a leak's steps of 1 GiB at 10, 40, 55, 90; a neighbour's 0.6 GiB arrives at 20, leaves at 30,
    # arrives at 70 and is still there; another's 0.5 GiB was there at the start and leaves at 50
    xs = [float(x) for x in range(0, 100, 5)]
    def level(x: float) -> float:
        return (gib * sum(1 for at in (10, 40, 55, 90) if x >= at) + 0.6 * gib * (20 <= x < 30 or x >= 70)
                + 0.5 * gib * (x < 50))
    ys = [level(x) for x in xs]
    moves = moves_of(xs, ys, 0.1 * gib)
    rises, falls = without_toggles(moves, 1.5)
    # the neighbour that came and went is gone, and so is the pair of the other leaving at 50 and the
    # neighbour arriving at 70 (a level gone and one of about its size back): the leak's steps are left
    assert [round(at) for at, _ in rises] == [8, 38, 52, 88]
    assert falls == 0
    assert sum(size for _, size in rises) == pytest.approx(4 * gib)
    # a warm-up's records (gaps doubling) decelerate; a leak's wandering gaps do not
    assert decelerating([5.0, 10.0, 20.0], 1.0, 0.5)
    assert not decelerating([12.0, 40.0, 15.0, 36.0], 1.0, 0.8)


def test_a_forecast_takes_another_process_s_moves_out_of_the_rate() -> None:
    from vramwatch.engine.forecast import level_shifts, moves_of, stairs_of, steady_rate, without

    gib = float(1 << 30)
    xs = [float(x) for x in range(0, 21)]
    # a leak creeping 0.1 GiB per point; another process's 0.8 GiB there until point 7 (a fall the
    # leak's own floor never makes), and 0.5 GiB that came at 12 and left at 15 (a toggle)
    ys = [0.1 * gib * x + 0.8 * gib * (x < 7) + 0.5 * gib * (12 <= x < 15) for x in xs]
    assert theil_sen(xs, ys) < 0.08 * gib  # read across the fall, the slope is a fifth short
    assert steady_rate(EngineConfig(), xs, ys, 0.8 * gib) == pytest.approx(0.1 * gib)
    assert steady_rate(EngineConfig(), xs, [0.1 * gib * x for x in xs], 0.8 * gib) == 0.0  # nothing to take out
    # the moves: over the creep, each of another's moves counts its whole size
    flat = [y - 0.1 * gib * x for x, y in zip(xs, ys, strict=True)]
    rises, foreign = level_shifts(moves_of(xs, flat, 0.2 * gib), 1.5)
    assert rises == [] and sorted(round(size / gib, 1) for _, size in foreign) == [-0.8, -0.5, 0.5]
    assert without(xs, ys, foreign) == pytest.approx([0.1 * gib * x + 0.8 * gib for x in xs])
    # a staircase of 1 GiB every 20 points, a neighbour's 0.6 GiB coming at 25 and going at 35, and a
    # 0.3 GiB rise at 55 (under half a step: no step of its cadence, yet still in its rise): the
    # envelope is the net rise since the first step over the time its steps took ...
    def stairs(end: int) -> Any:
        xs = [float(x) for x in range(0, end + 1)]
        ys = [gib * sum(1 for at in (10, 30, 50, 70) if x >= at) + 0.6 * gib * (25 <= x < 35)
              + 0.3 * gib * (x >= 55) for x in xs]
        return stairs_of(xs, ys, moves_of(xs, ys, 0.1 * gib), 1.5)

    read = stairs(80)
    assert (read.cadence, read.gaps, read.step) == (pytest.approx(20.0), 3, pytest.approx(1.1 * gib))
    assert read.rate(80, read.level) == pytest.approx(3.3 * gib / 60)
    assert read.spread == pytest.approx(0.0)  # evenly spaced, equal steps
    # ... and, while the next step is overdue, the time waited past a gap (it is at least that long),
    # unless the level took a step since the window ended
    assert stairs(100).rate(100, read.level) == pytest.approx(3.3 * gib / (60 + 100 - 69.5 - 20))
    assert read.rate(100, read.level) == stairs(100).rate(100, read.level)
    assert read.rate(100, read.level + gib) == pytest.approx(3.3 * gib / 60)


def test_the_forecast_range_widens_with_fewer_gaps_seen() -> None:
    from vramwatch.engine.leak import _t80

    assert _t80(1) == pytest.approx(3.078)
    assert _t80(2) == pytest.approx(1.886, rel=0.03) and _t80(4) == pytest.approx(1.533, rel=0.01)
    assert _t80(1000) == pytest.approx(1.2816, rel=0.001)
    assert [_t80(d) for d in range(1, 12)] == sorted((_t80(d) for d in range(1, 12)), reverse=True)


def test_a_step_straddling_two_points_counts_whole_and_a_rise_of_steps_is_no_creep() -> None:
    from vramwatch.engine.forecast import moves_of, stairs_of, stepwise

    gib = float(1 << 30)
    xs = [float(x) for x in range(0, 61)]
    # 2 GiB steps at 10, 30 and 50, each landing across two points (half at the point, half at the next)
    def level(x: float) -> float:
        return sum(gib * (1.0 if x >= at + 1 else 0.5 if x >= at else 0.0) for at in (10, 30, 50)) * 2

    ys = [level(x) for x in xs]
    read = stairs_of(xs, ys, moves_of(xs, ys, 0.1 * gib), 1.5)
    assert read is not None and read.gaps == 2
    assert read.rise == pytest.approx(4 * gib)  # the two steps after the first, whole
    assert read.rate(60, read.level) == pytest.approx(4 * gib / 40)
    cfg = EngineConfig()
    assert stepwise(cfg, xs, ys, 0.8 * gib)  # all of the rise is in its steps
    creep = [0.1 * gib * x for x in xs]
    assert not stepwise(cfg, xs, creep, 0.8 * gib)  # a leak creeping: none of it
    # a creep with another process's 0.6 GiB coming at 20 and going at 40: still a creep
    other = [y + 0.6 * gib * (20 <= x < 40) for x, y in zip(xs, creep, strict=True)]
    assert not stepwise(cfg, xs, other, 0.8 * gib)


def test_a_rise_many_times_a_staircase_s_step_is_no_step_of_it() -> None:
    from vramwatch.engine.forecast import moves_of, stairs_of

    gib = float(1 << 30)
    xs = [float(x) for x in range(0, 81)]
    # 0.2 GiB kept every 10 points; another process's 0.8 GiB arrives at 45 and stays
    ys = [0.2 * gib * sum(1 for at in range(10, 81, 10) if x >= at) + 0.8 * gib * (x >= 45) for x in xs]
    read = stairs_of(xs, ys, moves_of(xs, ys, 0.05 * gib), 1.5)
    assert read is not None and read.gaps == 7
    assert read.rate(80, read.level) == pytest.approx(0.02 * gib)  # the chunks' own rate, the arrival out
    assert read.step == pytest.approx(0.2 * gib)
