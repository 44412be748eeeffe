"""Foreign memory by name: /proc naming (bounded, cached, secrets redacted), NVML's compute and
graphics lists (the nvidia-ml-py-shaped fake), the hook's side-channel report into a real
collector (uvicorn + SQLite), the API, /metrics, the post-mortem, and a real process's /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.fake_cuda import FakeCuda, GiB
from fakes.fake_pynvml import FakeGpu, make_pynvml
from helpers import make_sample, ndjson
from hook.test_probes import UUID0, UUID1, UUID2, probe_with
from prometheus_helpers import exposed_samples

from vramwatch.collector.ingest.processes import ProcessBook, foreign_only
from vramwatch.collector.server import BackgroundServer
from vramwatch.evidence.foreign import ForeignReporter, ProcessReport, changed, holds
from vramwatch.probe.nvml import NvmlReading, open_device
from vramwatch.probe.processes import ForeignProcess, ProcessNames, container_id, identify, redact

DOCKER_ID = "4f1d0e8c9b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e"


def fake_proc(root: Path, pid: int, *, comm: str, argv: list[str], cgroup: str = "0::/user.slice/session-3.scope\n",
              start: str = "81234") -> None:
    """A /proc/PID directory with the files the kernel writes (stat's field 22 is the start time)."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "cgroup").write_text(cgroup)
    (d / "stat").write_text(f"{pid} ({comm}) S 1 " + " ".join(["0"] * 17) + f" {start} 0 0\n")


# ---------------------------------------------------------------- naming from /proc
def test_a_jupyter_kernel_in_a_container_is_named(tmp_path: Path):
    fake_proc(tmp_path, 4242, comm="python3", argv=["/opt/conda/bin/python3", "-m", "ipykernel_launcher", "-f",
                                                   "/root/.local/share/jupyter/runtime/kernel-7.json"],
              cgroup=f"0::/system.slice/docker-{DOCKER_ID}.scope\n")
    p = identify(4242, 38 * GiB, tmp_path)
    assert (p.name, p.program, p.kind, p.container) == ("python3", "ipykernel_launcher", "a Jupyter kernel",
                                                        DOCKER_ID[:12])
    assert p.describe() == f"a Jupyter kernel (pid 4242, ipykernel_launcher, container {DOCKER_ID[:12]})"
    assert holds(p, "GPU 3") == (f"a Jupyter kernel (pid 4242, ipykernel_launcher, container {DOCKER_ID[:12]}) "
                                 "holds 38.0 GiB on GPU 3")
    gone = identify(999_999, GiB, tmp_path)  # not visible from here: the PID is all there is
    assert (gone.name, gone.cmdline, gone.container, gone.describe()) == ("", "", "", "a process (pid 999999, unknown)")


@pytest.mark.parametrize(("argv", "program", "kind"), [
    (["python", "train.py", "--lr", "3e-4"], "train.py", "a Python process"),
    (["/usr/bin/python3.11", "-u", "-m", "vllm.entrypoints.openai.api_server"], "vllm.entrypoints.openai.api_server",
     "an inference server"),
    (["/usr/lib/xorg/Xorg", "vt1", "-displayfd", "3"], "Xorg", "a display server"),
    (["python", "-c", "import torch; x = torch.empty(1, device='cuda')"], "python -c", "a Python process"),
    (["./my_cuda_tool", "--device", "0"], "my_cuda_tool", "a process"),
])
def test_program_and_kind_from_the_command_line(tmp_path: Path, argv: list[str], program: str, kind: str):
    fake_proc(tmp_path, 10, comm=os.path.basename(argv[0])[:15], argv=argv)
    p = identify(10, None, tmp_path)
    assert (p.program, p.kind) == (program, kind)
    assert holds(p, "GPU 0").endswith("holds memory on GPU 0")  # NVML did not say how much


def test_secrets_in_command_lines_never_leave_the_host(tmp_path: Path):
    argv = ["python", "serve.py", "--api-key=sk-live-123", "--token", "hunter2", "HF_TOKEN=hf_abc", "--port", "8000",
            "--db-password", "pw1", "--auth=basic:me:pw2"]
    assert redact(argv) == ["python", "serve.py", "--api-key=***", "--token", "***", "HF_TOKEN=***", "--port", "8000",
                            "--db-password", "***", "--auth=***"]
    fake_proc(tmp_path, 11, comm="python", argv=argv)
    cmdline = identify(11, None, tmp_path).cmdline
    assert not any(secret in cmdline for secret in ("sk-live-123", "hunter2", "hf_abc", "pw1", "pw2"))
    assert "--port 8000" in cmdline


def test_reads_are_bounded_and_cached_per_pid_and_start_time(tmp_path: Path):
    fake_proc(tmp_path, 12, comm="x" * 40 + "\x1b[31m", argv=["python", "a.py"] + ["--flag"] * 4000)
    p = identify(12, None, tmp_path)
    assert len(p.cmdline) <= 512 and len(p.name) <= 64 and "\x1b" not in p.name
    names = ProcessNames(tmp_path)
    fake_proc(tmp_path, 13, comm="python", argv=["python", "old_job.py"], start="100")
    assert names.lookup(13, GiB).program == "old_job.py"
    assert names.lookup(13, 2 * GiB).used_bytes == 2 * GiB and names.reads == 1  # cached, bytes are NVML's
    fake_proc(tmp_path, 13, comm="python", argv=["python", "new_job.py"], start="200")  # the PID was reused
    assert names.lookup(13, GiB).program == "new_job.py" and names.reads == 2


@pytest.mark.parametrize(("cgroup", "expected"), [
    (f"12:memory:/docker/{DOCKER_ID}\n11:cpu:/docker/{DOCKER_ID}\n", DOCKER_ID[:12]),
    (f"0::/system.slice/docker-{DOCKER_ID}.scope\n", DOCKER_ID[:12]),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/"
     f"cri-containerd-{DOCKER_ID}.scope\n", DOCKER_ID[:12]),
    (f"0::/kubepods/burstable/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d/{DOCKER_ID}\n", DOCKER_ID[:12]),
    (f"0::/machine.slice/libpod-{DOCKER_ID}.scope/container\n", DOCKER_ID[:12]),
    (f"0::/system.slice/crio-{DOCKER_ID}.scope\n", DOCKER_ID[:12]),
    ("0::/user.slice/user-1000.slice/session-2.scope\n", ""),
    ("0::/\n", ""),
])
def test_container_ids_from_cgroup_paths(cgroup: str, expected: str):
    assert container_id(cgroup) == expected


