"""Torch-CUDA and NVML probe code paths through fakes at the seam (no GPU here)."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings

import pytest
from fakes.fake_cuda import FakeCuda, GiB
from fakes.fake_pynvml import FakeGpu, make_pynvml

from vramwatch.probe import NoProbeWarning, make_probe
from vramwatch.probe import base as probe_base
from vramwatch.probe.nvml import NvmlPoller, normalize_uuid, open_device
from vramwatch.probe.torch_cuda import NoCudaError, TorchCudaProbe, load_torch_cuda, uuid_text
from vramwatch.wire import validate

UUID0 = "11111111-aaaa-bbbb-cccc-000000000000"
UUID1 = "22222222-aaaa-bbbb-cccc-000000000001"
UUID2 = "33333333-aaaa-bbbb-cccc-000000000002"


def machine(pid: int | None = None) -> list[FakeGpu]:
    pid = os.getpid() if pid is None else pid
    return [
        FakeGpu(f"GPU-{UUID0}", used=5 * GiB),
        FakeGpu(f"GPU-{UUID1}", used=30 * GiB, processes={pid: 24 * GiB, 4242: 3 * GiB}),
        FakeGpu(f"GPU-{UUID2}", used=7 * GiB),
    ]


def probe_with(monkeypatch, cuda: FakeCuda, *, peak: str = "reset", nvml=None, env=None) -> TorchCudaProbe:
    """The real probe over torch's own ``torch.cuda`` code; only the C++ entry points are the fake's."""
    torch_cuda = cuda.install(monkeypatch)
    return TorchCudaProbe(0, peak=peak, cuda=torch_cuda, pynvml=nvml, nvml=nvml is not None, env=env or {},
                          nvml_interval_s=0.05)


def as_wire(reading: dict, step: int = 0, phase: str = "train") -> dict:
    sample = {"schema": 1, "run": "r", "host": "h", "rank": 0, "step": step, "ts": time.time(), "phase": phase}
    sample.update(reading)
    return validate(sample)


# ---------------------------------------------------------------- torch probe


def test_one_memory_stats_call_per_step_and_fields_picked_from_it(monkeypatch):
    cuda = FakeCuda()
    probe = probe_with(monkeypatch, cuda)
    cuda.alloc(10 * GiB)
    cuda.reserved = 12 * GiB
    cuda.inactive_split = GiB // 2
    cuda.active_extra = GiB // 4
    cuda.retries, cuda.ooms = 3, 1
    before = cuda.stats_calls
    reading = probe.read(1, "train")
    assert cuda.stats_calls - before == 1
    for step in range(2, 12):
        probe.read(step, "train")
    assert cuda.stats_calls - before == 11
    assert reading["allocated_bytes"] == 10 * GiB
    assert reading["reserved_bytes"] == 12 * GiB
    assert reading["active_bytes"] == 10 * GiB + GiB // 4
    assert reading["inactive_split_bytes"] == GiB // 2
    assert (reading["alloc_retries"], reading["ooms"]) == (3, 1)
    assert reading["total_bytes"] == 80 * GiB
    assert reading["nvml_used_bytes"] is None  # no NVML: unknown, never a fake zero
    as_wire(reading)


def test_reset_policy_gives_exact_per_step_peaks_and_keeps_the_run_long_max(monkeypatch):
    cuda = FakeCuda()
    probe = probe_with(monkeypatch, cuda, peak="reset")
    cuda.alloc(4 * GiB)  # weights
    peaks = []
    for activations in (6, 2, 9, 3):
        cuda.alloc(activations * GiB)
        cuda.free(activations * GiB)
        peaks.append(probe.read(0, "train")["peak_allocated_bytes"])
    assert peaks == [10 * GiB, 6 * GiB, 13 * GiB, 7 * GiB]
    assert cuda.reset_calls >= 4
    # other tools now see a per-step peak from torch, so the probe keeps the real one
    assert probe.max_allocated_bytes == 13 * GiB
    assert cuda.peak == 4 * GiB


def test_never_policy_does_not_touch_the_counter_and_reports_new_highs_exactly(monkeypatch):
    cuda = FakeCuda()
    cuda.alloc(4 * GiB)
    probe = probe_with(monkeypatch, cuda, peak="never")
    cuda.alloc(6 * GiB)
    cuda.free(6 * GiB)
    first = probe.read(1, "train")
    cuda.alloc(2 * GiB)
    cuda.free(2 * GiB)
    second = probe.read(2, "train")  # below the all-time high: lower bound only
    cuda.alloc(9 * GiB)
    cuda.free(9 * GiB)
    third = probe.read(3, "train")
    assert cuda.reset_calls == 0
    assert first["peak_allocated_bytes"] == 10 * GiB
    assert second["peak_allocated_bytes"] == 4 * GiB  # max(previous allocated, allocated)
    assert third["peak_allocated_bytes"] == 13 * GiB
    for r in (first, second, third):
        assert r["peak_allocated_bytes"] >= r["allocated_bytes"]


@pytest.mark.parametrize("policy", ["reset", "never"])
def test_phase_sample_carries_the_peak_during_the_phase(policy, monkeypatch):
    cuda = FakeCuda()
    cuda.alloc(4 * GiB)
    probe = probe_with(monkeypatch, cuda, peak=policy)
    cuda.alloc(3 * GiB)  # activations of step 1
    cuda.free(3 * GiB)
    probe.read(1, "train")
    cuda.alloc(5 * GiB)  # between the step and the checkpoint: belongs to the next train sample
    cuda.free(5 * GiB)
    probe.begin_phase("checkpoint")
    cuda.alloc(20 * GiB)  # state-dict gather
    cuda.free(20 * GiB)
    phase = probe.end_phase(1, "checkpoint")
    cuda.alloc(1 * GiB)
    cuda.free(1 * GiB)
    after = probe.read(2, "train")
    assert phase["peak_allocated_bytes"] == 24 * GiB
    assert after["peak_allocated_bytes"] == 9 * GiB  # the pre-phase 5 GiB bump is not lost
    as_wire(phase, step=1, phase="checkpoint")


def test_nested_phases_each_get_their_own_peak(monkeypatch):
    cuda = FakeCuda()
    cuda.alloc(GiB)
    probe = probe_with(monkeypatch, cuda)
    probe.begin_phase("eval")
    cuda.alloc(2 * GiB)
    cuda.free(2 * GiB)
    probe.begin_phase("checkpoint")
    cuda.alloc(5 * GiB)
    cuda.free(5 * GiB)
    inner = probe.end_phase(0, "checkpoint")
    outer = probe.end_phase(0, "eval")
    assert inner["peak_allocated_bytes"] == 6 * GiB
    assert outer["peak_allocated_bytes"] == 6 * GiB
    assert probe.read(1)["peak_allocated_bytes"] == GiB


def test_bad_peak_policy_names_the_argument(monkeypatch):
    with pytest.raises(ValueError, match="peak"):
        probe_with(monkeypatch, FakeCuda(), peak="sometimes")


def test_no_cuda_here_is_one_clear_warning_and_no_probe(monkeypatch):
    monkeypatch.setattr(probe_base, "_warned", set())
    with pytest.raises(NoCudaError, match="no CUDA device"):
        load_torch_cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert make_probe("auto") is None
        assert make_probe("torch") is None
    messages = [str(w.message) for w in caught if issubclass(w.category, NoProbeWarning)]
    assert len(messages) == 1
    assert "no CUDA device" in messages[0] and "simulated" in messages[0]


def test_probe_choice_by_name_and_environment(monkeypatch):
    monkeypatch.setenv("VRAMWATCH_PROBE", "simulated")
    chosen = make_probe(None, rank=3)
    assert chosen is not None and chosen.name == "simulated" and chosen.device_info()["gpu"] == 3
    assert chosen.scenario == "healthy"
    monkeypatch.setenv("VRAMWATCH_SIM_SCENARIO", "fast_leak")
    assert make_probe("simulated").scenario == "fast_leak"
    assert make_probe("none") is None
    assert make_probe(chosen) is chosen
    with pytest.raises(ValueError, match="probe: must be one of"):
        make_probe("cuda")


# ---------------------------------------------------------------- NVML


def test_uuid_normalisation():
    assert normalize_uuid("GPU-ABCD-12") == "abcd-12"
    assert normalize_uuid(b"MIG-abcd\0") == "abcd"
    assert normalize_uuid("abcd") == "abcd"


def test_torch_device_maps_to_nvml_handle_by_uuid_despite_renumbering():
    nv = make_pynvml(machine())
    # CUDA_VISIBLE_DEVICES=1 makes physical GPU 1 torch's cuda:0; torch reports its uuid
    device = open_device(0, torch_uuid=UUID1, env={"CUDA_VISIBLE_DEVICES": "1"}, pynvml=nv)
    assert device is not None and device.uuid == f"GPU-{UUID1}"
    reading = device.read()
    assert reading.used_bytes == 30 * GiB
    assert reading.process_used_bytes == 24 * GiB  # only this pid, not pid 4242


def test_gpu_is_the_hosts_nvml_index_not_torchs_renumbered_one(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=2 torch's cuda:0 is the host's GPU 2: the samples' ``gpu`` (the
    /metrics label) is 2, as nvidia-smi and dcgm-exporter number it; without NVML, torch's index."""
    cuda = FakeCuda(uuid=UUID2)
    cuda.alloc(GiB)
    probe = probe_with(monkeypatch, cuda, nvml=make_pynvml(machine()), env={"CUDA_VISIBLE_DEVICES": "2"})
    try:
        info = probe.device_info()
        assert (info["gpu"], info["uuid"]) == (2, f"GPU-{UUID2}")
    finally:
        probe.close()
    without = probe_with(monkeypatch, FakeCuda(uuid=UUID2), env={"CUDA_VISIBLE_DEVICES": "2"})
    assert without.device_info()["gpu"] == 0


