"""``TrendEngine.summary()``: the typed record /metrics, the API, the report and analyze show."""

from __future__ import annotations

from typing import TypedDict


class Summary(TypedDict):
    """One series' verdict now. Byte counts are ints, None when unknown or not measured.

    Headroom uses one formula (``verdicts.headroom_bytes``) at two moments:
    ``headroom_bytes`` at the latest training step boundary, ``checkpoint_headroom_bytes`` at
    the latest checkpoint's peak; ``worst_headroom_bytes`` is the lower of the two.
    """

    state: str  # one of verdicts.STATES
    step: int | None  # latest train step
    ts: float | None
    signal: str  # the judged level: allocated | reserved | device_used
    detectors_off: dict[str, str]  # detector -> what it needs that the samples do not measure
    plateau_bytes: int | None  # reserved level of the current or last plateau (the judged level without reserved)
    plateau_since_step: int | None  # first step of the flat window that plateau was judged on
    plateau_until_step: int | None  # where it ended (a leak's onset); None while it holds
    plateau_breaks: int  # every break, re-levels included
    plateau_relevels: int  # breaks a marked phase caused, absorbed at once
    plateau_break_cause: str | None  # cause of the latest break
    headroom_bytes: int | None
    checkpoint_headroom_bytes: int | None
    worst_headroom_bytes: int | None
    checkpoint_peak_bytes: int | None  # latest checkpoint's peak
    checkpoint_peak_max_bytes: int | None  # highest checkpoint peak
    checkpoints: int  # checkpoint phases seen, every process of the series
    slope_bytes_per_step: float | None  # these eight only while leaking
    steps_to_oom: int | None
    seconds_to_oom: float | None
    seconds_to_oom_low: float | None  # the forecast's range (None when not estimated)
    seconds_to_oom_high: float | None
    leak_source: str | None  # allocator | outside_allocator | device
    leak_onset_step: int | None
    leak_detected_step: int | None
    fragmentation: bool
    outside_allocator_bytes: int | None  # verdicts.outside_allocator_bytes at the latest step
    total_bytes: int | None
    samples: int


#: The runway figures: a leak's forecast, None where there is no live leak to forecast
RUNWAY_KEYS: tuple[str, ...] = ("steps_to_oom", "seconds_to_oom", "seconds_to_oom_low", "seconds_to_oom_high")

#: Detector -> the sample fields it needs (all must be measured).
DETECTOR_NEEDS: dict[str, tuple[str, ...]] = {
    "fragmentation": ("allocated_bytes", "reserved_bytes", "inactive_split_bytes"),
    "outside_allocator_leak": ("reserved_bytes", "nvml_used_bytes"),
    "reserved_break": ("reserved_bytes",),
    "periodic_spikes": ("peak_allocated_bytes",),
    "oom": ("ooms",),
}


def detectors_off(sample: dict[str, object] | None) -> dict[str, str]:
    """Which detectors the latest sample's measurements leave off, and why (never guessed)."""
    if sample is None:
        return {}
    off = {}
    for name, needs in DETECTOR_NEEDS.items():
        if any(sample.get(f) is None for f in needs):
            off[name] = "needs " + " and ".join(needs)
    return off
