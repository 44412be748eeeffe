"""Memory model, readiness, advice, compare and gate against simulator truth (vramwatch.decisions)."""

from __future__ import annotations

import math
import re

import pytest

from vramwatch.decisions.advice import advise
from vramwatch.decisions.gate import gate
from vramwatch.decisions.model import BUCKET_WIDTH, PROPORTIONAL_UNCERTAINTY, RankModelBuilder
from vramwatch.decisions.nextstep import ACTIONS, EXTRAPOLATION_LIMIT
from vramwatch.decisions.observe import RunObservation, observe
from vramwatch.decisions.readiness import ReadinessConfig, plateau_held_steps
from vramwatch.decisions.reasons import CAUSES
from vramwatch.decisions.views import run_readiness
from vramwatch.probe.simulated import SCENARIOS, simulate_trace
from vramwatch.simulation.tokens import regression_overrides, token_trace, token_truth
from vramwatch.units import duration, gib


def run_of(name: str, steps: int = 4000, ranks: int = 1, seed: int = 1, **overrides) -> RunObservation:
    samples = [s for r in range(ranks)
               for s in token_trace(name, steps=steps, run=name, rank=r, seed=seed, world_size=ranks, **overrides)]
    return observe(samples)[name]


@pytest.fixture(scope="module")
def varlen() -> RunObservation:
    return run_of("varlen", ranks=2)


# ------------------------------------------------------------------ model vs truth

def test_varlen_fit_finds_the_largest_batch_and_projects_a_larger_one(varlen) -> None:
    result = advise(varlen, target_tokens=int(16384 * 1.3))
    truth = token_truth("varlen", rank=result.binding_rank, seed=result.binding_rank)
    assert result.ranks[0].fit_method == "envelope"
    assert result.max_tokens_per_step == pytest.approx(truth.max_tokens(0.05), rel=0.02)
    assert result.max_global_tokens_per_step == 2 * result.max_tokens_per_step
    # rank 0 carries ~2.3 GB more (logging, checkpoint coordination): it binds
    assert result.binding_rank == 0
    target = result.target
    assert target is not None and target.rank == 0
    assert target.worst_peak_bytes == pytest.approx(truth.worst_need(target.tokens_per_step), rel=0.01)
    assert target.fits == (truth.worst_need(target.tokens_per_step) <= 0.95 * truth.total_bytes)


def test_outside_allocator_memory_and_slack_are_counted(varlen) -> None:
    model = varlen.tracks()[1].builder.model()
    truth = token_truth("varlen", rank=1, seed=1)
    assert model.outside_measured
    assert model.outside_bytes == pytest.approx(truth.outside_bytes, rel=0.02)
    assert model.slack_bytes == pytest.approx(truth.slack_bytes, abs=8 * 2**20)
    # without NVML the outside share is unknown, said so, and not invented
    samples = [dict(s, nvml_used_bytes=None) for s in token_trace("varlen", steps=600, run="n", seed=1)]
    blind = observe(samples)["n"].tracks()[0].builder.model()
    assert not blind.outside_measured and blind.outside_bytes == 0


def test_a_convex_transient_switches_to_the_quadratic_envelope() -> None:
    obs = run_of("varlen_quadratic")
    result = advise(obs, target_tokens=int(16384 * 1.3))
    truth = token_truth("varlen_quadratic", seed=0)
    fit = result.models[0].train
    assert fit.method == "envelope_quadratic" and fit.bytes_per_token2 > 0
    assert result.max_tokens_per_step == pytest.approx(truth.max_tokens(0.05), rel=0.02)
    assert result.target.worst_peak_bytes == pytest.approx(truth.worst_need(result.target.tokens_per_step), rel=0.01)


def test_constant_tokens_fall_back_to_proportional_with_wider_uncertainty() -> None:
    obs = run_of("fixed")
    result = advise(obs)
    truth = token_truth("fixed", seed=0)
    cap = result.ranks[0]
    assert cap.fit_method == "proportional" and cap.uncertainty_frac == PROPORTIONAL_UNCERTAINTY
    # a fixed share of the transient makes proportional scaling conservative: never above the truth
    assert 0.95 * truth.max_tokens(0.05) <= result.max_tokens_per_step <= truth.max_tokens(0.05)


