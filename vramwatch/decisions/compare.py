"""Two runs side by side, per rank: plateau, training peak, checkpoint and eval peaks, headroom, step time.

Ranks are matched by rank number (hosts may differ between runs). Each run is reduced to its
:class:`~vramwatch.decisions.figures.RunFigures` (what a collector serves, so a front or ``--url``
compares runs spread over several collectors). The comparison leads with a summary per run
(world size, ranks, what went wrong, the largest growth) and the ranks ordered by their largest
memory growth, so the rank that regressed most comes first at any width. OOMs, restarts and deaths
are every process's, as the run-life model counts them (:mod:`vramwatch.runlife`); the worst
headroom is the latest process's. Runs of different world sizes are compared only when asked
(``per_rank``): their ranks hold different shares of the job. O(ranks x metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.decisions.figures import RankFigures, RunFigures
from vramwatch.decisions.observe import RunObservation
from vramwatch.units import gib


@dataclass(frozen=True)
class ComparedFigure:
    """One compared figure of one rank; ``growth`` is (b - a) / a, None when either is unknown."""

    name: str  # plateau_bytes | peak_bytes | min_headroom_bytes | step_time_s | ooms | restarts | deaths
    phase: str  # train, checkpoint, eval, ...; for the others their scope: process | rank
    rank: int
    a: float | None
    b: float | None

    @property
    def growth(self) -> float | None:
        if self.a is None or self.b is None or self.a <= 0:
            return None
        return (self.b - self.a) / self.a

    def as_dict(self) -> dict[str, Any]:
        g = self.growth
        return {"metric": self.name, "phase": self.phase, "rank": self.rank, "a": self.a, "b": self.b,
                "delta": None if self.a is None or self.b is None else self.b - self.a,
                "growth": None if g is None else round(g, 6)}


#: Figures where growth is a memory regression (the gate's subjects).
MEMORY_METRICS = ("plateau_bytes", "peak_bytes")
#: What happened to a rank's processes (vramwatch.runlife), every process of the rank.
LIFE_METRICS = ("ooms", "restarts", "deaths")


def rank_metrics(rank: int, a: RankFigures | None, b: RankFigures | None) -> list[ComparedFigure]:
    """Every compared figure of one rank (either side may be missing: its values are None)."""
    out = [ComparedFigure("plateau_bytes", "train", rank, a.plateau_bytes if a else None,
                          b.plateau_bytes if b else None)]
    phases = sorted({*(a.peak_by_phase if a else {}), *(b.peak_by_phase if b else {})},
                    key=lambda p: (p != "train", p))
    for phase in phases:
        out.append(ComparedFigure("peak_bytes", phase, rank, a.peak_by_phase.get(phase) if a else None,
                          b.peak_by_phase.get(phase) if b else None))
    out.append(ComparedFigure("min_headroom_bytes", "process", rank, a.min_headroom_bytes if a else None,
                      b.min_headroom_bytes if b else None))
    out.append(ComparedFigure("step_time_s", "train", rank, a.step_time_s if a else None, b.step_time_s if b else None))
    for name in LIFE_METRICS:
        out.append(ComparedFigure(name, "rank", rank, getattr(a, name) if a else None, getattr(b, name) if b else None))
    return out


class WorldSizeMismatch(ValueError):
    """The runs ran on different numbers of ranks (CLI: exit 2 unless ``--per-rank``)."""


@dataclass(frozen=True)
class RunSummary:
    """One run at the head of a comparison."""

    run: str
    world_size: int | None
    ranks: int
    troubles: tuple[str, ...]  # unsafe causes of its history (figures.RunFigures.troubles), most serious first
    worst: str | None  # the most serious trouble, in words

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "world_size": self.world_size, "ranks": self.ranks, "troubles": list(self.troubles),
                "worst": self.worst}

    @classmethod
    def of(cls, f: RunFigures) -> RunSummary:
        found = f.troubles()
        causes = tuple(dict.fromkeys(r.cause for r in found))
        return cls(f.run, f.world_size, len(f.ranks), causes, found[0].text if found else None)


@dataclass(frozen=True)
class RankGrowth:
    """One rank's largest memory growth (plateau or a phase's peak) from A to B."""

    rank: int
    growth: float | None
    metric: str | None
    phase: str | None


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    metrics: tuple[ComparedFigure, ...]
    ranks_only_in_a: tuple[int, ...]
    ranks_only_in_b: tuple[int, ...]
    summary: tuple[RunSummary, RunSummary] | None = None
    order: tuple[RankGrowth, ...] = ()  # ranks, the largest memory growth first
    world_size_mismatch: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "metrics": [m.as_dict() for m in self.metrics],
                "ranks_only_in_a": list(self.ranks_only_in_a), "ranks_only_in_b": list(self.ranks_only_in_b),
                "runs": [s.as_dict() for s in self.summary or ()], "world_size_mismatch": self.world_size_mismatch,
                "ranks_by_growth": [{"rank": g.rank, "growth": None if g.growth is None else round(g.growth, 6),
                                     "metric": g.metric, "phase": g.phase} for g in self.order]}


def growth_order(metrics: tuple[ComparedFigure, ...]) -> tuple[RankGrowth, ...]:
    """Every rank with its largest memory growth, the largest first (ranks without one last)."""
    best: dict[int, RankGrowth] = {}
    for m in metrics:
        if m.name not in MEMORY_METRICS:
            continue
        have = best.get(m.rank)
        g = m.growth
        if have is None or (g is not None and (have.growth is None or g > have.growth)):
            best[m.rank] = RankGrowth(m.rank, g, m.name if g is not None else None, m.phase if g is not None else None)
    return tuple(sorted(best.values(), key=lambda r: (r.growth is None, -(r.growth or 0.0), r.rank)))


def _by_rank(run: RunFigures) -> dict[int, RankFigures]:
    out: dict[int, RankFigures] = {}
    for figures in run.ranks:
        out.setdefault(figures.rank, figures)  # several hosts with one rank number: the first
    return out


def compare(a: RunObservation | RunFigures, b: RunObservation | RunFigures, *, per_rank: bool = True) -> Comparison:
    """Per rank and figure; observations are reduced to their :class:`RunFigures` first.
    ``per_rank=False`` raises :class:`WorldSizeMismatch` for runs of different world sizes."""
    fa = a if isinstance(a, RunFigures) else RunFigures.of(a)
    fb = b if isinstance(b, RunFigures) else RunFigures.of(b)
    mismatch = bool(fa.world_size and fb.world_size and fa.world_size != fb.world_size)
    if mismatch and not per_rank:
        raise WorldSizeMismatch(f"world size: {fa.run} ran on {fa.world_size} ranks, {fb.run} on {fb.world_size}; "
                                "their ranks hold different shares of the job (--per-rank compares them anyway)")
    ra, rb = _by_rank(fa), _by_rank(fb)
    metrics = tuple(m for rank in sorted({*ra, *rb}) for m in rank_metrics(rank, ra.get(rank), rb.get(rank)))
    return Comparison(fa.run, fb.run, metrics, tuple(sorted(set(ra) - set(rb))), tuple(sorted(set(rb) - set(ra))),
                      (RunSummary.of(fa), RunSummary.of(fb)), growth_order(metrics), mismatch)


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return gib(value, 2)
    if name in LIFE_METRICS:
        return str(int(value))
    return f"{value:.3f} s"


def format_comparison(c: Comparison) -> str:
    """The runs' summary, then one row per rank and figure, the ranks that grew most first."""
    head = [f"{s.run}: {s.world_size or '?'} ranks (world size), {s.ranks} compared; "
            + (f"{', '.join(s.troubles)}: {s.worst}" if s.worst else "nothing unsafe") for s in c.summary or ()]
    if c.world_size_mismatch:
        head.append("world sizes differ: compared rank by rank as asked (--per-rank)")
    order = {g.rank: i for i, g in enumerate(c.order)}
    ranked = sorted(c.metrics, key=lambda m: (order.get(m.rank, len(order)), m.rank))
    header = ("rank", "metric", "phase", c.a, c.b, "growth")
    rows = [
        (str(m.rank), m.name, m.phase, _fmt(m.name, m.a), _fmt(m.name, m.b),
         "-" if m.growth is None else f"{m.growth:+.2%}")
        for m in ranked
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [*head, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    if c.ranks_only_in_a or c.ranks_only_in_b:
        lines.append(f"ranks only in {c.a}: {list(c.ranks_only_in_a)}; only in {c.b}: {list(c.ranks_only_in_b)}")
    return "\n".join(lines) + "\n"


__all__ = [
    "LIFE_METRICS",
    "MEMORY_METRICS",
    "ComparedFigure",
    "Comparison",
    "RankFigures",
    "RankGrowth",
    "RunFigures",
    "RunSummary",
    "WorldSizeMismatch",
    "compare",
    "format_comparison",
    "growth_order",
    "rank_metrics",
]
