"""Scenario-driven simulator of the CUDA caching allocator, for the demo, tests and benchmarks.

One :class:`_RankModel` holds the memory state of one training process on one GPU and
advances it step by step the way a real run behaves:

- a **floor** (``allocated`` at the step boundary: weights, gradients, optimizer state) that
  grows concavely during warm-up (compiled graphs, CUDA-graph pools, in ever rarer jumps);
- a per-step **activation peak** above the floor that varies with sequence length;
- **reserved** that only grows when a demand does not fit the cache (a ratchet), is capped
  by the device, and is released only on the OOM-retry path (``alloc_retries``);
- memory **outside the allocator** (CUDA context, NCCL, cuBLAS workspaces) seen by NVML;
- scenario effects on top: checkpoint and eval phases, a one-time late step, leaks inside
  or outside the allocator, fragmentation, a sawtooth cache, OOM.

Every size is a fraction of the device capacity, so one scenario means the same thing on
a 24, 80 or 140.4 GiB card (capacities: :data:`NVIDIA_SMI_MIB`). The defaults model the
KoHRM-Text notes: 8 x H200 (143771 MiB), ~89 % of the card used per GPU on the plateau
(the notes' "127.6GB / 143.8GB", nvidia-smi MiB / 1000), rank 0 ~1.6 % higher, checkpoint
spikes above the training peak.

:class:`SimulatedProbe` wraps one model behind the Probe contract (the hook calls
``read(step, phase)``); :func:`simulate_trace` drives one and writes full schema-1 samples,
with trace-level effects (phase samples, crash-and-resume, dropped samples, irregular step
times). :func:`scenario_truth` states the ground truth that tests and benchmarks score
against. Everything is deterministic given ``seed``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

from vramwatch.probe.base import BaseProbe
from vramwatch.probe.scenarios import (  # noqa: F401 - the tables, re-exported
    _SEGMENT,
    DEFAULTS,
    H200_TOTAL_BYTES,
    NVIDIA_SMI_MIB,
    SCENARIOS,
    _rank_params,
    device_name,
    device_total_bytes,
    scenario_params,
)


class _RankModel:
    """Memory state of one process on one GPU; advanced by :meth:`read`."""

    def __init__(self, params: dict[str, Any], total_bytes: int, rank: int, seed: int, start_step: int = 0) -> None:
        self.p = p = _rank_params(params, rank)
        self.start_step = start_step  # a resumed process warms up again from its first step
        self.total = total = int(total_bytes)
        self.rng = rng = random.Random(seed)
        self.base = (p["base_frac"] + (p["rank0_extra_frac"] if rank == 0 else 0.0)) * total
        self.warm = p["warm_frac"] * total
        self.warm_tau = max(1.0, float(p["warm_tau"]))
        # Warm-up arrives partly as a smooth approach, partly as discrete jumps (a new shape
        # compiled) at ever longer intervals: the classic staircase that settles.
        jumps = max(1, int(p["warm_jumps"]))
        # ever rarer (each gap about twice the last) and ever smaller jumps, the last one
        # around 4 time constants: the staircase of new shapes being compiled
        self.jumps = [
            (self.warm_tau * 4.0 * 2.0 ** (k + 1 - jumps) * (0.7 + 0.3 * rng.random()),
             self.warm * (jumps - k) / (jumps * (jumps + 1)))
            for k in range(jumps)
        ]
        self.act = p["act_frac"] * total
        # token mode: transient = act_fixed + act * tokens / tokens_ref (known truth for the advice bench)
        self.tokens_per_step = int(p["tokens_per_step"])
        self.tokens_ref = int(p["tokens_ref"]) or self.tokens_per_step
        self.act_fixed = p["act_fixed_frac"] * total
        self.tokens: int | None = None
        self.seq_min = p["seq_min"]
        self.seq_skew = p["seq_skew"]
        self.floor_noise = p["floor_noise_frac"] * total
        self.ctx = p["ctx_frac"] * total + rng.uniform(-0.0005, 0.0005) * total
        self.split = p["split_frac"] * total
        self.reserved = 0
        self.retries = 0
        self.ooms = 0
        self.allocated = 0
        self.peak_since_read = 0
        self.last_train_step: int | None = None
        self.oom_now = False

    # -- the deterministic parts, as functions of the step ------------------------------
    def floor(self, step: int) -> float:
        p = self.p
        age = step - self.start_step
        value = self.base + 0.5 * self.warm * (1.0 - math.exp(-age / self.warm_tau))
        for at, size in self.jumps:
            if age >= at:
                value += size
        if p["step_at"] is not None and step >= p["step_at"]:
            value += p["step_frac"] * self.total
        onset = p["leak_onset"]
        if onset is not None and step > onset:
            value += p["leak_rate_frac"] * self.total * (step - max(onset, self.start_step))
        if p["saw_period"]:
            value += p["saw_frac"] * self.total * ((step % p["saw_period"]) / p["saw_period"])
        return value

    def outside(self, step: int) -> float:
        p = self.p
        if p["outside_onset"] is not None and step > p["outside_onset"]:
            return p["outside_rate_frac"] * self.total * (step - p["outside_onset"])
        return 0.0

    def waste(self, step: int) -> float:
        """Cached bytes that cannot serve requests (split blocks): fragmentation."""
        p = self.p
        if p["frag_onset"] is not None and step > p["frag_onset"]:
            return self.split + p["frag_rate_frac"] * self.total * (step - p["frag_onset"])
        return self.split

    def cap(self, step: int) -> float:
        return self.total - self.ctx - self.outside(step)

    # -- one read -----------------------------------------------------------------------
    def _demand(self, need: float, step: int) -> bool:
        """Serve a peak demand of ``need`` bytes; grow, release or fail like the allocator."""
        waste = self.waste(step)
        want = need + waste
        cap = self.cap(step)
        if want > cap or self.reserved > cap:
            # cudaMalloc fails (or memory outside the allocator took the room): free every
            # cached non-split block and retry; splits release what they can.
            self.retries += 1
            want = need + waste * 0.5
            if want > cap:
                self.ooms += 1
                self.reserved = max(0, int(cap) // _SEGMENT * _SEGMENT)
                return False
            self.reserved = -(-int(want) // _SEGMENT) * _SEGMENT
        elif want > self.reserved:
            self.reserved = -(-int(want) // _SEGMENT) * _SEGMENT
        return True

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        p = self.p
        rng = self.rng
        floor = self.floor(step) + rng.gauss(0.0, self.floor_noise)
        floor = max(floor, 0.0)
        if phase == "train":
            seq = self.seq_min + (1.0 - self.seq_min) * rng.random() ** self.seq_skew
            need = floor + self.act * seq
            if self.tokens_per_step:
                self.tokens = max(1, round(self.tokens_per_step * seq))
                rel = self.tokens / self.tokens_ref
                act = self.act * rel * (1.0 + p["act_jitter_frac"] * rng.random())
                need = floor + self.act_fixed + act + p["act_quad_frac"] * self.total * rel * rel
            if p["periodic_every"] and step % p["periodic_every"] == 0 and step > 0:
                need = floor + self.act + p["periodic_frac"] * self.total  # above any batch
            self.last_train_step = step
        elif phase == "checkpoint":
            need = floor + self.act_fixed + self.act + p["ckpt_above_frac"] * self.total
            cliff = p["ckpt_cliff_tokens"]
            if cliff is not None and self.tokens_per_step > cliff:
                need += p["ckpt_cliff_frac"] * self.total
        else:  # eval, validation, any other named phase
            need = floor + p["eval_act_frac"] * self.total
        ok = self._demand(need, step)
        self.oom_now = not ok
        cap = self.cap(step)
        if not ok:
            need = min(need, cap)
            floor = min(floor, cap)
        allocated = int(min(floor, self.reserved))
        peak = int(min(max(need, allocated), self.reserved))
        reserved = self.reserved
        waste = self.waste(step)
        inactive = int(min(max(0.0, waste * (0.8 + 0.4 * rng.random())), reserved - allocated))
        active = min(reserved, allocated + int(rng.random() * 0.0003 * self.total))
        used = int(min(self.total, reserved + self.ctx + self.outside(step)))
        self.allocated = allocated
        out = {
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "peak_allocated_bytes": peak,
            "active_bytes": active,
            "inactive_split_bytes": inactive,
            "alloc_retries": self.retries,
            "ooms": self.ooms,
            "total_bytes": self.total,
            "nvml_used_bytes": used,
            "process_used_bytes": used,
        }
        if self.tokens_per_step and phase == "train":
            out["tokens"] = self.tokens
        return out


class SimulatedProbe(BaseProbe):
    """The Probe contract (docs/architecture.md) over a simulated allocator.

    ``scenario`` names an entry of :data:`SCENARIOS`; keyword ``params`` override its
    parameters (see :data:`DEFAULTS`). The model advances with the ``step`` the caller
    passes, so a hook that reads every step sees the scenario play out in step units.
    """

    name = "simulated"

    def __init__(
        self,
        scenario: str = "healthy",
        *,
        rank: int = 0,
        local_rank: int | None = None,
        total_bytes: int = H200_TOTAL_BYTES,
        seed: int | None = None,
        **params: Any,
    ) -> None:
        self.scenario = scenario
        self.params = scenario_params(scenario, **params)
        self.rank = rank
        self.local_rank = rank % 8 if local_rank is None else local_rank
        self.total_bytes = int(total_bytes)
        if self.total_bytes <= 0:
            raise ValueError("total_bytes must be positive")
        self.seed = _rank_seed(0 if seed is None else seed, rank)
        self._model = _RankModel(self.params, self.total_bytes, rank, self.seed)
        self._uuid = f"GPU-sim-{self.seed & 0xFFFFFFFF:08x}-{rank:04d}"
        self.closed = False

    def device_info(self) -> dict[str, Any]:
        return {
            "uuid": self._uuid,
            "gpu": self.local_rank,
            "total_bytes": self.total_bytes,
            "name": device_name(self.total_bytes),
            "allocator": "native",
        }

    def read(self, step: int, phase: str = "train") -> dict[str, Any]:
        return self._model.read(int(step), phase)

    def phases_at(self, step: int) -> list[str]:
        """Phases the scenario schedules after train step ``step`` (for drivers like the demo)."""
        return _phases_at(self.params, step)

    @property
    def tokens_per_step(self) -> int | None:
        """The batch a training step runs (tokens per step per rank; None outside token mode)."""
        return self._model.tokens_per_step or None

    @property
    def ooms(self) -> int:
        """OOMs this simulated process has run into (what the allocator's counter says)."""
        return self._model.ooms

    @property
    def step_time_s(self) -> float:
        """The scenario's nominal seconds per step (the demo paces itself with it)."""
        return float(self.params["step_time_s"])

    def close(self) -> None:
        self.closed = True


def _rank_seed(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + rank * 7_919 + 12_345) & 0x7FFFFFFF


def _phases_at(params: dict[str, Any], step: int) -> list[str]:
    phases = []
    if step > 0 and params["ckpt_every"] and step % params["ckpt_every"] == 0:
        phases.append("checkpoint")
    if step > 0 and params["eval_every"] and step % params["eval_every"] == 0:
        phases.append("eval")
    return phases


def simulate_trace(
    scenario: str,
    *,
    steps: int,
    run: str = "sim",
    host: str = "sim-host",
    rank: int = 0,
    start_ts: float = 1.7e9,
    step_time_s: float | None = None,
    seed: int = 0,
    total_bytes: int = H200_TOTAL_BYTES,
    **params: Any,
) -> Iterator[dict[str, Any]]:
    """Yield the schema-1 samples the hook would emit for one rank over ``steps`` steps.

    Train samples at every ``sample_every``-th step, each followed by that step's phase
    samples (checkpoint/eval) when scheduled; crash-and-resume starts a new incarnation
    whose steps go back; dropped samples are simply missing. ``step_time_s`` overrides the
    scenario's nominal step time (1 s; the demo's is 0.1 s) when given.
    """
    if step_time_s is not None:
        params["step_time_s"] = step_time_s
    p = scenario_params(scenario, **params)
    rank_seed = _rank_seed(seed, rank)
    rng = random.Random(rank_seed ^ 0x5EED)
    model = _RankModel(p, total_bytes, rank, rank_seed)
    world = int(p["world_size"])
    incarnation_no = 0
    pid = 10_000 + rank_seed % 50_000
    ts = float(start_ts)
    every = max(1, int(p["sample_every"]))
    nominal = float(p["step_time_s"])
    jitter = float(p["step_time_jitter"])
    identity, extra_identity = _trace_identity(run, host, rank, rank_seed, world)
    gap_at, gap_len = p["gap_at"], int(p["gap_len"])
    crash_at, resume_from = p["crash_at"], p["resume_from"]
    step = 0
    emitted_steps = 0
    while emitted_steps < steps:
        step += 1
        emitted_steps += 1
        dt = _step_dt(p, rng, nominal, jitter)
        ts += dt
        if step % every:
            model.read(step, "train")  # the process still runs the step
            if model.oom_now and p["stop_on_oom"]:
                return  # ... and dies there, unsampled
            continue
        stats = model.read(step, "train")
        dropped = (p["drop_prob"] and rng.random() < p["drop_prob"]) or (
            gap_at is not None and gap_at <= step < gap_at + gap_len and incarnation_no == 0
        )
        sample_base = {**identity, "step": step}
        if not dropped:
            yield _sample(sample_base, ts, "train", stats, extra_identity, pid, incarnation_no, dt)
        if model.oom_now and p["stop_on_oom"]:
            return
        for phase in _phases_at(p, step):
            duration = p["ckpt_time_s"] if phase == "checkpoint" else p["eval_time_s"]
            ts += duration
            stats = model.read(step, phase)
            if not (p["drop_prob"] and rng.random() < p["drop_prob"]):
                yield _sample(sample_base, ts, phase, stats, extra_identity, pid, incarnation_no, duration)
            if model.oom_now and p["stop_on_oom"]:
                return
        if crash_at is not None and step == crash_at and incarnation_no == 0:
            # The process dies; a new one resumes from the checkpoint with a fresh allocator.
            incarnation_no += 1
            pid += 1
            ts += p["restart_delay_s"]
            step = int(resume_from if resume_from is not None else 0)
            model = _RankModel(p, total_bytes, rank, rank_seed + 1, start_step=step)


def _trace_identity(run: str, host: str, rank: int, rank_seed: int,
                    world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the series key fields, the identity fields a hook adds) of one simulated rank."""
    identity = {"schema": 1, "run": run, "host": host, "rank": rank}
    extra = {"local_rank": rank % 8, "world_size": world, "uuid": f"GPU-sim-{rank_seed & 0xFFFFFFFF:08x}-{rank:04d}",
             "gpu": rank % 8, "allocator": "native"}
    return identity, extra


def _step_dt(p: dict[str, Any], rng: random.Random, nominal: float, jitter: float) -> float:
    """One step's wall time: jittered, sometimes stalled (irregular step times)."""
    dt = nominal * max(0.05, 1.0 + jitter * rng.gauss(0.0, 1.0))
    if p["stall_prob"] and rng.random() < p["stall_prob"]:
        dt *= p["stall_factor"]
    return dt


def _sample(
    base: dict[str, Any],
    ts: float,
    phase: str,
    stats: dict[str, Any],
    extra_identity: dict[str, Any],
    pid: int,
    incarnation_no: int,
    duration: float,
) -> dict[str, Any]:
    sample = dict(base)
    sample["ts"] = round(ts, 3)
    sample["phase"] = phase
    sample.update(stats)
    sample.update(extra_identity)
    sample["pid"] = pid
    sample["incarnation"] = f"{base['run']}-{base['rank']}-{incarnation_no}"
    sample["step_time_s"] = round(duration, 4)
    return sample


def scenario_truth(
    scenario: str, *, rank: int = 0, total_bytes: int = H200_TOTAL_BYTES, **params: Any
) -> dict[str, Any]:
    """Ground truth for one rank of a scenario, from its parameters (not from the samples).

    ``leak``: None or {"onset", "slope_bytes_per_step", "source", "oom_step"} where
    ``oom_step`` is the step at which the largest training peak no longer fits the device
    (projected analytically, so slow leaks that never reach it within the trace have one).
    ``plateau_break``: the step of a sustained rise after a plateau (late step, leak onset),
    or None. ``fragmentation``: the onset step or None.
    """
    p = _rank_params(scenario_params(scenario, **params), rank)
    total = float(total_bytes)
    base = (p["base_frac"] + (p["rank0_extra_frac"] if rank == 0 else 0.0)) * total
    plateau_floor = base + p["warm_frac"] * total  # warm-up settled
    if p["saw_period"]:
        plateau_floor += p["saw_frac"] * total
    peak_high = plateau_floor + p["act_frac"] * total
    cap = total - p["ctx_frac"] * total
    truth: dict[str, Any] = {"leak": None, "plateau_break": None, "fragmentation": None, "oom": False}
    if p["step_at"] is not None:
        truth["plateau_break"] = p["step_at"]
        peak_high += p["step_frac"] * total
    if p["leak_onset"] is not None and p["leak_rate_frac"] > 0:
        slope = p["leak_rate_frac"] * total
        onset = int(p["leak_onset"])
        truth["leak"] = {
            "onset": onset,
            "slope_bytes_per_step": slope,
            "source": "allocator",
            "oom_step": onset + int(max(0.0, cap - peak_high) / slope),
        }
        truth["plateau_break"] = truth["plateau_break"] or onset
    elif p["outside_onset"] is not None and p["outside_rate_frac"] > 0:
        slope = p["outside_rate_frac"] * total
        onset = int(p["outside_onset"])
        truth["leak"] = {
            "onset": onset,
            "slope_bytes_per_step": slope,
            "source": "outside_allocator",
            "oom_step": onset + int(max(0.0, cap - peak_high - p["split_frac"] * total) / slope),
        }
    if p["frag_onset"] is not None and p["frag_rate_frac"] > 0:
        truth["fragmentation"] = int(p["frag_onset"])
    return truth


def rank_model(
    scenario: str, *, rank: int = 0, seed: int = 0, total_bytes: int = H200_TOTAL_BYTES, **params: Any
) -> _RankModel:
    """The model ``simulate_trace`` drives for this rank and seed, unadvanced: its deterministic
    parts (``floor(step)``, ``act``, ``ctx``, ``waste(step)``, ...) are the ground truth that
    vramwatch.simulation.tokens scores against."""
    p = scenario_params(scenario, **params)
    return _RankModel(p, total_bytes, rank, _rank_seed(seed, rank))


def probe_from_env(**kwargs: Any) -> SimulatedProbe:
    """A probe configured by VRAMWATCH_SIM_SCENARIO / VRAMWATCH_SIM_SEED when set
    (read through :class:`vramwatch.config.Config`)."""
    from vramwatch.config import Config

    config = Config.from_env()
    scenario = config.sim_scenario or kwargs.pop("scenario", "healthy")
    kwargs.pop("scenario", None)
    if config.sim_seed is not None and "seed" not in kwargs:
        kwargs["seed"] = config.sim_seed
    return SimulatedProbe(scenario, **kwargs)


__all__ = ["DEFAULTS", "SCENARIOS", "SimulatedProbe", "scenario_params", "scenario_truth", "simulate_trace"]
