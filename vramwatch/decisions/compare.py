"""Two runs side by side, per rank: plateau, training peak, checkpoint and eval peaks, headroom, step time.

Ranks are matched by rank number (hosts may differ between runs). Each figure comes from
one :class:`~vramwatch.decisions.observe.RankTrack`, reduced to its :class:`RankFigures` (what
a collector serves, so a front or ``--url`` compares runs spread over several collectors): the
plateau is the trend engine's (reserved at the plateau), peaks are the allocator's largest ``peak_allocated_bytes`` per
phase kind (reproducible across machines, unlike NVML readings), headroom the worst over
the latest process (:func:`vramwatch.verdicts.headroom_bytes`), step time the median of the
latest train steps; OOMs, restarts and deaths are every process's, as the run-life model counts
them (:mod:`vramwatch.runlife`). The ``phase`` of a figure that is no phase's says its scope:
``process`` (the rank's latest process) or ``rank`` (every process of the rank). O(ranks x metrics)
on two observations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vramwatch.runlife import RankStory
from vramwatch.units import gib

from .observe import RankTrack, RunObservation


@dataclass(frozen=True)
class Metric:
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


@dataclass(frozen=True)
class RankFigures:
    """What compare and the gate read of one rank: small, JSON-safe, the same whether it was
    computed here from samples or by a collector (``GET /api/v1/runs/{run}/figures``)."""

    host: str
    rank: int
    plateau_bytes: float | None
    peak_by_phase: dict[str, int]  # allocator peak per phase kind
    min_headroom_bytes: int | None  # the latest process's worst
    step_time_s: float | None
    ooms: int = 0  # every process of the rank (vramwatch.runlife)
    restarts: int = 0
    deaths: int = 0  # processes that died: OOM, killed alone, stopped with the job

    @classmethod
    def of(cls, track: RankTrack, story: RankStory | None = None) -> RankFigures:
        """From an observed rank and its story: O(1) beyond a median of the latest step times."""
        return cls(track.host, track.rank, track.engine.summary().get("plateau_bytes"), dict(track.peak_by_phase),
                   track.min_headroom_bytes, track.builder.model().step_time_s,
                   *((story.ooms, story.restarts, story.deaths) if story is not None else (0, 0, 0)))

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "plateau_bytes": self.plateau_bytes,
                "peak_by_phase": dict(self.peak_by_phase), "min_headroom_bytes": self.min_headroom_bytes,
                "step_time_s": self.step_time_s, "ooms": self.ooms, "restarts": self.restarts, "deaths": self.deaths}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RankFigures:
        return cls(str(doc["host"]), int(doc["rank"]), doc.get("plateau_bytes"),
                   {str(k): int(v) for k, v in (doc.get("peak_by_phase") or {}).items()},
                   doc.get("min_headroom_bytes"), doc.get("step_time_s"),
                   int(doc.get("ooms") or 0), int(doc.get("restarts") or 0), int(doc.get("deaths") or 0))


@dataclass(frozen=True)
class RunFigures:
    """Every rank's :class:`RankFigures` of one run, in (rank, host) order."""

    run: str
    ranks: tuple[RankFigures, ...]

    @classmethod
    def of(cls, obs: RunObservation, now: float | None = None) -> RunFigures:
        """Every rank's figures, its life judged at ``now`` (default: the clock)."""
        index = obs.life.story(time.time() if now is None else now).index() if obs.life is not None else {}
        return cls(obs.run, tuple(RankFigures.of(t, index.get((t.host, t.rank))) for t in obs.tracks()))

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "ranks": [r.as_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunFigures:
        """One document, or (``join``) the documents of several collectors holding parts of the run."""
        return cls.join(str(doc["run"]), [doc])

    @classmethod
    def join(cls, run: str, docs: list[dict[str, Any]]) -> RunFigures:
        """The ranks of several collectors' documents for ``run`` as one (KeyError/TypeError/ValueError
        on a malformed document)."""
        ranks = (RankFigures.from_dict(r) for d in docs for r in d["ranks"])
        return cls(run, tuple(sorted(ranks, key=lambda r: (r.rank, r.host))))


def rank_metrics(rank: int, a: RankFigures | None, b: RankFigures | None) -> list[Metric]:
    """Every compared figure of one rank (either side may be missing: its values are None)."""
    out = [Metric("plateau_bytes", "train", rank, a.plateau_bytes if a else None, b.plateau_bytes if b else None)]
    phases = sorted({*(a.peak_by_phase if a else {}), *(b.peak_by_phase if b else {})},
                    key=lambda p: (p != "train", p))
    for phase in phases:
        out.append(Metric("peak_bytes", phase, rank, a.peak_by_phase.get(phase) if a else None,
                          b.peak_by_phase.get(phase) if b else None))
    out.append(Metric("min_headroom_bytes", "process", rank, a.min_headroom_bytes if a else None,
                      b.min_headroom_bytes if b else None))
    out.append(Metric("step_time_s", "train", rank, a.step_time_s if a else None, b.step_time_s if b else None))
    for name in LIFE_METRICS:
        out.append(Metric(name, "rank", rank, getattr(a, name) if a else None, getattr(b, name) if b else None))
    return out


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    metrics: tuple[Metric, ...]
    ranks_only_in_a: tuple[int, ...]
    ranks_only_in_b: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "metrics": [m.as_dict() for m in self.metrics],
                "ranks_only_in_a": list(self.ranks_only_in_a), "ranks_only_in_b": list(self.ranks_only_in_b)}


def _by_rank(run: RunFigures) -> dict[int, RankFigures]:
    out: dict[int, RankFigures] = {}
    for figures in run.ranks:
        out.setdefault(figures.rank, figures)  # several hosts with one rank number: the first
    return out


def compare(a: RunObservation | RunFigures, b: RunObservation | RunFigures) -> Comparison:
    """Per rank and figure; observations are reduced to their :class:`RunFigures` first."""
    fa = a if isinstance(a, RunFigures) else RunFigures.of(a)
    fb = b if isinstance(b, RunFigures) else RunFigures.of(b)
    ra, rb = _by_rank(fa), _by_rank(fb)
    metrics = [m for rank in sorted({*ra, *rb}) for m in rank_metrics(rank, ra.get(rank), rb.get(rank))]
    return Comparison(fa.run, fb.run, tuple(metrics), tuple(sorted(set(ra) - set(rb))),
                      tuple(sorted(set(rb) - set(ra))))


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return gib(value, 2)
    if name in LIFE_METRICS:
        return str(int(value))
    return f"{value:.3f} s"


def format_comparison(c: Comparison) -> str:
    """A readable table: one row per rank and figure."""
    header = ("rank", "metric", "phase", c.a, c.b, "growth")
    rows = [
        (str(m.rank), m.name, m.phase, _fmt(m.name, m.a), _fmt(m.name, m.b),
         "-" if m.growth is None else f"{m.growth:+.2%}")
        for m in c.metrics
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    if c.ranks_only_in_a or c.ranks_only_in_b:
        lines.append(f"ranks only in {c.a}: {list(c.ranks_only_in_a)}; only in {c.b}: {list(c.ranks_only_in_b)}")
    return "\n".join(lines) + "\n"


__all__ = ["LIFE_METRICS", "MEMORY_METRICS", "Comparison", "Metric", "RankFigures", "RunFigures", "compare",
           "format_comparison", "rank_metrics"]
