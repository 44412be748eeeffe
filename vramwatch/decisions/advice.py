"""Largest batch that fits, a proposed batch's projection, and the next step of the procedure.

Built on the per-rank :class:`~vramwatch.decisions.model.RankModel` and on the evidence of the
runs themselves (:mod:`.evidence`): the model's largest batch (the binding rank's, the smallest)
is bounded by what was observed, never the other way round: an OOM for a reason of the batch at
a setting caps it below that setting, a proven setting is a floor. A target batch at or above an
OOM's setting does not fit whatever the model says; at or below a proven one it fits. The global
batch assumes ranks share the batch equally (``world_size x`` the per-rank tokens). The next step
(raise, hold, back off, fix) is :func:`.nextstep.next_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from vramwatch.decisions.grid import OffGrid
from vramwatch.decisions.memory import MemoryFacts
from vramwatch.decisions.model import RankModel
from vramwatch.decisions.nextstep import NextStep, Proven, batch_words, next_step
from vramwatch.decisions.observe import RunObservation
from vramwatch.decisions.proven import Evidence, RankTrials, gather, judged_trials
from vramwatch.decisions.readiness import RankReadiness, Readiness, ReadinessConfig
from vramwatch.decisions.reasons import Reason
from vramwatch.decisions.remedies import Remedy, remedies
from vramwatch.decisions.trials import Trial
from vramwatch.decisions.views import RankView, RunView, judge, refit, run_view
from vramwatch.units import gib
from vramwatch.verdicts import LOW_HEADROOM_FRACTION, is_low_headroom


@dataclass(frozen=True)
class RankCapacity:
    host: str
    rank: int
    max_tokens: int | None  # the model's (evidence bounds the run's figure, not each rank's)
    binding_phase: str
    tokens_seen_max: int | None
    fit_method: str
    uncertainty_frac: float
    worst_need_bytes: float  # at the largest tokens observed
    total_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "max_tokens_per_step": self.max_tokens,
                "binding_phase": self.binding_phase, "tokens_seen_max": self.tokens_seen_max, "fit": self.fit_method,
                "uncertainty_frac": self.uncertainty_frac, "worst_need_bytes": self.worst_need_bytes,
                "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class Target:
    """A batch (tokens per step per rank) judged: by evidence first, else by the model."""

    tokens_per_step: int
    global_tokens_per_step: int
    worst_peak_bytes: int | None  # the model's worst device need over ranks and phases
    headroom_bytes: int | None
    fits: bool | None  # None: neither evidence nor a model can say
    rank: int | None
    phase: str | None
    because: Reason

    def as_dict(self) -> dict[str, Any]:
        return {"tokens_per_step": self.tokens_per_step, "global_tokens_per_step": self.global_tokens_per_step,
                "worst_peak_bytes": self.worst_peak_bytes, "headroom_bytes": self.headroom_bytes, "fits": self.fits,
                "rank": self.rank, "phase": self.phase, "because": self.because.as_dict()}


@dataclass(frozen=True)
class Advice:
    run: str
    margin: float
    config: ReadinessConfig
    readiness: Readiness
    ranks: tuple[RankCapacity, ...]
    models: tuple[RankModel, ...]
    max_tokens_per_step: int | None  # the model's, bounded by the evidence, settable; None: hidden
    model_max_tokens_per_step: int | None  # the model's alone
    bound: str  # what sets the largest batch: model | oom | proven
    binding_rank: int | None
    world_size: int
    target: Target | None
    next: NextStep
    evidence: Evidence
    trials: tuple[RankTrials, ...]  # this run's and the references' (a front rejoins them)
    references: tuple[tuple[str, int], ...] = ()  # (run, world size) of each reference
    max_hidden: Reason | None = None  # why no largest batch is shown (a leak, fragmentation, none settable)
    memory: tuple[MemoryFacts, ...] = ()  # per rank: by category (vw.watch), the input-peak finding
    remedies: tuple[Remedy, ...] = ()  # for the binding rank, largest saving first (.remedies)

    @property
    def max_global_tokens_per_step(self) -> int | None:
        return None if self.max_tokens_per_step is None else self.max_tokens_per_step * self.world_size

    @property
    def action(self) -> str:
        return self.next.action

    @property
    def recommendation(self) -> str:
        return self.next.sentence

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of ``vramwatch advise --json`` and ``GET /api/v1/runs/{run}/advice``."""
        return {
            "run": self.run, "margin": self.margin, "plateau_steps_required": self.config.plateau_steps,
            "checkpoints_required": self.config.checkpoints, "readiness": self.readiness.as_dict(),
            "max_tokens_per_step": self.max_tokens_per_step,
            "max_global_tokens_per_step": self.max_global_tokens_per_step,
            "max_tokens_hidden": self.max_hidden.as_dict() if self.max_hidden else None,
            "model_max_tokens_per_step": self.model_max_tokens_per_step, "bound": self.bound,
            "binding_rank": self.binding_rank, "world_size": self.world_size, "next": self.next.as_dict(),
            "action": self.action, "recommendation": self.recommendation,
            "target": self.target.as_dict() if self.target else None,
            "evidence": _evidence_doc(self.evidence, self.world_size),
            "ranks": [r.as_dict() for r in self.ranks], "models": [m.as_dict() for m in self.models],
            "trials": [{"run": r.run, "host": r.host, "rank": r.rank, "trials": [t.as_dict() for t in r.trials]}
                       for r in self.trials],
            "references": [{"run": name, "world_size": world} for name, world in self.references],
            "memory": [f.as_dict() for f in self.memory], "remedies": [r.as_dict() for r in self.remedies],
        }


