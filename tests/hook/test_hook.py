"""The hook end to end: real CPU torch loops feeding a real collector (uvicorn + SQLite)
through the real delivery path, with the simulated probe standing in for the GPU."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
import torch
from fakes.collector import CollectorProcess, free_port, stored
from fakes.ingest_server import dead_url

import vramwatch.hook as hook
from vramwatch import identity, wire
from vramwatch.probe.simulated import SimulatedProbe


@pytest.fixture(scope="module")
def collector(module_collector):
    return module_collector


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def tiny_training(steps: int, vw: hook.Monitor, *, checkpoint_every: int = 0, ckpt_dir: Path | None = None):
    """A real (tiny) CPU training loop: Linear + AdamW, random data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = torch.randn(16, 32), torch.randn(16, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        vw.step(step, tokens=16 * 32, loss=losses[-1])
        if checkpoint_every and step and step % checkpoint_every == 0:
            with vw.phase("checkpoint"):
                torch.save(model.state_dict(), ckpt_dir / f"ckpt-{step}.pt")
    return losses


def monitor(url: str, run: str, tmp_path: Path, **kwargs) -> hook.Monitor:
    kwargs.setdefault("probe", "simulated")
    kwargs.setdefault("flush_interval_s", 0.05)
    kwargs.setdefault("backoff_max_s", 0.3)
    return hook.init(url, run=run, rank=kwargs.pop("rank", 0), spool_dir=tmp_path / "spool", **kwargs)


def test_plain_loop_feeds_the_collector_steps_phases_and_numbers(collector, tmp_path):
    vw = monitor(collector.url, "plain-loop", tmp_path, world_size=1)
    tiny_training(30, vw, checkpoint_every=10, ckpt_dir=tmp_path)
    assert vw.close(10)
    rows = stored(collector.db, "plain-loop")
    assert [r[1] for r in rows if r[2] == "train"] == list(range(30))
    assert [r[1] for r in rows if r[2] == "checkpoint"] == [10, 20]
    stats = vw.stats()
    # 30 steps, 2 checkpoints each opened by a marker, the exit marker
    assert stats["samples"] == 35 and stats["accepted"] == 35
    assert stats["probe_errors"] == stats["hook_errors"] == stats["send_failures"] == 0
    ranks = get_json(f"{collector.url}/api/v1/runs/plain-loop/ranks")
    assert len(ranks) == 1 and ranks[0]["last_step"] == 29
    last = ranks[0]["last"]
    assert last["tokens"] == 512 and "loss" in last["extra"]
    assert last["uuid"].startswith("GPU-sim") and last["incarnation"] == vw.identity["incarnation"]
    phases = get_json(f"{collector.url}/api/v1/runs/plain-loop/phases")
    checkpoint_peaks = [p["peak_allocated_bytes"] for p in phases if p["phase"] == "checkpoint"]
    train_peaks = [r["last"]["peak_allocated_bytes"] for r in ranks]
    assert len(checkpoint_peaks) == 2 and min(checkpoint_peaks) > max(train_peaks)  # a phase carries its own peak
    con = sqlite3.connect(collector.db)
    durations = con.execute("SELECT s.step_time FROM samples s JOIN series se ON s.series = se.id "
                            "WHERE se.run = 'plain-loop' AND s.phase != 0").fetchall()
    con.close()
    assert len(durations) == 2 and all(d[0] > 0 for d in durations)  # a phase sample's time: its duration


class FlakyProbe(SimulatedProbe):
    """A probe whose every third read fails (a CUDA error, a driver hiccup)."""

    def read(self, step: int, phase: str = "train") -> dict:
        if step % 3 == 2:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return super().read(step, phase)


def test_probe_that_raises_training_goes_on_and_errors_are_counted(collector, tmp_path):
    vw = monitor(collector.url, "flaky-probe", tmp_path, probe=FlakyProbe("healthy"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = tiny_training(12, vw)
    assert len(losses) == 12  # training finished
    assert vw.close(10)
    assert vw.stats()["probe_errors"] == 4
    assert [r[1] for r in stored(collector.db, "flaky-probe")] == [0, 1, 3, 4, 6, 7, 9, 10]
    assert sum("probe failed" in str(w.message) for w in caught) == 1  # warned once, not per step


def test_bad_phase_name_and_tensor_numbers_never_raise(collector, tmp_path):
    vw = monitor(collector.url, "bad-input", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vw.phase("check point!"):
            pass
        vw.step(0, loss=torch.tensor(1.5), lr=3e-4)
        vw.step(torch.tensor(1))
    assert vw.close(10)
    stats = vw.stats()
    assert stats["hook_errors"] == 1 and stats["ignored_numbers"] == 1
    assert [r[1:3] for r in stored(collector.db, "bad-input")] == [(0, "train"), (1, "train")]
    assert any("phase" in str(w.message) for w in caught)


def test_context_manager_and_no_url_writes_jsonl_trace_files(tmp_path, monkeypatch):
    monkeypatch.delenv("VRAMWATCH_URL", raising=False)
    with hook.init(run="local-files", probe="simulated", out_dir=tmp_path / "traces") as vw:
        tiny_training(8, vw, checkpoint_every=5, ckpt_dir=tmp_path)
        path = vw.trace_path
    samples = list(wire.iter_samples(path))  # validates every line
    assert [(s["step"], s["phase"]) for s in samples] == [(i, "train") for i in range(6)] + [
        (5, "train"), (5, "checkpoint"), (6, "train"), (7, "train"), (7, "train")]
    assert (samples[6]["phase_open"], samples[6]["seq"]) == (True, 1)  # the checkpoint's opening marker
    assert samples[-1]["exit"] is True and samples[-1]["seq"] == 1  # the clean close's marker
    assert not any(s.get("phase_open") for s in samples if s is not samples[6])
    assert path.parent == tmp_path / "traces" / "local-files"


def test_cpu_torch_without_cuda_warns_once_and_is_a_no_op(tmp_path, monkeypatch):
    import vramwatch.probe.base as probe_base

    monkeypatch.setattr(probe_base, "_warned", set())
    monkeypatch.delenv("VRAMWATCH_PROBE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vw = hook.init(dead_url(), run="no-gpu", spool_dir=tmp_path)
        tiny_training(3, vw)
        with vw.phase("eval"):
            pass
    assert not vw.active
    stats = vw.stats()
    assert stats["samples"] == 0 and stats["probe"] is None
    assert sum("no CUDA device" in str(w.message) for w in caught) == 1
    assert vw.close(1)
    assert not list(tmp_path.iterdir())  # nothing spooled, nothing invented


def test_identity_from_torchrun_and_slurm_environments():
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "job-42",
                "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}
    a = identity.resolve(env=torchrun, host="node-b")
    b = identity.resolve(env=dict(torchrun, RANK="0", LOCAL_RANK="0"), host="node-a")
    assert a["run"] == b["run"] == "torchrun-job-42"
    assert (a["rank"], a["local_rank"], a["world_size"]) == (5, 1, 16)
    assert a["incarnation"] != b["incarnation"]
    # torchrun's default rdzv id is the literal "none": the rendezvous endpoint names the run
    default = dict(torchrun, TORCHELASTIC_RUN_ID="none")
    assert identity.resolve(env=default)["run"] == identity.resolve(env=dict(default, RANK="3"))["run"] \
        == "torchrun-node-a-29500"
    slurm = {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "991",
             "SLURMD_NODENAME": "gpu-node-12"}
    s = identity.resolve(env=slurm)
    assert (s["run"], s["host"], s["rank"], s["local_rank"], s["world_size"]) == ("slurm-991", "gpu-node-12", 7, 3, 8)
    single = identity.resolve(env={}, host="laptop")
    assert (single["rank"], single["world_size"]) == (0, 1) and single["run"].startswith("laptop-")
    assert identity.resolve(env={"VRAMWATCH_RUN": "my run/1", **slurm})["run"] == "my-run-1"
    garbled = identity.resolve(env={"RANK": "x", "SLURM_PROCID": "2"})
    assert garbled["rank"] == 2


FORK_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import vramwatch.hook as hook
    from torch.utils.data import DataLoader, TensorDataset

    from vramwatch.probe.simulated import SimulatedProbe

    url, out = sys.argv[1], sys.argv[2]

    class PidRecordingProbe(SimulatedProbe):
        # in a forked child a real CUDA probe would fail ("cannot re-initialize CUDA")
        def read(self, step, phase="train"):
            with open(out + "/reads.txt", "a") as fh:
                fh.write(f"{os.getpid()}\\n")
            return super().read(step, phase)

    vw = hook.init(url or None, run="fork-test", probe=PidRecordingProbe(), flush_interval_s=0.05,
                   out_dir=out, spool_dir=out + "/spool")
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    # DataLoader workers fork; each one calls the hook (as a careless collate_fn might)
    def collate(batch):
        vw.step(100000 + os.getpid() % 1000)
        with vw.phase("worker"):
            pass
        return torch.utils.data.default_collate(batch)
    loader = DataLoader(data, batch_size=8, num_workers=2, collate_fn=collate,
                        multiprocessing_context="fork")
    step = 0
    for epoch in range(2):
        for x, y in loader:
            vw.step(step)
            step += 1
    pid = os.fork()  # a plain fork child that exits normally (runs atexit)
    if pid == 0:
        print("CHILD active", vw.active, flush=True)
        vw.step(999999)
        vw.flush(1)
        sys.exit(0)
    os.waitpid(pid, 0)
    for _ in range(4):
        vw.step(step)
        step += 1
    print("STEPS", step, vw.stats()["dropped_in_child"], "PARENT", os.getpid())
    vw.close(10)
""")


@pytest.mark.parametrize("sink", ["collector", "files"])
def test_forked_workers_neither_send_nor_corrupt_the_parent(collector, tmp_path, sink):
    url = collector.url if sink == "collector" else ""
    result = subprocess.run([sys.executable, "-c", FORK_SCRIPT, url, str(tmp_path)], capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 20 0" in result.stdout  # the parent's sender never saw a child's sample
    assert "CHILD active False" in result.stdout
    parent = result.stdout.split("PARENT")[1].split()[0]
    readers = set((tmp_path / "reads.txt").read_text().split())
    assert readers == {parent}  # no forked process touched the probe
    if sink == "collector":
        rows = stored(collector.db, "fork-test")
    else:
        (trace,) = (tmp_path / "fork-test").glob("*.jsonl")
        rows = [(s["rank"], s["step"], s["phase"], s["incarnation"]) for s in wire.iter_samples(trace)
                if not s.get("exit")]  # the close's marker (checked in test_a_clean_close_...)
    assert [r[1] for r in rows] == list(range(20))
    assert {r[2] for r in rows} == {"train"} and len({r[3] for r in rows}) == 1


def test_collector_killed_mid_run_and_restarted_every_sample_arrives_exactly_once(tmp_path):
    db = tmp_path / "vw.db"
    port = free_port()
    server = CollectorProcess(db, port).start()
    vw = monitor(server.url, "kill-restart", tmp_path, batch_size=8)
    try:
        for step in range(60):
            vw.step(step)
            if step % 10 == 9:
                with vw.phase("checkpoint"):
                    time.sleep(0.002)
            time.sleep(0.01)
            if step == 20:
                server.kill()  # SIGKILL: no graceful shutdown
            if step == 45:
                server = CollectorProcess(db, port).start()  # same port, same DB
        assert vw.flush(20)
        stats = vw.stats()
        assert stats["send_failures"] >= 1 and stats["spooled"] > 0 and stats["replayed"] > 0
    finally:
        vw.close(10)
        server.stop()
    rows = stored(db, "kill-restart")
    train = [r[1] for r in rows if r[2] == "train"]
    checkpoints = [r[1] for r in rows if r[2] == "checkpoint"]
    assert train == list(range(60))  # every step, once (the primary key would refuse twice)
    assert checkpoints == [9, 19, 29, 39, 49, 59]


def test_samples_left_in_the_spool_by_a_dead_collector_are_replayed_by_the_next_process(collector, tmp_path):
    down = dead_url()
    first = monitor(down, "spool-handover", tmp_path)
    for step in range(25):
        first.step(step)
    started = time.monotonic()
    assert not first.close(timeout=1.0)  # bounded, even with the collector down
    assert time.monotonic() - started < 2.0
    assert first.stats()["spooled"] == 25 + 1  # and the close's exit marker
    # the rank restarts (new incarnation) and the collector is reachable again
    second = monitor(collector.url, "spool-handover", tmp_path)
    for step in range(25, 30):
        second.step(step)
    assert second.close(10)
    rows = stored(collector.db, "spool-handover")
    assert [r[1] for r in rows] == list(range(30))
    assert {r[3] for r in rows if r[1] < 25} == {first.identity["incarnation"]}
    assert not list((tmp_path / "spool").glob("*.jsonl"))


def test_the_hook_needs_neither_torch_nor_the_server_stack():
    code = ("import sys, vramwatch, vramwatch.hook, vramwatch.delivery, vramwatch.cli.demo\n"
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'httpx', 'pynvml') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_bad_collector_url_is_refused_before_training_starts(monkeypatch):
    with pytest.raises(ValueError, match=r"^url: must be http"):
        hook.init("ftp://collector:21", probe="simulated")
    monkeypatch.setenv("VRAMWATCH_URL", "collector:notaport:x")
    with pytest.raises(ValueError, match=r"^VRAMWATCH_URL: must be http"):
        hook.init(probe="simulated")


# ---------------------------------------------------------------- one config


def test_every_vramwatch_variable_is_in_the_config_table_and_the_readme():
    import re

    from vramwatch.config import ENV, env_table

    root = Path(hook.__file__).resolve().parent
    read = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        # a JS global in the report (window.VRAMWATCH_STATIC) is not an environment variable
        read |= {m.group(1) for m in re.finditer(r"(?<!window\.)\b(VRAMWATCH_[A-Z_]+)\b", text)}
    names = {var.name for var in ENV}
    assert read <= names, f"read but not in vramwatch.config.ENV: {sorted(read - names)}"
    readme = (root.parent / "README.md").read_text()
    assert env_table() in readme, "README's variable table is stale: regenerate it from vramwatch.config.env_table()"
    # outside config.py only the collector's settings and the launcher-facing identity are read
    outside = set()
    for path in root.rglob("*.py"):
        if path.name != "config.py":
            outside |= set(re.findall(r"environ(?:\.get)?\(?\[?\"(VRAMWATCH_[A-Z_]+)", path.read_text()))
    assert outside <= {"VRAMWATCH_DB", "VRAMWATCH_TOKEN"}, sorted(outside)


def test_config_from_env_arguments_win_values_are_checked_and_named():
    from vramwatch.config import Config

    env = {"VRAMWATCH_URL": "http://c:1", "VRAMWATCH_TOKEN": " s3cret \n", "VRAMWATCH_PROBE": "Simulated",
           "VRAMWATCH_DISABLE": "yes", "VRAMWATCH_EXIT_TIMEOUT": "2.5", "VRAMWATCH_SPOOL_DIR": "/tmp/sp",
           "VRAMWATCH_HOST": "node-9", "VRAMWATCH_SIM_SEED": "7"}
    config = Config.from_env(env)
    assert (config.url, config.token, config.probe, config.enabled) == ("http://c:1", "s3cret", "simulated", False)
    assert (config.exit_timeout_s, config.spool_root(), config.host, config.sim_seed) == (2.5, Path("/tmp/sp"),
                                                                                          "node-9", 7)
    assert Config.from_env(env, url="http://d:2", enabled=True).url == "http://d:2"
    with pytest.raises(ValueError, match=r"^VRAMWATCH_EXIT_TIMEOUT: must be a number"):
        Config.from_env({"VRAMWATCH_EXIT_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match=r"^VRAMWATCH_SIM_SEED"):
        Config.from_env({"VRAMWATCH_SIM_SEED": "x"})
    with pytest.raises(ValueError, match=r"^flush_interval_s"):
        Config.from_env({}, flush_interval_s=0)
    with pytest.raises(TypeError, match="nvml_interval"):
        Config.from_env({}, nvml_intervall_s=1)


def test_monitor_takes_a_config_and_its_constructor_is_small(tmp_path):
    import inspect

    from vramwatch.config import Config

    config = Config.from_env({}, probe="simulated", run="cfg", out_dir=tmp_path)
    vw = hook.Monitor(config)
    vw.step(1)
    assert vw.close(5) and vw.stats()["samples"] == 2 and vw.config is config  # the step and the exit marker
    lines = inspect.getsource(hook.Monitor.__init__).count("\n")
    assert lines <= 40, f"Monitor.__init__ is {lines} lines"


# ---------------------------------------------------------------- host memory


def test_host_memory_of_the_real_process_and_its_children():
    from vramwatch.probe import host

    child = subprocess.Popen([sys.executable, "-c", "x = bytearray(80 * 2**20); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        reading = host.read_host(os.getpid())
        while reading["host_children_rss_bytes"] < 80 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.05)
            reading = host.read_host(os.getpid())
    finally:
        child.kill()
        child.wait()
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 10 * 2**20 < reading["host_rss_bytes"] <= peak + 2**20  # torch is imported: tens of MiB at least
    assert reading["host_children_rss_bytes"] >= 80 * 2**20  # the child's 80 MiB bytearray is resident
    assert 0 < reading["host_available_bytes"] < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert reading["host_pinned_bytes"] is None  # no framework asked


def test_host_fields_ride_on_every_sample_and_a_phase_sample(tmp_path):
    vw = hook.init(None, run="host-fields", probe="simulated", out_dir=tmp_path, host_interval_s=0.05)
    vw.step(1)
    with vw.phase("checkpoint"):
        pass
    assert vw.close(5)
    stored = [json.loads(line) for line in vw.trace_path.read_text().splitlines()]
    assert len(stored) == 4  # step, the phase's opening marker, phase, the close's exit marker
    for sample in stored:
        assert sample["host_rss_bytes"] > 10 * 2**20 and sample["host_available_bytes"] > 0


def test_feature_seams_step_hooks_directive_listeners_and_close_hooks(tmp_path):
    """What the snapshot-capture agent plugs into: directives from replies, each step, close."""
    from fakes.ingest_server import ScriptedIngest

    with ScriptedIngest() as ingest:
        ingest.reply_extra = {"directives": [{"type": "capture", "steps": 3}]}
        vw = hook.init(ingest.url, run="seams", probe="simulated", spool_dir=tmp_path, flush_interval_s=0.05)
        seen, steps, closed = [], [], []
        vw.sender.add_directive_listener(seen.extend)
        vw.add_step_hook(steps.append)
        vw.add_step_hook(lambda step: 1 / 0 if step == 2 else None)  # a failing feature never reaches training
        vw.add_close_hook(closed.append)
        for step in range(4):
            vw.step(step)
        assert vw.flush(5)
        assert vw.close(5)
    assert steps == [0, 1, 2, 3]
    assert seen and seen[0].type == "capture" and seen[0].args == {"steps": 3}
    assert len(closed) == 1 and 0 < closed[0] <= 5
    assert vw.stats()["hook_errors"] == 1


def test_two_phases_of_one_name_at_one_step_are_numbered_when_the_wire_knows_seq(tmp_path):
    vw = hook.init(None, run="seq", probe="simulated", out_dir=tmp_path)
    vw.step(5)
    for _ in range(2):  # two checkpoint callbacks saving at the same step
        with vw.phase("checkpoint"):
            pass
    vw.step(6)
    with vw.phase("checkpoint"):
        pass
    assert vw.close(5)
    phases = [json.loads(line) for line in vw.trace_path.read_text().splitlines() if '"checkpoint"' in line]
    assert [p["step"] for p in phases] == [5, 5, 6]
    if "seq" in wire.FIELDS:
        assert [p.get("seq", 0) for p in phases] == [0, 1, 0]  # distinct idempotency keys
    else:  # the current collector would reject an unknown field: not sent yet
        assert all("seq" not in p for p in phases)


# ---------------------------------------------------------------- end markers for the post-mortem


def _trace(vw) -> list[dict]:
    return [json.loads(line) for line in vw.trace_path.read_text().splitlines()]


def test_a_clean_close_sends_one_copy_of_the_last_train_sample_marked_exit(tmp_path):
    vw = hook.init(None, run="exit", probe="simulated", out_dir=tmp_path)
    for step in range(3):
        vw.step(step)
    with vw.phase("checkpoint"):  # the copy is of the last *train* sample, not of this phase
        pass
    assert vw.close(5)
    samples = _trace(vw)
    assert len(samples) == 6 and vw.stats()["samples"] == 6  # 3 steps, the phase's opening, the phase, the exit
    opened, last = samples[3], samples[-1]
    assert (opened["step"], opened["phase"], opened["seq"], opened["phase_open"]) == (2, "train", 1, True)
    assert (last["step"], last["phase"], last["seq"], last["exit"]) == (2, "train", 2, True)
    assert "phase_open" not in last and "exit" not in opened
    assert last["allocated_bytes"] == samples[2]["allocated_bytes"] and last["ts"] >= samples[4]["ts"]
    assert not any(s.get("exit") for s in samples[:-1])
    assert len({(s["step"], s["phase"], s.get("seq", 0)) for s in samples}) == 6  # distinct idempotency keys
    never = hook.init(None, run="never-stepped", probe="simulated", out_dir=tmp_path / "never")
    assert never.close(5) and never.stats()["samples"] == 0  # nothing recorded: nothing to mark


def test_mark_oom_sends_a_fresh_marked_sample_and_a_monitor_that_never_started_marks_nothing(tmp_path):
    vw = hook.init(None, run="oom-mark", probe="simulated", out_dir=tmp_path)
    vw.step(0)
    vw.step(1)
    vw.mark_oom()
    assert vw.close(5)
    samples = _trace(vw)
    marked = [s for s in samples if s.get("oom_marked")]
    assert len(marked) == 1 and marked[0]["step"] == 1 and marked[0]["seq"] == 1
    assert (samples[-1]["seq"], samples[-1]["exit"]) == (2, True) and "oom_marked" not in samples[-1]
    off = hook.init(None, run="off", probe="none", out_dir=tmp_path / "off")
    off.mark_oom()
    assert off.close(1) and off.stats()["samples"] == 0


@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_the_exit_handler_marks_a_clean_end_but_not_a_death_by_exception(tmp_path, ending):
    script = textwrap.dedent(f"""
        import vramwatch
        vw = vramwatch.init(None, run="atexit-{ending}", probe="simulated", out_dir={str(tmp_path)!r})
        for step in range(3):
            vw.step(step)
        if {ending == "raises"!r}:
            raise RuntimeError("NaN loss")  # unhandled: the exit handler still flushes
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == (1 if ending == "raises" else 0), result.stderr
    (trace,) = (tmp_path / f"atexit-{ending}").glob("*.jsonl")
    samples = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [s["step"] for s in samples if not s.get("exit") and not s.get("last_words_type")] == [0, 1, 2]
    assert sum(bool(s.get("exit")) for s in samples) == (1 if ending == "returns" else 0)
    said = [(s["last_words_type"], s["last_words_message"]) for s in samples if s.get("last_words_type")]
    assert said == ([("RuntimeError", "NaN loss")] if ending == "raises" else [])  # flushed by the exit handler
