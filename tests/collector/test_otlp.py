"""OTLP export: a real collector pushes to a test receiver that decodes the protobuf with the
official ``opentelemetry-proto`` package (what an OpenTelemetry Collector would parse)."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from prometheus_helpers import post_samples

from vramwatch.cli import main
from vramwatch.collector.exporters.otlp import lifespan_hook, metrics_url
from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace


class Receiver:
    """An OTLP/HTTP metrics endpoint on loopback that keeps every decoded request."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []
        self.authorizations: list[str | None] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                elif self.headers.get("content-encoding") == "deflate":
                    body = zlib.decompress(body)
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                receiver.requests.append(request)
                receiver.paths.append(self.path)
                receiver.content_types.append(self.headers.get("content-type", ""))
                receiver.authorizations.append(self.headers.get("authorization"))
                answer = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait(self, predicate, timeout: float = 20.0) -> ExportMetricsServiceRequest:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for request in reversed(self.requests):
                if predicate(request):
                    return request
            time.sleep(0.05)
        raise AssertionError(f"no matching OTLP request in {len(self.requests)} received")


def _attrs(kvs) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def _by_rank(request: ExportMetricsServiceRequest) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """rank → (resource attributes, {metric name: metric})."""
    out = {}
    for rm in request.resource_metrics:
        attrs = _attrs(rm.resource.attributes)
        metrics = {m.name: m for sm in rm.scope_metrics for m in sm.metrics}
        out[attrs["vramwatch.rank"]] = (attrs, metrics)
    return out


def _value(metric) -> float:
    data = getattr(metric, metric.WhichOneof("data"))
    (point,) = data.data_points
    return point.as_int if point.WhichOneof("value") == "as_int" else point.as_double


@pytest.fixture
def traces() -> dict[int, list[dict[str, Any]]]:
    # rank 0 healthy, rank 1 leaking (the simulator's scenarios), rank 2 without NVML; every rank's
    # latest sample recent (a rank whose process no longer runs has its state metrics withdrawn)
    now = time.time()
    healthy = list(simulate_trace("healthy", steps=1500, run="otel-run", host="node-a", rank=0, seed=1,
                                  start_ts=now - 1500 - 30))
    leaking = list(simulate_trace("fast_leak", steps=4000, run="otel-run", host="node-a", rank=1, seed=1,
                                  start_ts=now - 4000 - 30))
    no_nvml = [dict(s, rank=2, nvml_used_bytes=None, uuid="GPU-no-nvml")
               for s in simulate_trace("healthy", steps=300, run="otel-run", host="node-b", rank=2, seed=2,
                                       start_ts=now - 300 - 30)]
    return {0: healthy, 1: leaking, 2: no_nvml}


def test_serve_pushes_per_rank_memory_and_verdicts_as_otlp(tmp_path, traces) -> None:
    with Receiver() as receiver, BackgroundServer(
        tmp_path / "vw.db", lifespan_hooks=(lifespan_hook(receiver.url, interval_s=0.2),)
    ) as server:
        for trace in traces.values():
            post_samples(server.url, trace)
        request = receiver.wait(lambda r: len(r.resource_metrics) == 3 and 1 in _by_rank(r)
                                and "vramwatch.trend.state" in _by_rank(r)[1][1])
    assert receiver.paths[0] == "/v1/metrics"
    assert receiver.content_types[0] == "application/x-protobuf"
    ranks = _by_rank(request)
    for rank, trace in traces.items():
        attrs, metrics = ranks[rank]
        last = [s for s in trace if s["phase"] == "train"][-1]
        # resource attributes: run, host, rank and the GPU's UUID
        assert attrs["vramwatch.run"] == "otel-run"
        assert attrs["host.name"] == last["host"]
        assert attrs["hw.id"] == last["uuid"]
        assert attrs["service.name"] == "vramwatch"
        # OTel hardware semantic conventions: hw.gpu.memory.limit, an UpDownCounter in By
        limit = metrics["hw.gpu.memory.limit"]
        assert limit.unit == "By" and limit.WhichOneof("data") == "sum" and not limit.sum.is_monotonic
        assert _value(limit) == last["total_bytes"]
        # the GPU's semantic-convention attributes, each only when known: NVML measured it (NVIDIA)
        gpu = {"hw.id": last["uuid"], "hw.type": "gpu", "hw.name": f"GPU {last['gpu']}"}
        if last["nvml_used_bytes"] is not None:
            gpu["hw.vendor"] = "NVIDIA"
        assert _attrs(limit.sum.data_points[0].attributes) == gpu
        assert gpu.items() <= attrs.items()
        assert _value(metrics["vramwatch.memory.allocated"]) == last["allocated_bytes"]
        assert _value(metrics["vramwatch.memory.reserved"]) == last["reserved_bytes"]
        if last["nvml_used_bytes"] is None:
            # not measured: not sent (never a zero)
            assert "hw.gpu.memory.usage" not in metrics and "hw.gpu.memory.utilization" not in metrics
        else:
            assert _value(metrics["hw.gpu.memory.usage"]) == last["nvml_used_bytes"]
            assert _value(metrics["hw.gpu.memory.utilization"]) == pytest.approx(
                last["nvml_used_bytes"] / last["total_bytes"])
    states = {rank: {_attrs(p.attributes)["vramwatch.state"]: p.as_int
                     for p in metrics["vramwatch.trend.state"].gauge.data_points}
              for rank, (_, metrics) in ranks.items()}
    assert states[1]["leak"] == 1 and sum(states[1].values()) == 1
    assert states[0]["leak"] == 0 and states[0]["plateau"] == 1
    leak = ranks[1][1]
    assert _value(leak["vramwatch.slope"]) > 0
    assert 0 < _value(leak["vramwatch.time_to_oom"]) < 10 * 86400
    assert leak["vramwatch.time_to_oom"].unit == "s"


