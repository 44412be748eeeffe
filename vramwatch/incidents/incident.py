"""One incident: a failure that ended processes, the ranks it took down, whether they came back,
and its cause as a finding (``derive`` fills it); ``text`` is said from those fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.incidents import findings as F

#: incident kinds, the one that names a group first: an OOM, then an OOM suspected from device
#: memory, then a rank that died alone, then a job-wide stop (``derive`` and a front's merge)
KIND_ORDER = ("oom", "suspected_oom", "death", "job_stop")


@dataclass
class Incident:
    """One failure that ended processes; ``to_dict`` is the API's form."""

    kind: str  # oom | suspected_oom | death | job_stop (KIND_ORDER)
    host: str
    rank: int
    step: int
    ts: float
    incarnation: str
    ranks: list[int]  # the ranks it took down (the named one first)
    restarted: bool
    restart_step: int | None = None
    restart_ts: float | None = None
    phase: str | None = None
    cause: str = "unknown"
    since_step: int | None = None
    finding: F.Finding | None = None
    died_cause: str | None = None  # the hook's own word on the death, when it sent one

    @property
    def text(self) -> str:
        what = {"oom": f"rank {self.rank} ran out of memory",
                "suspected_oom": f"rank {self.rank}'s memory vanished from the device (a suspected OOM)",
                "death": f"rank {self.rank} died alone (its peers went on)" if len(self.ranks) == 1
                else f"{len(self.ranks)} ranks died while their peers went on",
                "job_stop": f"{len(self.ranks)} ranks stopped together without a clean close (a job-wide stop)",
                }[self.kind]
        out = f"{what} at step {self.step:,}" + (f" in {self.phase}" if self.phase and self.phase != "train" else "")
        if self.kind == "oom" and len(self.ranks) > 1:
            out += f"; it took the job down ({len(self.ranks)} ranks)"
        elif self.kind == "suspected_oom" and len(self.ranks) > 1:
            out += f"; {len(self.ranks)} ranks' memory vanished with it"
        if self.died_cause:
            out += f"; its last word: {self.died_cause}"
        if self.finding is not None:
            out += f". Cause: {self.finding.text}"
        if self.restarted and self.restart_step is not None:
            out += f". Every rank it stopped restarted from step {self.restart_step:,}"
        elif not self.restarted and self.kind != "suspected_oom":  # device memory cannot tell a restart
            out += ". Not restarted"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "host": self.host, "rank": self.rank, "step": self.step, "ts": self.ts,
                "incarnation": self.incarnation, "phase": self.phase, "cause": self.cause,
                "since_step": self.since_step, "ranks_affected": list(self.ranks), "restarted": self.restarted,
                "restart_step": self.restart_step, "restart_ts": self.restart_ts, "died_cause": self.died_cause,
                "finding": None if self.finding is None else self.finding.to_dict(), "text": self.text}


__all__ = ["KIND_ORDER", "Incident"]
