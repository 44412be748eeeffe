"""Two runs side by side, per rank: plateau, training peak, checkpoint and eval peaks, headroom, step time.

Ranks are matched by rank number (hosts may differ between runs). Each figure comes from
one :class:`~vramwatch.decisions.observe.RankTrack`: the plateau is the trend engine's
(reserved at the plateau), peaks are the allocator's largest ``peak_allocated_bytes`` per
phase kind (reproducible across machines, unlike NVML readings), headroom the worst over
the latest process (:func:`vramwatch.verdicts.headroom_bytes`), step time the median of the
latest train steps. O(ranks x metrics) on two observations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.units import gib

from .observe import RankTrack, RunObservation


@dataclass(frozen=True)
class Metric:
    """One compared figure of one rank; ``growth`` is (b - a) / a, None when either is unknown."""

    name: str  # plateau_bytes | peak_bytes | min_headroom_bytes | step_time_s
    phase: str  # train, checkpoint, eval, ... ("-" for run-wide figures)
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


def rank_metrics(rank: int, a: RankTrack | None, b: RankTrack | None) -> list[Metric]:
    """Every compared figure of one rank (either side may be missing: its values are None)."""

    def plateau(t: RankTrack | None) -> float | None:
        return None if t is None else t.engine.summary().get("plateau_bytes")

    def step_time(t: RankTrack | None) -> float | None:
        return None if t is None else t.builder.model().step_time_s

    out = [Metric("plateau_bytes", "train", rank, plateau(a), plateau(b))]
    phases = sorted({*(a.peak_by_phase if a else {}), *(b.peak_by_phase if b else {})},
                    key=lambda p: (p != "train", p))
    for phase in phases:
        out.append(Metric("peak_bytes", phase, rank, a.peak_by_phase.get(phase) if a else None,
                          b.peak_by_phase.get(phase) if b else None))
    out.append(Metric("min_headroom_bytes", "-", rank, a.min_headroom_bytes if a else None,
                      b.min_headroom_bytes if b else None))
    out.append(Metric("step_time_s", "train", rank, step_time(a), step_time(b)))
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


def _by_rank(obs: RunObservation) -> dict[int, RankTrack]:
    out: dict[int, RankTrack] = {}
    for track in obs.tracks():
        out.setdefault(track.rank, track)  # several hosts with one rank number: the first
    return out


def compare(a: RunObservation, b: RunObservation) -> Comparison:
    ra, rb = _by_rank(a), _by_rank(b)
    metrics = [m for rank in sorted({*ra, *rb}) for m in rank_metrics(rank, ra.get(rank), rb.get(rank))]
    return Comparison(a.run, b.run, tuple(metrics), tuple(sorted(set(ra) - set(rb))),
                      tuple(sorted(set(rb) - set(ra))))


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return gib(value, 2)
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


__all__ = ["MEMORY_METRICS", "Comparison", "Metric", "compare", "format_comparison", "rank_metrics"]
