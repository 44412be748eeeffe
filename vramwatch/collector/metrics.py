"""Prometheus exposition of the collector's live state.

A scrape reads only in-memory state (``LiveState.snapshot()`` and each series' engine
summary): no database I/O. One custom collector yields the per-rank families; ingest
counters, the latency histogram and ``vramwatch_build_info`` are ordinary
prometheus_client metrics in a side registry.

Labels follow dcgm-exporter's spelling (``Hostname``, ``UUID``, ``gpu``) so PromQL can
join vramwatch series with ``DCGM_FI_DEV_FB_USED`` on ``UUID``.

``render`` has a fast path: prometheus_client's generic encoder spends ~15 µs per sample
(1.8 s for 4096 ranks x 25 series, docs/benchmarks.md), so the per-rank families are written straight
to text from cached label strings. ``collect()`` yields the same samples through the
standard API; a test checks that both paths agree.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from vramwatch import verdicts
from vramwatch.__about__ import __version__
from vramwatch.decisions.readiness import VERDICTS as READINESS_VERDICTS

#: Label names of every per-rank family, in exposition order. ``Hostname``/``UUID``/``gpu``
#: are spelled as dcgm-exporter spells them.
SERIES_LABELS = ("run", "rank", "Hostname", "UUID", "gpu")

#: Engine states; ``vramwatch_trend_state`` has one series per state per rank.
TREND_STATES = ("warmup", "plateau", "rising", "leak", "fragmentation")

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text"

Row = tuple[str, dict, dict | None, dict, Any, int, int]  # labels, last, last_train, summary, series,
#                                                        phase ratchets, checkpoints

#: Plateau-break causes that are the training loop itself; any other cause names the phase
#: (checkpoint, eval, ...) whose peak made the allocator keep more segments.
_LOOP_CAUSES = frozenset({"allocated", "reserved", None})


_READINESS = {verdict: i for i, verdict in enumerate(READINESS_VERDICTS)}  # 0 ready, 1 not_ready, 2 unsafe


def _sample(field: str) -> Callable[[Row], Any]:
    return lambda row: row[1].get(field)


def _summary(key: str) -> Callable[[Row], Any]:
    return lambda row: row[3].get(key)


def _headroom(row: Row) -> int | None:
    # Judged on the latest training step, not on a checkpoint/eval sample: those spikes
    # have their own family (checkpoint_headroom) and would make this gauge flap.
    sample = row[2] or row[1]
    return verdicts.sample_headroom(sample)


def _outside_allocator(row: Row) -> int | float | None:
    value = row[3].get("outside_allocator_bytes")
    if value is not None:
        return value
    sample = row[2] or row[1]
    # NVML unavailable: no number rather than a fake one
    return verdicts.outside_allocator_bytes(sample.get("reserved_bytes"), sample.get("nvml_used_bytes"))


def _fragmentation(row: Row) -> int | None:
    flag = row[3].get("fragmentation")
    return None if flag is None else int(bool(flag))


#: (name, type, help, getter). Counters are named without ``_total``; the suffix is added
#: on exposition as prometheus_client does. A getter returning None skips the sample.
SERIES_FAMILIES: tuple[tuple[str, str, str, Callable[[Row], Any]], ...] = (
    ("vramwatch_memory_allocated_bytes", "gauge",
     "Bytes held by live tensors (torch allocated_bytes) in the latest sample.", _sample("allocated_bytes")),
    ("vramwatch_memory_reserved_bytes", "gauge",
     "Bytes reserved by the caching allocator in the latest sample.", _sample("reserved_bytes")),
    ("vramwatch_memory_peak_allocated_bytes", "gauge",
     "Peak allocated bytes since the previous sample.", _sample("peak_allocated_bytes")),
    ("vramwatch_memory_active_bytes", "gauge",
     "Active bytes (allocated plus blocks awaiting cross-stream frees).", _sample("active_bytes")),
    ("vramwatch_inactive_split_bytes", "gauge",
     "Free bytes inside split allocator segments (not releasable).", _sample("inactive_split_bytes")),
    ("vramwatch_device_used_bytes", "gauge",
     "Device-wide used bytes reported by NVML (absent when NVML is unavailable).", _sample("nvml_used_bytes")),
    ("vramwatch_process_used_bytes", "gauge",
     "Bytes NVML attributes to the training process.", _sample("process_used_bytes")),
    ("vramwatch_device_total_bytes", "gauge", "Device memory capacity in bytes.", _sample("total_bytes")),
    ("vramwatch_foreign_used_bytes", "gauge",
     "Device memory NVML lists for other processes on this GPU (a stale notebook kernel, another job).",
     _sample("foreign_used_bytes")),
    ("vramwatch_host_rss_bytes", "gauge", "Resident host memory of the training process.", _sample("host_rss_bytes")),
    ("vramwatch_host_children_rss_bytes", "gauge",
     "Resident host memory of the training process's children (DataLoader workers).",
     _sample("host_children_rss_bytes")),
    ("vramwatch_host_available_bytes", "gauge", "MemAvailable of the node.", _sample("host_available_bytes")),
    ("vramwatch_host_pinned_bytes", "gauge", "Pinned host memory held by torch's host allocator.",
     _sample("host_pinned_bytes")),
    ("vramwatch_headroom_bytes", "gauge",
     "Capacity minus what the device holds at the latest training step boundary "
     "(vramwatch.verdicts.headroom_bytes).", _headroom),
    ("vramwatch_outside_allocator_bytes", "gauge",
     "NVML used minus allocator reserved: CUDA context, NCCL, cuBLAS workspaces, other leaks.",
     _outside_allocator),
    ("vramwatch_alloc_retries", "counter",
     "Allocator retries (cudaMalloc failed, caches flushed, retried) in this process.", _sample("alloc_retries")),
    ("vramwatch_ooms", "counter", "Out-of-memory errors raised by the allocator in this process.", _sample("ooms")),
    ("vramwatch_plateau_breaks", "counter",
     "Plateau breaks the trend engine found on this rank since the collector started.",
     _summary("plateau_breaks")),
    ("vramwatch_phase_ratchets", "counter",
     "Plateau breaks caused by a checkpoint/eval phase whose segments the allocator kept "
     "(included in vramwatch_plateau_breaks_total).", lambda row: row[5]),
    ("vramwatch_checkpoints", "counter",
     "Checkpoint phases the trend engine saw on this rank since the collector started (0 until the first).",
     lambda row: row[6]),
    ("vramwatch_plateau_bytes", "gauge", "Level of the current or last memory plateau.", _summary("plateau_bytes")),
    ("vramwatch_leak_slope_bytes_per_step", "gauge",
     "Robust growth slope of memory at step boundaries.", _summary("slope_bytes_per_step")),
    ("vramwatch_steps_to_oom", "gauge",
     "Projected steps until the device is full at the current slope (present while growing).",
     _summary("steps_to_oom")),
    ("vramwatch_seconds_to_oom", "gauge",
     "Projected seconds until the device is full at the current slope (present while growing).",
     _summary("seconds_to_oom")),
    ("vramwatch_fragmentation", "gauge", "1 when the engine sees allocator fragmentation growing.", _fragmentation),
    ("vramwatch_checkpoint_peak_bytes", "gauge",
     "Peak allocated bytes of the latest checkpoint phase.", _summary("checkpoint_peak_bytes")),
    ("vramwatch_checkpoint_headroom_bytes", "gauge",
     "Headroom left at the peak of the latest checkpoint phase.", _summary("checkpoint_headroom_bytes")),
    # decisions (vramwatch.decisions.live.DecisionEngine adds these summary keys)
    ("vramwatch_max_tokens_per_step", "gauge",
     "Largest tokens per step this rank can take keeping 5% of the device free at its worst phase.",
     _summary("max_tokens_per_step")),
    ("vramwatch_tokens_per_step_max_observed", "gauge",
     "Largest tokens per step this rank has run.", _summary("tokens_per_step_max_observed")),
    ("vramwatch_readiness", "gauge",
     "Readiness of the batch setting: 0 ready, 1 not_ready, 2 unsafe.",
     lambda row: _READINESS.get(row[3].get("readiness"))),
    ("vramwatch_step", "gauge", "Training step of the latest sample.", _sample("step")),
    ("vramwatch_last_sample_timestamp_seconds", "gauge",
     "Timestamp (rank's clock) of the latest sample.", _sample("ts")),
    ("vramwatch_last_received_timestamp_seconds", "gauge",
     "When the collector last received a sample for this rank (collector's clock).", lambda row: row[4].last_seen),
)

TREND_STATE_HELP = "1 for the rank's current trend-engine state, 0 for the others."


def _format_value(value: Any) -> str:
    if type(value) is int:
        return str(value)
    if type(value) is bool:
        return "1" if value else "0"
    value = float(value)
    if math.isfinite(value):
        return repr(int(value)) if value.is_integer() and abs(value) < 2**63 else repr(value)
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class CheckpointCounter:
    """``vramwatch_checkpoints_total``: checkpoint phases per series, monotonic across scrapes.

    The engine keeps a bounded event list (oldest dropped) and emits one ``checkpoint_spike``
    event per checkpoint-phase sample. Counting the list would go down when events age
    out, so each scrape counts only the events newer than the last one it counted (held by
    identity, which survives step numbers going back when a restarted rank resumes).
    Cost: O(new events) per series per scrape. Dashboards annotate from ``increase()`` of
    it; unlike ``changes(vramwatch_checkpoint_peak_bytes)`` it sees the first checkpoint
    and checkpoints with an unchanged peak.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[int, Any]] = {}  # series key -> (count, newest counted event)

    def count(self, series: Any) -> int:
        key = (series.run, series.host, series.rank)
        total, marker = self._seen.get(key, (0, None))
        events = list(getattr(series, "events", ()))  # a C-level copy: safe against the writer
        new = 0
        newest = marker
        for event in reversed(events):
            if event is marker:
                break
            if event.get("type") == "checkpoint_spike":
                new += 1
                if newest is marker:
                    newest = event
        if new:
            total += new
            self._seen[key] = (total, newest)
        return total

    def forget(self, alive: set[tuple]) -> None:
        self._seen = {k: v for k, v in self._seen.items() if k in alive}


