"""deploy/ for Prometheus and Grafana: promtool on the rules, config and unit tests, the rules'
one-source guarantees, the generated dashboard and its check (no rows per rank, {{run}} in
legends, only metric names a real collector exposes, $datasource everywhere), and the dcgm
join as documented. Compose, Kubernetes and the Dockerfile: tests/deploy/test_deploy_platforms.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml
from grafana_helpers import (
    DCGM_METRICS,
    check_dashboard,
    dashboard_panels,
    interpolate_link,
    merged_rows,
    outer_grouping,
    panel_links,
)
from helpers import ending_at
from incident_runs import device_oom
from prometheus_helpers import (
    DASHBOARD,
    DEPLOY,
    GRAFANA_ALERTS,
    ROOT,
    RULE_TESTS,
    RULES,
    alert_rules,
    all_queries,
    exposed_names,
    post_samples,
    promql_metric_names,
    recording_rule_names,
    run_promtool,
    scrape,
)

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace
from vramwatch.verdicts import LOW_HEADROOM_FRACTION, STATES

REQUIRED_ALERTS = {
    "VramwatchOOM",
    "VramwatchSuspectedOom",
    "VramwatchOOMImminent",
    "VramwatchRankDied",
    "VramwatchPlateauBreak",
    "VramwatchMemoryLeak",
    "VramwatchHeadroomLow",
    "VramwatchAllocRetriesRising",
    "VramwatchGrowthOutsideAllocator",
    "VramwatchHookSilent",
    "VramwatchForeignProcessOnGPU",  # docs/evidence.md
    "VramwatchHostMemoryLow",
    "VramwatchTokensNearLimit",  # group vramwatch-decisions
}
QUIET_SCENARIOS = ("warm-up", "checkpoint spikes", "noisy plateau")
DATASOURCE_UID = "vramwatch-prometheus"
#: Series Prometheus itself creates; everything else must come from the collector or a rule.
PROMETHEUS_OWN = {"ALERTS", "ALERTS_FOR_STATE", "up"}


# ------------------------------------------------------------------ a real scrape

@pytest.fixture(scope="module")
def scrape_names(tmp_path_factory) -> set[str]:
    """Metric names from a real collector fed scenarios that exercise every family."""
    db = tmp_path_factory.mktemp("deploy-scrape") / "vw.db"
    now = time.time()  # every rank still running (a rank that stopped has its state families withdrawn)
    with BackgroundServer(str(db)) as srv:
        traces = [
            simulate_trace("checkpoint", steps=2500, run="names", host="node-a", rank=0, start_ts=now - 2510,
                           tokens_per_step=16384, seq_min=0.4),  # tokens: the decision families
            simulate_trace("fast_leak", steps=3000, run="names", host="node-a", rank=1, start_ts=now - 3010),
            simulate_trace("late_step", steps=3600, run="names", host="node-b", rank=2, start_ts=now - 3610),
            # what the real hook adds: other processes on the GPU and host memory (docs/evidence.md)
            [dict(s, foreign_used_bytes=2**30, host_rss_bytes=40 * 2**30, host_children_rss_bytes=8 * 2**30,
                  host_available_bytes=900 * 2**30, host_pinned_bytes=2**30)
             for s in simulate_trace("healthy", steps=50, run="names", host="node-c", rank=3, start_ts=now - 60)],
            # an OOM the rank caught and ran on after (the last-OOM family)
            [dict(s, ooms=int(s["step"] >= 30))
             for s in simulate_trace("healthy", steps=50, run="names", host="node-c", rank=4, start_ts=now - 60)],
        ]
        # a rank of another run that died saying why: the died family (its last words as labels)
        died = list(simulate_trace("healthy", steps=20, run="names-dead", host="node-d", rank=0, start_ts=now - 30))
        traces.append([*died, {**died[-1], "ts": died[-1]["ts"] + 0.5, "seq": 1, "last_words_type": "RuntimeError",
                               "last_words_message": "CUDA error: an illegal memory access was encountered",
                               "last_words_phase": "train"}])
        # device memory only (dcgm): a rank's memory vanished near full, a suspected OOM (its families)
        traces.append(device_oom("names-device", end=now - 2))
        for trace in traces:
            post_samples(srv.url, ending_at(list(trace), now - 2))
        srv_names = exposed_names(scrape(srv.url).text)
    return srv_names


def test_every_shipped_query_uses_only_metrics_the_collector_exposes(scrape_names) -> None:
    known = known_metrics(scrape_names)
    queries = all_queries()
    assert len(queries) > 30
    unknown = {
        (where, name) for where, expr in queries for name in promql_metric_names(expr) if name not in known
    }
    assert not unknown, f"queries reference metrics no collector exposes: {sorted(unknown)}"
    used = {name for _, expr in queries for name in promql_metric_names(expr)}
    # the core of the product is on the dashboard / in the rules
    for name in ("vramwatch_trend_state", "vramwatch_headroom_bytes", "vramwatch_seconds_to_oom",
                 "vramwatch_plateau_breaks_total", "vramwatch_memory_reserved_bytes",
                 "vramwatch_checkpoint_peak_bytes", "vramwatch_outside_allocator_bytes"):
        assert name in used, name


def test_the_name_check_catches_a_misspelt_metric(scrape_names) -> None:
    expr = 'max by (run) (vramwatch_memory_reservd_bytes{run=~"$run"}) / on (run) vramwatch_device_total_bytes'
    names = promql_metric_names(expr)
    assert names == {"vramwatch_memory_reservd_bytes", "vramwatch_device_total_bytes"}
    assert names - scrape_names == {"vramwatch_memory_reservd_bytes"}


def test_promql_name_extraction() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (instance, le) (rate(vramwatch_ingest_request_duration_seconds_bucket'
        '[$__rate_interval])))'
    ) == {"vramwatch_ingest_request_duration_seconds_bucket"}
    assert promql_metric_names('label_values(vramwatch_step{run=~"$run"}, Hostname)') == {"vramwatch_step"}
    assert promql_metric_names(
        '(time() - a_seconds > 300) and on (run) (time() - max by (run) (b_seconds offset 5m) < 120)'
    ) == {"a_seconds", "b_seconds"}
    assert promql_metric_names('x{state="leak"} == 1 or on (run, rank) y * 1e9') == {"x", "y"}
    assert promql_metric_names("run:vramwatch_headroom_ratio:min") == {"run:vramwatch_headroom_ratio:min"}


# ------------------------------------------------------------------ promtool

def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    # 11 + 2 evidence alerts + vramwatch-decisions + rank died + suspected OOM
    assert "SUCCESS: 16 rules found" in result.stdout


def test_promtool_unit_tests_for_every_alert_pass() -> None:
    result = run_promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_check_config() -> None:
    result = run_promtool("check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_fail_when_an_alert_loses_its_guard(tmp_path) -> None:
    """The quiet scenarios have teeth: without `for:` the headroom alert fires on the noisy plateau."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    weakened = RULES.read_text().replace("for: 10m", "for: 0m", 1)
    assert weakened != RULES.read_text()
    (tmp_path / "rules" / "vramwatch.rules.yml").write_text(weakened)
    (tmp_path / "tests" / "t.yml").write_text(RULE_TESTS.read_text())
    result = run_promtool("test", "rules", str(tmp_path / "tests" / "t.yml"))
    assert result.returncode != 0
    assert "VramwatchHeadroomLow" in result.stdout + result.stderr
    assert "noisy plateau" in result.stdout + result.stderr


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    alerts = alert_rules()
    assert set(alerts) == REQUIRED_ALERTS
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    assert yaml.safe_load(RULE_TESTS.read_text())["rule_files"] == ["../rules/vramwatch.rules.yml"]
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert "for" in rule, f"{name}: production rules keep a for: duration"
        fires = [
            case for group in tests for case in group.get("alert_rule_test", [])
            if case["alertname"] == name and case["exp_alerts"]
        ]
        assert fires, f"{name}: no test where it fires"
        for scenario in QUIET_SCENARIOS:
            quiet = [
                case for group in tests if group["name"].startswith("quiet:") and scenario in group["name"]
                for case in group["alert_rule_test"] if case["alertname"] == name
            ]
            assert len(quiet) >= 3 and all(case["exp_alerts"] == [] for case in quiet), (name, scenario)
    leak = next(
        case for group in tests for case in group.get("alert_rule_test", [])
        if case["alertname"] == "VramwatchMemoryLeak" and case["exp_alerts"]
    )
    assert any("OOM in 41m 40s" in a["exp_annotations"]["summary"] for a in leak["exp_alerts"])