def _evidence_doc(ev: Evidence, world: int) -> dict[str, Any]:
    top = ev.ceiling()
    proven = ev.proven_below(None)
    return {
        "granularity": ev.granularity, "granularity_inferred": ev.granularity_inferred,
        "grid": ev.grid.as_dict(world),
        "oom_ceiling": None if top is None else {"run": top.run, "host": top.host, "rank": top.rank,
                                                 **top.record.as_dict()},
        "proven": None if proven is None else Proven.of(proven).as_dict(),
        "settings": [{"run": s.run, "ordinal": s.ordinal, "tokens_per_step": s.tokens,
                      "global_tokens_per_step": s.tokens * s.world_size, "proven": s.proven} for s in ev.settings],
        "ooms": [{"run": o.run, "host": o.host, "rank": o.rank, "ordinal": o.ordinal, **o.record.as_dict()}
                 for o in ev.ooms],
        "deaths": [{"run": d.run, "host": d.host, "rank": d.rank, "step": d.step} for d in ev.deaths],
    }


def capacity(model: RankModel, margin: float) -> RankCapacity:
    tokens, phase = model.max_tokens(margin)
    need, _ = model.worst_need(model.tokens_seen_max)
    return RankCapacity(model.host, model.rank, tokens, phase, model.tokens_seen_max, model.train.method,
                        model.train.uncertainty_frac, need, model.total_bytes)


class Projection(NamedTuple):
    """The model's worst device need over ranks and phases at a batch."""

    need_bytes: int
    headroom_bytes: int
    keeps_margin: bool
    rank: int
    phase: str


def project(models: list[RankModel], tokens: int, margin: float) -> Projection | None:
    """The model's worst device need over ranks and phases at ``tokens`` per rank; None without a
    usable fit. O(ranks x phases)."""
    worst: tuple[float, RankModel, str] | None = None
    for m in models:
        if not m.train.usable:
            continue
        need, phase = m.worst_need(tokens)
        if worst is None or m.total_bytes - need < worst[1].total_bytes - worst[0]:
            worst = (need, m, phase)
    if worst is None:
        return None
    need, m, phase = worst
    headroom = int(m.total_bytes - need)
    return Projection(int(need), headroom, not is_low_headroom(headroom, m.total_bytes, margin), m.rank, phase)