def test_runs_at_other_batch_settings_give_the_token_fit() -> None:
    obs = run_of("fixed")
    smaller = run_of("fixed", tokens_per_step=18432, seed=2)
    tiny = run_of("fixed", tokens_per_step=12288, seed=3)
    result = advise(obs, references=[smaller, tiny])
    truth = token_truth("fixed", seed=0)
    assert result.ranks[0].fit_method == "across_runs"
    assert result.max_tokens_per_step == pytest.approx(truth.max_tokens(0.05), rel=0.02)


def test_builder_memory_is_bounded_by_token_buckets() -> None:
    builder = RankModelBuilder()
    for s in token_trace("varlen", steps=3000, run="b", seed=4):
        builder.update(s)
    span = 16384 / (16384 * 0.35)
    assert len(builder.buckets) <= math.log(span) / math.log1p(BUCKET_WIDTH) + 2
    assert len(builder.floors) <= 256 // 32


def test_eval_phase_need_is_modelled_per_phase() -> None:
    obs = run_of("varlen_eval")
    model = obs.tracks()[0].builder.model()
    truth = token_truth("varlen_eval", seed=0)
    phases = {p.phase: p.transient_bytes for p in model.phases}
    assert phases["eval"] == pytest.approx(truth.phase_transients["eval"], rel=0.01)
    assert phases["checkpoint"] == pytest.approx(truth.phase_transients["checkpoint"], rel=0.01)


def test_a_phase_that_alone_breaks_the_margin_leaves_no_batch() -> None:
    obs = run_of("varlen_eval", steps=1500, eval_act_frac=0.57)
    result = advise(obs)
    # no batch to show, never "0 per rank": the figure is hidden with its reason
    assert result.max_tokens_per_step is None and result.ranks[0].binding_phase == "eval"
    assert result.max_hidden.cause == "no_fit" and "a phase alone breaks the margin" in result.max_hidden.text
    assert result.as_dict()["max_tokens_hidden"]["cause"] == "no_fit"
    # lowering the batch cannot help: the eval phase is what to fix
    assert result.action == "fix" and result.next.because.cause == "phase_peak"
    assert "eval phase alone" in result.recommendation


# ------------------------------------------------------------------ readiness

def test_plateau_held_counts_across_a_checkpoint_ratchet_but_not_a_loop_break() -> None:
    events = [{"type": "plateau", "step": 500},
              {"type": "plateau_break", "step": 1000, "cause": "checkpoint"},
              {"type": "plateau", "step": 1300}]
    assert plateau_held_steps(events, 3000, "plateau") == 2500
    events.append({"type": "plateau_break", "step": 3100, "cause": "allocated"})
    assert plateau_held_steps(events, 3200, "rising") == 0
    events.append({"type": "plateau", "step": 3500})
    assert plateau_held_steps(events, 4000, "plateau") == 500


def test_readiness_not_ready_then_ready_with_numbers() -> None:
    early = run_readiness(run_of("varlen", steps=1500))
    assert early.verdict == "not_ready"
    assert {r.cause for r in early.reasons} == {"plateau"}
    held = re.search(r"plateau held ([\d,]+) of 2,000 steps", " ".join(r.text for r in early.reasons))
    assert held and int(held.group(1).replace(",", "")) == early.plateau_steps < 2000
    assert early.checkpoints_passed == 1
    late = run_readiness(run_of("varlen", steps=4000))
    assert late.verdict == "ready" and late.plateau_steps >= 2000 and late.checkpoints_passed == 3
    assert late.min_headroom_bytes is not None and late.worst_rank == late.min_headroom_rank == 0
    assert [r.cause for r in late.reasons] == ["proven"]
    # thresholds are configurable
    relaxed = run_readiness(run_of("varlen", steps=1500), ReadinessConfig(plateau_steps=500, checkpoints=1))
    assert relaxed.verdict == "ready"


