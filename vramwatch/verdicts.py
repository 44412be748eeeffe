"""The verdict vocabulary: states, liveness, severity and headroom, each defined once.

Every consumer (engine, collector, Prometheus families, report, dashboard through
``GET /api/v1/meta``) reads these names and formulas from here; none retypes them.
Pure functions on plain numbers: no I/O, no imports beyond the standard library.

Headroom
--------
One formula, :func:`headroom_bytes`: device capacity minus what the device must hold
at that moment, which is what the allocator holds (``max(reserved, peak, allocated)``,
whichever are measured) plus memory outside the allocator (CUDA context, NCCL,
cuBLAS workspaces, other processes: ``nvml_used - reserved`` when both are measured).
It is applied at two moments, named distinctly:

* ``headroom_bytes``: at the latest *training step boundary* (the step's peak and the
  device-used reading of that sample);
* ``phase_headroom_bytes`` (e.g. ``checkpoint_headroom_bytes``): at the peak of the latest
  phase of that kind (checkpoint, eval).

``worst_headroom_bytes`` is the minimum of the two. With NVML and a caching allocator
(reserved >= peak) the step-boundary value equals ``total - nvml_used``, what
``nvidia-smi`` shows as free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

#: Engine states, safest first. Severity is the index.
STATES: tuple[str, ...] = ("plateau", "warmup", "rising", "fragmentation", "leak")
SEVERITY: dict[str, int] = {state: i for i, state in enumerate(STATES)}

# ---------------------------------------------------------------- a run's life
# The names of vramwatch.runlife's model, with what each means and how bad it is; the model
# (vramwatch/runlife/) decides which applies, every view shows these names.


class Outcome(StrEnum):
    """How one process (an incarnation of a rank) ended."""

    RUNNING = "running"
    EXITED = "exited"
    OOM = "oom"
    KILLED = "killed"
    STOPPED = "stopped"
    ENDED = "ended"
    # from the process's last words (vramwatch.causes classifies them)
    CUDA_ERROR = "cuda_error"
    COLLECTIVE_TIMEOUT = "collective_timeout"
    CRASH = "crash"
    CHECKPOINT_FAILED = "checkpoint_failed"
    EXCEPTION = "exception"


OUTCOME_MEANING: dict[Outcome, str] = {
    Outcome.RUNNING: "still sending (or quiet for less than the silence window while its run goes on)",
    Outcome.EXITED: "closed its monitor cleanly (the hook's end marker)",
    Outcome.OOM: "died of a CUDA out-of-memory error: the OOM was its last word",
    Outcome.KILLED: "killed alone: it stopped sending while the other ranks went on for longer than the silence "
                    "window (SIGKILL, the host's OOM-killer, a lost node)",
    Outcome.STOPPED: "stopped with the job: it and the other ranks stopped together with no clean close (a hang "
                     "then a kill of the whole job, or a launcher restarting every rank)",
    Outcome.ENDED: "stopped; its source (an import, dcgm) marks neither a clean close nor an OOM, so how is unknown",
    Outcome.CUDA_ERROR: "died of a CUDA error (an illegal memory access, an ECC error, a device-side assert ...): its "
                        "last words",
    Outcome.COLLECTIVE_TIMEOUT: "died waiting in a collective (the NCCL watchdog's timeout): usually the victim of "
                                "another rank that failed first",
    Outcome.CRASH: "died of a fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE): the crash record its next process "
                   "or a vramwatch command found beside its spool",
    Outcome.CHECKPOINT_FAILED: "died of an exception inside a checkpoint phase (a full disk, a lost mount ...)",
    Outcome.EXCEPTION: "died of an uncaught exception (its type and message are its last words)",
}
#: outcomes that are a death (the process did not end on its own terms)
DEATHS: frozenset[Outcome] = frozenset({
    Outcome.OOM, Outcome.KILLED, Outcome.STOPPED, Outcome.CUDA_ERROR, Outcome.COLLECTIVE_TIMEOUT, Outcome.CRASH,
    Outcome.CHECKPOINT_FAILED, Outcome.EXCEPTION})
#: deaths a process brings on itself: one of these before others timed out in a collective makes
#: its rank the culprit, the timed-out ranks its victims (vramwatch.runlife)
OWN_FAILURES: frozenset[Outcome] = frozenset({
    Outcome.OOM, Outcome.CUDA_ERROR, Outcome.CRASH, Outcome.CHECKPOINT_FAILED, Outcome.EXCEPTION})


class Liveness(StrEnum):
    """A rank now: what its latest process's outcome makes of it."""

    LIVE = "live"
    SILENT = "silent"
    EXITED = "exited"
    DEAD = "dead"
    ENDED = "ended"


LIVENESS_MEANING: dict[Liveness, str] = {
    Liveness.LIVE: "its process is running",
    Liveness.SILENT: "its process sent nothing for the silence window while its run goes on: not judged yet",
    Liveness.EXITED: "its process closed cleanly",
    Liveness.DEAD: "its process died (out of memory, a CUDA error, a crash, an exception, a collective timeout, killed "
                   "alone, or stopped with the job); `died` says how and when, and its last words",
    Liveness.ENDED: "its process stopped and its source cannot tell how",
}
#: Liveness of a rank, in the order the API lists it.
LIVENESS: tuple[str, ...] = tuple(Liveness)


