"""A real Prometheus (``/usr/bin/prometheus``, 5 s scrapes as deployed) scraping a real
collector (uvicorn + SQLite on loopback) that sees a rank OOM and restart within one second on
another GPU: the OOM reaches Prometheus (the counter is the collector's count across the rank's
processes, one series per rank whatever its GPU, not the new process's 0) and the shipped
VramwatchOOM alert fires for that rank only; not for a rank whose OOM is 18 minutes old and
that was relaunched on a new GPU since, neither at Prometheus' first scrape nor after Prometheus
itself restarts on empty storage (which sees the recent OOM again)."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import yaml
from helpers import make_sample
from prometheus_helpers import RULES, PrometheusServer, need_binary, post_samples

from vramwatch.collector.server import BackgroundServer

pytestmark = pytest.mark.prometheus


def test_an_oom_and_a_restart_within_a_second_reach_prometheus_and_fire_the_alert(tmp_path) -> None:
    need_binary("prometheus")
    now = time.time()
    run = "oom-restart"

    def sample(step: int, rank: int, ts: float, incarnation: str, uuid: str = "", **kw) -> dict:
        return make_sample(step, run=run, rank=rank, ts=ts, incarnation=incarnation, uuid=uuid or f"GPU-{rank}",
                           gpu=rank, **kw)

    with BackgroundServer(str(tmp_path / "vw.db")) as collector:
        post_samples(collector.url, [sample(i, r, now - 60 + i, f"a{r}") for r in range(2) for i in range(60)])
        # rank 2 ran out of memory 18 minutes ago; the job was relaunched on other GPUs a minute ago
        post_samples(collector.url, [sample(i, 2, now - 1200 + i, "a2") for i in range(120)]
                     + [sample(119, 2, now - 1080, "a2", ooms=1, seq=1, oom_marked=True)]
                     + [sample(i, 2, now - 60 + i, "b2", uuid="GPU-new-2") for i in range(60)])
        config = {
            "global": {"scrape_interval": "5s", "evaluation_interval": "1s", "scrape_timeout": "4s"},
            "scrape_configs": [{"job_name": "vramwatch", "honor_labels": True,
                                "static_configs": [{"targets": [collector.url.removeprefix("http://")]}]}],
        }
        rules = yaml.safe_load(RULES.read_text())  # the shipped file: VramwatchOOM has for: 0m
        with PrometheusServer(tmp_path / "prometheus", config, {"vramwatch.rules.yml": rules}) as prom:
            prom.wait_for('vramwatch_ooms_total{rank="1"}', lambda r: len(r) == 1 and r[0]["value"][1] == "0")
            old = prom.wait_for('vramwatch_last_oom_timestamp_seconds{rank="2"}', lambda r: len(r) == 1)
            assert abs(float(old[0]["value"][1]) - (now - 1080)) < 1 and "UUID" not in old[0]["metric"]
            # rank 1: the OOM observer's marked sample, then torchrun's new process on another GPU, in one second
            t = time.time()
            oom = sample(59, 1, t, "a1", ooms=1, seq=1, oom_marked=True)
            restarted = [sample(50 + i, 1, t + 0.2 + i * 0.1, "b1", uuid="GPU-new-1") for i in range(5)]
            post_samples(collector.url, [oom])
            post_samples(collector.url, restarted)
            assert time.time() - t < 1.0
            rank = httpx.get(f"{collector.url}/api/v1/runs/{run}/ranks", timeout=10).json()[1]
            assert (rank["ooms"], rank["restarts"], rank["liveness"], rank["last"]["ooms"]) == (1, 1, "live", 0)

            counted = prom.wait_for('vramwatch_ooms_total{rank="1"} == 1', lambda r: len(r) == 1)
            assert counted[0]["metric"]["run"] == run
            assert prom.query('vramwatch_restarts_total{rank="1"}')[0]["value"][1] == "1"
            assert_only_rank_1_pages(prom)
            # the count never went back to 0 in between, and the new GPU did not start a new series:
            # every scrape Prometheus kept says so
            history = prom.query(f'min_over_time(vramwatch_ooms_total{{rank="1"}}[1m] @ {time.time():.3f})')
            assert len(history) == 1 and history[0]["value"][1] == "0"  # before the OOM
            assert prom.query('resets(vramwatch_ooms_total{rank="1"}[1m])')[0]["value"][1] == "0"
            assert prom.query('vramwatch_ooms_total{rank="1"}')[0]["value"][1] == "1"
        # Prometheus itself restarts on empty storage (kube-prometheus-stack's default emptyDir): no
        # history at all; the OOM seconds old pages again, the 18-minute-old one still does not
        with PrometheusServer(tmp_path / "prometheus-restarted", config, {"vramwatch.rules.yml": rules}) as prom:
            prom.wait_for('vramwatch_last_oom_timestamp_seconds', lambda r: len(r) == 2)
            assert_only_rank_1_pages(prom)


def assert_only_rank_1_pages(prom: PrometheusServer) -> None:
    alerts = prom.wait_for('ALERTS{alertname="VramwatchOOM", alertstate="firing"}', lambda r: len(r) >= 1)
    time.sleep(2)  # two evaluations more: anything else would fire by now
    alerts = prom.query('ALERTS{alertname="VramwatchOOM"}')
    assert [(a["metric"]["rank"], a["metric"]["severity"], a["metric"]["alertstate"]) for a in alerts] == [
        ("1", "critical", "firing")]
    api = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    (firing,) = [a for a in api if a["labels"]["alertname"] == "VramwatchOOM"]
    assert re.fullmatch(r"Out of GPU memory on oom-restart rank 1 \(node-1\) \d+(\.\d+)?s ago",
                        firing["annotations"]["summary"]), firing["annotations"]["summary"]
    assert "counts them across its processes" in firing["annotations"]["description"]
    assert "UUID" not in firing["labels"] and "gpu" not in firing["labels"]
