"""Trials: each process of each rank at one batch setting, and how it went.

A rank's life is a sequence of processes (incarnations: the job restarted, resumed from a
checkpoint, perhaps at another batch). Each is a :class:`Trial` of one batch setting (the
largest tokens per step the process ran): how long its plateau held, how many checkpoints it
passed, its worst headroom, and how it ended. An OOM is recorded with its **cause**, read from
the evidence on that rank before it (:func:`oom_cause`): a leak or fragmentation the trend
engine had detected, a raise above a setting that had held, a phase's own peak, or the step's
peak at that batch.

:class:`~vramwatch.decisions.observe.RankTrack` folds one rank's samples into its trials online
(O(1) per sample, at most :data:`MAX_TRIALS` kept); how each process ended is the run-life model's
judgement (:func:`with_outcomes`, :mod:`vramwatch.runlife`), never decided here. :mod:`.evidence`
turns the trials of a run (and of reference runs) into what
was proven and what ran out of memory, which the advice never overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vramwatch.decisions.reasons import OOM_CAUSES
from vramwatch.runlife import IncarnationRecord, Moment, RankLife, judge
from vramwatch.units import mib
from vramwatch.verdicts import Outcome

#: Processes kept per rank (the latest); older ones leave their evidence behind with them.
MAX_TRIALS = 64
#: How a process ended: the run-life model's outcomes (:class:`vramwatch.verdicts.Outcome`, judged by
#: :func:`vramwatch.runlife.judge`); ``killed`` (alone, while the job went on) is a rank's death.
OUTCOMES = tuple(str(o) for o in Outcome)


@dataclass(frozen=True)
class LeakSeen:
    """The latest leak the trend engine reported in a process."""

    step: int
    slope_bytes_per_step: float
    source: str | None
    steps_to_oom: int | None


@dataclass(frozen=True)
class OomRecord:
    """An OOM and what the evidence on the rank showed before it."""

    step: int
    ts: float
    phase: str
    tokens: int | None  # the batch setting when it happened (per rank); None: no tokens sent
    cause: str  # of reasons.OOM_CAUSES
    detail: str  # the evidence before it, in words with numbers

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ts": self.ts, "phase": self.phase, "tokens": self.tokens, "cause": self.cause,
                "detail": self.detail}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> OomRecord:
        cause = str(doc["cause"])
        if cause not in OOM_CAUSES:
            raise ValueError(f"oom.cause: not one of {OOM_CAUSES}: {cause!r}")
        tokens = doc.get("tokens")
        return cls(int(doc["step"]), float(doc["ts"]), str(doc["phase"]), None if tokens is None else int(tokens),
                   cause, str(doc["detail"]))


@dataclass(slots=True)
class Trial:
    """One process of one rank. Mutable while its samples arrive; readers get copies
    (:meth:`~vramwatch.decisions.observe.RankTrack.copy_trials`)."""

    incarnation: Any
    ordinal: int  # 0 for the rank's first process, then one more per restart
    first_step: int
    first_ts: float
    last_step: int
    last_ts: float
    tokens: int | None = None  # the batch setting: the largest tokens per step of the process
    tokens_min: int | None = None
    plateau_steps: int = 0  # the longest the plateau held in this process
    checkpoints_passed: int = 0  # checkpoint phases followed by a training step without an OOM
    min_headroom_bytes: int | None = None
    min_headroom_phase: str | None = None
    total_bytes: int | None = None
    exited: bool = False
    marked: bool = False  # its source sends the hook's OOM counter or end marker (a silent end is a death)
    oom: OomRecord | None = None
    leak: LeakSeen | None = None
    fragmentation_step: int | None = None
    outcome: str = "running"  # set by with_outcomes() on copies; the track itself never judges it
    pending_checkpoint: bool = False
    grid: int | None = None  # the settable step the training loop declared (tokens per rank; .grid)

    @property
    def tokens_constant(self) -> bool:
        """Every training step carried the same tokens (fixed slots): the setting is exact."""
        return self.tokens is not None and self.tokens_min == self.tokens

    def as_dict(self) -> dict[str, Any]:
        leak = self.leak
        return {
            "incarnation": self.incarnation, "ordinal": self.ordinal, "first_step": self.first_step,
            "first_ts": self.first_ts, "last_step": self.last_step, "last_ts": self.last_ts, "tokens": self.tokens,
            "tokens_min": self.tokens_min, "plateau_steps": self.plateau_steps,
            "checkpoints_passed": self.checkpoints_passed, "min_headroom_bytes": self.min_headroom_bytes,
            "min_headroom_phase": self.min_headroom_phase, "total_bytes": self.total_bytes, "exited": self.exited,
            "marked": self.marked, "outcome": self.outcome, "oom": self.oom.as_dict() if self.oom else None,
            "leak": None if leak is None else {"step": leak.step, "slope_bytes_per_step": leak.slope_bytes_per_step,
                                               "source": leak.source, "steps_to_oom": leak.steps_to_oom},
            "fragmentation_step": self.fragmentation_step, "grid": self.grid,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Trial:
        """Inverse of :meth:`as_dict` (KeyError/TypeError/ValueError on a malformed document)."""
        outcome = str(doc.get("outcome", "running"))
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome: not one of {OUTCOMES}: {outcome!r}")
        leak = doc.get("leak")
        return cls(
            doc.get("incarnation"), int(doc["ordinal"]), int(doc["first_step"]), float(doc["first_ts"]),
            int(doc["last_step"]), float(doc["last_ts"]), _int(doc.get("tokens")), _int(doc.get("tokens_min")),
            int(doc["plateau_steps"]), int(doc["checkpoints_passed"]), _int(doc.get("min_headroom_bytes")),
            doc.get("min_headroom_phase"), _int(doc.get("total_bytes")), bool(doc.get("exited")),
            bool(doc.get("marked")), OomRecord.from_dict(doc["oom"]) if doc.get("oom") else None,
            None if not leak else LeakSeen(int(leak["step"]), float(leak["slope_bytes_per_step"]), leak.get("source"),
                                           _int(leak.get("steps_to_oom"))),
            _int(doc.get("fragmentation_step")), outcome, grid=_int(doc.get("grid")))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def leak_text(leak: LeakSeen) -> str:
    """``leaking 0.48 MiB/step (allocator) since step 1,569``: one wording for every reason."""
    source = f" ({leak.source})" if leak.source else ""
    return f"leaking {mib(leak.slope_bytes_per_step)}/step{source} since step {leak.step:,}"


def oom_cause(trial: Trial, earlier: list[Trial], phase: str, tokens: int | None,
              state_before: str | None) -> tuple[str, str]:
    """(cause, detail) of an OOM in ``trial``: the first of :data:`~.reasons.OOM_CAUSES` the
    evidence on the rank shows. ``earlier``: the rank's previous processes (a raise is judged
    against them); ``state_before``: the engine's state before the OOM sample."""
    at = f" at {tokens:,} tokens per step per rank" if tokens else ""
    if trial.leak is not None:
        return "leak", leak_text(trial.leak) + f", {trial.last_step - trial.leak.step:,} steps before the OOM"
    if state_before == "leak":
        return "leak", "the trend engine's leak verdict stood before the OOM"
    if trial.fragmentation_step is not None or state_before == "fragmentation":
        since = f" since step {trial.fragmentation_step:,}" if trial.fragmentation_step is not None else ""
        return "fragmentation", f"the allocator's cache was fragmented{since}"
    if tokens:
        held = [t for t in earlier if t.tokens and t.tokens < tokens and t.oom is None
                and t.plateau_steps > 0]
        if held:
            best = max(held, key=lambda t: (t.tokens or 0, t.ordinal))
            return "batch_change", (f"the batch was raised from {best.tokens:,} (held {best.plateau_steps:,} steps, "
                                    f"{best.checkpoints_passed} checkpoint(s)) to {tokens:,} per rank")
    if phase != "train":
        return "phase_peak", f"the {phase} phase's own peak{at}"
    return "batch", f"the training step's own peak{at}"


