"""deploy/: the files Docker, Kubernetes, Prometheus and Grafana would load, validated here
(Docker cannot run in this environment): promtool on the rules and config, structure and
cross-references of compose/k8s/Grafana files, and every PromQL expression checked against
the metric names a real collector exposes (taken from a live scrape, not a list)."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
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

REQUIRED_ALERTS = {
    "VramwatchPlateauBreak",
    "VramwatchMemoryLeak",
    "VramwatchHeadroomLow",
    "VramwatchAllocRetriesRising",
    "VramwatchGrowthOutsideAllocator",
    "VramwatchHookSilent",
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
    start = time.time() - 4000
    with BackgroundServer(str(db)) as srv:
        traces = [
            simulate_trace("checkpoint", steps=2500, run="names", host="node-a", rank=0, start_ts=start),
            simulate_trace("fast_leak", steps=3000, run="names", host="node-a", rank=1, start_ts=start),
            simulate_trace("late_step", steps=3600, run="names", host="node-b", rank=2, start_ts=start),
        ]
        for trace in traces:
            post_samples(srv.url, trace)
        srv_names = exposed_names(scrape(srv.url).text)
    return srv_names


def test_every_shipped_query_uses_only_metrics_the_collector_exposes(scrape_names) -> None:
    known = scrape_names | recording_rule_names() | PROMETHEUS_OWN
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
    assert "SUCCESS: 8 rules found" in result.stdout


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

def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "vramwatch-overview"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"run", "host", "rank"}
    for variable in variables.values():
        assert variable["query"]["query"].startswith("label_values(")
        assert variable["datasource"]["uid"] == DATASOURCE_UID
    assert variables["host"]["query"]["query"].endswith("Hostname)")

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    all_panels = list(panels(dashboard["panels"]))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    types = {p["type"] for p in all_panels}
    assert {"timeseries", "state-timeline", "stat", "table", "row"} <= types
    for panel in all_panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == DATASOURCE_UID
            # every per-rank query follows the dashboard's variables
            if "vramwatch_memory_" in target["expr"] or "vramwatch_headroom_bytes" in target["expr"]:
                assert "$run" in target["expr"], panel["title"]
    titles = " | ".join(p["title"] for p in all_panels).lower()
    for word in ("headroom", "trend state", "rank skew", "time to oom", "reserved"):
        assert word in titles, word
    assert any(p.get("repeat") == "rank" for p in all_panels), "per-rank panels repeat over $rank"
    annotations = {a["name"]: a for a in dashboard["annotations"]["list"]}
    assert "vramwatch_checkpoint_peak_bytes" in annotations["Checkpoints"]["expr"]
    assert annotations["Checkpoints"]["datasource"]["uid"] == DATASOURCE_UID
    # the state mapping covers every engine state
    timeline = next(p for p in all_panels if p["type"] == "state-timeline")
    mapped = {opt["text"] for m in timeline["fieldConfig"]["defaults"]["mappings"] for opt in m["options"].values()}
    assert mapped == {"warmup", "plateau", "rising", "leak", "fragmentation"}


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

    alerting = yaml.safe_load(GRAFANA_ALERTS.read_text())
    (group,) = alerting["groups"]
    (rule,) = group["rules"]
    assert rule["uid"] and rule["title"] and rule["for"]
    refs = {item["refId"]: item for item in rule["data"]}
    assert rule["condition"] in refs
    assert refs["A"]["datasourceUid"] == DATASOURCE_UID
    assert "vramwatch_plateau_breaks_total" in refs["A"]["model"]["expr"]
    assert refs["C"]["model"]["expression"] == "B" and refs["B"]["model"]["expression"] == "A"
    assert rule["annotations"]["__dashboardUid__"] == json.loads(DASHBOARD.read_text())["uid"]


# ------------------------------------------------------------------ compose and Kubernetes

def test_compose_stack() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"collector", "prometheus", "grafana"}
    collector = services["collector"]
    assert (DEPLOY / collector["build"]["context"] / collector["build"]["dockerfile"]).is_file()
    dockerfile = (ROOT / "Dockerfile").read_text()
    exposed = re.search(r"^EXPOSE (\d+)", dockerfile, re.M).group(1)
    assert collector["ports"] == [f"{exposed}:{exposed}"]
    assert "0.0.0.0" in collector["command"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert f"collector:{exposed}" in targets
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), volume
            else:
                assert source in compose["volumes"], volume
    prom_mounts = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert "/etc/prometheus/rules" in prom_mounts and "/etc/prometheus/prometheus.yml" in prom_mounts


def test_kubernetes_manifests() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "collector.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert {"Deployment", "Service", "PersistentVolumeClaim"} <= set(by_kind)
    deployment, service = by_kind["Deployment"], by_kind["Service"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    for scrape_hints in (template["metadata"]["annotations"], service["metadata"]["annotations"]):
        assert scrape_hints["prometheus.io/scrape"] == "true"
        assert int(scrape_hints["prometheus.io/port"]) == port_names["http"]
        assert scrape_hints["prometheus.io/path"] == "/metrics"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    env = {e["name"]: e for e in container["env"]}
    assert env["VRAMWATCH_DB"]["value"].startswith(mounts["data"] + "/")
    assert env["VRAMWATCH_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    monitor = yaml.safe_load((DEPLOY / "k8s" / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True and endpoint["port"] == "http"
