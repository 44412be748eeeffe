"""Readiness of a batch setting: the KoHRM procedure made explicit.

The operator's rule (docs/decisions.md): keep a larger batch only once its VRAM plateau
has held for 2-3 thousand steps *and* it has survived a checkpoint save, with margin
left; on an OOM or unstable peaks go back at once. Per rank:

* ``unsafe``: an OOM, a leak, fragmentation, a plateau break the training loop itself
  caused and that has not settled, or worst headroom under the margin;
* ``not_ready``: none of that, but the plateau has held fewer than ``plateau_steps``
  steps or fewer than ``checkpoints`` checkpoints were passed;
* ``ready``: otherwise.

The run's verdict is its worst rank's. Pure functions over a :class:`RunObservation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.units import gib
from vramwatch.verdicts import LOW_HEADROOM_FRACTION

from .observe import LOOP_CAUSES, PlateauClock, RankTrack, RunObservation

VERDICTS = ("ready", "not_ready", "unsafe")  # best first; severity is the index
#: Why a rank is unsafe, in the order reasons are listed (advice acts on these, not on text).
CAUSES = ("oom", "leak", "fragmentation", "unstable", "margin")

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
    reasons: tuple[str, ...]
    plateau_steps: int
    checkpoints_passed: int
    min_headroom_bytes: int | None
    min_headroom_phase: str | None
    causes: tuple[str, ...] = ()  # of CAUSES, when unsafe

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "rank": self.rank, "verdict": self.verdict, "reasons": list(self.reasons),
                "plateau_steps": self.plateau_steps, "checkpoints_passed": self.checkpoints_passed,
                "min_headroom_bytes": self.min_headroom_bytes, "min_headroom_phase": self.min_headroom_phase,
                "causes": list(self.causes)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RankReadiness:
        """Inverse of :meth:`as_dict` (KeyError/TypeError/ValueError on a malformed document)."""
        verdict = str(doc["verdict"])
        if verdict not in VERDICTS:
            raise ValueError(f"verdict: not one of {VERDICTS}: {verdict!r}")
        return cls(str(doc["host"]), int(doc["rank"]), verdict, tuple(str(r) for r in doc["reasons"]),
                   int(doc["plateau_steps"]), int(doc["checkpoints_passed"]), doc.get("min_headroom_bytes"),
                   doc.get("min_headroom_phase"), tuple(c for c in doc.get("causes") or () if c in CAUSES))


@dataclass(frozen=True)
class Readiness:
    verdict: str
    reasons: tuple[str, ...]
    plateau_steps: int
    checkpoints_passed: int
    min_headroom_bytes: int | None
    worst_rank: int | None
    ranks: tuple[RankReadiness, ...]
    causes: tuple[str, ...] = ()  # union over ranks, in CAUSES order

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": list(self.reasons), "plateau_steps": self.plateau_steps,
                "checkpoints_passed": self.checkpoints_passed, "min_headroom_bytes": self.min_headroom_bytes,
                "worst_rank": self.worst_rank, "causes": list(self.causes),
                "ranks": [r.as_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Readiness:
        """Inverse of :meth:`as_dict` (KeyError/TypeError/ValueError on a malformed document)."""
        return cls(str(doc["verdict"]), tuple(str(r) for r in doc["reasons"]), int(doc["plateau_steps"]),
                   int(doc["checkpoints_passed"]), doc.get("min_headroom_bytes"), doc.get("worst_rank"),
                   tuple(RankReadiness.from_dict(r) for r in doc.get("ranks") or ()),
                   tuple(c for c in doc.get("causes") or () if c in CAUSES))


def plateau_held_steps(events: list[dict[str, Any]], last_step: int | None, state: str) -> int:
    """Steps the current plateau has held, from a whole event list (see :class:`PlateauClock`)."""
    clock = PlateauClock()
    for event in events:
        clock.feed(event)
    return clock.held(last_step, state)


def _gb(value: float) -> str:
    return gib(value)


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


def rank_readiness(track: RankTrack, config: ReadinessConfig) -> RankReadiness:
    """One rank's verdict with reasons that carry the numbers."""
    state = track.engine.state
    held = track.plateau.held(track.last_step, state)
    unsafe: list[str] = []
    waiting: list[str] = []
    causes: list[str] = []
    if track.ooms:
        causes.append("oom")
        unsafe.append(f"rank {track.rank}: {track.ooms} OOM(s)")
    if state == "leak":
        causes.append("leak")
        summary = track.engine.summary()
        slope = summary.get("slope_bytes_per_step") or 0.0
        unsafe.append(f"rank {track.rank}: leak ({summary.get('leak_source')}) {slope / 1e6:.2f} MB/step, "
                      f"OOM in {summary.get('steps_to_oom') or '?'} steps")
    elif state == "fragmentation":
        causes.append("fragmentation")
        unsafe.append(f"rank {track.rank}: fragmentation (allocation retries climbing)")
    broke = _unstable_break(track)
    if broke is not None:
        causes.append("unstable")
        unsafe.append(f"rank {track.rank}: plateau broke at step {broke['step']} ({broke.get('cause')}) "
                      "and has not settled")
    total = track.total_bytes or 0
    headroom = track.min_headroom_bytes
    if headroom is not None and total and headroom < config.margin * total:
        causes.append("margin")
        unsafe.append(f"rank {track.rank}: worst headroom {_gb(headroom)} at {track.min_headroom_phase} "
                      f"is under the {config.margin:.0%} margin ({_gb(config.margin * total)})")
    if held < config.plateau_steps:
        waiting.append(f"rank {track.rank}: plateau held {held:,} of {config.plateau_steps:,} steps")
    if track.checkpoints_passed < config.checkpoints:
        waiting.append(f"rank {track.rank}: {track.checkpoints_passed} of {config.checkpoints} checkpoint(s) passed")
    verdict = "unsafe" if unsafe else "not_ready" if waiting else "ready"
    reasons = tuple(unsafe or waiting)
    if verdict == "ready":
        reasons = (f"rank {track.rank}: plateau held {held:,} steps, {track.checkpoints_passed} checkpoint(s) "
                   f"passed, worst headroom {_gb(headroom or 0)} at {track.min_headroom_phase}",)
    return RankReadiness(track.host, track.rank, verdict, reasons, held, track.checkpoints_passed,
                         headroom, track.min_headroom_phase, tuple(causes))


