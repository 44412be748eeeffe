"""Why: the cause codes that readiness, an OOM's cause and the next step carry, each defined once.

A decision's reason is data, not prose: :class:`Reason` pairs a cause code of :data:`CAUSES` with
the sentence a person reads (numbers included) and the rank it is about. Code that acts on a
reason reads ``cause``; nothing ever searches the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Every cause a decision may give, with what it means (docs/decisions.md lists the same table).
CAUSES: dict[str, str] = {
    # a rank is unsafe now
    "oom": "the process ran out of memory at this batch or a smaller one",
    "leak": "memory grows step after step: a leak the trend engine detected",
    "fragmentation": "the allocator's cache is fragmented: cached memory cannot serve requests",
    "unstable": "a plateau break of the training loop itself that has not settled",
    "margin": "the worst headroom is under the margin",
    "death": "a rank stopped without a clean exit or an OOM while the job went on",
    # what an OOM came from (the evidence on that rank before it)
    "phase_peak": "a phase's own peak (checkpoint, eval) at this batch",
    "batch_change": "the batch was raised above a setting that had held",
    "batch": "the training step's own peak at this batch",
    # waiting for proof
    "plateau": "the plateau has not held for the required steps at this batch",
    "checkpoint": "no checkpoint has been passed at this batch yet",
    # the next step
    "proven": "the batch held its plateau through a checkpoint with margin left",
    "recurrence": "a second OOM at the same batch",
    "oom_ceiling": "the next settable batch is at or above one that ran out of memory",
    "no_fit": "the next settable batch does not keep the margin by the model",
    "extrapolation": "the next settable batch is further than the model may extrapolate in one move",
    "no_tokens": "the samples carry no tokens per step, so no batch can be projected",
    "model": "the memory model's projection (nothing was observed at this batch)",
}

#: Causes of an OOM, in the order the evidence is weighed (the first that applies is the cause).
OOM_CAUSES = ("leak", "fragmentation", "phase_peak", "batch_change", "batch")
#: OOM causes that say the batch did not fit (a leak or fragmentation runs out at any batch).
BATCH_CAUSES = frozenset({"phase_peak", "batch_change", "batch"})


@dataclass(frozen=True)
class Reason:
    """A cause code (:data:`CAUSES`), the sentence with its numbers, and the rank it is about."""

    cause: str
    text: str
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause: not one of the known causes: {self.cause!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "rank": self.rank, "text": self.text}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Reason:
        """Inverse of :meth:`as_dict` (KeyError/TypeError/ValueError on a malformed document)."""
        rank = doc.get("rank")
        return cls(str(doc["cause"]), str(doc["text"]), None if rank is None else int(rank))


def causes_table() -> str:
    """The Markdown table of :data:`CAUSES` (docs/decisions.md embeds it; a test compares them)."""
    rows = "\n".join(f"| `{cause}` | {meaning} |" for cause, meaning in CAUSES.items())
    return f"| cause | meaning |\n|---|---|\n{rows}\n"


__all__ = ["BATCH_CAUSES", "CAUSES", "OOM_CAUSES", "Reason", "causes_table"]
