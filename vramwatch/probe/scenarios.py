"""Simulated devices and scenarios: the parameter tables behind :mod:`vramwatch.probe.simulated`.

Pure data and two small functions: device capacities as ``nvidia-smi`` prints them, the
default allocator model (KoHRM-Text notes: 8 x H200) and the named scenarios, each a set
of overrides of :data:`DEFAULTS`.
"""

from __future__ import annotations

from typing import Any

#: ``memory.total`` as ``nvidia-smi`` prints it (MiB) for each simulated device. A simulated
#: card's capacity is that figure x 2^20, so its numbers agree with nvidia-smi's (and the
#: dashboard's GiB): reading the MiB figure as MB made the H200 133.9 GiB instead of 140.4.
NVIDIA_SMI_MIB: dict[str, int] = {
    "H200": 143_771,
    "H100 80GB HBM3": 81_559,
    "A100-SXM4-80GB": 81_920,
    "A100-SXM4-40GB": 40_960,
    "GeForce RTX 3090": 24_576,
    "GeForce RTX 4090": 24_564,
}


def device_total_bytes(device: str) -> int:
    """Capacity in bytes of a simulated ``device`` (a key of :data:`NVIDIA_SMI_MIB`)."""
    try:
        return NVIDIA_SMI_MIB[device] * 2**20
    except KeyError:
        raise ValueError(f"device: unknown simulated device {device!r}; known: {', '.join(NVIDIA_SMI_MIB)}") from None


def device_name(total_bytes: int) -> str:
    """``"Simulated <device>"`` for a capacity in the table, else ``"Simulated GPU"``."""
    for device, mib in NVIDIA_SMI_MIB.items():
        if mib * 2**20 == total_bytes:
            return f"Simulated {device}"
    return "Simulated GPU"


H200_TOTAL_BYTES = device_total_bytes("H200")  # 150,754,820,096 B = 140.4 GiB
_SEGMENT = 2 * 1024 * 1024  # the caching allocator maps memory in 2 MiB multiples

#: Parameters every scenario starts from (fractions of total_bytes unless named otherwise).
DEFAULTS: dict[str, Any] = {
    "base_frac": 0.34,  # weights + grads + optimizer state at the step boundary
    "warm_frac": 0.04,  # floor growth during warm-up (compiled graphs, CUDA-graph pools)
    "warm_tau": 150.0,  # warm-up time constant, steps (concave: settles after ~5 tau)
    "warm_jumps": 4,  # discrete one-time jumps during warm-up (new shapes), ever rarer
    "act_frac": 0.49,  # activation peak above the floor at the longest sequence
    "seq_min": 0.55,  # shortest batch relative to the longest (variable-length noise)
    "seq_skew": 3.0,  # >1: long batches are rare, so reserved grows in ever rarer jumps
    "floor_noise_frac": 0.00008,  # jitter of allocated at the step boundary
    "ctx_frac": 0.0146,  # CUDA context + NCCL + workspaces: NVML used - reserved
    "rank0_extra_frac": 0.016,  # rank 0 keeps logging/metadata/checkpoint coordination state
    "split_frac": 0.004,  # inactive split bytes of a healthy cache
    "step_time_s": 1.0,
    "step_time_jitter": 0.02,  # relative
    "stall_prob": 0.0,  # probability of a slow step (irregular step times)
    "stall_factor": 8.0,
    "ckpt_every": 0,  # steps between checkpoint phases (0: none)
    "ckpt_above_frac": 0.03,  # checkpoint peak above the largest training peak
    "ckpt_time_s": 20.0,
    "eval_every": 0,  # steps between eval phases (0: none)
    "eval_act_frac": 0.42,  # eval activations (no grads, bigger batch) above the floor
    "eval_time_s": 15.0,
    "step_at": None,  # one-time late step (new plateau) at this step
    "step_frac": 0.03,
    "leak_onset": None,  # allocator leak (allocated floor rises linearly) from this step
    "leak_rate_frac": 0.0,  # per step
    "outside_onset": None,  # leak outside the allocator (NVML rises, torch flat)
    "outside_rate_frac": 0.0,  # per step
    "frag_onset": None,  # fragmentation: cached-but-unusable bytes grow
    "frag_rate_frac": 0.0,  # per step
    "saw_period": 0,  # sawtooth: a cache fills over this many steps, then is cleared
    "saw_frac": 0.0,  # its size when full
    "periodic_every": 0,  # unmarked periodic spike in the per-step peak (no phase marker)
    "periodic_frac": 0.0,
    "leak_rank": None,  # multi-rank scenarios: only this rank runs the leak effects
    "crash_at": None,  # trace: the process dies at this step ...
    "resume_from": None,  # ... and a new incarnation resumes from this step
    "restart_delay_s": 180.0,
    "drop_prob": 0.0,  # trace: fraction of samples lost
    "gap_at": None,  # trace: a run of samples lost (collector down, spool lost)
    "gap_len": 0,
    "sample_every": 1,  # trace: the hook emits every N-th step
    "stop_on_oom": True,  # trace: the process dies at its first OOM
    "world_size": 1,
    # token-dependent activations (vramwatch.simulation.tokens): off while tokens_per_step is 0
    "tokens_per_step": 0,  # >0: train samples carry `tokens` = round(tokens_per_step * seq)
    "tokens_ref": 0,  # tokens at which the activation is act_frac (0: tokens_per_step)
    "act_fixed_frac": 0.0,  # transient part that does not scale with tokens (workspaces, buckets)
    "act_jitter_frac": 0.0,  # batch composition: up to this share more activation at the same tokens
    "act_quad_frac": 0.0,  # superlinear part (attention without flash): act_quad * (tokens/tokens_ref)**2
    # a shape-dependent buffer (a kernel workspace, a graph compiled for larger shapes) the checkpoint
    # phase needs once the batch is above a size: what no run below that size can show
    "ckpt_cliff_tokens": None,  # the batch (tokens_per_step) above which the checkpoint needs more
    "ckpt_cliff_frac": 0.0,  # how much more
}

