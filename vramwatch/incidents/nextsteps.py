"""The next step: what to do after a run's incidents and with what is still open, in order, each
with the numbers it can be set to and the exact command where there is one.

Order: find a leak first (capture, then diff the rank's snapshots), fix it before any raise (a
leak brings every batch's OOM closer); the allocator setting for fragmentation; then the batch:
resume at what held after a raise, cap the input after an input peak, back off for a phase's
peak; after an OOM suspected from device memory the same steps said as a suspicion (confirm it
with the hook, back off if it was one, the allocator setting); ``hold`` when memory was not the
cause or nothing is wrong. Pure, O(incidents + findings).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from typing import Any

from vramwatch.incidents import findings as F
from vramwatch.incidents.incident import Incident
from vramwatch.units import gib, rate

ALLOCATOR_SETTING = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
#: the order next steps are taken in (a front joining shards' steps sorts by it)
ACTION_ORDER = ("diff_snapshots", "capture_snapshots", "fix_leak", "set_allocator", "resume", "cap_input",
                "back_off", "hold")


@dataclass(frozen=True)
class NextAction:
    action: str  # capture_snapshots | diff_snapshots | fix_leak | set_allocator | resume | cap_input | back_off | hold
    text: str
    rank: int | None = None
    command: str | None = None
    tokens_per_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _leak_steps(run: str, leak: F.Leak, snapshots: list[dict[str, Any]]) -> list[NextAction]:
    mine = sorted((s for s in snapshots if s.get("rank") == leak.rank and s.get("id") is not None),
                  key=lambda s: (s.get("step") or 0, str(s["id"])))
    out = []
    if len(mine) >= 2:
        old, new = mine[0], mine[-1]
        out.append(NextAction("diff_snapshots", f"see what grew on rank {leak.rank} between its snapshots at steps "
                            f"{old.get('step')} and {new.get('step')}: the growing allocation sites are the leak",
                            leak.rank, f"vramwatch snapshots diff {shlex.quote(str(old['id']))} "
                            f"{shlex.quote(str(new['id']))} --top 20"))
    else:
        capture = f"vramwatch capture {shlex.quote(run)} --rank {leak.rank}"
        out.append(NextAction("capture_snapshots", f"capture two allocator snapshots on rank {leak.rank}, a few "
                            f"hundred steps apart (it grows {rate(leak.slope_bytes_per_step)}), then diff them "
                            "with `vramwatch snapshots diff OLD NEW` (ids from /api/v1/runs/RUN/snapshots)",
                            leak.rank, capture))
    out.append(NextAction("fix_leak", f"fix the leak on rank {leak.rank} ({rate(leak.slope_bytes_per_step)} since "
                        f"step {leak.since_step:,}) before raising the batch: a restart does not fix it and a raise "
                        "only brings the OOM closer", leak.rank))
    return out


def _batch_step(finding: F.Finding) -> NextAction | None:
    if isinstance(finding, F.Raise):
        return NextAction("resume", f"resume at {finding.held_tokens_per_step:,} tokens per step per rank, the "
                        f"setting that held to step {finding.held_step:,}; raise again in smaller steps "
                        "(`vramwatch advise RUN` bounds the next one)", finding.rank,
                        tokens_per_step=finding.held_tokens_per_step)
    if isinstance(finding, F.InputPeakFinding):
        return NextAction("cap_input", f"cap a step's input at {finding.largest_held_tokens:,} tokens (the largest "
                        f"rank {finding.rank} held) or bucket inputs by length: the run's usual "
                        f"{finding.usual_tokens:,} fits, its longest inputs do not", finding.rank,
                        tokens_per_step=finding.largest_held_tokens)
    if isinstance(finding, F.PhasePeak):
        above = (None if finding.peak_bytes is None or finding.train_peak_bytes is None
                 else finding.peak_bytes - finding.train_peak_bytes)
        need = "" if above is None or above <= 0 else f" (it needs {gib(above)} above the training peak)"
        return NextAction("back_off", f"make room for {finding.phase}{need}: back off the batch one step of the "
                        "procedure, or lower the phase's own peak (save from CPU copies, smaller eval batch)",
                        finding.rank)
    return None


def _suspected_steps(run: str, f: F.SuspectedOomFinding) -> list[NextAction]:
    """What to do after an OOM suspected from device memory: what one does after an OOM (capture,
    back off, let the allocator grow segments), each said as the suspicion it is."""
    room = "" if f.headroom_bytes is None else f", {gib(f.headroom_bytes)} left"
    had = f"device used {gib(f.used_before_bytes)}{room} before its memory vanished"
    return [
        NextAction("capture_snapshots", f"confirm the suspected OOM on rank {f.rank} ({had}): run the next attempt "
                   "with the vramwatch hook, whose OOM counter confirms an OOM and whose allocator snapshots show "
                   "what filled the device", f.rank, f"vramwatch capture {shlex.quote(run)} --rank {f.rank}"),
        NextAction("back_off", f"if it was an OOM, make room on rank {f.rank} ({had}): back off the batch one step "
                   "of the procedure (`vramwatch advise RUN` bounds it)", f.rank),
        NextAction("set_allocator", f"if it was an OOM and rank {f.rank}'s free memory was split in blocks it "
                   "could not reuse (a hook's allocator fields show it), let the allocator grow segments instead",
                   f.rank, f"export {ALLOCATOR_SETTING}"),
    ]


def next_steps(run: str, incidents: list[Incident], still: list[F.Finding],
               snapshots: list[dict[str, Any]]) -> list[NextAction]:
    """The ordered next steps (see the module's docstring)."""
    out: list[NextAction] = []
    leaks: dict[int, F.Leak] = {}
    frags: dict[int, F.Fragmentation] = {}
    for f in [i.finding for i in incidents] + list(still):
        if isinstance(f, F.Leak):
            leaks.setdefault(f.rank, f)
        elif isinstance(f, F.Fragmentation):
            frags.setdefault(f.rank, f)
    for leak in leaks.values():
        out.extend(_leak_steps(run, leak, snapshots))
    for frag in frags.values():
        out.append(NextAction("set_allocator", f"rank {frag.rank}'s free memory is split in blocks it cannot reuse "
                            f"({gib(frag.split_bytes)}): let the allocator grow segments instead", frag.rank,
                            f"export {ALLOCATOR_SETTING}"))
    seen: set[str] = set()
    for inc in incidents:
        step = None if inc.finding is None else _batch_step(inc.finding)
        if step is not None and step.action not in seen:
            seen.add(step.action)
            out.append(step)
    taken = {(n.action, n.rank) for n in out}
    for inc in incidents:
        if isinstance(inc.finding, F.SuspectedOomFinding):
            fresh = [n for n in _suspected_steps(run, inc.finding) if (n.action, n.rank) not in taken]
            taken.update((n.action, n.rank) for n in fresh)
            out.extend(fresh)
    if any(i.cause == "not_memory" for i in incidents) and not out:
        stop = next(i for i in incidents if i.cause == "not_memory")
        why = (f"why rank {stop.rank} was killed (the host's kernel log for the OOM-killer, the scheduler)"
               if stop.kind == "death" else "why the job stopped (a hang in a collective, the launcher's, NCCL's logs)")
        out.append(NextAction("hold", f"keep the batch: memory was not the cause; look around step {stop.step:,} "
                            f"for {why}", stop.rank))
    if not out and not incidents:
        out.append(NextAction("hold", "nothing to change: no incident and nothing open"))
    if not out:
        out.append(NextAction("capture_snapshots", "the cause is unknown: capture allocator snapshots on the next "
                            "run so an OOM leaves its own evidence", None, f"vramwatch capture {shlex.quote(run)}"))
    return out


__all__ = ["ACTION_ORDER", "ALLOCATOR_SETTING", "NextAction", "next_steps"]
