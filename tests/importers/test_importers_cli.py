"""`vramwatch import|analyze --from FORMAT`: exit codes, one-line errors, nothing half-written,
and verdicts from other tools' files end to end."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from vramwatch.cli import main
from vramwatch.collector.store import Store
from vramwatch.probe.simulated import simulate_trace

DATA = Path(__file__).parents[1] / "data"
MiB = 1024**2


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def write_nvidia_smi(path: Path, traces: dict[int, list[dict[str, Any]]], every: int = 1) -> None:
    """What `nvidia-smi --query-gpu=timestamp,index,uuid,memory.used,memory.total --format=csv -l`
    would have printed while these ranks trained (one GPU per rank, every `every`-th step)."""
    lines = ["timestamp, index, uuid, memory.used [MiB], memory.total [MiB]"]
    rows = []
    for gpu, trace in traces.items():
        for sample in trace[::every]:
            if sample["phase"] == "train":
                rows.append((sample["ts"], gpu, sample))
    for ts, gpu, s in sorted(rows, key=lambda r: (r[0], r[1])):
        stamp = datetime.fromtimestamp(ts, UTC).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        lines.append(f"{stamp}, {gpu}, {s['uuid']}, {s['nvml_used_bytes'] // MiB} MiB, {s['total_bytes'] // MiB} MiB")
    path.write_text("\n".join(lines) + "\n")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_import_of_a_bad_row_exits_2_in_one_line_and_stores_nothing(tmp_path, capsys) -> None:
    db = tmp_path / "vw.db"
    code, _, err = run_cli(capsys, "import", "--from", "nvidia-smi", str(DATA / "nvidia_smi_bad.csv"), "--db", str(db))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "nvidia_smi_bad.csv:4: column 4 (memory.used): not measured" in line and "nothing imported" in line
    assert not db.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["analyze", "--from", "nvidia-smi", "nope.csv"], "no such file"),
    (["analyze", "--from", "excel", "x.csv"], "invalid choice"),
    (["import", "--from", "tensorboard", "x", "--device-memory", "lots"], "not a size"),
    (["import", "--from", "tensorboard", "x", "--rank", "-1"], "whole number"),
    (["import", "--from", "tensorboard", "empty_dir"], "no events.out.tfevents"),
])
def test_bad_arguments_exit_2_in_one_line(tmp_path, capsys, monkeypatch, argv, message) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty_dir").mkdir()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    (line,) = err.strip().splitlines()
    assert message in line


def test_import_round_trips_only_what_was_measured(tmp_path, capsys) -> None:
    db = tmp_path / "vw.db"
    code, _, err = run_cli(capsys, "import", "--from", "prometheus", str(DATA / "prometheus_dcgm_range.json"),
                           "--db", str(db), "--run", "fleet")
    assert code == 0 and "imported 16 samples (0 already present) of 16 from prometheus" in err
    code, _, err = run_cli(capsys, "import", "--from", "prometheus", str(DATA / "prometheus_dcgm_range.json"),
                           "--db", str(db), "--run", "fleet")
    assert "imported 0 samples (16 already present)" in err  # idempotent
    store = Store(str(db), readonly=True)
    try:
        stored = list(store.iter_samples("fleet"))
    finally:
        store.close()
    assert len(stored) == 16
    for sample in stored:
        measured = {k for k, v in sample.items() if v is not None}
        assert measured <= {"schema", "run", "host", "rank", "step", "ts", "phase", "nvml_used_bytes",
                            "total_bytes", "uuid", "gpu", "incarnation", "seq"}, sample
        assert sample.get("allocated_bytes") is None and sample.get("reserved_bytes") is None


def test_analyze_skips_bad_rows_by_default_and_says_so(tmp_path, capsys) -> None:
    code, out, err = run_cli(capsys, "analyze", "--from", "nvidia-smi", str(DATA / "nvidia_smi_bad.csv"), "--json")
    assert code == 0
    doc = orjson.loads(out)
    assert doc["skipped_lines"] == 2 and len(doc["series"]) == 2  # the same keys as a JSON Lines analyze
    assert "nvidia_smi_bad.csv:4: column 4 (memory.used)" in doc["bad_lines"][0]
    assert "skipped 2 bad lines" in err and "nvidia_smi_bad.csv:4" in err
    code, _, err = run_cli(capsys, "analyze", "--from", "nvidia-smi", str(DATA / "nvidia_smi_bad.csv"), "--strict")
    assert code == 2 and "nvidia_smi_bad.csv:4: column 4 (memory.used)" in err


def test_analyze_judges_nvidia_smi_logs_of_a_leak_and_a_healthy_gpu(tmp_path, capsys) -> None:
    healthy = list(simulate_trace("healthy", steps=5000, rank=0, seed=1))
    leaking = list(simulate_trace("fast_leak", steps=7000, rank=1, seed=1))
    path = tmp_path / "smi.csv"
    write_nvidia_smi(path, {0: healthy, 1: leaking})
    code, out, _ = run_cli(capsys, "analyze", "--from", "nvidia-smi", str(path), "--json", "--host", "node-1")
    assert code == 0
    series = {s["rank"]: s for s in orjson.loads(out)["series"]}
    assert series[0]["state"] == "plateau" and series[1]["state"] == "leak"
    assert not [e for e in series[0]["events"] if e["type"] == "leak"]
    leak = next(e for e in series[1]["events"] if e["type"] == "leak")
    # nvidia-smi rows are steps in file order; the simulator's leak starts at step 1500
    assert leak["step"] > 1500
    assert series[1]["summary"]["seconds_to_oom"] is not None


@pytest.mark.parametrize("source", ["nvidia-smi", "jsonl"])
def test_an_imported_device_only_run_keeps_its_suspected_oom_without_a_replay(tmp_path, capsys, source) -> None:
    """The importer runs the collector's engine on what it stores: rank 0's memory vanishing near
    full is kept as a suspected OOM (never an OOM), read back from the file by a read-only store;
    a second import of the same file adds nothing."""
    from incident_runs import device_oom

    trace = device_oom("imported")
    path = tmp_path / ("smi.csv" if source == "nvidia-smi" else "trace.jsonl")
    if source == "nvidia-smi":
        write_nvidia_smi(path, {s_rank: [dict(s, uuid=f"GPU-{s_rank}") for s in trace if s["rank"] == s_rank]
                                for s_rank in (0, 1)})
        argv = ["--from", "nvidia-smi", "--run", "imported", "--host", "node-a"]
    else:
        path.write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in trace))
        argv = []
    db = tmp_path / "vw.db"
    for _ in range(2):
        code, _, err = run_cli(capsys, "import", *argv, str(path), "--db", str(db))
        assert code == 0, err
    store = Store(str(db), readonly=True)
    try:
        kept = store.suspected_records("imported")
    finally:
        store.close()
    assert list(kept) == [("node-a", 0)]
    (found,), dropped = kept[("node-a", 0)]
    assert dropped == 0 and found.reason == "near_full"
    assert found.used_before_bytes > 70 * 1024**3 and found.used_after_bytes < 1024**3


def test_an_import_judges_at_most_as_many_ranks_as_a_collector_and_says_so(tmp_path, capsys) -> None:
    """Each rank judged costs an engine: a file naming a new GPU on every row would make one per
    row. Past the cap the samples are stored unjudged, counted, and one line says so."""
    from incident_runs import device_oom

    from vramwatch import wire
    from vramwatch.cli.importers import ImportSuspicions
    from vramwatch.collector.settings import Settings

    assert ImportSuspicions().max_ranks == Settings.max_series
    trace = [wire.validate(s) for s in device_oom("capped")]  # rank 0 suspected, rank 1 flat
    suspicions = ImportSuspicions(max_ranks=1)
    store = Store(str(tmp_path / "vw.db"))
    try:
        assert store.insert_stream(suspicions.judged(iter(trace)))[0] == len(trace)  # every sample stored
        suspicions.keep(store)
        assert list(store.suspected_records("capped")) == [("node-a", 0)]
    finally:
        store.close()
    assert suspicions.unjudged == sum(1 for s in trace if s["rank"] == 1)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{suspicions.unjudged} samples of ranks past the first 1 not judged" in line
