"""OpenTelemetry export: ``vramwatch serve --otlp-endpoint URL`` pushes per-rank memory and
verdict metrics over OTLP/HTTP (protobuf) with the OpenTelemetry SDK's exporter.

Every ``interval_s`` the collector's live state (no database I/O) becomes one OTLP request:
one *resource* per rank, carrying ``vramwatch.run``, ``host.name``, ``vramwatch.rank`` and
the GPU (``hw.id`` = its UUID), so backends group by the resource as they do for any
service. Names follow the OpenTelemetry hardware semantic conventions for GPUs where they
define one (``hw.gpu.memory.usage``, ``hw.gpu.memory.limit``, ``hw.gpu.memory.utilization``,
with the required ``hw.id`` and ``hw.type = "gpu"`` attributes) and ``vramwatch.*``
otherwise (allocator levels and the trend engine's verdicts). A number the rank did not
measure is not sent (no zeros for "not measured").

A push reads the same frozen snapshot as ``/metrics`` (:mod:`vramwatch.collector.state.snapshot`)
and follows its rules: the run-life model's OOM and restart counts per rank
(``vramwatch.ooms``, ``vramwatch.suspected_ooms``, ``vramwatch.restarts``: monotonic across the
rank's processes) and ``vramwatch.rank.running``; the state metrics (memory levels, headroom, trend, time to OOM) are
withdrawn for a rank whose latest process no longer runs (killed alone, OOM, exited), counters stay
while the run is held.

The GPU's recommended attributes (``hw.name``, ``hw.vendor``, ``hw.model``,
``hw.driver_version``, ...) go on the ``hw.gpu.*`` points and on the rank's resource, each only
when known: ``hw.name`` from the GPU's index on its host (``GPU 3``), ``hw.vendor`` ``NVIDIA``
when NVML or DCGM measured the device (those are NVIDIA's libraries) or the UUID is a MIG
instance's. The model and driver version are not in the samples; an operator gives them, with
any other resource attribute, in the SDK's standard ``OTEL_RESOURCE_ATTRIBUTES`` (e.g.
``hw.model=NVIDIA H200,hw.driver_version=550.90.07``), which is exact for a node-local collector
(one node, one kind of GPU) and applies to every rank the collector holds.

The request is built from the SDK's metric data model (``MetricsData``), not through
instruments: instruments would put every rank under one resource. Cost per push: O(ranks)
Python objects and one HTTP POST off the event loop; a failed push is logged and retried
at the next interval (the SDK exporter retries transient errors within its timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vramwatch.__about__ import __version__
from vramwatch.collector.state.live import LiveState
from vramwatch.collector.state.snapshot import SUSPECTED_OOMS_MEANING, RankSnapshot
from vramwatch.verdicts import STATES
from vramwatch.wire import Sample

log = logging.getLogger("vramwatch.otlp")

SCOPE = "vramwatch"
#: Semantic-convention attributes of a GPU (metric_attributes.hw.gpu) an operator may set in
#: OTEL_RESOURCE_ATTRIBUTES; they are also put on the hw.gpu.* points.
GPU_ATTRIBUTE_KEYS = ("hw.vendor", "hw.model", "hw.driver_version", "hw.firmware_version", "hw.parent")
NVIDIA = "NVIDIA"


@dataclass(frozen=True)
class OtlpRank:
    """What one rank exports: its frozen snapshot and the sample shown (latest training step's)."""

    rank: RankSnapshot
    sample: Sample

    @property
    def run(self) -> str:
        return self.rank.run

    @property
    def host(self) -> str:
        return self.rank.host

    @property
    def uuid(self) -> str | None:
        return self.rank.uuid

    @property
    def gpu(self) -> int | None:
        return self.rank.gpu

    @property
    def summary(self) -> dict[str, Any]:
        return self.rank.summary


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str
    description: str
    kind: str  # "gauge" | "updown" (non-monotonic sum) | "counter" (monotonic sum)
    value: Callable[[OtlpRank], float | int | None]
    hw: bool = False  # an hw.gpu.* metric: carries hw.id and hw.type
    always: bool = False  # sent for a rank that no longer runs too (counters), else only while it runs


def _utilization(view: OtlpRank) -> float | None:
    used, total = view.sample.get("nvml_used_bytes"), view.sample.get("total_bytes")
    return used / total if used is not None and total else None


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("hw.gpu.memory.usage", "By", "GPU memory used.", "updown",
               lambda v: v.sample.get("nvml_used_bytes"), hw=True),
    MetricSpec("hw.gpu.memory.limit", "By", "Size of the GPU memory.", "updown",
               lambda v: v.sample.get("total_bytes"), hw=True),
    MetricSpec("hw.gpu.memory.utilization", "1", "Fraction of GPU memory used.", "gauge", _utilization, hw=True),
    MetricSpec("vramwatch.memory.allocated", "By", "Bytes held by live tensors (torch allocated).", "gauge",
               lambda v: v.sample.get("allocated_bytes")),
    MetricSpec("vramwatch.memory.reserved", "By", "Bytes reserved by the caching allocator.", "gauge",
               lambda v: v.sample.get("reserved_bytes")),
    MetricSpec("vramwatch.memory.peak_allocated", "By", "Peak allocated since the previous sample.", "gauge",
               lambda v: v.sample.get("peak_allocated_bytes")),
    MetricSpec("vramwatch.step", "{step}", "Latest training step seen.", "gauge", lambda v: v.sample.get("step")),
    MetricSpec("vramwatch.headroom", "By", "Device capacity minus what the device must hold (verdicts.py).",
               "gauge", lambda v: v.summary.get("headroom_bytes")),
    MetricSpec("vramwatch.plateau", "By", "Level of the current plateau.", "gauge",
               lambda v: v.summary.get("plateau_bytes")),
    MetricSpec("vramwatch.slope", "By/{step}", "Trend slope of the judged memory level.", "gauge",
               lambda v: v.summary.get("slope_bytes_per_step")),
    MetricSpec("vramwatch.steps_to_oom", "{step}", "Projected steps until out of memory.", "gauge",
               lambda v: v.summary.get("steps_to_oom")),
    MetricSpec("vramwatch.time_to_oom", "s", "Projected time until out of memory.", "gauge",
               lambda v: v.summary.get("seconds_to_oom")),
    MetricSpec("vramwatch.time_to_oom.low", "s", "Low end of the 80 % range of the projected time until out of "
               "memory.", "gauge", lambda v: v.summary.get("seconds_to_oom_low")),
    MetricSpec("vramwatch.time_to_oom.high", "s", "High end of the 80 % range of the projected time until out of "
               "memory.", "gauge", lambda v: v.summary.get("seconds_to_oom_high")),
    MetricSpec("vramwatch.plateau.breaks", "{break}", "Plateau breaks so far.", "counter",
               lambda v: v.summary.get("plateau_breaks"), always=True),
    MetricSpec("vramwatch.ooms", "{oom}", "Out-of-memory errors on this rank, every process of it "
               "(a restart does not reset it).", "counter", lambda v: v.rank.ooms, always=True),
    MetricSpec("vramwatch.suspected_ooms", "{oom}", SUSPECTED_OOMS_MEANING, "counter",
               lambda v: v.rank.suspected_ooms, always=True),
    MetricSpec("vramwatch.restarts", "{restart}", "Processes of this rank after the first (restarts).", "counter",
               lambda v: v.rank.restarts, always=True),
    MetricSpec("vramwatch.rank.running", "1", "1 while this rank's latest process runs (live or silent), 0 once "
               "it exited, died or ended.", "gauge", lambda v: int(v.rank.running), always=True),
)


