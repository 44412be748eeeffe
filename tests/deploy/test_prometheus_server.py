"""A real Prometheus server scraping two real collectors (the sharded scale path).

Two collectors (uvicorn + SQLite, loopback ports) each hold half of one run's ranks:
shard A node-a ranks 0-1 (healthy), shard B node-b ranks 2-3 (rank 3 steps up to a new
plateau late in the run). Prometheus (``/usr/bin/prometheus``, temporary storage, 1 s
scrape and evaluation) loads the shipped rules with every ``for:`` shortened to 0s (the
shipped file keeps production durations). The samples arrive in two stages, as from a
live run: the plateau first, then the rest, so the plateau-break counter rises between
scrapes. Then the HTTP API must show both shards' series with their labels, the
cross-shard recording rule, and a firing VramwatchPlateauBreak for rank 3 only; the
Grafana table's rank links lead to the shard holding each rank (opened in Chromium).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import yaml
from grafana_helpers import (
    dashboard_panels,
    interpolate_link,
    merged_rows,
    panel_links,
)
from helpers import ending_at
from prometheus_helpers import (
    ALERTMANAGER,
    DASHBOARD,
    DEPLOY,
    RULES,
    AlertmanagerServer,
    PrometheusServer,
    StaticExporter,
    WebhookReceiver,
    all_queries,
    dcgm_exposition,
    grafana_to_promql,
    need_binary,
    post_samples,
)

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace
from vramwatch.verdicts import SEVERITY, STATES

pytestmark = pytest.mark.prometheus

RUN = "sharded-job"
STEPS = 3700
BREAK_STEP = 3000  # the late_step scenario's one-time step
STEP_S = 0.2


def test_prometheus_scrapes_two_shards_and_fires_plateau_break(tmp_path) -> None:
    need_binary("prometheus")
    # 0.2 s steps, the first stage ending now: every stage is a run still going (a run whose latest
    # sample is 5 minutes old has stopped, and its ranks' state gauges leave /metrics)
    start_ts = time.time() - (BREAK_STEP - 100) * STEP_S
    layout = {  # (host, rank) -> scenario
        ("node-a", 0): "healthy", ("node-a", 1): "healthy",
        ("node-b", 2): "healthy", ("node-b", 3): "late_step",
    }
    traces = {
        key: list(simulate_trace(scenario, steps=STEPS, run=RUN, host=key[0], rank=key[1], start_ts=start_ts,
                                 step_time_s=STEP_S))
        for key, scenario in layout.items()
    }
    assert {s["step"] for s in traces[("node-b", 3)]} >= {BREAK_STEP}

    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "0s"

    # dcgm-exporter beside them: each rank's GPU uses 1 GiB more than its allocator reserved
    gpus = [{"uuid": t[-1]["uuid"], "gpu": t[-1]["gpu"], "fb_used_mib": t[-1]["reserved_bytes"] // 1048576 + 1024}
            for t in traces.values()]
    with BackgroundServer(str(tmp_path / "a.db")) as shard_a, BackgroundServer(str(tmp_path / "b.db")) as shard_b, \
            StaticExporter(dcgm_exposition(gpus)) as dcgm:
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
            }, {"job_name": "dcgm-exporter", "static_configs": [{"targets": [dcgm.address]}]}],
        }
        # stage 1: warm-up and plateau on every rank
        for (host, _rank), samples in traces.items():
            post_samples(shards[host].url, [s for s in samples if s["step"] < BREAK_STEP - 100])

        with PrometheusServer(tmp_path / "prometheus", config, {"vramwatch.rules.yml": rules}) as prom:
            check_both_shards_scraped(prom, traces, layout)

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
            # a counter's alert: keyed by the rank (a restart on another GPU continues its series)
            assert "UUID" not in labels and "gpu" not in labels
            assert labels["severity"] == "warning" and labels["shard"] == "b"
            # the rules API shows the annotation rendered from the labels
            api = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            firing = [a for a in api if a["labels"]["alertname"] == "VramwatchPlateauBreak"]
            assert firing[0]["annotations"]["summary"] == f"GPU memory left its plateau on {RUN} rank 3 (node-b)"
            # nothing else fires on this run: healthy ranks, no leak, headroom fine, all sending
            others = prom.query(f'ALERTS{{run="{RUN}", alertname!="VramwatchPlateauBreak"}}')
            assert others == [], others

            check_every_shipped_query(prom)
            check_dashboard_against(prom)
            check_rank_links(prom, {host: shard.url for host, shard in shards.items()})
            check_gpu_context(prom, traces)


def check_both_shards_scraped(prom: PrometheusServer, traces: dict, layout: dict) -> None:
    """Stage 1: both shards up, every rank's series with the sample labels and its shard's target
    label, no plateau break yet, and the recording rule aggregating the run across shards."""
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


def check_every_shipped_query(prom: PrometheusServer) -> None:
    """Every shipped query parses in a real Prometheus, and the dashboard's panels show data from both shards."""
    results = {}
    for where, expr in all_queries():
        response = httpx.get(f"{prom.url}/api/v1/query", params={"query": grafana_to_promql(expr)}, timeout=10)
        assert response.json()["status"] == "success", (where, expr, response.text)
        results.setdefault(where, []).extend(response.json()["data"]["result"])
    for where in ("panel:Reserved per rank", "panel:Headroom per rank", "panel:Trend state per rank",
                  "panel:Rank skew: reserved minus the run's median", "panel:Ranks now",
                  "panel:Worst headroom (run)", "panel:Rank skew (reserved, max - min)",
                  "variable:run", "variable:host", "variable:rank", "annotation:Plateau breaks",
                  "grafana-alert:VramwatchPlateauBreak", "rules:run:vramwatch_headroom_ratio:min"):
        assert results[where], f"{where} returned no data"
    hosts = {r["metric"].get("Hostname") for r in results["panel:Reserved per rank"]}
    assert hosts == {"node-a", "node-b"}
    timeline = {r["metric"]["rank"]: float(r["value"][1]) for r in results["panel:Trend state per rank"]}
    code = {state: SEVERITY[state] + 1 for state in STATES}  # the dashboard's state numbers
    assert timeline == {"0": code["plateau"], "1": code["plateau"], "2": code["plateau"], "3": timeline["3"]}
    assert timeline["3"] in (code["plateau"], code["rising"])
    breaks = {r["metric"]["rank"] for r in results["annotation:Plateau breaks"]}
    assert breaks == {"3"}