def test_no_checkpoint_yet_is_not_ready() -> None:
    obs = run_of("varlen", steps=2900, ckpt_every=0)
    result = run_readiness(obs, ReadinessConfig(plateau_steps=1000))
    assert result.verdict == "not_ready" and result.checkpoints_passed == 0
    assert any(r.cause == "checkpoint" and "0 of 1 checkpoint(s) passed" in r.text for r in result.reasons)


@pytest.mark.parametrize(("scenario", "steps", "causes", "needle"), [
    ("fast_leak", 5000, ("leak",), "MiB/step"),
    ("leak_to_oom", 6000, ("oom", "leak"), "OOM at step"),
])
def test_leaks_and_ooms_are_unsafe(scenario: str, steps: int, causes: tuple[str, ...], needle: str) -> None:
    obs = observe(simulate_trace(scenario, steps=steps, run="u", seed=1))["u"]
    result = run_readiness(obs)
    assert result.verdict == "unsafe" and result.causes[:len(causes)] == causes
    assert result.reasons[0].cause == causes[0] and needle in result.reasons[0].text, result.reasons
    assert not any(" MB" in r.text for r in result.reasons)


def test_headroom_under_the_margin_is_unsafe_and_advice_lowers_by_the_computed_share() -> None:
    tight = {"act_frac": 0.50, "ckpt_every": 0}
    obs = run_of("fixed_tight", **tight)
    result = advise(obs, margin=0.10)
    assert result.readiness.verdict == "unsafe"
    assert any(r.cause == "margin" and "under the 10% margin" in r.text for r in result.readiness.reasons)
    assert result.action == "back_off" and result.next.because.cause == "margin"
    low = result.next.tokens_per_step
    cut = 1 - low / 22528
    assert low % result.evidence.granularity == 0 and result.evidence.granularity == 1024  # 22,528 = 22 x 1,024
    assert f"Back off to {low:,} global tokens per step ({low:,} per rank" in result.recommendation
    assert 0.05 < cut < 0.25
    truth = token_truth("fixed_tight", seed=0, **tight)
    # lowering by that share restores the margin in truth, though part of the transient is fixed
    assert truth.worst_need(low) <= 0.90 * truth.total_bytes


def test_a_checkpoint_that_alone_breaks_the_margin_is_named() -> None:
    result = advise(run_of("fixed_tight"), margin=0.15)
    assert result.readiness.verdict == "unsafe" and result.max_tokens_per_step is None
    assert result.action == "fix" and "checkpoint phase alone" in result.recommendation


# ------------------------------------------------------------------ advice

def test_ready_varlen_run_is_advised_to_raise_within_the_extrapolation_limit(varlen) -> None:
    result = advise(varlen)
    assert result.action == "raise"
    n = result.next.tokens_per_step
    assert result.recommendation.startswith(f"Raise to {2 * n:,} global tokens per step ({n:,} per rank")
    seen = result.ranks[0].tokens_seen_max
    assert seen < n <= seen * EXTRAPOLATION_LIMIT
    truth = token_truth("varlen", seed=0)
    assert truth.worst_need(n) <= 0.95 * truth.total_bytes  # the raise keeps the margin in truth
    assert f"{2 * n:,} global" in result.recommendation


def test_without_tokens_the_advice_says_so_and_projects_nothing() -> None:
    obs = observe(simulate_trace("checkpoint", steps=2500, run="plain", seed=1))["plain"]
    result = advise(obs, target_tokens=20000)
    assert result.max_tokens_per_step is None and result.max_global_tokens_per_step is None
    assert result.action == "hold" and "tokens=" in result.recommendation
    assert result.next.tokens_per_step is None and "0 tokens" not in result.recommendation
    # a target is never dropped: it is answered, saying why it cannot be judged
    assert result.target.tokens_per_step == 20000 and result.target.fits is None
    assert result.target.because.cause == "no_tokens"


def test_not_ready_run_holds_and_names_the_projection() -> None:
    result = advise(run_of("varlen", steps=1500))
    assert result.action == "hold" and "plateau held" in result.recommendation
    assert f"{result.max_tokens_per_step:,} per rank" in result.recommendation


# ------------------------------------------------------------------ compare and gate