def test_cuda_visible_devices_without_uuid_indices_and_uuid_prefixes():
    nv = make_pynvml(machine())
    by_index = open_device(1, env={"CUDA_VISIBLE_DEVICES": "2,0"}, pynvml=nv)
    assert by_index is not None and by_index.uuid == f"GPU-{UUID0}"
    by_prefix = open_device(0, env={"CUDA_VISIBLE_DEVICES": "GPU-33333333"}, pynvml=nv)
    assert by_prefix is not None and by_prefix.uuid == f"GPU-{UUID2}"
    plain = open_device(2, env={}, pynvml=nv)
    assert plain is not None and plain.uuid == f"GPU-{UUID2}"
    assert open_device(3, env={"CUDA_VISIBLE_DEVICES": "0,1"}, pynvml=nv) is None  # not visible


def test_mig_device_found_by_its_mig_uuid():
    mig_uuid = "MIG-44444444-aaaa-bbbb-cccc-000000000009"
    gpus = machine()
    gpus[2].mig = [FakeGpu("MIG-55555555-0000-0000-0000-000000000000", total=20 * GiB, used=GiB),
                   FakeGpu(mig_uuid, name="NVIDIA H200 MIG 3g.71gb", total=71 * GiB, used=9 * GiB,
                           process_list_supported=False)]
    nv = make_pynvml(gpus)
    device = open_device(0, torch_uuid="44444444-aaaa-bbbb-cccc-000000000009",
                         env={"CUDA_VISIBLE_DEVICES": mig_uuid}, pynvml=nv)
    assert device is not None and device.is_mig and device.uuid == mig_uuid
    reading = device.read()
    assert (reading.used_bytes, reading.total_bytes) == (9 * GiB, 71 * GiB)
    assert reading.process_used_bytes is None  # not available under MIG here: unknown, not 0
    # without torch's uuid the CUDA_VISIBLE_DEVICES entry (a MIG uuid) still resolves
    again = open_device(0, env={"CUDA_VISIBLE_DEVICES": mig_uuid}, pynvml=nv)
    assert again is not None and again.uuid == mig_uuid