def judge_target(tokens: int, models: list[RankModel], ev: Evidence, margin: float, world: int) -> Target:
    """``tokens`` per rank judged: at or above a batch-caused OOM's setting it does not fit, at or
    below a proven setting it fits, in between the model says (O(ranks x phases))."""
    proj = project(models, tokens, margin)
    need, head, keeps, rank, phase = proj if proj else (None, None, None, None, None)
    top, proven = ev.ceiling(), ev.proven_below(None)
    if top is not None and tokens >= (top.record.tokens or 0):
        o = top.record
        because = Reason("oom", f"rank {top.rank} ran out of memory at {batch_words(o.tokens or 0, world)}, run "
                                f"{top.run}, step {o.step:,}, {o.phase}: {o.detail}", top.rank)
        return Target(tokens, tokens * world, need, head, False, top.rank, o.phase, because)
    if proven is not None and tokens <= proven.tokens:
        because = Reason("proven", f"{batch_words(proven.tokens, proven.world_size)} held its plateau through a "
                                   f"checkpoint (run {proven.run})")
        return Target(tokens, tokens * world, need, head, True, rank, phase, because)
    if proj is None:
        return Target(tokens, tokens * world, None, None, None, None, None,
                      Reason("no_tokens", "no token fit: the samples carry no tokens per step, or too few"))
    words = "keeps" if keeps else "does not keep"
    because = Reason("model", f"the model projects {gib(need)} on rank {rank} at the {phase} phase, "
                              f"{gib(head)} free: it {words} the {margin:.0%} margin", rank)
    return Target(tokens, tokens * world, need, head, keeps, rank, phase, because)


def bounded_max(caps: list[RankCapacity], ev: Evidence) -> tuple[int | None, int | None, str, int | None]:
    """(largest tokens per step, the model's alone, what bounds it, the binding rank): the model's
    binding rank, never at or above a batch-caused OOM's setting and never under a proven setting.
    A model that says the OOM's batch fits is contradicted there: the figure is then the proven
    setting (the largest known to fit), else just below the OOM (an upper bound, said so)."""
    known = [c for c in caps if c.max_tokens is not None]
    binding = min(known, key=lambda c: (c.max_tokens or 0, c.rank)) if known else None
    model_max = binding.max_tokens if binding else None
    best, bound, rank = model_max, "model", binding.rank if binding else None
    top, proven = ev.ceiling(), ev.proven_below(None)
    if top is not None and top.record.tokens and (best is None or best >= top.record.tokens):
        best, bound, rank = top.record.tokens - 1, "oom", top.rank
        if proven is not None:
            best, bound = proven.tokens, "proven"
    if proven is not None and (best is None or best < proven.tokens):
        best, bound = proven.tokens, "proven"
    return best, model_max, bound, rank


def advise(
    obs: RunObservation,
    *,
    margin: float = LOW_HEADROOM_FRACTION,
    target_tokens: int | None = None,
    readiness_config: ReadinessConfig | None = None,
    references: list[RunObservation] | None = None,
    granularity: int | None = None,
    target_global_tokens: int | None = None,
) -> Advice:
    """Advice for one observed run; ``references`` are runs of the same job at other batch settings.
    :class:`.grid.OffGrid` when a target is not a settable batch."""
    config = readiness_config or ReadinessConfig(margin=margin)
    refs = [run_view(r, config) for r in references or ()]
    return decide(run_view(obs, config), refs, config=config, margin=margin, target_tokens=target_tokens,
                  granularity=granularity, target_global_tokens=target_global_tokens)


