"""Helpers for the Kubernetes tests: the documented render commands run as documented, a YAML
loader that reads kustomize's output as the API server does, and prometheus-operator's
translation of an AlertmanagerConfig into Alertmanager's own configuration.

(Not named test_*: it holds no tests; tests/deploy/test_deploy_kube.py imports it.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any

import yaml
from prometheus_helpers import DEPLOY, ROOT, load_module, need_binary

DOCS = ROOT / "docs" / "deploy.md"
#: The placeholder the documented command replaces with the Helm release's name (one definition).
RELEASE_PLACEHOLDER: str = load_module(DEPLOY / "k8s" / "generate_prometheusrule.py").RELEASE_PLACEHOLDER
_COMMAND = re.compile(r"^[ \t]*(kubectl kustomize (\S+) \| sed \"[^\"]+\") \| kubectl apply -f -$", re.M)
#: A label value the API server accepts (k8s.io/apimachinery IsValidLabelValue).
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


class KubeLoader(yaml.SafeLoader):
    """YAML as Kubernetes reads it: a bare ``=`` (kustomize writes ``matchType: =``) is the
    string "=", not YAML 1.1's ``value`` tag, which PyYAML cannot construct."""


KubeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:value"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(text, Loader=KubeLoader) if doc]


def documented_commands() -> dict[str, str]:
    """{kustomization path: its documented command up to the apply} from docs/deploy.md."""
    return {match.group(2): match.group(1) for match in _COMMAND.finditer(DOCS.read_text())}


def render(path: str, release: str) -> list[dict[str, Any]]:
    """The objects the documented command for ``path`` applies, with RELEASE=release, rendered by
    the same shell pipeline (``kubectl kustomize`` and ``sed``) minus the final ``kubectl apply``."""
    need_binary("kubectl")
    command = documented_commands()[path]
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "RELEASE": release})
    assert result.returncode == 0, result.stderr
    return load_objects(result.stdout)


# ------------------------------------------------------------------ prometheus-operator's AlertmanagerConfig

#: kube-prometheus-stack's default Alertmanager configuration (values.yaml, alertmanager.config):
#: everything to the `null` receiver, grouped by namespace.
CHART_ALERTMANAGER_CONFIG: dict[str, Any] = {
    "global": {"resolve_timeout": "5m"},
    "inhibit_rules": [
        {"source_matchers": ["severity = critical"], "target_matchers": ["severity =~ warning|info"],
         "equal": ["namespace", "alertname"]},
        {"source_matchers": ["severity = warning"], "target_matchers": ["severity = info"],
         "equal": ["namespace", "alertname"]},
        {"source_matchers": ["alertname = InfoInhibitor"], "target_matchers": ["severity = info"],
         "equal": ["namespace"]},
        {"target_matchers": ["alertname = InfoInhibitor"]},
    ],
    "route": {"group_by": ["namespace"], "group_wait": "30s", "group_interval": "5m", "repeat_interval": "12h",
              "receiver": "null", "routes": [{"receiver": "null", "matchers": ['alertname = "Watchdog"']}]},
    "receivers": [{"name": "null"}],
}


def _matcher(matcher: dict[str, Any]) -> str:
    return f"{matcher['name']}{matcher.get('matchType', '=')}{json.dumps(matcher.get('value', ''))}"


def _route(route: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {"receiver": prefix + route["receiver"]} if route.get("receiver") else {}
    keys = {"groupBy": "group_by", "groupWait": "group_wait", "groupInterval": "group_interval",
            "repeatInterval": "repeat_interval", "continue": "continue"}
    out.update({snake: route[camel] for camel, snake in keys.items() if camel in route})
    if route.get("matchers"):
        out["matchers"] = [_matcher(m) for m in route["matchers"]]
    if route.get("routes"):
        out["routes"] = [_route(child, prefix) for child in route["routes"]]
    return out


def _receiver(receiver: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": prefix + receiver["name"]}
    if receiver.get("webhookConfigs"):
        out["webhook_configs"] = [{"url": w["url"], "send_resolved": w.get("sendResolved", True)}
                                  for w in receiver["webhookConfigs"]]
    return out


def translate_alertmanager_config(amcfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Alertmanager's configuration after prometheus-operator merges ``amcfg`` into ``base``
    (pkg/alertmanager/amcfg.go, the default OnNamespace matcher strategy): receivers become
    ``<namespace>/<name>/<receiver>``; the object's top route gets ``namespace="<namespace>"``
    and ``continue: true`` and goes before the base's routes; each inhibit rule gets the same
    namespace matcher on its source and target side."""
    namespace, name = amcfg["metadata"]["namespace"], amcfg["metadata"]["name"]
    prefix = f"{namespace}/{name}/"
    config = json.loads(json.dumps(base))
    spec = amcfg["spec"]
    ns_matcher = f'namespace="{namespace}"'
    top = _route(spec["route"], prefix)
    top["matchers"] = [*top.get("matchers", []), ns_matcher]
    top["continue"] = True
    config["route"]["routes"] = [top, *config["route"].get("routes", [])]
    for rule in spec.get("inhibitRules", []):
        config.setdefault("inhibit_rules", []).append({
            "source_matchers": [*(_matcher(m) for m in rule.get("sourceMatch", [])), ns_matcher],
            "target_matchers": [*(_matcher(m) for m in rule.get("targetMatch", [])), ns_matcher],
            "equal": rule.get("equal", []),
        })
    config["receivers"] = [*config["receivers"], *(_receiver(r, prefix) for r in spec.get("receivers", []))]
    return config


def amtool_route(config_file: str, labels: dict[str, str]) -> str:
    """The receiver(s) Alertmanager picks for an alert with these labels (``amtool config routes test``)."""
    result = subprocess.run([need_binary("amtool"), "config", "routes", "test", f"--config.file={config_file}",
                             *(f"{k}={v}" for k, v in labels.items())], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()
