"""The stories ``vramwatch demo --scenario NAME`` tells (``--list`` prints this table).

Every scenario is the KoHRM-like job of the notes on simulated H200s: 22,528 fixed token slots per
GPU (180,224 global over 8 ranks), ~128 GiB of 140.4 used, rank 0 ~2 GiB higher, a checkpoint every
500 steps, at 10 steps per second: the simulated ranks always send their tokens per step, so the
dashboard's advice panel and ``vramwatch advise`` can judge the batch. Each scenario adds one story:
what goes wrong (or right), what a fix changes when the job is restarted, whether the job follows
the advice (raises and backs off as ``advise`` says: the procedure end to end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramwatch.simulation.stories import CLIFF, JOB

#: Simulator parameters every demo scenario starts from (on top of the ``demo`` scenario's pacing).
BASE: dict[str, Any] = {
    **{k: v for k, v in JOB.items() if k != "world_size"}, "tokens_per_step": 22528, "ckpt_every": 500,
    "ckpt_time_s": 1.0, "step_time_s": 0.1, "warm_tau": 60.0, "leak_rank": None, "leak_onset": None,
    "leak_rate_frac": 0.0,
}


@dataclass(frozen=True)
class DemoScenario:
    name: str
    description: str
    params: dict[str, Any] = field(default_factory=dict)  # simulator parameters on top of BASE
    fix: dict[str, Any] = field(default_factory=dict)  # what a fix changes (applied when the advice says fix)
    follows_advice: bool = False  # the job raises and backs off as the advice says
    kill: tuple[int, int] | None = None  # (rank, step): that rank's process is killed alone there


SCENARIOS: dict[str, DemoScenario] = {s.name: s for s in (
    DemoScenario("healthy", "warm-up, a plateau, checkpoints passed: READY after ~2,300 steps, then the advice "
                            "says raise to 196,608"),
    DemoScenario("batch-raise", "the procedure end to end: 180,224 proven, the job raises to 196,608 as the "
                                "advice says, runs out of memory at its first checkpoint (a buffer only batches "
                                "above 188,416 need), backs off to 180,224 and holds",
                 params=dict(CLIFF), follows_advice=True),
    DemoScenario("batch-raise-holds", "the procedure end to end: 180,224 proven, the job raises to 196,608, "
                                      "which holds its plateau through a checkpoint; the advice then holds "
                                      "(the next batch would break the margin)", follows_advice=True),
    DemoScenario("leak", "rank 5 leaks slowly from step 700 (~0.6 MiB/step, OOM in ~20,000 steps): UNSAFE, the "
                         "advice says fix, naming the rank and its runway",
                 params={"leak_rank": 5, "leak_onset": 700, "leak_rate_frac": 4e-6}),
    DemoScenario("oom-restart", "rank 5 leaks fast from step 700 and runs out of memory (~step 3,000): the job "
                                "dies, the advice blames the leak, the job restarts from its last checkpoint "
                                "with the leak fixed",
                 params={"leak_rank": 5, "leak_onset": 700, "leak_rate_frac": 4e-5},
                 fix={"leak_rank": None, "leak_onset": None}),
    DemoScenario("dead-rank", "rank 3 is killed at step 600 while the job goes on: after 5 minutes of its "
                              "silence it is dead (killed), the run UNSAFE", kill=(3, 600)),
    DemoScenario("fragmentation", "rank 2's cache fragments from step 700 (retries climb, reserved grows, "
                                  "allocated flat): UNSAFE, the advice says fix",
                 params={"leak_rank": 2, "frag_onset": 700, "frag_rate_frac": 4e-5},
                 fix={"leak_rank": None, "frag_onset": None}),
)}
#: What ``vramwatch demo`` runs without --scenario.
DEFAULT = "oom-restart"


def scenario(name: str) -> DemoScenario:
    """The scenario called ``name`` (ValueError naming the choices otherwise)."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"scenario: unknown {name!r}; choose one of {', '.join(SCENARIOS)}") from None


def listing() -> str:
    """``vramwatch demo --list``: one line per scenario."""
    width = max(len(n) for n in SCENARIOS)
    return "\n".join(f"{s.name.ljust(width)}  {s.description}{' (the default)' if s.name == DEFAULT else ''}"
                     for s in SCENARIOS.values()) + "\n"


__all__ = ["BASE", "DEFAULT", "SCENARIOS", "DemoScenario", "listing", "scenario"]