def decide(view: RunView, references: list[RunView], *, config: ReadinessConfig,
           margin: float = LOW_HEADROOM_FRACTION, target_tokens: int | None = None,
           granularity: int | None = None, target_global_tokens: int | None = None) -> Advice:
    """Advice from a run's view and its references' (O(ranks x (phases + buckets²))). :func:`advise`
    calls it on replayed runs, the collector on its live engines' views, a front on the ranks of
    every shard (:func:`join`): the same ranks give the same answer."""
    view = refit(view, references)
    ref_trials = [(r.rank_trials(), r.world_size) for r in references]
    return decide_on(view.run, view.readiness, view.models(), view.rank_trials(), view.world_size, ref_trials,
                     config=config, margin=margin, target_tokens=target_tokens, granularity=granularity,
                     references=tuple((r.run, r.world_size) for r in references),
                     target_global_tokens=target_global_tokens,
                     memory=tuple(v.memory for v in view.ranks if v.memory is not None))


def decide_on(run: str, readiness: Readiness, models: list[RankModel], trials: list[RankTrials], world: int,
              ref_trials: list[tuple[list[RankTrials], int]], *, config: ReadinessConfig, margin: float,
              target_tokens: int | None, granularity: int | None,
              references: tuple[tuple[str, int], ...] = (), target_global_tokens: int | None = None,
              memory: tuple[MemoryFacts, ...] = ()) -> Advice:
    """:func:`decide` on figures already reduced (models fitted, outcomes judged)."""
    ev = gather(run, trials, world, ref_trials, plateau_steps=config.plateau_steps, checkpoints=config.checkpoints,
                margin=margin, granularity=granularity)
    tokens = target_per_rank(ev, world, target_tokens, target_global_tokens)
    caps = [capacity(m, margin) for m in models]
    best, model_max, bound, binding = bounded_max(caps, ev)
    target = judge_target(tokens, models, ev, margin, world) if tokens else None
    step = next_step(readiness, models, ev, best, world=world, margin=margin, config=config,
                     judge=lambda tokens: judge_target(tokens, models, ev, margin, world))
    all_trials = tuple(trials) + tuple(r for ranks, _ in ref_trials for r in ranks)
    shown, hidden = shown_max(best, ev, readiness, margin)
    cures = remedies(list(memory), models, binding, world, margin)
    return Advice(run, margin, config, readiness, tuple(caps), tuple(models), shown, model_max, bound, binding, world,
                  target, step, ev, all_trials, references, hidden, memory, cures)


def target_per_rank(ev: Evidence, world: int, per_rank: int | None, global_tokens: int | None) -> int | None:
    """A target as tokens per rank: ``per_rank`` as given, or ``global_tokens`` shared equally by the
    ``world`` ranks. :class:`.grid.OffGrid` (one line naming the grid) when both are given, when the
    global batch does not split equally, or when the batch is not settable."""
    if per_rank and global_tokens:
        raise OffGrid("give a target per rank or a global target, not both")
    if global_tokens:
        if global_tokens % world:
            raise OffGrid(f"target {global_tokens:,} global tokens does not split equally over {world} ranks; the "
                          f"grid is {ev.grid.describe(world)}")
        per_rank = global_tokens // world
    if not per_rank or ev.grid.on(per_rank):
        return per_rank
    g = ev.grid
    low, high = g.settable(per_rank), g.next_settable(per_rank, per_rank)
    near = " or ".join(f"{x * world:,}" for x in (low, high) if x > 0)
    raise OffGrid(f"target {per_rank * world:,} global ({per_rank:,} per rank) is not on the grid: settable in "
                  f"steps of {g.describe(world)}; nearest {near} global")