def test_nvml_missing_or_not_loading_means_null_not_zero(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert open_device(0, torch_uuid=UUID0, env={}) is None
    assert open_device(0, env={}, pynvml=make_pynvml(machine(), init_fails=True)) is None
    cuda = FakeCuda()
    cuda.alloc(GiB)
    probe = TorchCudaProbe(0, cuda=cuda.install(monkeypatch), env={})  # nvml=True, but none to be had
    reading = probe.read(1)
    assert probe.poller is None and reading["nvml_used_bytes"] is None
    assert "process_used_bytes" not in reading


def test_nvml_poller_runs_off_the_training_thread_and_reading_is_attached(monkeypatch):
    nv = make_pynvml(machine())
    cuda = FakeCuda(uuid=UUID1)
    cuda.alloc(20 * GiB)
    probe = probe_with(monkeypatch, cuda, nvml=nv)
    try:
        deadline = time.monotonic() + 5
        while probe.poller.latest is None and time.monotonic() < deadline:
            time.sleep(0.01)
        reading = probe.read(1)
        training_thread = threading.current_thread().name
        polled_here = [fn for (fn, thread) in nv.callers if thread == training_thread]
        assert "nvmlDeviceGetMemoryInfo" not in polled_here  # never on the training thread...
        assert "nvmlDeviceGetComputeRunningProcesses" not in polled_here
        assert nv.callers[("nvmlDeviceGetMemoryInfo", "vramwatch-nvml")] >= 1
        assert reading["nvml_used_bytes"] == 30 * GiB
        assert reading["process_used_bytes"] == 24 * GiB
        stats = probe.stats()  # the process list itself: in stats, polled, never per step
        assert sorted(p["pid"] for p in stats["gpu_processes"]) == sorted([os.getpid(), 4242])
        assert stats["foreign_used_bytes"] == 3 * GiB
        assert probe.device_info()["uuid"] == f"GPU-{UUID1}"
        time.sleep(0.2)
        assert probe.poller.polls >= 3  # ...the poller thread did, every 50 ms
    finally:
        probe.close()


def test_gpu_lost_publishes_none_counts_the_error_and_stops_polling():
    gpus = machine()
    nv = make_pynvml(gpus)
    device = open_device(0, torch_uuid=UUID1, env={}, pynvml=nv)
    poller = NvmlPoller(device, interval_s=0.02)
    try:
        deadline = time.monotonic() + 5
        while poller.latest is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert poller.latest is not None
        gpus[1].lost = True
        deadline = time.monotonic() + 5
        while not poller.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert poller.lost and poller.latest is None
        assert poller.stats()["nvml_errors"] == 1 and "GpuIsLost" in poller.stats()["nvml_last_error"]
        polls = nv.calls["nvmlDeviceGetMemoryInfo"]
        time.sleep(0.1)
        assert nv.calls["nvmlDeviceGetMemoryInfo"] == polls  # stopped
    finally:
        poller.close()


def test_torch_uuid_in_its_various_shapes(monkeypatch):
    class CUuuid:  # torch's _CUuuid: str() may or may not be the uuid, .bytes are the 16 raw bytes
        bytes = bytes(range(16))

        def __str__(self) -> str:
            return "<torch._C._CUuuid object at 0x7f>"

    assert uuid_text(CUuuid()) == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert uuid_text(UUID1) == UUID1
    assert uuid_text(f"MIG-{UUID2}") == f"MIG-{UUID2}"
    assert uuid_text("garbage") is None and uuid_text(None) is None
    cuda = FakeCuda(uuid=UUID1)
    assert probe_with(monkeypatch, cuda).device_info()["uuid"] == f"GPU-{UUID1}"  # no NVML: torch's own uuid


# ---------------------------------------------------------------- the nested-stats read


def test_the_probe_reads_the_nested_dict_and_never_falls_back_to_memory_stats(monkeypatch):
    """memory_stats() flattens and sorts in Python on every call (~8x the nested read)."""
    import torch

    cuda = FakeCuda()
    probe = probe_with(monkeypatch, cuda)

    def forbidden(*args, **kwargs):
        raise AssertionError("the probe called torch.cuda.memory_stats(): flatten + sort on every step")

    for target in (torch.cuda, torch.cuda.memory):
        for name in ("memory_stats", "memory_allocated", "memory_reserved", "max_memory_allocated"):
            monkeypatch.setattr(target, name, forbidden)
    cuda.alloc(3 * GiB)
    before = cuda.stats_calls
    readings = [probe.read(step) for step in range(5)]
    with probe_phase(probe, "checkpoint"):
        cuda.alloc(GiB)
    assert cuda.stats_calls - before == 5 + 2  # one C++ stats call per read, two per phase
    assert readings[-1]["allocated_bytes"] == 3 * GiB and probe.stats()["max_allocated_bytes"] == 4 * GiB


class probe_phase:
    def __init__(self, probe, name):
        self.probe, self.name = probe, name

    def __enter__(self):
        self.probe.begin_phase(self.name)

    def __exit__(self, *exc):
        self.reading = self.probe.end_phase(0, self.name)


def test_the_probe_agrees_with_torchs_own_flattened_memory_stats(monkeypatch):
    import torch

    cuda = FakeCuda()
    probe = probe_with(monkeypatch, cuda, peak="never")
    cuda.alloc(7 * GiB)
    cuda.reserved = 9 * GiB
    cuda.inactive_split = 123 * 2**20
    cuda.retries, cuda.ooms = 2, 1
    reading = probe.read(1)
    flat = torch.cuda.memory_stats(0)  # torch's real flatten + sort over the same C++ entry point
    assert reading["allocated_bytes"] == flat["allocated_bytes.all.current"]
    assert reading["reserved_bytes"] == flat["reserved_bytes.all.current"]
    assert reading["active_bytes"] == flat["active_bytes.all.current"]
    assert reading["inactive_split_bytes"] == flat["inactive_split_bytes.all.current"]
    assert (reading["alloc_retries"], reading["ooms"]) == (flat["num_alloc_retries"], flat["num_ooms"])
    assert torch.cuda.max_memory_allocated(0) == 7 * GiB  # torch's own API sees the fake's peak


def test_the_stats_fixture_has_the_real_shape():
    """Every key torch's memory_stats() docstring promises is in the fixture, with its pools."""
    import torch
    from fakes.fake_cuda import load_fixture

    nested = load_fixture()
    documented = torch.cuda.memory_stats.__doc__
    for stat in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "segment",
                 "active", "inactive_split", "requested_bytes"):
        assert f'"{stat}.{{all,large_pool,small_pool}}' in documented
        assert set(nested[stat]) == {"all", "small_pool", "large_pool"}
        for pool in nested[stat].values():
            assert set(pool) == {"current", "peak", "allocated", "freed"}
            assert pool["peak"] >= pool["current"] >= 0
    for counter in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"):
        assert f'"{counter}"' in documented and isinstance(nested[counter], int)
    all_alloc = nested["allocated_bytes"]["all"]
    assert all_alloc["current"] == sum(nested["allocated_bytes"][p]["current"] for p in ("small_pool", "large_pool"))


