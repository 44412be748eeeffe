"""The hook speaks up once when nobody listens: a real hook process pointed at a port where no
collector runs yet, then a real collector (``vramwatch serve``) started on that port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from collector_process import CollectorProcess
from helpers import stored

_TRAIN = """
import sys, time, warnings
warnings.simplefilter("default")
import vramwatch
url, spool, flag = sys.argv[1], sys.argv[2], sys.argv[3]
vw = vramwatch.init(url=url, run="reach", rank=0, probe="simulated", spool_dir=spool, backoff_max_s=0.5,
                    flush_interval_s=0.1)
from pathlib import Path
step = 0
deadline = time.time() + 60
while time.time() < deadline:
    vw.step(step); step += 1
    time.sleep(0.01)
    if Path(flag).exists() and vw.stats()["delivered"] >= step - 1 and step > 50:
        break
print("steps", step, flush=True)
vw.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_collector_is_named_once_and_its_return_once(tmp_path: Path) -> None:
    port = _free_port()
    flag = tmp_path / "collector-up"
    hook = subprocess.Popen([sys.executable, "-c", _TRAIN, f"http://127.0.0.1:{port}", str(tmp_path / "spool"),
                             str(flag)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)  # the hook steps ~300 times and retries many times against a closed port
    collector = CollectorProcess(tmp_path / "vw.db", port=port).start()
    try:
        flag.touch()
        out, err = hook.communicate(timeout=90)
    finally:
        collector.terminate()
    steps = int(out.split()[-1])
    said = [line for line in err.splitlines() if "RuntimeWarning: vramwatch:" in line]
    unreachable = [line for line in said if "cannot reach the collector" in line]
    back = [line for line in said if "answers again" in line]
    assert len(unreachable) == 1, err
    assert f"127.0.0.1:{port}" in unreachable[0] and str(tmp_path / "spool") in unreachable[0]
    assert "MiB" in unreachable[0]  # the spool's cap
    assert len(back) == 1, err
    assert stored(str(tmp_path / "vw.db"), "reach") >= steps  # the spooled steps arrived
