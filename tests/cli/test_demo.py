"""`vramwatch demo`: a real collector fed by simulated ranks through the real hook path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fakes.collector import stored

from vramwatch.cli.demo import run_demo


def test_demo_feeds_every_rank_through_the_hook_into_the_collector(tmp_path):
    lines: list[str] = []
    db = tmp_path / "demo.db"
    summary = run_demo(ranks=3, duration=2.0, steps_per_s=25, db=str(db), run="demo-test",
                       sim_params={"ckpt_every": 10}, print_fn=lines.append)
    assert summary["url"] in lines[0] and "dashboard" in lines[1]
    steps = summary["steps"]
    assert steps >= 20  # 25 steps/s for 2 s, on a loaded machine
    rows = stored(db, "demo-test")
    for rank in range(3):
        train = [r[1] for r in rows if r[0] == rank and r[2] == "train"]
        checkpoints = [r[1] for r in rows if r[0] == rank and r[2] == "checkpoint"]
        assert train == list(range(steps))
        assert checkpoints == [s for s in range(1, steps) if s % 10 == 0]
    opened = sum(1 for r in rows if r[2] == "checkpoint")  # each checkpoint is opened by a marker sample
    assert summary["delivered"] == summary["samples"] == len(rows) + opened + 3  # and each rank's exit marker


def test_demo_ranks_look_like_the_h200_story(tmp_path):
    db = tmp_path / "demo.db"
    run_demo(ranks=2, duration=1.5, steps_per_s=40, db=str(db), run="demo-story", print_fn=lambda _l: None)
    import sqlite3

    con = sqlite3.connect(db)
    rows = con.execute("SELECT se.rank, MAX(s.allocated), MAX(s.total), MIN(s.nvml_used) FROM samples s "
                       "JOIN series se ON s.series = se.id WHERE se.run = 'demo-story' GROUP BY se.rank").fetchall()
    con.close()
    by_rank = {r[0]: r for r in rows}
    assert by_rank[0][2] == 143_771 * 2**20  # H200 as nvidia-smi reports it (MiB x 2^20)
    assert by_rank[0][1] > by_rank[1][1]  # rank 0 carries extra state
    assert by_rank[0][3] > 0  # NVML view present (not null)


@pytest.mark.parametrize("bad", [{"ranks": 0}, {"steps_per_s": 0}, {"duration": -1}])
def test_demo_bad_arguments_name_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        run_demo(**{"duration": 1.0, **bad})


def test_demo_serves_the_dashboard_while_it_runs(tmp_path):
    script = (
        "import sys, threading, urllib.request, json\n"
        "from vramwatch.cli import demo\n"
        "seen = {}\n"
        "def probe_dashboard(line):\n"
        "    print(line, flush=True)\n"
        "    if line.startswith('dashboard: '):\n"
        "        url = line.split()[1]\n"
        "        def check():\n"
        "            import time; deadline = time.time() + 7.0\n"
        "            seen['html'] = urllib.request.urlopen(url, timeout=10).status\n"
        "            # the hooks' POSTs land within a flush interval: 1 s, stretched to 10x a slow POST's\n"
        "            # latency (a cold first request on a loaded machine can take a few hundred ms)\n"
        "            while time.time() < deadline:\n"
        "                seen['runs'] = json.loads(urllib.request.urlopen(url + 'api/v1/runs', timeout=10).read())\n"
        "                if seen['runs'] and seen['runs'][0]['samples'] > 10: break\n"
        "                time.sleep(0.2)\n"
        "        threading.Thread(target=check).start()\n"
        "demo.run_demo(ranks=2, duration=8.0, steps_per_s=20, db=sys.argv[1], print_fn=probe_dashboard)\n"
        "print('CHECK', seen['html'], json.dumps(seen['runs']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "d.db")], capture_output=True, text=True,
                            timeout=60, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-2000:]
    check = next(line for line in result.stdout.splitlines() if line.startswith("CHECK"))
    status, runs = check.split(" ", 2)[1:]
    assert status == "200"
    (run,) = json.loads(runs)
    assert run["ranks"] == 2 and run["samples"] > 10
    assert "stopped after" in result.stdout


def test_cli_demo_subcommand(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vramwatch.cli", "demo", "--duration", "1.5", "--ranks", "2",
                             "--db", str(tmp_path / "cli.db")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dashboard: http://127.0.0.1:" in result.stdout
    assert "stopped after" in result.stdout and " 0 of " not in result.stdout


def test_an_oom_restarts_the_job_from_its_last_checkpoint_with_the_fix_the_advice_names(tmp_path):
    db = tmp_path / "demo.db"
    lines: list[str] = []
    summary = run_demo(ranks=2, duration=12.0, steps_per_s=500, db=str(db), run="demo-oom",
                       sim_params={"leak_rank": 1}, print_fn=lines.append)
    assert summary["restarts"] == 1
    oom = next(line for line in lines if "ran out of memory" in line)
    # the advice read the OOM's cause from the rank's story: the leak, to be fixed (not the batch)
    assert "advice: Fix first" in oom and "rank 1: leak (allocator)" in oom and "MiB/step" in oom
    import sqlite3

    con = sqlite3.connect(db)
    rows = con.execute("SELECT se.rank, se.incarnation, MIN(s.step), MAX(s.step), MAX(s.ooms) FROM samples s "
                       "JOIN series se ON s.series = se.id WHERE se.run = 'demo-oom' "
                       "GROUP BY se.id ORDER BY se.rank, MIN(s.ts)").fetchall()
    con.close()
    assert [r[0] for r in rows] == [0, 0, 1, 1]  # every rank: a first life and a resumed one
    first, resumed = rows[2], rows[3]
    assert first[1] != resumed[1] and first[4] >= 1  # the OOM (at a step or a checkpoint) was recorded
    assert resumed[2] % 500 == 1 and resumed[2] <= first[3]  # resumed after the last checkpoint
    assert resumed[4] == 0  # the leak is gone after the restart


def test_batch_raise_plays_the_procedure_live_following_the_advice(tmp_path):
    """180,224 proven, the job raises to 196,608 as advised, runs out of memory at its first
    checkpoint, backs off to 180,224 as advised: the batch in every process is the advice's."""
    db = tmp_path / "raise.db"
    lines: list[str] = []
    summary = run_demo(ranks=2, duration=20.0, steps_per_s=600, db=str(db), run="demo-raise",
                       scenario_name="batch-raise", print_fn=lines.append)
    text = "\n".join(lines)
    assert "advice: Raise to 49,152 global tokens per step (24,576 per rank, +9.1%)" in text, text[-3000:]
    assert "raise to 49,152 global tokens per step (24,576 per rank) as advised" in text
    oom = next(line for line in lines if line.lstrip().startswith("rank 0 ran out of memory at step"))
    assert "at 45,056 global tokens per step (22,528 per rank" in oom and "advice: Back off to 45,056 global" in oom
    assert summary["tokens_per_step"] == 22528 and summary["restarts"] == 2
    import sqlite3

    con = sqlite3.connect(db)
    batches = con.execute("SELECT se.incarnation, MIN(s.tokens), MAX(s.tokens), COUNT(*), "
                          "SUM(s.tokens IS NULL) FROM samples s JOIN series se ON s.series = se.id "
                          "WHERE se.run = 'demo-raise' AND se.rank = 0 AND s.phase = 0 "
                          "GROUP BY se.id ORDER BY MIN(s.ts)").fetchall()
    con.close()
    assert [(b[1], b[2]) for b in batches] == [(22528, 22528), (24576, 24576), (22528, 22528)]
    assert all(b[4] == 0 for b in batches)  # every training step sent its tokens