def test_before_cuda_initialisation_the_probe_reports_true_zeros(monkeypatch):
    import torch

    cuda = FakeCuda()
    probe = probe_with(monkeypatch, cuda)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: False)  # nested dict is {} then
    reading = probe.read(1)
    assert reading["allocated_bytes"] == reading["reserved_bytes"] == reading["peak_allocated_bytes"] == 0
    as_wire(reading)


# ---------------------------------------------------------------- honest fakes


def test_every_pynvml_name_the_fake_defines_exists_in_nvidia_ml_py_with_a_compatible_signature():
    import inspect

    import pynvml as real  # nvidia-ml-py

    fake = make_pynvml(machine())
    names = [n for n in vars(fake) if n.startswith(("nvml", "NVML"))]
    assert len(names) > 15
    for name in names:
        assert hasattr(real, name), f"the fake defines pynvml.{name}, which nvidia-ml-py does not have"
        ours, theirs = getattr(fake, name), getattr(real, name)
        if inspect.isfunction(theirs):
            real_params = list(inspect.signature(theirs).parameters.values())
            fake_params = list(inspect.signature(ours).parameters.values())
            assert [p.name for p in fake_params] == [p.name for p in real_params], name
            assert [p.default is p.empty for p in fake_params] == [p.default is p.empty for p in real_params], name
        elif isinstance(theirs, int):
            assert ours == theirs, name
        elif isinstance(theirs, type):
            assert issubclass(ours, Exception) and ours.__name__ == theirs.__name__
    # process entries carry the real structure's field names (what nvmlStructToFriendlyObject copies)
    from fakes.fake_pynvml import PROCESS_INFO_FIELDS

    assert tuple(name for name, _ in real.c_nvmlProcessInfo_t._fields_) == PROCESS_INFO_FIELDS
    gpu = machine()[1]
    for fn in (fake.nvmlDeviceGetComputeRunningProcesses, fake.nvmlDeviceGetGraphicsRunningProcesses):
        gpu.graphics = {77: GiB}
        assert all(set(vars(p)) == set(PROCESS_INFO_FIELDS) for p in fn(gpu))
    # errors behave alike: NVMLError(value) is the registered subclass and carries .value
    lost_real, lost_fake = real.NVMLError(real.NVML_ERROR_GPU_IS_LOST), fake.NVMLError(fake.NVML_ERROR_GPU_IS_LOST)
    assert type(lost_real).__name__ == type(lost_fake).__name__ == "NVMLError_GpuIsLost"
    assert lost_real.value == lost_fake.value == 15


