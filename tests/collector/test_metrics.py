"""/metrics: the Prometheus exposition of the live state (vramwatch/collector/exporters/metrics.py).

In-process tests use the real LiveState and TrendEngine fed by simulated traces; the
promtool test scrapes a real collector (uvicorn + SQLite) over HTTP."""

from __future__ import annotations

import math
import time

import pytest
from helpers import ending_at
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_helpers import exposed_names, exposed_samples, post_samples, run_promtool, scrape

from vramwatch.__about__ import __version__
from vramwatch.collector.exporters.metrics import SERIES_LABELS, build_registry, render
from vramwatch.collector.server import BackgroundServer
from vramwatch.collector.state.live import LiveState
from vramwatch.probe.simulated import simulate_trace
from vramwatch.verdicts import STATES as TREND_STATES

NOW = time.time()


@pytest.fixture(autouse=True, scope="module")
def _now() -> None:
    """NOW is the time this module's tests start, not when the suite was collected: the run-life
    model judges a run whose newest sample is minutes old as stopped, whatever ran before."""
    global NOW
    NOW = time.time()


def feed(live: LiveState, scenario: str, *, steps: int, received_at: float | None = None, **kw) -> list[dict]:
    received_at = NOW if received_at is None else received_at
    samples = list(simulate_trace(scenario, steps=steps, start_ts=0.0, **kw))
    # every rank's latest sample 5 s ago, as ranks of one job stepping together end together
    samples = ending_at(samples, NOW - 5)
    live.ingest(samples, received_at=received_at)
    return samples


@pytest.fixture(scope="module")
def live_run() -> tuple[LiveState, dict[tuple[str, int], list[dict]]]:
    live = LiveState()
    traces = {
        ("node-a", 0): feed(live, "checkpoint", steps=2200, run="job", host="node-a", rank=0),
        ("node-a", 1): feed(live, "fast_leak", steps=3000, run="job", host="node-a", rank=1),
        ("node-b", 2): feed(live, "healthy", steps=1500, run="job", host="node-b", rank=2),
    }
    return live, traces


