"""Runs with incidents, generated as the hook sends them (ranks interleaved by time, end markers,
checkpoint phases, restarts as new processes), each with the truth the incidents must tell.
Shared by tests/incidents (the model, the property over runs) and the collector/dashboard tests.

Every run: 80 GiB cards, one step a second, deterministic noise (seeded). The six stories:
a leak that runs out of memory in a checkpoint and restarts (still leaking); a job-wide stop with
memory to spare; fragmentation without retries that runs out of memory; a lone death while the
peers finish; a raise that runs out of memory; an input-length peak.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30
MiB = 2**20
TOTAL = 80 * GiB
T0 = 1_760_000_000.0


@dataclass
class Truth:
    name: str
    samples: list[dict[str, Any]]
    kinds: list[str]  # the incidents' kinds, in time order
    causes: list[str]
    lead_rank: list[int]
    ranks_affected: list[int]  # how many ranks each took down
    restarted: list[bool]
    open_kinds: list[str]  # open findings' kinds at the end
    next_actions: list[str]  # the next steps' actions that must be there (in this order)
    phase: list[str | None] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def last_ts(self) -> float:
        return max(s["ts"] for s in self.samples)


def sample(run: str, rank: int, step: int, ts: float, inc: str, floor: float, *, act: float = 6 * GiB,
           slack: float = 2 * GiB, split: float = 1 * GiB, retries: int = 0, ooms: int = 0, tokens: int | None = None,
           phase: str = "train", **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "schema": 1, "run": run, "host": f"node-{rank // 4}", "rank": rank, "step": step, "ts": round(ts, 3),
        "phase": phase, "incarnation": inc, "allocated_bytes": int(floor), "reserved_bytes": int(floor + slack),
        "peak_allocated_bytes": int(floor + act), "inactive_split_bytes": int(split), "alloc_retries": retries,
        "ooms": ooms, "nvml_used_bytes": int(floor + slack + 700 * MiB), "total_bytes": TOTAL,
        "host_available_bytes": 300 * GiB,
    }
    if tokens is not None:
        out["tokens"] = tokens
    out.update(kw)
    return out


def _ordered(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(samples, key=lambda s: (s["ts"], s["rank"], s["step"]))


def _noise(rng: random.Random) -> float:
    return rng.gauss(0, 8 * MiB)


def _exit(s: dict[str, Any]) -> dict[str, Any]:
    return {**s, "ts": s["ts"] + 0.4, "seq": 1, "exit": True}


def _oom(s: dict[str, Any], phase: str = "train") -> dict[str, Any]:
    return {**s, "ts": s["ts"] + 0.3, "phase": phase, "seq": 2, "ooms": 1, "oom_marked": True}


def leak_checkpoint_restart(run: str = "leak-ckpt", seed: int = 1, t0: float = T0) -> Truth:
    """8 ranks; rank 5 leaks 40 MiB/step from step 1,000 and runs out of memory in the step-1,600
    checkpoint; the others stop with it; all 8 restart from the step-1,200 checkpoint 60 s later;
    the run closes cleanly at step 1,900, rank 5 still leaking (from its restart on)."""
    rng = random.Random(seed)
    base, leak, ckpt = 40 * GiB, 40 * MiB, 18 * GiB
    out = []
    for r in range(8):
        for step in range(1601):
            grow = leak * max(0, step - 1000) if r == 5 else 0
            s = sample(run, r, step, t0 + step + r * 0.01, f"a{r}", base + grow + _noise(rng))
            out.append(s)
            if step and step % 400 == 0:
                phase = {**s, "ts": s["ts"] + 0.2, "phase": "checkpoint",
                         "peak_allocated_bytes": int(s["allocated_bytes"] + ckpt)}
                out.append(_oom(phase, "checkpoint") if (r == 5 and step == 1600) else phase)
        t1 = t0 + 1600 + 60
        last = None
        for step in range(1201, 1901):
            grow = leak * (step - 1201) if r == 5 else 0
            last = sample(run, r, step, t1 + (step - 1201) + r * 0.01, f"b{r}", base + grow + _noise(rng))
            out.append(last)
            if step % 400 == 0:
                out.append({**last, "ts": last["ts"] + 0.2, "phase": "checkpoint",
                            "peak_allocated_bytes": int(last["allocated_bytes"] + ckpt)})
        assert last is not None
        out.append(_exit(last))
    return Truth("a leak that runs out of memory in a checkpoint and restarts", _ordered(out), ["oom"], ["leak"],
                 [5], [8], [True], ["leak"], ["capture_snapshots", "fix_leak"], ["checkpoint"],
                 {"leak_since": 1000, "slope": leak, "restart_step": 1201})


def job_stop_with_room(run: str = "job-stop", seed: int = 2, t0: float = T0) -> Truth:
    """8 ranks at 20 GiB of 80 stop together at step 800, no clean close, no restart."""
    rng = random.Random(seed)
    out = [sample(run, r, step, t0 + step + r * 0.01 + (0.8 if step == 800 else 0), f"a{r}", 20 * GiB + _noise(rng))
           for r in range(8) for step in range(801)]
    return Truth("a job-wide stop with memory to spare", _ordered(out), ["job_stop"], ["not_memory"], [0], [8],
                 [False], [], ["hold"], [None])


def fragmentation_no_retries(run: str = "frag", seed: int = 3, t0: float = T0) -> Truth:
    """4 ranks; rank 2's reserved-but-unused memory grows 20 MiB/step in inactive split blocks from
    step 600 while its allocated floor holds and the allocator never retries; out of memory at step
    2,000, the job stops with it."""
    rng = random.Random(seed)
    out = []
    for r in range(4):
        for step in range(2001):
            grow = 20 * MiB * max(0, step - 600) if r == 2 else 0
            s = sample(run, r, step, t0 + step + r * 0.01, f"a{r}", 30 * GiB + _noise(rng), slack=2 * GiB + grow,
                       split=1 * GiB + grow)
            out.append(_oom(s) if (r == 2 and step == 2000) else s)
    return Truth("fragmentation without retries", _ordered(out), ["oom"], ["fragmentation"], [2], [4], [False],
                 [], ["set_allocator"], ["train"])


def lone_death(run: str = "lone", seed: int = 4, t0: float = T0) -> Truth:
    """4 ranks; rank 3 stops at step 300 (killed alone); the others run to step 1,000 and close cleanly."""
    rng = random.Random(seed)
    out = []
    for r in range(4):
        last_step = 300 if r == 3 else 1000
        rows = [sample(run, r, step, t0 + step + r * 0.01, f"a{r}", 30 * GiB + _noise(rng))
                for step in range(last_step + 1)]
        out.extend(rows)
        if r != 3:
            out.append(_exit(rows[-1]))
    return Truth("a lone death while the peers finish", _ordered(out), ["death"], ["not_memory"], [3], [1], [False],
                 [], ["hold"], [None])


def lone_death_then_clean_close(run: str = "lone-close", seed: int = 8, t0: float = T0) -> Truth:
    """4 ranks; rank 2 stops at step 900 without a clean close; the others close cleanly at step
    1,000, 100 s later (inside the silence window: the model calls it stopped, not killed)."""
    rng = random.Random(seed)
    out = []
    for r in range(4):
        last_step = 900 if r == 2 else 1000
        rows = [sample(run, r, step, t0 + step + r * 0.01, f"a{r}", 30 * GiB + _noise(rng))
                for step in range(last_step + 1)]
        out.extend(rows)
        if r != 2:
            out.append(_exit(rows[-1]))
    return Truth("a lone death while the peers close cleanly soon after", _ordered(out), ["death"], ["not_memory"],
                 [2], [1], [False], [], ["hold"], [None])


def raise_ooms(run: str = "raise", seed: int = 5, t0: float = T0) -> Truth:
    """4 ranks at 16,384 tokens per step run 1,000 steps and close; the job restarts at 24,576 and
    rank 1 runs out of memory at step 1,150; the others stop with it."""
    rng = random.Random(seed)
    out = []
    for r in range(4):
        rows = [sample(run, r, step, t0 + step + r * 0.01, f"a{r}", 30 * GiB + _noise(rng), act=16384 * 2 * MiB,
                       tokens=16384) for step in range(1000)]
        out.extend([*rows, _exit(rows[-1])])
        t1 = t0 + 1100
        for step in range(1000, 1151):
            s = sample(run, r, step, t1 + (step - 1000) + r * 0.01, f"b{r}", 30 * GiB + _noise(rng),
                       act=24576 * 2 * MiB, tokens=24576)
            out.append(_oom(s) if (r == 1 and step == 1150) else s)
    return Truth("a raise that runs out of memory", _ordered(out), ["oom"], ["raise"], [1], [4], [False], [],
                 ["resume"], ["train"], {"held_tokens": 16384})


def input_peak(run: str = "input-peak", seed: int = 6, t0: float = T0) -> Truth:
    """4 ranks with variable-length inputs (6,000-10,000 tokens a step); rank 0's step 700 carries
    20,000 tokens and runs out of memory; the others stop with it."""
    rng = random.Random(seed)
    out = []
    for r in range(4):
        for step in range(701):
            tokens = 20000 if (r == 0 and step == 700) else rng.randint(6000, 10000)
            s = sample(run, r, step, t0 + step + r * 0.01, f"a{r}", 30 * GiB + _noise(rng),
                       act=tokens * 2.5 * MiB, tokens=tokens)
            out.append(_oom(s) if (r == 0 and step == 700) else s)
    return Truth("an input-length peak", _ordered(out), ["oom"], ["input_peak"], [0], [4], [False], [],
                 ["cap_input"], ["train"])


def clean_but_leaking(run: str = "clean-leak", seed: int = 7, t0: float = T0) -> Truth:
    """2 ranks close cleanly at step 1,500; rank 1 leaks 30 MiB/step from step 500 to the end."""
    rng = random.Random(seed)
    out = []
    for r in range(2):
        rows = [sample(run, r, step, t0 + step + r * 0.01, f"a{r}",
                       30 * GiB + (30 * MiB * max(0, step - 500) if r == 1 else 0) + _noise(rng))
                for step in range(1501)]
        out.extend([*rows, _exit(rows[-1])])
    return Truth("a run that finished while leaking", _ordered(out), [], [], [], [], [], ["leak"],
                 ["capture_snapshots", "fix_leak"])


SCENARIOS: dict[str, Callable[..., Truth]] = {
    "leak_checkpoint_restart": leak_checkpoint_restart,
    "job_stop_with_room": job_stop_with_room,
    "fragmentation_no_retries": fragmentation_no_retries,
    "lone_death": lone_death,
    "lone_death_then_clean_close": lone_death_then_clean_close,
    "raise_ooms": raise_ooms,
    "input_peak": input_peak,
    "clean_but_leaking": clean_but_leaking,
}


#: the device-only run's climb (rank 0): 20 MiB a 15 s reading from 50 GiB, to 2 GiB short of the card
DEVICE_EVERY_S = 15.0
DEVICE_RATE = 20 * MiB / DEVICE_EVERY_S
DEVICE_OOM_T = (TOTAL - 2 * GiB - 50 * GiB) / DEVICE_RATE
_NO_ALLOCATOR = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "active_bytes", "inactive_split_bytes",
                 "alloc_retries", "ooms", "process_used_bytes")


def device_oom(run: str = "dcgm-oom", end: float = T0) -> list[dict[str, Any]]:
    """What dcgm-exporter gives (device used and capacity in whole MiB, no allocator fields, no OOM
    counter; steps on its clock, the unix second): two ranks every 15 s, rank 0 climbing to near full
    and then its memory vanishing (0.4 GiB) for 18 minutes, rank 1 flat at 40 GiB; +-10 MiB of
    reading jitter (seeded); the latest sample at ``end``. Known by no engine event: the story's
    truth is the vanish at DEVICE_OOM_T seconds from the first sample."""
    rng, out = random.Random(3), []
    n = int((DEVICE_OOM_T + 0.3 * 3600) / DEVICE_EVERY_S)
    start = end - (n - 1) * DEVICE_EVERY_S
    for i in range(n):
        t = i * DEVICE_EVERY_S
        for rank in (0, 1):
            level = 40 * GiB if rank else (0.4 * GiB if t > DEVICE_OOM_T else 50 * GiB + DEVICE_RATE * t)
            used = level + rng.uniform(-10, 10) * MiB
            out.append({"schema": 2, "run": run, "host": "node-a", "rank": rank, "step": round(start + t),
                        "ts": start + t, "phase": "train", "total_bytes": TOTAL,
                        "nvml_used_bytes": int(used) // MiB * MiB, **dict.fromkeys(_NO_ALLOCATOR)})
    return out
