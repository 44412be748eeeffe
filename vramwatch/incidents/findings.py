"""Typed findings: each holds the numbers its sentence states, and the sentence is rendered from
them (``text``), never written beside them. A finding exists only when the data shows it: the
constructors below are called by ``derive`` only when the evidence holds (a leak the engine
found, split blocks that grew, a retry counter that rose, a part no larger than its whole).

``to_dict()`` is the JSON form: ``kind``, the numbers, and ``text``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from vramwatch.units import capacity, duration, gib, rate, runway


class Finding:
    """Base: ``kind`` names it, ``text`` says it from the fields."""

    KIND: ClassVar[str] = ""

    @property
    def text(self) -> str:  # pragma: no cover - every finding overrides it
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.KIND, **asdict(self), "text": self.text}  # type: ignore[call-overload]


@dataclass(frozen=True)
class Leak(Finding):
    """The engine's leak on one process: since a step, at a slope, in the allocator or outside it."""

    KIND: ClassVar[str] = "leak"
    rank: int
    host: str
    since_step: int
    since_ts: float | None
    slope_bytes_per_step: float
    source: str  # allocator | outside_allocator | device
    steps_to_oom: int | None = None
    seconds_to_oom: float | None = None
    #: the forecast's 80 % range (the engine's ``seconds_to_oom_low``..``_high``), when it gave one
    seconds_to_oom_low: float | None = None
    seconds_to_oom_high: float | None = None

    @property
    def text(self) -> str:
        where = {"allocator": "in the allocator", "outside_allocator": "outside the allocator (NCCL, "
                 "cuBLAS workspaces, another library)", "device": "on the device"}.get(self.source, self.source)
        out = f"rank {self.rank} leaks {rate(self.slope_bytes_per_step)} {where} since step {self.since_step:,}"
        if self.steps_to_oom == 0:
            out += ", no room left: its next peak does not fit at this level"
        elif self.steps_to_oom is not None:
            out += f", out of memory in {runway(self.steps_to_oom, self.seconds_to_oom)} at this rate"
            if self.seconds_to_oom is not None and self.seconds_to_oom_low is not None \
                    and self.seconds_to_oom_high is not None:
                out += (f" (80 % range {duration(self.seconds_to_oom_low)} to "
                        f"{duration(self.seconds_to_oom_high)})")
        return out


@dataclass(frozen=True)
class Fragmentation(Finding):
    """Inactive split blocks grew while the floor held; ``retries_rose``: the allocator's retry
    counter rose over the same process (only then does the text say so)."""

    KIND: ClassVar[str] = "fragmentation"
    rank: int
    host: str
    since_step: int
    split_grew_bytes: int
    split_bytes: int
    unused_bytes: int | None  # reserved - allocated at the latest step
    retries_before: int | None
    retries_after: int | None

    @property
    def retries_rose(self) -> bool:
        return (self.retries_before is not None and self.retries_after is not None
                and self.retries_after > self.retries_before)

    @property
    def text(self) -> str:
        out = (f"rank {self.rank}: fragmentation since step {self.since_step:,}: inactive split blocks grew "
               f"{gib(self.split_grew_bytes)} to {gib(self.split_bytes)}")
        if self.unused_bytes is not None and self.split_bytes <= self.unused_bytes:
            out += f" (of {gib(self.unused_bytes)} reserved but unused)"
        if self.retries_rose:
            assert self.retries_before is not None and self.retries_after is not None
            out += f"; allocation retries climbing ({self.retries_before:,} to {self.retries_after:,})"
        elif self.retries_after is not None:
            out += "; the allocator has not had to retry yet"
        return out


@dataclass(frozen=True)
class Raise(Finding):
    """A process ran more tokens per step than one of its rank that held (no OOM)."""

    KIND: ClassVar[str] = "raise"
    rank: int
    host: str
    tokens_per_step: int
    held_tokens_per_step: int
    held_step: int  # the latest step the setting that held reached

    @property
    def text(self) -> str:
        return (f"rank {self.rank} ran {self.tokens_per_step:,} tokens per step, above the "
                f"{self.held_tokens_per_step:,} that held to step {self.held_step:,}")


