"""Labelled corpus for the trend engine: simulated traces with ground truth.

Each :class:`Case` is one scenario of :mod:`vramwatch.probe.simulated` at one *scale*: a
device size, a time factor (every step-valued parameter is multiplied by it, every
per-step rate divided by it, so the same story plays out over 0.5x .. 30x the steps), a
step time and a seed. Ground truth comes from the scenario's parameters
(:func:`scenario_truth`), plus the OOM step actually reached in the trace, if any.

Used by tests/test_engine*.py and bench/engine_bench.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vramwatch.engine import EngineConfig, TrendEngine
from vramwatch.probe.simulated import (
    H200_TOTAL_BYTES,
    device_total_bytes,
    scenario_params,
    scenario_truth,
    simulate_trace,
)

GB80 = device_total_bytes("A100-SXM4-80GB")  # 81920 MiB = 80 GiB
GB24 = device_total_bytes("GeForce RTX 3090")  # 24576 MiB = 24 GiB

#: Parameters measured in steps (scaled by the time factor) and in bytes per step (divided).
STEP_PARAMS = (
    "warm_tau", "ckpt_every", "eval_every", "step_at", "leak_onset", "outside_onset", "frag_onset",
    "saw_period", "periodic_every", "crash_at", "resume_from", "gap_at", "gap_len",
)
RATE_PARAMS = ("leak_rate_frac", "outside_rate_frac", "frag_rate_frac")


@dataclass(frozen=True)
class Scale:
    name: str
    total_bytes: int
    time_factor: float
    step_time_s: float
    seed: int
    warm_factor: float = 0.0  # warm-up time constant factor; 0: the time factor

    @property
    def warm(self) -> float:
        return self.warm_factor or self.time_factor


SCALES = {
    "h200": Scale("h200", H200_TOTAL_BYTES, 1.0, 1.0, 1),
    "a100-80gb": Scale("a100-80gb", GB80, 3.0, 0.4, 2),
    "rtx-24gb": Scale("rtx-24gb", GB24, 0.6, 2.5, 3),
    # a million-step run does not warm up for a hundred thousand steps: compile and the
    # allocator settle in hundreds to a few thousand steps whatever the run length, and a
    # cache cleared every N steps keeps its N
    "long": Scale("long", GB80, 30.0, 0.25, 4, warm_factor=3.0),
}

#: Steps per scenario at time factor 1 (long enough for the story to finish).
STEPS = {
    "healthy": 4000,
    "long_warmup": 9000,
    "checkpoint": 5000,
    "eval": 4000,
    "late_step": 5000,
    "fast_leak": 7000,
    "slow_leak": 6000,
    "noisy_leak": 6000,
    "leak_to_oom": 6000,
    "fragmentation": 6000,
    "outside_leak": 6000,
    "sawtooth": 6000,
    "periodic_spikes": 4000,
    "crash_resume": 5000,
    "dropped": 5000,
    "multi_rank": 5000,
}

LEAK_SCENARIOS = ("fast_leak", "slow_leak", "noisy_leak", "leak_to_oom", "outside_leak", "multi_rank")

#: Sparse variants: what other tools record. ``allocated_only``: Megatron-LM's
#: ``mem-allocated-bytes`` scalar (fields absent); ``device_used_only``: dcgm-exporter's
#: ``DCGM_FI_DEV_FB_USED`` / nvidia-smi ``memory.used`` (fields null, no phase marks).
VARIANTS = ("full", "allocated_only", "device_used_only")
_MEASUREMENTS = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "inactive_split_bytes",
                 "alloc_retries", "ooms", "nvml_used_bytes", "process_used_bytes", "active_bytes")
_KEEP = {"allocated_only": ("allocated_bytes",), "device_used_only": ("nvml_used_bytes",)}


def thin(sample: dict[str, Any], variant: str) -> dict[str, Any] | None:
    """One sample as a tool that measures less would have recorded it (None: not recorded at
    all). Nothing is invented: what is not measured is absent or null."""
    if variant == "full":
        return sample
    drop = [f for f in _MEASUREMENTS if f not in _KEEP[variant]]
    if variant == "device_used_only":
        if sample["phase"] != "train":
            return None  # dcgm and nvidia-smi know nothing of phases
        out = dict(sample, schema=2)  # wire schema 2: measurements may be null
        out.update(dict.fromkeys(drop))  # null: not measured
        return out
    out = {k: v for k, v in sample.items() if k not in drop}  # absent: not measured
    out["schema"] = 2
    return out


def sparse(samples: Iterator[dict[str, Any]], variant: str) -> Iterator[dict[str, Any]]:
    for sample in samples:
        out = thin(sample, variant)
        if out is not None:
            yield out


@dataclass
class Case:
    scenario: str
    scale: Scale
    steps: int
    params: dict[str, Any]
    ranks: tuple[int, ...]
    truth: dict[int, dict[str, Any]] = field(default_factory=dict)
    variant: str = "full"

    @property
    def name(self) -> str:
        suffix = "" if self.variant == "full" else f"/{self.variant}"
        return f"{self.scenario}@{self.scale.name}{suffix}"

    def trace(self, rank: int) -> Iterator[dict[str, Any]]:
        return sparse(self._full_trace(rank), self.variant)

    def _full_trace(self, rank: int) -> Iterator[dict[str, Any]]:
        return simulate_trace(
            self.scenario,
            steps=self.steps,
            run=self.name,
            rank=rank,
            seed=self.scale.seed,
            step_time_s=self.scale.step_time_s,
            total_bytes=self.scale.total_bytes,
            **self.params,
        )


def scaled_params(scenario: str, factor: float, warm_factor: float | None = None) -> dict[str, Any]:
    base = scenario_params(scenario)
    out: dict[str, Any] = {}
    for name in STEP_PARAMS:
        value = base[name]
        scale = warm_factor if name in ("warm_tau", "saw_period") and warm_factor else factor
        if value:
            out[name] = type(value)(round(value * scale)) if isinstance(value, int) else value * scale
    for name in RATE_PARAMS:
        if base[name]:
            out[name] = base[name] / factor
    return out


def make_case(
    scenario: str, scale: Scale | str, ranks: tuple[int, ...] | None = None, variant: str = "full"
) -> Case:
    scale = SCALES[scale] if isinstance(scale, str) else scale
    params = scaled_params(scenario, scale.time_factor, scale.warm)
    if ranks is None:
        ranks = (0, 1, scenario_params(scenario)["leak_rank"]) if scenario == "multi_rank" else (1,)
    case = Case(scenario, scale, int(STEPS[scenario] * scale.time_factor), params, ranks, variant=variant)
    for rank in ranks:
        case.truth[rank] = scenario_truth(scenario, rank=rank, total_bytes=scale.total_bytes, **params)
    return case


def corpus(scales: tuple[str, ...] = ("h200", "a100-80gb", "rtx-24gb")) -> list[Case]:
    return [make_case(scenario, scale) for scale in scales for scenario in STEPS]


@dataclass
class RankResult:
    rank: int
    events: list[dict[str, Any]]
    summary: dict[str, Any]
    samples: list[dict[str, Any]] | None
    oom_step: int | None  # first step whose sample counted an OOM
    last_step: int

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def first(self, kind: str) -> dict[str, Any] | None:
        found = self.of(kind)
        return found[0] if found else None


def run_rank(case: Case, rank: int, keep_samples: bool = False, config: EngineConfig | None = None) -> RankResult:
    engine = TrendEngine(config)
    events: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] | None = [] if keep_samples else None
    oom_step = None
    last_step = 0
    for full in case._full_trace(rank):
        if oom_step is None and full["ooms"] > 0:
            oom_step = full["step"]  # the truth, whatever the variant measures
        sample = thin(full, case.variant)
        if sample is not None:
            if kept is not None:
                kept.append(sample)
            events.extend(engine.update(sample))
        last_step = full["step"]
    truth = case.truth[rank]
    if truth["leak"] is not None and oom_step is not None:
        truth["leak"]["oom_step"] = oom_step  # what actually happened beats the projection
        truth["oom"] = True
    return RankResult(rank, events, engine.summary(), kept, oom_step, last_step)


def runway_left(detect_step: int, onset: int, oom_step: int) -> float:
    """Share of the runway (onset -> OOM) still ahead at detection."""
    if oom_step <= onset:
        return 0.0
    return max(0.0, min(1.0, (oom_step - detect_step) / (oom_step - onset)))