def run_readiness(obs: RunObservation, config: ReadinessConfig | None = None) -> Readiness:
    """The run's verdict: its worst rank's, with the reasons of every rank at that verdict (O(ranks))."""
    config = config or ReadinessConfig()
    return combine(tuple(rank_readiness(t, config) for t in obs.tracks()))


def combine(ranks: tuple[RankReadiness, ...]) -> Readiness:
    """The run's readiness from its ranks' (O(ranks)): also how a front joins the ranks of
    several collectors, so a run spread over shards gets the verdict one collector would give."""
    if not ranks:
        return Readiness("not_ready", ("no samples",), 0, 0, None, None, ())
    worst = max(VERDICTS.index(r.verdict) for r in ranks)
    verdict = VERDICTS[worst]
    at_worst = [r for r in ranks if r.verdict == verdict]
    headrooms = [r for r in ranks if r.min_headroom_bytes is not None]
    tight = min(headrooms, key=lambda r: r.min_headroom_bytes or 0) if headrooms else None
    if verdict == "not_ready":  # the rank furthest from proven
        worst_rank: int | None = min(at_worst, key=lambda r: (r.plateau_steps, r.checkpoints_passed)).rank
    elif verdict == "unsafe":  # the rank with the most serious cause
        worst_rank = min(at_worst, key=lambda r: min(CAUSES.index(c) for c in r.causes)).rank
    else:
        worst_rank = tight.rank if tight else None
    if verdict == "ready" and tight is not None:
        reasons: tuple[str, ...] = next(r.reasons for r in ranks if r.rank == tight.rank)
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
        causes=tuple(c for c in CAUSES if any(c in r.causes for r in ranks)),
    )


def _condense(reasons: tuple[str, ...], keep: int = 6) -> tuple[str, ...]:
    """At most ``keep`` reasons, then a count (8 ranks waiting say the same thing 8 times)."""
    if len(reasons) <= keep:
        return reasons
    return (*reasons[:keep], f"... and {len(reasons) - keep} more")


__all__ = ["CAUSES", "VERDICTS", "RankReadiness", "Readiness", "ReadinessConfig", "combine", "plateau_held_steps",
           "rank_readiness", "run_readiness"]
