"""What the runs themselves showed about batch settings: which were proven, which ran out of memory.

Evidence beats the model (docs/decisions.md): an OOM whose cause is the batch (a phase's peak,
a raise, the step's own peak) at a setting caps what fits at and above it; a setting whose every
rank held its plateau through the required checkpoints, with margin left and no OOM, leak or
fragmentation, is proven. The model only interpolates between the two.

Settings are **per rank** tokens per step (the global batch is ``world_size x`` that). An epoch is
one ordinal of a run's processes (the job's n-th start): its setting is the largest of its ranks'.
Pure functions over trials (:mod:`.trials`); O(processes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramwatch.decisions.grid import Grid, choose
from vramwatch.decisions.reasons import BATCH_CAUSES
from vramwatch.decisions.trials import OomRecord, Trial, with_outcomes
from vramwatch.verdicts import Outcome, is_low_headroom

#: A rank's death (vramwatch.runlife): killed alone while the job went on.
#: Two OOMs at settings within this share of each other are OOMs at the same setting.
SAME_SETTING = 0.01


@dataclass(frozen=True)
class RankTrials:
    """One rank's processes, with ``outcome`` judged across the run (:func:`.trials.outcomes`)."""

    run: str
    host: str
    rank: int
    trials: tuple[Trial, ...]


@dataclass(frozen=True)
class Setting:
    """One epoch of one run: the batch it ran and whether every rank proved it."""

    run: str
    ordinal: int
    tokens: int  # per rank
    world_size: int
    proven: bool
    last_step: int
    last_ts: float


@dataclass(frozen=True)
class OomAt:
    """An OOM of one rank's process, where it happened."""

    run: str
    host: str
    rank: int
    ordinal: int
    record: OomRecord

    @property
    def batch_caused(self) -> bool:
        return self.record.cause in BATCH_CAUSES and self.record.tokens is not None


@dataclass(frozen=True)
class RankDeath:
    run: str
    host: str
    rank: int
    ordinal: int
    step: int
    ts: float


def judged_trials(ranks: list[RankTrials]) -> list[RankTrials]:
    """The same ranks (of one run) with every process's outcome judged across them by the run-life
    model (:func:`.trials.with_outcomes`): how a front joins the trials of several collectors."""
    if not ranks:
        return []
    judged = with_outcomes(ranks[0].run, [(r.host, r.rank, r.trials) for r in ranks])
    return [replace(r, trials=ts) for r, ts in zip(ranks, judged, strict=True)]


def proven(trial: Trial, *, plateau_steps: int, checkpoints: int, margin: float) -> bool:
    """The process held its plateau for ``plateau_steps`` and passed ``checkpoints`` with the
    margin kept, and nothing went wrong in it (no OOM, leak or fragmentation)."""
    if trial.oom is not None or trial.leak is not None or trial.fragmentation_step is not None:
        return False
    if trial.plateau_steps < plateau_steps or trial.checkpoints_passed < checkpoints:
        return False
    head, total = trial.min_headroom_bytes, trial.total_bytes
    return not is_low_headroom(head, total, margin)


@dataclass(frozen=True)
class Evidence:
    """Settings, OOMs and deaths of a run and its references, and the grid of settable batches."""

    run: str
    settings: tuple[Setting, ...]
    ooms: tuple[OomAt, ...]
    deaths: tuple[RankDeath, ...]
    grid: Grid
    current_ordinal: int | None = None  # the run's latest process (its largest ordinal)

    @property
    def granularity(self) -> int:
        return self.grid.step

    @property
    def granularity_inferred(self) -> bool:
        return self.grid.source == "inferred"

    def ceiling(self) -> OomAt | None:
        """The batch-caused OOM at the smallest setting: nothing at or above it fits."""
        batch = [o for o in self.ooms if o.batch_caused]
        return min(batch, key=lambda o: (o.record.tokens or 0, o.record.ts)) if batch else None

    def proven_below(self, tokens: int | None) -> Setting | None:
        """The last proven setting below ``tokens`` (all proven ones when None): the largest, the
        latest among equals; a setting at or above the ceiling is not proven (an OOM undid it)."""
        top = self.ceiling()
        limits = [x for x in (tokens, top.record.tokens if top else None) if x is not None]
        limit = min(limits) if limits else None
        found = [s for s in self.settings if s.proven and (limit is None or s.tokens < limit)]
        return max(found, key=lambda s: (s.tokens, s.last_ts)) if found else None

    def ooms_at(self, tokens: int) -> list[OomAt]:
        """Batch-caused OOMs at the same setting, one per epoch (a job restart that OOMs on two
        ranks is one OOM of the job)."""
        seen: dict[tuple[str, int], OomAt] = {}
        for o in self.ooms:
            if o.batch_caused and abs((o.record.tokens or 0) - tokens) <= SAME_SETTING * tokens:
                seen.setdefault((o.run, o.ordinal), o)
        return sorted(seen.values(), key=lambda o: o.record.ts)

    def settable(self, tokens: float) -> int:
        """The largest settable batch (on the grid) at or below ``tokens``."""
        return self.grid.settable(tokens)

    def next_settable(self, tokens: int, at_least: float) -> int:
        """The smallest settable batch above ``tokens`` and at least ``at_least``."""
        return self.grid.next_settable(tokens, at_least)


