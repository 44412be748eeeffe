"""Post-mortem of a run whose ranks stopped: who failed first, when, and why.

How each rank ended, the run's status and the first failure are :mod:`vramwatch.runlife`'s
judgement (the same model ``/runs``, ``/ranks``, the report and ``/metrics`` read); this module
adds what the model does not keep: each rank's last sample and headroom, and what every rank
held at the moment of the first failure.

Input is the run's samples in any order of series (the store's ``iter_samples(run)`` or a
trace file), read in two passes: the first folds them into the model and keeps each rank's
latest sample, the second finds what every other rank held at the first failure. A caller that
has the run judged already (a collector's live state, the report) passes its story: one read, no
fold. Memory is O(ranks).

``end`` of a rank is its latest process's outcome (:class:`vramwatch.verdicts.Outcome`):
``oom``, ``killed`` (killed alone: the others went on for longer than the silence window),
``stopped`` (stopped with the job), a cause its last words name (``cuda_error``,
``collective_timeout``, ``crash``, ``checkpoint_failed``, ``exception``: :mod:`vramwatch.causes`),
``exited`` (a clean ``close()``), ``ended`` (a source without end markers) or ``running``.
The first failure carries the failing process's last words and, for a culprit, its victims
(the ranks that then timed out waiting for it in a collective). A rank whose OOM was followed by a restart still counts
its OOM: the first failure is the earliest OOM or death of any process, whatever happened
after (a rank stopped with the job is named only when nothing else failed: it is a victim).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from vramwatch import incidents as _incidents
from vramwatch import runlife
from vramwatch.evidence.foreign import holds
from vramwatch.evidence.suspects import LeakSuspects, render_lines
from vramwatch.probe.processes import ForeignProcess
from vramwatch.units import gib
from vramwatch.verdicts import SILENT_AFTER_S, Outcome, device_need_bytes, sample_headroom
from vramwatch.wire import Sample, series_key

ENDS = tuple(str(o) for o in Outcome)

SeriesKey = tuple[str, str, int]


@dataclass(frozen=True)
class FailureReport:
    rank: int
    host: str
    step: int
    ts: float
    cause: str
    detail: str
    #: what the failing process said ({type, message, phase}), None if it said nothing
    last_words: dict[str, str] | None = None
    #: the ranks that then died timing out in a collective: the culprit's victims, [{host, rank}]
    victims: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RankEnd:
    rank: int
    host: str
    last_step: int
    last_ts: float
    end: str  # its latest process's outcome
    ooms: int
    headroom_bytes: int | None
    #: what the rank held when the first failure happened (its last sample at or before it)
    held_at_failure_bytes: int | None = None
    headroom_at_failure_bytes: int | None = None
    last_sample: dict[str, Any] = field(default_factory=dict)
    liveness: str = ""
    died: dict[str, Any] | None = None  # {"cause", "step", "ts"} while its latest process is dead
    restarts: int = 0
    deaths: int = 0
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
    status: str  # vramwatch.verdicts.RunStatus
    first_failure: FailureReport | None
    ranks: list[RankEnd]
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    tally: dict[str, int] = field(default_factory=dict)  # runlife.RunTally: a front adds shards' up
    #: leaking ranks' growing allocation sites between two of their snapshots
    suspects: list[LeakSuspects] = field(default_factory=list)
    #: the failures in time order with their causes, what is still wrong, and what to do next
    #: (:mod:`vramwatch.incidents`; a front merges shards' documents, hence the JSON form)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    open_findings: list[dict[str, Any]] = field(default_factory=list)
    next: list[dict[str, Any]] = field(default_factory=list)
    report: _incidents.Report | None = field(default=None, repr=False)  # the typed form of the three

    def refresh_next(self) -> None:
        """Re-decide the next steps once the run's snapshots are known (the diff command names their ids)."""
        if self.report is not None:
            self.report.next = _incidents.next_steps(self.run, self.report.incidents, self.report.open_findings,
                                                     self.snapshots)
            self.next = [n.to_dict() for n in self.report.next]

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "status": self.status,
                "first_failure": None if self.first_failure is None else asdict(self.first_failure),
                "ranks": [r.to_dict() for r in self.ranks], "snapshots": list(self.snapshots),
                "suspects": [s.to_dict() for s in self.suspects], "tally": dict(self.tally),
                "incidents": list(self.incidents), "open_findings": list(self.open_findings), "next": list(self.next)}