def by_name(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in exposed_samples(text):
        out.setdefault(name, []).append((labels, value))
    return out


def one(samples, **labels) -> float:
    hits = [v for lab, v in samples if all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(hits) == 1, (labels, samples)
    return hits[0]


def test_per_rank_gauges_match_the_latest_samples(live_run) -> None:
    live, traces = live_run
    registry, _ = build_registry(live)
    body, content_type = render(registry, None)
    assert content_type.startswith("text/plain")
    metrics = by_name(body.decode())
    for (host, rank), samples in traces.items():
        last = samples[-1]
        last_train = [s for s in samples if s["phase"] == "train"][-1]
        labels = {"rank": rank, "Hostname": host}
        assert one(metrics["vramwatch_memory_allocated_bytes"], **labels) == last["allocated_bytes"]
        assert one(metrics["vramwatch_memory_reserved_bytes"], **labels) == last["reserved_bytes"]
        assert one(metrics["vramwatch_memory_peak_allocated_bytes"], **labels) == last["peak_allocated_bytes"]
        assert one(metrics["vramwatch_inactive_split_bytes"], **labels) == last["inactive_split_bytes"]
        assert one(metrics["vramwatch_device_used_bytes"], **labels) == last["nvml_used_bytes"]
        assert one(metrics["vramwatch_device_total_bytes"], **labels) == last["total_bytes"]
        assert one(metrics["vramwatch_alloc_retries_total"], **labels) == last["alloc_retries"]
        assert one(metrics["vramwatch_ooms_total"], **labels) == last["ooms"]
        assert one(metrics["vramwatch_step"], **labels) == last["step"]
        assert one(metrics["vramwatch_last_sample_timestamp_seconds"], **labels) == pytest.approx(last["ts"])
        assert one(metrics["vramwatch_last_received_timestamp_seconds"], **labels) == pytest.approx(NOW)
        expected_headroom = last_train["total_bytes"] - max(last_train["reserved_bytes"], last_train["nvml_used_bytes"])
        assert one(metrics["vramwatch_headroom_bytes"], **labels) == expected_headroom
        # dcgm-exporter spelling, values from the samples
        (series_labels, _), = [x for x in metrics["vramwatch_step"] if x[0]["rank"] == str(rank)]
        assert set(series_labels) == set(SERIES_LABELS)
        assert series_labels == {"run": "job", "rank": str(rank), "Hostname": host,
                                 "UUID": last["uuid"], "gpu": str(last["gpu"])}


def test_trend_state_has_one_series_per_state_and_follows_the_engine(live_run) -> None:
    live, _ = live_run
    registry, _ = build_registry(live)
    metrics = by_name(render(registry, None)[0].decode())
    states = metrics["vramwatch_trend_state"]
    assert len(states) == len(TREND_STATES) * 3
    for series in live.snapshot():
        row = {lab["state"]: v for lab, v in states if lab["rank"] == str(series.rank)}
        assert set(row) == set(TREND_STATES)
        assert sum(row.values()) == 1
        assert row[series.engine.state] == 1
    # the leaking rank is called a leak, with a time to OOM; the healthy one is not
    leak_rank = {lab["rank"]: v for lab, v in states if lab["state"] == "leak"}
    assert leak_rank["1"] == 1 and leak_rank["2"] == 0
    seconds = {lab["rank"]: v for lab, v in metrics["vramwatch_seconds_to_oom"]}
    assert seconds["1"] > 0
    summary = live.get("job", "node-a", 1).engine.summary()
    assert seconds["1"] == pytest.approx(summary["seconds_to_oom"])
    # and the forecast's range around it, the engine's own numbers
    low = one(metrics["vramwatch_seconds_to_oom_low"], rank=1)
    high = one(metrics["vramwatch_seconds_to_oom_high"], rank=1)
    assert (low, high) == (pytest.approx(summary["seconds_to_oom_low"]), pytest.approx(summary["seconds_to_oom_high"]))
    assert low <= seconds["1"] <= high
    assert not [v for lab, v in metrics.get("vramwatch_seconds_to_oom_low", []) if lab["rank"] == "2"]
    assert one(metrics["vramwatch_leak_slope_bytes_per_step"], rank=1) == pytest.approx(summary["slope_bytes_per_step"])
    # checkpoints: the engine's checkpoint peak is exported for the checkpointing rank
    ckpt = live.get("job", "node-a", 0).engine.summary()["checkpoint_peak_bytes"]
    assert ckpt and one(metrics["vramwatch_checkpoint_peak_bytes"], rank=0) == pytest.approx(ckpt)


def test_fast_path_and_standard_collect_agree(live_run) -> None:
    live, _ = live_run
    registry, ingest = build_registry(live)
    ingest.observe(accepted=10, duplicates=2, rejected=1, seconds=0.004)
    fast = sorted(exposed_samples(render(registry, None)[0].decode()), key=repr)
    generic = sorted(exposed_samples(generate_latest(registry).decode()), key=repr)
    assert len(fast) > 60
    assert len(fast) == len(generic)
    for (name_a, labels_a, value_a), (name_b, labels_b, value_b) in zip(fast, generic, strict=True):
        assert (name_a, labels_a) == (name_b, labels_b)
        if not name_a.endswith("_created"):
            assert value_a == pytest.approx(value_b, rel=1e-12)


def test_openmetrics_is_negotiated(live_run) -> None:
    live, _ = live_run
    registry, ingest = build_registry(live)
    ingest.observe(accepted=5, duplicates=0, rejected=0, seconds=0.01)
    body, content_type = render(registry, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    families = {f.name: f for f in parse_openmetrics(text)}  # the strict parser accepts it
    assert families["vramwatch_alloc_retries"].type == "counter"
    assert families["vramwatch_build"].type == "info"
    assert {s.name for s in families["vramwatch_alloc_retries"].samples} == {"vramwatch_alloc_retries_total"}
    assert any(s.value == 5 for s in families["vramwatch_ingest_samples"].samples)


def test_ingest_counters_latency_and_build_info(live_run) -> None:
    live, _ = live_run
    registry, ingest = build_registry(live)
    ingest.observe(accepted=100, duplicates=3, rejected=0, seconds=0.02)
    ingest.observe(accepted=0, duplicates=0, rejected=7, seconds=0.3)
    metrics = by_name(render(registry, None)[0].decode())
    assert one(metrics["vramwatch_ingest_samples_total"], result="accepted") == 100
    assert one(metrics["vramwatch_ingest_samples_total"], result="duplicate") == 3
    assert one(metrics["vramwatch_ingest_samples_total"], result="rejected") == 7
    assert metrics["vramwatch_ingest_requests_total"][0][1] == 2
    assert metrics["vramwatch_ingest_request_duration_seconds_count"][0][1] == 2
    assert metrics["vramwatch_ingest_request_duration_seconds_sum"][0][1] == pytest.approx(0.32)
    assert one(metrics["vramwatch_ingest_request_duration_seconds_bucket"], le="0.25") == 1
    assert metrics["vramwatch_build_info"] == [({"version": __version__}, 1.0)]
    assert metrics["vramwatch_series"] == [({}, 3.0)]


def test_finished_runs_age_out_but_a_silent_rank_of_a_live_run_stays() -> None:
    live = LiveState()
    feed(live, "healthy", steps=300, run="old", host="h", rank=0, received_at=NOW - 7200)
    feed(live, "healthy", steps=300, run="live", host="h", rank=0, received_at=NOW - 1800)  # silent rank
    feed(live, "healthy", steps=300, run="live", host="h", rank=1, received_at=NOW - 5)
    registry, _ = build_registry(live, finished_after_s=3600)
    metrics = by_name(render(registry, None)[0].decode())
    ranks = {(lab["run"], lab["rank"]) for lab, _ in metrics["vramwatch_step"]}
    assert ranks == {("live", "0"), ("live", "1")}
    assert all(lab["run"] == "live" for lab, _ in metrics["vramwatch_trend_state"])
    assert metrics["vramwatch_series"] == [({}, 2.0)]
    registry_short, _ = build_registry(live, finished_after_s=1.0)
    assert "vramwatch_step" not in by_name(render(registry_short, None)[0].decode())
    with pytest.raises(ValueError, match="finished_after_s"):
        build_registry(live, finished_after_s=0)


def test_missing_nvml_is_absent_not_zero_and_labels_are_escaped() -> None:
    live = LiveState()
    samples = []
    for sample in simulate_trace("healthy", steps=50, run='we"ird\\run', host="h\nx", rank=4, start_ts=NOW - 55):
        sample = dict(sample, nvml_used_bytes=None)
        sample.pop("uuid")
        sample.pop("gpu")
        samples.append(sample)
    live.ingest(samples, received_at=NOW)
    registry, _ = build_registry(live)
    metrics = by_name(render(registry, None)[0].decode())
    assert "vramwatch_device_used_bytes" not in metrics
    assert "vramwatch_outside_allocator_bytes" not in metrics or all(
        not math.isnan(v) for _, v in metrics["vramwatch_outside_allocator_bytes"])
    (labels, value), = metrics["vramwatch_memory_reserved_bytes"]
    assert labels["run"] == 'we"ird\\run' and labels["Hostname"] == "h\nx"
    assert labels["UUID"] == "" and labels["gpu"] == ""
    assert value == samples[-1]["reserved_bytes"]
    # without NVML, headroom is judged on reserved alone
    last = samples[-1]
    assert one(metrics["vramwatch_headroom_bytes"], rank=4) == last["total_bytes"] - last["reserved_bytes"]


def test_real_scrape_passes_promtool_check_metrics(tmp_path) -> None:
    with BackgroundServer(str(tmp_path / "vw.db")) as srv:
        now = time.time()  # both ranks still running: their state families are exposed
        post_samples(srv.url, simulate_trace("fast_leak", steps=2600, run="lint", host="node-a", rank=0,
                                             start_ts=now - 2610))
        post_samples(srv.url, simulate_trace("checkpoint", steps=1200, run="lint", host="node-a", rank=1,
                                             start_ts=now - 1210))
        response = scrape(srv.url)
        openmetrics = scrape(srv.url, accept="application/openmetrics-text; version=1.0.0")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    text = response.text
    names = exposed_names(text)
    for name in ("vramwatch_memory_allocated_bytes", "vramwatch_trend_state", "vramwatch_seconds_to_oom",
                 "vramwatch_ingest_samples_total", "vramwatch_build_info", "vramwatch_plateau_breaks_total"):
        assert name in names
    result = run_promtool("check", "metrics", stdin=text)
    assert result.returncode == 0, result.stdout + result.stderr
    # and the linter does catch problems (so a pass means something)
    bad = run_promtool("check", "metrics", stdin="# HELP vw_x x\n# TYPE vw_x counter\nvw_x 1\n")
    assert bad.returncode != 0 and "_total" in bad.stdout + bad.stderr


def test_phase_ratchets_count_breaks_a_checkpoint_caused() -> None:
    live = LiveState()
    registry, _ = build_registry(live)
    checkpoint = list(simulate_trace("checkpoint", steps=3200, run="r", host="h", rank=0, start_ts=NOW - 4000))
    late = list(simulate_trace("late_step", steps=3700, run="r", host="h", rank=1, start_ts=NOW - 4000))
    live.ingest([s for s in checkpoint if s["step"] < 900] + [s for s in late if s["step"] < 2900], received_at=NOW)
    first = by_name(render(registry, None)[0].decode())
    assert {lab["rank"]: v for lab, v in first["vramwatch_plateau_breaks_total"]} == {"0": 0, "1": 0}
    assert {lab["rank"]: v for lab, v in first["vramwatch_phase_ratchets_total"]} == {"0": 0, "1": 0}
    live.ingest([s for s in checkpoint if s["step"] >= 900] + [s for s in late if s["step"] >= 2900], received_at=NOW)
    causes = {
        rank: [e["cause"] for e in live.get("r", "h", rank).events if e["type"] == "plateau_break"] for rank in (0, 1)
    }
    assert causes[0] and all(c == "checkpoint" for c in causes[0]), causes
    assert causes[1] and "checkpoint" not in causes[1], causes
    second = by_name(render(registry, None)[0].decode())
    breaks = {lab["rank"]: v for lab, v in second["vramwatch_plateau_breaks_total"]}
    ratchets = {lab["rank"]: v for lab, v in second["vramwatch_phase_ratchets_total"]}
    assert breaks == {"0": len(causes[0]), "1": len(causes[1])}
    assert ratchets == {"0": len(causes[0]), "1": 0}
    # a later scrape with nothing new keeps the counts (monotonic counters)
    assert by_name(render(registry, None)[0].decode())["vramwatch_phase_ratchets_total"] == \
        second["vramwatch_phase_ratchets_total"]


def test_concurrent_scrapes_during_ingest_stay_consistent() -> None:
    """Scrapes run in the server's thread pool while the writer ingests: no error, counters monotonic."""
    import threading

    live = LiveState()
    registry, _ = build_registry(live)
    trace = list(simulate_trace("checkpoint", steps=3200, run="c", host="h", rank=0, start_ts=NOW - 4000))
    errors: list[BaseException] = []
    seen: list[list[float]] = [[] for _ in range(3)]
    done = threading.Event()

    def scraper(out: list[float]) -> None:
        try:
            while not done.is_set():
                metrics = by_name(render(registry, None)[0].decode())
                out.extend(v for _, v in metrics.get("vramwatch_phase_ratchets_total", []))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=scraper, args=(out,)) for out in seen]
    for thread in threads:
        thread.start()
    for index in range(0, len(trace), 50):
        live.ingest(trace[index:index + 50], received_at=NOW)
    done.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    for values in seen:
        assert values == sorted(values), "a counter went backwards"
    final = by_name(render(registry, None)[0].decode())
    breaks = live.get("c", "h", 0).engine.summary()["plateau_breaks"]
    assert breaks >= 1
    assert final["vramwatch_phase_ratchets_total"][0][1] == breaks


def test_counters_and_oom_time_are_keyed_by_the_rank_across_a_restart_on_another_gpu() -> None:
    """A rank OOMs, and its restarted process comes back on another GPU (new UUID and index):
    the counters, the last-OOM time and the running flag stay one series per rank (no new series
    carrying an old count for Prometheus to mistake for a new OOM); the state gauges follow the
    running process's GPU; the last-OOM time is the OOM sample's own, the process start the new
    process's first sample's."""
    live = LiveState()
    first = list(simulate_trace("healthy", steps=200, run="r", host="node-a", rank=0, start_ts=NOW - 400))
    oom_ts = first[-1]["ts"] + 0.5
    oom = {**first[-1], "ts": oom_ts, "seq": (first[-1].get("seq") or 0) + 1, "ooms": 1, "oom_marked": True,
           "alloc_retries": 7}
    again = [{**s, "incarnation": "second", "uuid": "GPU-other", "gpu": 5, "ts": s["ts"] + 300}
             for s in simulate_trace("healthy", steps=50, run="r", host="node-a", rank=0, start_ts=NOW - 100)]
    live.ingest([*first, oom, *again], received_at=NOW)
    registry, _ = build_registry(live)
    metrics = by_name(render(registry, None)[0].decode())
    rank_labels = {"run": "r", "rank": "0", "Hostname": "node-a"}
    for name in ("vramwatch_ooms_total", "vramwatch_restarts_total", "vramwatch_alloc_retries_total",
                 "vramwatch_plateau_breaks_total", "vramwatch_last_oom_timestamp_seconds", "vramwatch_rank_running",
                 "vramwatch_process_start_timestamp_seconds"):
        (labels, _value), = metrics[name]
        assert labels == rank_labels, name
    assert metrics["vramwatch_ooms_total"][0][1] == 1 and metrics["vramwatch_restarts_total"][0][1] == 1
    assert metrics["vramwatch_alloc_retries_total"][0][1] == again[-1]["alloc_retries"]  # the running process's
    assert metrics["vramwatch_last_oom_timestamp_seconds"][0][1] == pytest.approx(oom_ts)
    assert metrics["vramwatch_process_start_timestamp_seconds"][0][1] == pytest.approx(again[0]["ts"])
    (state_labels, _), = metrics["vramwatch_memory_reserved_bytes"]
    assert (state_labels["UUID"], state_labels["gpu"]) == ("GPU-other", "5")
    # a rank that never ran out of memory has no last-OOM series at all (nothing to be recent)
    clean = LiveState()
    clean.ingest(simulate_trace("healthy", steps=50, run="c", host="h", rank=0, start_ts=NOW - 100), received_at=NOW)
    assert "vramwatch_last_oom_timestamp_seconds" not in by_name(render(build_registry(clean)[0], None)[0].decode())