def views_of(live: LiveState, now: float | None = None) -> list[OtlpRank]:
    """The ranks of every live run, frozen (:meth:`LiveState.freeze_live`, what ``/metrics`` reads)."""
    return [OtlpRank(rank, rank.shown) for run in live.freeze_live(now) for rank in run.ranks
            if rank.shown is not None]


def environment_attributes() -> dict[str, Any]:
    """Resource attributes from ``OTEL_RESOURCE_ATTRIBUTES`` (parsed by the SDK's own detector)."""
    from opentelemetry.sdk.resources import OTELResourceDetector

    return dict(OTELResourceDetector().detect().attributes)


def gpu_attributes(view: OtlpRank, environment: dict[str, Any]) -> dict[str, Any]:
    """The semantic conventions' attributes of the rank's GPU: ``hw.id``, ``hw.type`` and what is
    known of the recommended ones (never a guess: an unknown one is left out)."""
    index = view.gpu if view.gpu is not None else view.rank.rank
    attrs: dict[str, Any] = {"hw.id": view.uuid or f"{view.host}/gpu{index}", "hw.type": "gpu"}
    if view.gpu is not None:
        attrs["hw.name"] = f"GPU {view.gpu}"
    if view.sample.get("nvml_used_bytes") is not None or (view.uuid or "").startswith("MIG-"):
        attrs["hw.vendor"] = NVIDIA
    attrs.update({key: environment[key] for key in GPU_ATTRIBUTE_KEYS if key in environment})
    return attrs


def _resource_attributes(view: OtlpRank, environment: dict[str, Any]) -> dict[str, Any]:
    attrs: dict[str, Any] = {**environment, **gpu_attributes(view, environment),
                             "service.name": "vramwatch", "service.version": __version__,
                             "service.instance.id": f"{view.run}/{view.host}/{view.rank.rank}",
                             "vramwatch.run": view.run, "host.name": view.host, "vramwatch.rank": view.rank.rank}
    if view.gpu is not None:
        attrs["vramwatch.gpu"] = view.gpu
    return attrs