def test_a_dcgm_only_rank_sends_device_metrics_and_no_allocator_zeros(tmp_path) -> None:
    # what `vramwatch watch` or `import --from prometheus` stores: device used + capacity only
    t0 = time.time() - 15 * 40  # recent: a rank that still runs
    samples = [{"schema": 2, "run": "fleet", "host": "gpu-node-07", "rank": 3, "step": 1_700_000_000 + 15 * i,
                "ts": t0 + 15 * i, "phase": "train", "nvml_used_bytes": (60_000 + i) * 2**20,
                "total_bytes": 81_920 * 2**20, "uuid": "GPU-dcgm-3", "gpu": 3} for i in range(40)]
    with Receiver() as receiver, BackgroundServer(
        tmp_path / "vw.db", lifespan_hooks=(lifespan_hook(receiver.url, interval_s=0.2),)
    ) as server:
        post_samples(server.url, samples)
        request = receiver.wait(lambda r: _by_rank(r).get(3) is not None
                                and _value(_by_rank(r)[3][1]["vramwatch.step"]) == samples[-1]["step"])
    attrs, metrics = _by_rank(request)[3]
    assert attrs["hw.id"] == "GPU-dcgm-3" and attrs["host.name"] == "gpu-node-07"
    assert _value(metrics["hw.gpu.memory.usage"]) == samples[-1]["nvml_used_bytes"]
    assert _value(metrics["hw.gpu.memory.limit"]) == 81_920 * 2**20
    # not measured: absent, never a zero
    assert not {"vramwatch.memory.allocated", "vramwatch.memory.reserved", "vramwatch.memory.peak_allocated"} \
        & set(metrics)
    signals = {_attrs(p.attributes).get("vramwatch.signal") for p in metrics["vramwatch.trend.state"].gauge.data_points}
    assert signals == {"device_used"}  # the verdict says which level it rests on


def test_operator_gives_the_gpu_model_and_driver_in_the_standard_variable(tmp_path, monkeypatch) -> None:
    # what the samples do not carry: a node-local collector's one kind of GPU, set by the operator
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "hw.model=NVIDIA H200,hw.driver_version=550.90.07,"
                                                   "k8s.node.name=gpu-node-07")
    mig = [dict(s, uuid="MIG-4f1c9a2e-0000-5000-8000-000000000001", nvml_used_bytes=None)
           for s in simulate_trace("healthy", steps=200, run="otel-mig", host="gpu-node-07", rank=0, seed=3,
                                          start_ts=time.time() - 205)]
    with Receiver() as receiver, BackgroundServer(
        tmp_path / "vw.db", lifespan_hooks=(lifespan_hook(receiver.url, interval_s=0.2),)
    ) as server:
        post_samples(server.url, mig)
        request = receiver.wait(lambda r: 0 in _by_rank(r))
    attrs, metrics = _by_rank(request)[0]
    gpu = {"hw.id": mig[-1]["uuid"], "hw.type": "gpu", "hw.name": f"GPU {mig[-1]['gpu']}", "hw.vendor": "NVIDIA",
           "hw.model": "NVIDIA H200", "hw.driver_version": "550.90.07"}
    assert _attrs(metrics["hw.gpu.memory.limit"].sum.data_points[0].attributes) == gpu  # a MIG UUID is NVIDIA's
    assert gpu.items() <= attrs.items() and attrs["k8s.node.name"] == "gpu-node-07"
    assert attrs["service.name"] == "vramwatch" and attrs["vramwatch.run"] == "otel-mig"