def test_this_process_is_named_from_the_real_proc():
    me = identify(os.getpid(), None)
    assert me.name and "pytest" in me.cmdline
    assert me.kind == "a Python process"


# ---------------------------------------------------------------- NVML: compute and graphics, one namespace
def test_nvml_compute_and_graphics_lists_named_largest_first(tmp_path: Path):
    me = os.getpid()
    gpus = [FakeGpu(f"GPU-{UUID0}"), FakeGpu(f"GPU-{UUID1}", used=70 * GiB, processes={me: 24 * GiB, 4242: 38 * GiB},
                                              graphics={4242: 38 * GiB, 77: GiB})]
    fake_proc(tmp_path, 4242, comm="python3", argv=["python3", "-m", "ipykernel_launcher"])
    fake_proc(tmp_path, 77, comm="Xorg", argv=["/usr/lib/xorg/Xorg", "vt1"])
    device = open_device(0, torch_uuid=UUID1, env={}, pynvml=make_pynvml(gpus))
    device.names = ProcessNames(tmp_path)
    reading = device.read()
    assert device.index == 1  # the host's numbering, not torch's
    assert reading.foreign_used_bytes == 39 * GiB  # the kernel once, though NVML lists it twice
    assert [(p.pid, p.used_bytes, p.kind) for p in reading.foreign] == [(4242, 38 * GiB, "a Jupyter kernel"),
                                                                        (77, GiB, "a display server")]
    # another PID namespace (a container): our PID is not listed, so no PID here is named
    gpus[1].processes, gpus[1].graphics = {1: 20 * GiB, 4242: GiB}, {}
    assert device.read().foreign == ()
    mig = FakeGpu("MIG-66666666-0000-0000-0000-000000000001", total=18 * GiB, used=5 * GiB, processes={me: GiB})
    gpus[2:] = [FakeGpu(f"GPU-{UUID2}", mig=[mig])]
    assert open_device(0, env={"CUDA_VISIBLE_DEVICES": "MIG-66666666"}, pynvml=make_pynvml(gpus)).index is None