@pytest.mark.parametrize("name", ["healthy", "batch-raise", "batch-raise-holds", "leak", "oom-restart", "dead-rank",
                                  "fragmentation"])
def test_every_scenario_sends_tokens(tmp_path, name):
    from vramwatch.simulation.demo_runs import SCENARIOS

    assert set(SCENARIOS) == {"healthy", "batch-raise", "batch-raise-holds", "leak", "oom-restart", "dead-rank",
                              "fragmentation"}
    db = tmp_path / "t.db"
    run_demo(ranks=2, duration=1.0, steps_per_s=60, db=str(db), run="t", scenario_name=name,
             print_fn=lambda _l: None)
    import sqlite3

    con = sqlite3.connect(db)
    missing, total = con.execute("SELECT SUM(s.tokens IS NULL), COUNT(*) FROM samples s JOIN series se "
                                 "ON s.series = se.id WHERE s.phase = 0").fetchone()
    con.close()
    assert total > 20 and missing == 0


def test_a_killed_rank_stops_without_an_exit_while_the_job_goes_on(tmp_path):
    db = tmp_path / "dead.db"
    lines: list[str] = []
    run_demo(ranks=4, duration=3.0, steps_per_s=400, db=str(db), run="dead", scenario_name="dead-rank",
             print_fn=lines.append)
    assert any("rank 3 was killed at step 600" in line for line in lines)
    import sqlite3

    con = sqlite3.connect(db)
    ends = dict(con.execute("SELECT se.rank, MAX(s.step) FROM samples s JOIN series se ON s.series = se.id "
                            "GROUP BY se.rank").fetchall())
    exits = {r for (r,) in con.execute("SELECT DISTINCT se.rank FROM samples s JOIN series se ON s.series = se.id "
                                       "WHERE s.exited = 1")}
    con.close()
    assert ends[3] == 600 and min(ends[r] for r in (0, 1, 2)) > 900
    assert exits == {0, 1, 2}  # the killed process never closed cleanly


def test_fragmentation_is_to_be_fixed_and_names_its_rank(tmp_path):
    from vramwatch.cli.decisions import resolve
    from vramwatch.decisions.advice import advise

    db = tmp_path / "frag.db"
    run_demo(ranks=3, duration=6.0, steps_per_s=500, db=str(db), run="frag", scenario_name="fragmentation",
             sim_params={"frag_onset": 300}, print_fn=lambda _l: None)
    result = advise(resolve("frag", str(db)))
    assert result.readiness.verdict == "unsafe" and "fragmentation" in result.readiness.causes
    assert result.action == "fix" and result.next.because.cause == "fragmentation" and result.next.because.rank == 2


def test_cli_demo_lists_its_scenarios_and_refuses_an_unknown_one():
    listed = subprocess.run([sys.executable, "-m", "vramwatch.cli", "demo", "--list"], capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert {"batch-raise", "leak", "oom-restart", "dead-rank", "fragmentation", "healthy"} <= set(names)
    bad = subprocess.run([sys.executable, "-m", "vramwatch.cli", "demo", "--scenario", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "scenario" in bad.stderr


def test_ctrl_c_stops_the_demo_cleanly_with_everything_delivered(tmp_path):
    import signal
    import time

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # the child must not inherit SIG_IGN
    try:
        proc = subprocess.Popen([sys.executable, "-m", "vramwatch.cli", "demo", "--ranks", "2", "--db",
                                 str(tmp_path / "c.db")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        first = proc.stdout.readline()
        assert first.startswith("vramwatch demo: collector on http://127.0.0.1:")
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    stopped = next(line for line in out.splitlines() if "stopped after" in line)
    delivered, _of, samples = stopped.split("; ")[1].split()[:3]
    assert int(samples) > 0 and delivered == samples
