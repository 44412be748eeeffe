"""In-memory live state: one TrendEngine and the latest samples per series.

Everything a scrape or a dashboard poll needs is here, so neither touches the database.
After a restart the state is rebuilt by replaying the store through the same engines,
so verdicts continue where they left off (no spurious plateau breaks).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vramwatch.wire import Sample

SeriesKey = tuple[str, str, int]

#: Engine events kept per series for the API (the engine keeps its own bounded list too).
EVENTS_KEPT = 500

STATE_SEVERITY = {"leak": 4, "fragmentation": 3, "rising": 2, "warmup": 1, "plateau": 0}


@dataclass
class SeriesState:
    run: str
    host: str
    rank: int
    engine: Any
    incarnation: str = ""
    uuid: str | None = None
    gpu: int | None = None
    local_rank: int | None = None
    last: Sample | None = None
    last_train: Sample | None = None
    samples: int = 0
    late_samples: int = 0
    last_seen: float = 0.0
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    # (step, phases seen at that step) of the current incarnation: resends and late
    # arrivals (spool replay) are stored but not fed to the engine out of order.
    _frontier_step: int = -1
    _frontier_phases: set[str] = field(default_factory=set)

    @property
    def key(self) -> SeriesKey:
        return (self.run, self.host, self.rank)

    def accepts(self, sample: Sample) -> bool:
        incarnation = sample.get("incarnation", "")
        step = sample["step"]
        if incarnation != self.incarnation:
            return True
        if step > self._frontier_step:
            return True
        return step == self._frontier_step and sample["phase"] not in self._frontier_phases

    def advance(self, sample: Sample) -> None:
        incarnation = sample.get("incarnation", "")
        step = sample["step"]
        if incarnation != self.incarnation or step != self._frontier_step:
            self._frontier_phases = set()
        self.incarnation = incarnation
        self._frontier_step = step
        self._frontier_phases.add(sample["phase"])


def collector_engine() -> Any:
    """The collector's per-series engine: the trend engine plus the decision figures
    (largest tokens per step, readiness; vramwatch.decisions.live)."""
    from vramwatch.decisions.live import DecisionEngine

    return DecisionEngine()


class LiveState:
    """Thread-safe map of series → state. ``ingest`` is called by the single writer."""

    def __init__(self, engine_factory: Callable[[], Any] = collector_engine) -> None:
        self._engine_factory = engine_factory
        self._series: dict[SeriesKey, SeriesState] = {}
        self._lock = threading.Lock()

    def ingest(self, samples: Iterable[Sample], received_at: float | None = None) -> list[dict[str, Any]]:
        """Feed new samples to their engines; returns the events they raised (with identity)."""
        now = time.time() if received_at is None else received_at
        raised: list[dict[str, Any]] = []
        with self._lock:
            for s in samples:
                key = (s["run"], s["host"], s["rank"])
                state = self._series.get(key)
                if state is None:
                    state = SeriesState(run=key[0], host=key[1], rank=key[2], engine=self._engine_factory())
                    self._series[key] = state
                state.samples += 1
                state.last_seen = now
                if not state.accepts(s):
                    state.late_samples += 1
                    continue
                state.advance(s)
                state.uuid = s.get("uuid", state.uuid)
                state.gpu = s.get("gpu", state.gpu)
                state.local_rank = s.get("local_rank", state.local_rank)
                state.last = s
                if s["phase"] == "train":
                    state.last_train = s
                for event in state.engine.update(s):
                    state.events.append(event)
                    raised.append({"run": key[0], "host": key[1], "rank": key[2], **event})
        return raised

    def rebuild(self, samples: Iterable[Sample]) -> int:
        """Replay stored samples (per series, in step order) to restore engine state."""
        count = 0
        batch: list[Sample] = []
        for s in samples:
            batch.append(s)
            if len(batch) >= 5000:
                self.ingest(batch, received_at=s["ts"])
                count += len(batch)
                batch = []
        if batch:
            self.ingest(batch, received_at=batch[-1]["ts"])
            count += len(batch)
        with self._lock:
            for state in self._series.values():
                # last_seen is the collector's receive time; after a replay the best we
                # know is the sample's own timestamp.
                if state.last is not None:
                    state.last_seen = state.last["ts"]
        return count

    def snapshot(self) -> list[SeriesState]:
        with self._lock:
            return list(self._series.values())

    def get(self, run: str, host: str, rank: int) -> SeriesState | None:
        with self._lock:
            return self._series.get((run, host, rank))

    def for_run(self, run: str) -> list[SeriesState]:
        with self._lock:
            return sorted((s for s in self._series.values() if s.run == run), key=lambda s: (s.rank, s.host))

    def run_summaries(self) -> list[dict[str, Any]]:
        """One row per run: worst rank's state, min headroom, soonest OOM, last sample."""
        runs: dict[str, dict[str, Any]] = {}
        for state in self.snapshot():
            row = runs.setdefault(state.run, {
                "run": state.run, "ranks": 0, "hosts": set(), "samples": 0, "last_ts": None,
                "last_step": None, "worst_state": None, "worst_rank": None, "min_headroom_bytes": None,
                "seconds_to_oom": None, "last_seen": 0.0,
            })
            row["ranks"] += 1
            row["hosts"].add(state.host)
            row["samples"] += state.samples
            row["last_seen"] = max(row["last_seen"], state.last_seen)
            if state.last is not None:
                ts, step = state.last["ts"], state.last["step"]
                row["last_ts"] = ts if row["last_ts"] is None else max(row["last_ts"], ts)
                row["last_step"] = step if row["last_step"] is None else max(row["last_step"], step)
            summary = state.engine.summary()
            st = summary.get("state")
            if st is not None and (
                row["worst_state"] is None or STATE_SEVERITY.get(st, 0) > STATE_SEVERITY.get(row["worst_state"], 0)
            ):
                row["worst_state"], row["worst_rank"] = st, state.rank
            headroom = summary.get("headroom_bytes")
            if headroom is not None and (row["min_headroom_bytes"] is None or headroom < row["min_headroom_bytes"]):
                row["min_headroom_bytes"] = headroom
            eta = summary.get("seconds_to_oom")
            if eta is not None and (row["seconds_to_oom"] is None or eta < row["seconds_to_oom"]):
                row["seconds_to_oom"] = eta
        out = []
        for row in runs.values():
            row["hosts"] = len(row["hosts"])
            out.append(row)
        out.sort(key=lambda r: -(r["last_seen"] or 0))
        return out