def check_gpu_context(prom: PrometheusServer, traces: dict) -> None:
    """The GPU-context row: dcgm's series, and torch reserved vs DCGM FB used joined per rank."""
    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dashboard_panels(dashboard) if p["title"] == "torch reserved vs DCGM FB used")
    joined = prom.query(grafana_to_promql(panel["targets"][1]["expr"]))
    got = {(r["metric"]["run"], r["metric"]["Hostname"], r["metric"]["rank"]): float(r["value"][1])
           for r in joined}
    assert set(got) == {(RUN, host, str(rank)) for host, rank in traces}
    for (host, rank), trace in traces.items():
        assert got[(RUN, host, str(rank))] == (trace[-1]["reserved_bytes"] // 1048576 + 1024) * 1048576
    for title in ("DCGM frame buffer used", "DCGM GPU utilisation", "DCGM power", "DCGM temperature"):
        panel = next(p for p in dashboard_panels(dashboard) if p["title"] == title)
        assert len(prom.query(grafana_to_promql(panel["targets"][0]["expr"]))) == 4, title


def check_dashboard_against(prom: PrometheusServer) -> None:
    """The dashboard's queries on real data: one table row per rank, and {{run}} in every legend
    whose query returns a run label."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard_panels(dashboard):
        frames = []
        for target in panel.get("targets", []):
            result = prom.query(grafana_to_promql(target["expr"]))
            frames.append([r["metric"] for r in result])
            if target.get("format") != "table" and any("run" in r["metric"] for r in result):
                assert "{{run}}" in target["legendFormat"], (panel["title"], target["refId"])
        if any(t["id"] == "merge" for t in panel.get("transformations", [])):
            rows = merged_rows(frames)
            keys = [(r.get("run"), r.get("Hostname"), r.get("rank")) for r in rows]
            assert len(keys) == len(set(keys)) == 4, (panel["title"], rows)


def check_rank_links(prom: PrometheusServer, shard_of_host: dict[str, str]) -> None:
    """Each "Ranks now" row's first link, rendered as Grafana would from the row, points at the
    shard that holds the rank (its scrape target), and that shard's page, opened from the link
    in headless Chromium, shows that rank."""
    from playwright.sync_api import sync_playwright

    panel = next(p for p in dashboard_panels(json.loads(DASHBOARD.read_text())) if p["title"] == "Ranks now")
    rows = merged_rows([[r["metric"] for r in prom.query(grafana_to_promql(t["expr"]))] for t in panel["targets"]])
    shard_link = panel_links(panel)[0]["url"]
    variables = {"collector_url": "http://unused.invalid", "__from": "0", "__to": "1"}
    links = {(row["Hostname"], row["rank"]): interpolate_link(shard_link, row, variables) for row in rows}
    assert len(links) == len(rows) == 4
    for (host, _rank), url in links.items():
        assert url.startswith(shard_of_host[host] + "/#/run/"), (host, url)
    chromium = need_binary("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            for (host, rank), url in sorted(links.items()):
                page.goto(url)
                page.wait_for_function("t => (document.getElementById('rank-title')?.textContent ?? '') === t",
                                       arg=f"Rank {rank} · {host}", timeout=20_000)
                assert page.get_attribute("#verdict-strip tbody tr.selected", "data-rank") == rank
        finally:
            browser.close()


def test_leak_alert_is_routed_by_alertmanager_to_a_webhook(tmp_path) -> None:
    """Collector -> real Prometheus (shipped rules, `for:` 0s) -> real Alertmanager (the shipped
    routing tree and inhibit rules, test timings, webhook URLs pointing here) -> this test.
    Rank 1 leaks, rank 0 is healthy: the leak reaches the on-call receiver, naming rank 1 only;
    its plateau-break/low-headroom side effects are inhibited; nothing names rank 0."""
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    run, steps = "leaky-job", 3300
    start_ts = time.time() - steps - 60
    # each rank's latest sample 2 s ago: both still running, within their silence windows
    samples = [*ending_at(list(simulate_trace("healthy", steps=steps, run=run, host="node-a", rank=0,
                                              start_ts=start_ts)), time.time() - 2),
               *ending_at(list(simulate_trace("fast_leak", steps=steps, run=run, host="node-a", rank=1,
                                              start_ts=start_ts)), time.time() - 2)]
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "0s"
    shipped = yaml.safe_load(ALERTMANAGER.read_text())
    shipped_prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert shipped_prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]

    with WebhookReceiver() as hook, BackgroundServer(str(tmp_path / "c.db")) as collector:
        config = json.loads(json.dumps(shipped))  # the shipped routing, faster and pointed at the hook
        config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        for receiver in config["receivers"]:
            for webhook in receiver["webhook_configs"]:
                webhook["url"] = f"{hook.url}/{receiver['name']}"
        post_samples(collector.url, samples)
        with AlertmanagerServer(tmp_path / "am", config) as am:
            prom_config = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am.url.removeprefix("http://")]}]}]},
                "scrape_configs": [{"job_name": "vramwatch", "honor_labels": True,
                                    "static_configs": [{"targets": [collector.url.removeprefix("http://")]}]}],
            }
            with PrometheusServer(tmp_path / "prometheus", prom_config, {"vramwatch.rules.yml": rules}):
                delivered = hook.wait_for(lambda alerts: any(
                    a["labels"]["alertname"] == "VramwatchMemoryLeak" for _p, a in alerts))
                time.sleep(2)  # a group interval more: anything else routed would have arrived
                delivered = hook.alerts()
    leaks = [(path, a) for path, a in delivered if a["labels"]["alertname"] == "VramwatchMemoryLeak"]
    assert {path for path, _ in leaks} == {"/training-oncall"}
    (_path, leak) = leaks[0]
    assert leak["status"] == "firing"
    assert (leak["labels"]["run"], leak["labels"]["rank"], leak["labels"]["severity"]) == (run, "1", "critical")
    assert leak["annotations"]["summary"].startswith(f"Memory leak on {run} rank 1 (node-a): OOM in ")
    assert {a["labels"].get("rank") for _p, a in delivered} == {"1"}, delivered
    inhibited = {"VramwatchPlateauBreak", "VramwatchHeadroomLow"}
    assert not [a for _p, a in delivered if a["labels"]["alertname"] in inhibited], delivered