@pytest.mark.parametrize(("growth", "passes"), [(0.01, True), (0.06, False)])
def test_gate_passes_one_percent_and_fails_six(growth: float, passes: bool) -> None:
    base = run_of("varlen", steps=2500, ranks=2, seed=1)
    cand = run_of("varlen", steps=2500, ranks=2, seed=2, **regression_overrides("varlen", growth))
    result = gate(base, cand, 0.03)
    assert result.passed is passes, result.line
    if not passes:
        assert re.match(r"FAIL: (peak_bytes|plateau_bytes) rank \d phase \w+ grew \+[5-7]\.\d\d%", result.line)
    else:
        assert 0.0 < result.worst.growth < 0.02


def test_a_leak_is_fixed_before_the_batch_is_touched() -> None:
    obs = run_of("varlen", steps=5000, leak_onset=1200, leak_rate_frac=4e-5)
    result = advise(obs)
    assert result.readiness.verdict == "unsafe" and "leak" in result.readiness.causes
    assert result.action == "fix" and result.next.because.cause == "leak" and result.next.because.rank == 0
    assert result.recommendation.startswith("Fix first, holding 16,3") and "MiB/step" in result.recommendation
    assert result.next.tokens_per_step == result.readiness.ranks[0].tokens


def test_an_oom_the_batch_does_not_explain_is_not_answered_by_lowering() -> None:
    # memory outside the allocator grows into an OOM while the batch itself fits easily
    obs = run_of("varlen", steps=6000, outside_onset=1000, outside_rate_frac=6e-5, ckpt_every=0)
    result = advise(obs)
    assert result.readiness.verdict == "unsafe"
    oom = obs.tracks()[0].trial.oom
    assert oom is not None and oom.cause == "leak" and "outside_allocator" in oom.detail
    # the leak is the cause, not the batch: nothing caps the batch, the leak is to be fixed
    assert result.evidence.ceiling() is None and result.bound == "model"
    assert result.action == "fix" and result.next.because.cause == "leak", result.recommendation


# ------------------------------------------------------------------ the collector's engine

def test_decision_engine_is_a_drop_in_trend_engine_with_the_figures() -> None:
    from vramwatch.collector.state.live import LiveState
    from vramwatch.decisions.online import RECHECK_EVERY, REFIT_EVERY, DecisionEngine
    from vramwatch.engine import TrendEngine

    samples = token_trace("varlen", steps=3200, run="live", seed=1)
    plain, decision = TrendEngine(), DecisionEngine()
    plain_events = [e for s in samples for e in plain.update(s)]
    decision_events = [e for s in samples for e in decision.update(s)]
    assert decision_events == plain_events and decision.state == plain.state
    assert list(decision.events) == list(plain.events) and decision.samples == plain.samples
    summary = decision.summary()
    assert {k: summary[k] for k in plain.summary()} == plain.summary()
    truth = token_truth("varlen", seed=1)
    assert summary["max_tokens_per_step"] == pytest.approx(truth.max_tokens(0.05), rel=0.02)
    assert summary["readiness"] == "ready" and 16000 < summary["tokens_per_step_max_observed"] <= 16384
    # a scrape reads cached figures: re-judged every RECHECK_EVERY samples, refitted rarer
    cached = decision.figures()
    more = token_trace("varlen", steps=3200 + REFIT_EVERY, run="live", seed=1)[len(samples):]
    for s in more[:RECHECK_EVERY - 1]:
        decision.update(s)
    assert decision.figures() is cached
    for s in more[RECHECK_EVERY - 1:]:
        decision.update(s)
    assert decision.figures() is not cached and decision.figures() is decision.figures()
    # the collector's live state uses it by default
    live = LiveState()
    live.ingest(samples[:10])
    assert isinstance(live.snapshot()[0].engine, DecisionEngine)


