"""``vramwatch watch``: a real Prometheus scrapes a dcgm-exporter-format endpoint driven by the
simulator; the collector polls Prometheus and judges every GPU with no training-code change."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from prometheus_helpers import PrometheusServer, exposed_samples, scrape

from vramwatch.cli import main
from vramwatch.collector.exporters.device_watch import Poller, WatchConfig, build_query, lifespan_hook
from vramwatch.collector.server import BackgroundServer
from vramwatch.probe.simulated import simulate_trace

MiB = 1024**2
#: dcgm-exporter 3.x's labels on every series (etc/default-counters.csv metrics)
HOST = "gpu-node-07"


class SimulatedGpu:
    """One GPU whose memory follows a simulator scenario; each scrape advances the job by
    ``steps_per_scrape`` training steps (dcgm sees one reading every few steps, as in life)."""

    def __init__(self, index: int, scenario: str, steps_per_scrape: int, **params: Any) -> None:
        self.index = index
        self.uuid = f"GPU-{index:08x}-sim0-4000-8000-{index:012x}"
        self.trace: Iterator[dict[str, Any]] = simulate_trace(scenario, steps=10**6, rank=index, seed=index,
                                                             **params)
        self.steps_per_scrape = steps_per_scrape
        self.last: dict[str, Any] | None = None
        self.finished = False

    def advance(self) -> dict[str, Any] | None:
        taken = 0
        for sample in self.trace:
            if sample["phase"] == "train":
                self.last = sample
                taken += 1
                if taken >= self.steps_per_scrape:
                    break
        else:
            self.finished = True  # the job died (OOM): dcgm keeps reporting the last level
        return self.last


class DcgmExporter:
    """``/metrics`` in dcgm-exporter's exposition: FB_USED / FB_FREE / FB_RESERVED in MiB."""

    RESERVED_MIB = 537

    def __init__(self, gpus: list[SimulatedGpu]) -> None:
        self.gpus = gpus
        self.scrapes = 0
        self.lock = threading.Lock()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except BrokenPipeError:
                    pass  # Prometheus gave up on a slow scrape (its timeout): a missed point, as in life

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def render(self) -> str:
        with self.lock:
            self.scrapes += 1
            lines = {name: [f"# HELP {name} {help_}", f"# TYPE {name} gauge"] for name, help_ in (
                ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
                ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
                ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB)."))}
            for gpu in self.gpus:
                sample = gpu.advance()
                total = sample["total_bytes"] // MiB
                # dcgm's FB_USED excludes the driver's reserve: USED + FREE + RESERVED = total
                used = min(sample["nvml_used_bytes"] // MiB, total - self.RESERVED_MIB)
                labels = (f'gpu="{gpu.index}",UUID="{gpu.uuid}",pci_bus_id="00000000:{gpu.index + 7:02X}:00.0",'
                          f'device="nvidia{gpu.index}",modelName="NVIDIA H200",Hostname="{HOST}",'
                          f'DCGM_FI_DRIVER_VERSION="550.54.15"')
                lines["DCGM_FI_DEV_FB_USED"].append(f"DCGM_FI_DEV_FB_USED{{{labels}}} {used}")
                lines["DCGM_FI_DEV_FB_FREE"].append(
                    f"DCGM_FI_DEV_FB_FREE{{{labels}}} {total - used - self.RESERVED_MIB}")
                lines["DCGM_FI_DEV_FB_RESERVED"].append(f"DCGM_FI_DEV_FB_RESERVED{{{labels}}} {self.RESERVED_MIB}")
            return "\n".join(line for block in lines.values() for line in block) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _ranks(url: str, run: str) -> dict[int, dict[str, Any]]:
    response = httpx.get(f"{url}/api/v1/runs/{run}/ranks", timeout=10)
    return {r["rank"]: r for r in response.json()} if response.status_code == 200 else {}


def test_watch_judges_dcgm_series_from_a_real_prometheus(tmp_path) -> None:
    # GPU 0 trains healthily, GPU 1 leaks from step 1000 (about 2 minutes from OOM at this pace, so the
    # leak is still running when the test looks); 20 training steps per scrape
    gpus = [SimulatedGpu(0, "healthy", 20), SimulatedGpu(1, "fast_leak", 20, leak_onset=1000, leak_rate_frac=6e-6)]
    exporter = DcgmExporter(gpus)
    config = {"global": {"scrape_interval": "100ms", "scrape_timeout": "90ms"},
              "scrape_configs": [{"job_name": "dcgm-exporter", "static_configs": [{"targets": [exporter.target]}]}]}
    try:
        with PrometheusServer(tmp_path / "prom", config, {}) as prom:
            prom.wait_for('count(DCGM_FI_DEV_FB_USED{job="dcgm-exporter"})', lambda r: r and r[0]["value"][1] == "2")
            watch = WatchConfig(prom.url, selector='Hostname="gpu-node-07"', run="fleet", interval_s=0.1,
                                lookback_s=30, step_s=0.01)
            # a collector with an ingest token: the in-process poller must present it like any hook
            with BackgroundServer(tmp_path / "vw.db", token="s3cret", lifespan_hooks=(lifespan_hook(watch),)) \
                    as server:
                deadline = time.monotonic() + 60
                ranks: dict[int, dict[str, Any]] = {}
                while time.monotonic() < deadline:
                    ranks = _ranks(server.url, "fleet")
                    states = {rank: r["verdict"].get("state") for rank, r in ranks.items()}
                    if states.get(1) == "leak" and states.get(0) == "plateau":
                        break
                    time.sleep(0.25)
                assert {r: v["verdict"].get("state") for r, v in ranks.items()} == {0: "plateau", 1: "leak"}, ranks
                poller: Poller = server.app.state.watch
                text = scrape(server.url).text
                # the dashboard serves those GPUs: the runs list and the chart it polls
                runs = httpx.get(f"{server.url}/api/v1/runs", timeout=10).json()
                chart = httpx.get(f"{server.url}/api/v1/runs/fleet/chart", timeout=10,
                                  params={"rank": 1, "host": HOST, "fields": "nvml_used_bytes,total_bytes"})
                page = httpx.get(f"{server.url}/", timeout=10)
    finally:
        exporter.close()
    # what dcgm-exporter said is what was stored: device-level used memory and capacity only
    last = ranks[1]["last"]
    assert last["host"] == HOST and last["uuid"] == gpus[1].uuid and last["gpu"] == 1
    assert last["total_bytes"] == gpus[1].last["total_bytes"] // MiB * MiB
    assert last.get("allocated_bytes") is None and last.get("reserved_bytes") is None
    assert poller.posted > 50 and poller.failures == 0
    # the same verdict families a hook-fed run gets, on the dcgm-exporter labels
    states = {(labels["gpu"], labels["state"]): value for name, labels, value in exposed_samples(text)
              if name == "vramwatch_trend_state" and labels.get("run") == "fleet"}
    assert states[("1", "leak")] == 1 and states[("0", "leak")] == 0 and states[("0", "plateau")] == 1
    assert "fleet" in [r["run"] for r in runs] and page.status_code == 200
    assert chart.status_code == 200, chart.text
    used = [v for v in chart.json()["series"]["nvml_used_bytes"] if v is not None]
    assert len(used) > 20 and max(used) <= last["total_bytes"]
    # no false alarm on the healthy GPU, before or after
    assert not [e for e in ranks[0]["events"] if e["type"] == "leak"]
    leak = ranks[1]["verdict"]
    assert leak["slope_bytes_per_step"] > 0 and leak["seconds_to_oom"] is not None


def test_selector_becomes_label_matchers() -> None:
    assert build_query("") == '{__name__=~"DCGM_FI_DEV_FB_(USED|FREE|RESERVED|TOTAL)"}'
    assert build_query('{Hostname=~"gpu-.*", gpu!="7"}') == \
        '{__name__=~"DCGM_FI_DEV_FB_(USED|FREE|RESERVED|TOTAL)",Hostname=~"gpu-.*",gpu!="7"}'
    assert build_query('pod="a,b"').endswith(',pod="a,b"}')  # a comma inside quotes is not a separator
    for bad in ("Hostname", 'gpu=7', 'x="1"; drop'):
        with pytest.raises(ValueError, match="selector"):
            build_query(bad)


def test_poll_windows_follow_the_interval_grid() -> None:
    poller = Poller(WatchConfig("http://prom:9090", interval_s=15, lookback_s=600))
    start, end = poller.window(1_700_000_007.0)
    assert end == 1_700_000_000.0 - 1_700_000_000 % 15 + 0 and end % 15 == 0
    assert start == end - 600
    poller.next_start = end + 15
    assert poller.window(1_700_000_030.0) == (end + 15, end + 30)
    # a long outage: at most 10,000 points per series in one query (Prometheus caps at 11,000)
    poller.next_start = end - 10**6
    start, end2 = poller.window(1_700_000_030.0)
    assert (end2 - start) / 15 == 10_000


def test_watch_cli_rejects_bad_arguments_in_one_line(capsys) -> None:
    for argv, message in ((["--prometheus", "prom:9090"], "must be an http(s) URL"),
                          (["--prometheus", "http://p:9090", "--selector", "gpu=7"], "not a label matcher")):
        assert main(["watch", *argv, "--db", "/nonexistent/dir/x.db"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
