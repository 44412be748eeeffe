"""How runs end, as the hook sends them: one builder per ending, shared by the model's unit
tests and the tests that check every reader agrees (tests/runlife/test_runlife_readers.py).

Each builder returns an :class:`Ending`: the samples in the order the collector would receive
them (ranks interleaved step by step, end markers as the hook sends them: a clean ``close()``
repeats the last train sample with ``exit: true``, the OOM observer sends a fresh reading with
``oom_marked: true`` and the risen counter) and what the model must make of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from helpers import make_sample

T0 = 1_760_000_000.0
RANKS = 4
#: steps of a run (one a second); a rank "killed alone" stops at KILL_STEP, 600 s before the end
STEPS = 900
KILL_STEP = 200


@dataclass
class Ending:
    name: str
    samples: list[dict[str, Any]]
    status: str  # the run's status once every rank is judged
    liveness: dict[int, str]  # rank -> liveness at the end
    died: dict[int, str | None]  # rank -> cause of its latest process's death (None: did not die)
    ooms: dict[int, int] = field(default_factory=dict)
    restarts: dict[int, int] = field(default_factory=dict)
    first_failure: tuple[int, str] | None = None  # (rank, cause)

    @property
    def last_ts(self) -> float:
        return max(s["ts"] for s in self.samples)


def _train(step: int, rank: int, run: str, incarnation: str, t0: float, **kw: Any) -> dict[str, Any]:
    return make_sample(step, run=run, rank=rank, ts=t0 + step + rank * 0.01, incarnation=incarnation, **kw)


def _exit(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "ts": sample["ts"] + 0.5, "seq": 1, "exit": True}


def _interleave(per_rank: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return sorted((s for samples in per_rank.values() for s in samples), key=lambda s: (s["ts"], s["rank"]))


def clean_exit(run: str = "clean", t0: float = T0) -> Ending:
    per_rank = {}
    for r in range(RANKS):
        samples = [_train(i, r, run, f"p{r}", t0) for i in range(STEPS)]
        per_rank[r] = [*samples, _exit(samples[-1])]
    return Ending("clean exit on every rank", _interleave(per_rank), "finished",
                  dict.fromkeys(range(RANKS), "exited"), dict.fromkeys(range(RANKS)))


def job_killed(run: str = "killed-job", t0: float = T0) -> Ending:
    per_rank = {r: [_train(i, r, run, f"p{r}", t0) for i in range(STEPS)] for r in range(RANKS)}
    return Ending("job killed at once", _interleave(per_rank), "crashed", dict.fromkeys(range(RANKS), "dead"),
                  dict.fromkeys(range(RANKS), "stopped"), first_failure=(0, "stopped"))


def one_killed(run: str = "one-killed", t0: float = T0) -> Ending:
    per_rank = {}
    for r in range(RANKS):
        if r == 2:
            per_rank[r] = [_train(i, r, run, f"p{r}", t0) for i in range(KILL_STEP)]
        else:
            samples = [_train(i, r, run, f"p{r}", t0) for i in range(STEPS)]
            per_rank[r] = [*samples, _exit(samples[-1])]
    live = dict.fromkeys(range(RANKS), "exited") | {2: "dead"}
    died = dict.fromkeys(range(RANKS)) | {2: "killed"}
    return Ending("one rank killed while the rest finish", _interleave(per_rank), "crashed", live, died,
                  first_failure=(2, "killed"))


def oom_restart_finish(run: str = "oom-restart", t0: float = T0) -> Ending:
    """Rank 1 OOMs at step 300 (observer's marked sample); torchrun restarts every rank from the
    step-250 checkpoint; all finish cleanly."""
    per_rank = {}
    for r in range(RANKS):
        first = [_train(i, r, run, f"a{r}", t0) for i in range(300)]
        if r == 1:
            first.append({**_train(299, r, run, f"a{r}", t0, ooms=1), "ts": t0 + 300.2, "seq": 1, "oom_marked": True})
        second = [{**_train(i, r, run, f"b{r}", t0), "ts": t0 + 60 + i + r * 0.01} for i in range(250, STEPS)]
        per_rank[r] = [*first, *second, _exit(second[-1])]
    return Ending("an OOM, a restart and a clean finish", _interleave(per_rank), "recovered",
                  dict.fromkeys(range(RANKS), "exited"), dict.fromkeys(range(RANKS)),
                  ooms=dict.fromkeys(range(RANKS), 0) | {1: 1}, restarts=dict.fromkeys(range(RANKS), 1),
                  first_failure=(1, "oom"))


def oom_everywhere(run: str = "oom-all", t0: float = T0) -> Ending:
    per_rank = {}
    for r in range(RANKS):
        samples = [_train(i, r, run, f"p{r}", t0) for i in range(400)]
        samples.append({**_train(399, r, run, f"p{r}", t0, ooms=1), "ts": t0 + 400.1 + r * 0.01, "seq": 1,
                        "oom_marked": True})
        per_rank[r] = samples
    return Ending("an OOM on every rank", _interleave(per_rank), "crashed", dict.fromkeys(range(RANKS), "dead"),
                  dict.fromkeys(range(RANKS), "oom"), ooms=dict.fromkeys(range(RANKS), 1), first_failure=(0, "oom"))


def collector_restart(run: str = "restarted-collector", t0: float = T0) -> Ending:
    """A run that finishes cleanly; the tests restart the collector half way (this is the data)."""
    ending = clean_exit(run, t0)
    ending.name = "the collector restarted mid-run"
    return ending


#: what the NCCL watchdog raises on a rank left waiting (ProcessGroupNCCL.cpp), as the hook bounds it
WATCHDOG = ("[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=301, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.")


def _last_words(sample: dict[str, Any], ts: float, kind: str, message: str, phase: str = "train") -> dict[str, Any]:
    """The hook's last-words marker: a copy of the latest sample, ``ts`` when it spoke, next ``seq``."""
    message = message if len(message) <= 128 else message[:127] + "…"
    return {**sample, "ts": ts, "seq": (sample.get("seq") or 0) + 1, "last_words_type": kind,
            "last_words_message": message, "last_words_phase": phase}


def culprit_and_victims(run: str = "culprit", t0: float = T0) -> Ending:
    """Rank 1 runs out of memory at step 300 (the observer's marked sample, then its uncaught
    torch.OutOfMemoryError); the other ranks hang in the next all-reduce and the NCCL watchdog
    kills each 600 s later: their last words are collective timeouts, after the OOM."""
    per_rank = {}
    for r in range(RANKS):
        samples = [_train(i, r, run, f"p{r}", t0) for i in range(301)]
        if r == 1:
            oom = {**_train(300, r, run, f"p{r}", t0, ooms=1), "ts": t0 + 300.2, "seq": 1, "oom_marked": True}
            samples += [oom, _last_words(oom, t0 + 300.3, "torch.OutOfMemoryError",
                                         "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
                                         "of 79.15 GiB of which 1.06 GiB is free.")]
        else:
            samples.append(_last_words(samples[-1], t0 + 900.0 + r, "torch.distributed.DistBackendError",
                                       WATCHDOG.format(rank=r)))
        per_rank[r] = samples
    died = dict.fromkeys(range(RANKS), "collective_timeout") | {1: "oom"}
    return Ending("one rank out of memory, the others time out waiting for it", _interleave(per_rank), "crashed",
                  dict.fromkeys(range(RANKS), "dead"), died, ooms=dict.fromkeys(range(RANKS), 0) | {1: 1},
                  first_failure=(1, "oom"))


def crash_then_restart(run: str = "segfault", t0: float = T0) -> Ending:
    """Rank 2 dies of a SIGSEGV at step 200; its next process (restarted from the step-150
    checkpoint) sends the dead one's crash record; every rank finishes cleanly."""
    per_rank = {}
    for r in range(RANKS):
        first = [_train(i, r, run, f"a{r}", t0) for i in range(STEPS if r != 2 else 201)]
        if r != 2:
            per_rank[r] = [*first, _exit(first[-1])]
            continue
        second = [{**_train(i, r, run, f"b{r}", t0), "ts": t0 + 80 + i} for i in range(150, STEPS - 80)]
        crash = _last_words(first[-1], t0 + 200.5, "SIGSEGV", "Fatal Python error: Segmentation fault")
        per_rank[r] = [*first, *second[:1], crash, *second[1:], _exit(second[-1])]
    return Ending("a segfault, the rank restarted, a clean finish", _interleave(per_rank), "recovered",
                  dict.fromkeys(range(RANKS), "exited"), dict.fromkeys(range(RANKS)),
                  restarts=dict.fromkeys(range(RANKS), 0) | {2: 1}, first_failure=(2, "crash"))


ENDINGS = (clean_exit, job_killed, one_killed, oom_restart_finish, oom_everywhere, collector_restart,
           culprit_and_victims, crash_then_restart)
