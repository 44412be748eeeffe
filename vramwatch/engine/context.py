"""What every detector of one series reads: the pyramid, sizes, the plateau, the latest sample.

One :class:`Context` per process (reset on restart). Detectors keep their own state in
their own dataclasses and read this; only the engine and the plateau detector write it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch import verdicts
from vramwatch.engine.blocks import Block, Pyramid
from vramwatch.engine.config import EngineConfig

#: The judged level per signal: the sample field whose floor the engine trends.
SIGNAL_FIELDS: dict[str, str] = {
    "allocated": "allocated_bytes",
    "reserved": "reserved_bytes",
    "device_used": "nvml_used_bytes",
}


def choose_signal(sample: dict[str, Any]) -> str:
    """The lowest-level memory signal the sample measures: allocated, else reserved, else
    device used (what dcgm-exporter and nvidia-smi see). Fixed per process: switching signals
    mid-series would be a fake jump."""
    for signal, field in SIGNAL_FIELDS.items():
        if sample.get(field) is not None:
            return signal
    return "device_used"


@dataclass(slots=True)
class PlateauLevels:
    """The levels of the current (or last) plateau, each None when not measured."""

    floor: float  # floor of the judged signal
    reserved: float | None
    peak: float | None  # the typical training peak: median of block peaks
    outside: float | None  # device used - reserved
    slack: float | None  # reserved - allocated
    since_step: int  # first step of the flat window the plateau was judged on
    until_step: int | None = None  # where it ended (a leak's onset); None while it holds

    def level_bytes(self) -> int:
        """What the summary and every event call ``plateau_bytes``: the reserved level, or
        the judged floor when reserved is not measured."""
        return int(self.reserved if self.reserved is not None else self.floor)


@dataclass(slots=True)
class Cusum:
    """One-sided CUSUM (Page 1954): drift allowance tol/2, alarm at 2 tol (the classic choice
    for a shift of tol; a smaller allowance breaks on noisy plateaus). ``onset`` is the step
    after the last block where the sum was zero: the change point estimate."""

    value: float = 0.0
    onset: int = 0

    def step(self, excess: float, tol: float, block: Block) -> bool:
        value = self.value + excess - 0.5 * tol
        if value <= 0:
            self.value = 0.0
            self.onset = block.end + 1
            return False
        self.value = value
        return value > 2 * tol

    def reset(self, onset: int) -> None:
        self.value = 0.0
        self.onset = onset


@dataclass(slots=True)
class Context:
    """Shared, read-mostly state of one process's series."""

    config: EngineConfig
    pyramid: Pyramid
    signal: str
    total: int = 0
    tol: float = 0.0  # material size: max(tol_frac of the device, noise_k sigma of the floor)
    last: dict[str, Any] | None = None  # latest folded train sample
    plateau: PlateauLevels | None = None
    first_plateau_age: int | None = None
    phase_reach: float | None = None  # how far a marked phase last reached above the floor (max)
    start_ts: float = 0.0  # wall time of the process's first sample
    horizon_step: int | None = None  # the first block end past the warm-up horizon (wall time); None before

    def wall_age(self, block: Block) -> float:
        """Wall seconds from the process's first sample to the end of ``block``."""
        return block.ts - self.start_ts

    def note_horizon(self, block: Block) -> None:
        """Remember where the process passed the warm-up horizon (once; O(1) per block)."""
        if self.horizon_step is None and self.wall_age(block) >= self.config.warmup_horizon_s:
            self.horizon_step = block.end

    def past_horizon(self, block: Block, multiple: float) -> bool:
        """The process has run ``multiple`` warm-up horizons of wall time: whatever it does now
        is no warm-up (compile, autotune and the allocator's working set settle within one)."""
        return self.horizon_step is not None and self.wall_age(block) >= multiple * self.config.warmup_horizon_s

    @property
    def base_tol(self) -> float:
        """The smallest material change before noise is known: 0.1 % of the device, or for a
        ratcheting level (reserved, device used) the 1 % a caching allocator's normal ratchets
        reach (the allocator meeting a longer batch than before is not growth)."""
        cfg = self.config
        frac = cfg.reserved_break_frac if self.pyramid.ratchet_floor else cfg.tol_frac
        return frac * self.total

    @property
    def leak_shape(self) -> tuple[float, int]:
        """(ratio, parts) of the leak test's linearity check on the floor. A ratcheting level
        warms up as a record-breaking process, ratchets ever rarer, which over a short window
        can look as straight as a leak's halves; three parts that must agree tell the
        deceleration apart (device-used corpus, two seeds: false alarms 13 -> 3 of 112)."""
        cfg = self.config
        if self.pyramid.ratchet_floor:
            return cfg.half_ratio, 3
        return cfg.half_ratio, 2

    @property
    def reserved_tol(self) -> float:
        """A reserved ratchet this large is a plateau break (1 % of the device)."""
        return self.config.reserved_break_frac * self.total

    def min_span(self) -> float:
        """Shortest window a leak verdict may rest on: 8 blocks, 1.5 sawtooth periods, and
        40 % of the age at which the first plateau was reached."""
        cfg = self.config
        span = max(cfg.min_blocks * cfg.block_steps, 1.5 * self.pyramid.saw_period)
        if self.first_plateau_age:
            span = max(span, cfg.warmup_span_frac * self.first_plateau_age)
        return span

    def outside_now(self) -> int:
        """Device used - reserved at the latest train sample (0 when either is unmeasured)."""
        last = self.last
        if last is None:
            return 0
        return verdicts.outside_allocator_bytes(last.get("reserved_bytes"), last.get("nvml_used_bytes")) or 0

    def training_peak(self) -> float | None:
        """The typical training peak: the plateau's, else the recent blocks' highest."""
        if self.plateau is not None and self.plateau.peak is not None:
            return self.plateau.peak
        return self.pyramid.recent_peak()

    def plateau_bytes(self) -> int | None:
        return None if self.plateau is None else self.plateau.level_bytes()
