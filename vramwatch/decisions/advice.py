"""Largest batch that fits, a proposed batch's projection, and what to do next, with numbers.

Built on the per-rank :class:`~vramwatch.decisions.model.RankModel`: the binding rank is
the one whose largest fitting tokens per step is smallest; the global batch assumes ranks
share the batch equally (``world_size x`` the binding rank's local tokens). The
recommendation is computed from the model and the readiness verdict, never a fixed
percentage: raise to the largest batch that still fits *after* the fit's stated
uncertainty, hold, or lower by the share that restores the margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.units import gib
from vramwatch.verdicts import LOW_HEADROOM_FRACTION

from .model import RankModel
from .observe import RunObservation
from .readiness import RankReadiness, Readiness, ReadinessConfig, combine, run_readiness

#: Suggested batches are rounded down to a multiple of up to this many tokens (a context length).
MAX_GRANULE = 4096
#: The most a raise goes beyond the largest observed tokens in one move (the range the
#: model's projection is benchmarked over, docs/benchmarks.md).
EXTRAPOLATION_LIMIT = 1.3
#: Lowering a batch whose tokens never varied assumes up to this share of the transient
#: does not shrink with it (workspaces, communication buckets); docs/decisions.md.
LOWER_FIXED_SHARE = 0.10
#: A raise smaller than this share of the current batch is not worth a restart: hold.
MIN_RAISE = 0.02


@dataclass(frozen=True)
class RankCapacity:
    host: str
    rank: int
    max_tokens: int | None
    binding_phase: str
    tokens_seen_max: int | None
    fit_method: str
    uncertainty_frac: float
    worst_need_bytes: float  # at the largest tokens observed
    total_bytes: int


@dataclass(frozen=True)
class Target:
    tokens_per_step: int
    worst_peak_bytes: int
    headroom_bytes: int
    fits: bool
    rank: int
    phase: str

    def as_dict(self) -> dict[str, Any]:
        return {"tokens_per_step": self.tokens_per_step, "worst_peak_bytes": self.worst_peak_bytes,
                "headroom_bytes": self.headroom_bytes, "fits": self.fits, "rank": self.rank, "phase": self.phase}


@dataclass(frozen=True)
class Advice:
    run: str
    margin: float
    readiness: Readiness
    ranks: tuple[RankCapacity, ...]
    models: tuple[RankModel, ...]
    max_tokens_per_step: int | None
    max_global_tokens_per_step: int | None
    binding_rank: int | None
    world_size: int
    target: Target | None
    action: str  # raise | hold | lower
    recommendation: str

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of ``vramwatch advise --json`` and ``GET /api/v1/runs/{run}/advice``."""
        return {
            "run": self.run,
            "margin": self.margin,
            "readiness": self.readiness.as_dict(),
            "max_tokens_per_step": self.max_tokens_per_step,
            "max_global_tokens_per_step": self.max_global_tokens_per_step,
            "binding_rank": self.binding_rank,
            "world_size": self.world_size,
            "action": self.action,
            "recommendation": self.recommendation,
            "target": self.target.as_dict() if self.target else None,
            "ranks": [
                {"host": r.host, "rank": r.rank, "max_tokens_per_step": r.max_tokens, "binding_phase": r.binding_phase,
                 "tokens_seen_max": r.tokens_seen_max, "fit": r.fit_method, "uncertainty_frac": r.uncertainty_frac,
                 "worst_need_bytes": r.worst_need_bytes, "total_bytes": r.total_bytes}
                for r in self.ranks
            ],
            "models": [m.as_dict() for m in self.models],
        }


def capacity(model: RankModel, margin: float) -> RankCapacity:
    tokens, phase = model.max_tokens(margin)
    need, _ = model.worst_need(model.tokens_seen_max)
    return RankCapacity(model.host, model.rank, tokens, phase, model.tokens_seen_max, model.train.method,
                        model.train.uncertainty_frac, need, model.total_bytes)


def project(models: list[RankModel], tokens: int, margin: float) -> Target | None:
    """Projected worst device need over ranks and phases at ``tokens`` per rank (O(ranks x phases))."""
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
    return Target(tokens, int(need), headroom, headroom >= margin * m.total_bytes, m.rank, phase)


