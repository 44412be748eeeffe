"""What compare and the CI gate read of a run, per rank: memory figures and what went wrong.

A :class:`RankFigures` is small and JSON-safe, the same whether it was computed here from samples
or by a collector (``GET /api/v1/runs/{run}/figures``); a front joins the ranks of several
collectors (:meth:`RunFigures.join`) and judges how each process ended over all of them. The
plateau is the trend engine's (reserved at the plateau), peaks are the allocator's largest
``peak_allocated_bytes`` per phase kind (reproducible across machines, unlike NVML readings),
headroom the worst of the current process (:func:`vramwatch.verdicts.headroom_bytes`), step time
the median of the latest train steps. :meth:`RunFigures.troubles` is every unsafe cause of the
run's history per rank (a leak, fragmentation, an OOM, a death, an unsettled rise, lost margin),
each a :class:`~vramwatch.decisions.reasons.Reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vramwatch.decisions.observe import RunObservation
from vramwatch.decisions.proven import RankTrials, judged_trials
from vramwatch.decisions.readiness import UNSAFE_CAUSES, ReadinessConfig
from vramwatch.decisions.reasons import Reason
from vramwatch.decisions.trials import Trial, leak_text
from vramwatch.decisions.views import RankView, RunView, run_view
from vramwatch.runlife import RankStory
from vramwatch.verdicts import Outcome


@dataclass(frozen=True)
class RankFigures:
    host: str
    rank: int
    plateau_bytes: float | None
    peak_by_phase: dict[str, int]  # allocator peak per phase kind
    min_headroom_bytes: int | None
    step_time_s: float | None
    unsafe: tuple[Reason, ...] = ()  # the current process's unsafe reasons (default thresholds), deaths aside
    trials: tuple[Trial, ...] = ()  # how each process went (outcomes judged across the run's ranks)
    steps_to_oom: int | None = None  # a current leak's runway
    ooms: int = 0  # every process of the rank, as the run-life model counts them (vramwatch.runlife)
    restarts: int = 0
    deaths: int = 0  # processes that died: an OOM, killed alone, stopped with the job

    @classmethod
    def of(cls, view: RankView, story: RankStory | None = None) -> RankFigures:
        """From a rank's view and its story: O(trials)."""
        r = view.readiness
        unsafe = tuple(x for x in r.reasons if r.verdict == "unsafe" and x.cause != "death")
        counts = (story.ooms, story.restarts, story.deaths) if story is not None else (0, 0, 0)
        return cls(view.host, view.rank, view.plateau_bytes, dict(view.peak_by_phase), r.min_headroom_bytes,
                   view.model.step_time_s, unsafe, view.trials, r.steps_to_oom, *counts)

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "plateau_bytes": self.plateau_bytes,
                "peak_by_phase": dict(self.peak_by_phase), "min_headroom_bytes": self.min_headroom_bytes,
                "step_time_s": self.step_time_s, "unsafe": [r.as_dict() for r in self.unsafe],
                "trials": [t.as_dict() for t in self.trials], "steps_to_oom": self.steps_to_oom,
                "ooms": self.ooms, "restarts": self.restarts, "deaths": self.deaths}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RankFigures:
        return cls(str(doc["host"]), int(doc["rank"]), doc.get("plateau_bytes"),
                   {str(k): int(v) for k, v in (doc.get("peak_by_phase") or {}).items()},
                   doc.get("min_headroom_bytes"), doc.get("step_time_s"),
                   tuple(Reason.from_dict(r) for r in doc.get("unsafe") or ()),
                   tuple(Trial.from_dict(t) for t in doc.get("trials") or ()), doc.get("steps_to_oom"),
                   int(doc.get("ooms") or 0), int(doc.get("restarts") or 0), int(doc.get("deaths") or 0))

    def troubles(self) -> tuple[Reason, ...]:
        """Every unsafe cause of this rank's history, one reason per cause, most serious first:
        the current process's, then what its processes' trials show (an OOM, a death, a leak,
        fragmentation the engine reported). O(trials)."""
        found: dict[str, Reason] = {r.cause: r for r in reversed(self.unsafe)}
        rank = self.rank
        for t in reversed(self.trials):
            if t.oom is not None and "oom" not in found:
                o = t.oom
                at = f" at {o.tokens:,} tokens per step" if o.tokens else ""
                found["oom"] = Reason("oom", f"rank {rank}: OOM at step {o.step:,} ({o.phase}){at}, cause "
                                             f"{o.cause}: {o.detail}", rank)
            if t.outcome == Outcome.KILLED and "death" not in found:
                found["death"] = Reason("death", f"rank {rank}: killed at step {t.last_step:,} (no clean exit, no "
                                                 "OOM) while the job went on", rank)
            if t.leak is not None and "leak" not in found:
                found["leak"] = Reason("leak", f"rank {rank}: {leak_text(t.leak)}", rank)
            if t.fragmentation_step is not None and "fragmentation" not in found:
                found["fragmentation"] = Reason("fragmentation", f"rank {rank}: fragmentation since step "
                                                                 f"{t.fragmentation_step:,}", rank)
        return tuple(found[c] for c in UNSAFE_CAUSES if c in found)


@dataclass(frozen=True)
class RunFigures:
    """Every rank's :class:`RankFigures` of one run, in (rank, host) order."""

    run: str
    ranks: tuple[RankFigures, ...]
    world_size: int | None = None

    @classmethod
    def of(cls, obs: RunObservation, now: float | None = None) -> RunFigures:
        """Every rank's figures, its life judged at ``now`` (default: the run's latest sample)."""
        view = run_view(obs, ReadinessConfig())
        stories: dict[tuple[str, int], RankStory] = {}
        if obs.life is not None:
            last = max((v.last_ts for v in view.ranks if v.last_ts is not None), default=0.0)
            stories = obs.life.story(last if now is None else now).index()
        return cls.of_view(view, stories)

    @classmethod
    def of_view(cls, view: RunView, stories: dict[tuple[str, int], RankStory] | None = None) -> RunFigures:
        index = stories or {}
        return cls(view.run, tuple(RankFigures.of(v, index.get((v.host, v.rank))) for v in view.ranks),
                   view.world_size)

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "world_size": self.world_size, "ranks": [r.as_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunFigures:
        """One document, or (``join``) the documents of several collectors holding parts of the run."""
        return cls.join(str(doc["run"]), [doc])

    @classmethod
    def join(cls, run: str, docs: list[dict[str, Any]]) -> RunFigures:
        """The ranks of several collectors' documents for ``run`` as one, how each process ended
        judged over all of them (KeyError/TypeError/ValueError on a malformed document)."""
        ranks = sorted((RankFigures.from_dict(r) for d in docs for r in d["ranks"]), key=lambda r: (r.rank, r.host))
        judged = judged_trials([RankTrials(run, r.host, r.rank, r.trials) for r in ranks])
        worlds = [int(d["world_size"]) for d in docs if d.get("world_size")]
        return cls(run, tuple(replace(r, trials=j.trials) for r, j in zip(ranks, judged, strict=True)),
                   max(worlds) if worlds else None)

    def troubles(self) -> list[Reason]:
        """Every rank's :meth:`RankFigures.troubles`, most serious first; among leaks the one that
        runs out first; then by rank."""
        found = [(r, f.steps_to_oom) for f in self.ranks for r in f.troubles()]
        found.sort(key=lambda x: (UNSAFE_CAUSES.index(x[0].cause), x[1] if x[1] is not None else float("inf"),
                                  x[0].rank if x[0].rank is not None else -1))
        return [r for r, _ in found]


__all__ = ["RankFigures", "RunFigures"]