def _read(samples: Iterable[Sample], tracker: _incidents.Tracker | None, *, fold: bool = True,
          failed_at: float | None = None
          ) -> tuple[dict[str, runlife.RunLife], dict[SeriesKey, Sample], dict[SeriesKey, Sample],
                     dict[SeriesKey, Sample]]:
    """One pass: the model's fold (unless ``fold`` is off: the caller has the judgement), each
    rank's latest sample (by time), its first OOM sample and, when the first failure's time is
    known (``failed_at``), its latest sample at or before it; ``tracker`` (when given) folds each
    process's evidence for the incidents' causes."""
    last: dict[SeriesKey, Sample] = {}
    first_oom: dict[SeriesKey, Sample] = {}
    at_failure: dict[SeriesKey, Sample] = {}
    lives: dict[str, runlife.RunLife] = {}
    for s in samples:
        if tracker is not None:
            tracker.feed(s)
        if fold:
            life = lives.get(s["run"])
            if life is None:
                life = lives[s["run"]] = runlife.RunLife(s["run"])
            life.feed(s)
        key = series_key(s)
        prev = last.get(key)
        if prev is None or (s["ts"], s["step"]) >= (prev["ts"], prev["step"]):
            last[key] = s
        if (s.get("ooms") or s.get("oom_marked")) and (key not in first_oom or s["ts"] < first_oom[key]["ts"]):
            first_oom[key] = s
        if failed_at is not None and s["ts"] <= failed_at:
            prev = at_failure.get(key)
            if prev is None or s["ts"] >= prev["ts"]:
                at_failure[key] = s
    return lives, last, first_oom, at_failure


def _detail(f: runlife.Failure, story: runlife.RunStory, oom_sample: Sample | None) -> str:
    said = f.last_words
    named = ", ".join(str(r) for _, r in f.victims[:8]) + (" ..." if len(f.victims) > 8 else "")
    victims = f"; {len(f.victims)} rank(s) then timed out waiting for it in a collective: {named}" if f.victims else ""
    if said is not None and f.cause != Outcome.OOM:
        return f"{said.type}: {said.message or '(no message)'} in phase {said.phase}{victims}"
    return _silent_detail(f, story, oom_sample) + victims


def _silent_detail(f: runlife.Failure, story: runlife.RunStory, oom_sample: Sample | None) -> str:
    if f.cause == Outcome.OOM:
        extra = oom_sample.get("extra") if oom_sample is not None else None
        free = extra.get("oom_device_free_bytes") if isinstance(extra, dict) else None
        return "CUDA out of memory" + (f" with {gib(free, 2)} free on the device" if free else "")
    if f.cause == Outcome.KILLED:
        went_on = (story.last.ts if story.last is not None else f.ts) - f.ts
        return (f"stopped sending while the other ranks went on for {went_on:.0f} s: "
                "killed alone (SIGKILL, the host's OOM-killer, a lost node)")
    rank = story.rank(f.host, f.rank)
    window = rank.window_s if rank is not None else SILENT_AFTER_S
    return ("stopped with the rest of the job within its "
            f"{window:.0f} s silence window and no clean close: a job-wide stop (a hang in a collective, then a kill "
            "of the job, or a launcher restarting every rank)")


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
    silent_after_s: float | None = None,
    story: runlife.RunStory | None = None,
    kept_suspected: runlife.SuspectedRecords | None = None,
) -> PostMortem:
    """The post-mortem of ``run``; ``samples`` is called once or twice (streaming passes).

    ``story``: the run as a collector's live state judged it (the route and the report pass it, so
    the post-mortem and ``/runs`` read one judgement): the samples are read once and not folded.
    Without it the first pass folds and judges them at ``now``, a second finds what each rank held
    at the first failure. ``kept_suspected``: the OOMs suspected from device memory as a store kept
    them (``Store.suspected_records``), told to that fold with its engines' own."""
    failed_at = None if story is None or story.first_failure is None else story.first_failure.ts
    tracker = _incidents.Tracker()
    lives, last, oom_samples, at_failure = _read(samples(), tracker, fold=story is None, failed_at=failed_at)
    if not last or (story is None and run not in lives):
        return PostMortem(run=run, status=str(runlife.RunTally().status), first_failure=None, ranks=[])
    if story is None:
        tracker.tell(lives[run])  # the OOMs its engines suspected from device memory
        lives[run].add_suspected(kept_suspected)  # and those kept before the samples went
        story = runlife.judge(run, lives[run].ranks(), now, silent_after_s=silent_after_s)
    f = story.first_failure
    first = None
    if f is not None:
        detail = _detail(f, story, oom_samples.get((run, f.host, f.rank)))
        first = FailureReport(f.rank, f.host, f.step, f.ts, str(f.cause), detail,
                              None if f.last_words is None else f.last_words.as_dict(),
                              [{"host": h, "rank": r} for h, r in f.victims])
        if failed_at is None:
            at_failure = _read(samples(), None, fold=False, failed_at=first.ts)[3]
    ranks = []
    for r in story.ranks:
        key = (run, r.host, r.rank)
        latest, snap = last[key], at_failure.get(key)
        ranks.append(RankEnd(
            rank=r.rank, host=r.host, last_step=latest["step"], last_ts=latest["ts"], end=str(r.outcome),
            ooms=r.ooms, headroom_bytes=sample_headroom(latest),
            held_at_failure_bytes=_held(snap) if snap else None,
            headroom_at_failure_bytes=sample_headroom(snap) if snap else None,
            last_sample=dict(latest), liveness=str(r.liveness), died=None if r.died is None else r.died.as_dict(),
            restarts=r.restarts, deaths=r.deaths,
        ))
    report = _incidents.derive(story, tracker.processes())
    if first is not None and first.cause == str(Outcome.STOPPED) and any(
            i.kind == "death" and i.rank == first.rank and i.host == first.host for i in report.incidents):
        # the model's silence window called it stopped, but peers went on to a clean close after it
        first = replace(first, detail="stopped while the other ranks went on to a clean close: it died alone "
                                      "(SIGKILL, the host's OOM-killer, a lost node)")
    return PostMortem(run=run, status=str(story.status), first_failure=first, ranks=ranks,
                      tally=story.tally.as_dict(), report=report, **report.to_dict())


