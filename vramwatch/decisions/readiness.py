"""Readiness of a batch setting: the KoHRM procedure made explicit.

The operator's rule (docs/decisions.md): keep a larger batch only once its VRAM plateau
has held for 2-3 thousand steps *and* it has survived a checkpoint save, with margin
left; on an OOM or unstable peaks go back at once. Per rank:

* ``unsafe``: an OOM of the current process (or an earlier one at this batch or a smaller one,
  for a reason of the batch), a rank killed while the job went on (vramwatch.runlife), a leak, fragmentation, a
  plateau break the training loop itself caused and that has not settled, or worst headroom
  under the margin;
* ``not_ready``: none of that, but the plateau has held fewer than ``plateau_steps``
  steps or fewer than ``checkpoints`` checkpoints were passed;
* ``ready``: otherwise.

Judged on each rank's current process (a restart at another batch starts the proof again);
earlier processes are evidence (:mod:`.evidence`). The run's verdict is its worst rank's; every
reason carries its cause code (:class:`~vramwatch.decisions.reasons.Reason`). Pure functions
over a :class:`RunObservation`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vramwatch.decisions.observe import LOOP_CAUSES, PlateauClock, RankTrack
from vramwatch.decisions.reasons import BATCH_CAUSES, Reason
from vramwatch.units import duration, gib, mib
from vramwatch.verdicts import LOW_HEADROOM_FRACTION, is_low_headroom

VERDICTS = ("ready", "not_ready", "unsafe")  # best first; severity is the index
#: Why a rank is unsafe, most serious first (advice acts on these codes, never on the text).
UNSAFE_CAUSES = ("oom", "death", "leak", "fragmentation", "unstable", "margin")


@dataclass(frozen=True)
class ReadinessConfig:
    """Thresholds; the defaults are the seed's (2,000 steps, one checkpoint, 5 % margin)."""

    plateau_steps: int = 2000
    checkpoints: int = 1
    margin: float = LOW_HEADROOM_FRACTION


@dataclass(frozen=True)
class RankReadiness:
    host: str
    rank: int
    verdict: str
    reasons: tuple[Reason, ...]
    plateau_steps: int
    checkpoints_passed: int
    min_headroom_bytes: int | None
    min_headroom_phase: str | None
    causes: tuple[str, ...] = ()  # of UNSAFE_CAUSES, when unsafe
    steps_to_oom: int | None = None  # a leak's runway (the soonest OOM is fixed first)
    tokens: int | None = None  # the batch the current process runs (per rank)
    seconds_to_oom: float | None = None  # the same runway at the rank's own step time

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "verdict": self.verdict,
                "reasons": [r.as_dict() for r in self.reasons], "plateau_steps": self.plateau_steps,
                "checkpoints_passed": self.checkpoints_passed, "min_headroom_bytes": self.min_headroom_bytes,
                "min_headroom_phase": self.min_headroom_phase, "causes": list(self.causes),
                "steps_to_oom": self.steps_to_oom, "seconds_to_oom": self.seconds_to_oom, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RankReadiness:
        """Inverse of :meth:`as_dict` (KeyError/TypeError/ValueError on a malformed document)."""
        verdict = str(doc["verdict"])
        if verdict not in VERDICTS:
            raise ValueError(f"verdict: not one of {VERDICTS}: {verdict!r}")
        return cls(str(doc["host"]), int(doc["rank"]), verdict, tuple(Reason.from_dict(r) for r in doc["reasons"]),
                   int(doc["plateau_steps"]), int(doc["checkpoints_passed"]), doc.get("min_headroom_bytes"),
                   doc.get("min_headroom_phase"), tuple(c for c in doc.get("causes") or () if c in UNSAFE_CAUSES),
                   doc.get("steps_to_oom"), doc.get("tokens"), doc.get("seconds_to_oom"))


