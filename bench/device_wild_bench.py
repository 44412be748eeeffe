"""The device-used-only engine on ``bench/device_wild.py`` (neighbours, NCCL, young fast leaks,
irregular staircases, device-seen OOMs), per phenomenon, next to Prometheus ``predict_linear``.

    .venv/bin/python -m bench.device_wild_bench                    # eval split, 8 per family: prints the section
    .venv/bin/python -m bench.device_wild_bench --split tune --show
    .venv/bin/python -m bench.device_wild_bench --write            # appends/replaces its section in docs/benchmarks.md

Each trace goes through one ``TrendEngine`` exactly as ``watch`` / ``import`` / the hook would feed
it (``bench.device_bench.run_trace``). Per phenomenon: leak recall and false alarms (engine and
``predict_linear(used[10m], 4h) > total``), runway left at detection, the engine's time-to-OOM error
at its first alarm (median and the share within +-25 %), how often the true time falls within the
forecast's range, and suspected OOMs named on the traces whose process died of one (and on none
other).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from bench.device_bench import DETECTORS, Outcome, _found, run_trace, score
from bench.device_wild import FAMILIES, SPLITS, corpus
from bench.report import table, write_section

HEADING = "Device used only: neighbours, NCCL, young processes, irregular staircases"


def _errors(group: list[Outcome]) -> tuple[list[float], int, int]:
    """(forecast errors at the first alarm, forecasts whose range held the truth, ranges given)."""
    errors, inside, ranged = [], 0, 0
    for o in group:
        hit = _found(o, "engine") if o.truth.leak else None
        if hit is None or o.seconds_to_oom is None or o.truth.oom_ts is None or o.truth.oom_ts <= hit:
            continue
        left = o.truth.oom_ts - hit
        errors.append((o.seconds_to_oom - left) / left)
        if o.oom_range is not None:
            ranged += 1
            inside += o.oom_range[0] <= left <= o.oom_range[1]
    return errors, inside, ranged


def _suspected(group: list[Outcome]) -> tuple[int, int, int]:
    """(traces that died of an OOM, of them named as a suspected OOM, suspected OOMs named elsewhere)."""
    died = named = wrong = 0
    for o in group:
        says = [e["ts"] for e in o.events if e["type"] == "suspected_oom"]
        if o.truth.leak and o.oom_seen and o.source != "hook":  # a dead hook sends nothing
            died += 1
            assert o.truth.oom_ts is not None
            named += any(abs(t - o.truth.oom_ts) <= 600.0 for t in says)
            wrong += any(abs(t - o.truth.oom_ts) > 600.0 for t in says)
        else:
            wrong += bool(says)
    return died, named, wrong


def _pct(values: list[float], within: float) -> str:
    return f"{sum(abs(v) <= within for v in values)}/{len(values)}" if values else "-"


def family_rows(outcomes: list[Outcome]) -> list[tuple[str, ...]]:
    rows = []
    for family, leaking in FAMILIES.items():
        group = [o for o in outcomes if o.family == family]
        if not group:
            continue
        cells = [family, str(len(group))]
        for detector in DETECTORS:
            s = score(group, detector)
            cells.append(f"{s['found']}/{s['leaking']} found, {s['early']} early" if leaking
                         else f"{s['false']}/{s['clean']} false")
        s = score(group, "engine")
        cells.append(f"{s['runway']:.0%}" if leaking else "-")
        errors, inside, ranged = _errors(group)
        cells.append(f"{statistics.median(errors):+.0%}" if errors else "-")
        cells.append(_pct(errors, 0.25))
        cells.append(f"{inside}/{ranged}" if ranged else "-")
        died, named, wrong = _suspected(group)
        cells.append(f"{named}/{died}" + (f", {wrong} wrong" if wrong else ""))
        rows.append(tuple(cells))
    return rows


def summary_rows(outcomes: list[Outcome]) -> list[tuple[str, ...]]:
    rows = []
    errors, inside, ranged = _errors(outcomes)
    for detector in DETECTORS:
        s = score(outcomes, detector)
        cells = [detector, f"{s['recall']:.0%} ({s['found']}/{s['leaking']})", f"{s['false']}/{s['clean']}",
                 str(s["early"]), f"{s['runway']:.0%}"]
        if detector == "engine" and errors:
            cells += [f"{statistics.median(errors):+.1%}", _pct(errors, 0.10), _pct(errors, 0.25),
                      f"{inside}/{ranged}"]
        else:
            cells += ["-", "-", "-", "-"]
        rows.append(tuple(cells))
    return rows


INTRO = """`bench/device_wild.py`: {traces} traces of one GPU each, device used and capacity only, built for the
phenomena the first device corpus lacks: another process's 0.4-0.8 GiB coming and going every 1-30 min, NCCL
buffers in five irregular ~2 GiB steps over the first hour, leaks starting 20-40 min into a young process and
filling the card in 1.1-1.9 h, staircases whose gaps vary 3-4x, a few large regular steps on a 141 GiB card, warm-ups
that are fast at first then slow down, restarts with a neighbour present; H200 / H100 / A100-80 / A100-40; dcgm-exporter
every 1-15 s, `nvidia-smi -l` every 2-10 s, a hook without allocator fields; a trace whose process runs out of memory
goes on being scraped for 10 min without it. *tune* is the split the device rules were adjusted on; *eval* draws
every parameter from other ranges with other seeds and was only run to be reported; *wide* draws from wider
ranges than both (neighbours of 0.2-2 GiB on and off for up to an hour, gaps varying up to 5.7x, 3-8 NCCL steps of
0.35-3.9 GiB within 30-90 min), reported only, to see what holds beyond them. Leak found: the first alarm
between onset and OOM; runway left = (OOM - detection) / (OOM - onset), a miss counts 0 %. Forecast error =
(forecast - actual) / actual time to OOM at the engine's first alarm; "in range": the actual time within the leak
event's `seconds_to_oom_low`..`seconds_to_oom_high`. Suspected OOM: a `suspected_oom` event within 10 min of the
process's OOM, on the dcgm and nvidia-smi traces that had one (a hook's process sends nothing once dead;
wrong: one anywhere else)."""


def section(results: dict[str, list[Outcome]], took: float) -> str:
    traces = sum(len(v) for v in results.values())
    parts = [INTRO.format(traces=traces)]
    for split, outcomes in results.items():
        samples = sum(o.samples for o in outcomes)
        parts.append(
            f"*{split}* ({len(outcomes)} traces, {samples:,} samples)\n\n"
            + table(("detector", "leak recall", "false alarms", "fired before onset", "runway left (mean)",
                     "forecast error (median)", "within +-10 %", "within +-25 %", "in range"), summary_rows(outcomes))
            + "\n\n"
            + table(("phenomenon", "traces", "engine", "predict_linear", "runway left", "forecast error (median)",
                     "within +-25 %", "in range", "suspected OOM named"), family_rows(outcomes))
        )
    return "\n\n".join(parts) + f"\n\nBench took {took:.0f} s."


def show(outcomes: list[Outcome]) -> None:
    for o in outcomes:
        truth = "clean"
        if o.truth.leak:
            assert o.truth.onset_ts is not None and o.truth.oom_ts is not None
            truth = f"leak {(o.truth.onset_ts - o.start_ts) / 3600:.2f}..{(o.truth.oom_ts - o.start_ts) / 3600:.2f} h"
        hit = _found(o, "engine") if o.truth.leak else None
        err = ""
        if hit is not None and o.seconds_to_oom is not None and o.truth.oom_ts:
            err = f"err {(o.seconds_to_oom - (o.truth.oom_ts - hit)) / (o.truth.oom_ts - hit):+.0%}"
        events = [f"{e['type']}@{(e['ts'] - o.start_ts) / 3600:.2f}" for e in o.events[:10]]
        print(f"{o.name:40} {o.source:5} {o.samples:6} {truth:22} {err:9} {' '.join(events)}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.device_wild_bench")
    parser.add_argument("--split", choices=tuple(SPLITS), action="append")
    parser.add_argument("--per-family", type=int, default=8)
    parser.add_argument("--family", action="append", help="only these phenomena")
    parser.add_argument("--show", action="store_true")
    parser.add_argument("--seed-base", type=int, help="draw the split's stories from other seeds (more draws)")
    parser.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results: dict[str, list[Outcome]] = {}
    for split in args.split or list(SPLITS):
        if args.seed_base is not None:
            SPLITS[split] = dataclasses.replace(SPLITS[split], seed_base=args.seed_base)
        results[split] = [run_trace(t) for t in corpus(split, args.per_family, args.family)]
    took = time.perf_counter() - started
    if args.show:
        for outcomes in results.values():
            show(outcomes)
    body = section(results, took)
    print(body)
    if args.write:
        write_section(HEADING, body, "python -m bench.device_wild_bench")


if __name__ == "__main__":
    main(sys.argv[1:])
