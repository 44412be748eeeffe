"""Prometheus exposition of the collector's live state.

A scrape reads only in-memory state: each live run frozen (``LiveState.freeze_live``, the
ranks' engine summaries with the run-life model's judgement, :mod:`vramwatch.collector.state.snapshot`,
the same snapshot the OTLP push and the ``/ranks`` rows read): no database I/O. One custom collector
yields the per-rank families; ingest counters, the latency histogram and
``vramwatch_build_info`` are ordinary prometheus_client metrics in a side registry.

Labels follow dcgm-exporter's spelling (``Hostname``, ``UUID``, ``gpu``) so PromQL can
join vramwatch series with ``DCGM_FI_DEV_FB_USED`` on ``UUID``.

What a rank's story means here (docs/architecture.md, "Run life"):

* ``vramwatch_ooms_total`` and ``vramwatch_restarts_total`` are the model's counts per rank
  across its processes: monotonic, so an OOM followed by a restart within a second is still a
  rise of the counter at the next scrape (the wire's ``ooms`` counts per process and starts
  again at 0);
* ``vramwatch_suspected_ooms_total`` counts the OOMs the model only suspects from device memory
  (dcgm, nvidia-smi, a hook without the allocator's fields): never part of ``vramwatch_ooms_total``;
* ``vramwatch_rank_running`` is 1 while the rank's latest process runs (live or silent), 0 once
  it exited, died or ended; the *state* families (memory levels, headroom, trend state, time to
  OOM, ...) are withdrawn for a rank that is not running, so alerts on them resolve at once, and
  the alerts on counters are gated by ``vramwatch_rank_running``; counters and the timestamps stay
  until the run ages out (``finished_after_s``);
* counters the engine keeps (plateau breaks, phase ratchets = its re-levels, checkpoints) are
  read from its summary: monotonic, never rebuilt from its bounded event list.

Every sample is produced once (:meth:`SeriesCollector.families`); ``collect()`` (the standard
API) and ``render_text`` (the fast path: prometheus_client's generic encoder spends ~15 µs per
sample, 1.8 s for 4096 ranks x 25 series, docs/benchmarks.md) only format it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from vramwatch import verdicts
from vramwatch.__about__ import __version__
from vramwatch.collector.state.live import LiveState
from vramwatch.collector.state.snapshot import SUSPECTED_OOMS_MEANING, RankSnapshot
from vramwatch.decisions.readiness import VERDICTS as READINESS_VERDICTS
from vramwatch.wire import FIELD_TABLE, Sample

#: Label names of the per-rank state families, in exposition order. ``Hostname``/``UUID``/``gpu``
#: are spelled as dcgm-exporter spells them (``gpu``: the host's NVML index).
SERIES_LABELS = ("run", "rank", "Hostname", "UUID", "gpu")

#: Label names of the families keyed by the rank alone: every counter, the rank's last OOM time,
#: its running flag and its process's start. A restart or relaunch on other GPUs (new UUID,
#: new index) continues the same series, so ``increase()`` and the OOM alert never see a new
#: series carrying an old count.
RANK_LABELS = ("run", "rank", "Hostname")

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text"

_READINESS = {verdict: i for i, verdict in enumerate(READINESS_VERDICTS)}  # 0 ready, 1 not_ready, 2 unsafe


class RankRow(NamedTuple):
    """One frozen rank as a scrape sees it: its labels, the snapshot (``series``) and, read once from
    it, what the families read (a tuple of plain fields: ~30 families x every rank read them)."""

    labels: str  # the label string, escaped (fast path)
    label_values: tuple[str, str, str, str, str]  # SERIES_LABELS' values (standard API)
    rank_labels: str  # RANK_LABELS' label string, escaped
    series: RankSnapshot
    last: Sample  # latest sample
    last_train: Sample | None  # latest training-step sample
    summary: dict[str, Any]  # engine summary
    ooms: int  # the run-life model's count, every process of the rank
    restarts: int
    running: bool  # its latest process runs (live or silent)
    silence_window_s: float  # the run-life model's window for this rank (its cadence)
    last_oom_ts: float | None = None  # the model's latest OOM (rank's clock), any process
    process_start_ts: float | None = None  # its latest process's first sample (rank's clock)
    died: Any = None  # runlife.Death of its latest process, None while it runs or after a clean close
    suspected_ooms: int = 0  # the run-life model's OOMs suspected from device memory (never in ooms)
    last_suspected_oom_ts: float | None = None

    @classmethod
    def of(cls, labels: str, values: tuple[str, str, str, str, str], rank_labels: str, rank: RankSnapshot) -> RankRow:
        story = rank.story
        return cls(labels, values, rank_labels, rank, rank.last or {}, rank.last_train,  # type: ignore[arg-type]
                   rank.summary, rank.ooms, rank.restarts, rank.running,
                   verdicts.SILENT_AFTER_S if story is None else story.window_s, rank.last_oom_ts,
                   rank.process_start_ts, None if story is None else story.died, rank.suspected_ooms,
                   rank.last_suspected_oom_ts)


@dataclass(frozen=True, slots=True)
class Family:
    """One per-rank family. Counters are named without ``_total`` (added on exposition, as
    prometheus_client does). ``get`` returning None skips the rank; ``always``: exposed for a
    rank that is no longer running too (counters, timestamps), else only while it runs."""

    name: str
    kind: str  # gauge | counter
    help: str
    get: Callable[[RankRow], Any]
    always: bool = False
    #: labelled by RANK_LABELS (a counter always is) instead of SERIES_LABELS
    per_rank: bool = False

    @property
    def label_names(self) -> tuple[str, ...]:
        return RANK_LABELS if self.per_rank or self.kind == "counter" else SERIES_LABELS


def _sample(field: str) -> Callable[[RankRow], Any]:
    return lambda row: row.last.get(field)


def _summary(key: str) -> Callable[[RankRow], Any]:
    return lambda row: row.summary.get(key)


def _headroom(row: RankRow) -> int | None:
    # Judged on the latest training step, not on a checkpoint/eval sample: those spikes
    # have their own family (checkpoint_headroom) and would make this gauge flap.
    return verdicts.sample_headroom(row.last_train or row.last)


def _outside_allocator(row: RankRow) -> int | float | None:
    value = row.summary.get("outside_allocator_bytes")
    if value is not None:
        return value
    sample = row.last_train or row.last
    # NVML unavailable: no number rather than a fake one
    return verdicts.outside_allocator_bytes(sample.get("reserved_bytes"), sample.get("nvml_used_bytes"))


def _fragmentation(row: RankRow) -> int | None:
    flag = row.summary.get("fragmentation")
    return None if flag is None else int(bool(flag))


#: Every per-rank family but ``vramwatch_trend_state`` (one series per state).
SERIES_FAMILIES: tuple[Family, ...] = (
    # the latest value of every sample field the wire table gives a family (wire.Field.metric)
    *(Family(f.metric.name, f.metric.kind, f.metric.help, _sample(f.name), always=f.metric.always)
      for f in FIELD_TABLE if f.metric is not None),
    Family("vramwatch_headroom_bytes", "gauge",
           "Capacity minus what the device holds at the latest training step boundary "
           "(vramwatch.verdicts.headroom_bytes).", _headroom),
    Family("vramwatch_outside_allocator_bytes", "gauge",
           "NVML used minus allocator reserved: CUDA context, NCCL, cuBLAS workspaces, other leaks.",
           _outside_allocator),
    Family("vramwatch_ooms", "counter",
           "Out-of-memory errors on this rank, every process of it (a restart does not reset it).",
           lambda row: row.ooms, always=True),
    Family("vramwatch_suspected_ooms", "counter", SUSPECTED_OOMS_MEANING, lambda row: row.suspected_ooms,
           always=True),
    Family("vramwatch_last_suspected_oom_timestamp_seconds", "gauge",
           "When this rank's memory last vanished in a suspected OOM, inferred from device memory (rank's clock; "
           "absent before the first). The suspected-OOM alert fires while it is recent.",
           lambda row: row.last_suspected_oom_ts, always=True, per_rank=True),
    Family("vramwatch_restarts", "counter", "Processes of this rank after the first (restarts).",
           lambda row: row.restarts, always=True),
    Family("vramwatch_rank_running", "gauge",
           "1 while this rank's latest process runs (live or silent), 0 once it exited, died or ended "
           "(vramwatch.runlife).", lambda row: int(row.running), always=True, per_rank=True),
    Family("vramwatch_last_oom_timestamp_seconds", "gauge",
           "When this rank last ran out of memory (rank's clock; any process of it; absent before its "
           "first OOM). The OOM alert fires while it is recent, whatever Prometheus remembers.",
           lambda row: row.last_oom_ts, always=True, per_rank=True),
    Family("vramwatch_process_start_timestamp_seconds", "gauge",
           "First sample of this rank's running process (rank's clock): alerts over a time window count "
           "only the running process's part of it.", lambda row: row.process_start_ts, per_rank=True),
    Family("vramwatch_plateau_breaks", "counter",
           "Plateau breaks the trend engine found on this rank since the collector started.",
           _summary("plateau_breaks"), always=True),
    Family("vramwatch_phase_ratchets", "counter",
           "Plateau breaks caused by a checkpoint/eval phase whose segments the allocator kept "
           "(included in vramwatch_plateau_breaks_total).", _summary("plateau_relevels"), always=True),
    Family("vramwatch_checkpoints", "counter",
           "Checkpoint phases the trend engine saw on this rank (0 until the first).", _summary("checkpoints"),
           always=True),
    Family("vramwatch_plateau_bytes", "gauge", "Level of the current or last memory plateau.",
           _summary("plateau_bytes")),
    Family("vramwatch_leak_slope_bytes_per_step", "gauge",
           "Robust growth slope of memory at step boundaries.", _summary("slope_bytes_per_step")),
    Family("vramwatch_steps_to_oom", "gauge",
           "Projected steps until the device is full at the current slope (present while growing).",
           _summary("steps_to_oom")),
    Family("vramwatch_seconds_to_oom", "gauge",
           "Projected seconds until the device is full at the current slope (present while growing).",
           _summary("seconds_to_oom")),
    Family("vramwatch_seconds_to_oom_low", "gauge",
           "Low end of the 80 % range of the projected seconds to OOM (present while leaking with a range).",
           _summary("seconds_to_oom_low")),
    Family("vramwatch_seconds_to_oom_high", "gauge",
           "High end of the 80 % range of the projected seconds to OOM (present while leaking with a range).",
           _summary("seconds_to_oom_high")),
    Family("vramwatch_fragmentation", "gauge", "1 when the engine sees allocator fragmentation growing.",
           _fragmentation),
    Family("vramwatch_checkpoint_peak_bytes", "gauge",
           "Peak allocated bytes of the latest checkpoint phase.", _summary("checkpoint_peak_bytes")),
    Family("vramwatch_checkpoint_headroom_bytes", "gauge",
           "Headroom left at the peak of the latest checkpoint phase.", _summary("checkpoint_headroom_bytes")),
    # decisions (vramwatch.decisions.online.DecisionEngine adds these summary keys)
    Family("vramwatch_max_tokens_per_step", "gauge",
           "Largest tokens per step this rank can take keeping 5% of the device free at its worst phase.",
           _summary("max_tokens_per_step")),
    Family("vramwatch_tokens_per_step_max_observed", "gauge",
           "Largest tokens per step this rank has run.", _summary("tokens_per_step_max_observed")),
    Family("vramwatch_readiness", "gauge",
           "Readiness of the batch setting: 0 ready, 1 not_ready, 2 unsafe.",
           lambda row: _READINESS.get(row.summary.get("readiness"))),
    Family("vramwatch_last_received_timestamp_seconds", "gauge",
           "When the collector last received a sample for this rank (collector's clock).",
           lambda row: row.series.last_seen, always=True),
    Family("vramwatch_silence_window_seconds", "gauge",
           "How long this rank may send nothing before it reads silent: ten of its sample intervals, "
           "30 s to 30 min, at least 1.5x its longest checkpoint/eval phase (vramwatch.verdicts.silence_window).",
           lambda row: row.silence_window_s, always=True),
)

TREND_STATE_HELP = "1 for the rank's current trend-engine state, 0 for the others (while the rank runs)."

#: one exposed sample: its row, extra labels or None ((escaped text for the fast path, their values)),
#: and the value
_Point = tuple[RankRow, tuple[str, tuple[str, ...]] | None, Any]
_STATE_LABELS = {state: (f',state="{state}"', (state,)) for state in verdicts.STATES}
DIED_HELP = ("When this rank's latest process died (unix seconds), while it is dead: `cause` as vramwatch.runlife "
             "judged it, `last_words` the type and message the process said as it ended, `phase` where (empty "
             "when it said nothing).")
DIED_LABELS = ("cause", "last_words", "phase")


def _died_labels(died: Any) -> tuple[str, tuple[str, ...]]:
    said = died.last_words
    values = (str(died.cause), "" if said is None else f"{said.type}: {said.message}" if said.message else said.type,
              "" if said is None else said.phase)
    return "".join(f',{k}="{_escape(v)}"' for k, v in zip(DIED_LABELS, values, strict=True)), values


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


class SeriesCollector(Collector):
    """Per-rank families from ``live.snapshot()``; runs silent for ``finished_after_s`` age out.

    A run ages out as a whole (no rank has sent for ``finished_after_s``), so a rank that
    went silent inside a live run stays visible and the hook-silent alert can see it.
    """

    def __init__(self, live: LiveState, *, finished_after_s: float = 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not finished_after_s > 0:
            raise ValueError(f"finished_after_s: must be > 0, got {finished_after_s!r}")
        self.live = live
        self.finished_after_s = float(finished_after_s)
        self.clock = clock
        self._labels: dict[tuple, tuple[str, tuple[str, str, str, str, str], str]] = {}
        self._lock = threading.Lock()
        self.exported_series = 0
        self.exported_keys: set[tuple[str, str, int]] = set()
        self.aged_out_series = 0

    # -------------------------------------------------------------- rows

    def _label_strings(self, series: RankSnapshot) -> tuple[str, tuple[str, str, str, str, str], str]:
        key = (series.run, series.rank, series.host, series.uuid, series.gpu)
        found = self._labels.get(key)
        if found is None:
            uuid = "" if series.uuid is None else series.uuid
            gpu = "" if series.gpu is None else str(series.gpu)
            text = (
                f'run="{_escape(series.run)}",rank="{series.rank}",Hostname="{_escape(series.host)}",'
                f'UUID="{_escape(uuid)}",gpu="{gpu}"'
            )
            rank_text = text[:text.index(',UUID="')]
            found = (text, (series.run, str(series.rank), series.host, uuid, gpu), rank_text)
            with self._lock:
                if len(self._labels) > 65536:  # bounded: old runs' label strings go
                    self._labels.clear()
                self._labels[key] = found
        return found

    def rows(self) -> list[RankRow]:
        """Live ranks frozen (one judgement per run), runs silent for ``finished_after_s`` dropped."""
        now = self.clock()
        frozen = self.live.freeze_live(now, since=now - self.finished_after_s)
        rows: list[RankRow] = []
        for run in frozen:
            for series in run.ranks:
                labels, values, rank_labels = self._label_strings(series)
                rows.append(RankRow.of(labels, values, rank_labels, series))
        rows.sort(key=lambda row: (row.series.run, row.series.host, row.series.rank))
        self.exported_series = len(rows)
        self.exported_keys = {row.series.key for row in rows}
        self.aged_out_series = len(self.live) - len(rows)
        return rows

    def families(self, rows: list[RankRow]) -> Iterator[tuple[str, str, str, tuple[str, ...], list[_Point]]]:
        """Every per-rank family once: (name, kind, help, label names, points). The one place
        that decides what a scrape exposes; both encoders below only format it."""
        for family in SERIES_FAMILIES:
            points: list[_Point] = []
            for row in rows:
                if family.always or row.running:
                    value = family.get(row)
                    if value is not None:
                        points.append((row, None, value))
            yield family.name, family.kind, family.help, family.label_names, points
        states: list[_Point] = []
        for row in rows:
            if row.running:
                current = row.summary.get("state")
                states.extend((row, _STATE_LABELS[state], int(state == current)) for state in verdicts.STATES)
        yield "vramwatch_trend_state", "gauge", TREND_STATE_HELP, (*SERIES_LABELS, "state"), states
        died = [(row, _died_labels(row.died), row.died.ts) for row in rows if row.died is not None]
        yield "vramwatch_rank_died", "gauge", DIED_HELP, (*SERIES_LABELS, *DIED_LABELS), died

    # -------------------------------------------------------------- standard API

    def collect(self) -> Iterator[Metric]:
        rows = self.rows()
        for name, kind, doc, labels, points in self.families(rows):
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)
            per_rank = labels is RANK_LABELS
            for row, extra, value in points:
                own = row.label_values[:3] if per_rank else row.label_values
                values = list(own) if extra is None else [*own, *extra[1]]
                family.add_metric(values, float(value))
            yield family
        yield GaugeMetricFamily("vramwatch_series", "Rank series exported on /metrics.", value=len(rows))

    # -------------------------------------------------------------- fast path

    def render_text(self, *, openmetrics: bool = False) -> str:
        """The same samples as ``collect()``, written straight to exposition text."""
        rows = self.rows()
        parts: list[str] = []
        append = parts.append
        for name, kind, doc, label_names, points in self.families(rows):
            sample_name = name + "_total" if kind == "counter" else name
            family_name = name if openmetrics or kind != "counter" else sample_name
            append(f"# HELP {family_name} {doc}\n# TYPE {family_name} {kind}\n")
            per_rank = label_names is RANK_LABELS
            for row, extra, value in points:
                own = row.rank_labels if per_rank else row.labels
                labels = own if extra is None else own + extra[0]
                append(f"{sample_name}{{{labels}}} {_format_value(value)}\n")
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
        """One call per request, whatever its outcome (ingest.IngestAnswer)."""
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

    def __init__(self, live: LiveState, *, finished_after_s: float, processes: Any = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(auto_describe=False)
        self.process = CollectorRegistry(auto_describe=False)
        self.series = SeriesCollector(live, finished_after_s=finished_after_s, clock=clock)
        self.ingest = IngestMetrics(self.process)
        Info("vramwatch_build", "vramwatch collector build.", registry=self.process).info({"version": __version__})
        self.register(_RegistryView(self.process))
        self.register(self.series)  # before the foreign processes: they follow the series it exported
        self.foreign = None
        if processes is not None:
            from vramwatch.collector.ingest.processes import ForeignProcessCollector

            self.foreign = ForeignProcessCollector(processes, live, lambda: self.series.exported_keys)
            self.register(self.foreign)


def build_registry(live: LiveState, *, finished_after_s: float = 3600.0, processes: Any = None,
                   clock: Callable[[], float] = time.time
                   ) -> tuple[CollectorRegistry, IngestMetrics]:
    """The registry that ``GET /metrics`` renders, and the ingest metrics each POST updates.

    ``live``: the LiveState (``snapshot()`` for the series, ``story()`` for their life).
    ``finished_after_s``: a run with no sample for this long leaves ``/metrics``.
    ``processes``: a :class:`~vramwatch.collector.ingest.processes.ProcessBook` (named foreign processes).
    ``clock``: the ``now`` ranks are judged at (a replay of a recorded run passes its own).
    """
    registry = VramwatchRegistry(live, finished_after_s=finished_after_s, processes=processes, clock=clock)
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
    "RANK_LABELS",
    "SERIES_LABELS",
    "IngestMetrics",
    "SeriesCollector",
    "VramwatchRegistry",
    "build_registry",
    "render",
]
