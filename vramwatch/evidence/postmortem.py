"""Post-mortem of a run whose ranks stopped: who failed first, when, and why.

Input is the run's samples in any order of series (the store's ``iter_samples(run)`` or a
trace file), read in two passes: the first finds each rank's end, the second what every
other rank held at the moment of the first failure. Memory is O(ranks); the cost is two
sequential reads of the run.

How a rank ended (:data:`ENDS`):

* ``oom``: its OOM counter rose, or the hook marked its last sample as sent from the OOM
  observer (``oom_marked: true``), or its last sample is an OOM it never recovered from;
* ``exit``: the hook marked a clean ``close()`` (``exit: true``);
* ``silent``: it simply stopped sending. What the others did next tells killed from hung:
  if they went on for longer than ``silent_after_s`` it was killed alone (SIGKILL, the
  host's OOM-killer, a node loss); if they all stopped within that window it was a job-wide
  stop (a hang in a collective, then a kill of the whole job);
* ``running``: still sending as of ``now`` (not a failure).

A rank whose OOM was followed by a restart (new incarnation) still counts its OOM: the
first failure is the earliest OOM or silence, whatever happened after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from vramwatch.evidence.foreign import holds
from vramwatch.evidence.suspects import LeakSuspects, render_lines
from vramwatch.probe.processes import ForeignProcess
from vramwatch.verdicts import device_need_bytes, sample_headroom
from vramwatch.wire import Sample, series_key

ENDS = ("oom", "silent", "exit", "running")

#: Default silence after which a rank that stopped sending counts as dead (the
#: ``VramwatchHookSilent`` alert's rule, 5 minutes).
SILENT_AFTER_S = 300.0

SeriesKey = tuple[str, str, int]


def marker(sample: Sample) -> str | None:
    """``"oom"`` / ``"exit"`` when the hook marked the sample (``oom_marked`` / ``exit``), else None."""
    if sample.get("oom_marked"):
        return "oom"
    if sample.get("exit"):
        return "exit"
    return None


@dataclass
class _Track:
    """One series while reading: its last sample and its first OOM."""

    last: Sample
    first_oom: Sample | None = None
    ooms: int = 0
    prev_ooms: int | None = None
    incarnation: str = ""

    def add(self, s: Sample) -> None:
        count = s.get("ooms")
        same_incarnation = s.get("incarnation", "") == self.incarnation
        rose = count is not None and self.prev_ooms is not None and same_incarnation and count > self.prev_ooms
        if rose or marker(s) == "oom":
            # the observer's marked sample usually carries the risen counter too: count once
            self.ooms += (count - self.prev_ooms) if rose else 1  # type: ignore[operator]
            if self.first_oom is None or s["ts"] < self.first_oom["ts"]:
                self.first_oom = s
        if count is not None:
            self.prev_ooms = count
        self.incarnation = s.get("incarnation", "")
        if (s["ts"], s["step"]) >= (self.last["ts"], self.last["step"]):
            self.last = s


@dataclass(frozen=True)
class Failure:
    rank: int
    host: str
    step: int
    ts: float
    cause: str
    detail: str


@dataclass
class RankEnd:
    rank: int
    host: str
    last_step: int
    last_ts: float
    end: str
    ooms: int
    headroom_bytes: int | None
    #: what the rank held when the first failure happened (its last sample at or before it)
    held_at_failure_bytes: int | None = None
    headroom_at_failure_bytes: int | None = None
    last_sample: dict[str, Any] = field(default_factory=dict)
    #: other processes on its GPU, by name, as its hook last reported them (``GPU 3`` or a UUID)
    foreign_processes: tuple[ForeignProcess, ...] = ()
    foreign_device: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["foreign_processes"] = [{**p.to_dict(), "summary": holds(p, self.foreign_device)}
                                    for p in self.foreign_processes]
        return out


@dataclass
class PostMortem:
    run: str
    status: str  # "running" | "finished" | "crashed"
    first_failure: Failure | None
    ranks: list[RankEnd]
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    #: leaking ranks' growing allocation sites between two of their snapshots
    suspects: list[LeakSuspects] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "status": self.status,
                "first_failure": None if self.first_failure is None else asdict(self.first_failure),
                "ranks": [r.to_dict() for r in self.ranks], "snapshots": list(self.snapshots),
                "suspects": [s.to_dict() for s in self.suspects]}


def _read_ends(samples: Iterable[Sample]) -> dict[SeriesKey, _Track]:
    tracks: dict[SeriesKey, _Track] = {}
    for s in samples:
        key = series_key(s)
        track = tracks.get(key)
        if track is None:
            track = tracks[key] = _Track(last=s, incarnation=s.get("incarnation", ""))
            track.prev_ooms = s.get("ooms")
            if marker(s) == "oom":
                track.ooms, track.first_oom = 1, s
            continue
        track.add(s)
    return tracks


def _end_of(track: _Track, now: float, silent_after_s: float) -> str:
    last = track.last
    if marker(last) == "exit":
        return "exit"
    if marker(last) == "oom" or (track.first_oom is not None and track.first_oom is last):
        return "oom"
    if now - last["ts"] <= silent_after_s:
        return "running"
    return "silent"


def _silent_detail(ts: float, job_last_ts: float, silent_after_s: float) -> str:
    if job_last_ts - ts > silent_after_s:
        return (f"stopped sending while the other ranks went on for {job_last_ts - ts:.0f} s: "
                "killed alone (SIGKILL, the host's OOM-killer, a lost node)")
    return ("stopped with the rest of the job within "
            f"{silent_after_s:.0f} s: a job-wide stop (a hang in a collective, then a kill of the job)")


def _first_failure(tracks: dict[SeriesKey, _Track], ends: dict[SeriesKey, str], job_last_ts: float,
                   silent_after_s: float) -> Failure | None:
    candidates: list[Failure] = []
    for key, track in tracks.items():
        if track.first_oom is not None:
            s = track.first_oom
            free = s.get("extra", {}).get("oom_device_free_bytes") if isinstance(s.get("extra"), dict) else None
            detail = "CUDA out of memory" + (f" with {free / 2**30:.2f} GiB free on the device" if free else "")
            candidates.append(Failure(key[2], key[1], s["step"], s["ts"], "oom", detail))
        elif ends[key] == "silent":
            s = track.last
            candidates.append(Failure(key[2], key[1], s["step"], s["ts"], "silent",
                                      _silent_detail(s["ts"], job_last_ts, silent_after_s)))
    if not candidates:
        return None
    # An OOM beats a silence at the same moment: the silent ranks are usually its victims.
    return min(candidates, key=lambda f: (f.ts, f.cause != "oom", f.rank))


def _held(s: Sample) -> int | None:
    """What the device held for this rank at that moment: the one device-need rule, so held plus
    headroom is the device's capacity (:func:`vramwatch.verdicts.device_need_bytes`)."""
    return device_need_bytes(allocated=s.get("allocated_bytes"), reserved=s.get("reserved_bytes"),
                             peak=s.get("peak_allocated_bytes"), nvml_used=s.get("nvml_used_bytes"))