def infer_grid(trials: list[Trial], own: list[Trial], granularity: int | None = None) -> Grid:
    """The grid (:func:`.grid.choose`): ``granularity`` if given, else the latest of the run's own
    processes (``own``) that declared one, else inferred from every process's tokens (``trials``)."""
    declared = next((t.grid for t in sorted(own, key=lambda t: (t.ordinal, t.last_ts), reverse=True) if t.grid),
                    None)
    exact = [t.tokens for t in trials if t.tokens and t.tokens_constant]
    varying = max((t.tokens for t in trials if t.tokens), default=0)
    return choose(granularity, declared, exact, varying)


def gather(run: str, ranks: list[RankTrials], world_size: int, references: list[tuple[list[RankTrials], int]], *,
           plateau_steps: int, checkpoints: int, margin: float, granularity: int | None = None) -> Evidence:
    """The evidence of ``run`` (its ranks' trials, outcomes judged) and of reference runs
    (``(ranks, world_size)`` each): settings per epoch, OOMs, deaths. ``granularity``: the
    settable step in tokens per rank (None: inferred from every process's tokens)."""
    settings: list[Setting] = []
    ooms: list[OomAt] = []
    deaths: list[RankDeath] = []
    every: list[Trial] = []
    for ranks_of, world in ((ranks, world_size), *references):
        epochs: dict[tuple[str, int], list[Trial]] = {}
        for r in ranks_of:
            for t in r.trials:
                every.append(t)
                epochs.setdefault((r.run, t.ordinal), []).append(t)
                if t.oom is not None:
                    ooms.append(OomAt(r.run, r.host, r.rank, t.ordinal, t.oom))
                elif t.outcome == Outcome.KILLED:
                    deaths.append(RankDeath(r.run, r.host, r.rank, t.ordinal, t.last_step, t.last_ts))
        for (name, ordinal), trials in epochs.items():
            tokens = max((t.tokens or 0 for t in trials), default=0)
            if not tokens:
                continue
            ok = all(proven(t, plateau_steps=plateau_steps, checkpoints=checkpoints, margin=margin) for t in trials)
            settings.append(Setting(name, ordinal, tokens, world, ok and len(trials) >= _ranks_in(ranks_of),
                                    max(t.last_step for t in trials), max(t.last_ts for t in trials)))
    ooms = [_raised(o, settings) for o in ooms]
    grid = infer_grid(every, [t for r in ranks for t in r.trials], granularity)
    current = max((r.trials[-1].ordinal for r in ranks if r.trials), default=None)
    return Evidence(run, tuple(sorted(settings, key=lambda s: s.last_ts)),
                    tuple(sorted(ooms, key=lambda o: o.record.ts)), tuple(deaths), grid, current)


def _raised(oom: OomAt, settings: list[Setting]) -> OomAt:
    """An OOM at a phase's or the step's peak above a setting some run proved (a reference run,
    or an earlier process judged with other thresholds) is an OOM of the raise: the batch changed."""
    o = oom.record
    if o.cause not in ("phase_peak", "batch") or not o.tokens:
        return oom
    held = [s for s in settings if s.proven and s.tokens < o.tokens]
    if not held:
        return oom
    best = max(held, key=lambda s: (s.tokens, s.last_ts))
    detail = (f"{o.detail}; {best.tokens * best.world_size:,} global ({best.tokens:,} per rank) held its plateau "
              f"through its checkpoints (run {best.run})")
    return replace(oom, record=replace(o, cause="batch_change", detail=detail))


def _ranks_in(ranks: list[RankTrials]) -> int:
    """Ranks a run has (an epoch is proven only when every one of them proved it)."""
    return len({(r.host, r.rank) for r in ranks})


__all__ = ["Evidence", "OomAt", "RankDeath", "RankTrials", "Setting", "gather", "infer_grid",
           "judged_trials", "proven"]
