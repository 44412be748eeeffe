"""What recording a process's last words costs.

1. The training thread: ``vw.step()`` and a ``with vw.phase("checkpoint")`` block with the hook's
   constant probe (its own overhead only), for a monitor that records last words (excepthooks
   chained, faulthandler armed, the state writer running) against one that does not, in
   interleaved rounds of one run. Limit: the monitor without last words (goal: no more cost).
2. Off the training thread: the excepthook building and queueing one marker sample, and the
   state writer's rewrite of the state file, per call.

    python -m bench.last_words_bench [--calls 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.hook_bench import ConstantProbe
from bench.report import table, write_section
from vramwatch.hook import Monitor


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls * 1e6


def _phase(vw: Monitor):
    def run(_i: int) -> None:
        with vw.phase("checkpoint"):
            pass
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        on = Monitor(None, run="lw-on", probe=ConstantProbe(), out_dir=Path(tmp) / "on", max_queue=10**7)
        off = Monitor(None, run="lw-off", probe=ConstantProbe(), out_dir=Path(tmp) / "off", max_queue=10**7)
        assert on.last_words is not None and on.last_words.crash_file is not None
        off.last_words.close()  # type: ignore[union-attr]
        off.last_words = None
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            pair = (("without", off), ("with", on))
            for label, vw in pair if r % 2 else pair[::-1]:  # alternate who goes first
                results.setdefault(("step", label), []).append(_per_call_us(vw.step, args.calls))
                results.setdefault(("phase", label), []).append(_per_call_us(_phase(vw), args.calls // 4))
                vw.flush(60)  # its delivery worker's backlog must not land on the other's turn
        recorder = on.last_words
        exc = RuntimeError("CUDA error: an illegal memory access was encountered")
        speak = _per_call_us(lambda _i: recorder.on_exception(exc, recorder.thread_id), 2000)

        def rewrite(_i: int) -> None:
            recorder._written = None
            recorder.write_state()
        write = _per_call_us(rewrite, 500)
        on.close(5)
        off.close(5)
    rows = []
    for what, name in (("step", "`vw.step()`, constant probe"), ("phase", "`with vw.phase(\"checkpoint\")`")):
        without, with_ = statistics.median(results[(what, "without")]), statistics.median(results[(what, "with")])
        rows.append((name, f"{with_:.2f}", f"{without:.2f}", f"{with_ / without:.3f}"))
    body = (
        "Training-thread cost of a monitor that records last words (excepthooks chained, faulthandler "
        "armed, the state writer running) against one that does not, interleaved rounds of one run, "
        f"median of {args.rounds} (the order alternating, each monitor's backlog delivered before the "
        "other's turn). Limit: the monitor without last words.\n\n"
        + table(("call", "with last words µs", "limit: without µs", "measured / limit"), rows)
        + f"\n\nOff the training thread: the excepthook builds and queues one marker in {speak:.1f} µs; the "
        f"state writer rewrites the state file in {write:.0f} µs (at most once per flush interval).\n\n"
        f"Bench took {time.perf_counter() - started:.0f} s."
    )
    write_section("Last words: cost on the training thread", body, "python -m bench.last_words_bench")
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