def test_scrape_config_honours_labels_and_loads_the_rules() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vramwatch")
    assert job["honor_labels"] is True
    assert job["metrics_path"] == "/metrics"
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    assert RULES.name.endswith(".yml")


# ------------------------------------------------------------------ Grafana

def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def known_metrics(scrape_names: set[str]) -> set[str]:
    return scrape_names | recording_rule_names() | PROMETHEUS_OWN | DCGM_METRICS


def test_dashboard_is_generated_from_its_builder() -> None:
    result = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "build_dashboard.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_dashboard_check_passes(scrape_names) -> None:
    assert check_dashboard(load_dashboard(), known_metrics(scrape_names)) == []


def test_dashboard_check_catches_each_defect(scrape_names) -> None:
    """The check has teeth: each defect the issue found, put back into the dashboard, is reported."""
    known = known_metrics(scrape_names)

    def problems_after(mutate) -> str:
        dashboard = load_dashboard()
        mutate(dashboard)
        return " | ".join(check_dashboard(dashboard, known))

    def panel(dashboard, title):
        return next(p for p in dashboard_panels(dashboard) if p.get("title") == title)

    def repeat_per_rank(d):
        panel(d, "Reserved per rank")["repeat"] = "rank"

    def raw_table_query(d):
        panel(d, "Ranks now")["targets"][0]["expr"] = 'vramwatch_trend_state{run=~"$run"} == 1'

    def legend_without_run(d):
        panel(d, "Headroom per rank")["targets"][0]["legendFormat"] = "rank {{rank}} ({{Hostname}})"

    def legend_without_gpu(d):
        panel(d, "Reserved per rank")["targets"][0]["legendFormat"] = "{{run}} r{{rank}} {{Hostname}}"

    def dcgm_without_run(d):  # the dcgm panels are joined to the ranks, so they filter and name by run
        target = panel(d, "DCGM power")["targets"][0]
        target["expr"], target["legendFormat"] = 'DCGM_FI_DEV_POWER_USAGE{gpu=~"$gpu"}', "{{Hostname}}"

    def misspelt(d):
        target = panel(d, "Reserved per rank")["targets"][0]
        target["expr"] = target["expr"].replace("reserved", "reservd")

    def fixed_datasource(d):
        panel(d, "Reserved per rank")["targets"][0]["datasource"]["uid"] = "vramwatch-prometheus"

    def no_inputs(d):
        d.pop("__inputs")

    def shard_dropped(d):  # the table's queries aggregate `instance` away: the rank link's host is empty
        for target in panel(d, "Ranks now")["targets"]:
            target["expr"] = target["expr"].replace("by (run, Hostname, rank, instance)", "by (run, Hostname, rank)")

    def renamed_variable(d):  # the link still names the old variable
        next(v for v in d["templating"]["list"] if v["name"] == "collector_url")["name"] = "collector"

    assert "repeated per value of multi-value $rank" in problems_after(repeat_per_rank)
    assert "Ranks now: merged queries do not aggregate to one label set" in problems_after(raw_table_query)
    assert "Headroom per rank A: legend lacks {{run}}" in problems_after(legend_without_run)
    assert problems_after(legend_without_gpu) == "Reserved per rank A: legend lacks {{gpu}}"
    assert problems_after(dcgm_without_run) == "DCGM power A: legend lacks {{gpu}}"
    assert "unknown metric vramwatch_memory_reservd_bytes" in problems_after(misspelt)
    assert "query datasource is not ${datasource}" in problems_after(fixed_datasource)
    assert "no __inputs entry" in problems_after(no_inputs)
    assert problems_after(shard_dropped) == "Ranks now: link uses field 'instance' that its queries do not keep"
    assert problems_after(renamed_variable).split(" | ") == [
        f"{owner}: link uses undefined variable $collector_url" for owner in ("dashboard", "Ranks now")]