@dataclass(frozen=True)
class Readiness:
    verdict: str
    reasons: tuple[Reason, ...]
    plateau_steps: int
    checkpoints_passed: int
    min_headroom_bytes: int | None
    worst_rank: int | None  # the rank the verdict is about: furthest from proven, or the most serious cause
    ranks: tuple[RankReadiness, ...]
    causes: tuple[str, ...] = ()  # union over ranks, in UNSAFE_CAUSES order
    min_headroom_rank: int | None = None  # the rank with the least headroom (min_headroom_bytes is its)

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": [r.as_dict() for r in self.reasons],
                "plateau_steps": self.plateau_steps, "checkpoints_passed": self.checkpoints_passed,
                "min_headroom_bytes": self.min_headroom_bytes, "min_headroom_rank": self.min_headroom_rank,
                "worst_rank": self.worst_rank, "causes": list(self.causes), "ranks": [r.as_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Readiness:
        """Inverse of :meth:`as_dict` (KeyError/TypeError/ValueError on a malformed document)."""
        return cls(str(doc["verdict"]), tuple(Reason.from_dict(r) for r in doc["reasons"]), int(doc["plateau_steps"]),
                   int(doc["checkpoints_passed"]), doc.get("min_headroom_bytes"), doc.get("worst_rank"),
                   tuple(RankReadiness.from_dict(r) for r in doc.get("ranks") or ()),
                   tuple(c for c in doc.get("causes") or () if c in UNSAFE_CAUSES), doc.get("min_headroom_rank"))


def plateau_held_steps(events: list[dict[str, Any]], last_step: int | None, state: str) -> int:
    """Steps the current plateau has held, from a whole event list (see :class:`PlateauClock`)."""
    clock = PlateauClock()
    for event in events:
        clock.feed(event)
    return clock.held(last_step, state)


def _unstable_break(track: RankTrack) -> dict[str, Any] | None:
    """The latest loop-caused break when the engine is still rising from it."""
    if track.engine.state != "rising":
        return None
    for event in reversed(track.events):
        if event["type"] == "plateau":
            return None
        if event["type"] == "plateau_break":
            return event if event.get("cause") in LOOP_CAUSES else None
    return None


def _batch(tokens: int, world: int | None) -> str:
    """A batch global first when the world size is known (``196,608 global (24,576 per rank)``)."""
    return f"{tokens * world:,} global ({tokens:,} per rank)" if world else f"{tokens:,} tokens per step per rank"


def _fragmentation_text(track: RankTrack) -> str:
    """What the engine's latest fragmentation event measured: retries climbing only when the
    retry counter rose in its window, else the split blocks' growth."""
    event = next((e for e in reversed(track.engine.events) if e.get("type") == "fragmentation"), None)
    if event is None:
        return "reserved memory the allocator cannot reuse is growing"
    rose = event.get("alloc_retries_in_window") or 0
    if rose > 0:
        return f"allocation retries climbing: {rose:,} in its window"
    return (f"unused reserved memory grew {gib(event.get('growth_bytes'))}; inactive split blocks hold "
            f"{gib(event.get('inactive_split_bytes'))}; no allocation retry yet")


def _oom_reason(track: RankTrack) -> Reason | None:
    """The current process ran out of memory, or an earlier one did at this batch or a smaller
    one for a reason of the batch (a leak's OOM says nothing about the batch)."""
    trials = track.trials()
    if not trials:
        return None
    now = trials[-1]
    world = track.builder.world_size
    if now.oom is not None:
        o = now.oom
        at = f" at {_batch(o.tokens, world)}" if o.tokens else ""
        return Reason("oom", f"rank {track.rank}: OOM at step {o.step:,} ({o.phase}){at}: {o.detail}", track.rank)
    for t in reversed(trials[:-1]):
        o = t.oom
        if o is not None and o.cause in BATCH_CAUSES and o.tokens and now.tokens and o.tokens <= now.tokens:
            text = (f"rank {track.rank}: runs {_batch(now.tokens, world)}, and an earlier process ran out of "
                    f"memory at {_batch(o.tokens, world)} (step {o.step:,}, {o.phase}): {o.detail}")
            return Reason("oom", text, track.rank)
    return None


def _unsafe(track: RankTrack, config: ReadinessConfig) -> tuple[list[Reason], tuple[int | None, float | None]]:
    """Reasons the rank is unsafe now (cause codes of UNSAFE_CAUSES) and a leak's runway."""
    unsafe: list[Reason] = []
    rank = track.rank
    oom = _oom_reason(track)
    if oom is not None:
        unsafe.append(oom)
    state = track.engine.state
    steps_to_oom = seconds = None
    if state == "leak":
        summary = track.engine.summary()
        slope = summary.get("slope_bytes_per_step") or 0.0
        steps_to_oom, seconds = summary.get("steps_to_oom"), summary.get("seconds_to_oom")
        runway = runway_text(steps_to_oom, seconds)
        unsafe.append(Reason("leak", f"rank {rank}: leak ({summary.get('leak_source')}) {mib(slope)}/step, {runway}",
                             rank))
    elif state == "fragmentation":
        unsafe.append(Reason("fragmentation", f"rank {rank}: fragmentation ({_fragmentation_text(track)})", rank))
    broke = _unstable_break(track)
    if broke is not None:
        unsafe.append(Reason("unstable", f"rank {rank}: plateau broke at step {broke['step']:,} "
                                         f"({broke.get('cause')}) and has not settled", rank))
    total = track.total_bytes or 0
    headroom = track.min_headroom_bytes
    if is_low_headroom(headroom, total, config.margin):
        unsafe.append(Reason("margin", f"rank {rank}: worst headroom {gib(headroom)} at {track.min_headroom_phase} "
                                       f"is under the {config.margin:.0%} margin ({gib(config.margin * total)})", rank))
    return unsafe, (steps_to_oom, seconds)


def runway_text(steps: int | None, seconds: float | None) -> str:
    """``OOM in 7 h 9 min (25,780 steps at 1.00 s/step)``: the runway in time at the run's own step
    time, beside steps; steps alone when no step time is known."""
    if steps is None:
        return "OOM time unknown"
    if seconds is None or steps <= 0:
        return f"OOM in {steps:,} steps (no step time yet)"
    return f"OOM in {duration(seconds)} ({steps:,} steps at {seconds / steps:.2f} s/step)"


def rank_readiness(track: RankTrack, config: ReadinessConfig) -> RankReadiness:
    """One rank's verdict on its current process, with reasons that carry the numbers."""
    held = track.plateau.held(track.last_step, track.engine.state)
    unsafe, (steps_to_oom, seconds_to_oom) = _unsafe(track, config)
    rank = track.rank
    waiting: list[Reason] = []
    if held < config.plateau_steps:
        waiting.append(Reason("plateau", f"rank {rank}: plateau held {held:,} of {config.plateau_steps:,} steps", rank))
    if track.checkpoints_passed < config.checkpoints:
        waiting.append(Reason("checkpoint", f"rank {rank}: {track.checkpoints_passed} of {config.checkpoints} "
                                            "checkpoint(s) passed", rank))
    verdict = "unsafe" if unsafe else "not_ready" if waiting else "ready"
    reasons = tuple(unsafe or waiting)
    headroom = track.min_headroom_bytes
    if verdict == "ready":
        reasons = (Reason("proven", f"rank {rank}: plateau held {held:,} steps, {track.checkpoints_passed} "
                                    f"checkpoint(s) passed, worst headroom {gib(headroom or 0)} at "
                                    f"{track.min_headroom_phase}", rank),)
    trial = track.trial
    return RankReadiness(track.host, rank, verdict, reasons, held, track.checkpoints_passed, headroom,
                         track.min_headroom_phase, tuple(r.cause for r in unsafe), steps_to_oom,
                         trial.tokens if trial else None, seconds_to_oom)


def with_death(r: RankReadiness, text: str) -> RankReadiness:
    """``r`` made unsafe by the death of its current process (judged across the run's ranks)."""
    reasons = (Reason("death", text, r.rank), *(x for x in r.reasons if r.verdict == "unsafe"))
    causes = tuple(c for c in UNSAFE_CAUSES if c == "death" or c in r.causes)
    return RankReadiness(r.host, r.rank, "unsafe", reasons, r.plateau_steps, r.checkpoints_passed,
                         r.min_headroom_bytes, r.min_headroom_phase, causes, r.steps_to_oom, r.tokens,
                         r.seconds_to_oom)


def _most_serious(r: RankReadiness) -> tuple[int, float]:
    """Sort key: the most serious cause first, then the soonest OOM (a leak that runs out first)."""
    serious = min(UNSAFE_CAUSES.index(c) for c in r.causes) if r.causes else len(UNSAFE_CAUSES)
    return serious, r.steps_to_oom if r.steps_to_oom is not None else float("inf")


def combine(ranks: tuple[RankReadiness, ...]) -> Readiness:
    """The run's readiness from its ranks' (O(ranks)): also how a front joins the ranks of
    several collectors, so a run spread over shards gets the verdict one collector would give."""
    if not ranks:
        return Readiness("not_ready", (Reason("plateau", "no samples"),), 0, 0, None, None, ())
    worst = max(VERDICTS.index(r.verdict) for r in ranks)
    verdict = VERDICTS[worst]
    at_worst = [r for r in ranks if r.verdict == verdict]
    headrooms = [r for r in ranks if r.min_headroom_bytes is not None]
    tight = min(headrooms, key=lambda r: (r.min_headroom_bytes or 0, r.rank)) if headrooms else None
    if verdict == "not_ready":  # the rank furthest from proven
        worst_rank: int | None = min(at_worst, key=lambda r: (r.plateau_steps, r.checkpoints_passed)).rank
    elif verdict == "unsafe":  # the most serious cause; among leaks the one that runs out first
        first = min(at_worst, key=_most_serious)
        worst_rank = first.rank
        at_worst = [first, *(r for r in sorted(at_worst, key=_most_serious) if r is not first)]
    else:
        worst_rank = tight.rank if tight else None
    if verdict == "ready" and tight is not None:
        reasons: tuple[Reason, ...] = next(r.reasons for r in ranks if r.rank == tight.rank)
    else:
        reasons = tuple(reason for r in at_worst for reason in r.reasons)
    return Readiness(
        verdict=verdict,
        reasons=_condense(reasons),
        plateau_steps=min(r.plateau_steps for r in ranks),
        checkpoints_passed=min(r.checkpoints_passed for r in ranks),
        min_headroom_bytes=tight.min_headroom_bytes if tight else None,
        worst_rank=worst_rank,
        ranks=ranks,
        causes=tuple(c for c in UNSAFE_CAUSES if any(c in r.causes for r in ranks)),
        min_headroom_rank=tight.rank if tight else None,
    )


def _condense(reasons: tuple[Reason, ...], keep: int = 6) -> tuple[Reason, ...]:
    """At most ``keep`` reasons, then a count under the most common cause left out (8 ranks
    waiting say the same thing 8 times)."""
    if len(reasons) <= keep:
        return reasons
    rest = reasons[keep:]
    cause = Counter(r.cause for r in rest).most_common(1)[0][0]
    return (*reasons[:keep], Reason(cause, f"... and {len(rest)} more"))


__all__ = ["UNSAFE_CAUSES", "VERDICTS", "RankReadiness", "Readiness", "ReadinessConfig", "combine",
           "plateau_held_steps", "rank_readiness", "with_death"]