# ---------------------------------------------------------------- the hook's report
def _reading(*procs: ForeignProcess) -> NvmlReading:
    return NvmlReading(80 * GiB, 141 * GiB, 24 * GiB, time.time(), sum(p.used_bytes or 0 for p in procs), (), procs)


def test_reports_are_sent_when_the_list_changes_and_refreshed(tmp_path: Path):
    sent: list[ProcessReport] = []
    now = {"reading": None}
    reporter = ForeignReporter("http://127.0.0.1:9", lambda: now["reading"], run="job", host="node-a", rank=3, gpu=3,
                               uuid="GPU-x", refresh_s=60)
    reporter._post = sent.append  # the transport is tested against a real collector below
    kernel = ForeignProcess(4242, 38 * GiB, "python3", "python3 -m ipykernel_launcher")
    assert not reporter.poll_once(0.0)  # NVML unknown: nothing said
    now["reading"] = _reading()
    assert not reporter.poll_once(1.0)  # nobody else on the GPU, nothing to say
    now["reading"] = _reading(kernel)
    assert reporter.poll_once(2.0) and sent[-1].processes == (kernel,) and sent[-1].device() == "GPU 3"
    now["reading"] = _reading(ForeignProcess(4242, 38 * GiB + 10 * 2**20, "python3", kernel.cmdline))
    assert not reporter.poll_once(3.0)  # 10 MiB moved: not news
    assert reporter.poll_once(62.5)  # but the collector hears again within refresh_s
    now["reading"] = _reading(ForeignProcess(4242, 45 * GiB, "python3", kernel.cmdline))
    assert reporter.poll_once(63.0)  # 7 GiB more
    now["reading"] = _reading()
    assert reporter.poll_once(64.0) and sent[-1].processes == ()  # it went away: said once
    assert not reporter.poll_once(200.0)
    assert changed((kernel,), (ForeignProcess(4242, 38 * GiB, "python3", "python3 other.py"),))  # PID reused
    assert reporter.stats() == {"reports": 4, "failed": 0} and len(sent) == 4


