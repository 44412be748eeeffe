"""Validates prometheus-operator objects (ServiceMonitor, PrometheusRule, ...) strictly.

    python deploy/k8s/check_operator_objects.py deploy/k8s/monitoring/*.yaml

Each YAML document is checked against the pydantic models of `cloudcoil-models-prometheus-operator`
(a pinned PyPI package from the `test` extra, generated from prometheus-operator's CRDs): JSON
mode, `strict=True` (no coercion: "yes" is not a boolean) and `extra="forbid"` at every level
(a misspelt field fails instead of being silently dropped, as a CRD without
`x-kubernetes-preserve-unknown-fields` would prune it). Nothing is vendored here: the schema
comes from the installed package.

Exit 0: every document valid. 1: one line per error, `file: Kind/name: field.path: message`.
2: the package is missing or a file cannot be read/parsed (one line).
Cost: the first call imports the models (~3 s, 2 MB of generated code); each document then
validates in milliseconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

PACKAGE = "cloudcoil.models.prometheus_operator"
GROUP = "monitoring.coreos.com"
INSTALL_HINT = "pip install -e '.[test]' (cloudcoil-models-prometheus-operator)"


class UsageError(Exception):
    """The validator cannot run (package missing, file unreadable): exit 2."""


def _models(version: str) -> ModuleType:
    """The package's module for one API version (`v1`, `v1alpha1`); ModuleNotFoundError if the
    package has no such version, UsageError if the package itself is missing."""
    try:
        installed = importlib.util.find_spec(PACKAGE) is not None
    except ModuleNotFoundError:  # the parent `cloudcoil` is missing
        installed = False
    if not installed:
        raise UsageError(f"{PACKAGE} not installed: {INSTALL_HINT}")
    if not re.fullmatch(r"v\d+(?:(?:alpha|beta)\d+)?", version):
        raise ModuleNotFoundError(version)
    return importlib.import_module(f"{PACKAGE}.{version}")


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(document)"


def check_document(doc: Any) -> list[str]:
    """Errors of one parsed YAML document (empty when valid), each `Kind/name: field: message`."""
    if not isinstance(doc, dict):
        return [f"(document): expected a mapping, got {type(doc).__name__}"]
    api_version, kind = str(doc.get("apiVersion", "")), str(doc.get("kind", ""))
    metadata = doc.get("metadata")
    label = f"{kind or '?'}/{metadata.get('name', '?') if isinstance(metadata, dict) else '?'}"
    group, _, version = api_version.partition("/")
    if group != GROUP or not version:
        return [f"{label}: apiVersion: {api_version!r} is not {GROUP}/<version>"]
    try:
        module = _models(version)
    except ModuleNotFoundError:
        return [f"{label}: apiVersion: unknown version {version!r} of {GROUP}"]
    model = getattr(module, kind, None)
    # only top-level resources (their `kind` field defaults to the kind), not nested models
    kind_field = getattr(model, "model_fields", {}).get("kind")
    if kind_field is None or kind_field.default != kind:
        return [f"{label}: kind: {kind!r} is not a {api_version} kind"]
    from pydantic import ValidationError

    try:
        # JSON mode, as the API server sees the object: strings are not coerced to numbers/booleans
        model.model_validate_json(json.dumps(doc, default=str), strict=True, extra="forbid")
    except ValidationError as exc:
        return [f"{label}: {_location(err['loc'])}: {err['msg']}" for err in exc.errors()]
    return []


def check_file(path: Path) -> list[str]:
    """Errors of every document in one YAML file, prefixed with the file name."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: {exc}".splitlines()[0]) from exc
    if not docs:
        return [f"{path}: no YAML document"]
    return [f"{path}: {error}" for doc in docs for error in check_document(doc)]


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: check_operator_objects.py FILE.yaml...", file=sys.stderr)
        return 2
    try:
        _models("v1")
        errors = [error for path in paths for error in check_file(path)]
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for error in errors:
        print(error)
    if not errors:
        print(f"{len(paths)} file(s) valid against {PACKAGE}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