def build(
    run: str,
    samples: Callable[[], Iterable[Sample]],
    *,
    now: float,
    silent_after_s: float = SILENT_AFTER_S,
) -> PostMortem:
    """The post-mortem of ``run``; ``samples`` is called twice (two streaming passes)."""
    tracks = _read_ends(samples())
    if not tracks:
        return PostMortem(run=run, status="finished", first_failure=None, ranks=[])
    job_last_ts = max(t.last["ts"] for t in tracks.values())
    ends = {key: _end_of(t, now, silent_after_s) for key, t in tracks.items()}
    first = _first_failure(tracks, ends, job_last_ts, silent_after_s)
    at_failure: dict[SeriesKey, Sample] = {}
    if first is not None:
        for s in samples():
            if s["ts"] <= first.ts:
                key = series_key(s)
                prev = at_failure.get(key)
                if prev is None or s["ts"] >= prev["ts"]:
                    at_failure[key] = s
    ranks = []
    for key, track in sorted(tracks.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        snap = at_failure.get(key)
        ranks.append(RankEnd(
            rank=key[2], host=key[1], last_step=track.last["step"], last_ts=track.last["ts"], end=ends[key],
            ooms=track.ooms, headroom_bytes=sample_headroom(track.last),
            held_at_failure_bytes=_held(snap) if snap else None,
            headroom_at_failure_bytes=sample_headroom(snap) if snap else None,
            last_sample=dict(track.last),
        ))
    return PostMortem(run=run, status=run_status(ends.values(), first), first_failure=first, ranks=ranks)


def run_status(ends: Iterable[str], first: Failure | None) -> str:
    """``crashed`` if any rank failed, ``running`` while any still sends, else ``finished``."""
    ends = list(ends)
    if first is not None or any(e in ("oom", "silent") for e in ends):
        return "crashed"
    if any(e == "running" for e in ends):
        return "running"
    return "finished"


def from_dict(doc: dict[str, Any]) -> PostMortem:
    """A post-mortem document (the API's, or a front's merge of several) as a typed record."""
    first = doc.get("first_failure")
    fields = {f for f in RankEnd.__dataclass_fields__} - {"foreign_processes"}
    return PostMortem(
        run=doc.get("run", ""), status=doc.get("status") or "finished",
        first_failure=Failure(**{k: first[k] for k in Failure.__dataclass_fields__}) if first else None,
        ranks=[RankEnd(**{k: v for k, v in r.items() if k in fields},
                       foreign_processes=tuple(ForeignProcess.from_dict(p) for p in r.get("foreign_processes", ())))
               for r in doc.get("ranks", [])],
        snapshots=list(doc.get("snapshots", [])),
        suspects=[LeakSuspects.from_dict(s) for s in doc.get("suspects", [])],
    )


def render_text(pm: PostMortem) -> str:
    """The human summary printed by ``vramwatch postmortem``."""
    gib = 2**30
    lines = [f"run {pm.run}: {pm.status}"]
    f = pm.first_failure
    if f is None:
        lines.append("no rank failed")
    else:
        lines.append(f"first failure: rank {f.rank} on {f.host} at step {f.step} (ts {f.ts:.0f}): "
                     f"{f.cause} — {f.detail}")
    for r in pm.ranks:
        head = "—" if r.headroom_bytes is None else f"{r.headroom_bytes / gib:.2f} GiB"
        held = ("" if r.held_at_failure_bytes is None
                else f", held {r.held_at_failure_bytes / gib:.2f} GiB at the failure")
        lines.append(f"  rank {r.rank:>4} {r.host}: {r.end:<7} last step {r.last_step}, headroom {head}{held}"
                     + (f", {r.ooms} OOM" if r.ooms else ""))
        lines.extend(f"    {holds(p, r.foreign_device)}" for p in r.foreign_processes)
    for snap in pm.snapshots:
        lines.append(f"  snapshot: rank {snap.get('rank')} step {snap.get('step')} ({snap.get('trigger')}) "
                     f"{snap.get('url', '')}")
    lines.extend(render_lines(pm.suspects))
    return "\n".join(lines)