@dataclass(frozen=True)
class PhasePeak(Finding):
    """Out of memory in a marked phase (checkpoint, eval): its peak, not training, met the capacity."""

    KIND: ClassVar[str] = "phase_peak"
    rank: int
    host: str
    phase: str
    step: int
    peak_bytes: int | None
    train_peak_bytes: int | None

    @property
    def text(self) -> str:
        out = f"rank {self.rank} ran out of memory in {self.phase} at step {self.step:,}"
        peak, train = self.peak_bytes, self.train_peak_bytes
        if peak is not None and train is not None and peak > train:
            out += (f", peaking at {gib(peak)}, {gib(peak - train)} "
                    "above the training peak")
        return out


@dataclass(frozen=True)
class InputPeakFinding(Finding):
    """The failing step's input (tokens) above anything the process had held."""

    KIND: ClassVar[str] = "input_peak"
    rank: int
    host: str
    step: int
    tokens: int
    usual_tokens: int  # the process's mean tokens per step before it
    largest_held_tokens: int  # the largest step that went through

    @property
    def text(self) -> str:
        return (f"rank {self.rank}'s step {self.step:,} carried {self.tokens:,} tokens, "
                f"{self.tokens / self.usual_tokens:.1f}x its usual {self.usual_tokens:,} and above the "
                f"largest it had held ({self.largest_held_tokens:,})")


#: why the trend engine suspected an OOM (vramwatch.engine's ``suspected_oom`` reasons), as a person reads it
SUSPICION_REASONS = {"near_full": "with the device near full",
                     "top_of_climb": "at the top of a climb the engine followed as a leak"}


@dataclass(frozen=True)
class SuspectedOomFinding(Finding):
    """An OOM suspected from device memory alone (:class:`vramwatch.runlife.SuspectedOom`): the
    process's memory vanished with the device near full or at the top of a climb. Said as a
    suspicion with its numbers: there is no OOM counter to confirm it."""

    KIND: ClassVar[str] = "suspected_oom"
    rank: int
    host: str
    step: int
    used_before_bytes: int
    used_after_bytes: int
    total_bytes: int | None
    headroom_bytes: int | None  # capacity minus used before it vanished
    reason: str  # near_full | top_of_climb

    @property
    def text(self) -> str:
        short = ("" if self.headroom_bytes is None or not self.total_bytes
                 else f", {gib(self.headroom_bytes)} short of its {capacity(self.total_bytes)},")
        return (f"suspected OOM (device memory only, no OOM counter to confirm it): rank {self.rank}'s device used "
                f"fell from {gib(self.used_before_bytes)}{short} to {gib(self.used_after_bytes)} "
                f"{SUSPICION_REASONS.get(self.reason, self.reason)}; a kill or a crash looks the same from the device")


@dataclass(frozen=True)
class NotMemory(Finding):
    """Headroom and trend show memory was not involved: every affected rank had room and none leaked."""

    KIND: ClassVar[str] = "not_memory"
    ranks: int
    min_headroom_bytes: int
    total_bytes: int | None
    host_available_bytes: int | None  # the node's free host memory at the end, when measured

    @property
    def text(self) -> str:
        who = "the rank" if self.ranks == 1 else f"each of the {self.ranks} ranks"
        out = (f"not memory: {who} had at least {gib(self.min_headroom_bytes)} free"
               + (f" of {capacity(self.total_bytes)}" if self.total_bytes else "") + " and was not leaking")
        if self.host_available_bytes is not None:
            out += f"; the node had {gib(self.host_available_bytes)} of host memory available"
        return out


@dataclass(frozen=True)
class Unknown(Finding):
    """No evidence names a cause (said as such, never guessed)."""

    KIND: ClassVar[str] = "unknown"
    headroom_bytes: int | None

    @property
    def text(self) -> str:
        return "cause unknown: no leak, fragmentation, raise or peak explains it" + (
            "" if self.headroom_bytes is None else f" (headroom {gib(self.headroom_bytes)} at its last sample)")


__all__ = ["SUSPICION_REASONS", "Finding", "Fragmentation", "InputPeakFinding", "Leak", "NotMemory", "PhasePeak",
           "Raise", "SuspectedOomFinding", "Unknown"]
