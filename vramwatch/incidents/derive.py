"""Incidents from the run-life model's deaths, and their causes from the processes' evidence.

**Grouping** (:func:`group`, from the :class:`~vramwatch.runlife.RunStory` alone, O(n log n) in
processes): every process that died (``oom``, ``killed``, ``stopped``) is a death at its last
sample (an OOM at its OOM). Deaths within the silence window of the first of a group, of
processes already running when it began, are one incident: the OOM that took the job down and
its victims (stopped in the next collective, their last samples seconds before or after it); a
process restarted after it that dies soon after is the next one (a crash loop). Its ``kind``:
``oom`` when an OOM is in it (the earliest names the rank), ``suspected_oom`` when the trend engine
suspected one from device memory alone (:class:`~vramwatch.runlife.SuspectedOom`: its cause is that
suspicion with its numbers, never an OOM), ``death`` when a rank was killed alone (or its peers
went on to a clean close), ``job_stop`` when every process just stopped.
``restarted``: every rank it took down came back (a newer process), at the earliest restart's
step and time.

**Causes** (:func:`derive`, with :class:`~vramwatch.incidents.track.Process` evidence), in order:
a ``leak`` the engine followed in the process at its end; ``fragmentation`` the engine found; a
``raise`` above tokens per step that held on the rank; an ``input_peak`` (the failing step's
tokens above anything the process had held and 1.2x its mean); a ``phase_peak`` (the OOM in a
marked phase); for a stop without an OOM, ``not_memory`` when every rank it took down had at
least the low-headroom fraction free; else ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramwatch.incidents import findings as F
from vramwatch.incidents.incident import KIND_ORDER, Incident
from vramwatch.incidents.nextsteps import NextAction, next_steps
from vramwatch.incidents.track import Process
from vramwatch.runlife import RunStory, SuspectedOom
from vramwatch.verdicts import DEATHS, LOW_HEADROOM_FRACTION, SILENT_AFTER_S, Outcome

#: a failing step's input is a peak when it is this many times the process's mean (and above the largest held)
INPUT_PEAK_RATIO = 1.2


@dataclass(frozen=True)
class ProcessDeath:
    host: str
    rank: int
    incarnation: str
    outcome: Outcome
    step: int
    ts: float
    restart: tuple[int, float] | None  # the rank's next process's first (step, ts)
    start: float = 0.0  # the process's first sample's time
    suspected: SuspectedOom | None = None  # an OOM suspected from device memory (the process may run on)

    @property
    def kind(self) -> str:
        """The incident kind this death would name (:data:`KIND_ORDER`)."""
        if self.suspected is not None:
            return "suspected_oom"
        return {Outcome.OOM: "oom", Outcome.KILLED: "death"}.get(self.outcome, "job_stop")

    @property
    def precedence(self) -> int:
        """Which death names its group (:data:`KIND_ORDER`): an OOM, a suspected OOM, a rank killed
        alone, a stop, any other death."""
        if self.kind != "job_stop":
            return KIND_ORDER.index(self.kind)
        return len(KIND_ORDER) - 1 if self.outcome == Outcome.STOPPED else len(KIND_ORDER)


@dataclass
class Report:
    incidents: list[Incident] = field(default_factory=list)
    open_findings: list[F.Finding] = field(default_factory=list)
    next: list[NextAction] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"incidents": [i.to_dict() for i in self.incidents],
                "open_findings": [f.to_dict() for f in self.open_findings],
                "next": [n.to_dict() for n in self.next]}


def _deaths(story: RunStory) -> list[ProcessDeath]:
    out = []
    for r in story.ranks:
        incs = r.incarnations
        for i, inc in enumerate(incs):
            if inc.outcome not in DEATHS:
                continue
            rec = inc.record
            at = rec.oom_at if inc.outcome == Outcome.OOM and rec.oom_at is not None else rec.last
            nxt = incs[i + 1].record.first if i + 1 < len(incs) else None
            out.append(ProcessDeath(r.host, r.rank, rec.incarnation, inc.outcome, at.step, at.ts,
                             None if nxt is None else (nxt.step, nxt.ts), rec.first.ts))
        for found in r.suspected:  # in the process running then (device data has one)
            inc = next((x for x in reversed(incs) if x.record.first.ts <= found.ts), incs[0])
            out.append(ProcessDeath(r.host, r.rank, inc.record.incarnation, inc.outcome, found.step, found.ts, None,
                                    inc.record.first.ts, found))
    return out


def _closed_after(story: RunStory) -> list[tuple[float, float, int]]:
    """(start, end, rank) of every process that closed cleanly: a stop while one of these ran on
    to its clean close was no job-wide stop, whatever the silence window says."""
    return [(inc.record.first.ts, inc.record.last.ts, r.rank) for r in story.ranks for inc in r.incarnations
            if inc.outcome == Outcome.EXITED]


def _suspicion(d: ProcessDeath) -> F.SuspectedOomFinding:
    found = d.suspected
    assert found is not None
    return F.SuspectedOomFinding(d.rank, d.host, found.step, found.used_before_bytes, found.used_after_bytes,
                                 found.total_bytes, found.headroom_bytes, found.reason)


def _one(group_: list[ProcessDeath], exits: list[tuple[float, float, int]]) -> Incident:
    lead = min(group_, key=lambda d: (d.precedence, d.ts, d.rank))
    kind = lead.kind
    gone = {d.rank for d in group_}
    if kind == "job_stop" and any(start <= lead.ts < end and rank not in gone for start, end, rank in exits):
        kind = "death"  # its peers went on to a clean close: it died alone
    ranks = [lead.rank, *sorted({d.rank for d in group_} - {lead.rank})]
    restarts = [d.restart for d in group_]
    restarted = all(r is not None for r in restarts)
    first = min((r for r in restarts if r is not None), key=lambda r: r[1], default=None)
    inc = Incident(kind, lead.host, lead.rank, lead.step, lead.ts, lead.incarnation, ranks, restarted,
                   None if first is None else first[0], None if first is None else first[1])
    if lead.suspected is not None:  # its cause is the suspicion itself, with the numbers the fold kept
        inc.finding = _suspicion(lead)
        inc.cause = inc.finding.KIND
    return inc


def group(story: RunStory, *, window: float = SILENT_AFTER_S) -> list[Incident]:
    """The run's incidents in time order, without causes (the story alone: cheap enough for ``/runs``)."""
    deaths = sorted(_deaths(story), key=lambda d: (d.ts, d.rank))
    groups: list[list[ProcessDeath]] = []
    for d in deaths:
        # one incident: deaths close in time of processes already running when it began (a
        # process restarted after it that dies soon after is the next incident: a crash loop)
        if groups and d.ts - groups[-1][0].ts <= window and d.start <= groups[-1][0].ts:
            groups[-1].append(d)
        else:
            groups.append([d])
    exits = _closed_after(story)
    return sorted((_one(g, exits) for g in groups), key=lambda i: i.ts)


