"""``vramwatch advise``, ``compare`` and ``gate``: registered into the main CLI by :func:`register`.

Exit codes: 0 done (gate: passed; ``advise --check``: ready), 1 gate failed or ``advise --check``
not ready (advise, compare: ``--url`` unreachable), 2 bad input, runs of different world sizes
without ``--per-rank`` (one line on stderr, raised as :class:`vramwatch.cli.common.UsageError`),
3 gate: ``--url`` unreachable (a CI job can tell an outage from a regression).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any

from vramwatch.cli.common import Outage, UsageError, cli_call, db_path
from vramwatch.decisions import MAX_CHECKPOINTS, MAX_PLATEAU_STEPS
from vramwatch.decisions.observe import RunObservation, SourceError, observe
from vramwatch.units import gib
from vramwatch.verdicts import LOW_HEADROOM_FRACTION
from vramwatch.wire import WireError, iter_samples

EXIT_GATE_FAILED = 1
#: advise --check: the batch is not (yet) ready
EXIT_NOT_READY = 1
#: gate and advise: the collector or front could not be reached (neither a pass nor a regression,
#: neither ready nor not ready)
EXIT_UNREACHABLE = 3


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text}")
    return value


def _whole(low: int, high: int, what: str) -> Any:
    """An argparse type: a whole number of ``what`` in ``[low, high]`` (the API's bounds)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number of {what}: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}..{high} {what}, got {text}")
        return value

    parse.__name__ = what
    return parse


_tokens = _whole(1, 2**53, "tokens")


def _resolve(source: str, args: argparse.Namespace) -> Any:

    from vramwatch.decisions.observe import SourceError

    try:
        return resolve(source, db_path(args))
    except SourceError as exc:
        raise UsageError(str(exc)) from None


def _dump(doc: dict[str, Any]) -> None:
    import orjson

    sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


def _remote(command: str, args: argparse.Namespace, run: str, what: str, read: Any,
            params: dict[str, Any] | None = None) -> Any:
    """``read(doc)`` of run ``run``'s ``what`` document from ``--url`` (a collector or a front):
    None when it could not be reached (one line printed; the command exits 1); a 4xx, a bad URL
    or a document ``read`` cannot take is a usage error (exit 2)."""
    from vramwatch import remote

    try:
        return cli_call(command, args.url, lambda url: read(remote.get_json(url, remote.run_path(run, what),
                                                                                   params)),
                               f"{what} document for {run!r}")
    except Outage:
        return None


def _figures(command: str, source: str, args: argparse.Namespace) -> Any:
    """A run's compare figures: from ``--url`` (joined over every shard when it is a front), else
    replayed from the database or trace files. None: the server could not be reached."""
    from vramwatch.decisions.figures import RunFigures

    if args.url:
        return _remote(command, args, source, "figures", RunFigures.from_dict)
    return RunFigures.of(_resolve(source, args))


def _both_figures(command: str, a: str, b: str, args: argparse.Namespace) -> tuple[Any, Any] | None:
    """Both runs' figures, or None (after one line) when the server could not be reached."""
    first = _figures(command, a, args)
    if first is None:
        return None
    second = _figures(command, b, args)
    return None if second is None else (first, second)


def _advice(args: argparse.Namespace) -> Any:
    """The advice: asked of ``--url`` (a front decides over every shard's ranks), else computed here."""
    from vramwatch.decisions.advice import advise, join
    from vramwatch.decisions.grid import OffGrid
    from vramwatch.decisions.readiness import ReadinessConfig

    if args.url:
        params = {"margin": args.margin, "target_tokens": args.target_tokens,
                  "target_global_tokens": args.target_global_tokens, "plateau_steps": args.plateau_steps,
                  "checkpoints": args.checkpoints, "reference": args.reference, "granularity": args.granularity}
        return _remote("advise", args, args.run, "advice",
                       lambda doc: join([doc], granularity=args.granularity), params)
    obs = _resolve(args.run, args)
    refs = [_resolve(r, args) for r in args.reference or []]
    config = ReadinessConfig(plateau_steps=args.plateau_steps, checkpoints=args.checkpoints, margin=args.margin)
    try:
        return advise(obs, margin=args.margin, target_tokens=args.target_tokens, readiness_config=config,
                      references=refs, granularity=args.granularity, target_global_tokens=args.target_global_tokens)
    except OffGrid as exc:
        raise UsageError(str(exc)) from None


_BOUND = {"model": "by the model", "oom": "below a batch that ran out of memory", "proven": "a proven batch"}


def advice_text(result: Any) -> str:
    """``vramwatch advise``'s text: verdict, reasons, the largest batch, the evidence and its grid, a
    target, the binding rank's memory by category and what each remedy would save, the next step
    (last). Every batch reads global first, per rank beside it."""
    from vramwatch.decisions.remedies import remedy_lines

    r = result.readiness
    w = result.world_size
    lines = [f"run {result.run}: {r.verdict.upper()} (plateau held {r.plateau_steps:,} steps, "
             f"{r.checkpoints_passed} checkpoint(s) passed, worst headroom {gib(r.min_headroom_bytes)} "
             f"on rank {r.min_headroom_rank})"]
    lines += [f"  - {reason.text}" for reason in r.reasons]
    head = f"largest settable batch that keeps {result.margin:.0%} free: "
    if result.max_tokens_per_step is not None:
        cap = next((c for c in result.ranks if c.rank == result.binding_rank), None)
        where = f"; binding: rank {cap.rank} at {cap.binding_phase}; fit {cap.fit_method}, uncertainty " \
                f"{cap.uncertainty_frac:.1%}" if cap is not None else ""
        lines.append(f"{head}{result.max_global_tokens_per_step:,} global ({result.max_tokens_per_step:,} per rank "
                     f"x {w} ranks), {_BOUND[result.bound]}{where}")
    elif result.max_hidden is not None:
        lines.append(head + result.max_hidden.text)
    ev = result.evidence
    top, proven = ev.ceiling(), result.next.proven
    facts = [f"proven {proven.global_tokens_per_step:,} global ({proven.tokens_per_step:,} per rank, run "
             f"{proven.run})"] if proven else []
    if top is not None:
        facts.append(f"OOM at {(top.record.tokens or 0) * w:,} global ({top.record.tokens:,} per rank; run {top.run}, "
                     f"rank {top.rank}, step {top.record.step:,}, {top.record.phase}; cause {top.record.cause})")
    others = [o for o in ev.ooms if o is not top]
    if others and top is None:  # "no OOM" is never said after one: OOMs the batch did not cause are still OOMs
        causes = ", ".join(sorted({o.record.cause for o in others}))
        facts.append(f"{len(others)} OOM(s) not caused by the batch (cause {causes})")
    lines.append(f"evidence: {'; '.join(facts) or 'nothing proven, no OOM'}")
    lines.append(f"grid: settable in steps of {ev.grid.describe(w)}")
    if result.target is not None:
        t = result.target
        verdict = {True: "fits", False: "does NOT fit", None: "cannot be judged"}[t.fits]
        lines.append(f"at {t.global_tokens_per_step:,} global ({t.tokens_per_step:,} per rank): {verdict} "
                     f"({t.because.cause}: {t.because.text})")
    lines += remedy_lines(result.memory, result.remedies)
    lines.append(f"next: {result.next.sentence}")  # the last line: what to do
    return "\n".join(lines) + "\n"


def cmd_advise(args: argparse.Namespace) -> int:
    result = _advice(args)
    if result is None:
        return EXIT_UNREACHABLE
    if args.json:
        _dump(result.as_dict())
    else:
        sys.stdout.write(advice_text(result))
    if args.check and result.readiness.verdict != "ready":
        return EXIT_NOT_READY
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from vramwatch.decisions.compare import WorldSizeMismatch, compare, format_comparison

    both = _both_figures("compare", args.run_a, args.run_b, args)
    if both is None:
        return 1
    try:
        result = compare(*both, per_rank=args.per_rank)
    except WorldSizeMismatch as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _dump(result.as_dict())
    else:
        sys.stdout.write(format_comparison(result))
    return 0


def cmd_gate(args: argparse.Namespace) -> int:

    from vramwatch.decisions.compare import WorldSizeMismatch
    from vramwatch.decisions.gate import gate

    both = _both_figures("gate", args.baseline, args.candidate, args)
    if both is None:
        return EXIT_UNREACHABLE
    try:
        result = gate(*both, args.max_growth, per_rank=args.per_rank)
    except WorldSizeMismatch as exc:
        raise UsageError(str(exc)) from None
    if result.worst is None:
        raise UsageError("nothing comparable between baseline and candidate (no shared rank and phase)")
    print(f"vramwatch gate: {result.line}")
    return 0 if result.passed else EXIT_GATE_FAILED


def _add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="ask a collector or a federating front (runs spread over shards are joined) "
                                 "instead of reading --db or trace files")


