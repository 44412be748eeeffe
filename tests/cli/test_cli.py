"""The CLI as users run it: a real subprocess, exit codes, one-line errors."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import orjson
import pytest
from helpers import make_sample

from vramwatch import wire


def vw(*args: str, env_db: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramwatch", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["serve", "demo", "analyze", "import", "export", "report", "advise", "compare",
                                     "gate"])
def test_every_command_has_help(command: str) -> None:
    result = vw(command, "--help")
    assert result.returncode == 0 and "usage: vramwatch " + command in result.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "required"),
        (("bogus",), "invalid choice"),
        (("serve", "--port", "70000"), "port must be 0-65535"),
        (("demo", "--ranks", "0"), "must be positive"),
        (("analyze",), "PATH"),
        (("analyze", "/no/such/file.jsonl"), "cannot read /no/such/file.jsonl"),
        (("import", "/no/such/file.jsonl"), "no such file"),
        (("report", "run-a"), "--out"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: tuple[str, ...], needle: str) -> None:
    result = vw(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_import_then_export_round_trips_and_import_is_idempotent(tmp_path) -> None:
    samples = [make_sample(i, rank=r, incarnation="x") for r in range(3) for i in range(40)]
    trace = tmp_path / "trace.jsonl.gz"
    wire.write_file(trace, samples)
    db = str(tmp_path / "vw.db")
    first = vw("import", str(trace), "--db", db)
    assert first.returncode == 0 and "imported 120 samples (0 already present)" in first.stderr
    again = vw("import", str(trace), "--db", db)
    assert again.returncode == 0 and "imported 0 samples (120 already present)" in again.stderr
    out = vw("export", "run-a", "--db", db)
    assert out.returncode == 0
    exported = [orjson.loads(line) for line in out.stdout.splitlines()]
    assert sorted(exported, key=lambda s: (s["rank"], s["step"])) == samples


def test_import_of_a_bad_file_names_the_line_and_changes_nothing(tmp_path) -> None:
    good = tmp_path / "good.jsonl"
    bad = tmp_path / "bad.jsonl"
    wire.write_file(good, [make_sample(i) for i in range(10)])
    bad.write_bytes(wire.encode_lines([make_sample(0, rank=1)]) + b'{"schema": 1, "run": 5}\n')
    db = tmp_path / "vw.db"
    result = vw("import", str(good), str(bad), "--db", str(db))
    assert result.returncode == 2
    assert f"{bad}:2: run" in result.stderr and "nothing imported" in result.stderr
    assert not db.exists() or sqlite3.connect(db).execute("SELECT count(*) FROM samples").fetchone()[0] == 0


def test_export_of_unknown_run_and_missing_db(tmp_path) -> None:
    db = tmp_path / "vw.db"
    wire.write_file(tmp_path / "t.jsonl", [make_sample(0)])
    assert vw("import", str(tmp_path / "t.jsonl"), "--db", str(db)).returncode == 0
    result = vw("export", "nope", "--db", str(db))
    assert result.returncode == 2 and "no run named 'nope'" in result.stderr
    result = vw("export", "run-a", "--db", str(tmp_path / "missing.db"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_analyze_reports_every_series(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    wire.write_file(trace, [make_sample(i, rank=r) for r in range(2) for i in range(300)])
    result = vw("analyze", str(trace), "--json")
    assert result.returncode == 0, result.stderr
    doc = orjson.loads(result.stdout)
    assert [(s["run"], s["host"], s["rank"]) for s in doc["series"]] == [("run-a", "node-1", 0), ("run-a", "node-1", 1)]
    assert all(s["state"] in ("warmup", "plateau", "rising", "leak", "fragmentation") for s in doc["series"])
    table = vw("analyze", str(trace))
    assert table.returncode == 0 and "run-a" in table.stdout
