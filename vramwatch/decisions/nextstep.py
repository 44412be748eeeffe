"""The next step in the procedure's own terms: raise, hold, back off, or fix.

The procedure (the KoHRM notes, docs/decisions.md): finish stably at the current batch; try the
next one; keep it only after its plateau held and it survived a checkpoint; on an OOM go straight
back to the last proven batch; after a second OOM at a batch, cut 5-10 % below it. Rules, the
first that applies decides:

1. no tokens in the samples: **hold**, nothing can be projected;
2. a leak or fragmentation on a rank now: **fix** first, at the current batch (the soonest OOM first);
3. the current batch is at or above one that ran out of memory for a reason of the batch:
   **back off**: after a second OOM at that batch to the largest settable batch 5 % below it
   (the seed's 5-10 %), else to the last proven batch below it, else to the largest settable
   batch the evidence and the model allow;
4. this run's latest OOM came from a leak or fragmentation and the restarted process is not proven:
   **fix** while that process still runs, **hold** once a new one runs;
5. worst headroom under the margin: **back off** to the last proven batch, else by the model (a
   phase that alone breaks the margin at any batch: **fix** that phase, lowering is not enough);
6. a rank was killed while the job went on, or the plateau broke and has not settled: **hold**;
7. not proven yet (plateau, checkpoints): **hold**;
8. proven: **raise** to the next settable batch (at least 5 % up, at most 1.3x) if it is below every
   batch that ran out of memory and keeps the margin by the model; else **hold** and say why.

Settable: a multiple of the granularity (:attr:`Evidence.granularity`). Every step carries its
cause as data (:class:`~vramwatch.decisions.reasons.Reason`). O(ranks + OOMs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vramwatch.decisions.grid import WINDOW
from vramwatch.decisions.model import RankModel
from vramwatch.decisions.proven import Evidence, Setting
from vramwatch.decisions.readiness import RankReadiness, Readiness, ReadinessConfig
from vramwatch.decisions.reasons import Reason
from vramwatch.units import gib

ACTIONS = ("raise", "hold", "back_off", "fix")
#: The smallest raise worth a restart: the procedure's smallest move (its 5-10 % steps: 180,224 to
#: 196,608 is +9.1 % on a grid of 8,192 global, where +4.5 % would be the next settable batch).
MIN_RAISE = WINDOW
#: The most a raise goes beyond the current batch in one move (the range the model's projection
#: is benchmarked over, docs/benchmarks.md).
EXTRAPOLATION_LIMIT = 1.3
#: After a second OOM at a batch: the cut below it (the seed's "5-10 %": the smallest cut of the range).
RECURRENCE_CUT = WINDOW
#: Lowering by the model when nothing is proven: up to this share of the transient is assumed not
#: to shrink with the batch (workspaces, communication buckets).
LOWER_FIXED_SHARE = 0.10


@dataclass(frozen=True)
class Proven:
    """The last proven setting: the run that proved it and its batch."""

    run: str
    tokens_per_step: int
    global_tokens_per_step: int

    @classmethod
    def of(cls, s: Setting) -> Proven:
        return cls(s.run, s.tokens, s.tokens * s.world_size)

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "tokens_per_step": self.tokens_per_step,
                "global_tokens_per_step": self.global_tokens_per_step}


@dataclass(frozen=True)
class NextStep:
    action: str  # of ACTIONS
    tokens_per_step: int | None  # per rank: the batch to run next (None: unknown)
    global_tokens_per_step: int | None
    because: Reason
    proven: Proven | None
    sentence: str  # the whole step in one sentence with its numbers

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "tokens_per_step": self.tokens_per_step,
                "global_tokens_per_step": self.global_tokens_per_step, "because": self.because.as_dict(),
                "proven": self.proven.as_dict() if self.proven else None, "sentence": self.sentence}


@dataclass(frozen=True)
class _Ctx:
    readiness: Readiness
    models: list[RankModel]
    ev: Evidence
    best: int | None  # the largest batch, bounded by the evidence
    world: int
    margin: float
    config: ReadinessConfig
    judge: Callable[[int], Any]  # tokens -> advice.Target
    current: int
    proven: Proven | None

    def step(self, action: str, tokens: int | None, because: Reason) -> NextStep:
        return make_step(action, tokens, because, self.current, self.world, self.proven)


def batch_words(tokens: int, world: int) -> str:
    """``196,608 global (24,576 per rank)``: a batch as a person sets it, the global number first."""
    return f"{tokens * world:,} global ({tokens:,} per rank)"


def make_step(action: str, tokens: int | None, because: Reason, current: int | None, world: int,
              proven: Proven | None) -> NextStep:
    """A step and its sentence: the action, the batch global and per rank, the change, the cause."""
    glob = None if tokens is None else tokens * world
    if tokens is None:
        sentence = f"Hold: {because.text}."
    else:
        change = f", {tokens / current - 1:+.1%}" if current and tokens != current else ""
        batch = f"{glob:,} global tokens per step ({tokens:,} per rank{change})"
        sentence = {"raise": f"Raise to {batch}", "hold": f"Hold at {batch}", "back_off": f"Back off to {batch}",
                    "fix": f"Fix first, holding {batch}"}[action] + f": {because.text}."
    return NextStep(action, tokens, glob, because, proven, sentence)


def _current(readiness: Readiness, models: list[RankModel]) -> int | None:
    """The batch the run runs now: its ranks' current processes' largest, else the largest seen."""
    now = [r.tokens for r in readiness.ranks if r.tokens]
    if now:
        return max(now)
    seen = [m.tokens_last for m in models if m.tokens_last]
    return max(seen) if seen else None


def next_step(readiness: Readiness, models: list[RankModel], ev: Evidence, best: int | None, *, world: int,
              margin: float, config: ReadinessConfig, judge: Callable[[int], Any]) -> NextStep:
    """The next step for a run (rules in the module docstring); ``judge(tokens)`` judges a batch
    by the evidence and the model (:func:`.advice.judge_target`)."""
    current = _current(readiness, models)
    setting = ev.proven_below(None)
    proven = Proven.of(setting) if setting else None
    if not current:
        head = gib(readiness.min_headroom_bytes, none="unknown")
        return make_step("hold", None, Reason("no_tokens", "no per-step tokens in the samples (pass tokens= to "
                                                           f"vw.step), so no batch can be projected; worst headroom "
                                                           f"{head} on rank {readiness.min_headroom_rank}"),
                         None, world, proven)
    ctx = _Ctx(readiness, models, ev, best, world, margin, config, judge, current, proven)
    for rule in (_fix_now, _back_off_oom, _after_leak_oom, _back_off_margin, _hold_troubled, _hold_waiting):
        step = rule(ctx)
        if step is not None:
            return step
    return _raise(ctx)


def _fix_now(ctx: _Ctx) -> NextStep | None:
    """A leak or fragmentation now: fix it first, the rank that runs out soonest named."""
    from vramwatch.decisions.readiness import UNSAFE_CAUSES

    hit = [r for r in ctx.readiness.ranks if {"leak", "fragmentation"} & set(r.causes)]
    if not hit:
        return None
    first = min(hit, key=lambda r: (min(UNSAFE_CAUSES.index(c) for c in r.causes if c in ("leak", "fragmentation")),
                                    r.steps_to_oom if r.steps_to_oom is not None else float("inf"), r.rank))
    reason = next(x for x in first.reasons if x.cause in ("leak", "fragmentation"))
    more = f" (the soonest of {len(hit)} ranks)" if len(hit) > 1 else ""
    return ctx.step("fix", ctx.current, Reason(reason.cause, reason.text + more + "; a smaller batch only buys "
                                                                                  "time that it eats", first.rank))


def _back_off_oom(ctx: _Ctx) -> NextStep | None:
    """At or above a batch that ran out of memory for a reason of the batch: back off."""
    top = ctx.ev.ceiling()
    if top is None or ctx.current < (top.record.tokens or 0):
        return None
    s, o = top.record.tokens or 0, top.record
    again = ctx.ev.ooms_at(s)
    w = ctx.world
    what = f"rank {top.rank} ran out of memory at {batch_words(s, w)}, step {o.step:,}, {o.phase}: {o.detail}"
    if len(again) >= 2:
        n = ctx.ev.settable((1 - RECURRENCE_CUT) * s)
        steps = ", ".join(f"{x.record.step:,}" for x in again[:4])
        wide = "" if n >= (1 - 2 * RECURRENCE_CUT) * s else f" (the nearest settable batch: {n / s - 1:+.1%})"
        return ctx.step("back_off", n, Reason("recurrence", f"{len(again)} OOMs at {batch_words(s, w)} (steps "
                                                            f"{steps}; the latest: {o.detail}); cut 5-10 % below "
                                                            f"it{wide}", top.rank))
    below = ctx.ev.proven_below(s)
    if below is not None:
        return ctx.step("back_off", below.tokens, Reason(o.cause, f"{what}; back to the last proven "
                                                                  f"{batch_words(below.tokens, below.world_size)}, "
                                                                  f"run {below.run}", top.rank))
    if ctx.best == 0:
        return ctx.step("fix", ctx.current, Reason("phase_peak", f"{what}; no batch keeps the margin by the model "
                                                                 "(a phase alone breaks it): reduce that phase's "
                                                                 "memory, lowering is not enough", top.rank))
    # nothing proven to go back to: at least the procedure's smallest cut (a model that allows a
    # batch just under the one that failed has just been contradicted there)
    n = ctx.ev.settable(min(ctx.best if ctx.best is not None else s - 1, (1 - RECURRENCE_CUT) * s))
    if n <= 0:
        return ctx.step("hold", ctx.current, Reason(o.cause, f"{what}; nothing proven below it and no settable "
                                                             f"batch (steps of {ctx.ev.granularity:,} per rank) "
                                                             "under it", top.rank))
    return ctx.step("back_off", n, Reason(o.cause, f"{what}; nothing proven below it: the largest settable batch "
                                                   f"the evidence and the model allow, at least "
                                                   f"{RECURRENCE_CUT:.0%} below it", top.rank))


def _after_leak_oom(ctx: _Ctx) -> NextStep | None:
    """This run's latest OOM came from a leak or fragmentation, and nothing is proven since."""
    mine = [o for o in ctx.ev.ooms if o.run == ctx.ev.run]
    if not mine or ctx.readiness.verdict == "ready":
        return None
    last = mine[-1]
    o = last.record
    if o.cause not in ("leak", "fragmentation"):
        return None
    text = f"rank {last.rank} ran out of memory at step {o.step:,} ({o.phase}) after {o.detail}"
    if ctx.ev.current_ordinal == last.ordinal:
        return ctx.step("fix", ctx.current, Reason(o.cause, text + "; the batch does not explain it", last.rank))
    return ctx.step("hold", ctx.current, Reason(o.cause, text + "; the restarted process shows none so far: hold "
                                                               "until it is proven", last.rank))