def test_the_process_list_splits_this_process_from_foreign_ones():
    gpus = machine()
    nv = make_pynvml(gpus)
    device = open_device(0, torch_uuid=UUID1, env={}, pynvml=nv)
    reading = device.read()
    assert reading.process_used_bytes == 24 * GiB
    assert reading.foreign_used_bytes == 3 * GiB  # pid 4242: a stale notebook kernel, say
    assert {p.pid for p in reading.processes} == {os.getpid(), 4242}
    # another PID namespace (a container): our pid is not listed, so nothing can be called foreign
    gpus[1].processes = {1: 20 * GiB, 7: GiB}
    other = device.read()
    assert other.process_used_bytes is None and other.foreign_used_bytes is None
    gpus[1].process_list_supported = False
    assert device.read().foreign_used_bytes is None


def test_mig_instance_memory_is_the_instance_not_the_whole_gpu():
    gpus = machine()
    gpus[0].mig = [FakeGpu("MIG-66666666-0000-0000-0000-000000000001", total=18 * GiB, used=5 * GiB,
                           processes={os.getpid(): 4 * GiB, 99: GiB})]
    nv = make_pynvml(gpus)
    device = open_device(0, env={"CUDA_VISIBLE_DEVICES": "MIG-66666666"}, pynvml=nv)
    reading = device.read()
    assert device.is_mig
    assert (reading.used_bytes, reading.total_bytes) == (5 * GiB, 18 * GiB)
    assert (reading.process_used_bytes, reading.foreign_used_bytes) == (4 * GiB, GiB)


