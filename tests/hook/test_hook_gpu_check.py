"""bench/gpu_check: fails clearly without a GPU; its plumbing and checks run on CPU."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check"
ENV = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           PYTHONWARNINGS="ignore")
GiB = 1024**3


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def test_script_is_executable_with_a_python_shebang():
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")


def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    result = run_script()
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("gpu_check: no CUDA device")


def test_bad_arguments_exit_2():
    result = run_script("--seconds", "500")
    assert result.returncode == 2 and "--seconds" in result.stderr


def test_cpu_dry_run_exercises_every_run_through_the_collector(tmp_path):
    result = run_script("--cpu-dry-run", "--seconds", "1", "--out", str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for kind in ("clean", "leak", "checkpoint", "fragment"):
        assert f"== {kind}:" in result.stdout
    assert "delivered all: True" in result.stdout and "[FAIL]" not in result.stdout
    assert "phase samples" in result.stdout  # the checkpoint run recorded checkpoint phases
    assert "all strict checks hold" in result.stdout


def test_the_checks_catch_impossible_samples():
    module = runpy.run_path(str(SCRIPT), run_name="gpu_check_module")
    base = {"phase": "train", "allocated_bytes": 10 * GiB, "reserved_bytes": 12 * GiB,
            "peak_allocated_bytes": 11 * GiB, "total_bytes": 80 * GiB, "nvml_used_bytes": 13 * GiB,
            "process_used_bytes": 12 * GiB + GiB // 2, "inactive_split_bytes": 0, "alloc_retries": 0}
    good = [dict(base, step=i, ts=1000.0 + i * 0.5) for i in range(8)]
    checks = module["check_samples"](good)
    assert all(bad == 0 for _checked, bad in checks["counts"].values())
    assert checks["counts"]["reserved<=nvml_used(stable)"][0] > 0 and checks["context"][0] == GiB // 2
    broken = [dict(good[0], allocated_bytes=13 * GiB), dict(good[1], peak_allocated_bytes=GiB),
              dict(good[2], nvml_used_bytes=81 * GiB)]
    counts = module["check_samples"](broken)["counts"]
    assert counts["allocated<=reserved"][1] == 1
    assert counts["peak>=allocated"][1] == 2  # the first (peak 11 < allocated 13) and the second
    assert counts["nvml_used<=total"][1] == 1


def test_the_device_cost_rows_run_through_torchs_own_code(monkeypatch, tmp_path):
    """gpu_check's probe-cost rows on CPU, over the fake C++ entry points (the GPU run uses the same code)."""
    import torch
    from fakes.fake_cuda import FakeCuda

    import vramwatch.hook as hook

    module = runpy.run_path(str(SCRIPT), run_name="gpu_check_module")
    fake = FakeCuda()
    fake.install(monkeypatch)
    fake.alloc(GiB)
    vw = hook.init(None, run="cost", probe="torch", out_dir=tmp_path, spool_dir=tmp_path / "spool")
    assert vw.stats()["probe"] == "torch"
    cost = module["probe_cost"](torch, vw, calls=200, rounds=2)
    assert vw.close(10) and vw.stats()["samples"] == 200 + 1  # 2 rounds of 100, the exit marker
    assert set(cost) == {"floor", "memory_stats()", "probe.read()", "vw.step()"}
    assert cost["memory_stats()"] > cost["floor"] > 0  # flatten + sort costs more than the nested read


def test_the_leak_site_check_names_the_leaking_line_and_nothing_else(tmp_path):
    """gpu_check's leak-site check on CPU: snapshots in torch's shape whose frames are the ones
    the device run records (the leaking line of the script), through the same safe load and diff."""
    import torch
    from fakes.fake_snapshot import TORCH_DIR, Alloc, build_snapshot, frame

    module = runpy.run_path(str(SCRIPT), run_name="gpu_check_module")
    file, line, function = module["leak_site"]()
    assert "kept.append(torch.empty(LEAK_BYTES" in Path(file).read_text().splitlines()[line - 1]
    leak = module["LEAK_BYTES"]
    caller = [frame(file, 520, "leak_site_check"), frame(file, 700, "main"), frame(file, 760, "<module>")]
    at_line = [frame(file, line, function), *caller]
    scratch = [frame(file, line + 1, function), *caller]

    def snap(kept: int, scratch_size: int) -> dict:
        allocs = [Alloc(leak, at_line) for _ in range(kept)] + [Alloc(scratch_size, scratch, "inactive")]
        return build_snapshot([*allocs, Alloc(64 * 2**20, [frame(f"{TORCH_DIR}/nn/modules/module.py", 1, "to")])])

    ok, text = module["check_leak_diff"](snap(5, 3 * leak), snap(25, 3 * leak + 4096 * 25), steps=20,
                                         workdir=tmp_path)
    assert ok, text
    assert f"{file}:{line} in {function}: +40.0 MiB in +20 blocks" in text
    assert not module["check_leak_diff"](snap(5, leak), snap(24, leak), steps=20, workdir=tmp_path)[0]
    elsewhere = [frame(file, line - 3, function), *caller]
    moved = build_snapshot([Alloc(leak, elsewhere) for _ in range(25)])
    assert not module["check_leak_diff"](snap(5, leak), moved, steps=20, workdir=tmp_path)[0]
    kept: list = []
    module["leak_workload"](torch, "cpu", 3, kept)  # the workload itself runs anywhere
    assert len(kept) == 3 and all(t.numel() == leak for t in kept)
