"""Leak suspects: for a leaking rank with two snapshots far enough apart, the sites that grew.

When the trend engine calls a rank's growth a leak, the collector asks it for a snapshot
(trigger ``auto:leak``) and, once that arrives, for a second one recorded over
:data:`FOLLOWUP_STEPS` steps (trigger :data:`FOLLOWUP_TRIGGER`), so every block the leak
allocates meanwhile carries its stack. The diff of a rank's pair
(:mod:`vramwatch.evidence.snapshot_diff`) names the lines of code whose live memory grew.

Which pair: the rank's newest second capture (:data:`FOLLOWUP_TRIGGER`: the one whose
recording covered the leak), else its newest snapshot; and the newest earlier one at least
``min_steps`` steps before it (same rank and host; taken earlier in time, so a restarted rank
whose steps went back is not paired across the restart). Blocks allocated while no history
was recording have no stack: their growth is reported apart (``untraced``). The pairing is
pure (:func:`pick_pairs`); the loading and the diff's cost (a few hundred ms for 20,000
blocks, ``docs/benchmarks.md``) are the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vramwatch.evidence.snapshot_diff import Amount, SiteChange, SnapshotDiff

#: Triggers that say the engine saw a leak on that rank.
LEAK_TRIGGER = "auto:leak"
FOLLOWUP_TRIGGER = "auto:leak-second"
LEAK_TRIGGERS = frozenset({LEAK_TRIGGER, FOLLOWUP_TRIGGER})
#: Steps of allocator history the second capture records.
FOLLOWUP_STEPS = 20
#: Fewest steps between the two snapshots of a pair.
MIN_STEPS = 10
#: Sites listed per rank.
TOP_SITES = 5


@dataclass(frozen=True)
class SnapshotRef:
    """What pairing needs of a stored snapshot."""

    id: str
    host: str
    rank: int
    step: int
    ts: float
    trigger: str


@dataclass(frozen=True)
class LeakSuspects:
    """One leaking rank's growing sites between two of its snapshots."""

    rank: int
    host: str
    old: str  # snapshot ids
    new: str
    old_step: int
    new_step: int
    sites: tuple[SiteChange, ...]
    untraced: Amount
    cached: Amount

    @property
    def steps(self) -> int:
        return self.new_step - self.old_step

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "old": self.old, "new": self.new, "old_step": self.old_step,
                "new_step": self.new_step, "steps": self.steps, "sites": [s.to_dict() for s in self.sites],
                "untraced": self.untraced.to_dict(), "cached": self.cached.to_dict()}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LeakSuspects:
        return cls(int(doc["rank"]), str(doc["host"]), str(doc["old"]), str(doc["new"]), int(doc["old_step"]),
                   int(doc["new_step"]), tuple(SiteChange.from_dict(s) for s in doc.get("sites", ())),
                   Amount.from_dict(doc.get("untraced")), Amount.from_dict(doc.get("cached")))


def pick_pairs(refs: Iterable[SnapshotRef], leaking: set[tuple[str, int]], *, min_steps: int = MIN_STEPS
               ) -> list[tuple[SnapshotRef, SnapshotRef]]:
    """(old, new) per rank in ``leaking`` (``(host, rank)``) or whose snapshots came from a leak
    trigger; ranks without a pair at least ``min_steps`` apart are left out."""
    by_rank: dict[tuple[str, int], list[SnapshotRef]] = {}
    for ref in refs:
        by_rank.setdefault((ref.host, ref.rank), []).append(ref)
    out = []
    for key in sorted(by_rank, key=lambda k: (k[1], k[0])):
        snaps = sorted(by_rank[key], key=lambda r: r.ts)
        if key not in leaking and not any(r.trigger in LEAK_TRIGGERS for r in snaps):
            continue
        followups = [r for r in snaps if r.trigger == FOLLOWUP_TRIGGER]
        new = (followups or snaps)[-1]
        older = [r for r in snaps if r.ts < new.ts and new.step - r.step >= min_steps]
        if older:
            out.append((older[-1], new))
    return out


def from_diff(old: SnapshotRef, new: SnapshotRef, result: SnapshotDiff, *, top: int = TOP_SITES) -> LeakSuspects:
    """The suspects of one pair: the sites that grew (at most ``top``)."""
    return LeakSuspects(new.rank, new.host, old.id, new.id, old.step, new.step, tuple(result.growing()[:top]),
                        result.untraced, result.cached)


def render_lines(suspects: Iterable[LeakSuspects]) -> list[str]:
    """Text lines for ``vramwatch postmortem``: per rank, its growing sites."""
    lines = []
    for s in suspects:
        lines.append(f"  leak suspects on rank {s.rank} ({s.host}), steps {s.old_step} → {s.new_step} "
                     f"({s.steps} steps):")
        if not s.sites:
            lines.append("    no allocation site grew between the two snapshots"
                         + (f"; {s.untraced.bytes_delta / 2**20:+.1f} MiB untraced" if s.untraced.bytes_delta else ""))
        for c in s.sites:
            lines.append(f"    {c.bytes_delta / 2**20:+,.1f} MiB in {c.blocks_delta:+,} blocks at {c.site.text()}")
    return lines


__all__ = ["FOLLOWUP_STEPS", "FOLLOWUP_TRIGGER", "LEAK_TRIGGER", "LEAK_TRIGGERS", "MIN_STEPS", "LeakSuspects",
           "SnapshotRef", "from_diff", "pick_pairs", "render_lines"]