def test_one_host_poller_per_process_shared_by_every_monitor():
    from vramwatch.probe import host

    before = sum(t.name == "vramwatch-host" for t in threading.enumerate())
    first = host.HostPoller.start(0.05, pinned=lambda: 4096)
    second = host.HostPoller.start(0.05)
    try:
        assert first is second and first.users == 2
        assert sum(t.name == "vramwatch-host" for t in threading.enumerate()) == before + 1
        deadline = time.monotonic() + 5
        while first.polls < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.polls >= 3 and first.latest["host_pinned_bytes"] == 4096
        assert first.latest["host_rss_bytes"] > 0
    finally:
        first.release()
        assert first.users == 1 and first._thread.is_alive()  # the other monitor still uses it
        second.release()
    first._thread.join(2)
    assert not first._thread.is_alive() and first.users == 0


def test_every_test_module_holds_tests():
    """A helper named test_*.py is collected as a test module that tests nothing: name it plainly."""
    import ast
    from pathlib import Path

    here = Path(__file__).parents[1]
    empty = [str(path.relative_to(here)) for path in sorted(here.rglob("test_*.py"))
             if not any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
                        for node in ast.walk(ast.parse(path.read_text())))]
    assert not empty, f"test modules without tests: {empty}"


def test_a_phase_sample_carries_the_host_peak_of_the_phase_even_when_freed_before_it_ends():
    """A checkpoint that materialises a state dict on the host and frees it: the phase's RSS peak."""
    from vramwatch.probe import host

    poller = host.HostPoller.start(60.0)
    try:
        baseline = poller.poll_once()["host_rss_bytes"]
        poller.begin_phase()
        blob = bytearray(300 * 2**20)  # touched pages: resident
        blob[:: 4096] = b"x" * len(blob[:: 4096])
        del blob  # freed (unmapped) before the phase ends
        after = poller.poll_once()["host_rss_bytes"]
        phase = poller.end_phase()
    finally:
        poller.release()
    assert after < baseline + 100 * 2**20  # the current RSS no longer shows it...
    assert phase["host_rss_bytes"] >= baseline + 250 * 2**20  # ...the phase's peak does
    assert poller.stats()["host_rss_max_bytes"] >= phase["host_rss_bytes"]


def test_a_users_probe_gets_the_whole_protocol_and_keeps_its_own_attributes():
    from vramwatch.probe import BaseProbe, as_probe

    class Minimal:  # only what a user must write
        name = "mine"
        max_allocated_bytes = 7

        def device_info(self):
            return {"gpu": 0}

        def read(self, step, phase="train"):
            return {"allocated_bytes": step}

        def special(self):
            return "kept"

    probe = as_probe(Minimal())
    assert isinstance(probe, BaseProbe) and probe.name == "mine"
    probe.begin_phase("checkpoint")  # no-op default
    assert probe.end_phase(3, "checkpoint") == {"allocated_bytes": 3}  # default: one more read
    assert (probe.stats(), probe.pinned_host_bytes(), probe.max_allocated_bytes) == ({}, None, 7)
    assert probe.special() == "kept"
    with pytest.raises(ValueError, match="probe: must be one of"):
        as_probe(object())
