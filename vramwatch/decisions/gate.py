"""Memory regression gate for CI: a candidate fails when something went wrong in it that did not in
the baseline, or when its plateau or any phase's peak grew beyond a tolerance, on any rank.

Trouble first, whatever the growth so far: a leak or fragmentation verdict, an OOM, a death, an
unsettled rise or lost margin (the unsafe causes of :mod:`.readiness`, over every process of
the run) that the baseline does not have fails the candidate, naming the rank and the cause: a
leak of 0.5 MiB/step has grown the peak by 1 % when CI stops it and would run out of memory later.
Then growth, judged on the allocator's own figures (plateau reserved, ``peak_allocated_bytes`` per
phase kind), which repeat across machines and drivers. A figure the baseline has and the
candidate lacks (a phase that never ran, a rank missing) is reported, not silently passed. A rank
with more OOMs than the baseline's same rank fails too when the baseline had OOMs of its own (the
counts are every process's, :mod:`vramwatch.runlife`); restarts and deaths the baseline did not have
are said on the line. Runs of different world sizes are not alike (their ranks hold different shares
of the job): comparing them raises :class:`~vramwatch.decisions.compare.WorldSizeMismatch` unless
``per_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramwatch.decisions.compare import MEMORY_METRICS, ComparedFigure, compare
from vramwatch.decisions.figures import RunFigures
from vramwatch.decisions.observe import RunObservation
from vramwatch.decisions.reasons import Reason
from vramwatch.units import gib

DEFAULT_MAX_GROWTH = 0.03


@dataclass(frozen=True)
class GateResult:
    passed: bool
    line: str  # one line: the verdict, and for a failure the rank, the cause or metric, phase and growth
    worst: ComparedFigure | None  # the figure that grew most (None when nothing comparable)
    failures: tuple[ComparedFigure, ...]
    missing: tuple[str, ...]  # baseline figures the candidate lacks
    added: tuple[str, ...] = ()  # candidate figures the baseline lacks (a new phase)
    troubles: tuple[Reason, ...] = ()  # the candidate's unsafe causes the baseline does not have


def new_troubles(baseline: RunFigures, candidate: RunFigures) -> tuple[Reason, ...]:
    """The candidate's troubles (most serious first) whose cause the baseline has on no rank."""
    known = {r.cause for r in baseline.troubles()}
    return tuple(r for r in candidate.troubles() if r.cause not in known)


def gate(baseline: RunObservation | RunFigures, candidate: RunObservation | RunFigures,
         max_growth: float = DEFAULT_MAX_GROWTH, *, per_rank: bool = False) -> GateResult:
    """Trouble the baseline does not have, then growth per rank and phase; O(ranks x (phases + processes))."""
    base = baseline if isinstance(baseline, RunFigures) else RunFigures.of(baseline)
    cand = candidate if isinstance(candidate, RunFigures) else RunFigures.of(candidate)
    cmp = compare(base, cand, per_rank=per_rank)
    memory = [m for m in cmp.metrics if m.name in MEMORY_METRICS]
    comparable = [m for m in memory if m.growth is not None]
    missing = tuple(f"{m.name} rank {m.rank} phase {m.phase}" for m in memory if m.a is not None and m.b is None)
    missing += tuple(f"rank {r}" for r in cmp.ranks_only_in_a)
    added = tuple(f"{m.name} rank {m.rank} phase {m.phase} ({gib(m.b or 0, 2)})"
                  for m in memory if m.a is None and m.b is not None)
    failures = tuple(sorted((m for m in comparable if (m.growth or 0) > max_growth),
                            key=lambda m: -(m.growth or 0)))
    worst = max(comparable, key=lambda m: m.growth or 0, default=None)
    troubles = new_troubles(base, cand)
    life = _life_note(cmp.metrics)
    if troubles:
        t = troubles[0]
        more = f" (+{len(troubles) - 1} more)" if len(troubles) > 1 else ""
        grew = f"; largest growth so far {worst.growth:+.2%}" if worst is not None and worst.growth is not None else ""
        line = f"FAIL: {t.text} (cause {t.cause}; the baseline has none){more}{grew}{life}"
        return GateResult(False, line, worst, failures, missing, added, troubles)
    new_ooms = tuple(m for m in cmp.metrics if m.name == "ooms" and (m.b or 0) > (m.a or 0))
    if new_ooms:
        m = new_ooms[0]
        more = f" (+{len(new_ooms) - 1} more ranks)" if len(new_ooms) > 1 else ""
        line = f"FAIL: rank {m.rank} hit {int(m.b or 0)} OOM(s), the baseline {int(m.a or 0)}{more}{life}"
        return GateResult(False, line, worst, new_ooms + failures, missing)
    if failures:
        f = failures[0]
        more = f" (+{len(failures) - 1} more over tolerance)" if len(failures) > 1 else ""
        line = (f"FAIL: {f.name} rank {f.rank} phase {f.phase} grew {f.growth:+.2%} "
                f"({gib(f.a or 0, 2)} -> {gib(f.b or 0, 2)}), tolerance {max_growth:.1%}{more}{life}")
        return GateResult(False, line, worst, failures, missing)
    if not comparable:
        return GateResult(False, "FAIL: nothing comparable between baseline and candidate", None, (), missing)
    line = (f"PASS: largest growth {worst.growth:+.2%} ({worst.name} rank {worst.rank} phase {worst.phase}) "
            f"within {max_growth:.1%}") if worst else "PASS"
    if missing:
        line += f"; candidate lacks {', '.join(missing[:3])}"
    if added:  # new memory the baseline never needed: not a growth, but worth a look
        line += f"; candidate adds {', '.join(added[:3])}"
    return GateResult(True, line + life, worst, (), missing, added)


def _life_note(metrics: tuple[ComparedFigure, ...]) -> str:
    """Restarts and deaths the candidate had beyond the baseline, as "; rank 2: 1 restarts ..."."""
    notes = [f"rank {m.rank}: {int(m.b or 0)} {m.name} (baseline {int(m.a or 0)})" for m in metrics
             if m.name in ("restarts", "deaths") and (m.b or 0) > (m.a or 0)]
    return f"; candidate {', '.join(notes[:3])}" if notes else ""


__all__ = ["DEFAULT_MAX_GROWTH", "GateResult", "gate", "new_troubles"]
