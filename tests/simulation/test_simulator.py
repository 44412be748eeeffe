"""The scenario-driven allocator simulator: wire validity, invariants, determinism, stories."""

from __future__ import annotations

import pytest

from vramwatch import wire
from vramwatch.probe.simulated import (
    H200_TOTAL_BYTES,
    SCENARIOS,
    SimulatedProbe,
    scenario_params,
    scenario_truth,
    simulate_trace,
)

GB = 1e9
#: the operator's notes divide nvidia-smi's MiB by 1000 ("127.6GB / 143.8GB" on an H200 of 143771 MiB)
NOTES_GB = 1000 * 2**20


def train(samples: list[dict]) -> list[dict]:
    return [s for s in samples if s["phase"] == "train"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenario_emits_valid_schema1_samples(scenario: str) -> None:
    samples = list(simulate_trace(scenario, steps=1500, seed=4, rank=5 if scenario == "demo" else 0))
    assert samples
    for sample in samples:
        assert wire.validate(sample) == sample  # already normalised, nothing to fix
        assert sample["allocated_bytes"] <= sample["reserved_bytes"] <= sample["nvml_used_bytes"]
        assert sample["nvml_used_bytes"] <= sample["total_bytes"]
        assert sample["peak_allocated_bytes"] >= sample["allocated_bytes"]
        assert sample["active_bytes"] >= sample["allocated_bytes"]
    ts = [s["ts"] for s in samples]
    assert ts == sorted(ts)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = list(simulate_trace("fast_leak", steps=300, seed=1))
    b = list(simulate_trace("fast_leak", steps=300, seed=1))
    c = list(simulate_trace("fast_leak", steps=300, seed=2))
    assert a == b
    assert [s["allocated_bytes"] for s in a] != [s["allocated_bytes"] for s in c]
    p1, p2 = SimulatedProbe("healthy", seed=3), SimulatedProbe("healthy", seed=3)
    assert [p1.read(i) for i in range(1, 50)] == [p2.read(i) for i in range(1, 50)]


def test_probe_contract() -> None:
    probe = SimulatedProbe("demo", rank=9, seed=1)
    info = probe.device_info()
    assert info == {"uuid": info["uuid"], "gpu": 1, "total_bytes": H200_TOTAL_BYTES, "name": "Simulated H200",
                    "allocator": "native"}
    assert info["uuid"].startswith("GPU-sim-")
    assert SimulatedProbe("demo", rank=9, seed=1).device_info()["uuid"] == info["uuid"]
    assert SimulatedProbe("demo", rank=8, seed=1).device_info()["uuid"] != info["uuid"]
    assert SimulatedProbe("healthy", local_rank=3).device_info()["gpu"] == 3
    keys = {"allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "active_bytes", "inactive_split_bytes",
            "alloc_retries", "ooms", "total_bytes", "nvml_used_bytes", "process_used_bytes"}
    for step in range(1, 600):
        stats = probe.read(step)
        assert set(stats) == keys
        for phase in probe.phases_at(step):
            assert phase == "checkpoint" and step % 500 == 0
            ckpt = probe.read(step, phase)
            assert ckpt["peak_allocated_bytes"] > stats["peak_allocated_bytes"]
    assert probe.step_time_s == 0.1
    probe.close()
    assert probe.closed


def test_bad_scenario_or_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        SimulatedProbe("nope")
    with pytest.raises(ValueError, match="unknown simulator parameter 'leak_rat'"):
        simulate_trace("healthy", steps=1, leak_rat=1.0).__next__()
    with pytest.raises(ValueError, match="total_bytes"):
        SimulatedProbe(total_bytes=0)


def test_demo_plateau_near_the_kohrm_numbers_rank0_higher_rank5_leaks() -> None:
    used, allocated = {}, {}
    for rank in (0, 1, 5):
        samples = train(list(simulate_trace("demo", steps=2400, rank=rank, seed=0)))
        used[rank] = [s["nvml_used_bytes"] for s in samples]
        allocated[rank] = [s["allocated_bytes"] for s in samples]
    # plateau (after warm-up and the first checkpoint) near the notes' "127-130GB / 143.8GB",
    # which are nvidia-smi MiB / 1000 (the card is 143771 MiB)
    assert 126 * NOTES_GB < used[1][1000] < 129 * NOTES_GB
    assert 128 * NOTES_GB < used[0][1000] < 131 * NOTES_GB
    assert used[0][1000] - used[1][1000] == pytest.approx(2.3 * NOTES_GB, rel=0.3)
    assert abs(used[1][-1] - used[1][1000]) < 0.3 * NOTES_GB  # healthy rank stays put
    truth = scenario_truth("demo", rank=5)
    assert truth["leak"]["onset"] == 700
    rise = allocated[5][-1] - allocated[5][1000]
    expected = truth["leak"]["slope_bytes_per_step"] * (len(allocated[5]) - 1001)
    assert rise == pytest.approx(expected, rel=0.05)
    assert used[5][-1] - used[5][1000] > 0.5 * expected  # reserved and NVML follow, in ratchets
    assert scenario_truth("demo", rank=4)["leak"] is None


def test_checkpoint_ratchets_reserved_once() -> None:
    samples = list(simulate_trace("checkpoint", steps=4500, seed=2))
    reserved_after = {}
    for sample in samples:
        if sample["phase"] == "checkpoint":
            reserved_after[sample["step"]] = sample["reserved_bytes"]
    steps = sorted(reserved_after)
    assert steps == [1000, 2000, 3000, 4000]
    before_first = max(s["reserved_bytes"] for s in train(samples) if s["step"] < 1000)
    assert reserved_after[1000] - before_first > 0.02 * H200_TOTAL_BYTES
    assert reserved_after[4000] - reserved_after[1000] < 0.002 * H200_TOTAL_BYTES


def test_leak_to_oom_counts_the_oom_and_ends() -> None:
    samples = list(simulate_trace("leak_to_oom", steps=10_000, seed=1))
    last = samples[-1]
    assert last["ooms"] == 1 and last["alloc_retries"] >= 1
    assert all(s["ooms"] == 0 for s in samples[:-1])
    assert last["reserved_bytes"] <= last["total_bytes"] and last["nvml_used_bytes"] <= last["total_bytes"]
    assert last["step"] < 10_000


def test_fragmentation_grows_waste_with_allocated_flat_and_retries() -> None:
    samples = train(list(simulate_trace("fragmentation", steps=7000, seed=1)))
    at = {s["step"]: s for s in samples}
    early, late = at[1400], samples[-1]
    assert late["step"] > 5500
    assert abs(late["allocated_bytes"] - early["allocated_bytes"]) < 0.002 * H200_TOTAL_BYTES
    assert late["inactive_split_bytes"] - early["inactive_split_bytes"] > 0.1 * H200_TOTAL_BYTES
    assert late["alloc_retries"] > early["alloc_retries"] == 0


def test_outside_leak_moves_nvml_only() -> None:
    samples = train(list(simulate_trace("outside_leak", steps=4000, seed=1)))
    at = {s["step"]: s for s in samples}
    early, late = at[1400], at[4000]
    assert late["reserved_bytes"] - early["reserved_bytes"] < 0.002 * H200_TOTAL_BYTES
    outside = (late["nvml_used_bytes"] - late["reserved_bytes"]) - (early["nvml_used_bytes"] - early["reserved_bytes"])
    assert outside == pytest.approx(1.5e-5 * H200_TOTAL_BYTES * 2500, rel=0.05)


def test_crash_resume_goes_back_with_a_new_incarnation() -> None:
    samples = train(list(simulate_trace("crash_resume", steps=3000, seed=1)))
    incarnations = [s["incarnation"] for s in samples]
    assert len(set(incarnations)) == 2
    switch = incarnations.index(incarnations[-1])
    assert samples[switch - 1]["step"] == 2600 and samples[switch]["step"] == 2001
    assert samples[switch]["pid"] != samples[switch - 1]["pid"]
    assert samples[switch]["reserved_bytes"] < samples[switch - 1]["reserved_bytes"]  # a fresh allocator
    assert samples[switch]["ts"] > samples[switch - 1]["ts"]


def test_dropped_samples_and_irregular_steps() -> None:
    samples = train(list(simulate_trace("dropped", steps=3000, seed=1)))
    steps = [s["step"] for s in samples]
    assert 0.78 * 3000 < len(steps) < 0.86 * 3000  # 5 % at random plus a 400-step gap
    assert not any(2000 <= s < 2400 for s in steps)  # the gap
    times = [s["step_time_s"] for s in samples]
    assert max(times) > 4 * min(times)


def test_sizes_scale_with_the_device() -> None:
    small = train(list(simulate_trace("healthy", steps=2000, seed=1, total_bytes=24 * 2**30)))
    big = train(list(simulate_trace("healthy", steps=2000, seed=1)))
    assert small[-1]["reserved_bytes"] / small[-1]["total_bytes"] == pytest.approx(
        big[-1]["reserved_bytes"] / big[-1]["total_bytes"], rel=0.05
    )


def test_multi_rank_only_the_named_rank_leaks() -> None:
    bad = scenario_params("multi_rank")["leak_rank"]
    for rank in range(8):
        truth = scenario_truth("multi_rank", rank=rank)
        assert (truth["leak"] is not None) == (rank == bad)


@pytest.mark.parametrize(("device", "mib"), [
    ("H200", 143_771), ("H100 80GB HBM3", 81_559), ("A100-SXM4-80GB", 81_920), ("A100-SXM4-40GB", 40_960),
    ("GeForce RTX 3090", 24_576), ("GeForce RTX 4090", 24_564),
])
def test_simulated_devices_match_nvidia_smi(device: str, mib: int) -> None:
    """Each simulated capacity is nvidia-smi's memory.total (MiB) x 2^20, never the MiB read as MB."""
    from vramwatch.probe.simulated import NVIDIA_SMI_MIB, device_total_bytes

    assert NVIDIA_SMI_MIB[device] == mib
    assert device_total_bytes(device) == mib * 2**20
    probe = SimulatedProbe("healthy", total_bytes=device_total_bytes(device))
    assert probe.device_info()["name"] == f"Simulated {device}"
    assert probe.read(10)["total_bytes"] == mib * 2**20


def test_h200_is_140_gib_as_nvidia_smi_says() -> None:
    assert H200_TOTAL_BYTES == 150_754_820_096
    assert f"{H200_TOTAL_BYTES / 2**30:.1f}" == "140.4"
    with pytest.raises(ValueError, match="device: unknown simulated device 'B300'"):
        __import__("vramwatch.probe.simulated", fromlist=["x"]).device_total_bytes("B300")
