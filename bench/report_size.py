"""Size and build time of ``vramwatch report`` for 8 and 512 ranks (an operator's report: "8 MB for 8 ranks
and 23 MB for 512"), with the plotly bundle the report inlines: the partial cartesian bundle
the dashboard serves (``dashboard_plotly_js_path()``, now the default) against the full one
(``plotly_js_path()``, before), both in the same run on the same databases.

Data: ``demo`` scenario traces (checkpoints every 200 steps, rank 7 leaking) written through
the store: 8 ranks x 2,000 steps and 512 ranks x 500 steps.

Run: ``python -m bench.report_size`` (about a minute); writes the "Report size" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.report import table, write_section
from vramwatch import report
from vramwatch.collector.serving.app import dashboard_plotly_js_path, plotly_js_path
from vramwatch.collector.store import Store
from vramwatch.probe.simulated import simulate_trace

CASES = ((8, 2000), (512, 500))
MB = 1e6


def fill(db: str, run: str, ranks: int, steps: int) -> None:
    store = Store(db)
    start = time.time() - steps * 1.0 - 60
    store.insert_stream((s for r in range(ranks) for s in simulate_trace(
        "demo", steps=steps, run=run, host=f"node-{r // 8:03d}", rank=r, start_ts=start, step_time_s=1.0, seed=r,
        ckpt_every=200, leak_rank=7, leak_onset=100)), 50_000)
    store.close()


def measure(db: str, run: str, plotly: Path) -> tuple[int, float]:
    original = report.dashboard_plotly_js_path
    report.dashboard_plotly_js_path = lambda: plotly  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        size = len(report.build_report(db, run).encode("utf-8"))
        return size, time.perf_counter() - t0
    finally:
        report.dashboard_plotly_js_path = original  # type: ignore[assignment]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, steps in CASES:
            db, run = str(Path(tmp) / f"r{ranks}.db"), f"bench-{ranks}"
            fill(db, run, ranks, steps)
            full, t_full = measure(db, run, plotly_js_path())
            part, t_part = measure(db, run, dashboard_plotly_js_path())
            rows.append((f"{ranks} x {steps}", f"{full / MB:.2f} MB", f"{t_full:.1f} s", f"{part / MB:.2f} MB",
                         f"{t_part:.1f} s", f"{part / full:.2f}"))
            print(rows[-1], flush=True)
    body = table(("ranks x steps", "full plotly (before)", "build", "partial plotly (now)", "build",
                  "size now / before"), rows)
    body += (f"\n\nplotly bundles: full {plotly_js_path().stat().st_size / MB:.2f} MB, partial "
             f"{dashboard_plotly_js_path().stat().st_size / MB:.2f} MB. The rest is the embedded data (≤ "
             f"{report.MAX_SERIES_RANKS} charted ranks sharing {report.REPORT_POINTS:,} points, every rank's "
             "verdict and events, two heatmaps per axis) and the dashboard's modules.")
    write_section("Report size", body, "python -m bench.report_size")


if __name__ == "__main__":
    main()