def test_merge_simulation_reproduces_the_three_rows_per_rank() -> None:
    """Queries keeping different __name__ values give one row per query and rank; aggregated, one row."""
    ranks = [{"run": "r", "Hostname": "h", "rank": str(i)} for i in range(2)]
    named = [[{"__name__": name, **labels} for labels in ranks] for name in ("a", "b", "c")]
    assert len(merged_rows(named)) == 6
    assert len(merged_rows([[dict(labels) for labels in ranks] for _ in range(3)])) == 2
    assert outer_grouping("max by (run, Hostname, rank) (a / b)") == {"run", "Hostname", "rank"}
    assert outer_grouping("max by (run) (a) - min by (run) (b)") is None
    assert outer_grouping("sum by (run) (increase(x[2m])) > 0") is None


def test_dashboard_scales_and_reads_well() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "vramwatch-overview"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "run", "host", "rank", "focus", "instance", "gpu"} <= set(variables)
    assert variables["host"]["query"]["query"].endswith("Hostname)")
    assert variables["focus"]["multi"] is False and variables["focus"]["includeAll"] is False
    assert "DCGM_FI_DEV_" in variables["instance"]["query"]["query"]
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert not any(p.get("repeat") for p in panels), "no panel is copied per rank"
    # the per-rank detail is one collapsed row for the single $focus rank
    detail = next(p for p in panels if p["type"] == "row" and "$focus" in p["title"])
    assert detail["collapsed"] is True and detail["panels"]
    assert all('rank="$focus"' in t["expr"] for p in detail["panels"] for t in p["targets"])
    # O(1): panels and queries do not depend on the number of ranks
    assert len(panels) < 40 and sum(len(p.get("targets", [])) for p in panels) < 80
    titles = {p["title"] for p in panels}
    for wanted in ("Worst headroom (run)", "Soonest OOM", "Ranks now", "Trend state per rank", "Time to OOM",
                   "Steps to OOM", "Checkpoint headroom per rank", "Process used (NVML) per rank",
                   "OOMs in the time range", "torch reserved vs DCGM FB used", "DCGM GPU utilisation",
                   "DCGM power", "DCGM temperature", "DCGM frame buffer used"):
        assert wanted in titles, wanted
    by_title = {p["title"]: p for p in panels}
    for panel in panels:
        if panel["type"] in ("timeseries", "stat"):
            assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
    # smallest first where the smallest matters
    for title in ("Headroom per rank", "Time to OOM", "Steps to OOM", "Checkpoint headroom per rank"):
        assert by_title[title]["options"]["tooltip"]["sort"] == "asc", title
        assert by_title[title]["options"]["legend"]["calcs"][0] == "min", title
    assert by_title["Leak slope per step"]["fieldConfig"]["defaults"]["unit"].endswith("/step")
    assert by_title["Ingest samples/s by result"]["fieldConfig"]["defaults"]["unit"].endswith("/s")
    assert by_title["Soonest OOM"]["fieldConfig"]["defaults"]["noValue"] == "nothing growing"
    skew = by_title["Rank skew (reserved, max - min)"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in skew] == ["green", "yellow", "red"]
    # the single low-headroom threshold, from verdicts.py
    headroom = by_title["Worst headroom (run)"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert headroom[1] == {"color": "green", "value": LOW_HEADROOM_FRACTION}
    # every state mapped, only a leak is red
    for timeline in (p for p in panels if p["type"] == "state-timeline"):
        colors = {o["text"]: o["color"] for m in timeline["fieldConfig"]["defaults"]["mappings"]
                  for o in m["options"].values()}
        assert set(colors) == set(STATES)
        assert [s for s, c in colors.items() if c == "red"] == ["leak"]
        assert colors["rising"] != colors["leak"]
    # annotations: checkpoints from the counter, OOMs, plateau breaks, firing alerts
    annotations = {a["name"]: a for a in dashboard["annotations"]["list"]}
    assert "vramwatch_checkpoints_total" in annotations["Checkpoints"]["expr"]
    assert "vramwatch_ooms_total" in annotations["OOMs"]["expr"]
    assert 'ALERTS{alertname=~"Vramwatch.*"' in annotations["Alerts"]["expr"]
    # links carry the run and the time range
    link = next(item for item in dashboard["links"] if item["type"] == "link")
    assert "${run" in link["url"] and "${__from}" in link["url"] and "${__to}" in link["url"]
    assert any(item["type"] == "dashboards" and item["keepTime"] for item in dashboard["links"])
    # each rank links to the shard that holds it (the scrape target), then to $collector_url
    shard, fallback = (lk["url"] for lk in panel_links(by_title["Ranks now"]))
    row = {"run": "job a/b", "rank": "3", "Hostname": "node-7", "instance": "10.0.0.7:8765"}
    variables = {"collector_url": "https://vramwatch.example", "__from": "100", "__to": "200"}
    route = "/#/run/job%20a%2Fb?rank=3&host=node-7&x=time&from=100&to=200"
    assert interpolate_link(shard, row, variables) == "http://10.0.0.7:8765" + route
    assert interpolate_link(fallback, row, variables) == "https://vramwatch.example" + route


def test_grafana_provisioning_files_fit_together() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    datasource = yaml.safe_load((prov / "datasources" / "vramwatch.yaml").read_text())
    assert datasource["apiVersion"] == 1
    (ds,) = datasource["datasources"]
    assert ds["uid"] == DATASOURCE_UID and ds["type"] == "prometheus" and ds["url"].startswith("http://")
    provider = yaml.safe_load((prov / "dashboards" / "vramwatch.yaml").read_text())
    (prov_entry,) = provider["providers"]
    assert prov_entry["type"] == "file"
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grafana_mounts = dict(v.rsplit(":", 2)[:2] if v.endswith(":ro") else v.split(":", 1)
                          for v in compose["services"]["grafana"]["volumes"])
    assert grafana_mounts["./grafana/dashboards"] == prov_entry["options"]["path"]
    assert grafana_mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"

    # Grafana's rules are the Prometheus alerts' copies: each named as its alert (so Alertmanager's
    # inhibitions hold for it), its PromQL with the same gates, for: and labels, on this datasource
    alerting = yaml.safe_load(GRAFANA_ALERTS.read_text())
    (group,) = alerting["groups"]
    prometheus = alert_rules()
    assert {rule["title"] for rule in group["rules"]} >= {"VramwatchPlateauBreak", "VramwatchMemoryLeak",
                                                         "VramwatchOOMImminent", "VramwatchOOM"}
    for rule in group["rules"]:
        source = prometheus[rule["title"]]
        refs = {item["refId"]: item for item in rule["data"]}
        assert rule["condition"] in refs
        assert refs["A"]["datasourceUid"] == DATASOURCE_UID
        assert refs["A"]["model"]["expr"] == source["expr"].strip()
        assert rule["for"] == source["for"] and rule["labels"] == source["labels"]
        assert refs["C"]["model"]["expression"] == "B" and refs["B"]["model"]["expression"] == "A"
        assert rule["annotations"]["__dashboardUid__"] == json.loads(DASHBOARD.read_text())["uid"]
    plateau = next(r for r in group["rules"] if r["title"] == "VramwatchPlateauBreak")
    assert "vramwatch_rank_running == 0" in plateau["data"][0]["model"]["expr"]  # the run's end resolves it


# ------------------------------------------------------------------ the dcgm join

OLD_DCGM_JOIN = ("DCGM_FI_DEV_FB_USED * 1048576\n"
                 "  * on (UUID) group_left (run, rank) (vramwatch_device_total_bytes > bool 0)")


def documented_dcgm_queries() -> list[str]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = text.split("Joining with dcgm-exporter", 1)[1].split("```promql", 1)[1].split("```", 1)[0]
    queries, current = [], []
    for line in block.strip().splitlines():
        if line.startswith("#"):
            if current:
                queries.append("\n".join(current))
            current = []
        else:
            current.append(line)
    queries.append("\n".join(current))
    return queries


def dcgm_join_group(tests: list[dict]) -> dict:
    """The promtool case's series (finished + new run on one GPU, NVML-less ranks, dcgm scraped
    twice) plus the raw families the joins read."""
    group = json.loads(json.dumps(next(g for g in yaml.safe_load(RULE_TESTS.read_text())["tests"]
                                       if g["name"].startswith("dcgm join"))))
    group.pop("promql_expr_test")
    for series in list(group["input_series"]):
        if series["series"].startswith("vramwatch_last_received_timestamp_seconds"):
            labels = series["series"].split("{", 1)[1]
            group["input_series"].append({"series": "vramwatch_device_total_bytes{" + labels, "values": "80e9x25"})
            group["input_series"].append({"series": "vramwatch_memory_reserved_bytes{" + labels,
                                          "values": "31457280000x25"})
    group["promql_expr_test"] = tests
    return group


def run_rule_test(tmp_path, group: dict) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules").mkdir(exist_ok=True)
    (tmp_path / "rules" / "vramwatch.rules.yml").write_text(RULES.read_text())
    test_file = tmp_path / "t.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": ["rules/vramwatch.rules.yml"], "evaluation_interval": "1m",
                                         "tests": [group]}, sort_keys=False, width=100000))
    return run_promtool("test", "rules", str(test_file))


def test_the_documented_dcgm_joins_give_one_series_per_gpu(tmp_path) -> None:
    join, share = documented_dcgm_queries()
    new_rank = {"run": "new", "rank": "3", "Hostname": "node-a"}
    labels = lambda d: "{" + ", ".join(f'{k}="{v}"' for k, v in d.items()) + "}"  # noqa: E731
    tests = [
        {"expr": join, "eval_time": "8m",
         "exp_samples": [{"labels": labels({"UUID": "GPU-a", **new_rank}), "value": 60000 * 1048576}]},
        {"expr": share, "eval_time": "8m", "exp_samples": [{"labels": labels(new_rank), "value": 0.5}]},
    ]
    result = run_rule_test(tmp_path, dcgm_join_group(tests))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_old_dcgm_join_is_many_to_many(tmp_path) -> None:
    """The class of the defect: on the same series the join the docs used to give fails."""
    result = run_rule_test(tmp_path, dcgm_join_group([{"expr": OLD_DCGM_JOIN, "eval_time": "8m",
                                                       "exp_samples": []}]))
    assert result.returncode != 0
    assert "many-to-many matching not allowed" in result.stdout + result.stderr