def test_shutdown_pushes_the_last_state_once_more(tmp_path, monkeypatch) -> None:
    # headers come from the SDK's standard variable (an API key for a hosted backend)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer otel-key")
    first = list(simulate_trace("healthy", steps=200, run="otel-run", host="node-a", rank=0, seed=1,
                                start_ts=time.time() - 205))
    with Receiver() as receiver:
        with BackgroundServer(tmp_path / "vw.db", lifespan_hooks=(lifespan_hook(receiver.url, interval_s=3600),)) \
                as server:
            post_samples(server.url, first)
            assert receiver.requests == []  # the interval has not passed
        request = receiver.wait(lambda r: len(r.resource_metrics) == 1, timeout=5)
    _attrs_of_rank, metrics = _by_rank(request)[0]
    assert receiver.authorizations == ["Bearer otel-key"]
    assert _value(metrics["vramwatch.step"]) == [s for s in first if s["phase"] == "train"][-1]["step"]


def test_endpoint_url_defaults_to_the_otlp_metrics_path() -> None:
    assert metrics_url("http://otel:4318") == "http://otel:4318/v1/metrics"
    assert metrics_url("https://otel:4318/") == "https://otel:4318/v1/metrics"
    assert metrics_url("http://gw/custom/metrics") == "http://gw/custom/metrics"
    with pytest.raises(ValueError, match="http"):
        metrics_url("otel:4318")


def test_serve_refuses_a_bad_endpoint_in_one_line(capsys) -> None:
    for argv, message in ((["--otlp-endpoint", "grpc://otel:4317"], "--otlp-endpoint must be an http(s) URL"),
                          (["--otlp-endpoint", "http://otel:4318", "--peers", "http://a:8765"],
                           "a federating front holds no ranks")):
        assert main(["serve", *argv, "--db", "/nonexistent/x.db"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def _otlp_by_rank(live, now: float) -> dict[int, dict[str, float]]:
    from vramwatch.collector.exporters.otlp import build_metrics_data, views_of

    data = build_metrics_data(views_of(live, now), start_ns=1)
    out: dict[int, dict[str, float]] = {}
    for resource in data.resource_metrics:
        rank = resource.resource.attributes["vramwatch.rank"]
        metrics = out.setdefault(rank, {})
        for metric in resource.scope_metrics[0].metrics:
            metrics[metric.name] = metric.data.data_points[0].value
    return out


@pytest.mark.parametrize("ending", ["one_killed", "oom_restart_finish"])
def test_otlp_and_metrics_withdraw_the_same_ranks_and_count_the_same_ooms_and_restarts(ending: str) -> None:
    """One frozen snapshot behind both exporters: a rank killed alone loses its state metrics on
    OTLP as on /metrics, and OTLP carries the run-life model's OOM and restart counts."""
    import endings

    from vramwatch.collector.exporters.metrics import build_registry, render
    from vramwatch.collector.state.live import LiveState

    built = getattr(endings, ending)()
    # cut before the survivors' clean exit: they still run, a rank killed alone is long gone
    samples = [s for s in built.samples if s["ts"] < endings.T0 + endings.STEPS - 50]
    now = max(s["ts"] for s in samples) + 1
    live = LiveState()
    live.ingest(samples, received_at=now)
    registry, _ = build_registry(live, clock=lambda: now)
    text = render(registry, None)[0].decode()
    exposed: dict[str, dict[int, float]] = {}
    for line in text.splitlines():
        if line.startswith("vramwatch_") and 'rank="' in line:
            name = line.split("{", 1)[0]
            rank = int(line.split('rank="', 1)[1].split('"', 1)[0])
            exposed.setdefault(name, {})[rank] = float(line.rsplit(" ", 1)[1])
    otlp = _otlp_by_rank(live, now)
    assert set(otlp) == set(range(endings.RANKS))
    running = {r for r, m in otlp.items() if m["vramwatch.rank.running"] == 1}
    assert running == {r for r, v in exposed["vramwatch_rank_running"].items() if v == 1}
    assert {r for r, m in otlp.items() if "vramwatch.headroom" in m} == set(exposed["vramwatch_headroom_bytes"])
    assert {r for r, m in otlp.items() if "vramwatch.headroom" in m} == running
    for rank, metrics in otlp.items():
        assert metrics["vramwatch.ooms"] == exposed["vramwatch_ooms_total"][rank] == built.ooms.get(rank, 0)
        assert metrics["vramwatch.restarts"] == exposed["vramwatch_restarts_total"][rank]
    if ending == "one_killed":
        assert running == {0, 1, 3}  # rank 2 killed alone: withdrawn by both
    else:
        assert running == set(range(endings.RANKS)) and {m["vramwatch.restarts"] for m in otlp.values()} == {1}