def shown_max(best: int | None, ev: Evidence, readiness: Readiness, margin: float) -> tuple[int | None, Reason | None]:
    """The largest batch as a person may set it: rounded down to the grid; hidden, with the reason,
    while a leak or fragmentation makes it meaningless (memory is not a function of the batch then)
    or when no settable batch keeps the margin: never 0 or negative."""
    if best is None:
        return None, None
    trouble = [x for r in readiness.ranks for x in r.reasons if x.cause in ("leak", "fragmentation")]
    if trouble:
        return None, Reason(trouble[0].cause, f"not shown: {trouble[0].text}; memory does not follow the batch "
                                               "until that is fixed", trouble[0].rank)
    n = ev.settable(best)
    if n <= 0:
        text = ("a phase alone breaks the margin at any batch" if best <= 0 else
                f"no settable batch (steps of {ev.granularity:,} per rank) is at or under {best:,} per rank")
        return None, Reason("no_fit", f"not shown: {text} with {margin:.0%} kept free")
    return n, None


def join(docs: list[dict[str, Any]], *, granularity: int | None = None) -> Advice:
    """Advice over the ranks of several advice documents of one run (``as_dict``, one per
    collector that holds some of its ranks): outcomes and readiness are rejudged on every rank,
    the evidence regathered and the decision retaken, so a front answers exactly what one
    collector holding all the ranks would. ``join([doc])`` reads one document back.
    O(ranks x phases + processes); KeyError/TypeError/ValueError on a malformed document."""
    if not docs:
        raise ValueError("advice: no documents to join")
    first = docs[0]
    run = str(first["run"])
    stated = first.get("evidence") or {}
    source = (stated.get("grid") or {}).get("source", "inferred" if stated.get("granularity_inferred") else "option")
    if granularity is None and source == "option":
        granularity = int(stated["granularity"])  # a collector was asked for it: keep it (a declared one the
        # trials carry, an inferred one is inferred again over every rank)
    refs = {str(r["run"]): int(r["world_size"]) for d in docs for r in d.get("references") or ()}
    readiness = {(r.host, r.rank): r for d in docs for r in map(RankReadiness.from_dict, d["readiness"]["ranks"])}
    models = {(m.host, m.rank): m for d in docs for m in map(RankModel.from_dict, d["models"])}
    trials: dict[str, dict[tuple[str, int], tuple[Trial, ...]]] = {}
    for d in docs:
        for r in d.get("trials") or ():
            key = (str(r["host"]), int(r["rank"]))
            trials.setdefault(str(r["run"]), {})[key] = tuple(Trial.from_dict(t) for t in r["trials"])
    own = trials.get(run, {})
    views = [RankView(run, host, rank, readiness[key], models[key], (), own.get(key, ()), None, {},
                      max((t.last_ts for t in own.get(key, ())), default=None))
             for key in readiness if key in models for host, rank in (key,)]
    judged = judge(run, views, 0)
    ref_trials = [(judged_trials([RankTrials(name, h, k, ts) for (h, k), ts in trials.get(name, {}).items()]), world)
                  for name, world in refs.items()]
    margin = float(first["margin"])
    config = ReadinessConfig(int(first.get("plateau_steps_required", 2000)), int(first.get("checkpoints_required", 1)),
                             margin)
    target = first.get("target") or {}
    return decide_on(run, judged.readiness, judged.models(), judged.rank_trials(), judged.world_size, ref_trials,
                     config=config, margin=margin, target_tokens=target.get("tokens_per_step"),
                     granularity=granularity, references=tuple(refs.items()),
                     memory=_joined_memory(docs))


def _joined_memory(docs: list[dict[str, Any]]) -> tuple[MemoryFacts, ...]:
    """Every shard's per-rank memory facts, in the order one collector lists its ranks (rank, host)."""
    facts = {(f.rank, f.host): f for d in docs for f in map(MemoryFacts.from_dict, d.get("memory") or ())}
    return tuple(facts[key] for key in sorted(facts))


__all__ = ["Advice", "Projection", "RankCapacity", "Target", "advise", "bounded_max", "capacity", "decide", "decide_on",
           "join", "judge_target", "project", "shown_max", "target_per_rank"]
