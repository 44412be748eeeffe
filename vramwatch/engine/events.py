"""Typed engine events: one dataclass per event type, one ``to_dict()`` for the JSON contract.

``TrendEngine.update`` returns (and ``engine.events`` keeps) the ``to_dict()`` form, the
shape of ``vramwatch analyze --json`` and ``/events``: ``type`` and ``step`` (the step of
the sample at which the event was raised) first, then the fields in declaration order.
Events are rare (a few per thousand steps), so building a dataclass costs nothing that
matters.

Byte fields are relative to what their names say: ``above_plateau_bytes`` is the peak
minus the event's own ``plateau_bytes``, the same number the summary reports as
``plateau_bytes``; ``above_training_peak_bytes`` is the peak minus the typical training
peak (negative: the phase stayed below it, a non-event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

FRAGMENTATION_ADVICE = (
    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the allocator grows segments "
    "instead of splitting them"
)


class Event:
    """Base of every event: ``to_dict()`` gives ``{"type", "step", ...fields}``."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE}
        for name in self.__slots__:  # dataclass(slots=True): the fields, in order
            out[name] = getattr(self, name)
        return out


@dataclass(slots=True)
class PlateauEvent(Event):
    """The series settled: warm-up over, a rise over, or a leak or fragmentation ended."""

    TYPE: ClassVar[str] = "plateau"
    step: int
    plateau_bytes: int  # the reserved level (the judged level when reserved is not measured)
    allocated_bytes: int | None  # the allocated floor; None when allocated is not measured
    floor_bytes: int  # the floor of the judged signal
    peak_bytes: int | None  # the typical training peak (median of block peaks)
    headroom_bytes: int | None  # verdicts.headroom_bytes at the latest step boundary
    since_step: int  # where the flat window began
    signal: str  # allocated | reserved | device_used


@dataclass(slots=True)
class PlateauBreakEvent(Event):
    """Memory left the plateau. ``relevel``: a marked phase ratcheted reserved once and the
    plateau was moved to the new level at once (not a growing problem, no ``rising``)."""

    TYPE: ClassVar[str] = "plateau_break"
    step: int
    onset_step: int
    cause: str  # allocated | reserved | the phase that ratcheted reserved (e.g. checkpoint)
    plateau_bytes: int  # the level it broke from
    reserved_bytes: int | None
    allocated_bytes: int | None
    relevel: bool = False
    new_plateau_bytes: int | None = None  # the level after a re-level


@dataclass(slots=True)
class LeakEvent(Event):
    """A significant, material, linear, gradual rise, or a staircase of ratchets at a regular
    cadence on a ratcheting level (docs/engine.md)."""

    TYPE: ClassVar[str] = "leak"
    step: int  # detection
    onset_step: int  # where the rise began (same as leak_onset_step; kept for the contract)
    slope_bytes_per_step: float
    steps_to_oom: int | None
    seconds_to_oom: float | None
    source: str  # allocator | outside_allocator | device
    leak_onset_step: int
    plateau_bytes: int | None  # the plateau the leak grew from
    plateau_since_step: int | None
    signal: str
    cadence_steps: int | None = None  # a staircase leak: mean steps between its steps; None for a steady rise
    # the forecast's range: a steady rise's slower and faster parts, a staircase's 80 % interval (docs/engine.md)
    seconds_to_oom_low: float | None = None
    seconds_to_oom_high: float | None = None


@dataclass(slots=True)
class FragmentationEvent(Event):
    TYPE: ClassVar[str] = "fragmentation"
    step: int
    onset_step: int
    reserved_bytes: int | None
    allocated_bytes: int | None
    reserved_minus_allocated_bytes: int
    growth_bytes: int
    growth_bytes_per_step: float
    inactive_split_bytes: int | None
    alloc_retries: int | None
    alloc_retries_in_window: int
    recommendation: str = FRAGMENTATION_ADVICE


@dataclass(slots=True)
class SpikeEvent(Event):
    """A marked phase's peak (``checkpoint_spike`` / ``eval_spike`` / ``phase_spike``) or an
    unmarked periodic one (``periodic_spike`` with ``period_steps``)."""

    kind: str
    step: int
    phase: str | None
    peak_bytes: int | None  # None: the phase sample carried no peak (not measured)
    above_plateau_bytes: int | None  # peak - plateau_bytes
    headroom_bytes: int | None  # verdicts.headroom_bytes at this peak
    plateau_bytes: int | None
    training_peak_bytes: int | None
    above_training_peak_bytes: int | None  # < 0: below the training peak, a non-event
    below_training_peak: bool
    period_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind, "step": self.step}
        if self.phase is not None:
            out["phase"] = self.phase
        if self.period_steps is not None:
            out["period_steps"] = self.period_steps
        for name in ("peak_bytes", "above_plateau_bytes", "headroom_bytes", "plateau_bytes", "training_peak_bytes",
                     "above_training_peak_bytes", "below_training_peak"):
            out[name] = getattr(self, name)
        return out


@dataclass(slots=True)
class RestartEvent(Event):
    TYPE: ClassVar[str] = "restart"
    step: int
    from_step: int
    incarnation: str | None


@dataclass(slots=True)
class OomEvent(Event):
    TYPE: ClassVar[str] = "oom"
    step: int
    ooms: int
    phase: str


@dataclass(slots=True)
class SuspectedOomEvent(Event):
    """Seen from the device only (no OOM counter): the process's memory vanished with the device
    near full, or at the top of a climb the engine was following. A suspicion, named as such: a
    kill or a crash looks the same from the device."""

    TYPE: ClassVar[str] = "suspected_oom"
    step: int
    used_before_bytes: int  # the level before it vanished
    used_after_bytes: int
    total_bytes: int | None
    reason: str  # near_full | top_of_climb
    state: str  # the verdict it vanished in


def spike_kind(phase: str) -> str:
    """checkpoint / eval by the usual names (Lightning, HF Trainer, hand-written loops)."""
    lowered = phase.lower()
    if lowered.startswith(("checkpoint", "ckpt", "save")):
        return "checkpoint_spike"
    if lowered.startswith(("eval", "val", "test")):
        return "eval_spike"
    return "phase_spike"


__all__ = [
    "FRAGMENTATION_ADVICE",
    "Event",
    "FragmentationEvent",
    "LeakEvent",
    "OomEvent",
    "PlateauBreakEvent",
    "PlateauEvent",
    "RestartEvent",
    "SpikeEvent",
    "SuspectedOomEvent",
    "spike_kind",
]