class RunStatus(StrEnum):
    """A run now, from its ranks' liveness and what happened to their processes."""

    RUNNING = "running"
    FINISHED = "finished"
    RECOVERED = "recovered"
    CRASHED = "crashed"
    ENDED = "ended"


RUN_STATUS_MEANING: dict[RunStatus, str] = {
    RunStatus.RUNNING: "a rank is live or silent (not judged yet)",
    RunStatus.FINISHED: "every rank closed cleanly; no OOM, no death",
    RunStatus.RECOVERED: "every rank closed cleanly, after an OOM or a death that a restart (or the training "
                         "loop) got over",
    RunStatus.CRASHED: "no rank is running and at least one rank's last process died",
    RunStatus.ENDED: "no rank is running; its source does not mark clean closes, so how it ended is unknown",
}
#: Run status -> how much attention it needs (higher is worse).
RUN_STATUS_SEVERITY: dict[RunStatus, int] = {
    RunStatus.FINISHED: 0, RunStatus.ENDED: 1, RunStatus.RUNNING: 1, RunStatus.RECOVERED: 2, RunStatus.CRASHED: 3,
}
#: Run status for the runs list.
RUN_STATUSES: tuple[str, ...] = tuple(RunStatus)

#: What part of a rank's life a figure covers. Figures shown side by side share a scope.
SCOPES: dict[str, str] = {
    "process": "the rank's current process (since its latest start)",
    "rank": "every process of the rank (across restarts)",
}
#: Scope of each figure of a ``/ranks`` row (its verdict and counts) and of compare.
FIGURE_SCOPES: dict[str, str] = {
    "state": "process", "headroom_bytes": "process", "plateau_bytes": "process", "slope_bytes_per_step": "process",
    "steps_to_oom": "process", "seconds_to_oom": "process", "seconds_to_oom_low": "process",
    "seconds_to_oom_high": "process", "outside_allocator_bytes": "process",
    "fragmentation": "process", "min_headroom_bytes": "process",
    # the checkpoint record is the rank's: its latest checkpoint, whichever process saved it
    "checkpoint_peak_bytes": "rank", "checkpoint_headroom_bytes": "rank", "checkpoint_peak_max_bytes": "rank",
    "worst_headroom_bytes": "rank", "plateau_breaks": "rank", "checkpoints": "rank",
    "ooms": "rank", "restarts": "rank", "deaths": "rank",
}

#: One "low headroom" threshold everywhere (table, cards, alert, advice margin default):
#: a fraction of the device's capacity.
LOW_HEADROOM_FRACTION = 0.05

#: Extra severity added on top of the state's, so a dead or OOM'd rank sorts worst.
_SILENT_BONUS = len(STATES) + 1
_OOM_BONUS = len(STATES)


def severity(state: str | None, liveness: str = "live", ooms: int = 0, suspected_ooms: int = 0) -> int:
    """Sort key, higher is worse: a dead or silent rank, then one that hit an OOM (or, seen from
    the device only, a suspected one), outranks any state."""
    base = SEVERITY.get(state or "", -1)
    if liveness in (Liveness.DEAD, Liveness.SILENT):
        return base + _SILENT_BONUS + _OOM_BONUS
    if ooms or suspected_ooms:
        return base + _OOM_BONUS
    return base


def worst_state(states: Iterable[str | None]) -> str | None:
    """The most severe known state of ``states`` (None when there is none)."""
    known = [s for s in states if s in SEVERITY]
    return max(known, key=SEVERITY.__getitem__) if known else None


def outside_allocator_bytes(reserved: int | None, nvml_used: int | None) -> int | None:
    """Device memory this GPU holds beyond the allocator's segments; None when unmeasured."""
    if reserved is None or nvml_used is None:
        return None
    return max(0, nvml_used - reserved)


def device_need_bytes(
    *,
    allocated: int | None = None,
    reserved: int | None = None,
    peak: int | None = None,
    nvml_used: int | None = None,
) -> int | None:
    """What the device must hold at this moment (see the module docstring); None if nothing measured."""
    held_values = [v for v in (reserved, peak, allocated) if v is not None]
    held = max(held_values) if held_values else None
    if nvml_used is None:
        return held
    if held is None:
        return nvml_used
    if reserved is None:
        return max(nvml_used, held)
    return held + max(0, nvml_used - reserved)


def headroom_bytes(
    total: int | None,
    *,
    allocated: int | None = None,
    reserved: int | None = None,
    peak: int | None = None,
    nvml_used: int | None = None,
) -> int | None:
    """Capacity minus :func:`device_need_bytes`; may be negative (over-subscribed). None if unknown."""
    if not total:
        return None
    need = device_need_bytes(allocated=allocated, reserved=reserved, peak=peak, nvml_used=nvml_used)
    return None if need is None else int(total - need)