def build_metrics_data(views: Iterable[OtlpRank], start_ns: int, now_ns: int | None = None,
                       environment: dict[str, Any] | None = None) -> Any:
    """One OTLP export (SDK ``MetricsData``): a resource per rank, its metrics under one scope.
    ``environment``: the operator's resource attributes (:func:`environment_attributes`)."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    now_ns = now_ns or time.time_ns()
    scope = InstrumentationScope(SCOPE, __version__)
    resources = []
    for view in views:
        hw_attrs = gpu_attributes(view, environment or {})
        metrics = []
        running = view.rank.running
        for spec in METRICS:
            if not (running or spec.always):
                continue  # withdrawn with the process, as /metrics withdraws it
            value = spec.value(view)
            if value is None:
                continue  # not measured: nothing is sent, never a zero
            point = NumberDataPoint(attributes=hw_attrs if spec.hw else {}, start_time_unix_nano=start_ns,
                                    time_unix_nano=now_ns, value=value)
            metrics.append(Metric(spec.name, spec.description, spec.unit, _data(spec.kind, [point], Gauge, Sum,
                                                                                   AggregationTemporality)))
        state = view.summary.get("state")
        if state is not None and running:
            # which memory level the verdict rests on (allocated, or device used for sparse sources)
            signal = {"vramwatch.signal": view.summary["signal"]} if view.summary.get("signal") else {}
            points = [NumberDataPoint(attributes={"vramwatch.state": s, **signal}, start_time_unix_nano=start_ns,
                                      time_unix_nano=now_ns, value=int(s == state)) for s in STATES]
            metrics.append(Metric("vramwatch.trend.state", "1 for the rank's current trend state, 0 for the others "
                                  "(and the judged signal when the engine names it).", "1", Gauge(points)))
        resource = Resource(_resource_attributes(view, environment or {}))
        resources.append(ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], ""))
    return MetricsData(resources)


def _data(kind: str, points: list, gauge: Any, sum_: Any, temporality: Any) -> Any:
    if kind == "gauge":
        return gauge(points)
    return sum_(points, temporality.CUMULATIVE, kind == "counter")


def metrics_url(endpoint: str) -> str:
    """``http://otel:4318`` → ``http://otel:4318/v1/metrics`` (OTLP/HTTP's default path); a URL
    with a path is used as given. Raises ValueError for anything but http(s)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint.rstrip("/") + "/v1/metrics" if parts.path in ("", "/") else endpoint


class OtlpPusher:
    """Push the live state to an OTLP/HTTP endpoint every ``interval_s`` seconds."""

    def __init__(self, endpoint: str, interval_s: float = 15.0, headers: dict[str, str] | None = None,
                 timeout_s: float = 10.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        self.url = metrics_url(endpoint)
        self.interval_s = interval_s
        self.exporter = OTLPMetricExporter(endpoint=self.url, headers=headers, timeout=timeout_s)
        self.start_ns = time.time_ns()
        self.environment = environment_attributes()  # read once: the process environment is fixed
        self.pushes = 0
        self.failures = 0

    def push(self, live: LiveState) -> bool:
        """One export of every rank now; True when the endpoint accepted it (blocking)."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        views = views_of(live)
        if not views:
            return True
        result = self.exporter.export(build_metrics_data(views, self.start_ns, environment=self.environment))
        ok = result == MetricExportResult.SUCCESS
        self.pushes += 1
        if not ok:
            self.failures += 1
            log.warning("OTLP push to %s failed (%d of %d so far); retrying next interval", self.url,
                        self.failures, self.pushes)
        return ok

    def close(self) -> None:
        self.exporter.shutdown()


def lifespan_hook(endpoint: str, interval_s: float = 15.0,
                  headers: dict[str, str] | None = None) -> Callable[[Any], contextlib.AbstractAsyncContextManager]:
    """A collector lifespan hook (``Settings.lifespan_hooks``): pushes while the app runs,
    and once more on shutdown so the last verdicts leave too."""
    metrics_url(endpoint)  # a bad URL fails at startup, not at the first push
    try:
        import opentelemetry.exporter.otlp.proto.http.metric_exporter  # noqa: F401
    except ImportError:
        raise ValueError("--otlp-endpoint needs the OpenTelemetry SDK: pip install 'vramwatch[otlp]'") from None

    from vramwatch.collector.settings import background

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        pusher = OtlpPusher(endpoint, interval_s, headers)

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await asyncio.to_thread(pusher.push, app.state.live)
                except Exception:  # never let export take the collector down
                    log.exception("OTLP push failed")

        try:
            async with background(loop()):
                log.info("pushing OTLP metrics to %s every %g s", pusher.url, interval_s)
                yield
        finally:
            try:
                await asyncio.to_thread(pusher.push, app.state.live)
            except Exception:
                log.exception("final OTLP push failed")
            pusher.close()

    return run
