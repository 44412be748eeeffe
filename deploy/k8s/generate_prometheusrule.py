"""Writes deploy/k8s/monitoring/prometheusrule.yaml from deploy/prometheus/rules/vramwatch.rules.yml.

    python deploy/k8s/generate_prometheusrule.py          # rewrite
    python deploy/k8s/generate_prometheusrule.py --check  # exit 1 if it differs from the rules file

One source for the rules: compose mounts the rules file, Kubernetes gets the same groups
wrapped in a PrometheusRule (labelled for kube-prometheus-stack's default ruleSelector:
`release: <release name>`, filled in when the manifests are rendered).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "vramwatch.rules.yml"
OUT = Path(__file__).resolve().parent / "monitoring" / "prometheusrule.yaml"
#: Replaced by the Helm release name of kube-prometheus-stack when the manifests are rendered
#: (docs/deploy.md); not a valid label value, so forgetting it fails at apply time.
RELEASE_PLACEHOLDER = "__VRAMWATCH_RELEASE__"
HEADER = """\
# GENERATED from deploy/prometheus/rules/vramwatch.rules.yml by deploy/k8s/generate_prometheusrule.py:
# edit the rules file, then re-run the script (tests/deploy/test_deploy.py fails when they differ).
# kube-prometheus-stack loads PrometheusRules labelled `release: <helm release name>`: the documented
# command (docs/deploy.md) puts your release name in place of the placeholder.
"""


class _Literal(str):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Literal, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                                                                 style="|"))


def _block_strings(node: Any) -> Any:
    """Multi-line expressions stay readable (|) in the output."""
    if isinstance(node, dict):
        return {k: _block_strings(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_block_strings(v) for v in node]
    if isinstance(node, str) and "\n" in node:
        return _Literal(node)
    return node


def build() -> dict[str, Any]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "vramwatch", "labels": {"app.kubernetes.io/name": "vramwatch",
                                                     "release": RELEASE_PLACEHOLDER}},
        "spec": {"groups": groups},
    }


def render() -> str:
    body = yaml.dump(_block_strings(build()), Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return HEADER + body


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} differs from {RULES}: run python {Path(__file__).relative_to(ROOT)}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