def count(story: RunStory) -> int:
    """How many incidents the run had (``/runs``' ``incidents``)."""
    return len(group(story))


def _leak(p: Process, *, runway: bool = True) -> F.Leak | None:
    """The process's leak; ``runway`` False for a cause (the OOM it projected has happened)."""
    if p.leak is None:
        return None
    low_high = p.leak.get("seconds_range") if runway else None
    return F.Leak(p.rank, p.host, p.leak["since_step"], p.ts_at(p.leak["since_step"]), round(p.leak["slope"], 1),
                  p.leak["source"], p.leak["steps_to_oom"] if runway else None,
                  p.leak["seconds_to_oom"] if runway else None,
                  None if low_high is None else round(low_high[0], 1),
                  None if low_high is None else round(low_high[1], 1))


def _fragmentation(p: Process) -> F.Fragmentation | None:
    if p.fragmentation_since is None or p.split_first is None or p.split_last is None:
        return None
    if p.split_last <= p.split_first:
        return None
    return F.Fragmentation(p.rank, p.host, p.fragmentation_since, p.split_last - p.split_first, p.split_last,
                           p.unused_last, p.retries_first, p.retries_last)


def _raise(p: Process, earlier: list[Process]) -> F.Raise | None:
    held = [q for q in earlier if q.oom_step is None and q.usual_tokens]
    usual = p.usual_tokens
    if not held or not usual:
        return None
    best = max(held, key=lambda q: q.usual_tokens or 0)
    held_tokens = best.usual_tokens or 0
    if usual <= held_tokens * 1.02:
        return None
    return F.Raise(p.rank, p.host, usual, held_tokens, best.last_step)


