"""Files from outside (traces, other tools' logs) are read in bounded memory whatever they hold:
a line, CSV row, TensorBoard record or Prometheus document past its cap is a named bad row or
one refusal line with exit 2 (naming file:line and the flag that raises the cap), never a
traceback and never held whole."""

from __future__ import annotations

import gzip
import struct
import tracemalloc
from pathlib import Path

import orjson
import pytest
from helpers import make_sample

from vramwatch.bounded import LONG_LINE, CsvRows, Inflater, LimitExceeded, Lines
from vramwatch.cli import main
from vramwatch.importers.tensorboard import masked_crc32c

MiB = 2**20


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def peak_of(fn) -> int:
    """tracemalloc's peak of Python allocations while ``fn`` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def long_line_trace(path: Path, line_bytes: int) -> None:
    """A gzip trace: a sample, one line of ``line_bytes`` (a few KiB compressed), a sample."""
    with gzip.open(path, "wb", compresslevel=9) as fh:
        fh.write(orjson.dumps(make_sample(0)) + b"\n")
        chunk = b"x" * MiB
        for _ in range(line_bytes // MiB):
            fh.write(chunk)
        fh.write(b"\n" + orjson.dumps(make_sample(1)) + b"\n")


# ---------------------------------------------------------------- the readers themselves

def test_lines_never_hold_a_long_line_and_keep_the_numbering() -> None:
    import io

    data = b"a\n" + b"y" * 5000 + b"\nbb\n" + b"z" * 300 + b"\nc"
    for block in (7, 64, 1000, 1 << 20):
        got = list(Lines(io.BytesIO(data), 256, block=block))
        assert got == [b"a", LONG_LINE, b"bb", LONG_LINE, b"c"], block
    assert list(Lines(io.BytesIO(b"a\r\nb\n\n"), 10)) == [b"a\r", b"b", b""]


def test_inflater_stops_a_bomb_at_its_cap_and_names_the_limit() -> None:
    bomb = gzip.compress(b"\0" * (64 * MiB), 9)  # ~64 KiB that inflates to 64 MiB
    inflater = Inflater(4 * MiB, "body", "--max-thing")
    with pytest.raises(LimitExceeded, match=r"body: more than 4 MiB inflated \(--max-thing\)"):
        for _ in inflater.feed(bomb):
            pass
    assert inflater.inflated <= 5 * MiB
    two = gzip.compress(b"ab") + gzip.compress(b"cd")  # concatenated members are one stream
    assert b"".join(Inflater(10, "x", "y").feed(two)) == b"abcd"
    truncated = Inflater(100, "t", "y")
    list(truncated.feed(gzip.compress(b"abcdef" * 10)[:-6]))
    with pytest.raises(OSError, match="truncated"):
        truncated.finish()
    with pytest.raises(OSError, match="corrupt"):
        list(Inflater(100, "t", "y").feed(b"\x1f\x8b\x08\x00" + b"\xff" * 40))


def test_csv_rows_refuse_a_long_line_or_field_and_go_on() -> None:
    import io

    text = b"a,b\n" + b"," * 5000 + b"\n" + b'"' + b"f" * 3000 + b'",x\n' + b"c,d\n"
    rows = list(CsvRows(io.BytesIO(text), "f.csv", 1024, "--max-line-bytes"))
    assert rows[0] == (1, ["a", "b"]) and rows[-1] == (4, ["c", "d"])
    assert [str(c) for _, c in rows[1:3]] == ["f.csv:2: line longer than 1 KiB (--max-line-bytes)",
                                              "f.csv:3: line longer than 1 KiB (--max-line-bytes)"]
    spanning = b'"' + b"q\n" * 1000 + b'"\n'  # one quoted field over a thousand short lines
    with pytest.raises(LimitExceeded, match=r"f.csv:\d+: row longer than 1 KiB"):
        list(CsvRows(io.BytesIO(spanning), "f.csv", 1024, "--max-line-bytes"))


# ---------------------------------------------------------------- analyze / import of traces

def test_analyze_of_a_gzip_trace_with_one_huge_line_stays_small_and_names_it(tmp_path, capsys) -> None:
    path = tmp_path / "bomb.jsonl.gz"
    long_line_trace(path, 64 * MiB)
    assert path.stat().st_size < 256 * 1024
    result: dict = {}

    def analyze() -> None:
        result["run"] = run_cli(capsys, "analyze", "--json", str(path))

    peak = peak_of(analyze)
    code, out, err = result["run"]
    assert code == 0 and peak < 16 * MiB, peak  # before: the line held whole, 64 MiB and more
    doc = orjson.loads(out)
    assert doc["skipped_lines"] == 1 and doc["series"][0]["samples"] == 2
    assert doc["bad_lines"] == [f"{path}:2: line longer than 1 MiB (--max-line-bytes)"]
    code, _, err = run_cli(capsys, "analyze", "--strict", str(path))
    assert code == 2 and f"{path}:2: line longer than 1 MiB (--max-line-bytes)" in one_line(err)


def test_import_of_a_trace_with_a_long_line_exits_2_and_raising_the_cap_reads_it(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    padded = {**make_sample(1), "run": "run-a"}
    path.write_bytes(orjson.dumps(make_sample(0)) + b"\n" + orjson.dumps(padded)[:-1] + b"," + b" " * (2 * MiB)
                     + b'"tokens": 5}\n')
    db = tmp_path / "vw.db"
    code, _, err = run_cli(capsys, "import", str(path), "--db", str(db))
    assert code == 2 and f"{path}:2: line longer than 1 MiB (--max-line-bytes)" in one_line(err)
    assert not db.exists()  # nothing half-stored
    code, _, err = run_cli(capsys, "import", str(path), "--db", str(db), "--max-line-bytes", "4MiB")
    assert code == 0 and "imported 2 samples" in err


# ---------------------------------------------------------------- other tools' files

def test_an_nvidia_smi_line_of_commas_is_a_bad_row_in_bounded_memory(tmp_path, capsys) -> None:
    path = tmp_path / "smi.csv"
    header = b"timestamp, index, uuid, memory.used [MiB], memory.total [MiB]\n"
    row = b"2024/05/14 09:31:15.000, 0, GPU-0, 1000 MiB, 81920 MiB\n"
    path.write_bytes(header + row + b"," * (32 * MiB) + b"\n" + row.replace(b"15.000", b"16.000"))
    result: dict = {}
    peak = peak_of(lambda: result.setdefault("run", run_cli(capsys, "analyze", "--from", "nvidia-smi", "--json",
                                                             str(path))))
    code, out, err = result["run"]
    assert code == 0 and peak < 16 * MiB, peak  # before: 32 M empty strings, gigabytes
    doc = orjson.loads(out)
    assert doc["skipped_lines"] == 1 and doc["series"][0]["samples"] == 2
    assert doc["bad_lines"] == [f"{path}:3: row: line longer than 1 MiB (--max-line-bytes)"]
    code, _, err = run_cli(capsys, "import", "--from", "nvidia-smi", str(path), "--db", str(tmp_path / "vw.db"))
    assert code == 2 and f"{path}:3: row: line longer than 1 MiB" in one_line(err)


def test_a_wandb_field_past_csvs_own_limit_is_named_not_a_traceback(tmp_path, capsys) -> None:
    path = tmp_path / "wandb.csv"
    path.write_text("_timestamp,system.gpu.0.memoryAllocatedBytes,note\n"
                    f"1715679075,1000000000,\"{'n' * 200_000}\"\n1715679076,1000000000,ok\n")
    code, out, err = run_cli(capsys, "analyze", "--from", "wandb", "--json", "--device-memory", "80GiB", str(path))
    assert code == 0, err
    assert orjson.loads(out)["series"][0]["samples"] == 2  # a 200 KB field is within the 1 MiB row cap
    code, _, err = run_cli(capsys, "import", "--from", "wandb", "--device-memory", "80GiB", str(path),
                           "--db", str(tmp_path / "vw.db"), "--max-line-bytes", "64KiB")
    assert code == 2 and f"{path}:2: row: line longer than 64 KiB (--max-line-bytes)" in one_line(err)


def test_a_tensorboard_record_whose_length_says_2_to_the_60_is_refused_by_name(tmp_path, capsys) -> None:
    path = tmp_path / "events.out.tfevents.1.host"
    head = struct.pack("<Q", 2**60)
    path.write_bytes(head + struct.pack("<I", masked_crc32c(head)) + b"\0" * 64)
    code, _, err = run_cli(capsys, "analyze", "--from", "tensorboard", "--device-memory", "80GiB", str(path))
    line = one_line(err)  # before: MemoryError traceback
    assert code == 2 and f"{path}: record 1: length field says 1,152,921,504,606,846,976 bytes" in line
    assert "(--max-record-bytes)" in line


def test_a_prometheus_document_past_the_record_cap_is_refused_by_name(tmp_path, capsys) -> None:
    doc = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "DCGM_FI_DEV_FB_USED", "Hostname": "n", "UUID": "GPU-1", "gpu": "0"},
         "values": [[1.7e9 + i, "1000"] for i in range(20_000)]}]}}
    path = tmp_path / "prom.json"
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    code, _, err = run_cli(capsys, "analyze", "--from", "prometheus", str(path), "--max-record-bytes", "64KiB")
    assert code == 2 and "larger than 64 KiB and not one document per line (--max-record-bytes)" in one_line(err)
    lines = tmp_path / "prom.jsonl"  # one document per line: each within the cap, the points budgeted per file
    lines.write_bytes(b"\n".join(orjson.dumps({**doc, "data": {**doc["data"], "result": [
        {**doc["data"]["result"][0], "values": doc["data"]["result"][0]["values"][i:i + 1000]}]}})
        for i in range(0, 20_000, 1000)))
    code, _, err = run_cli(capsys, "analyze", "--from", "prometheus", str(lines), "--max-record-bytes", "64KiB")
    assert code == 2 and "more than 4,096 points (GPU x time) in one file" in one_line(err)


def test_a_corrupt_gzip_is_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl.gz"
    good = gzip.compress(orjson.dumps(make_sample(0)) + b"\n" * 1000)
    path.write_bytes(good[:20] + bytes(b ^ 0xFF for b in good[20:40]) + good[40:])
    code, _, err = run_cli(capsys, "analyze", str(path))
    assert code == 2 and "cannot read" in one_line(err) and str(path) in err


def test_the_readers_import_without_the_server_extras() -> None:
    """analyze, the importers and the CLI's --url client run on a training node's install (no
    FastAPI, no httpx): the bounded readers must not need them."""
    import subprocess
    import sys

    code = ("import sys\nfor m in ('httpx', 'fastapi', 'uvicorn', 'starlette'): sys.modules[m] = None\n"
            "import vramwatch.bounded, vramwatch.engine.analyze, vramwatch.importers, vramwatch.remote\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_an_importer_error_line_echoes_a_bounded_excerpt(tmp_path) -> None:
    import subprocess
    import sys

    header = "timestamp, name, index, memory.used [MiB], memory.total [MiB]\n"
    path = tmp_path / "smi.csv"
    path.write_text(header + "2026/01/01 00:00:00.000, H200, 0, " + "9" * 200_000 + "x MiB, 143771 MiB\n")
    proc = subprocess.run([sys.executable, "-m", "vramwatch.cli", "analyze", "--from", "nvidia-smi", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert len(proc.stderr) < 2000 and "characters)" in proc.stderr, (proc.returncode, proc.stderr[:500])


_LONG = "X" * 100_000
_SMI = "timestamp, index, memory.used [MiB], memory.total [MiB]\n"


@pytest.mark.parametrize(("source", "name", "text", "extra"), [
    ("nvidia-smi", "cell.csv", _SMI + "2026/01/01 00:00:00.000, 0, " + _LONG + " MiB, 81559 MiB\n", []),
    ("nvidia-smi", "time.csv", _SMI + _LONG + ", 0, 10 MiB, 81559 MiB\n", []),
    ("wandb", "time.csv", "_timestamp,system.gpu.0.memoryAllocatedBytes\n" + _LONG + ",5\n", []),
    ("wandb", "value.csv", "_timestamp,system.gpu.0.memoryAllocatedBytes\n1700000000," + _LONG + "\n", []),
    ("prometheus", "label.json", orjson.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "DCGM_FI_DEV_FB_USED", "Hostname": "h", "UUID": "u", "gpu": _LONG},
         "values": [[1700000000, "5"]]}]}}).decode(), []),
    ("prometheus", "status.json", orjson.dumps({"status": "error" + _LONG, "error": _LONG}).decode(), []),
    ("tensorboard", "events.out.tfevents.1", "", ["--keys", "keys.toml"]),
])
def test_an_importer_error_line_echoes_at_most_200_characters_of_a_field(tmp_path, capsys, source, name, text,
                                                                          extra) -> None:
    """Whatever the field (a cell, a label, a status, a key table's tag and field), the one error
    line holds at most ~200 characters of it (it held 400, and 200 more of a key's tag)."""
    (tmp_path / "keys.toml").write_text(f'[keys."{_LONG}"]\nfield = "{_LONG}"\n')
    path = tmp_path / name
    path.write_text(text)
    extra = [str(tmp_path / e) if e.endswith(".toml") else e for e in extra]
    code = main(["import", "--db", str(tmp_path / "vw.db"), "--from", source, *extra, str(path)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "characters)" in line, line[:300]
    longest = max(len(run) for run in line.replace("'", " ").replace('"', " ").split(" ") if set(run) <= set("X.…"))
    assert longest <= 205, (longest, line[:300])
    assert not (tmp_path / "vw.db").exists()
