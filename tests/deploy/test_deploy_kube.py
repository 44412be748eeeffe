"""The Kubernetes paths as a kube-prometheus-stack user applies them: every documented command
rendered (``kubectl kustomize`` and ``sed``, exactly as docs/deploy.md gives it) under two
release names and every object validated by the tool that owns its format; the Grafana alert
rules parsed and their queries run through Prometheus' engine on simulated runs; the
AlertmanagerConfig translated as prometheus-operator does and delivering through a real
Alertmanager to a webhook. Under CI=true a missing tool fails instead of skipping."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from helpers import ending_at
from kube_helpers import (
    CHART_ALERTMANAGER_CONFIG,
    DOCS,
    LABEL_VALUE,
    RELEASE_PLACEHOLDER,
    amtool_route,
    documented_commands,
    load_objects,
    render,
    translate_alertmanager_config,
)
from prometheus_helpers import (
    DASHBOARD,
    DEPLOY,
    RULE_TESTS,
    RULES,
    AlertmanagerServer,
    PrometheusServer,
    WebhookReceiver,
    alert_rules,
    load_module,
    need_binary,
    need_module,
    post_samples,
    run_promtool,
    run_tool,
)

from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace

VARIANTS = ("deploy/k8s", "deploy/k8s/node-local", "deploy/k8s/kube-prometheus-stack",
            "deploy/k8s/kube-prometheus-stack/node-local")
KPS = VARIANTS[2:]
RELEASES = ("kube-prometheus-stack", "prom-eu1")  # the chart's usual name and any other
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"}
K8S_VERSIONS = ("1.28.0", "1.31.0", "1.34.0")
NAMESPACE = "monitoring"
GENERATOR = DEPLOY / "k8s" / "generate_grafana.py"
grafana_gen = load_module(GENERATOR)
LAST_APPLIED_LIMIT = 262144  # kubectl apply keeps the object in an annotation; annotations total 256 KiB

_rendered: dict[tuple[str, str], list[dict]] = {}


def rendered(path: str, release: str = "prom-eu1") -> list[dict]:
    if (path, release) not in _rendered:
        _rendered[(path, release)] = render(path, release)
    return _rendered[(path, release)]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects}


# ------------------------------------------------------------------ one command, one parameter

def test_every_path_is_one_documented_command() -> None:
    commands = documented_commands()
    assert set(commands) == set(VARIANTS)
    for command in commands.values():
        assert f's/{RELEASE_PLACEHOLDER}/$RELEASE/' in command


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("path", VARIANTS)
def test_the_release_name_reaches_every_object_its_chart_selects(path, release) -> None:
    objects = rendered(path, release)
    text = json.dumps(objects)
    assert RELEASE_PLACEHOLDER not in text
    selected = [o for o in objects if o["kind"] in OPERATOR_KINDS]
    assert {o["kind"] for o in selected} >= {"ServiceMonitor", "PrometheusRule"}
    assert all(o["metadata"]["labels"]["release"] == release for o in selected)
    if release == "prom-eu1":  # the name lands nowhere but in those labels
        assert text.count(release) == len(selected)
    # the namespace is created with the rest (a first apply on a cluster without it does not fail)
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == NAMESPACE
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]
        assert len(json.dumps(obj)) < LAST_APPLIED_LIMIT // 2, obj["metadata"]["name"]


@pytest.mark.parametrize("path", VARIANTS)
def test_scrape_hints_only_where_metrics_needs_no_token(path) -> None:
    """An annotation-driven scrape job sends no token: the pods of the --auth-read variants carry
    no prometheus.io/* hints (their ServiceMonitor sends the token), the others keep them."""
    workloads = [o for o in rendered(path) if o["kind"] in ("Deployment", "DaemonSet")]
    assert workloads
    for workload in workloads:
        template = workload["spec"]["template"]
        auth_read = "--auth-read" in template["spec"]["containers"][0]["args"]
        assert auth_read == (path in KPS)
        hints = {k for k in template["metadata"].get("annotations") or {} if k.startswith("prometheus.io/")}
        assert hints == (set() if auth_read else {"prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"})


def test_without_the_command_the_api_server_refuses_the_release_label() -> None:
    assert LABEL_VALUE.fullmatch(RELEASE_PLACEHOLDER) is None
    assert all(LABEL_VALUE.fullmatch(release) for release in RELEASES)
    raw = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "monitoring" / "servicemonitor.yaml").read_text()) if d]
    assert raw[0]["metadata"]["labels"]["release"] == RELEASE_PLACEHOLDER


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_core_objects_validate_strictly(tmp_path, version) -> None:
    core = [o for path in VARIANTS for o in rendered(path) if o["kind"] not in OPERATOR_KINDS]
    kinds = {o["kind"] for o in core}
    assert kinds == {"Namespace", "Deployment", "DaemonSet", "Service", "PersistentVolumeClaim", "ConfigMap",
                     "NetworkPolicy"}
    manifest = tmp_path / "core.yaml"
    manifest.write_text(yaml.safe_dump_all(core, sort_keys=False))
    result = run_tool("kubernetes-validate", "--strict", "-k", version, str(manifest))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(core), result.stdout


def test_rendered_operator_objects_validate_strictly() -> None:
    need_module("cloudcoil.models.prometheus_operator", "cloudcoil-models-prometheus-operator")
    checker = load_module(DEPLOY / "k8s" / "check_operator_objects.py")
    seen = set()
    for path in VARIANTS:
        for obj in rendered(path):
            if obj["kind"] in OPERATOR_KINDS:
                assert checker.check_document(obj) == [], (path, obj["kind"])
                seen.add(obj["kind"])
    assert seen == OPERATOR_KINDS
    # the check has teeth on the AlertmanagerConfig too: a misspelt field, a bad match type
    amcfg = json.loads(json.dumps(by_kind(rendered(KPS[0]))["AlertmanagerConfig"]))
    amcfg["spec"]["route"]["groupby"] = amcfg["spec"]["route"].pop("groupBy")
    amcfg["spec"]["inhibitRules"][0]["sourceMatch"][0]["matchType"] = "=="
    errors = " | ".join(checker.check_document(amcfg))
    assert "spec.route.groupby: Extra inputs are not permitted" in errors
    assert "spec.inhibitRules.0.sourceMatch.0.matchType" in errors


# ------------------------------------------------------------------ the workloads

@pytest.mark.parametrize("path", VARIANTS)
def test_collectors_outlast_their_replay_and_read_with_the_token_in_the_variant(path) -> None:
    objects = rendered(path)
    (workload,) = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/healthz", "port": "http"}
    # 4 million samples took 50 s here (docs/deploy.md); the probe allows 15 minutes
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert "initialDelaySeconds" not in container["livenessProbe"]  # the startupProbe holds it back
    assert ("--auth-read" in container["args"]) == (path in KPS)
    if workload["kind"] == "DaemonSet":
        selector = workload["spec"]["template"]["spec"]["nodeSelector"]
        assert selector == {"nvidia.com/gpu.present": "true"}
        assert "`nodeSelector: nvidia.com/gpu.present: \"true\"`" in DOCS.read_text()


@pytest.mark.parametrize("path", KPS)
def test_network_policy_admits_prometheus_and_the_training_namespaces(path) -> None:
    objects = rendered(path)
    policy = by_kind(objects)["NetworkPolicy"]
    (workload,) = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    template = workload["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    prometheus, training = policy["spec"]["ingress"]
    assert prometheus["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}]
    (label,) = training["from"][0]["namespaceSelector"]["matchLabels"].items()
    assert f"kubectl label namespace <training-namespace> {label[0]}={label[1]}" in DOCS.read_text()
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= ports
    # the token for the training namespaces: the documented copy names the Secret the pods read
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    secret = env["VRAMWATCH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert f"kubectl create secret generic {secret['name']} -n <training-namespace> " \
           f"--from-file={secret['key']}=/dev/stdin" in DOCS.read_text()


# ------------------------------------------------------------------ Grafana

def test_grafana_configmaps_are_generated_from_their_sources() -> None:
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_grafana_generator_check_fails_when_a_rule_changes(tmp_path) -> None:
    for rel in ("k8s/generate_grafana.py", "k8s/generate_prometheusrule.py", "prometheus/rules/vramwatch.rules.yml",
                "grafana/dashboards/vramwatch.json",
                "k8s/components/kube-prometheus-stack/grafana-dashboard.yaml",
                "k8s/components/kube-prometheus-stack/grafana-alerts.yaml",
                "grafana/provisioning/alerting/vramwatch-alerts.yaml"):
        (tmp_path / "deploy" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "deploy" / rel).write_text((DEPLOY / rel).read_text())
    rules = tmp_path / "deploy" / "prometheus" / "rules" / "vramwatch.rules.yml"
    rules.write_text(rules.read_text().replace("[15m]", "[20m]"))
    result = subprocess.run([sys.executable, str(tmp_path / "deploy" / "k8s" / "generate_grafana.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "grafana-alerts.yaml is out of date" in result.stderr
    assert "vramwatch-alerts.yaml is out of date" in result.stderr  # the compose copy too


def test_dashboard_configmap_for_the_chart_sidecar() -> None:
    configmap = next(o for o in rendered(KPS[0]) if o["metadata"]["name"] == "vramwatch-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"]["grafana_folder"] == grafana_gen.FOLDER
    (text,) = configmap["data"].values()
    shipped, source = json.loads(text), json.loads(DASHBOARD.read_text())
    datasource = next(v for v in shipped["templating"]["list"] if v["type"] == "datasource")
    assert datasource["current"]["value"] == "prometheus"  # kube-prometheus-stack's datasource uid
    datasource["current"] = next(v for v in source["templating"]["list"] if v["type"] == "datasource")["current"]
    assert shipped == source


def grafana_rules() -> list[dict]:
    configmap = next(o for o in rendered(KPS[0]) if o["metadata"]["name"] == "vramwatch-grafana-alerts")
    assert configmap["metadata"]["labels"]["grafana_alert"] == "1"
    (text,) = configmap["data"].values()
    provisioning = yaml.safe_load(text)
    assert provisioning["apiVersion"] == 1
    (group,) = provisioning["groups"]
    assert group["folder"] == grafana_gen.FOLDER and group["interval"] == "1m"
    return group["rules"]


def test_grafana_alert_rules_are_the_prometheus_rules_on_the_chart_datasource() -> None:
    rules = grafana_rules()
    assert [r["title"] for r in rules] == ["VramwatchPlateauBreak", "VramwatchMemoryLeak", "VramwatchOOMImminent",
                                           "VramwatchOOM", "VramwatchHookSilent"]
    prometheus = alert_rules()
    dashboard_uid = json.loads(DASHBOARD.read_text())["uid"]
    assert len({r["uid"] for r in rules}) == len(rules)
    for rule in rules:
        source = prometheus[rule["title"]]
        refs = {item["refId"]: item for item in rule["data"]}
        assert rule["condition"] == "C" and set(refs) == {"A", "B", "C"}
        assert refs["A"]["datasourceUid"] == "prometheus" and refs["A"]["model"]["instant"] is True
        assert refs["A"]["model"]["expr"] == source["expr"].strip()
        assert refs["B"]["model"] == {"refId": "B", "type": "reduce", "expression": "A", "reducer": "last"}
        assert refs["C"]["model"]["expression"] == "B"
        assert refs["C"]["model"]["conditions"] == [{"evaluator": {"type": "gt", "params": [0]}}]
        # the namespace label routes the rule's alerts and Grafana's DatasourceError about it
        assert rule["for"] == source["for"] and rule["labels"] == {**source["labels"], "namespace": NAMESPACE}
        assert rule["annotations"].pop("__dashboardUid__") == dashboard_uid
        assert set(rule["annotations"]) == set(source["annotations"])
        for key, text in rule["annotations"].items():
            assert not re.search(r"\$value\b(?!s)", text), (rule["title"], key)  # a string in Grafana
            assert text == source["annotations"][key].replace("$value", "$values.B.Value")


T0 = 1_700_000_000.0
SILENT_RANK, OOM_RANK, BREAK_RANK, LEAK_RANK = 5, 3, 1, 2


def simulated_job() -> list[dict]:
    """8 ranks, 3600 steps: rank 1 steps up to a new plateau, rank 2 leaks, rank 3 leaks into
    an OOM at step 3000 and dies, rank 5 stops sending at step 2400; the rest are healthy."""
    special = {BREAK_RANK: ("late_step", {}), LEAK_RANK: ("fast_leak", {}),
               OOM_RANK: ("leak_to_oom", {"leak_onset": 2600, "leak_rate_frac": 3e-4})}
    samples = []
    for rank in range(8):
        scenario, params = special.get(rank, ("healthy", {}))
        trace = simulate_trace(scenario, steps=3600, run="job", host=f"node-{rank // 4}", rank=rank, start_ts=T0,
                               **params)
        samples += [s for s in trace if rank != SILENT_RANK or s["step"] < 2400]
    return samples


def test_grafana_alert_queries_fire_on_the_right_ranks_of_a_simulated_job(tmp_path) -> None:
    """Each Grafana rule's query A through Prometheus' engine (promtool) on what the real collector
    exported once a simulated minute, then its condition (last value > 0) as Grafana applies it."""
    from test_prometheus_rules_simulated import exported_from, input_series

    rules = grafana_rules()
    names = set()
    for rule in rules:
        names |= set(re.findall(r"vramwatch_\w+", rule["data"][0]["model"]["expr"]))
    series, minutes = exported_from(simulated_job(), names)
    tests = [{"expr": rule["data"][0]["model"]["expr"], "eval_time": f"{m}m", "exp_samples": []}
             for rule in rules for m in range(10, minutes + 1)]
    test_file = tmp_path / "grafana.test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"name": "grafana queries", "interval": "1m", "input_series": input_series(series),
         "promql_expr_test": tests}]}, sort_keys=False, width=100000))
    result = run_promtool("test", "rules", str(test_file))
    output = result.stdout + result.stderr
    fired: dict[str, set[str]] = {rule["title"]: set() for rule in rules}
    by_expr = {rule["data"][0]["model"]["expr"]: rule["title"] for rule in rules}
    for block in output.split("expr: ")[1:]:
        title = by_expr[json.loads(block.split(", time:", 1)[0])]
        for labels, value in re.findall(r"(\{[^}]*\}) ([^\s,]+)", block.split("got:", 1)[1]):
            assert float(value) > 0, (title, labels, value)  # condition C holds for every returned series
            fired[title].add(re.search(r'rank="(\d+)"', labels).group(1))
    assert fired["VramwatchOOM"] == {str(OOM_RANK)}, output[-3000:]
    assert fired["VramwatchHookSilent"] == {str(SILENT_RANK), str(OOM_RANK)}  # a rank that died is silent
    assert str(LEAK_RANK) in fired["VramwatchMemoryLeak"] <= {str(LEAK_RANK), str(OOM_RANK)}
    assert str(BREAK_RANK) in fired["VramwatchPlateauBreak"] <= {str(BREAK_RANK), str(LEAK_RANK), str(OOM_RANK)}


# ------------------------------------------------------------------ Alertmanager

def chart_config_with_vramwatch(tmp_path, hook_url: str | None = None) -> tuple[dict, str]:
    amcfg = by_kind(rendered(KPS[0]))["AlertmanagerConfig"]
    config = translate_alertmanager_config(amcfg, CHART_ALERTMANAGER_CONFIG)
    if hook_url:
        for receiver in config["receivers"]:
            for webhook in receiver.get("webhook_configs", []):
                webhook["url"] = f"{hook_url}/{receiver['name'].rsplit('/', 1)[1]}"
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config, str(path)


def test_alertmanagerconfig_routes_in_the_charts_alertmanager(tmp_path) -> None:
    _config, path = chart_config_with_vramwatch(tmp_path)
    result = subprocess.run([need_binary("amtool"), "check-config", path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    rank = {"namespace": NAMESPACE, "run": "job", "rank": "3", "Hostname": "node-0"}
    oncall, team = "monitoring/vramwatch/training-oncall", "monitoring/vramwatch/training-team"
    for labels, receiver in (
        ({"alertname": "VramwatchMemoryLeak", "severity": "critical"}, oncall),
        ({"alertname": "VramwatchOOM", "severity": "critical"}, oncall),
        ({"alertname": "VramwatchPlateauBreak", "severity": "warning"}, team),
        ({"alertname": "VramwatchHookSilent", "severity": "warning", "grafana_folder": "vramwatch"}, team),
        ({"alertname": "VramwatchOOMImminent", "severity": "critical"}, oncall),
        # Grafana cannot query Prometheus for one of its vramwatch rules: the team, not the null receiver,
        # whatever the rule's severity (its labels, namespace included, are the error alert's)
        ({"alertname": "DatasourceError", "severity": "critical", "grafana_folder": "vramwatch",
          "rulename": "VramwatchOOM"}, team),
        ({"alertname": "DatasourceNoData", "severity": "warning", "grafana_folder": "vramwatch",
          "rulename": "VramwatchHookSilent"}, team),
        ({"alertname": "KubePodCrashLooping", "severity": "warning"}, "null"),  # not ours: the chart's tree
    ):
        assert amtool_route(path, {**rank, **labels}) == receiver, labels
    # the operator confines the object's routes to its namespace: an alert without it goes nowhere
    no_namespace = {k: v for k, v in rank.items() if k != "namespace"}
    assert amtool_route(path, {**no_namespace, "alertname": "VramwatchOOM", "severity": "critical"}) == "null"


def test_every_alert_keeps_the_namespace_it_was_scraped_in(tmp_path) -> None:
    """The unit tests of every alert, replayed with `namespace` on every input series: each alert
    fires with it (the AlertmanagerConfig's namespace matcher routes it)."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    groups = []
    for group in tests["tests"]:
        if not group.get("alert_rule_test"):
            continue
        group = json.loads(json.dumps(group))
        group.pop("promql_expr_test", None)
        for series in group["input_series"]:
            series["series"] = series["series"].replace("{", f'{{namespace="{NAMESPACE}", ', 1)
        for case in group["alert_rule_test"]:
            for alert in case["exp_alerts"]:
                alert["exp_labels"]["namespace"] = NAMESPACE
        groups.append(group)
    fired = {case["alertname"] for g in groups for case in g["alert_rule_test"] if case["exp_alerts"]}
    assert fired == set(alert_rules())
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "vramwatch.rules.yml").write_text(RULES.read_text())
    (tmp_path / "t.yml").write_text(yaml.safe_dump({**tests, "rule_files": ["rules/vramwatch.rules.yml"],
                                                   "tests": groups}, sort_keys=False, width=100000))
    result = run_promtool("test", "rules", str(tmp_path / "t.yml"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def test_kube_prometheus_stack_alerts_reach_their_receivers(tmp_path) -> None:
    """Collector -> real Prometheus (the rendered PrometheusRule, `for:` 0s, scraping as the
    ServiceMonitor does: honor_labels, the target's namespace) -> real Alertmanager (the chart's
    tree with the AlertmanagerConfig merged as the operator does) -> webhook. Rank 1 leaks, rank 2
    breaks its plateau, rank 3 runs out of memory, rank 0 is healthy. Then Grafana's copies, as
    Grafana sends them, are held back by their Prometheus twins."""
    need_binary("prometheus")
    need_binary("prometheus-alertmanager")
    run, steps = "kube-job", 3300
    start_ts = time.time() - steps - 60
    layout = {0: ("healthy", {}), 1: ("fast_leak", {}), 2: ("late_step", {}),
              3: ("leak_to_oom", {"leak_onset": 2600, "leak_rate_frac": 3e-4})}
    # each rank's latest sample 2 s ago: the ranks of one job end together, within their silence windows
    samples = [s for rank, (scenario, params) in layout.items()
               for s in ending_at(list(simulate_trace(scenario, steps=steps, run=run, host="node-a", rank=rank,
                                                      start_ts=start_ts, **params)), time.time() - 2)]
    rule = by_kind(rendered(KPS[0]))["PrometheusRule"]
    groups = json.loads(json.dumps(rule["spec"]["groups"]))
    for group in groups:
        for item in group["rules"]:
            if "for" in item:
                item["for"] = "0s"
    with WebhookReceiver() as hook, BackgroundServer(str(tmp_path / "c.db")) as collector:
        config, _path = chart_config_with_vramwatch(tmp_path, hook.url)
        config["route"]["routes"][0].update(group_wait="1s", group_interval="1s")
        post_samples(collector.url, [s for s in samples if s["step"] < 2900])
        with AlertmanagerServer(tmp_path / "am", config) as am:
            prom_config = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am.url.removeprefix("http://")]}]}]},
                "scrape_configs": [{"job_name": "vramwatch", "honor_labels": True, "static_configs": [
                    {"targets": [collector.url.removeprefix("http://")], "labels": {"namespace": NAMESPACE}}]}],
            }
            with PrometheusServer(tmp_path / "prometheus", prom_config, {"vramwatch.rules.yml": {"groups": groups}}) \
                    as prom:
                prom.wait_for('vramwatch_ooms_total{rank="3"}', lambda r: len(r) == 1)
                post_samples(collector.url, [s for s in samples if s["step"] >= 2900])
                hook.wait_for(lambda alerts: {(a["labels"]["alertname"], a["labels"]["rank"]) for _p, a in alerts}
                              >= {("VramwatchMemoryLeak", "1"), ("VramwatchOOM", "3"), ("VramwatchPlateauBreak", "2")},
                              timeout=60)
                time.sleep(2)  # a group interval more: anything else routed would have arrived
                delivered = hook.alerts()
                grafana_copies = grafana_alerts_from(prom)
                response = httpx.post(f"{am.url}/api/v2/alerts", json=grafana_copies, timeout=10)
                assert response.status_code == 200, response.text
                time.sleep(1)
                held = httpx.get(f"{am.url}/api/v2/alerts", params={"filter": 'grafana_folder="vramwatch"'},
                                 timeout=10).json()
    got = {(path, a["labels"]["alertname"], a["labels"]["rank"]) for path, a in delivered}
    assert ("/training-oncall", "VramwatchMemoryLeak", "1") in got and ("/training-oncall", "VramwatchOOM", "3") in got
    assert ("/training-team", "VramwatchPlateauBreak", "2") in got
    assert not [g for g in got if g[2] == "0"], got  # the healthy rank pages nobody
    assert not [g for g in got if g[1] in ("VramwatchPlateauBreak", "VramwatchHeadroomLow") and g[2] == "1"], got
    assert all(a["labels"]["namespace"] == NAMESPACE for _p, a in delivered)
    titles = {a["labels"]["alertname"] for a in grafana_copies}
    assert {"VramwatchMemoryLeak", "VramwatchOOM", "VramwatchPlateauBreak"} <= titles
    assert len(held) == len(grafana_copies)
    assert all(a["status"]["state"] == "suppressed" and a["status"]["inhibitedBy"] for a in held), held


def grafana_alerts_from(prom: PrometheusServer) -> list[dict]:
    """What Grafana sends for the shipped Grafana rules on this Prometheus: query A, last value > 0,
    labels = the series' labels + the rule's labels + alertname (its title) + grafana_folder."""
    alerts = []
    for rule in grafana_rules():
        for result in prom.query(rule["data"][0]["model"]["expr"]):
            if float(result["value"][1]) > 0:
                labels = {**result["metric"], **rule["labels"], "alertname": rule["title"],
                          "grafana_folder": grafana_gen.FOLDER}
                alerts.append({"labels": labels, "annotations": {"summary": rule["title"]}})
    return alerts


def test_documented_apply_commands_are_shell_ready() -> None:
    """What users paste: each command line renders as the tests render it (a load of the docs'
    fence, not a paraphrase), and the training-pod snippet reads the Secret the commands create."""
    text = DOCS.read_text()
    fence = text.split("5. Apply one variant", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    lines = [line.strip() for line in fence.strip().splitlines()]
    assert [documented_commands()[path] + " | kubectl apply -f -" for path in KPS + VARIANTS[:2]] == lines
    snippet = text.split("and in the training pods:", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    env = {e["name"]: e for e in load_objects(snippet)[0]["env"]}
    assert env["VRAMWATCH_URL"]["value"].startswith("http://vramwatch-collector.monitoring:")
    assert env["VRAMWATCH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "vramwatch-token", "key": "token"}
