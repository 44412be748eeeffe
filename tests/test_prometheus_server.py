"""A real Prometheus server scraping two real collectors (the sharded scale path).

Two collectors (uvicorn + SQLite, loopback ports) each hold half of one run's ranks:
shard A node-a ranks 0-1 (healthy), shard B node-b ranks 2-3 (rank 3 steps up to a new
plateau late in the run). Prometheus (``/usr/bin/prometheus``, temporary storage, 1 s
scrape and evaluation) loads the shipped rules with every ``for:`` shortened to 0s (the
shipped file keeps production durations). The samples arrive in two stages, as from a
live run: the plateau first, then the rest, so the plateau-break counter rises between
scrapes. Then the HTTP API must show both shards' series with their labels, the
cross-shard recording rule, and a firing VramwatchPlateauBreak for rank 3 only.
"""

from __future__ import annotations

import time

import httpx
import pytest
import yaml
from prometheus_helpers import (
    RULES,
    PrometheusServer,
    all_queries,
    grafana_to_promql,
    need_binary,
    post_samples,
)

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace

pytestmark = pytest.mark.prometheus

RUN = "sharded-job"
STEPS = 3700
BREAK_STEP = 3000  # the late_step scenario's one-time step


def test_prometheus_scrapes_two_shards_and_fires_plateau_break(tmp_path) -> None:
    need_binary("prometheus")
    start_ts = time.time() - STEPS - 60
    layout = {  # (host, rank) -> scenario
        ("node-a", 0): "healthy", ("node-a", 1): "healthy",
        ("node-b", 2): "healthy", ("node-b", 3): "late_step",
    }
    traces = {
        key: list(simulate_trace(scenario, steps=STEPS, run=RUN, host=key[0], rank=key[1], start_ts=start_ts))
        for key, scenario in layout.items()
    }
    assert {s["step"] for s in traces[("node-b", 3)]} >= {BREAK_STEP}

    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "0s"

    with BackgroundServer(str(tmp_path / "a.db")) as shard_a, BackgroundServer(str(tmp_path / "b.db")) as shard_b:
        shards = {"node-a": shard_a, "node-b": shard_b}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{
                "job_name": "vramwatch",
                "honor_labels": True,
                "static_configs": [
                    {"targets": [shard_a.url.removeprefix("http://")], "labels": {"shard": "a"}},
                    {"targets": [shard_b.url.removeprefix("http://")], "labels": {"shard": "b"}},
                ],
            }],
        }
        # stage 1: warm-up and plateau on every rank
        for (host, _rank), samples in traces.items():
            post_samples(shards[host].url, [s for s in samples if s["step"] < BREAK_STEP - 100])

        with PrometheusServer(tmp_path / "prometheus", config, {"vramwatch.rules.yml": rules}) as prom:
            up = prom.wait_for('up{job="vramwatch"} == 1', lambda r: len(r) == 2)
            assert {r["metric"]["shard"] for r in up} == {"a", "b"}
            reserved = prom.wait_for(
                f'vramwatch_memory_reserved_bytes{{run="{RUN}"}}', lambda r: len(r) == 4
            )
            got = {(r["metric"]["Hostname"], int(r["metric"]["rank"])): r["metric"] for r in reserved}
            assert set(got) == set(layout)
            for key, labels in got.items():
                first = traces[key][0]
                assert labels["UUID"] == first["uuid"] and labels["gpu"] == str(first["gpu"])
                assert labels["shard"] == ("a" if key[0] == "node-a" else "b")
            breaks_before = prom.wait_for(
                f'vramwatch_plateau_breaks_total{{run="{RUN}"}}', lambda r: len(r) == 4
            )
            assert all(float(r["value"][1]) == 0 for r in breaks_before), breaks_before

            # the recording rule aggregates the run across both shards
            # (a rule evaluation may predate the scrape of the second shard: wait for one after it)
            per_rank = prom.query(
                f'vramwatch_headroom_bytes{{run="{RUN}"}} / vramwatch_device_total_bytes{{run="{RUN}"}}'
            )
            assert len(per_rank) == 4
            worst = min(float(r["value"][1]) for r in per_rank)
            prom.wait_for(
                f'run:vramwatch_headroom_ratio:min{{run="{RUN}"}}',
                lambda r: len(r) == 1 and float(r[0]["value"][1]) == pytest.approx(worst, rel=0.02),
            )

            # stage 2: the rest of the run; rank 3 leaves its plateau
            for (host, _rank), samples in traces.items():
                post_samples(shards[host].url, [s for s in samples if s["step"] >= BREAK_STEP - 100])
            ranks = httpx.get(f"{shard_b.url}/api/v1/runs/{RUN}/ranks", timeout=10).json()
            verdicts = {r["rank"]: r["verdict"] for r in ranks}
            assert verdicts[3]["plateau_breaks"] >= 1, verdicts[3]
            assert verdicts[2]["plateau_breaks"] == 0, verdicts[2]

            alerts = prom.wait_for(
                'ALERTS{alertname="VramwatchPlateauBreak", alertstate="firing"}', lambda r: len(r) >= 1
            )
            (alert,) = alerts
            labels = alert["metric"]
            assert (labels["run"], labels["Hostname"], labels["rank"]) == (RUN, "node-b", "3")
            assert labels["UUID"] == traces[("node-b", 3)][0]["uuid"]
            assert labels["severity"] == "warning" and labels["shard"] == "b"
            # the rules API shows the annotation rendered from the labels
            api = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            firing = [a for a in api if a["labels"]["alertname"] == "VramwatchPlateauBreak"]
            assert firing[0]["annotations"]["summary"] == f"GPU memory left its plateau on {RUN} rank 3 (node-b)"
            # nothing else fires on this run: healthy ranks, no leak, headroom fine, all sending
            others = prom.query(f'ALERTS{{run="{RUN}", alertname!="VramwatchPlateauBreak"}}')
            assert others == [], others

            # every shipped query parses in a real Prometheus, and the dashboard's panels
            # show data from both shards
            results = {}
            for where, expr in all_queries():
                response = httpx.get(f"{prom.url}/api/v1/query", params={"query": grafana_to_promql(expr)}, timeout=10)
                assert response.json()["status"] == "success", (where, expr, response.text)
                results.setdefault(where, []).extend(response.json()["data"]["result"])
            for where in ("panel:Reserved per rank", "panel:Headroom per rank", "panel:Trend state per rank",
                          "panel:Rank skew: reserved minus the run's median", "panel:Ranks now",
                          "panel:Worst headroom (run)", "panel:Rank skew (reserved, max - min)",
                          "variable:run", "variable:host", "variable:rank", "annotation:Plateau breaks",
                          "grafana-alert:vramwatch plateau break", "rules:run:vramwatch_headroom_ratio:min"):
                assert results[where], f"{where} returned no data"
            hosts = {r["metric"].get("Hostname") for r in results["panel:Reserved per rank"]}
            assert hosts == {"node-a", "node-b"}
            timeline = {r["metric"]["rank"]: float(r["value"][1]) for r in results["panel:Trend state per rank"]}
            assert timeline == {"0": 2.0, "1": 2.0, "2": 2.0, "3": timeline["3"]} and timeline["3"] in (2.0, 3.0)
            breaks = {r["metric"]["rank"] for r in results["annotation:Plateau breaks"]}
            assert breaks == {"3"}
