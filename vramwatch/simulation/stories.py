"""The batch procedure played out by a simulated job, with the truth to judge the advice by.

A story is one job (KoHRM-like: 8 x H200, 22,528 fixed token slots per GPU = 180,224 global)
run as a sequence of processes, each at one batch (:class:`Epoch`): the job finishes stably,
tries a larger batch, runs out of memory or holds, backs off. When a rank runs out of memory the
job dies with it (every rank's process ends at that step) and the next process resumes from the
last checkpoint before it, as a launcher does. The truth (:func:`story_truth`) comes from the
simulator's parameters, including what no run below a batch can show: a buffer the checkpoint
needs only above a size (``ckpt_cliff_tokens``, a shape-dependent workspace or a graph compiled
for larger shapes), the reason a raise that looked fine runs out of memory at its first checkpoint.

Deterministic given the seed; O(ranks x steps) samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.probe.simulated import H200_TOTAL_BYTES, simulate_trace
from vramwatch.simulation.tokens import TokenTruth, token_truth


@dataclass(frozen=True)
class Epoch:
    """One process of the job: its batch (tokens per step per rank) and how long it would run."""

    tokens_per_step: int
    steps: int
    changes: tuple[tuple[str, Any], ...] = ()  # simulator parameters this process runs with (a fix)


#: The job: 127-130 GB of the H200's 143.8 (nvidia-smi's MiB read as GB) at 22,528 slots per GPU,
#: rank 0 ~2 GB higher, a checkpoint every 1,000 steps just above the training peak.
JOB: dict[str, Any] = {"tokens_ref": 22528, "seq_min": 1.0, "act_frac": 0.458, "act_fixed_frac": 0.03,
                       "ckpt_above_frac": 0.005, "ckpt_every": 1000, "world_size": 8}
#: The buffer the checkpoint needs above 23,552 tokens per rank (none of 22,528's runs shows it):
#: 16.8 GiB, about fp32 logits for the loss at 24,576 x 131,072 vocabulary (the notes' 131K vocab).
CLIFF = {"ckpt_cliff_tokens": 23552, "ckpt_cliff_frac": 0.12}
#: The same, below the primary batch: 22,528 itself runs out of memory at every checkpoint.
LOW_CLIFF = {"ckpt_cliff_tokens": 21504, "ckpt_cliff_frac": 0.12}

#: name -> (overrides of JOB, the processes). Global batches: 163,840 / 180,224 / 196,608 / 229,376.
STORIES: dict[str, tuple[dict[str, Any], tuple[Epoch, ...]]] = {
    # 180,224 held a plateau through three checkpoints
    "proven": ({}, (Epoch(22528, 3200),)),
    # ... then 196,608 was tried and held as well
    "raise_holds": ({}, (Epoch(22528, 3200), Epoch(24576, 3200))),
    # ... then 196,608 was tried and ran out of memory at its first checkpoint
    "raise_ooms": (CLIFF, (Epoch(22528, 3200), Epoch(24576, 3200))),
    # ... and the job went back to 180,224 (not proven again yet)
    "backed_off": (CLIFF, (Epoch(22528, 3200), Epoch(24576, 3200), Epoch(22528, 1200))),
    # 180,224 ran out of memory at a checkpoint twice: the notes' "OOM 재발 시"
    "recurrence": (LOW_CLIFF, (Epoch(22528, 3200), Epoch(22528, 3200))),
    # 163,840 held; a jump to 229,376 ran out of memory at once
    "raise_far": ({}, (Epoch(20480, 3200), Epoch(28672, 600))),
    # a new run tried 196,608 straight away and ran out of memory at its first checkpoint
    "try_alone": (CLIFF, (Epoch(24576, 3200),)),
    # rank 1 leaked from step 1,500 until it ran out of memory; the job resumed with the leak fixed
    "leak_restart": ({"leak_rank": 1, "leak_onset": 1500, "leak_rate_frac": 4e-5},
                     (Epoch(22528, 6000), Epoch(22528, 600, (("leak_onset", None),)))),
}


def story_params(name: str) -> dict[str, Any]:
    if name not in STORIES:
        raise ValueError(f"unknown story {name!r}; choose one of {', '.join(STORIES)}")
    return {**JOB, **STORIES[name][0]}


def story_trace(name: str, *, ranks: int = 2, seed: int = 0, run: str | None = None,
                start_ts: float = 1.75e9) -> list[dict[str, Any]]:
    """Every sample of the story's job (``ranks`` of its 8 ranks simulated), process by process."""
    params = story_params(name)
    run = run or name
    out: list[dict[str, Any]] = []
    resume, ts = 0, start_ts
    for k, epoch in enumerate(STORIES[name][1]):
        per_rank = [list(simulate_trace("checkpoint", steps=epoch.steps, run=run, host=f"node-{r // 8}", rank=r,
                                        seed=seed * 100 + k * 10 + r, start_ts=ts,
                                        **{**params, **dict(epoch.changes),
                                           "tokens_per_step": epoch.tokens_per_step}))
                    for r in range(ranks)]
        oom_steps = [s[-1]["step"] for s in per_rank if s and s[-1]["ooms"]]
        end = min(oom_steps) if oom_steps else None
        for r, samples in enumerate(per_rank):
            for x in samples:
                if end is not None and (x["step"] > end or (x["step"] == end and x["phase"] != "train"
                                                            and not x["ooms"])):
                    break  # the job died with the rank that ran out of memory
                out.append({**x, "step": resume + x["step"], "incarnation": f"{run}-{r}-{k}"})
        last = [x for x in out if x["incarnation"].endswith(f"-{k}")]
        ts = max(x["ts"] for x in last) + 120.0
        stopped = max(x["step"] for x in last)
        every = params["ckpt_every"]
        # the next process resumes from the last checkpoint the job saved (one that failed saved nothing)
        resume = (end + resume - 1 if end is not None else stopped) // every * every
    return out


def story_truth(name: str, *, rank: int = 0, seed: int = 0, total_bytes: int = H200_TOTAL_BYTES) -> TokenTruth:
    """The job's truth for one rank (rank 0 binds: it carries ~2 GB more)."""
    params = story_params(name)
    return token_truth("fixed", rank=rank, seed=seed, total_bytes=total_bytes,
                       **{k: v for k, v in params.items() if k != "world_size"}, tokens_per_step=22528)


__all__ = ["CLIFF", "JOB", "LOW_CLIFF", "STORIES", "Epoch", "story_params", "story_trace", "story_truth"]
