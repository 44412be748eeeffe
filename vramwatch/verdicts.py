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
from typing import Any

#: Engine states, safest first. Severity is the index.
STATES: tuple[str, ...] = ("plateau", "warmup", "rising", "fragmentation", "leak")
SEVERITY: dict[str, int] = {state: i for i, state in enumerate(STATES)}

#: Liveness of a rank's hook: sending, gone quiet while its run goes on, or closed cleanly.
LIVENESS: tuple[str, ...] = ("live", "exited", "silent")

#: Run status for the runs list.
RUN_STATUSES: tuple[str, ...] = ("running", "finished", "crashed")

#: One "low headroom" threshold everywhere (table, cards, alert, advice margin default):
#: a fraction of the device's capacity.
LOW_HEADROOM_FRACTION = 0.05

#: Extra severity added on top of the state's, so a dead or OOM'd rank sorts worst.
_SILENT_BONUS = len(STATES) + 1
_OOM_BONUS = len(STATES)


def severity(state: str | None, liveness: str = "live", ooms: int = 0) -> int:
    """Sort key, higher is worse: a silent rank or one that hit an OOM outranks any state."""
    base = SEVERITY.get(state or "", -1)
    if liveness == "silent":
        return base + _SILENT_BONUS + _OOM_BONUS
    if ooms:
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


def is_low_headroom(headroom: int | None, total: int | None) -> bool:
    """The single low-headroom rule: under :data:`LOW_HEADROOM_FRACTION` of the device."""
    return headroom is not None and bool(total) and headroom < LOW_HEADROOM_FRACTION * total


def meta() -> dict[str, object]:
    """The vocabulary as served by ``GET /api/v1/meta`` (the dashboard reads it, never retypes it)."""
    return {
        "states": list(STATES),
        "severity": dict(SEVERITY),
        "liveness": list(LIVENESS),
        "run_statuses": list(RUN_STATUSES),
        "low_headroom_fraction": LOW_HEADROOM_FRACTION,
        "silent_after_s": SILENT_AFTER_S,
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
# tests/test_dashboard_api.py checks that both agree).

#: a rank is silent once nothing arrived from it for this long ...
SILENT_AFTER_S = 300.0
#: ... while another rank of its run sent something within this long
RUN_ACTIVE_S = 120.0


def liveness(now: float, last_seen: float, run_last_seen: float, exited: bool = False) -> str:
    """``exited`` (the hook closed cleanly), ``silent`` (the hook-silent alert's rule) or ``live``."""
    if exited:
        return "exited"
    if now - last_seen > SILENT_AFTER_S and now - run_last_seen < RUN_ACTIVE_S:
        return "silent"
    return "live"


def run_status(now: float, run_last_seen: float, *, all_exited: bool, died: bool) -> str:
    """``running`` while any rank reports (and not all closed cleanly); once quiet for
    :data:`SILENT_AFTER_S` (or all exited), ``crashed`` if a rank died (OOM at the end, or went
    silent or quiet before the others), else ``finished``."""
    if not all_exited and now - run_last_seen <= SILENT_AFTER_S:
        return "running"
    return "crashed" if died else "finished"
