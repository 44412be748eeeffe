"""One line and the right exit code for what users get wrong: a busy port, a mistyped --db, a
collector that is down, a file with no sample. Real subprocesses; nothing is created or printed
before the error."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest


def vramwatch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramwatch", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_busy_port_is_one_line_and_exit_2(command, busy_port, tmp_path) -> None:
    db = tmp_path / "vw.db"
    extra = ["--duration", "5"] if command == "demo" else []
    run = vramwatch(command, "--port", str(busy_port), "--db", str(db), *extra)
    assert run.returncode == 2, run
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert f"127.0.0.1:{busy_port}" in run.stderr and "already in use" in run.stderr
    assert "closed cleanly" not in run.stderr and not db.exists()


def test_a_missing_db_directory_is_refused_unless_asked_to_create_it(tmp_path) -> None:
    db = tmp_path / "typo" / "vw.db"
    run = vramwatch("serve", "--port", "0", "--db", str(db))
    assert run.returncode == 2 and "--db" in run.stderr and "--create-db-dir" in run.stderr
    assert len(run.stderr.splitlines()) == 1 and not db.parent.exists()
    made = vramwatch("demo", "--duration", "2", "--ranks", "1", "--db", str(db), "--create-db-dir")
    assert made.returncode == 0, made.stderr
    assert db.exists()


def test_advise_against_a_collector_that_is_down_exits_3_like_gate() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens
    for args in (("--check",), ()):
        run = vramwatch("advise", "some-run", "--url", f"http://127.0.0.1:{port}", *args)
        assert run.returncode == 3, run
        assert len(run.stderr.splitlines()) == 1 and f"127.0.0.1:{port}" in run.stderr


def test_analyze_with_no_valid_sample_names_the_first_bad_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"not": "a sample"}\ngarbage\n')
    run = vramwatch("analyze", str(trace))
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1
    assert f"{trace}:1" in run.stderr and "no valid sample in 2 lines" in run.stderr


def test_hostile_serve_arguments_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """A --db whose name the system cannot look at, and a setting past its range: one line each."""
    too_long = vramwatch("serve", "--port", "0", "--db", str(tmp_path / ("a" * 5000) / "vw.db"))
    assert too_long.returncode == 2 and len(too_long.stderr.splitlines()) == 1
    assert "--db" in too_long.stderr and len(too_long.stderr) < 400
    past = vramwatch("serve", "--port", "0", "--db", str(tmp_path / "vw.db"), "--silent-after", "1e9")
    assert past.returncode == 2 and len(past.stderr.splitlines()) == 1 and "silent_after_s" in past.stderr
    assert not (tmp_path / "vw.db").exists()