def _back_off_margin(ctx: _Ctx) -> NextStep | None:
    if "margin" not in ctx.readiness.causes:
        return None
    tight = _rank(ctx.readiness, ctx.readiness.min_headroom_rank)
    reason = next((x for x in tight.reasons if x.cause == "margin"), None) if tight else None
    text = reason.text if reason else "worst headroom under the margin"
    rank = tight.rank if tight else None
    below = ctx.ev.proven_below(ctx.current)
    if below is not None:
        return ctx.step("back_off", below.tokens, Reason("margin", f"{text}; back to the last proven "
                                                                   f"{batch_words(below.tokens, below.world_size)}, "
                                                                   f"run {below.run}", rank))
    model = next((m for m in ctx.models if m.rank == rank), None)
    alone = model.max_tokens(ctx.margin) if model else (None, "train")
    if alone[0] == 0 and alone[1] != "train":
        return ctx.step("fix", ctx.current, Reason("phase_peak", f"{text}; the {alone[1]} phase alone leaves less "
                                                                 f"than the {ctx.margin:.0%} margin on rank {rank} at "
                                                                 "any batch: reduce its memory (state-dict offload, a "
                                                                 "smaller eval batch), lowering is not enough", rank))
    low = ctx.ev.settable(min(ctx.best or 0, lower_tokens(model, ctx.margin))) if model else 0
    if low >= ctx.current:
        fits = batch_words(ctx.ev.settable(ctx.best or 0), ctx.world)
        return ctx.step("hold", ctx.current, Reason("margin", f"{text}; the model projects up to {fits} "
                                                              "would fit, so the batch does not explain it: "
                                                              "look for memory outside the allocator, a leak or "
                                                              "fragmentation", rank))
    return ctx.step("back_off", low, Reason("margin", f"{text}; the largest settable batch that restores it by the "
                                                      "model, its error against us", rank))


