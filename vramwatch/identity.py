"""Who is this process: run, host, rank, incarnation, from the launcher's environment.

``run`` must be equal on every rank of one job without any coordination between ranks,
so it is derived only from values the launcher hands to every rank alike:

1. ``run=`` given to :func:`vramwatch.init` or ``VRAMWATCH_RUN``;
2. torchrun: ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; a uuid with ``--standalone``). torchrun's
   default id is the literal ``"none"``, which is not unique, so then the rendezvous endpoint
   ``MASTER_ADDR:MASTER_PORT`` names the run instead;
3. SLURM: ``SLURM_JOB_ID`` (array jobs: ``SLURM_ARRAY_JOB_ID`` + ``SLURM_ARRAY_TASK_ID``);
4. a single process: ``<host>-<start time>-<pid>``.

``incarnation`` is a fresh random id per process start, so a rank restarted by torchrun
(same run, same rank) is told apart from its previous life and its steps do not collide
with the old ones in the store.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from typing import TypedDict

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@+=-]+")


class Identity(TypedDict):
    run: str
    host: str
    rank: int
    local_rank: int
    world_size: int
    incarnation: str
    pid: int


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                number = int(value)
            except ValueError:
                continue  # a garbled launcher variable must not stop training
            if number >= 0:
                return number
    return None


def _clean(value: str, limit: int = 128) -> str:
    # wire names: 1-128 characters, no control characters; keep them shell/URL friendly too
    cleaned = _UNSAFE.sub("-", value.strip()).strip("-")
    return cleaned[:limit] or "run"


def run_from_env(env: Mapping[str, str], host: str) -> str:
    explicit = env.get("VRAMWATCH_RUN", "").strip()
    if explicit:
        return _clean(explicit)
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic != "none":
        return _clean(f"torchrun-{elastic}")
    if elastic == "none" or ("RANK" in env and "MASTER_ADDR" in env):
        addr = env.get("MASTER_ADDR", "localhost").strip() or "localhost"
        port = env.get("MASTER_PORT", "").strip() or "0"
        return _clean(f"torchrun-{addr}-{port}")
    array_job = env.get("SLURM_ARRAY_JOB_ID", "").strip()
    if array_job:
        return _clean(f"slurm-{array_job}_{env.get('SLURM_ARRAY_TASK_ID', '0').strip()}")
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        return _clean(f"slurm-{job}")
    # the process's start, not now: a second init() in one process (a notebook cell run again)
    # names the same run
    return _clean(f"{host}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(_process_started()))}-{os.getpid()}")


_STARTED: tuple[int, float] = (os.getpid(), time.time())


def _process_started() -> float:
    """When this process first asked (a forked child asks anew: its own pid, its own start)."""
    global _STARTED
    if _STARTED[0] != os.getpid():
        _STARTED = (os.getpid(), time.time())
    return _STARTED[1]


def new_incarnation() -> str:
    """A per-process-start id: start time (for humans sorting) + 32 random bits."""
    return f"{int(time.time()):x}-{secrets.token_hex(4)}"


def resolve(
    *,
    run: str | None = None,
    host: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Identity:
    """Fill every identity field: explicit arguments first, then the launcher's environment."""
    env = os.environ if env is None else env
    if host is None:
        host = env.get("VRAMWATCH_HOST") or env.get("SLURMD_NODENAME") or socket.gethostname() or "localhost"
    host = _clean(host)
    if rank is None:
        rank = _env_int(env, "RANK", "SLURM_PROCID")
    if local_rank is None:
        local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID")
    if world_size is None:
        world_size = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
    rank = 0 if rank is None else int(rank)
    return Identity(
        run=_clean(run) if run else run_from_env(env, host),
        host=host,
        rank=rank,
        local_rank=rank if local_rank is None else int(local_rank),
        world_size=max(1, rank + 1) if world_size is None else int(world_size),
        incarnation=new_incarnation(),
        pid=os.getpid(),
    )


__all__ = ["Identity", "new_incarnation", "resolve", "run_from_env"]
