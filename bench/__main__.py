"""``make bench``: run every benchmark and rewrite its section of docs/benchmarks.md.

    python -m bench                 # all
    python -m bench ingest engine   # some
"""

from __future__ import annotations

import importlib
import sys
import time

BENCHMARKS = {
    "ingest": "bench.ingest_bench",
    "engine": "bench.engine_bench",
    "sparse": "bench.sparse_bench",
    "hook": "bench.hook_bench",
    "last_words": "bench.last_words_bench",
    "metrics": "bench.metrics_bench",
    "dashboard": "bench.dashboard_bench",
    "dashboard_polling": "bench.dashboard_polling",
    "load": "bench.load",
    "front": "bench.front_bench",
    "series": "bench.series_bench",
    "decisions": "bench.decisions_bench",
    "http": "bench.http_bench",
    "snapshot_diff": "bench.snapshot_diff_bench",
}


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"bench: error: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            importlib.import_module(BENCHMARKS[name]).main([])
        except Exception as exc:  # one broken benchmark must not hide the others' figures
            print(f"== {name} FAILED: {exc!r}", flush=True)
            failed.append(name)
        print(f"== {name} took {time.perf_counter() - started:.0f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