def _granule(tokens: int) -> int:
    g = 1
    while g < MAX_GRANULE and tokens % (g * 2) == 0:
        g *= 2
    return g


def _safe_tokens(model: RankModel, margin: float) -> int | None:
    """Largest tokens that fit when the transient is as large as the fit's stated uncertainty allows."""
    tokens, _ = model.max_tokens(margin)
    if tokens is None or tokens <= 0:
        return tokens
    u = model.train.uncertainty_frac
    # transient(T) * (1 + u) must fit where transient(T) did: solve on the slope and intercept
    fixed = model.floor_bytes + model.slack_bytes + model.outside_bytes
    return model.train.tokens_for((model.total_bytes * (1 - margin) - fixed) / (1 + u))


def _lower_tokens(model: RankModel, margin: float) -> int:
    """Tokens to lower to: judged with the fit's error against us (a fixed share does not shrink)."""
    fit = model.train
    if fit.method != "proportional" or not model.tokens_seen_max:
        return _safe_tokens(model, margin) or 0
    seen = model.tokens_seen_max
    observed = fit.transient(seen)
    room = model.total_bytes * (1 - margin) - model.floor_bytes - model.slack_bytes - model.outside_bytes
    shrinking = (1 - LOWER_FIXED_SHARE) * observed / seen
    return max(0, int((room - LOWER_FIXED_SHARE * observed) // shrinking))


def advise(
    obs: RunObservation,
    *,
    margin: float = LOW_HEADROOM_FRACTION,
    target_tokens: int | None = None,
    readiness_config: ReadinessConfig | None = None,
    references: list[RunObservation] | None = None,
) -> Advice:
    """Advice for one observed run; ``references`` are runs of the same job at other batch settings."""
    readiness = run_readiness(obs, readiness_config or ReadinessConfig(margin=margin))
    tracks = obs.tracks()
    for ref in references or []:
        for track in tracks:
            other = ref.ranks.get((track.host, track.rank)) or next(
                (t for t in ref.tracks() if t.rank == track.rank), None)
            if other is not None:
                track.builder.merge_tokens(other.builder)
    return decide(obs.run, readiness, [t.builder.model() for t in tracks], world=obs.world_size, margin=margin,
                  target_tokens=target_tokens)


def decide(run: str, readiness: Readiness, models: list[RankModel], *, world: int,
           margin: float = LOW_HEADROOM_FRACTION, target_tokens: int | None = None) -> Advice:
    """Advice from a run's readiness and its ranks' models (O(ranks x phases)). :func:`advise`
    calls it on one collector's observation; a front calls it on the ranks of every shard
    (:func:`vramwatch.front.merge.merge_advice`), so both give the same answer for the same ranks."""
    caps = [capacity(m, margin) for m in models]
    known = [c for c in caps if c.max_tokens is not None]
    binding = min(known, key=lambda c: c.max_tokens or 0) if known else None
    max_tokens = binding.max_tokens if binding else None
    target = project(models, target_tokens, margin) if target_tokens else None
    action, text = _recommend(readiness, models, binding, world, margin)
    return Advice(run, margin, readiness, tuple(caps), tuple(models), max_tokens,
                  None if max_tokens is None else max_tokens * world, binding.rank if binding else None,
                  world, target, action, text)


def join(docs: list[dict[str, Any]]) -> Advice:
    """Advice over the ranks of several advice documents of one run (``as_dict``, one per
    collector that holds some of its ranks): readiness is recombined from the ranks' own
    verdicts and the decision retaken on every rank's model, so a front answers exactly
    what one collector holding all the ranks would. ``join([doc])`` reads one document back.
    O(ranks x phases); KeyError/TypeError/ValueError on a malformed document."""
    if not docs:
        raise ValueError("advice: no documents to join")
    first = docs[0]
    ranks = sorted((RankReadiness.from_dict(r) for d in docs for r in d["readiness"].get("ranks") or ()),
                   key=lambda r: (r.rank, r.host))
    models = sorted((RankModel.from_dict(m) for d in docs for m in d["models"]), key=lambda m: (m.rank, m.host))
    readiness = combine(tuple(ranks)) if ranks else Readiness.from_dict(first["readiness"])
    target = first.get("target") or {}
    return decide(str(first["run"]), readiness, models, world=world_size(models), margin=float(first["margin"]),
                  target_tokens=target.get("tokens_per_step"))


def world_size(models: list[RankModel]) -> int:
    """The job's world size as the samples state it (largest), else the number of ranks modelled."""
    sizes = [m.world_size for m in models if m.world_size]
    return max(sizes) if sizes else len({m.rank for m in models})


def _pct(x: float) -> str:
    return f"{x:.1%}" if abs(x) < 0.1 else f"{x:.0%}"


def _recommend(
    readiness: Readiness,
    models: list[RankModel],
    binding: RankCapacity | None,
    world: int,
    margin: float,
) -> tuple[str, str]:
    """(action, one sentence with numbers)."""
    if binding is None or not models:
        worst = readiness.min_headroom_bytes
        head = gib(worst, none="unknown")
        return "hold", (f"Hold: no per-step tokens in the samples (pass tokens= to vw.step), so no batch can be "
                        f"projected; worst headroom {head} on rank {readiness.worst_rank}.")
    model = next(m for m in models if m.rank == binding.rank and m.host == binding.host)
    current = binding.tokens_seen_max or 0
    best = binding.max_tokens or 0
    phase = binding.binding_phase
    over_margin = bool({"margin", "oom"} & set(readiness.causes))
    structural = [c for c in ("leak", "fragmentation", "unstable") if c in readiness.causes]
    if structural:
        # a leak or an unsettled rise eats any margin a smaller batch would buy: fix it first
        reason = next((r for r in readiness.reasons if any(w in r for w in ("leak", "fragmentation", "broke"))),
                      readiness.reasons[0])
        return "hold", f"Hold at {current:,} tokens per step and fix first: {reason}."
    if best == 0 and phase != "train":
        return "lower", (f"Lower is not enough: the {phase} phase alone leaves less than the {margin:.0%} margin "
                         f"on rank {binding.rank} at any batch; reduce its memory (state-dict offload, eval batch).")
    if over_margin or (current and best < current):
        # lowering is judged with the fit's uncertainty against us: a fixed share of the
        # transient does not shrink with the batch
        low = min(best, _lower_tokens(model, margin))
        if current and low >= current:
            # the model says the batch fits: the OOM or the lost margin came from elsewhere
            return "hold", (f"Hold at {current:,} tokens per step: the model projects up to {best:,} per rank "
                            f"would fit, so the batch does not explain it ({readiness.reasons[0]}); "
                            "look for a leak, memory outside the allocator or fragmentation.")
        cut = 1 - low / current if current else 1.0
        return "lower", (f"Lower tokens per step by at least {_pct(cut)} (from {current:,} to {low:,} per rank, "
                         f"{low * world:,} global) to restore the {margin:.0%} margin on rank {binding.rank} at the "
                         f"{phase} phase.")
    safe = _safe_tokens(model, margin) or 0
    capped = min(safe, int(current * EXTRAPOLATION_LIMIT)) if current else safe
    suggestion = capped // _granule(current) * _granule(current) if current else capped
    if readiness.verdict == "not_ready":
        return "hold", (f"Hold at {current:,} tokens per step until the batch is proven ({readiness.reasons[0]}); "
                        f"the model projects up to {best:,} per rank would fit.")
    if suggestion <= current * (1 + MIN_RAISE):
        how = ("tokens never varied: proportional assumption; a run at another batch setting "
               "(--reference) narrows it") if model.train.method == "proportional" else model.train.method
        return "hold", (f"Hold at {current:,} tokens per step: the largest that fits is {best:,} per rank, "
                        f"within the model's uncertainty ({_pct(model.train.uncertainty_frac)}, {how}) of the "
                        "current batch.")
    projected = project(models, suggestion, margin)
    room = projected.headroom_bytes / _total_of(models, projected.rank) if projected else 0.0
    where = f"rank {projected.rank} at the {projected.phase} phase" if projected else f"rank {binding.rank}"
    return "raise", (f"Raise to {suggestion:,} tokens per step per rank ({suggestion * world:,} global, "
                     f"+{_pct(suggestion / current - 1)}): still {_pct(room)} headroom at the worst phase "
                     f"({where}).")


def _total_of(models: list[RankModel], rank: int) -> int:
    return next(m.total_bytes for m in models if m.rank == rank)


__all__ = ["Advice", "RankCapacity", "Target", "advise", "capacity", "decide", "join", "project", "world_size"]