def test_an_oomed_step_bounds_the_batch_instead_of_joining_the_envelope() -> None:
    # the activations are 30 % larger than the device allows for the longest batches
    obs = run_of("varlen", steps=3000, act_frac=0.62, ckpt_every=0)
    track = obs.tracks()[0]
    assert track.ooms == 1
    oom = track.trial.oom
    assert oom is not None and oom.phase == "train" and oom.cause == "batch"
    model = track.builder.model()
    # the process died there: the truth is the one of that moment (warm-up not over)
    truth = token_truth("varlen", seed=1, act_frac=0.62, ckpt_every=0, at_step=track.last_step)
    assert oom.tokens > truth.max_tokens(0.0)
    # the OOM sample's capped peak did not bend the envelope: the fit still matches the truth
    assert model.max_tokens(0.05)[0] == pytest.approx(truth.max_tokens(0.05), rel=0.03)
    result = advise(obs, target_tokens=oom.tokens)
    assert result.max_tokens_per_step < oom.tokens
    assert result.target.fits is False and result.target.because.cause == "oom"
    assert result.action == "back_off" and result.readiness.causes[0] == "oom"
    assert result.next.tokens_per_step < oom.tokens and result.next.because.cause == "batch"


def test_a_phase_that_ooms_caps_the_batch_it_ran_not_every_batch() -> None:
    obs = run_of("varlen", steps=1500, ckpt_above_frac=0.2)
    trial = obs.tracks()[0].trial
    assert trial.oom.phase == "checkpoint" and trial.oom.cause == "phase_peak"
    assert trial.oom.tokens == trial.tokens  # the batch the process ran
    result = advise(obs, target_tokens=trial.tokens - 300)
    # just below the batch that ran out, on the grid (a number a person can set, not tokens - 1)
    assert result.bound == "oom" and result.max_tokens_per_step == result.evidence.settable(trial.tokens - 1)
    assert result.next.action == "back_off" and result.next.because.cause == "phase_peak"
    g = result.evidence.granularity
    assert result.next.tokens_per_step % g == 0 and result.next.tokens_per_step < trial.tokens
    assert result.target.fits is not False  # below the OOM's batch the model decides


def test_gate_names_a_phase_only_the_candidate_has() -> None:
    base = run_of("varlen", steps=1500, seed=3)
    cand = run_of("varlen_eval", steps=1500, seed=3, act_frac=0.36, act_fixed_frac=0.03, eval_act_frac=0.40)
    result = gate(base, cand, 0.03)
    assert result.passed, result.line
    assert any("phase eval" in a for a in result.added) and "candidate adds peak_bytes rank 0 phase eval" in result.line


def test_two_batch_settings_are_enough_for_an_across_run_line_with_a_stated_uncertainty() -> None:
    obs = run_of("fixed")
    other = run_of("fixed", tokens_per_step=16384, seed=2)
    result = advise(obs, references=[other])
    truth = token_truth("fixed", seed=0)
    cap = result.ranks[0]
    assert cap.fit_method == "across_runs" and cap.uncertainty_frac == 0.10
    assert result.max_tokens_per_step == pytest.approx(truth.max_tokens(0.05), rel=0.02)


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - {"demo", "multi_rank"}))
def test_every_simulator_scenario_gets_a_sentence_with_numbers(scenario: str) -> None:
    obs = observe(simulate_trace(scenario, steps=3000, run="s", seed=2, tokens_per_step=8192, seq_min=0.5))["s"]
    result = advise(obs, target_tokens=9000)
    doc = result.as_dict()
    assert doc["action"] in ACTIONS and doc["recommendation"].endswith(".")
    assert doc["next"]["action"] == doc["action"] and doc["next"]["because"]["cause"] in CAUSES
    assert re.search(r"\d", doc["recommendation"])
    assert doc["readiness"]["verdict"] in ("ready", "not_ready", "unsafe")
    if doc["max_tokens_per_step"] is not None:
        assert doc["max_tokens_per_step"] >= 0 and doc["target"] is not None


@pytest.mark.parametrize("keep", [("nvml_used_bytes",), ("allocated_bytes",)])
def test_sparse_runs_get_advice_without_guessing(keep):
    """Device-used-only (dcgm, nvidia-smi) and allocated-only runs: no crash, no invented fit."""
    measured = {"allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes",
                "alloc_retries", "ooms", "nvml_used_bytes", "process_used_bytes", "active_bytes"}
    samples = []
    for s in simulate_trace("healthy", steps=600, run="sparse", host="h", rank=0, start_ts=1_760_000_000.0):
        samples.append({k: v for k, v in s.items() if k not in measured or k in keep} | {"schema": 2})
    obs = observe(samples)["sparse"]
    doc = advise(obs).as_dict()
    assert doc["max_tokens_per_step"] is None
    assert doc["readiness"]["verdict"] in ("not_ready", "unsafe", "ready")
    assert isinstance(doc["recommendation"], str) and doc["recommendation"]