class SeriesCollector(Collector):
    """Per-rank families from ``live.snapshot()``; runs silent for ``finished_after_s`` age out.

    A run ages out as a whole (no rank has sent for ``finished_after_s``), so a rank that
    went silent inside a live run stays visible and the hook-silent alert can see it.
    """

    def __init__(self, live: Any, *, finished_after_s: float = 3600.0, clock: Callable[[], float] = time.time) -> None:
        if not finished_after_s > 0:
            raise ValueError(f"finished_after_s: must be > 0, got {finished_after_s!r}")
        self.live = live
        self.finished_after_s = float(finished_after_s)
        self.clock = clock
        self._labels: dict[tuple, str] = {}
        # per series: [plateau breaks attributed so far, of which phase ratchets]
        self._ratchets: dict[tuple, list[int]] = {}
        self._checkpoints = CheckpointCounter()
        self._lock = threading.Lock()
        # two scrapes at once (an HA pair of Prometheus servers) must not both attribute
        # the same new plateau breaks
        self._rows_lock = threading.Lock()
        self.exported_series = 0
        self.exported_keys: set[tuple[str, str, int]] = set()
        self.aged_out_series = 0

    # -------------------------------------------------------------- rows

    def _label_string(self, series: Any) -> str:
        key = (series.run, series.rank, series.host, series.uuid, series.gpu)
        text = self._labels.get(key)
        if text is None:
            uuid = "" if series.uuid is None else series.uuid
            gpu = "" if series.gpu is None else str(series.gpu)
            text = (
                f'run="{_escape(series.run)}",rank="{series.rank}",Hostname="{_escape(series.host)}",'
                f'UUID="{_escape(uuid)}",gpu="{gpu}"'
            )
            with self._lock:
                if len(self._labels) > 65536:  # bounded: old runs' label strings go
                    self._labels.clear()
                self._labels[key] = text
        return text

    def _phase_ratchets(self, series: Any, breaks: int | None) -> int:
        """Breaks whose cause is a phase, counted from the series' recent events.

        The engine counts all breaks; its ``plateau_break`` events name the cause. Each
        scrape attributes only the breaks that are new since the previous one, looking at
        the newest events, so the count stays monotonic like the engine's.
        """
        key = (series.run, series.host, series.rank)
        entry = self._ratchets.get(key)
        if entry is None or not breaks or breaks < entry[0]:  # new series, or a rebuilt engine
            entry = [0, 0]
            self._ratchets[key] = entry
        if breaks and breaks > entry[0]:
            events = list(getattr(series, "events", ()))  # a C-level copy: safe against the writer
            causes = [e.get("cause") for e in reversed(events) if e.get("type") == "plateau_break"]
            entry[1] += sum(1 for cause in causes[: breaks - entry[0]] if cause not in _LOOP_CAUSES)
            entry[0] = breaks
        return entry[1]

    def rows(self) -> list[Row]:
        """Live series as (labels, last, last_train, summary, series, phase ratchets), finished runs dropped."""
        with self._rows_lock:
            return self._rows()

    def _rows(self) -> list[Row]:
        snapshot = list(self.live.snapshot())
        newest_by_run: dict[str, float] = {}
        for series in snapshot:
            seen = series.last_seen
            if series.last is not None and seen > newest_by_run.get(series.run, -math.inf):
                newest_by_run[series.run] = seen
        cutoff = self.clock() - self.finished_after_s
        rows: list[Row] = []
        for series in snapshot:
            if series.last is None or newest_by_run[series.run] < cutoff:
                continue
            summary = series.engine.summary()
            ratchets = self._phase_ratchets(series, summary.get("plateau_breaks"))
            checkpoints = self._checkpoints.count(series)
            rows.append(
                (self._label_string(series), series.last, series.last_train, summary, series, ratchets, checkpoints)
            )
        if len(self._ratchets) > 2 * len(snapshot) + 1024:  # forget series LiveState dropped
            alive = {(s.run, s.host, s.rank) for s in snapshot}
            self._ratchets = {k: v for k, v in self._ratchets.items() if k in alive}
            self._checkpoints.forget(alive)
        rows.sort(key=lambda row: (row[4].run, row[4].host, row[4].rank))
        self.exported_series = len(rows)
        self.exported_keys = {(row[4].run, row[4].host, row[4].rank) for row in rows}
        self.aged_out_series = len(snapshot) - len(rows)
        return rows

    # -------------------------------------------------------------- standard API

    def collect(self) -> Iterator[Metric]:
        rows = self.rows()
        label_values = [
            [row[4].run, str(row[4].rank), row[4].host, row[4].uuid or "",
             "" if row[4].gpu is None else str(row[4].gpu)]
            for row in rows
        ]
        for name, kind, doc, getter in SERIES_FAMILIES:
            family_class = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_class(name, doc, labels=SERIES_LABELS)
            for row, values in zip(rows, label_values, strict=True):
                value = getter(row)
                if value is not None:
                    family.add_metric(values, float(value))
            yield family
        family = GaugeMetricFamily("vramwatch_trend_state", TREND_STATE_HELP, labels=(*SERIES_LABELS, "state"))
        for row, values in zip(rows, label_values, strict=True):
            state = row[3].get("state") or row[4].engine.state
            for candidate in TREND_STATES:
                family.add_metric([*values, candidate], 1.0 if candidate == state else 0.0)
        yield family
        yield GaugeMetricFamily("vramwatch_series", "Rank series exported on /metrics.", value=len(rows))

    # -------------------------------------------------------------- fast path

    def render_text(self, *, openmetrics: bool = False) -> str:
        """The same samples as ``collect()``, written straight to exposition text."""
        rows = self.rows()
        parts: list[str] = []
        append = parts.append
        for name, kind, doc, getter in SERIES_FAMILIES:
            sample_name = name + "_total" if kind == "counter" else name
            family_name = name if openmetrics or kind != "counter" else sample_name
            append(f"# HELP {family_name} {doc}\n# TYPE {family_name} {kind}\n")
            for row in rows:
                value = getter(row)
                if value is not None:
                    append(f"{sample_name}{{{row[0]}}} {_format_value(value)}\n")
        append(f"# HELP vramwatch_trend_state {TREND_STATE_HELP}\n# TYPE vramwatch_trend_state gauge\n")
        for row in rows:
            state = row[3].get("state") or row[4].engine.state
            labels = row[0]
            for candidate in TREND_STATES:
                append(
                    f'vramwatch_trend_state{{{labels},state="{candidate}"}} {"1" if candidate == state else "0"}\n'
                )
        append("# HELP vramwatch_series Rank series exported on /metrics.\n# TYPE vramwatch_series gauge\n")
        append(f"vramwatch_series {len(rows)}\n")
        return "".join(parts)


