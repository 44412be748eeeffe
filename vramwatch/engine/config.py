"""EngineConfig: the engine's knobs; every size is relative to the device or the noise."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Knobs of the engine; every size threshold is relative to the device or the noise."""

    block_steps: int = 32  # level-0 block length in steps
    ring_blocks: int = 48  # blocks kept per level
    levels: int = 8  # level k blocks are block_steps * 4**k steps (32 .. 524288)
    fit_points: int = 16  # estimators see at most this many (grouped) points
    min_blocks: int = 8  # fewest points a verdict rests on
    tol_frac: float = 0.001  # smallest material change: this fraction of the device ...
    noise_k: float = 4.0  # ... or this many noise sigmas of the block floor, whichever is larger
    reserved_break_frac: float = 0.01  # a reserved ratchet this large is a plateau break
    mk_z: float = 2.6  # Mann-Kendall significance for a trend
    half_ratio: float = 0.5  # slopes of the two halves must agree within this ratio (linearity)
    warmup_half_ratio: float = 0.8  # stricter while the series never settled (thirds, not halves)
    warmup_span_frac: float = 0.4  # a plateau must be flat over this fraction of the process age
    warmup_leak_horizons: float = 2.0  # a rise from a warm-up is a leak only past this many warm-up horizons
    young_fill_ratio: float = 0.5  # a young process's steady rise, seen for this share of its time to fill: a leak
    warmup_horizon_s: float = 3600.0  # the longest plausible warm-up, wall seconds (compile, autotune, caches)
    stair_steps: int = 4  # a ratcheting level's staircase: at least this many steps ...
    stair_spread: float = 5.0  # ... the longest gap between them at most this many times the shortest ...
    stair_toggle_ratio: float = 1.5  # a rise and a fall within this ratio of each other: a level that came back
    stair_z: float = 3.0  # ... each step this many noise deviations above the point-to-point jitter
    vanish_frac: float = 0.5  # device used falling below this share of its level: the process is gone ...
    near_full_frac: float = 0.9  # ... with the device this full before (or at the top of a climb): a suspected OOM
    spike_margin_frac: float = 0.015  # an unmarked spike is this far above the training peak
    max_events: int = 256  # events kept (most recent)