def record_oom(trial: Trial, earlier: list[Trial], step: int, ts: float, phase: str, tokens: int | None,
               state_before: str | None) -> None:
    """The process's first OOM: its setting is the one it ran (the step's tokens for a training
    step, else the largest the process ran); ``earlier``: the rank's previous processes."""
    if trial.oom is not None:
        return
    setting = tokens if phase == "train" and tokens else trial.tokens
    cause, detail = oom_cause(trial, earlier, phase, setting, state_before)
    trial.oom = OomRecord(step, ts, phase, setting, cause, detail)
    trial.pending_checkpoint = False


def note_event(trial: Trial, event: dict[str, Any]) -> None:
    """The engine's leak and fragmentation verdicts, as evidence for a later OOM's cause."""
    kind = event["type"]
    if kind == "leak":
        trial.leak = LeakSeen(int(event["step"]), float(event.get("slope_bytes_per_step") or 0.0),
                              event.get("source"), event.get("steps_to_oom"))
    elif kind == "fragmentation" and trial.fragmentation_step is None:
        trial.fragmentation_step = int(event["step"])


def record_of(trial: Trial) -> IncarnationRecord:
    """The run-life model's record of a process, from what the trial kept of it (a front joins
    shards' trials this way: the judgement is :func:`vramwatch.runlife.judge`'s either way)."""
    first, last = Moment(trial.first_step, trial.first_ts), Moment(trial.last_step, trial.last_ts)
    oom = None if trial.oom is None else Moment(trial.oom.step, trial.oom.ts)
    return IncarnationRecord(str(trial.incarnation or ""), first, last, trial.exited, False,
                             0 if oom is None else 1, oom, oom, trial.marked)


def with_outcomes(run: str, ranks: list[tuple[str, int, tuple[Trial, ...]]],
                  lives: list[RankLife] | None = None) -> list[tuple[Trial, ...]]:
    """Every process's trial with the outcome the run-life model judges (:func:`vramwatch.runlife.judge`,
    at the run's own clock: its latest sample). ``lives``: the run's folds (the collector's, or a
    replay's); without them they are rebuilt from the trials' records. O(processes log processes)."""
    if lives is None:
        lives = []
        for host, rank, trials in ranks:
            life = RankLife(host, rank)
            for t in trials:
                life.add_record(record_of(t))
            lives.append(life)
    now = max((t.last_ts for _, _, trials in ranks for t in trials), default=0.0)
    story = judge(run, lives, now)
    out = []
    for host, rank, trials in ranks:
        told = story.rank(host, rank)
        judged = {inc.record.incarnation: str(inc.outcome) for inc in told.incarnations} if told else {}
        out.append(tuple(replace(t, outcome=judged.get(str(t.incarnation or ""), t.outcome)) for t in trials))
    return out


__all__ = ["MAX_TRIALS", "OUTCOMES", "LeakSeen", "OomRecord", "Trial", "leak_text", "note_event", "oom_cause",
           "record_of", "record_oom", "with_outcomes"]