def test_byte_figures_are_gib_as_the_dashboard_shows_them() -> None:
    """One unit for a number a person reads: GiB (2^30), with the dashboard's digits rule."""
    from vramwatch.units import gib

    late = run_readiness(run_of("varlen", steps=4000))
    text = " ".join(r.text for r in late.reasons)
    assert " GB" not in text and " MB" not in text
    assert f"worst headroom {gib(late.min_headroom_bytes)} at" in text  # the same text as "Min headroom"
    samples = [{k: v for k, v in s.items() if k != "tokens"} for s in token_trace("varlen", steps=600, run="nt")]
    no_tokens = advise(observe(samples)["nt"])
    assert "worst headroom " in no_tokens.recommendation and " GB" not in no_tokens.recommendation
    assert re.search(r"worst headroom \d+\.\d+ GiB on rank", no_tokens.recommendation), no_tokens.recommendation
    assert (gib(9.41 * 2**30), gib(12.34 * 2**30), gib(None)) == ("9.41 GiB", "12.3 GiB", "-")
    # a leak's slope in MiB per step (the dashboard's unit), never MB
    leak = advise(run_of("varlen", steps=5000, leak_onset=1200, leak_rate_frac=4e-5))
    slope = leak.models[0].total_bytes * 4e-5 / 2**20
    said = re.search(r"leak \(allocator\) (\d+\.\d\d) MiB/step", leak.recommendation)
    assert said and float(said.group(1)) == pytest.approx(slope, rel=0.05), leak.recommendation