def from_dict(doc: dict[str, Any]) -> PostMortem:
    """A post-mortem document (the API's, or a front's merge of several) as a typed record."""
    first = doc.get("first_failure")
    fields = {f for f in RankEnd.__dataclass_fields__} - {"foreign_processes"}
    return PostMortem(
        run=doc.get("run", ""), status=doc.get("status") or "",
        first_failure=FailureReport(**{k: first[k] for k in FailureReport.__dataclass_fields__ if k in first})
        if first else None,
        ranks=[RankEnd(**{k: v for k, v in r.items() if k in fields},
                       foreign_processes=tuple(ForeignProcess.from_dict(p) for p in r.get("foreign_processes", ())))
               for r in doc.get("ranks", [])],
        snapshots=list(doc.get("snapshots", [])), tally=dict(doc.get("tally") or {}),
        suspects=[LeakSuspects.from_dict(s) for s in doc.get("suspects", [])],
        incidents=list(doc.get("incidents") or []), open_findings=list(doc.get("open_findings") or []),
        next=list(doc.get("next") or []),
    )


def when(ts: float) -> str:
    """A sample time as a person reads it: date, time and the zone (this machine's local time)."""
    return datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z (UTC%z)")


def render_text(pm: PostMortem) -> str:
    """The human summary printed by ``vramwatch postmortem``."""
    lines = [f"run {pm.run}: {pm.status}"]
    f = pm.first_failure
    if f is None:
        lines.append("no rank failed")
    else:
        lines.append(f"first failure: rank {f.rank} on {f.host} at step {f.step} ({when(f.ts)}): "
                     f"{f.cause} — {f.detail}")
    for r in pm.ranks:
        head = gib(r.headroom_bytes, 2, none="—")
        held = "" if r.held_at_failure_bytes is None else f", held {gib(r.held_at_failure_bytes, 2)} at the failure"
        lines.append(f"  rank {r.rank:>4} {r.host}: {r.end:<7} last step {r.last_step} ({when(r.last_ts)}), "
                     f"headroom {head}{held}" + (f", {r.ooms} OOM" if r.ooms else "")
                     + (f", {r.restarts} restart(s)" if r.restarts else ""))
        said, culprit = (r.died or {}).get("last_words"), (r.died or {}).get("culprit")
        if said:
            message = f": {said['message']}" if said["message"] else ""
            lines.append(f"    last words ({said['phase']}): {said['type']}{message}"
                         + (f" (waiting for rank {culprit['rank']})" if culprit else ""))
        lines.extend(f"    {holds(p, r.foreign_device)}" for p in r.foreign_processes)
    for snap in pm.snapshots:
        lines.append(f"  snapshot: rank {snap.get('rank')} step {snap.get('step')} ({snap.get('trigger')}) "
                     f"{snap.get('url', '')}")
    lines.extend(render_lines(pm.suspects))
    lines.extend(story_lines(pm))
    return "\n".join(lines)


def story_lines(pm: PostMortem) -> list[str]:
    """The incidents in time order, what is still open, and the next steps: each line the text of
    a typed finding (:mod:`vramwatch.incidents`), rendered where its numbers are."""
    lines = [f"incident {n}: {when(i['ts'])}: {i['text']}" for n, i in enumerate(pm.incidents, 1)]
    if not pm.incidents:
        lines.append("no incident")
    lines.extend(f"still open: {f['text']}" for f in pm.open_findings)
    for n, step in enumerate(pm.next, 1):
        lines.append(f"next {n}. {step['text']}" + (f"\n     $ {step['command']}" if step.get("command") else ""))
    return lines