def _post(client: httpx.Client, samples: list[dict]) -> None:
    r = client.post("/api/v1/samples", content=ndjson(samples), headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text


def _report(rank: int, *procs: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {"run": "job", "host": "node-a", "rank": rank, "ts": time.time(), "gpu": rank, "uuid": f"GPU-{rank}",
            "processes": list(procs), **over}


def test_the_side_channel_refuses_bad_reports_and_changes_nothing(tmp_path: Path):
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        _post(client, [make_sample(0, run="job", host="node-a", rank=0, ts=time.time(), pid=100)])
        kernel = {"pid": 4242, "used_bytes": 38 * GiB, "name": "python3", "cmdline": "python3 -m ipykernel_launcher",
                  "container": ""}
        bad = [
            (_report(0, {**kernel, "cmd": "x"}), 422, "cmd"),
            (_report(0, {**kernel, "cmdline": "x" * 513}), 422, "cmdline"),
            (_report(0, *[{**kernel, "pid": i} for i in range(17)]), 422, "processes"),
            (_report(0, {**kernel, "pid": "4242"}), 422, "pid"),
            (_report(0, {**kernel, "container": "../../etc"}), 422, "container"),
            (_report(-1, kernel), 422, "rank"),
            (_report(5, kernel), 404, "rank"),
        ]
        for body, status, field in bad:
            r = client.post("/api/v1/processes", json=body)
            assert r.status_code == status, (field, r.text)
            assert field in r.text
        big = client.post("/api/v1/processes", content=b"{" + b" " * (70 * 1024) + b"}",
                          headers={"Content-Type": "application/json"})
        assert big.status_code == 413 and "65536" in big.json()["detail"]
        assert client.get("/api/v1/runs/job/processes").json() == []
        assert client.post("/api/v1/processes", json=_report(0, kernel)).json() == {"processes": 1}
        assert len(client.get("/api/v1/runs/job/processes").json()) == 1


def test_ranks_of_the_run_are_not_foreign(tmp_path: Path):
    book = ProcessBook(tmp_path / "p")
    rank1 = ForeignProcess(101, 60 * GiB, "python", "python train.py")
    kernel = ForeignProcess(4242, 38 * GiB, "python3", "python3 -m ipykernel_launcher")
    book.put(ProcessReport("job", "node-a", 0, time.time(), 0, "GPU-0", (rank1, kernel)))
    report = book.run("job")[0]
    assert foreign_only(report, {"node-a": {100, 101}}).processes == (kernel,)
    assert foreign_only(report, {"node-b": {101}}).processes == (rank1, kernel)  # another host's PID 101
    # persisted: a new book (a restarted collector, the CLI) reads it back
    assert ProcessBook(tmp_path / "p").run("job") == [report]
    book.put(ProcessReport("job", "node-a", 0, time.time(), 0, "GPU-0", ()))
    assert book.run("job") == [] and ProcessBook(tmp_path / "p").run("job") == []


def test_a_real_process_named_from_the_hook_to_the_api_metrics_and_postmortem(tmp_path: Path, monkeypatch, capsys):
    """The real Monitor (torch probe over the fake CUDA entry points, NVML from the
    nvidia-ml-py-shaped fake) on a GPU where NVML also lists a real child process started as a
    Jupyter kernel would be: its /proc is read for real, the report crosses HTTP to a real
    collector, and the API, /metrics and the post-mortem name it."""
    from vramwatch import hook

    (tmp_path / "ipykernel_launcher.py").write_text("import time\ntime.sleep(120)\n")
    kernel = subprocess.Popen([sys.executable, "-m", "ipykernel_launcher", "-f", str(tmp_path / "kernel-1.json"),
                               "--Session.key=b'do-not-leak'"], cwd=tmp_path)
    try:
        gpus = [FakeGpu(f"GPU-{UUID0}"), FakeGpu(f"GPU-{UUID1}", used=70 * GiB,
                                                  processes={os.getpid(): 24 * GiB, kernel.pid: 38 * GiB})]
        probe = probe_with(monkeypatch, FakeCuda(uuid=UUID1), nvml=make_pynvml(gpus))
        with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
            vw = hook.init(srv.url, run="job", host="node-a", rank=3, probe=probe, spool_dir=tmp_path / "spool",
                           flush_interval_s=0.05)
            try:
                deadline = time.monotonic() + 10
                while not (probe.poller.latest and probe.poller.latest.foreign and "ipykernel" in
                           probe.poller.latest.foreign[0].cmdline):
                    assert time.monotonic() < deadline, "the poller never named the process"
                    time.sleep(0.05)
                for step in range(3):
                    vw.step(step)
                assert vw.flush(10)
                assert vw.foreign is not None and vw.foreign._thread.name == "vramwatch-foreign"
                assert vw.foreign.poll_once()
                (doc,) = client.get("/api/v1/runs/job/processes").json()
                (proc,) = doc["processes"]
                sentence = f"a Jupyter kernel (pid {kernel.pid}, ipykernel_launcher) holds 38.0 GiB on GPU 1"
                assert (doc["rank"], doc["device"], proc["summary"]) == (3, "GPU 1", sentence)
                assert "do-not-leak" not in proc["cmdline"] and "kernel-1.json" in proc["cmdline"]
                metrics = [(labels, v) for name, labels, v in exposed_samples(client.get("/metrics").text)
                           if name == "vramwatch_foreign_process_used_bytes"]
                # gpu: the host's NVML index (the one dcgm-exporter labels with), as the device names it
                assert metrics == [({"run": "job", "rank": "3", "Hostname": "node-a", "UUID": f"GPU-{UUID1}",
                                     "gpu": "1", "pid": str(kernel.pid), "process": proc["name"], "container": "",
                                     "description": f"a Jupyter kernel (pid {kernel.pid}, ipykernel_launcher)",
                                     "device": "GPU 1"}, 38 * GiB)]
                pm = client.get("/api/v1/runs/job/postmortem").json()
                (rank,) = pm["ranks"]
                assert [p["summary"] for p in rank["foreign_processes"]] == [sentence]
            finally:
                vw.close()
        from vramwatch.cli import main

        capsys.readouterr()
        assert main(["postmortem", "job", "--db", str(tmp_path / "vw.db")]) == 0  # after the collector is gone
        assert sentence in capsys.readouterr().out
    finally:
        kernel.kill()
        kernel.wait()


def test_the_prometheus_family_on_both_exposition_paths():
    from prometheus_client import generate_latest

    from vramwatch.collector.exporters.metrics import build_registry, render
    from vramwatch.collector.ingest.processes import FAMILY
    from vramwatch.collector.state.live import LiveState

    live = LiveState()
    now = time.time()
    live.ingest([make_sample(0, run="job", host="node-a", rank=r, pid=100 + r, ts=now, uuid=f"GPU-{r}", gpu=r)
                 for r in (0, 1)], received_at=now)
    book = ProcessBook(None)
    odd = ForeignProcess(4242, 38 * GiB, 'py"th\\on', 'python3 "my script\\.py"')  # quotes and backslashes
    rank1 = ForeignProcess(101, 60 * GiB, "python", "python train.py")  # rank 1 on the same host: not foreign
    book.put(ProcessReport("job", "node-a", 0, now, 3, "GPU-0", (odd, rank1)))
    book.put(ProcessReport("gone", "node-a", 0, now, 3, "GPU-0", (odd,)))  # a run /metrics does not export
    registry, _ = build_registry(live, processes=book)
    fast = [s for s in exposed_samples(render(registry, None)[0].decode()) if s[0] == FAMILY]
    generic = [s for s in exposed_samples(generate_latest(registry).decode()) if s[0] == FAMILY]
    assert fast == generic
    ((_, labels, value),) = fast
    assert value == 38 * GiB and labels["pid"] == "4242" and labels["process"] == 'py"th\\on'
    assert labels["description"] == 'a Python process (pid 4242, "my)' and labels["device"] == "GPU 3"
    assert (labels["UUID"], labels["gpu"], labels["rank"]) == ("GPU-0", "0", "0")


def test_the_side_channel_takes_json_only_and_redacts_on_receipt(tmp_path: Path):
    with BackgroundServer(str(tmp_path / "vw.db")) as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        _post(client, [make_sample(0, run="job", host="node-a", rank=0, ts=time.time(), pid=100)])
        leaky = {"pid": 4242, "used_bytes": GiB, "name": "python3", "container": "",
                 "cmdline": "psql postgres://app:hunter2@db/m --password hunter2 Authorization: Bearer hunter2"}
        import json as _json
        form = client.post("/api/v1/processes", content=_json.dumps(_report(0, leaky)),  # a cross-site form's type
                           headers={"Content-Type": "text/plain"})
        assert form.status_code == 415 and client.get("/api/v1/runs/job/processes").json() == []
        assert client.post("/api/v1/processes", json=_report(0, leaky)).status_code == 200
        served = client.get("/api/v1/runs/job/processes").json()[0]["processes"][0]["cmdline"]
        assert "hunter2" not in served and served.startswith("psql postgres://app:***@db/m --password ***"), served
        assert "hunter2" not in client.get("/api/v1/runs/job/postmortem").text