#: Named scenarios: description plus the parameters that differ from DEFAULTS.
SCENARIOS: dict[str, dict[str, Any]] = {
    "healthy": {"description": "warm-up, then a clean plateau", "params": {}},
    "long_warmup": {
        "description": "slow concave warm-up lasting thousands of steps, then a plateau",
        "params": {"warm_tau": 700.0, "warm_frac": 0.09, "base_frac": 0.30, "warm_jumps": 6},
    },
    "checkpoint": {
        "description": "checkpoint phases every N steps; the first one ratchets reserved once",
        "params": {"ckpt_every": 1000},
    },
    "eval": {
        "description": "eval phases every N steps, with their own (lower) peak",
        "params": {"eval_every": 700},
    },
    "late_step": {
        "description": "a one-time step late in the run (new compiled shape), then a new plateau",
        "params": {"step_at": 3000, "step_frac": 0.03},
    },
    "fast_leak": {
        "description": "allocated floor rises fast from an onset step (runway of a few thousand steps)",
        "params": {"leak_onset": 1500, "leak_rate_frac": 2.5e-5},
    },
    "slow_leak": {
        "description": "allocated floor rises slowly with lots of headroom (runway far beyond the trace)",
        "params": {"leak_onset": 1500, "leak_rate_frac": 2.0e-6, "act_frac": 0.30},
    },
    "noisy_leak": {
        "description": "a leak hidden under variable-length noise in the per-step peak",
        "params": {"leak_onset": 1500, "leak_rate_frac": 5e-6, "seq_min": 0.2, "act_frac": 0.40,
                   "floor_noise_frac": 0.0005},
    },
    "leak_to_oom": {
        "description": "an allocator leak that runs into OOM (ooms counter increments, the process dies)",
        "params": {"leak_onset": 1200, "leak_rate_frac": 4e-5, "ckpt_every": 1000},
    },
    "fragmentation": {
        "description": "reserved - allocated and inactive split grow, allocation retries climb, allocated flat",
        "params": {"frag_onset": 1500, "frag_rate_frac": 4e-5},
    },
    "outside_leak": {
        "description": "NVML used - reserved rises (driver/NCCL/GL leak) while torch stats stay flat",
        "params": {"outside_onset": 1500, "outside_rate_frac": 1.5e-5},
    },
    "sawtooth": {
        "description": "a cache that fills and is cleared periodically: not a leak",
        "params": {"saw_period": 400, "saw_frac": 0.05},
    },
    "periodic_spikes": {
        "description": "unmarked periodic spikes in the per-step peak (no phase marker)",
        "params": {"periodic_every": 250, "periodic_frac": 0.04, "act_frac": 0.40},
    },
    "crash_resume": {
        "description": "the process dies and a new incarnation resumes from the last checkpoint",
        "params": {"ckpt_every": 1000, "crash_at": 2600, "resume_from": 2000},
    },
    "dropped": {
        "description": "5 % of samples lost at random plus a long gap, irregular step times",
        "params": {"drop_prob": 0.05, "gap_at": 2000, "gap_len": 400, "stall_prob": 0.02,
                   "step_time_jitter": 0.3},
    },
    "multi_rank": {
        "description": "8 ranks, rank 0 ~2 GB higher, one bad rank (leak_rank) leaking",
        "params": {"world_size": 8, "leak_rank": 3, "leak_onset": 1500, "leak_rate_frac": 1.5e-5,
                   "ckpt_every": 1000},
    },
    "demo": {
        "description": "vramwatch demo: 8 ranks at ~10 steps/s, plateau near 127-130 GB, checkpoint "
        "spikes, rank 0 ~2 GB higher, rank 5 leaking from step 700 (runway ~2800 steps)",
        "params": {"world_size": 8, "warm_tau": 60.0, "act_frac": 0.46, "ckpt_every": 500, "ckpt_time_s": 1.0,
                   "step_time_s": 0.1, "leak_rank": 5, "leak_onset": 700, "leak_rate_frac": 4e-5},
    },
}

#: Effects that run only on ``leak_rank`` when a scenario names one.
_BAD_RANK_EFFECTS = ("leak_onset", "outside_onset", "frag_onset", "step_at")


def scenario_params(scenario: str, **overrides: Any) -> dict[str, Any]:
    """DEFAULTS, then the scenario's parameters, then ``overrides``; unknown names raise."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    params = dict(DEFAULTS)
    params.update(SCENARIOS[scenario]["params"])
    for name, value in overrides.items():
        if name not in DEFAULTS:
            raise ValueError(f"unknown simulator parameter {name!r}")
        params[name] = value
    return params


def _rank_params(params: dict[str, Any], rank: int) -> dict[str, Any]:
    bad = params.get("leak_rank")
    if bad is None or rank == bad:
        return params
    healthy = dict(params)
    for name in _BAD_RANK_EFFECTS:
        healthy[name] = None
    return healthy