class IngestMetrics:
    """The collector's own ingest counters and request latency, updated once per POST."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples = Counter(
            "vramwatch_ingest_samples",
            "Samples received on POST /api/v1/samples, by result.",
            ["result"],
            registry=registry,
        )
        self.requests = Counter(
            "vramwatch_ingest_requests", "Requests to POST /api/v1/samples, by response status.", ["code"],
            registry=registry,
        )
        self.duration = Histogram(
            "vramwatch_ingest_request_duration_seconds",
            "Time to validate and store one POST /api/v1/samples body.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        )
        # Pre-create every result so rate() sees a 0 before the first rejection.
        self._accepted = self.samples.labels(result="accepted")
        self._duplicates = self.samples.labels(result="duplicate")
        self._rejected = self.samples.labels(result="rejected")

    def observe(self, *, accepted: int, duplicates: int, rejected: int, seconds: float, status: int = 200) -> None:
        """One call per request, whatever its outcome (ingest.Outcome)."""
        if accepted:
            self._accepted.inc(accepted)
        if duplicates:
            self._duplicates.inc(duplicates)
        if rejected:
            self._rejected.inc(rejected)
        self.requests.labels(code=str(status)).inc()
        self.duration.observe(seconds)


class _RegistryView(Collector):
    """Exposes another registry's metrics inside the main registry (for ``collect()``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()


