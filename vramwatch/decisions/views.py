"""A run as the decisions read it: per rank a frozen :class:`RankView` (readiness, memory model,
trials, compare figures), the same whether the ranks were replayed from samples
(:class:`~vramwatch.decisions.observe.RunObservation`) or read from the collector's live engines
(:meth:`vramwatch.decisions.online.DecisionEngine.view`).

A view is taken in two parts so that a live engine is held only for the cheap one:
:func:`raw_view` copies what the track knows (O(buckets + trials + phases), under the engine's
lock), :func:`fitted` fits the transient on the copied points (O(buckets²), outside it).
:func:`run_view` then judges across ranks how each process ended (a rank that died while the
job went on makes the run unsafe) and combines the ranks' readiness. Both paths run the same
functions on the same figures, so they give the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from vramwatch.decisions.memory import MemoryFacts, MemoryFold
from vramwatch.decisions.model import Bucket, RankModel, TransientFit, fit_transient, fold_points
from vramwatch.decisions.observe import RankTrack, RunObservation
from vramwatch.decisions.proven import RankTrials
from vramwatch.decisions.readiness import RankReadiness, Readiness, ReadinessConfig, combine, rank_readiness, with_death
from vramwatch.decisions.trials import Trial, with_outcomes
from vramwatch.runlife import RankLife
from vramwatch.verdicts import Outcome

#: A rank's death, for the decisions: killed alone while the job went on (vramwatch.runlife).

#: The placeholder fit of a raw view (replaced by :func:`fitted`).
UNFITTED = TransientFit("none", 0.0, 0.0, 0, None, None, None, None, 1.0)


@dataclass(frozen=True)
class RankView:
    """What the decisions read of one rank (immutable: safe to use while the rank goes on)."""

    run: str
    host: str
    rank: int
    readiness: RankReadiness
    model: RankModel
    points: tuple[Bucket, ...]  # the token-bucket maxima the fit rests on
    trials: tuple[Trial, ...]
    plateau_bytes: float | None  # the trend engine's plateau (reserved)
    peak_by_phase: dict[str, int]
    last_ts: float | None
    memory: MemoryFacts | None = None  # by category (vw.watch), the input-peak finding


def raw_view(track: RankTrack, config: ReadinessConfig, *, timing: bool = True) -> RankView:
    """Copy what ``track`` knows, with the fit left for :func:`fitted`. O(buckets + trials +
    phases + recent events); ``timing`` adds the median step time (a sort of the latest 256)."""
    model = track.builder.model(UNFITTED, timing=timing and track.builder.timing)
    trials = track.copy_trials()
    fragmented = track.engine.state == "fragmentation" or any(t.fragmentation_step is not None for t in trials)
    return RankView(track.run, track.host, track.rank, rank_readiness(track, config), model,
                    tuple(track.builder.points()), trials, track.engine.summary().get("plateau_bytes"),
                    dict(track.peak_by_phase), track.last_ts,
                    (track.memory or MemoryFold()).facts(track.host, track.rank, fragmented=fragmented,
                                                         last=track.engine.last_sample()))


def fitted(view: RankView, reference_points: Iterable[Bucket] = ()) -> RankView:
    """``view`` with its transient fitted on its own points plus the same rank's points in runs
    of the same job at other batch settings (``reference_points``). O(buckets²) at most."""
    refs = fold_points(list(reference_points))
    fit = fit_transient([*view.points, *refs], across_runs=bool(refs))
    return replace(view, model=replace(view.model, train=fit))


@dataclass(frozen=True)
class RunView:
    """Every rank's view of one run, outcomes judged across ranks, readiness combined."""

    run: str
    ranks: tuple[RankView, ...]
    world_size: int
    samples: int
    readiness: Readiness

    def rank_trials(self) -> list[RankTrials]:
        return [RankTrials(v.run, v.host, v.rank, v.trials) for v in self.ranks]

    def models(self) -> list[RankModel]:
        return [v.model for v in self.ranks]

    def points_of(self, host: str, rank: int) -> tuple[Bucket, ...]:
        """The points of the rank with this host and number, else of the same rank number (hosts
        differ between runs), else none."""
        same = next((v for v in self.ranks if (v.host, v.rank) == (host, rank)), None) or next(
            (v for v in self.ranks if v.rank == rank), None)
        return same.points if same else ()


def world_size_of(models: Iterable[RankModel]) -> int:
    """The job's world size as the samples state it (largest), else the number of ranks modelled."""
    models = list(models)
    sizes = [m.world_size for m in models if m.world_size]
    return max(sizes) if sizes else len({m.rank for m in models})


def judge(run: str, views: list[RankView], samples: int, lives: list[RankLife] | None = None) -> RunView:
    """The run's view from its ranks' (fitted) views: how each process ended (the run-life model's
    judgement over ``lives``, the run's folds, else over the trials' records: :func:`.trials.with_outcomes`),
    a rank whose current process was killed made unsafe, readiness combined. O(ranks + processes)."""
    views = sorted(views, key=lambda v: (v.rank, v.host))
    judged = with_outcomes(run, [(v.host, v.rank, v.trials) for v in views], lives)
    out = []
    for view, trials in zip(views, judged, strict=True):
        readiness = view.readiness
        now = trials[-1] if trials else None
        if now is not None and now.outcome == Outcome.KILLED:
            readiness = with_death(readiness, f"rank {view.rank}: killed at step {now.last_step:,} (no clean exit, "
                                              "no OOM) while the job went on")
        out.append(replace(view, trials=trials, readiness=readiness))
    return RunView(run, tuple(out), world_size_of(v.model for v in out), samples,
                   combine(tuple(v.readiness for v in out)))


def run_view(obs: RunObservation, config: ReadinessConfig | None = None) -> RunView:
    """A replayed run's view (O(samples) already spent: O(ranks x buckets²) here)."""
    config = config or ReadinessConfig()
    lives = obs.life.ranks() if obs.life is not None else None
    return judge(obs.run, [fitted(raw_view(t, config)) for t in obs.tracks()], obs.samples, lives)


def run_readiness(obs: RunObservation, config: ReadinessConfig | None = None) -> Readiness:
    """The run's verdict: its worst rank's, with the reasons of every rank at that verdict
    (deaths judged across the ranks). O(ranks x buckets²) beyond the replay."""
    return run_view(obs, config).readiness


def refit(run: RunView, references: list[RunView]) -> RunView:
    """``run`` with every rank's transient refitted on its own points plus the same rank's points
    in runs of the same job at other batch settings (matched by host and rank, else by rank)."""
    if not references:
        return run
    views = [fitted(v, [p for ref in references for p in ref.points_of(v.host, v.rank)]) for v in run.ranks]
    return replace(run, ranks=tuple(views))


__all__ = ["UNFITTED", "RankView", "RunView", "fitted", "judge", "raw_view", "refit", "run_readiness", "run_view",
           "world_size_of"]