def _hold_troubled(ctx: _Ctx) -> NextStep | None:
    for cause in ("death", "unstable", "oom"):
        if cause in ctx.readiness.causes:
            r = next(x for x in ctx.readiness.reasons if x.cause == cause)
            return ctx.step("hold", ctx.current, r)
    return None


def _hold_waiting(ctx: _Ctx) -> NextStep | None:
    if ctx.readiness.verdict != "not_ready":
        return None
    wait = ctx.readiness.reasons[0]
    told = (f" (the last proven: {ctx.proven.global_tokens_per_step:,} global, {ctx.proven.tokens_per_step:,} per "
            f"rank, run {ctx.proven.run})" if ctx.proven else "")
    best = ctx.ev.settable(ctx.best) if ctx.best else 0
    fits = f"; the largest settable batch that fits: {batch_words(best, ctx.world)}" if best > 0 else ""
    return ctx.step("hold", ctx.current, Reason(wait.cause, f"not proven yet: {wait.text}{told}{fits}", wait.rank))


def _raise(ctx: _Ctx) -> NextStep:
    """Proven: the next settable batch, if nothing observed and the model both allow it."""
    n = ctx.ev.next_settable(ctx.current, ctx.current * (1 + MIN_RAISE))
    w = ctx.world
    top = ctx.ev.ceiling()
    if top is not None and n >= (top.record.tokens or 0):
        o = top.record
        which = "the one" if n == o.tokens else f"above {(o.tokens or 0) * w:,} global, the one"
        return ctx.step("hold", ctx.current, Reason(
            "oom_ceiling", f"proven; the next settable batch, {batch_words(n, w)}, is {which} that ran out of "
                           f"memory (rank {top.rank}, step {o.step:,}, {o.phase})", top.rank))
    if n > ctx.current * EXTRAPOLATION_LIMIT:
        return ctx.step("hold", ctx.current, Reason(
            "extrapolation", f"proven; the next settable batch {batch_words(n, w)} (steps of "
                             f"{ctx.ev.granularity * w:,} global) is more than {EXTRAPOLATION_LIMIT:g}x the current "
                             "one: set a finer --granularity"))
    target = ctx.judge(n)
    if not target.fits:
        return ctx.step("hold", ctx.current, Reason("no_fit", f"proven; the next settable batch {batch_words(n, w)}: "
                                                              f"{target.because.text}", target.rank))
    keep = (f"keep it only after a {ctx.config.plateau_steps:,}-step plateau and {ctx.config.checkpoints} "
            f"checkpoint(s), else straight back to {ctx.current * w:,} global")
    return ctx.step("raise", n, Reason("proven", f"{batch_words(ctx.current, w)} is proven; at {n * w:,} global "
                                                 f"{target.because.text}; {keep}",
                                       target.rank))


