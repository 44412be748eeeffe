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

from vramwatch import probe as probe_mod
from vramwatch.probe import NoProbeWarning, make_probe
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


def probe_with(cuda: FakeCuda, *, peak: str = "reset", nvml=None, env=None) -> TorchCudaProbe:
    return TorchCudaProbe(0, peak=peak, cuda=cuda, pynvml=nvml, nvml=nvml is not None, env=env or {},
                          nvml_interval_s=0.05)


def as_wire(reading: dict, step: int = 0, phase: str = "train") -> dict:
    sample = {"schema": 1, "run": "r", "host": "h", "rank": 0, "step": step, "ts": time.time(), "phase": phase}
    sample.update(reading)
    return validate(sample)


# ---------------------------------------------------------------- torch probe


def test_one_memory_stats_call_per_step_and_fields_picked_from_it():
    cuda = FakeCuda()
    probe = probe_with(cuda)
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


def test_reset_policy_gives_exact_per_step_peaks_and_keeps_the_run_long_max():
    cuda = FakeCuda()
    probe = probe_with(cuda, peak="reset")
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


def test_never_policy_does_not_touch_the_counter_and_reports_new_highs_exactly():
    cuda = FakeCuda()
    cuda.alloc(4 * GiB)
    probe = probe_with(cuda, peak="never")
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
def test_phase_sample_carries_the_peak_during_the_phase(policy):
    cuda = FakeCuda()
    cuda.alloc(4 * GiB)
    probe = probe_with(cuda, peak=policy)
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


def test_nested_phases_each_get_their_own_peak():
    cuda = FakeCuda()
    cuda.alloc(GiB)
    probe = probe_with(cuda)
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


def test_bad_peak_policy_names_the_argument():
    with pytest.raises(ValueError, match="peak"):
        probe_with(FakeCuda(), peak="sometimes")


def test_no_cuda_here_is_one_clear_warning_and_no_probe(monkeypatch):
    monkeypatch.setattr(probe_mod, "_warned", set())
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
    probe = TorchCudaProbe(0, cuda=cuda, env={})  # nvml=True, but none to be had
    reading = probe.read(1)
    assert probe.poller is None and reading["nvml_used_bytes"] is None
    assert "process_used_bytes" not in reading


def test_nvml_poller_runs_off_the_training_thread_and_reading_is_attached():
    nv = make_pynvml(machine())
    cuda = FakeCuda(uuid=UUID1)
    cuda.alloc(20 * GiB)
    probe = probe_with(cuda, nvml=nv)
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
        assert poller.stats()["nvml_errors"] == 1 and "GPUIsLost" in poller.stats()["nvml_last_error"]
        polls = nv.calls["nvmlDeviceGetMemoryInfo"]
        time.sleep(0.1)
        assert nv.calls["nvmlDeviceGetMemoryInfo"] == polls  # stopped
    finally:
        poller.close()


def test_torch_uuid_in_its_various_shapes():
    class CUuuid:  # torch's _CUuuid: str() may or may not be the uuid, .bytes are the 16 raw bytes
        bytes = bytes(range(16))

        def __str__(self) -> str:
            return "<torch._C._CUuuid object at 0x7f>"

    assert uuid_text(CUuuid()) == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert uuid_text(UUID1) == UUID1
    assert uuid_text(f"MIG-{UUID2}") == f"MIG-{UUID2}"
    assert uuid_text("garbage") is None and uuid_text(None) is None
    cuda = FakeCuda(uuid=UUID1)
    assert probe_with(cuda).device_info()["uuid"] == f"GPU-{UUID1}"  # no NVML: torch's own uuid