def _add_per_rank(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-rank", action="store_true",
                   help="compare runs of different world sizes rank by rank anyway (else exit 2)")


def register(sub: Any, add_db: Any) -> None:
    """Add the three subcommands to the main parser's subparsers (``add_db`` adds ``--db``)."""
    p = sub.add_parser("advise", help="readiness, largest batch that fits, and what to do next for a run")
    p.add_argument("run", help="run name in the database, or trace file(s) (comma-separated)")
    add_db(p)
    p.add_argument("--margin", type=_fraction, default=LOW_HEADROOM_FRACTION,
                   help=f"device share to keep free at the worst phase (default {LOW_HEADROOM_FRACTION})")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-global-tokens", type=_tokens, metavar="N",
                        help="judge a proposed global batch (tokens per step over every rank; on the grid)")
    target.add_argument("--target-tokens", type=_tokens, metavar="N",
                        help="judge a proposed batch in tokens per step per rank (on the grid)")
    p.add_argument("--reference", action="append", metavar="RUN",
                   help="the same job at another batch setting (fits tokens across runs); repeatable")
    p.add_argument("--plateau-steps", type=_whole(0, MAX_PLATEAU_STEPS, "steps"), default=2000, metavar="N",
                   help="steps a plateau must hold to be ready (default 2000)")
    p.add_argument("--checkpoints", type=_whole(0, MAX_CHECKPOINTS, "checkpoints"), default=1, metavar="N",
                   help="checkpoints that must be passed to be ready (default 1)")
    p.add_argument("--granularity", type=_tokens, metavar="N",
                   help="settable batches are multiples of N tokens per rank (default: declared by the training "
                        "loop, else inferred from the batches seen)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the batch is ready (for scripts)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    _add_url(p)
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("compare", help="two runs side by side per rank (plateau, peaks per phase, headroom)")
    p.add_argument("run_a", metavar="RUN_A", help="run name or trace file(s)")
    p.add_argument("run_b", metavar="RUN_B", help="run name or trace file(s)")
    add_db(p)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    _add_per_rank(p)
    _add_url(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("gate", help="CI memory regression gate: exit 1 when the candidate grew beyond tolerance")
    p.add_argument("baseline", metavar="BASELINE", help="run name or trace file(s)")
    p.add_argument("candidate", metavar="CANDIDATE", help="run name or trace file(s)")
    add_db(p)
    p.add_argument("--max-growth", type=_fraction, default=0.03, help="tolerated growth (default 0.03)")
    _add_per_rank(p)
    _add_url(p)
    p.set_defaults(func=cmd_gate)


__all__ = ["register"]


# ---------------------------------------------------------------- sources: a stored run or trace files

def observe_db(db_path: str, run: str) -> RunObservation:
    """A stored run, read through a read-only Store (never writes)."""
    from vramwatch.collector.store import Store, StoreError  # sqlite only when a database is read

    if not os.path.exists(db_path):
        raise SourceError(f"no database at {db_path}")
    try:
        store = Store(db_path, readonly=True)
    except StoreError as exc:
        raise SourceError(str(exc)) from None
    try:
        if run not in store.runs():
            raise SourceError(f"no run named {run!r} in {db_path}")
        return observe(store.iter_samples(run))[run]
    finally:
        store.close()


def observe_files(paths: Iterable[str]) -> RunObservation:
    """Trace files (.jsonl / .jsonl.gz) holding one run; several runs in them is an error."""
    def samples() -> Iterable[dict[str, Any]]:
        for path in paths:
            if not os.path.isfile(path):
                raise SourceError(f"cannot read {path}: no such file")
            try:
                yield from iter_samples(path)
            except WireError as exc:
                raise SourceError(str(exc)) from None
            except (OSError, EOFError, UnicodeDecodeError) as exc:
                raise SourceError(f"cannot read {path}: {exc}") from None

    runs = observe(samples())
    if not runs:
        raise SourceError("no samples in " + ", ".join(paths))
    if len(runs) > 1:
        raise SourceError(f"traces hold several runs ({', '.join(sorted(runs))}); give one run's files")
    return next(iter(runs.values()))


def resolve(source: str, db_path: str | None) -> RunObservation:
    """A run name in the database, or a trace file, or comma-separated trace files."""
    parts = [p for p in source.split(",") if p]
    if parts and all(os.path.isfile(p) for p in parts):
        return observe_files(parts)
    if db_path is None:
        raise SourceError(f"{source!r} is neither a trace file nor a run (no database given)")
    return observe_db(db_path, source)