def sample_headroom(sample: Mapping[str, Any], total: int | None = None) -> int | None:
    """:func:`headroom_bytes` of one wire sample, from its own measurements (``total`` overrides
    the sample's capacity, e.g. the last known one when the sample lacks it)."""
    return headroom_bytes(
        sample.get("total_bytes") if total is None else total,
        allocated=sample.get("allocated_bytes"),
        reserved=sample.get("reserved_bytes"),
        peak=sample.get("peak_allocated_bytes"),
        nvml_used=sample.get("nvml_used_bytes"),
    )


def is_low_headroom(headroom: float | None, total: float | None, fraction: float = LOW_HEADROOM_FRACTION) -> bool:
    """The single low-headroom rule: under ``fraction`` of the device (default
    :data:`LOW_HEADROOM_FRACTION`; the decisions pass the margin a user asked for). Unknown
    headroom or capacity is not low."""
    return headroom is not None and bool(total) and headroom < fraction * total  # type: ignore[operator]


def meta() -> dict[str, object]:
    """The vocabulary as served by ``GET /api/v1/meta`` (the dashboard reads it, never retypes it)."""
    return {
        "states": list(STATES),
        "severity": dict(SEVERITY),
        "liveness": list(LIVENESS),
        "liveness_meaning": {str(k): v for k, v in LIVENESS_MEANING.items()},
        "run_statuses": list(RUN_STATUSES),
        "run_status_meaning": {str(k): v for k, v in RUN_STATUS_MEANING.items()},
        "run_status_severity": {str(k): v for k, v in RUN_STATUS_SEVERITY.items()},
        "outcomes": {str(k): v for k, v in OUTCOME_MEANING.items()},
        "scopes": dict(SCOPES),
        "figure_scopes": dict(FIGURE_SCOPES),
        "low_headroom_fraction": LOW_HEADROOM_FRACTION,
        "silent_after_s": SILENT_AFTER_S,
        "silence": {"intervals": SILENT_INTERVALS, "floor_s": SILENT_FLOOR_S, "ceiling_s": SILENT_CEILING_S,
                    "phase_allowance": PHASE_ALLOWANCE},
        "run_active_s": RUN_ACTIVE_S,
        "headroom": {
            "headroom_bytes": "capacity minus what the device holds at the latest training step boundary "
            "(allocator's max(reserved, peak) plus memory outside the allocator)",
            "checkpoint_headroom_bytes": "the same formula at the peak of the latest checkpoint phase",
            "worst_headroom_bytes": "the lower of the two",
        },
    }


# ---------------------------------------------------------------- liveness and run status
# The same numbers as the VramwatchHookSilent alert (deploy/prometheus/rules/vramwatch.rules.yml;
# tests/dashboard/test_dashboard_api.py checks that both agree).

#: The silence window of a rank whose cadence is unknown (a single sample; a source without step
#: times): a rank is silent once nothing arrived from it for its window while its run goes on; a
#: rank whose peers went on longer than its window after its last sample was killed alone; a run
#: quiet for its slowest rank's window has stopped (vramwatch.runlife). A rank with a cadence
#: gets :func:`silence_window` of it.
SILENT_AFTER_S = 300.0
#: missed sample intervals before a rank reads silent
SILENT_INTERVALS = 10
#: no window is shorter (a delivery batch, a GC pause, a slow step are not a death) ...
SILENT_FLOOR_S = 30.0
#: ... nor longer than this (a 10-minute step is still judged within the half hour)
SILENT_CEILING_S = 1800.0
#: a rank that marked phases (checkpoint saves, evals) may stay quiet this many times its longest
PHASE_ALLOWANCE = 1.5


def silence_window(cadence_s: float | None, longest_phase_s: float | None = None, *, in_phase: bool = False
                   ) -> float:
    """How long a rank may send nothing before it reads silent: :data:`SILENT_INTERVALS` of its
    sample interval, at least :data:`SILENT_FLOOR_S`, at most :data:`SILENT_CEILING_S`, and never
    shorter than :data:`PHASE_ALLOWANCE` times its longest marked phase (capped the same). 1 step/s
    -> 30 s; 60 s/step -> 600 s; unknown cadence -> :data:`SILENT_AFTER_S`. ``in_phase``: its
    latest sample opened a phase (``phase_open``) that has not ended; with no phase of it measured
    yet (a first checkpoint), the ceiling: its length is unknown, and its silence is expected."""
    if cadence_s is None or not cadence_s > 0:
        window = SILENT_AFTER_S
    else:
        window = min(max(SILENT_INTERVALS * cadence_s, SILENT_FLOOR_S), SILENT_CEILING_S)
    if longest_phase_s is not None and longest_phase_s > 0:
        window = max(window, min(PHASE_ALLOWANCE * longest_phase_s, SILENT_CEILING_S))
    elif in_phase:
        window = max(window, SILENT_CEILING_S)
    return window
#: ... and "its run goes on" means another rank of it sent something within this long
RUN_ACTIVE_S = 120.0
