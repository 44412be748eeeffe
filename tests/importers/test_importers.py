"""Importers on files in each tool's real format: what each sample holds, and nothing more."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from vramwatch.importers import ImportOptions, ImportStats, RowError, iter_import, parse_size
from vramwatch.importers.tensorboard import iter_records, load_keys, masked_crc32c, parse_event

DATA = Path(__file__).parents[1] / "data"
MiB, GiB = 1024**2, 1024**3
UUID0 = "GPU-2f3a7c1e-8b6d-4e0f-9a51-3c7d2e8f4b10"
UUID1 = "GPU-9c0b4e12-77a1-4d3e-b2f8-60e1a5d3c9f7"
DEVICE_ONLY = {"schema", "run", "host", "rank", "step", "ts", "phase", "nvml_used_bytes", "total_bytes", "uuid",
               "gpu"}


@pytest.fixture
def utc(monkeypatch):
    """nvidia-smi prints local time without a zone: read it as UTC here."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def read(fmt: str, *paths: str | Path, **options: Any) -> tuple[list[dict[str, Any]], ImportStats]:
    stats = ImportStats()
    samples = list(iter_import([str(p) for p in paths], fmt, ImportOptions(**options), stats))
    return samples, stats


# ---------------------------------------------------------------- nvidia-smi

@pytest.mark.parametrize("name", ["nvidia_smi_units.csv", "nvidia_smi_nounits.csv", "nvidia_smi_noheader.csv"])
def test_nvidia_smi_rows_become_device_level_samples(utc, name) -> None:
    samples, stats = read("nvidia-smi", DATA / name)
    lines = [line for line in (DATA / name).read_text().splitlines() if not line.startswith("timestamp")]
    assert stats.rows == len(lines) == len(samples) and stats.skipped == 0
    first = samples[0]
    assert set(first) == DEVICE_ONLY  # what nvidia-smi measured, nothing invented
    assert first["nvml_used_bytes"] == 61234 * MiB and first["total_bytes"] == 81920 * MiB
    assert first["ts"] == pytest.approx(1715679062.417)  # 2024/05/14 09:31:02.417 UTC
    assert (first["rank"], first["gpu"], first["uuid"], first["step"]) == (0, 0, UUID0, 0)
    assert first["run"] == name.removesuffix(".csv") and first["host"] == "unknown"
    gpu1 = [s for s in samples if s["rank"] == 1]
    assert [s["step"] for s in gpu1] == list(range(len(gpu1)))  # per-GPU ordinal
    assert all(s["uuid"] == UUID1 for s in gpu1)