def _bytes_held_per_series(factory, samples_per_series: int, series: int = 2000) -> float:
    """tracemalloc: what ``series`` engines still hold after their samples, per series (the
    samples are built before measuring: the collector owns them)."""
    import gc
    import tracemalloc

    train = [s for s in simulate_trace("demo", steps=samples_per_series + 40, seed=0) if s["phase"] == "train"]
    batches = [[dict(s, rank=r) for s in train[:samples_per_series]] for r in range(series)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    engines = []
    for batch in batches:
        engine = factory()
        for sample in batch:
            engine.update(sample)
        engines.append(engine)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    return sum(d.size_diff for d in after.compare_to(before, "filename")) / series


def test_a_new_series_engine_fits_its_4_kb_budget_beside_the_collectors_own_state() -> None:
    """<= 4 KB resident per series that has not closed a block. The collector's own
    state is bounded at 700 B (test_hardening); its engine (trend engine + decisions model) gets
    the rest. Nothing is allocated for what has not happened yet (rings, events, buckets)."""
    from vramwatch.collector.state.live import collector_engine
    from vramwatch.engine import TrendEngine

    for samples in (1, 20):  # a block closes at the 32nd step
        held = _bytes_held_per_series(collector_engine, samples)
        assert held <= 4096 - 700, (samples, held)  # was 18.6 KB (rings and deques made up front)
        assert _bytes_held_per_series(TrendEngine, samples) <= 2048  # was 13.7 KB


def test_the_least_headroom_and_the_soonest_oom_are_named_on_their_own_ranks() -> None:
    """4 ranks, two leaking: rank 3 faster than rank 0. The headroom named is the least one's, on
    its rank; the leak to fix first is the one that runs out first."""
    samples = []
    for r, rate in ((0, 2.5e-5), (1, 0.0), (2, 0.0), (3, 3.5e-5)):
        leak = {"leak_onset": 1200, "leak_rate_frac": rate} if rate else {}
        samples += token_trace("fixed", steps=3000, run="four", rank=r, seed=r, world_size=4, **leak)
    result = advise(observe(samples)["four"])
    r = result.readiness
    tight = min(r.ranks, key=lambda x: x.min_headroom_bytes)
    assert r.min_headroom_rank == tight.rank and r.min_headroom_bytes == tight.min_headroom_bytes
    leaking = {x.rank: x.steps_to_oom for x in r.ranks if "leak" in x.causes}
    assert set(leaking) == {0, 3} and leaking[3] < leaking[0]
    assert r.worst_rank == 3 and r.reasons[0].rank == 3 and r.reasons[0].cause == "leak"
    assert result.action == "fix" and result.next.because.rank == 3
    # the runway in time at the rank's own step time, beside steps
    soonest = next(x for x in r.ranks if x.rank == 3)
    step_time = soonest.seconds_to_oom / soonest.steps_to_oom
    assert step_time == pytest.approx(1.0, rel=0.05)  # the simulated job's pace
    assert (f"OOM in {duration(soonest.seconds_to_oom)} ({leaking[3]:,} steps at {step_time:.2f} s/step)"
            in result.recommendation and "soonest of 2 ranks" in result.recommendation)
    assert " h " in duration(soonest.seconds_to_oom) or " min" in duration(soonest.seconds_to_oom)
    assert result.max_tokens_per_step is None and result.max_hidden.cause == "leak"  # meaningless during a leak
    from vramwatch.cli.decisions import advice_text

    assert f"worst headroom {gib(tight.min_headroom_bytes)} on rank {tight.rank})" in advice_text(result)


def test_a_rank_killed_while_the_job_went_on_is_a_death_the_gate_and_the_advice_name() -> None:
    """How a process ended is the run-life model's judgement (vramwatch.runlife): rank 1 stops at
    step 1,500 without an exit or an OOM while rank 0 goes on for 1,500 s more: killed."""
    base = run_of("fixed", steps=3000, ranks=2)
    samples = [s for r in range(2) for s in token_trace("fixed", steps=3000, run="cut", rank=r, seed=r, world_size=2)
               if r == 0 or s["step"] <= 1500]
    cut = observe(samples)["cut"]
    result = advise(cut)
    assert result.readiness.verdict == "unsafe" and result.readiness.causes[0] == "death"
    assert result.readiness.worst_rank == 1 and result.action == "hold" and result.next.because.cause == "death"
    assert [d.rank for d in result.evidence.deaths] == [1]
    verdict = gate(base, cut, 0.03)
    assert not verdict.passed and verdict.troubles[0].cause == "death" and verdict.troubles[0].rank == 1
    assert verdict.line.startswith("FAIL: rank 1: killed at step 1,500") and "(cause death;" in verdict.line
    # the baseline had the same death: not the candidate's doing
    assert gate(cut, cut, 0.03).passed


def test_the_docs_list_every_cause_with_its_meaning() -> None:
    """docs/decisions.md's cause table is generated from reasons.CAUSES (one definition)."""
    from pathlib import Path

    from vramwatch.decisions.reasons import causes_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "decisions.md").read_text()
    start, end = doc.index("<!-- causes:start -->"), doc.index("<!-- causes:end -->")
    assert doc[start + len("<!-- causes:start -->"):end].strip() == causes_table().strip()
    assert all(f"| `{cause}` |" in doc for cause in CAUSES)


def test_a_live_view_is_the_state_between_two_samples_while_the_writer_goes_on() -> None:
    """The collector's live state copies a rank for /advice under its one lock, between two of the
    writer's batches: every copy is whole (its process and its model at the same step) while the
    writer goes on."""
    import threading

    from vramwatch.collector.state.live import LiveState

    samples = token_trace("varlen", steps=6000, run="busy", seed=3)
    live = LiveState()
    live.ingest(samples[:200])
    done = threading.Event()

    def write() -> None:
        for i in range(200, len(samples), 7):
            live.ingest(samples[i:i + 7])
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    views = 0
    config = ReadinessConfig()
    while not done.is_set() or views == 0:
        (view,), _lives, _samples = live.views("busy", config)
        assert view.trials[-1].last_step == view.model.step and len(view.points) >= 1
        views += 1
    writer.join()
    (final,), _lives, count = live.views("busy", config)
    assert views > 1 and final.model.step == final.trials[-1].last_step == samples[-1]["step"]
    assert count == len(samples)
