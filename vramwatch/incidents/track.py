"""The evidence of each process, folded from a run's samples with one trend engine per rank.

Feed the samples of each process in step order and the processes of a rank in their order (the
store's ``iter_samples`` gives both). One :class:`~vramwatch.engine.TrendEngine` per rank sees
its processes one after the other, so a restarted process is judged against its rank's leak
(the engine keeps it as the baseline). Per process :class:`Process` keeps O(1): first and last
moments, the OOM sample's phase and input, the engine's leak and fragmentation, the inactive
split and retry counters, the tokens' mean and largest. Cost: the engine's update per sample
(microseconds), memory O(processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.engine import TrendEngine
from vramwatch.runlife import RunLife, SuspectedOom
from vramwatch.verdicts import sample_headroom
from vramwatch.wire import Sample

ProcessKey = tuple[str, int, str]  # (host, rank, incarnation)


@dataclass
class Process:
    """What one process showed, as far as the incidents' causes need it."""

    host: str
    rank: int
    incarnation: str
    first_step: int
    first_ts: float
    last_step: int = 0
    last_ts: float = 0.0
    last_headroom: int | None = None
    total_bytes: int | None = None
    host_available_bytes: int | None = None
    oom_step: int | None = None
    oom_phase: str | None = None
    oom_tokens: int | None = None
    oom_peak: int | None = None
    train_peak: int | None = None  # the largest training peak before the OOM
    tokens_n: int = 0
    tokens_sum: int = 0
    tokens_max: int = 0
    split_first: int | None = None
    split_last: int | None = None
    retries_first: int | None = None
    retries_last: int | None = None
    unused_last: int | None = None
    leak: dict[str, Any] | None = None  # the engine's summary while leaking at the process's end
    fragmentation_since: int | None = None
    last: Sample | None = None  # the latest sample (by time)

    @property
    def usual_tokens(self) -> int | None:
        return round(self.tokens_sum / self.tokens_n) if self.tokens_n else None

    def ts_at(self, step: int) -> float | None:
        """The wall time of ``step`` in this process, interpolated between its first and last samples."""
        if self.last_step <= self.first_step:
            return self.first_ts
        frac = min(1.0, max(0.0, (step - self.first_step) / (self.last_step - self.first_step)))
        return self.first_ts + frac * (self.last_ts - self.first_ts)

    def finish(self) -> None:
        """Read what the latest sample says (once, when the process's samples are all in)."""
        s = self.last
        if s is not None:
            self.last_headroom = sample_headroom(s)
            self.total_bytes = s.get("total_bytes") or self.total_bytes
            self.host_available_bytes = s.get("host_available_bytes", self.host_available_bytes)

    def feed(self, s: Sample, oomed: bool) -> None:
        step, phase = s["step"], s["phase"]
        if s["ts"] >= self.last_ts:
            self.last_step, self.last_ts, self.last = step, s["ts"], s
        if oomed and self.oom_step is None:
            self.oom_step, self.oom_phase = step, phase
            self.oom_tokens, self.oom_peak = s.get("tokens"), s.get("peak_allocated_bytes")
            return
        if phase != "train" or self.oom_step is not None:
            return
        tokens, peak = s.get("tokens"), s.get("peak_allocated_bytes")
        if tokens:
            self.tokens_n += 1
            self.tokens_sum += tokens
            self.tokens_max = max(self.tokens_max, tokens)
        if peak is not None:
            self.train_peak = peak if self.train_peak is None else max(self.train_peak, peak)
        split, retries = s.get("inactive_split_bytes"), s.get("alloc_retries")
        if split is not None:
            self.split_first = split if self.split_first is None else self.split_first
            self.split_last = split
        if retries is not None:
            self.retries_first = retries if self.retries_first is None else self.retries_first
            self.retries_last = retries
        allocated, reserved = s.get("allocated_bytes"), s.get("reserved_bytes")
        if allocated is not None and reserved is not None:
            self.unused_last = max(0, reserved - allocated)


class Tracker:
    """Feed a run's samples (:meth:`feed`); :meth:`processes` once every sample is in."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, int], TrendEngine] = {}
        self._current: dict[tuple[str, int], Process] = {}
        self._oom_count: dict[tuple[str, int], int] = {}
        self.done: dict[ProcessKey, Process] = {}
        #: the OOMs the engines suspected from device memory, by (host, rank): for a fold that ran no engine
        self.suspected: list[tuple[str, int, SuspectedOom]] = []

    def feed(self, s: Sample) -> None:
        rank_key = (s["host"], s["rank"])
        incarnation = s.get("incarnation") or ""
        proc = self._current.get(rank_key)
        if proc is None or proc.incarnation != incarnation:
            if proc is not None:
                self._close(rank_key, proc)
            proc = self.done.get((s["host"], s["rank"], incarnation))  # a late sample of an earlier one
            if proc is None:
                proc = Process(s["host"], s["rank"], incarnation, s["step"], s["ts"], s["step"], s["ts"])
                self._oom_count[rank_key] = 0
            self._current[rank_key] = proc
        ooms = s.get("ooms") or 0
        oomed = bool(s.get("oom_marked")) or ooms > self._oom_count.get(rank_key, 0)
        self._oom_count[rank_key] = max(ooms, self._oom_count.get(rank_key, 0))
        engine = self._engines.get(rank_key)
        if engine is None:
            engine = self._engines[rank_key] = TrendEngine()
        events = engine.update(s)  # type: ignore[arg-type]  # read, never kept past the next block
        for event in events:
            if event["type"] == "fragmentation" and proc.fragmentation_since is None:
                proc.fragmentation_since = event["step"]
            elif event["type"] == "suspected_oom":
                self.suspected.append((s["host"], s["rank"], SuspectedOom.of(event, s["ts"])))
        proc.feed(s, oomed)
        if events or oomed:  # the leak as it stands: read when the engine says something, and at the end
            self._note_state(engine, proc)

    @staticmethod
    def _note_state(engine: TrendEngine, proc: Process) -> None:
        if proc.oom_step is not None and proc.leak is not None:
            return  # the leak as it stood when the process ran out of memory
        if engine.state == "leak" and engine.leak.current is not None:
            leak = engine.leak.current
            proc.leak = {"since_step": leak.onset, "slope": leak.slope, "source": leak.source,
                         "steps_to_oom": leak.steps, "seconds_to_oom": leak.seconds,
                         "seconds_range": leak.seconds_range}
        elif engine.state != "leak" and proc.oom_step is None:
            proc.leak = None

    def _close(self, rank_key: tuple[str, int], proc: Process) -> None:
        """The process's samples are in (the engine has not seen the next one's yet)."""
        engine = self._engines.get(rank_key)
        if engine is not None:
            self._note_state(engine, proc)
        proc.finish()
        self.done[(proc.host, proc.rank, proc.incarnation)] = proc

    def tell(self, life: RunLife) -> None:
        """Tell a run's fold the OOMs the engines suspected (a fold fed the samples alone)."""
        for host, rank, found in self.suspected:
            life.rank(host, rank).suspect(found)

    def processes(self) -> dict[ProcessKey, Process]:
        """Every process seen, by (host, rank, incarnation)."""
        for rank_key, proc in self._current.items():
            self._close(rank_key, proc)
        self._current.clear()
        return self.done


__all__ = ["Process", "ProcessKey", "Tracker"]