def test_nvidia_smi_loop_with_repeated_headers_reads_every_block(utc) -> None:
    samples, _ = read("nvidia-smi", DATA / "nvidia_smi_units.csv", run="job-7", host="node-3")
    assert len(samples) == 20  # 6 + 4 loop iterations x 2 GPUs, header lines skipped
    gpu1 = [s for s in samples if s["gpu"] == 1]
    assert [s["nvml_used_bytes"] // MiB for s in gpu1] == [61234 + 37 * i for i in (*range(6), *range(8, 12))]
    assert {(s["run"], s["host"]) for s in samples} == {("job-7", "node-3")}


def test_nvidia_smi_bad_row_names_file_line_and_column(utc) -> None:
    with pytest.raises(RowError) as info:
        read("nvidia-smi", DATA / "nvidia_smi_bad.csv")
    assert str(info.value).startswith(f"{DATA / 'nvidia_smi_bad.csv'}:4: column 4 (memory.used): not measured")
    samples, stats = read("nvidia-smi", DATA / "nvidia_smi_bad.csv", skip_invalid=True)
    assert (stats.rows, stats.skipped, len(samples)) == (6, 2, 4)
    assert "nvidia_smi_bad.csv:5: column 5 (memory.total)" in stats.errors[1] and "'lots'" in stats.errors[1]


def test_nvidia_smi_gzip_extra_columns_and_reordered_header(utc, tmp_path) -> None:
    text = ("name, memory.total [MiB], uuid, memory.used [MiB], index, utilization.gpu [%], timestamp\n"
            f"NVIDIA H200, 143771 MiB, {UUID0}, 100000 MiB, 3, 97 %, 2024/05/14 09:31:02.417\n")
    path = tmp_path / "smi.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    (sample,), _ = read("nvidia-smi", path)
    assert (sample["rank"], sample["nvml_used_bytes"], sample["total_bytes"]) == (3, 100000 * MiB, 143771 * MiB)
    assert sample["run"] == "smi"


def test_nvidia_smi_header_without_memory_columns_is_refused(tmp_path) -> None:
    path = tmp_path / "util.csv"
    path.write_text("timestamp, index, utilization.gpu [%]\n2024/05/14 09:31:02.417, 0, 97 %\n")
    with pytest.raises(RowError, match=r"util.csv:1: header: needs timestamp, memory.used"):
        read("nvidia-smi", path)


def _peak_while_reading(path: Path, rows: int) -> int:
    row = "2024/05/14 09:31:02.417, {g}, GPU-{g:08d}, {u} MiB, 81920 MiB\n"
    with open(path, "w") as fh:
        fh.write("timestamp, index, uuid, memory.used [MiB], memory.total [MiB]\n")
        for i in range(rows // 8):
            fh.write("".join(row.format(g=g, u=60000 + i % 7) for g in range(8)))
    tracemalloc.start()
    count = sum(1 for _ in iter_import([str(path)], "nvidia-smi", ImportOptions()))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == rows
    return peak


def test_nvidia_smi_streams_in_bounded_memory(utc, tmp_path) -> None:
    small = _peak_while_reading(tmp_path / "small.csv", 800)
    large = _peak_while_reading(tmp_path / "large.csv", 8000)  # 10x the rows ...
    assert large < small * 1.5 + 64 * 1024, (small, large)  # ... not 10x the memory


# ---------------------------------------------------------------- TensorBoard

def write_events(logdir: Path, scalars: list[tuple[int, str, float]], new_style: bool = False) -> Path:
    """A real event file, written by torch.utils.tensorboard's SummaryWriter (as Megatron,
    torchtitan and Lightning's TensorBoardLogger do)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(logdir))
    for step, tag, value in scalars:
        writer.add_scalar(tag, value, step, new_style=new_style)
    writer.close()
    (path,) = logdir.glob("events.out.tfevents.*")
    return path


def megatron_scalars(steps: range) -> list[tuple[int, str, float]]:
    # megatron/training/training.py, training_log() with --log-memory-to-tensorboard
    out = []
    for it in steps:
        out += [(it, "lm loss", 3.0 / it), (it, "mem-reserved-bytes", 60 * GiB),
                (it, "mem-allocated-bytes", 40 * GiB + it * 64 * MiB), (it, "mem-max-allocated-bytes", 52 * GiB),
                (it, "mem-allocated-count", 1234.0)]
    return out


def f32(value: float) -> float:
    """TensorBoard stores scalars as float32: what a reader can get back."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def test_tensorboard_megatron_memory_scalars(tmp_path) -> None:
    path = write_events(tmp_path / "megatron-run", megatron_scalars(range(10, 110, 10)))
    samples, stats = read("tensorboard", tmp_path / "megatron-run", total_bytes=80 * GiB,
                          rank=7)
    assert len(samples) == 10 and stats.skipped == 0
    s = samples[2]
    assert s["step"] == 30 and s["rank"] == 7 and s["run"] == "megatron-run"
    assert s["allocated_bytes"] == round(f32(40 * GiB + 30 * 64 * MiB))
    assert s["reserved_bytes"] == 60 * GiB and s["total_bytes"] == 80 * GiB
    # the lifetime peak is kept, but not as the per-interval peak the engine judges
    assert "peak_allocated_bytes" not in s and s["extra"] == {"max_allocated_bytes": 52 * GiB}
    assert "nvml_used_bytes" not in s and "ooms" not in s  # Megatron does not log them
    assert s["incarnation"] == path.name


def test_tensorboard_torchtitan_window_peaks_and_capacity_from_percent(tmp_path) -> None:
    scalars = []
    for step in (10, 20, 30):  # torchtitan/components/metrics.py: GiB and % of the device, 2 decimals
        scalars += [(step, "loss_metrics/global_avg_loss", 2.5), (step, "memory/max_active(GiB)", 50.25 + step / 100),
                    (step, "memory/max_active(%)", 35.31), (step, "memory/max_reserved(GiB)", 60.5),
                    (step, "memory/max_reserved(%)", 45.18), (step, "memory/num_alloc_retries", 0),
                    (step, "memory/num_ooms", 0)]
    write_events(tmp_path / "titan", scalars)
    samples, _ = read("tensorboard", tmp_path / "titan")
    assert [s["step"] for s in samples] == [10, 20, 30]
    s = samples[0]
    # capacity from max_reserved(GiB) / max_reserved(%): 60.5 GiB at 45.18 % -> 133.9 GiB (an H200)
    assert s["total_bytes"] == round(f32(60.5) * GiB * 100 / f32(45.18) / MiB) * MiB
    assert abs(s["total_bytes"] - 143_771_009_024) / 143_771_009_024 < 0.002
    assert s["peak_allocated_bytes"] == s["allocated_bytes"] == round(f32(50.35) * GiB)
    assert s["extra"] == {"level_is_window_peak": 1}  # the level is a window peak, and says so
    assert (s["reserved_bytes"], s["alloc_retries"], s["ooms"]) == (round(f32(60.5) * GiB), 0, 0)
    assert {x["total_bytes"] for x in samples} == {s["total_bytes"]}  # one capacity per file


def test_tensorboard_lightning_device_stats_monitor(tmp_path) -> None:
    prefix = "DeviceStatsMonitor.on_train_batch_end/"
    scalars = []
    for step in range(1, 4):
        for hook, scale in (("DeviceStatsMonitor.on_train_batch_start/", 0.5), (prefix, 1.0)):
            scalars += [(step, hook + "allocated_bytes.all.current", scale * 8 * GiB),
                        (step, hook + "reserved_bytes.all.current", 12 * GiB),
                        (step, hook + "inactive_split_bytes.all.current", 64 * MiB),
                        (step, hook + "num_alloc_retries", 0), (step, hook + "num_ooms", 0)]
    write_events(tmp_path / "lightning_logs" / "version_0", scalars, new_style=True)  # tensor-valued scalars
    samples, _ = read("tensorboard", tmp_path / "lightning_logs", total_bytes=24 * GiB, run="lit")
    assert len(samples) == 3
    s = samples[0]
    assert (s["allocated_bytes"], s["reserved_bytes"], s["inactive_split_bytes"]) == (8 * GiB, 12 * GiB, 64 * MiB)
    assert s["run"] == "lit" and (s["alloc_retries"], s["ooms"]) == (0, 0)


def test_tensorboard_reader_agrees_with_tensorboards_own_loader(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    path = write_events(tmp_path / "x", megatron_scalars(range(1, 30)))
    events = [Event.FromString(raw) for raw in RawEventFileLoader(str(path)).Load()]
    theirs = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    with open(path, "rb") as fh:
        ours = [(step, tag, value) for _n, data, _crc in iter_records(fh)
                for _wt, step, values in [parse_event(data)] for tag, value in values]
    assert ours == theirs and len(ours) == 29 * 5


def test_tensorboard_without_capacity_says_what_to_pass(tmp_path) -> None:
    write_events(tmp_path / "m", megatron_scalars(range(1, 3)))
    with pytest.raises(RowError, match=r"record \d+: mem-.*pass --device-memory SIZE"):
        read("tensorboard", tmp_path / "m")


def test_tensorboard_torn_tail_is_ignored_and_a_corrupt_record_is_named(tmp_path) -> None:
    path = write_events(tmp_path / "t", megatron_scalars(range(1, 6)))
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the writer was killed mid-record
    samples, _ = read("tensorboard", path, total_bytes=80 * GiB)
    assert [s["step"] for s in samples] == [1, 2, 3, 4, 5]  # the last step lost one scalar, not the file
    broken = bytearray(data)
    at = data.index(b"mem-allocated-bytes") + 25  # inside the value of a mapped record
    broken[at] ^= 0xFF
    path.write_bytes(bytes(broken))
    with pytest.raises(RowError, match=r":record \d+: data: checksum mismatch"):
        read("tensorboard", path, total_bytes=80 * GiB)
    samples, stats = read("tensorboard", path, total_bytes=80 * GiB, skip_invalid=True)
    # the damaged record is skipped; its step then has no memory level and is skipped too
    assert stats.skipped == 2 and len(samples) == 4
    assert "checksum mismatch" in stats.errors[0] and "memory level" in stats.errors[1]
    (tmp_path / "junk").write_bytes(b"not an event file at all")
    with pytest.raises(RowError, match="not a TensorBoard event file"):
        read("tensorboard", tmp_path / "junk")


def test_tensorboard_key_table_is_data_and_extendable(tmp_path) -> None:
    table = load_keys()
    assert table["mem-allocated-bytes"].field == "allocated_bytes"
    assert table["memory/max_reserved(%)"].capacity_percent_of == "memory/max_reserved(GiB)"
    extra = tmp_path / "keys.toml"
    extra.write_text('[keys."gpu/mem_alloc_mb"]\nfield = "allocated_bytes"\nscale = 1048576\n'
                     '[keys."gpu/mem_total_mb"]\nfield = "total_bytes"\nscale = 1048576\n')
    write_events(tmp_path / "custom", [(5, "gpu/mem_alloc_mb", 1000.0), (5, "gpu/mem_total_mb", 24000.0)])
    (s,), _ = read("tensorboard", tmp_path / "custom", keys_path=str(extra))
    assert (s["allocated_bytes"], s["total_bytes"]) == (1000 * MiB, 24000 * MiB)
    extra.write_text('[keys."x"]\nfield = "allocated"\n')
    with pytest.raises(RowError, match=r"keys.x: field must be a schema-1 field"):
        load_keys(str(extra))


def test_masked_crc32c_matches_tensorboards() -> None:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs

    for data in (b"", b"a", b"123456789", os.urandom(300)):
        assert masked_crc32c(data) == theirs(data)


# ---------------------------------------------------------------- W&B

def test_wandb_system_export(tmp_path) -> None:
    samples, stats = read("wandb", DATA / "wandb_system.csv")
    assert stats.rows == 10 and stats.skipped == 0
    gpu0 = [s for s in samples if s["gpu"] == 0]
    gpu1 = [s for s in samples if s["gpu"] == 1]
    assert len(gpu0) == 9 and len(gpu1) == 10  # row 4 has no GPU 0 reading: no sample, not a zero
    s = gpu1[3]
    assert set(s) == DEVICE_ONLY - {"uuid"}
    assert s["nvml_used_bytes"] == 64_208_109_568 + 3 * 52_428_800
    assert s["total_bytes"] == 80 * GiB  # bytes / percent, rounded to whole MiB
    assert s["ts"] == pytest.approx(1715679075.41 + 45) and s["step"] == 3 and s["run"] == "wandb_system"
    forced, _ = read("wandb", DATA / "wandb_system.csv", total_bytes=81559 * MiB, run="r1")
    assert {x["total_bytes"] for x in forced} == {81559 * MiB} and forced[0]["run"] == "r1"


def test_wandb_panel_export_names_the_run_and_needs_timestamps(tmp_path) -> None:
    path = tmp_path / "panel.csv"
    path.write_text('"_timestamp","llama-7b - system/gpu.0.memoryAllocatedBytes",'
                    '"llama-7b - system/gpu.0.memoryAllocatedBytes__MIN"\n1715679075.4,1000000000,990000000\n')
    (s,), _ = read("wandb", path, total_bytes=24 * GiB)
    assert (s["run"], s["nvml_used_bytes"]) == ("llama-7b", 1_000_000_000)
    path.write_text('"Wall Time","llama-7b - system/gpu.0.memoryAllocatedBytes"\n1715679075410,1000000000\n'
                    '2024-05-14T09:31:30.41Z,1000000000\n')
    first, second = read("wandb", path, total_bytes=24 * GiB)[0]
    assert first["ts"] == pytest.approx(1715679075.41) and second["ts"] == pytest.approx(1715679090.41)
    path.write_text('"Step","llama-7b - system/gpu.0.memoryAllocatedBytes"\n1,1000000000\n')
    with pytest.raises(RowError, match=re.escape("panel.csv:1: header: needs a _timestamp (or Wall Time) column")):
        read("wandb", path)


# ---------------------------------------------------------------- Prometheus (dcgm-exporter)

def test_prometheus_dcgm_range_query(tmp_path) -> None:
    samples, stats = read("prometheus", DATA / "prometheus_dcgm_range.json")
    assert len(samples) == 16 and stats.skipped == 0
    s = [x for x in samples if x["gpu"] == 1][3]
    assert set(s) == DEVICE_ONLY
    assert (s["run"], s["host"], s["rank"], s["uuid"]) == ("dcgm", "gpu-node-07", 1, UUID1)
    assert s["nvml_used_bytes"] == (61234 + 120) * MiB
    assert s["total_bytes"] == 81920 * MiB  # USED + FREE + RESERVED
    assert s["ts"] == 1715679060 + 45 and s["step"] == 1715679060 + 45  # steps are seconds
    gap = [x for x in samples if x["gpu"] == 0][5]  # FB_FREE missed at that instant
    assert gap["total_bytes"] == 81920 * MiB  # the GPU's capacity, known from earlier points


def test_prometheus_separate_queries_one_per_line_are_joined(tmp_path) -> None:
    doc = orjson.loads((DATA / "prometheus_dcgm_range.json").read_bytes())
    used = {"status": "success", "data": {"resultType": "matrix", "result": [
        r for r in doc["data"]["result"] if r["metric"]["__name__"] == "DCGM_FI_DEV_FB_USED"]}}
    free = {"status": "success", "data": {"resultType": "matrix", "result": [
        r for r in doc["data"]["result"] if r["metric"]["__name__"] != "DCGM_FI_DEV_FB_USED"]}}
    path = tmp_path / "two.jsonl"
    path.write_bytes(orjson.dumps(used) + b"\n" + orjson.dumps(free) + b"\n")
    joined, _ = read("prometheus", path, run="fleet")
    direct, _ = read("prometheus", DATA / "prometheus_dcgm_range.json", run="fleet")
    assert joined == direct


def test_prometheus_errors_name_the_series(tmp_path) -> None:
    path = tmp_path / "err.json"
    path.write_text('{"status": "error", "errorType": "bad_data", "error": "parse error"}')
    with pytest.raises(RowError, match=re.escape("err.json:1: status: 'error': parse error")):
        read("prometheus", path)
    doc = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "DCGM_FI_DEV_FB_USED", "Hostname": "n1", "gpu": "0"}, "values": [[1.7e9, "1"]]}]}}
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(RowError, match=r"err.json:result\[0\]: metric: series has no UUID label"):
        read("prometheus", path)
    doc["data"]["result"][0]["metric"]["UUID"] = "GPU-1"
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(RowError, match=re.escape("n1 gpu 0 t=1700000000.000: values: no DCGM_FI_DEV_FB_FREE")):
        read("prometheus", path)


# ---------------------------------------------------------------- common

def test_sizes() -> None:
    assert parse_size("80GiB") == 80 * GiB and parse_size("81559MiB") == 81559 * MiB
    assert parse_size("141GB") == 141 * 10**9 and parse_size("143771009024") == 143771009024
    for bad in ("", "lots", "-1GiB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_missing_input_is_a_clear_error(tmp_path) -> None:
    from vramwatch.importers import input_paths

    with pytest.raises(FileNotFoundError, match="no such file"):
        input_paths([str(tmp_path / "nope.csv")], "nvidia-smi")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape("no events.out.tfevents")):
        input_paths([str(tmp_path / "empty")], "tensorboard")
    shutil.rmtree(tmp_path / "empty")
