"""Helpers for the Prometheus/deploy tests: binaries, a real Prometheus server, feeding a
real collector with simulated traces, and pulling metric names out of PromQL.

(Not named test_*: it holds no tests; the deploy, metrics and Prometheus tests import it.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from vramwatch.wire import encode_lines

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "vramwatch.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "vramwatch.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vramwatch.json"
GRAFANA_ALERTS = DEPLOY / "grafana" / "provisioning" / "alerting" / "vramwatch-alerts.yaml"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


#: Debian package of each binary the tests run (installed by `make system-deps`).
PACKAGES = {"prometheus": "prometheus", "promtool": "prometheus", "prometheus-alertmanager": "prometheus-alertmanager",
            "amtool": "prometheus-alertmanager"}


def need_binary(name: str) -> str:
    """Path of a Prometheus/Alertmanager binary; under CI=true its absence fails the test, else skips."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path:
        return path
    message = f"{name} not found: apt-get install {PACKAGES.get(name, name)} (or make system-deps)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def need_tool(name: str) -> str:
    """A Python console script (check-jsonschema, kubernetes-validate, hadolint, yamllint) from the
    test extra: next to this interpreter, else on PATH. Under CI=true missing fails, else skips."""
    local = Path(sys.executable).parent / name
    path = str(local) if os.access(local, os.X_OK) else shutil.which(name)
    if path:
        return path
    message = f"{name} not found: pip install -e '.[test]' (or make install-test)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def need_module(name: str, package: str) -> None:
    """A Python package from the test extra (`package` is its PyPI name), importable by this
    interpreter. Under CI=true missing fails, else skips."""
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if found:
        return
    message = f"{name} not found: pip install -e '.[test]' ({package})"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def run_tool(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([need_tool(name), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def load_module(path: Path) -> Any:
    """Import a script from deploy/ (not a package) by path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [need_binary("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT
    )


# ------------------------------------------------------------------ collector side

def post_samples(url: str, samples: Iterable[dict[str, Any]], batch: int = 2000) -> int:
    """POST samples as NDJSON in batches; returns how many the collector accepted."""
    accepted = 0
    chunk: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        def flush() -> None:
            nonlocal accepted
            response = client.post(
                "/api/v1/samples", content=encode_lines(chunk), headers={"content-type": "application/x-ndjson"}
            )
            assert response.status_code == 200, response.text
            accepted += response.json()["accepted"]
            chunk.clear()

        for sample in samples:
            chunk.append(sample)
            if len(chunk) >= batch:
                flush()
        if chunk:
            flush()
    return accepted


def scrape(url: str, accept: str | None = None) -> httpx.Response:
    headers = {"accept": accept} if accept else {}
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response


def exposed_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def exposed_names(text: str) -> set[str]:
    """Names of the samples in an exposition (what PromQL can select)."""
    return {name for name, _, _ in exposed_samples(text)}


# ------------------------------------------------------------------ PromQL names

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "inf", "nan", "atan2", "start", "end",
}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (or a Grafana ``label_values`` query).

    A small lexer, enough for the expressions vramwatch ships: strings, label matchers,
    ranges, grouping clauses and template variables are dropped, then every identifier
    that is not a function call or a keyword is a metric name.
    """
    text = re.sub(r"\$\{[^}]*\}|\$[A-Za-z_]\w*", "x", expr)  # Grafana variables
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', text)
    label_values = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*", text, re.S)
    if label_values:
        text = label_values.group(1)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(offset|@)\s+-?[0-9a-z.]+", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", " ", text)  # numbers, incl. 1e9
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        following = text[match.end():].lstrip()
        if following.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]


def recording_rule_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def alert_rules() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in rule_groups() for rule in group["rules"] if "alert" in rule}


def all_queries() -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression shipped in deploy/."""
    queries = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            queries.append((f"rules:{rule.get('alert') or rule.get('record')}", rule["expr"]))
    dashboard = json.loads(DASHBOARD.read_text())

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            queries.append((f"panel:{panel['title']}", target["expr"]))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            queries.append((f"annotation:{annotation['name']}", annotation["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # not the datasource picker or the collector-URL textbox
            queries.append((f"variable:{variable['name']}", variable["query"]["query"]))
    for group in yaml.safe_load(GRAFANA_ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            for item in rule["data"]:
                if "expr" in item["model"]:
                    queries.append((f"grafana-alert:{rule['title']}", item["model"]["expr"]))
    return queries


def grafana_to_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in, as Grafana would send it."""
    for variable, value in (("$__rate_interval", "1m"), ("$__interval", "1m"), ("$__range", "1h"), ("$run", ".*"),
                            ("$host", ".*"), ("$rank", ".*"), ("$focus", "0"), ("$instance", ".*"), ("$gpu", ".*")):
        expr = expr.replace(variable, value)
    label_values = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*", expr, re.S)
    return label_values.group(1) if label_values else expr