def _rank(readiness: Readiness, rank: int | None) -> RankReadiness | None:
    return next((r for r in readiness.ranks if r.rank == rank), None)


def safe_tokens(model: RankModel, margin: float) -> int | None:
    """Largest tokens that fit when the transient is as large as the fit's stated uncertainty allows."""
    tokens, _ = model.max_tokens(margin)
    if tokens is None or tokens <= 0:
        return tokens
    u = model.train.uncertainty_frac
    fixed = model.floor_bytes + model.slack_bytes + model.outside_bytes
    return model.train.tokens_for((model.total_bytes * (1 - margin) - fixed) / (1 + u))


def lower_tokens(model: RankModel, margin: float) -> int:
    """Tokens to lower to by the model, its error against us (a fixed share does not shrink)."""
    fit = model.train
    if fit.method != "proportional" or not model.tokens_seen_max:
        return safe_tokens(model, margin) or 0
    seen = model.tokens_seen_max
    observed = fit.transient(seen)
    room = model.total_bytes * (1 - margin) - model.floor_bytes - model.slack_bytes - model.outside_bytes
    shrinking = (1 - LOWER_FIXED_SHARE) * observed / seen
    return max(0, int((room - LOWER_FIXED_SHARE * observed) // shrinking))


__all__ = ["ACTIONS", "EXTRAPOLATION_LIMIT", "MIN_RAISE", "RECURRENCE_CUT", "NextStep", "Proven", "lower_tokens",
           "make_step", "next_step", "safe_tokens"]
