"""Decisions against simulator truth: largest batch, projected peaks, readiness, the gate, and costs.

    .venv/bin/python -m bench.decisions_bench           # writes docs/benchmarks.md "## Decisions"
    .venv/bin/python -m bench.decisions_bench --quick   # fewer seeds, no file written

Truth comes from the simulator's parameters (:func:`vramwatch.simulation.tokens.token_truth`),
never from the samples the model saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import median_time, table, write_section
from vramwatch import wire
from vramwatch.decisions.advice import advise, decide, project
from vramwatch.decisions.compare import WorldSizeMismatch
from vramwatch.decisions.gate import gate
from vramwatch.decisions.model import fit_transient
from vramwatch.decisions.observe import RunObservation, observe
from vramwatch.decisions.online import DecisionEngine
from vramwatch.decisions.readiness import ReadinessConfig
from vramwatch.decisions.views import run_readiness
from vramwatch.engine import TrendEngine
from vramwatch.engine.analyze import analyze_paths
from vramwatch.simulation.stories import STORIES, story_trace, story_truth
from vramwatch.simulation.tokens import regression_overrides, token_trace, token_truth

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from corpus import SCALES, STEPS, make_case

GOAL = 0.10  # error goal for the largest batch and projected peaks
DEVICES = {"h200": SCALES["h200"].total_bytes, "80gb": SCALES["a100-80gb"].total_bytes,
           "24gb": SCALES["rtx-24gb"].total_bytes}
FACTORS = (1.1, 1.2, 1.3)
SCENARIOS = ("varlen", "varlen_rare_long", "varlen_noisy", "varlen_eval", "varlen_quadratic", "fixed",
             "fixed_tight")
#: Expected readiness on the engine corpus (default thresholds: 2,000 steps, 1 checkpoint, 5 %).
EXPECTED = {
    "healthy": "not_ready", "long_warmup": "not_ready", "checkpoint": "ready", "eval": "not_ready",
    "late_step": "not_ready", "fast_leak": "unsafe", "slow_leak": "unsafe", "noisy_leak": "unsafe",
    "leak_to_oom": "unsafe", "fragmentation": "unsafe", "outside_leak": "unsafe", "sawtooth": "not_ready",
    "periodic_spikes": "not_ready", "dropped": "not_ready", "multi_rank": "unsafe",
}


def expected(case: Any) -> str:
    """crash_resume: the resumed process re-proves its plateau; at 1x steps it has run ~1,800 steps
    past warm-up when the trace ends (not_ready), at 3x ~6,000 (ready: a crash is not an OOM)."""
    if case.scenario == "crash_resume":
        return "ready" if case.scale.time_factor >= 2 else "not_ready"
    return EXPECTED[case.scenario]


def _run(name: str, steps: int, seed: int, total: int, ranks: int = 2, **overrides: Any) -> RunObservation:
    samples = [s for r in range(ranks) for s in token_trace(name, steps=steps, run=name, rank=r, seed=seed + r,
                                                             total_bytes=total, world_size=ranks, **overrides)]
    return observe(samples)[name]


def _accuracy_row(name: str, device: str, seed: int, steps: int, refs: bool = False) -> dict[str, Any]:
    total = DEVICES[device]
    obs = _run(name, steps, seed, total)
    references = []
    if refs:  # the same job at two smaller batch settings
        references = [_run(name, steps // 2, seed + 50, total, tokens_per_step=t) for t in (18432, 14336)]
    result = advise(obs, references=references)
    binding = result.binding_rank
    truth = token_truth(name, rank=binding, seed=seed + binding, total_bytes=total)
    true_max = truth.max_tokens(0.05)
    model = next(m for m in result.models if m.rank == binding)
    row = {"case": f"{name}{'+refs' if refs else ''}@{device}/s{seed}", "fit": model.train.method,
           "max_err": (result.max_tokens_per_step - true_max) / true_max}
    seen = model.tokens_seen_max
    for f in FACTORS:
        tokens = int(seen * f)
        got = project([model], tokens, 0.05)
        row[f] = (got.need_bytes - truth.worst_need(tokens)) / truth.worst_need(tokens)
    return row


def accuracy(seeds: int) -> tuple[str, list[float]]:
    rows = []
    for name in SCENARIOS:
        for device in DEVICES:
            for seed in range(seeds):
                rows.append(_accuracy_row(name, device, seed, 4000))
                if name.startswith("fixed"):
                    rows.append(_accuracy_row(name, device, seed, 4000, refs=True))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["case"].split("@")[0], []).append(r)
    out, worst = [], []
    for key, items in groups.items():
        errs = [abs(r["max_err"]) for r in items]
        cells = [key, items[0]["fit"], len(items), f"{statistics.median([r['max_err'] for r in items]):+.2%}",
                 f"{max(errs):.2%} / {GOAL:.0%} = {max(errs) / GOAL:.2f}"]
        worst.append(max(errs))
        for f in FACTORS:
            e = [abs(r[f]) for r in items]
            cells.append(f"{max(e):.2%} / {GOAL:.0%} = {max(e) / GOAL:.2f}")
            worst.append(max(e))
        out.append(cells)
    headers = ["scenario", "fit", "runs", "largest batch: median error", "largest batch: worst |error| / goal",
               *(f"peak at {f}x: worst |error| / goal" for f in FACTORS)]
    return table(headers, out), worst


def ablation(seeds: int) -> str:
    """What each part of the fit buys: the same runs with a simpler transient model."""
    rows = []
    for name, force in (("varlen", "proportional"), ("varlen_quadratic", "proportional"),
                        ("varlen_quadratic", "envelope"), ("varlen_quadratic", None)):
        max_errs, peak_errs = [], []
        for seed in range(seeds):
            obs = _run(name, 4000, seed, DEVICES["h200"])
            track = obs.tracks()[0]
            model = track.builder.model()
            fit = fit_transient(list(track.builder.buckets.values()), force=force)
            model = dataclasses.replace(model, train=fit)
            truth = token_truth(name, rank=0, seed=seed)
            true_max = truth.max_tokens(0.05)
            max_errs.append((model.max_tokens(0.05)[0] - true_max) / true_max)
            tokens = int(model.tokens_seen_max * 1.3)
            need = model.worst_need(tokens)[0]
            peak_errs.append((need - truth.worst_need(tokens)) / truth.worst_need(tokens))
        worst_max = max(max_errs, key=abs)
        worst_peak = max(peak_errs, key=abs)
        label = force or "as shipped (convex switch)"
        rows.append([name, label, fit.method, f"{worst_max:+.2%}", f"{worst_peak:+.2%}"])
    return table(["scenario", "transient model", "method", "largest batch: worst error", "peak at 1.3x: worst error"],
                 rows)


def convergence(seeds: int) -> str:
    rows = []
    for steps in (300, 600, 1200, 2500, 5000):
        errs = []
        for seed in range(seeds):
            errs.append(abs(_accuracy_row("varlen_rare_long", "h200", seed, steps)["max_err"]))
        rows.append([f"{steps:,}", f"{statistics.median(errs):.2%}", f"{max(errs):.2%}"])
    return table(["steps seen", "median |error| of largest batch", "worst"], rows)


def torch_real() -> str:
    """The fit on a real PyTorch model's activation memory (CPU), see tests/torch_transient.py."""
    import random

    from torch_transient import Batch, TinyLM, samples

    model, rng = TinyLM(), random.Random(0)
    cases = {
        "sequence length varies (B = 4, T 64-384)": (
            [Batch(4, 16 * rng.randint(4, 24)) for _ in range(120)], lambda tok: Batch(4, tok // 4)),
        "batch size varies (T = 128, B 2-12)": (
            [Batch(rng.randint(2, 12), 128) for _ in range(120)], lambda tok: Batch(round(tok / 128), 128)),
        "both vary (T 64/128/256, up to 1,536 tokens)": (
            [Batch(rng.randint(1, 1536 // t), t) for t in (rng.choice((64, 128, 256)) for _ in range(160))],
            lambda tok: Batch(round(tok / 256), 256)),  # the worst composition seen
    }
    rows = []
    for name, (batches, at) in cases.items():
        obs = observe(samples(model, batches, scale=1000))["torch-cpu"]
        fit = obs.tracks()[0].builder.model().train
        cells = [name, fit.method, f"{fit.uncertainty_frac:.1%}"]
        for f in FACTORS:
            b = at(int(1536 * f))
            measured = model.saved_bytes(b.batch, b.seq) * 1000
            err = (fit.transient(b.tokens) - measured) / measured
            cells.append(f"{abs(err):.2%} / {GOAL:.0%} = {abs(err) / GOAL:.2f} ({b.batch}x{b.seq})")
        rows.append(cells)
    return table(["batches (120-160 steps)", "fit", "stated uncertainty",
                  *(f"transient at {f}x: |error| / goal (batch)" for f in FACTORS)], rows)


def readiness_on_corpus() -> tuple[str, int, int]:
    rows, agree = [], 0
    cases = [make_case(s, scale) for scale in ("h200", "a100-80gb") for s in STEPS]
    for case in cases:
        samples = (s for rank in case.ranks for s in case.trace(rank))
        obs = observe(samples)[case.name]
        r = run_readiness(obs)
        want = expected(case)
        agree += r.verdict == want
        rows.append([case.name, want, r.verdict, "yes" if r.verdict == want else "**no**",
                     f"{r.plateau_steps:,}", r.checkpoints_passed, r.reasons[0].text[:90] if r.reasons else ""])
    text = table(["case", "expected", "verdict", "agrees", "plateau held", "checkpoints", "first reason"], rows)
    return text, agree, len(cases)


def _story_row(name: str, seed: int, with_reference: bool) -> dict[str, Any]:
    refs = [observe(story_trace("proven", run="proven", seed=seed))["proven"]] if with_reference else []
    a = advise(observe(story_trace(name, seed=seed))[name], references=refs)
    truth = story_truth(name, seed=seed)
    true_max = truth.max_tokens(0.05)
    g = a.evidence.granularity
    step = a.next
    fits = truth.worst_need(step.tokens_per_step) <= 0.95 * truth.total_bytes if step.tokens_per_step else None
    return {"story": name + (" + the proven run as --reference" if refs else ""),
            "ooms": len({(o.run, o.ordinal) for o in a.evidence.ooms}),
            "next": f"{step.action} {step.tokens_per_step:,} ({step.because.cause})", "fits": fits,
            "settable_truth": true_max // g * g, "g": g, "max": a.max_tokens_per_step, "bound": a.bound,
            "err": (a.max_tokens_per_step - true_max) / true_max, "true_max": true_max,
            "model_err": ((a.model_max_tokens_per_step or 0) - true_max) / true_max}


def procedure(seeds: int) -> tuple[str, list[float]]:
    """The procedure's replays (vramwatch/simulation/stories.py): what advise says next, and the
    largest batch against the truth, on runs that include OOMs."""
    rows, errors = [], []
    for name, with_reference in (*((n, False) for n in STORIES), ("try_alone", True)):
        items = [_story_row(name, seed, with_reference) for seed in range(seeds)]
        first = items[0]
        worst = max(items, key=lambda r: abs(r["err"]))["err"]
        model = max(items, key=lambda r: abs(r["model_err"]))["model_err"]
        if first["ooms"]:
            errors.append(abs(worst))
        fits = {True: "yes", False: "**no**", None: "-"}[first["fits"]]
        settable = f"{first['settable_truth']:,} (g {first['g']:,})"
        largest = f"{first['max']:,} ({first['bound']})"
        rows.append([first["story"], first["ooms"], first["next"], fits, settable, largest, f"{first['true_max']:,}",
                     f"{worst:+.2%}", f"{model:+.2%}"])
    headers = ["replay", "OOMs", "next step (seed 0)", "next batch keeps the margin in truth",
               "largest settable in truth", "largest batch (what bounds it)", "truth", "largest batch: worst error",
               "the model alone: worst error"]
    return table(headers, rows), errors


def leak_gate(seeds: int) -> str:
    """A candidate leaking 0.5 MiB/step against a clean baseline: the gate must fail it whatever
    its growth so far; runs of different world sizes are refused unless asked per rank."""
    failed, growths, mismatched = 0, [], 0
    rate = 0.5 * 2**20 / DEVICES["h200"]
    for seed in range(seeds):
        base = _run("fixed", 3000, 300 + seed, DEVICES["h200"])
        cand = _run("fixed", 3000, 400 + seed, DEVICES["h200"], leak_rank=1, leak_onset=1200, leak_rate_frac=rate)
        result = gate(base, cand, 0.03)
        failed += not result.passed and bool(result.troubles) and result.troubles[0].cause == "leak"
        growths.append(result.worst.growth if result.worst else float("nan"))
        wide = observe(s for r in range(2) for s in token_trace("fixed", steps=600, run="wide", rank=r,
                                                                  seed=500 + seed + r, world_size=64))["wide"]
        try:
            gate(base, wide, 0.03)
        except WorldSizeMismatch:
            mismatched += 1
    rows = [["leaks 0.5 MiB/step on rank 1 (from step 1,200 of 3,000)", seeds, failed,
             f"{min(growths):+.2%} .. {max(growths):+.2%}"],
            ["2 of 64 ranks against 2 of 2 (world sizes differ)", seeds, f"{mismatched} refused (exit 2)", "-"]]
    return table(["candidate", "pairs", "gate failed naming rank and cause", "largest peak growth so far"], rows)


def live_advice_cost() -> str:
    """``/advice`` on the tracks the collector holds against replaying the run (8 ranks x 5,000 steps)."""
    from vramwatch.collector.reads.advice import live_view
    from vramwatch.collector.state.live import LiveState

    samples = [s for r in range(8) for s in token_trace("varlen", steps=5000, run="eight", rank=r, seed=r,
                                                         world_size=8)]
    live = LiveState()
    live.rebuild(samples)
    config = ReadinessConfig()
    states = live.for_run("eight")
    live_t = median_time(lambda: decide(live_view("eight", states, config), [], config=config), 5)
    replay_t = median_time(lambda: advise(observe(samples)["eight"]), 3)
    same = decide(live_view("eight", states, config), [], config=config).next == advise(observe(samples)["eight"]).next
    return table(["what", "measured / limit = ratio", "limit"], [[
        f"`/advice` from the live tracks (8 ranks x 5,000 steps; same next step as the replay: {same})",
        f"{live_t * 1e3:.1f} ms / {0.1 * replay_t * 1e3:.1f} ms = {live_t / (0.1 * replay_t):.2f}",
        "a tenth of replaying the run"]])


def gate_pairs(seeds: int) -> str:
    rows = []
    for growth in (0.01, 0.06):
        passed, growths = 0, []
        for seed in range(seeds):
            base = _run("varlen", 2500, 100 + seed, DEVICES["h200"])
            cand = _run("varlen", 2500, 200 + seed, DEVICES["h200"], **regression_overrides("varlen", growth))
            result = gate(base, cand, 0.03)
            passed += result.passed
            growths.append(result.worst.growth if result.worst else float("nan"))
        rows.append([f"+{growth:.0%}", seeds, passed, seeds - passed, f"{min(growths):+.2%} .. {max(growths):+.2%}"])
    return table(["injected growth (training peak)", "pairs", "gate passed", "gate failed",
                  "largest growth the gate measured"], rows)


def costs() -> str:
    samples = token_trace("varlen", steps=20000, run="cost", seed=1)

    def feed(cls: type) -> None:
        engine = cls()
        for s in samples:
            engine.update(s)

    def cpu(fn: Any, repeats: int = 5) -> float:
        # best CPU time of several: the machine is shared, wall time measures the neighbours
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        return best

    engine_t = cpu(lambda: feed(TrendEngine)) / len(samples)
    decision_t = cpu(lambda: feed(DecisionEngine)) / len(samples)
    overhead = decision_t - engine_t
    ranks = [s for r in range(8) for s in token_trace("varlen", steps=5000, run="eight", rank=r, seed=r,
                                                       world_size=8)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "eight.jsonl"
        path.write_bytes(b"".join(wire.encode(s) + b"\n" for s in ranks))
        analyze_t = median_time(lambda: analyze_paths([str(path)]), 3)
        advise_t = median_time(lambda: advise(observe(wire.iter_samples(str(path)))["eight"]), 3)
    rows = [
        ["collector: decision figures per sample (DecisionEngine - TrendEngine, CPU)",
         f"{overhead * 1e6:.2f} µs / {2 * engine_t * 1e6:.2f} µs = {overhead / (2 * engine_t):.2f}",
         "twice the trend engine's own per-sample cost"],
        ["`vramwatch advise` on a trace (8 ranks x 5,000 steps, 40k samples)",
         f"{advise_t:.2f} s / {2 * analyze_t:.2f} s = {advise_t / (2 * analyze_t):.2f}",
         "twice `vramwatch analyze` of the same file"],
    ]
    return table(["what", "measured / limit = ratio", "limit"], rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.decisions_bench")
    parser.add_argument("--quick", action="store_true", help="fewer seeds, no file written")
    args = parser.parse_args(argv)
    seeds = 2 if args.quick else 4
    started = time.perf_counter()
    acc, worst = accuracy(seeds)
    conv = convergence(seeds)
    abl = ablation(seeds)
    real = torch_real()
    ready, agree, cases = readiness_on_corpus()
    gates = gate_pairs(3 if args.quick else 10)
    steps, step_errors = procedure(1 if args.quick else 3)
    leaks = leak_gate(2 if args.quick else 5)
    cost = costs() + "\n\n" + live_advice_cost()
    body = f"""
**Largest batch that fits and projected peaks** against the simulator's truth (token scenarios of
`vramwatch/simulation/tokens.py`: transient = fixed part + activation per token, 3 % batch-composition
jitter at equal tokens; `varlen_quadratic` adds a quadratic share; `fixed*` never vary tokens, `+refs` adds
two runs at 18,432 and 14,336 tokens). 2 ranks per run, 4,000 steps, {seeds} seeds, devices 143.8 / 80 / 24 GB.
Error = (predicted - true) / true; the largest batch keeps 5 % of the device free at the worst phase; peaks
are projected at 1.1-1.3x the largest tokens the run has seen (the worst phase's device need).
Goal: within 10 % up to 1.3x. Worst over all rows: {max(worst):.2%} / 10% = {max(worst) / GOAL:.2f}.

{acc}

`fixed` without references uses the proportional assumption (stated uncertainty 25 %): with a fixed share in
the transient it under-states the largest batch (conservative) by the share shown.

**Ablation** (rank 0, {seeds} seeds, 143.8 GB): a transient assumed proportional to tokens, or a straight
envelope where memory grows faster than tokens, would have missed by this much:

{abl}

**A real model** (PyTorch on CPU: a 2-layer transformer with naive attention; the transient is
what autograd keeps for the backward pass, measured per batch shape with `saved_tensors_hooks`, scaled
x1000 to GPU sizes; tests/torch_transient.py). Projected at 1.1-1.3x the largest tokens seen (1,536)
against the measurement of that batch:

{real}

**Online convergence** (`varlen_rare_long`: long batches rare, the model sees ever longer ones):

{conv}

**Readiness on the engine corpus** (`tests/corpus.py`, h200 and a100-80gb scales, default thresholds):
{agree}/{cases} agree with the expected verdict.

{ready}

**The procedure on replays with known truth** (`vramwatch/simulation/stories.py`: a KoHRM-like job, 22,528
token slots per GPU = 180,224 global over 8, played process by process; a buffer the checkpoint needs only
above 23,552 tokens per rank makes the raise to 24,576 run out of memory at its first checkpoint; 2 of the 8
ranks simulated, {3 if not args.quick else 1} seed(s)). "Largest batch" is what `advise` reports: the model
bounded by the evidence (below a batch that ran out of memory, never under a proven one; a model contradicted by
an OOM yields to the proven batch, else to just below the OOM, an upper bound). **Largest-batch error on the
replays that include OOMs: worst {max(step_errors):.2%}** (the model alone, which cannot see the checkpoint's
buffer, in the last column).

{steps}

**Gate** (`vramwatch gate`, tolerance 3 %) on baseline/candidate pairs with different seeds, the candidate
holding more persistent memory (its training peak +1 % or +6 %):

{gates}

Trouble the baseline does not have fails the candidate whatever its growth so far:

{leaks}

**Costs**:

{cost}

Bench took {time.perf_counter() - started:.0f} s.
"""
    print(body)
    if not args.quick:
        write_section("Decisions", body, "python -m bench.decisions_bench")


if __name__ == "__main__":
    main(sys.argv[1:])
