"""deploy/ beyond Prometheus and Grafana: compose, Alertmanager, Kubernetes and the Dockerfile,
each checked for what operators rely on (closed by default, one scrape, one rules source,
pinned image) and run through its own validator (compose-spec, kubernetes-validate, the
prometheus-operator models, hadolint, yamllint, amtool). Offline; under CI=true a
missing tool fails instead of skipping."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from prometheus_helpers import (
    ALERTMANAGER,
    DEPLOY,
    ROOT,
    RULES,
    alert_rules,
    load_module,
    need_binary,
    need_module,
    need_tool,
    run_tool,
)

from vramwatch.__about__ import __version__

# ------------------------------------------------------------------ compose and Kubernetes

def k8s_docs(*parts: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(DEPLOY.joinpath("k8s", *parts).read_text()) if d]


def test_compose_stack_is_closed_by_default() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"collector", "prometheus", "alertmanager", "grafana"}
    collector = services["collector"]
    assert (DEPLOY / collector["build"]["context"] / collector["build"]["dockerfile"]).is_file()
    exposed = re.search(r"^EXPOSE (\d+)", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    # every published port binds to loopback unless the operator names an address
    for name, service in services.items():
        for port in service.get("ports", []):
            host = port.rsplit(":", 2)[0]
            assert host == "127.0.0.1" or re.fullmatch(r"\$\{\w+:-127\.0\.0\.1\}", host), (name, port)
    assert collector["ports"] == [f"${{VRAMWATCH_BIND:-127.0.0.1}}:{exposed}:{exposed}"]
    # secrets are required (":?"), never defaulted; Prometheus has no lifecycle API
    assert collector["environment"]["VRAMWATCH_TOKEN"].startswith("${VRAMWATCH_TOKEN:?")
    assert "--auth-read" in collector["command"]
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert not any("lifecycle" in arg for arg in services["prometheus"]["command"])
    assert compose["secrets"]["vramwatch_token"] == {"environment": "VRAMWATCH_TOKEN"}
    assert "vramwatch_token" in services["prometheus"]["secrets"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vramwatch")
    assert job["authorization"]["credentials_file"] == "/run/secrets/vramwatch_token"
    assert job["static_configs"][0]["targets"] == [f"collector:{exposed}"]
    (alertmanagers,) = config["alerting"]["alertmanagers"]
    am_port = services["alertmanager"]["ports"][0].rsplit(":", 1)[1]
    assert alertmanagers["static_configs"][0]["targets"] == [f"alertmanager:{am_port}"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), volume
            else:
                assert source in compose["volumes"], volume
    prom_mounts = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert "/etc/prometheus/rules" in prom_mounts and "/etc/prometheus/prometheus.yml" in prom_mounts


def test_grafana_routes_its_alerts_to_the_alertmanager() -> None:
    notifications = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "alerting"
                                     / "vramwatch-notifications.yaml").read_text())
    (contact,) = notifications["contactPoints"]
    (receiver,) = contact["receivers"]
    assert receiver["type"] == "prometheus-alertmanager" and receiver["settings"]["url"] == "http://alertmanager:9093"
    (policy,) = notifications["policies"]
    assert policy["receiver"] == contact["name"] and "run" in policy["group_by"]
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "vramwatch.yaml").read_text())
    assert all("isDefault" not in ds for ds in datasource["datasources"])


def test_alertmanager_routes_critical_vramwatch_alerts_to_oncall() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    receivers = {r["name"] for r in config["receivers"]}
    routes = config["route"]["routes"]
    assert config["route"]["receiver"] in receivers and all(r["receiver"] in receivers for r in routes)
    assert 'severity = "critical"' in routes[0]["matchers"] and "run" in config["route"]["group_by"]
    leak, imminent, grafana_copy = config["inhibit_rules"]
    assert set(leak["equal"]) == set(imminent["equal"]) == {"run", "Hostname", "rank"}
    assert {"alertname", "run", "Hostname", "rank"} == set(grafana_copy["equal"])
    amtool = need_binary("amtool")

    def route(**labels: str) -> str:
        result = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                                 *(f"{k}={v}" for k, v in labels.items())], capture_output=True, text=True, timeout=60)
        return result.stdout.strip()

    assert route(alertname="VramwatchOOMImminent", severity="critical", run="r", rank="0") == "training-oncall"
    # Grafana cannot reach Prometheus for its copy of a critical rule: the team, not on-call
    assert route(alertname="DatasourceError", severity="critical", grafana_folder="vramwatch",
                 rulename="VramwatchOOM") == "training-team"
    critical = {name for name, rule in alert_rules().items() if rule["labels"]["severity"] == "critical"}
    assert critical == {"VramwatchMemoryLeak", "VramwatchOOMImminent", "VramwatchOOM", "VramwatchRankDied"}


def test_kubernetes_collector_and_node_local_daemonset() -> None:
    single = {d["kind"]: d for d in k8s_docs("collector", "collector.yaml")}
    node = {d["kind"]: d for d in k8s_docs("node-local", "daemonset.yaml")}
    assert {"Deployment", "Service", "PersistentVolumeClaim"} <= set(single) and {"DaemonSet", "Service"} <= set(node)
    deployment = single["Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    daemonset = node["DaemonSet"]
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0  # one writer per node
    assert node["Service"]["spec"]["internalTrafficPolicy"] == "Local"
    for workload, service in ((deployment, single["Service"]), (daemonset, node["Service"])):
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()
        (container,) = template["spec"]["containers"]
        port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert service["spec"]["ports"][0]["targetPort"] in port_names
        # one scrape hint, on the pods: never also on the Service (every series twice)
        hints = template["metadata"]["annotations"]
        assert hints["prometheus.io/scrape"] == "true" and int(hints["prometheus.io/port"]) == port_names["http"]
        assert "prometheus.io/scrape" not in service["metadata"].get("annotations", {})
        assert container["image"] == "vramwatch"  # kustomize sets registry and tag
        assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        env = {e["name"]: e for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert env["VRAMWATCH_DB"]["value"].startswith(mounts["data"] + "/")
        assert env["VRAMWATCH_TOKEN"]["valueFrom"]["secretKeyRef"].get("optional", False) is False
        assert template["spec"]["securityContext"]["runAsUser"] == 10001
        assert template["spec"]["securityContext"]["runAsGroup"] == 10001
        # the ServiceMonitor selects this Service
        (monitor,) = k8s_docs("monitoring", "servicemonitor.yaml")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_servicemonitor_is_selected_by_kube_prometheus_stack_and_authenticates() -> None:
    (monitor,) = k8s_docs("monitoring", "servicemonitor.yaml")
    # the Helm release's name is filled in when the manifests are rendered (tests/deploy/test_deploy_kube.py)
    assert monitor["metadata"]["labels"]["release"] == "__VRAMWATCH_RELEASE__"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True and endpoint["port"] == "http"
    secret = endpoint["authorization"]["credentials"]
    container = k8s_docs("collector", "collector.yaml")[1]["spec"]["template"]["spec"]["containers"][0]
    collector_secret = next(e for e in container["env"] if e["name"] == "VRAMWATCH_TOKEN")["valueFrom"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == (collector_secret["name"], collector_secret["key"])


def test_prometheusrule_is_generated_from_the_rules_file() -> None:
    script = DEPLOY / "k8s" / "generate_prometheusrule.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (rule,) = k8s_docs("monitoring", "prometheusrule.yaml")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    assert rule["metadata"]["labels"]["release"] == "__VRAMWATCH_RELEASE__"


def test_prometheusrule_check_fails_when_the_rules_change(tmp_path) -> None:
    """The --check has teeth: a rules file edited without regenerating is reported."""
    copy = tmp_path / "deploy"
    (copy / "prometheus" / "rules").mkdir(parents=True)
    (copy / "k8s" / "monitoring").mkdir(parents=True)
    script = copy / "k8s" / "generate_prometheusrule.py"
    script.write_text((DEPLOY / "k8s" / "generate_prometheusrule.py").read_text())
    (copy / "k8s" / "monitoring" / "prometheusrule.yaml").write_text(
        (DEPLOY / "k8s" / "monitoring" / "prometheusrule.yaml").read_text())
    (copy / "prometheus" / "rules" / "vramwatch.rules.yml").write_text(RULES.read_text().replace("for: 5m", "for: 6m"))
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "differs" in result.stderr


def test_kustomizations_reference_their_files_and_set_the_image() -> None:
    for base in ("", "collector", "node-local", "monitoring"):
        directory = DEPLOY / "k8s" / base
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert kustomization["kind"] == "Kustomization"
        for resource in kustomization["resources"]:
            assert (directory / resource).exists(), (base, resource)
        if base in ("collector", "node-local"):  # the image is set once per workload
            (image,) = kustomization["images"]
            assert image["name"] == "vramwatch" and "/" in image["newName"]  # a registry, not a bare name
            assert image["newTag"] == __version__


# ------------------------------------------------------------------ Dockerfile

def test_dockerfile_is_reproducible_and_runs_as_10001() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    assert all(line.split()[1] == "${PYTHON_IMAGE}" for line in dockerfile.splitlines() if line.startswith("FROM "))
    assert "groupadd --gid 10001" in dockerfile and "--uid 10001 --gid 10001" in dockerfile
    assert "useradd --system" not in dockerfile and "USER 10001:10001" in dockerfile
    # the build backend and the server deps: every distribution pinned by digest, nothing else installed
    assert dockerfile.count("--require-hashes --no-deps -r /") == 2
    assert "-c /constraints.txt" not in dockerfile
    # the image runs `serve --otlp-endpoint`: the otlp extra is installed, and pinned like the rest
    extras = re.search(r'vramwatch-\*\.whl\)\[([a-z,]+)\]', dockerfile).group(1).split(",")
    assert extras == list(load_module(DEPLOY / "server_constraints.py").IMAGE_EXTRAS) == ["server", "otlp"]
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {"!deploy/build-requirements.txt", "!deploy/image-requirements.txt"} <= set(ignore)


def test_server_constraints_pin_every_dependency_of_the_image() -> None:
    module = load_module(DEPLOY / "server_constraints.py")
    pins = {}
    for line in (DEPLOY / "server-constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[module.canonical(name)] = version
    assert set(module.closure()) <= set(pins), set(module.closure()) - set(pins)
    for requirement in module.top_requirements():
        assert requirement.specifier.contains(pins[module.canonical(requirement.name)]), requirement
    # the dashboard vendors plotly.js: the image carries no plotly Python package
    assert "plotly" not in pins and "narwhals" not in pins


def test_image_locks_pin_the_constraints_with_digests(tmp_path) -> None:
    """The hash-checked locks the Dockerfile installs pin exactly the constraints, each entry with a
    sha256 digest; a lock that drifts (a version changed, a digest dropped) fails the check."""
    result = subprocess.run([sys.executable, str(DEPLOY / "image_lock.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    module = load_module(DEPLOY / "image_lock.py")
    build, image = module.locked(module.BUILD_LOCK), module.locked(module.IMAGE_LOCK)
    assert "hatchling" in build and "hatchling" not in image and "fastapi" in image and "uvicorn" in image
    assert set(build) | set(image) == set(module.pins())
    broken = tmp_path / "lock.txt"
    broken.write_text(module.IMAGE_LOCK.read_text().replace("--hash=sha256:", "--hash=md5:", 1))
    with pytest.raises(ValueError, match="no sha256 digest"):
        module.locked(broken)


# ------------------------------------------------------------------ each file checked by its own tool

K8S_VERSIONS = ("1.28.0", "1.31.0", "1.34.0")
K8S_MANIFESTS = ("collector/collector.yaml", "node-local/daemonset.yaml")


def test_compose_file_matches_the_compose_spec() -> None:
    result = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(DEPLOY / "compose.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate_strictly(version) -> None:
    result = run_tool("kubernetes-validate", "--strict", "-k", version,
                      *(str(DEPLOY / "k8s" / m) for m in K8S_MANIFESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 5, result.stdout


def test_kubernetes_validation_rejects_a_misspelt_field(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    manifest = (DEPLOY / "k8s" / "collector" / "collector.yaml").read_text()
    bad.write_text(manifest.replace("readinessProbe:", "readynessProbe:"))
    result = run_tool("kubernetes-validate", "--strict", "-k", K8S_VERSIONS[-1], str(bad))
    assert result.returncode != 0 and "readynessProbe" in result.stdout + result.stderr


OPERATOR_CHECK = DEPLOY / "k8s" / "check_operator_objects.py"
OPERATOR_OBJECTS = ("monitoring/servicemonitor.yaml", "monitoring/prometheusrule.yaml")
OPERATOR_MODELS = ("cloudcoil.models.prometheus_operator", "cloudcoil-models-prometheus-operator")


def test_operator_objects_validate_strictly(tmp_path) -> None:
    """The CLI (as `make check-deploy` runs it): the shipped objects pass, a misspelt one fails
    naming file, object and field, and only it is reported."""
    need_module(*OPERATOR_MODELS)
    bad = tmp_path / "bad.yaml"
    bad.write_text((DEPLOY / "k8s" / OPERATOR_OBJECTS[0]).read_text().replace("honorLabels", "honourLabels"))
    shipped = [str(DEPLOY / "k8s" / m) for m in OPERATOR_OBJECTS]
    result = subprocess.run([sys.executable, str(OPERATOR_CHECK), *shipped], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run([sys.executable, str(OPERATOR_CHECK), *shipped, str(bad)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"{bad}: ServiceMonitor/vramwatch-collector: spec.endpoints.0.honourLabels: Extra inputs are not permitted"]


@pytest.mark.parametrize(("manifest", "old", "new", "error"), [
    # unknown fields, at every depth
    (0, "matchLabels:", "matchLabel:", "spec.selector.matchLabel: Extra inputs are not permitted"),
    (1, "  groups:", "  grups:", "spec.grups: Extra inputs are not permitted"),
    (1, "    - record:", "    - recrd:", "spec.groups.0.rules.0.recrd: Extra inputs are not permitted"),
    # wrong types: no coercion, as the API server would reject them
    (0, "honorLabels: true", 'honorLabels: "yes"', "spec.endpoints.0.honorLabels: Input should be a valid boolean"),
    (0, "key: token", "key: 7", "spec.endpoints.0.authorization.credentials.key: Input should be a valid string"),
    (1, "      for: 1m", "      for: 60", "spec.groups.1.rules.0.for: Input should be a valid string"),
    # the CRD's patterns
    (0, "interval: 15s", "interval: 15 seconds", "spec.endpoints.0.interval: String should match pattern"),
    # an object the operator does not know
    (0, "kind: ServiceMonitor", "kind: Endpoint", "kind: 'Endpoint' is not a monitoring.coreos.com/v1 kind"),
    (0, "monitoring.coreos.com/v1", "monitoring.coreos.com/v9", "apiVersion: unknown version 'v9'"),
])
def test_operator_object_check_rejects_a_bad_object(manifest, old, new, error) -> None:
    need_module(*OPERATOR_MODELS)
    checker = load_module(OPERATOR_CHECK)
    text = (DEPLOY / "k8s" / OPERATOR_OBJECTS[manifest]).read_text()
    assert old in text
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [checker.check_document(d) for d in docs] == [[]]
    (doc,) = [d for d in yaml.safe_load_all(text.replace(old, new, 1)) if d]
    (message,) = checker.check_document(doc)
    assert error in message and message.startswith(f"{doc['kind']}/{doc['metadata']['name']}: "), message


def test_operator_object_check_without_its_package_exits_2(monkeypatch, tmp_path, capsys) -> None:
    checker = load_module(OPERATOR_CHECK)
    monkeypatch.setattr(checker, "PACKAGE", "no_such_package.models")
    assert checker.main([str(DEPLOY / "k8s" / OPERATOR_OBJECTS[0])]) == 2
    assert "no_such_package.models not installed: pip install" in capsys.readouterr().err
    assert checker.main([str(tmp_path / "missing.yaml")]) == 2
    assert checker.main([]) == 2


def test_hadolint() -> None:
    result = run_tool("hadolint", str(ROOT / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint() -> None:
    result = run_tool("yamllint", "--strict", "-c", ".yamllint.yaml", ".", cwd=DEPLOY)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_config() -> None:
    result = subprocess.run([need_binary("amtool"), "check-config", str(ALERTMANAGER)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="yamllint not found"):
        need_tool("yamllint")
    with pytest.raises(pytest.fail.Exception, match="apt-get install no-such-daemon"):
        need_binary("no-such-daemon")
    with pytest.raises(pytest.fail.Exception, match=r"no_such_package.models not found: .*\(no-such-package\)"):
        need_module("no_such_package.models", "no-such-package")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        need_tool("yamllint")