def _input_peak(p: Process) -> F.InputPeakFinding | None:
    usual = p.usual_tokens
    if not p.oom_tokens or not usual or p.oom_tokens <= p.tokens_max or p.oom_tokens < INPUT_PEAK_RATIO * usual:
        return None
    assert p.oom_step is not None
    return F.InputPeakFinding(p.rank, p.host, p.oom_step, p.oom_tokens, usual, p.tokens_max)


def _oom_cause(p: Process, earlier: list[Process]) -> F.Finding:
    found: F.Finding | None = _leak(p, runway=False) or _fragmentation(p) or _raise(p, earlier) or _input_peak(p)
    if found is not None:
        return found
    if p.oom_phase and p.oom_phase != "train":
        return F.PhasePeak(p.rank, p.host, p.oom_phase, p.oom_step or p.last_step, p.oom_peak, p.train_peak)
    return F.Unknown(p.last_headroom)


def _stop_cause(affected: list[Process]) -> F.Finding:
    for p in affected:
        leak = _leak(p, runway=False)
        if leak is not None:
            return leak
    rooms = [p.last_headroom for p in affected]
    totals = [p.total_bytes for p in affected if p.total_bytes]
    known = [h for h in rooms if h is not None]
    if known and len(known) == len(rooms) and totals:
        total = min(totals)
        if min(known) >= LOW_HEADROOM_FRACTION * total:
            hosts = [p.host_available_bytes for p in affected if p.host_available_bytes is not None]
            return F.NotMemory(len(affected), min(known), total, min(hosts) if hosts else None)
    return F.Unknown(min(known) if known else None)


def _explain(inc: Incident, procs: dict[tuple[str, int, str], Process], story: RunStory) -> None:
    lead = procs.get((inc.host, inc.rank, inc.incarnation))
    if lead is None or inc.kind == "suspected_oom":  # a suspicion's cause is set by group
        return
    by_rank = story.index()
    if inc.kind == "oom":
        rank_story = by_rank.get((inc.host, inc.rank))
        earlier = []
        if rank_story is not None:
            for x in rank_story.incarnations:
                if x.record.incarnation == inc.incarnation:
                    break
                q = procs.get((inc.host, inc.rank, x.record.incarnation))
                if q is not None:
                    earlier.append(q)
        inc.phase = lead.oom_phase or "train"
        finding = _oom_cause(lead, earlier)
    else:
        inc.phase = None
        affected = [p for p in procs.values() if p.rank in inc.ranks and p.first_ts <= inc.ts + SILENT_AFTER_S
                    and p.last_ts >= inc.ts - SILENT_AFTER_S and p.oom_step is None]
        finding = _stop_cause(affected or [lead])
    inc.finding, inc.cause = finding, finding.KIND
    if isinstance(finding, F.Leak | F.Fragmentation):
        inc.since_step = finding.since_step
    latest = by_rank.get((inc.host, inc.rank))
    died = getattr(latest.died, "cause", None) if latest is not None else None
    if died is not None and str(died) not in {str(o) for o in Outcome} and latest is not None \
            and latest.current.record.incarnation == inc.incarnation:
        inc.died_cause = str(died)


def open_findings(story: RunStory, procs: dict[tuple[str, int, str], Process]) -> list[F.Finding]:
    """What is still wrong in each rank's latest process (a leak, fragmentation), whatever its end."""
    out: list[F.Finding] = []
    for r in story.ranks:
        p = procs.get((r.host, r.rank, r.current.record.incarnation))
        if p is None or p.oom_step is not None:
            continue
        found = _leak(p) or _fragmentation(p)
        if found is not None:
            out.append(found)
    return out


def derive(story: RunStory, procs: dict[tuple[str, int, str], Process], *,
           snapshots: list[dict[str, Any]] | None = None, run_ref: str = "") -> Report:
    """Incidents with causes, open findings, and the next steps (``snapshots``: the run's stored
    snapshots, ``{"id", "rank", "step"}``, for the diff command; ``run_ref`` the run's name)."""
    incidents = group(story)
    for inc in incidents:
        _explain(inc, procs, story)
    still = open_findings(story, procs)
    return Report(incidents, still, next_steps(story.run or run_ref, incidents, still, snapshots or []))



__all__ = ["Incident", "Report", "count", "derive", "group", "open_findings"]