# ------------------------------------------------------------------ a real Prometheus

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _LoopbackBinary:
    """A server binary on a free loopback port for one test: start (retrying a port taken
    between probe and bind), wait for ``/-/ready``, stop (terminate, then kill)."""

    name = ""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = need_binary(binary)
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log = workdir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> None:
        raise NotImplementedError

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> Any:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.port = free_port()
            with open(self.log, "wb") as log:
                self.process = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            self.stop()
            if "address already in use" not in self.log.read_text():
                break
        raise RuntimeError(f"{self.name} did not become ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusServer(_LoopbackBinary):
    """``/usr/bin/prometheus`` on a loopback port with temporary storage, for one test."""

    name = "prometheus"

    def __init__(self, workdir: Path, config: dict[str, Any], rule_files: dict[str, Any]) -> None:
        super().__init__("prometheus", workdir)
        self.config = config
        self.rule_files = rule_files

    def _write_config(self) -> None:
        names = []
        for name, content in self.rule_files.items():
            (self.workdir / name).write_text(yaml.safe_dump(content, sort_keys=False))
            names.append(str(self.workdir / name))
        config = dict(self.config, rule_files=names)
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))

    def _argv(self) -> list[str]:
        return [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle", "--storage.tsdb.retention.time=1h"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, predicate=bool, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll an instant query until ``predicate(result)`` holds; fail with the last result."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {expr!r}; last result: {result}\n"
                             f"prometheus log tail:\n{self.log.read_text()[-2000:]}")


# ------------------------------------------------------------------ a real Alertmanager

class AlertmanagerServer(_LoopbackBinary):
    """``/usr/bin/prometheus-alertmanager`` (Debian) on a loopback port, clustering off, for one test."""

    name = "alertmanager"

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        super().__init__("prometheus-alertmanager", workdir)
        self.config = config

    def _write_config(self) -> None:
        (self.workdir / "alertmanager.yml").write_text(yaml.safe_dump(self.config, sort_keys=False))

    def _argv(self) -> list[str]:
        return [self.binary, f"--config.file={self.workdir / 'alertmanager.yml'}",
                f"--storage.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address="]


class WebhookReceiver:
    """An HTTP server on loopback that keeps every JSON body POSTed to it, by path."""

    def __init__(self) -> None:
        import http.server
        import threading

        received: list[tuple[str, dict[str, Any]]] = []
        self.received = received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self) -> list[tuple[str, dict[str, Any]]]:
        """(receiver path, alert) for every alert delivered so far."""
        return [(path, alert) for path, body in list(self.received) for alert in body.get("alerts", [])]

    def wait_for(self, predicate, timeout: float = 30.0) -> list[tuple[str, dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.alerts()):
                return self.alerts()
            time.sleep(0.1)
        raise AssertionError(f"timed out; webhook received: {self.alerts()}")


class StaticExporter:
    """Serves a fixed exposition text at /metrics on loopback (a stand-in for dcgm-exporter's
    output, with its metric and label names; the test sets the values)."""

    def __init__(self, text: str) -> None:
        import http.server
        import threading

        payload = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> StaticExporter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def dcgm_exposition(gpus: list[dict[str, Any]]) -> str:
    """dcgm-exporter's text for GPUs given as {uuid, gpu, fb_used_mib}: its names, labels and units."""
    lines = []
    for name, kind, value in (("DCGM_FI_DEV_FB_USED", "gauge", "fb_used_mib"), ("DCGM_FI_DEV_GPU_UTIL", "gauge", 97),
                              ("DCGM_FI_DEV_POWER_USAGE", "gauge", 650.5), ("DCGM_FI_DEV_GPU_TEMP", "gauge", 61)):
        lines.append(f"# HELP {name} dcgm-exporter field\n# TYPE {name} {kind}")
        for gpu in gpus:
            number = gpu[value] if isinstance(value, str) else value
            lines.append(f'{name}{{gpu="{gpu["gpu"]}",UUID="{gpu["uuid"]}",device="nvidia{gpu["gpu"]}",'
                         f'modelName="NVIDIA H200",Hostname="dcgm-exporter-x7k2p"}} {number}')
    return "\n".join(lines) + "\n"