class VramwatchRegistry(CollectorRegistry):
    """A registry whose ``collect()`` yields everything; ``render`` uses its fast path."""

    def __init__(self, live: Any, *, finished_after_s: float, processes: Any = None) -> None:
        super().__init__(auto_describe=False)
        self.process = CollectorRegistry(auto_describe=False)
        self.series = SeriesCollector(live, finished_after_s=finished_after_s)
        self.ingest = IngestMetrics(self.process)
        Info("vramwatch_build", "vramwatch collector build.", registry=self.process).info({"version": __version__})
        self.register(_RegistryView(self.process))
        self.register(self.series)  # before the foreign processes: they follow the series it exported
        self.foreign = None
        if processes is not None:
            from vramwatch.collector.processes import ForeignProcessCollector

            self.foreign = ForeignProcessCollector(processes, live, lambda: self.series.exported_keys)
            self.register(self.foreign)


def build_registry(live: Any, *, finished_after_s: float = 3600.0, processes: Any = None
                   ) -> tuple[CollectorRegistry, IngestMetrics]:
    """The registry that ``GET /metrics`` renders, and the ingest metrics each POST updates.

    ``live``: anything with ``snapshot()`` returning series states (see collector/live.py).
    ``finished_after_s``: a run with no sample for this long leaves ``/metrics``.
    ``processes``: a :class:`~vramwatch.collector.processes.ProcessBook` (named foreign processes).
    """
    registry = VramwatchRegistry(live, finished_after_s=finished_after_s, processes=processes)
    return registry, registry.ingest


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """Exposition bytes and content type: OpenMetrics when the Accept header asks for it."""
    encoder, content_type = choose_encoder(accept or "")
    if not isinstance(registry, VramwatchRegistry):
        return encoder(registry), content_type
    openmetrics = content_type.startswith(OPENMETRICS_CONTENT_TYPE)
    head = encoder(registry.process)
    foreign = registry.foreign.render_text if registry.foreign is not None else str
    if openmetrics:
        # The OpenMetrics encoder ends with "# EOF"; the rank families go before it.
        head = head.removesuffix(b"# EOF\n")
        body = registry.series.render_text(openmetrics=True) + foreign()
        return head + body.encode() + b"# EOF\n", content_type
    return head + (registry.series.render_text() + foreign()).encode(), content_type


__all__ = [
    "SERIES_LABELS",
    "TREND_STATES",
    "IngestMetrics",
    "SeriesCollector",
    "VramwatchRegistry",
    "build_registry",
    "render",
]
