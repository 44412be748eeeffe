"""The collector's hot paths in one process, printed as JSON: to compare two trees in one run.

    python -m bench.live_bench [--ranks 64 --steps 1500] [--metrics-ranks 4096]

* ``live_us_per_sample``: CPU per sample of ``LiveState.ingest`` (the run-life fold, the frontier,
  the rank's engine: the trend engine plus the decision figures), batches of 1000 as ingest hands
  them over, median of 5 rounds;
* ``stages``: ``bench.ingest_bench.stage_costs`` (gunzip, decode + validate, SQLite insert, live
  state, engines), CPU ms per 1000 samples;
* ``metrics``: ``/metrics`` rendered at ``--metrics-ranks`` ranks of ``bench.metrics_bench``'s live
  state, judged at a fixed instant (a minute after the samples: every rank live, whatever time the
  feeding took on a loaded machine), median of ``--repeat``; and once more with the run's life judged
  afresh each time.

To compare with another tree, extract it (``git archive REF | tar -x -C /tmp/ref``), copy this file
into its ``bench/`` and run the same command there, alternating the trees (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def live_cost(ranks: int, steps: int, rounds: int = 5) -> float:
    """Median CPU microseconds per sample of ``LiveState.ingest`` over a fresh state per round."""
    from vramwatch.collector.state.live import LiveState
    from vramwatch.probe.simulated import simulate_trace

    start = time.time() - steps - 10
    samples = []
    for rank in range(ranks):
        scenario = "fast_leak" if rank % 16 == 3 else "checkpoint"
        samples += simulate_trace(scenario, steps=steps, run="bench", host=f"node-{rank // 8}", rank=rank,
                                  start_ts=start, step_time_s=1.0)
    samples.sort(key=lambda s: s["ts"])  # as the ranks' posts interleave
    batches = [samples[i:i + 1000] for i in range(0, len(samples), 1000)]
    costs = []
    for _ in range(rounds):
        live = LiveState()
        t0 = time.process_time()
        for batch in batches:
            live.ingest(batch)
        costs.append((time.process_time() - t0) / len(samples) * 1e6)
    return statistics.median(costs)


def metrics_cost(ranks: int, steps: int, repeat: int) -> dict:
    """Median ms of ``metrics.render`` over ``ranks`` ranks, the clock fixed (see the module doc)."""
    from bench.metrics_bench import real_live
    from vramwatch.collector.exporters.metrics import build_registry, render

    fed_at = time.time()
    live = real_live(ranks, steps=steps)
    registry, _ = build_registry(live, clock=lambda: fed_at + 60)
    body, _ = render(registry, None)
    plain, judged = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        render(registry, None)
        plain.append(time.perf_counter() - t0)
        live._stories.clear()  # the first reader in a second judges the run's life afresh
        t0 = time.perf_counter()
        render(registry, None)
        judged.append(time.perf_counter() - t0)
    return {"render_ms": statistics.median(plain) * 1e3, "render_judged_ms": statistics.median(judged) * 1e3,
            "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--ingest-samples", type=int, default=64_000)
    parser.add_argument("--metrics-ranks", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--metrics-only", action="store_true")
    args = parser.parse_args(argv)
    from bench.ingest_bench import stage_costs

    if args.metrics_only:
        out = {"metrics": metrics_cost(args.metrics_ranks, 60, args.repeat)}
        print("RESULT " + json.dumps(out))
        return out
    out = {"live_us_per_sample": live_cost(args.ranks, args.steps),
           "stages": stage_costs(args.ingest_samples, args.ranks, 1000),
           "metrics": metrics_cost(args.metrics_ranks, 60, args.repeat)}
    print("RESULT " + json.dumps(out))
    return out


if __name__ == "__main__":
    main()
