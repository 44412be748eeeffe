"""Benchmark: GET /metrics render time for thousands of ranks (issue 5 target: 4096 ranks < 250 ms).

    .venv/bin/python -m bench.metrics_bench [--ranks 4096] [--repeat 15]

The live state is the collector's real ``LiveState`` fed through its ingest path when
``vramwatch.collector.live`` is importable (every rank gets a short simulated trace, so
the engines hold real summaries); otherwise a stand-in with the same attributes.
Reported: median render time of ``metrics.render`` (fast path) and, measured side by
side, prometheus_client's generic ``generate_latest`` over the same registry.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from prometheus_client import generate_latest

from vramwatch.collector.metrics import build_registry, render

GIB = 1024**3


class _StaticEngine:
    def __init__(self, rank: int) -> None:
        self.state = "leak" if rank % 97 == 0 else "plateau"
        self._summary = {
            "state": self.state, "plateau_bytes": 127 * GIB + rank, "headroom_bytes": 13 * GIB,
            "slope_bytes_per_step": 2.5e7 if self.state == "leak" else 0.0,
            "steps_to_oom": 700 if self.state == "leak" else None,
            "seconds_to_oom": 690.0 if self.state == "leak" else None, "leak_source": None,
            "fragmentation": False, "outside_allocator_bytes": 2 * GIB, "plateau_breaks": rank % 3,
            "checkpoint_peak_bytes": 131 * GIB, "checkpoint_headroom_bytes": 9 * GIB, "total_bytes": 143 * GIB,
        }

    def summary(self) -> dict:
        return dict(self._summary)


def standin_live(ranks: int, now: float) -> SimpleNamespace:
    series = []
    for rank in range(ranks):
        last = {
            "schema": 1, "run": "bench-run", "host": f"node-{rank // 8:04d}", "rank": rank, "step": 12345,
            "ts": now, "phase": "train", "allocated_bytes": 120 * GIB + rank, "reserved_bytes": 128 * GIB,
            "peak_allocated_bytes": 126 * GIB, "inactive_split_bytes": 3 * GIB, "alloc_retries": 0, "ooms": 0,
            "nvml_used_bytes": 130 * GIB, "total_bytes": 143 * GIB, "active_bytes": 121 * GIB,
        }
        series.append(SimpleNamespace(
            run="bench-run", host=last["host"], rank=rank, uuid=f"GPU-{rank:08x}-1111-2222-3333-444455556666",
            gpu=rank % 8, incarnation="i0", last=last, last_train=last, engine=_StaticEngine(rank),
            samples=100, last_seen=now,
        ))
    return SimpleNamespace(snapshot=lambda: list(series))


def real_live(ranks: int, steps: int):  # pragma: no cover - depends on the lead's module
    from vramwatch.collector.live import LiveState
    from vramwatch.probe.simulated import simulate_trace

    live = LiveState()
    start = time.time() - steps
    for rank in range(ranks):
        scenario = "leak" if rank % 97 == 0 else "plateau"
        for sample in simulate_trace(scenario, steps=steps, run="bench-run", host=f"node-{rank // 8:04d}",
                                     rank=rank, start_ts=start, step_time_s=1.0):
            live.ingest(sample)
    return live


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--standin", action="store_true", help="use the stand-in live state even if LiveState exists")
    args = parser.parse_args(argv)

    source = "stand-in"
    live = None
    if not args.standin:
        try:
            live = real_live(args.ranks, steps=60)
            source = "LiveState fed by simulate_trace (60 steps per rank)"
        except (ImportError, AttributeError, TypeError) as exc:
            print(f"real LiveState unavailable ({exc}); using the stand-in")
    if live is None:
        live = standin_live(args.ranks, time.time())
    registry, _ = build_registry(live)

    fast, generic = [], []
    size = 0
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        t0 = time.perf_counter()
        body, _ = render(registry, None)
        fast.append(time.perf_counter() - t0)
        size = len(body)
        t0 = time.perf_counter()
        generate_latest(registry)
        generic.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    om_body, _ = render(registry, "application/openmetrics-text; version=1.0.0")
    om_seconds = time.perf_counter() - t0
    result = {
        "ranks": args.ranks, "source": source, "samples": body.count(b"\n") - body.count(b"\n#"),
        "bytes": size, "median_render_ms": statistics.median(fast) * 1e3,
        "median_generic_ms": statistics.median(generic) * 1e3,
        "openmetrics_render_ms": om_seconds * 1e3, "openmetrics_bytes": len(om_body),
    }
    result["speedup"] = result["median_generic_ms"] / result["median_render_ms"]
    for key, value in result.items():
        print(f"{key:>22}: {value:.1f}" if isinstance(value, float) else f"{key:>22}: {value}")
    return result


if __name__ == "__main__":
    main()
