"""Host memory of the training process, polled off the training thread.

Per sample (the latest poll, at most ``interval_s`` old; phase ends read afresh so a
checkpoint's host peak is caught):

* ``host_rss_bytes``: this process's resident set (``/proc/self/statm``);
* ``host_children_rss_bytes``: the sum over its descendants (DataLoader workers, compile
  workers), from ``/proc/<pid>/task/*/children`` (else a ``/proc`` scan for parent PIDs);
* ``host_available_bytes``: the node's ``MemAvailable`` (``/proc/meminfo``): what the
  kernel could still give before the OOM-killer;
* ``host_pinned_bytes``: torch's pinned host allocator (``host_memory_stats``), None when
  torch cannot say.

Reading all four costs ~0.1-1 ms (more with many children): never on the training thread
per step. Off Linux (no ``/proc``) the fields are None, never zeros.

Phase peaks: a checkpoint can materialise a whole state dict on the host and free it before
the phase ends (FSDP ``state_dict``: the host OOM-killer's favourite moment). So a phase
sample's ``host_rss_bytes`` is the process's *peak* RSS during the phase: at phase start
the kernel's high-water mark is reset (``/proc/self/clear_refs`` ← ``5``), at phase end
``VmHWM`` is read. Side effect, like ``reset_peak_memory_stats``: ``VmHWM`` and
``getrusage().ru_maxrss`` of this process then count from the latest phase start; the
poller keeps the run-long maximum (``stats()['host_rss_max_bytes']``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramwatch.wire import fields_of

#: the sample fields this poller fills (the table's "host" group)
HOST_FIELDS = fields_of(group="host")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PROC = Path("/proc")


def rss_bytes(pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def peak_rss_bytes() -> int | None:
    """The kernel's high-water mark of this process's RSS (``VmHWM``), None off Linux."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def _children(pid: int) -> list[int] | None:
    """Direct children via /proc/<pid>/task/*/children; None when the kernel lacks it."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(c) for c in fh.read().split())
        except FileNotFoundError:
            return None if tid == str(pid) else out  # no CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return out


def _children_by_scan() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_bytes()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    direct = _children(pid)
    tree = _children_by_scan() if direct is None else None
    stack = list(direct if direct is not None else tree.get(pid, []))  # type: ignore[union-attr]
    while stack and len(found) < 4096:
        child = stack.pop()
        found.append(child)
        grand = _children(child) if tree is None else tree.get(child, [])
        stack.extend(grand or [])
    return found


def children_rss_bytes(pid: int) -> int | None:
    if not _PROC.is_dir():
        return None
    total = 0
    for child in descendants(pid):
        rss = rss_bytes(child)
        if rss is not None:  # a child that exited between listing and reading holds nothing
            total += rss
    return total


def read_host(pid: int, pinned: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """One reading of the four host fields (None where the platform cannot say)."""
    pinned_bytes = None
    if pinned is not None:
        with contextlib.suppress(Exception):
            pinned_bytes = pinned()
    return {"host_rss_bytes": rss_bytes(pid), "host_children_rss_bytes": children_rss_bytes(pid),
            "host_available_bytes": available_bytes(), "host_pinned_bytes": pinned_bytes}


_shared: dict[int, HostPoller] = {}
_shared_lock = threading.Lock()


class HostPoller:
    """Polls :func:`read_host` on a daemon thread; ``latest`` is the dict a sample is updated with.

    Host memory is per process, so every monitor of a process shares one poller
    (:meth:`start`/:meth:`release`): a load generator with 512 ranks in a process runs one
    host thread, not 512.
    """

    def __init__(self, interval_s: float, pinned: Callable[[], int | None] | None = None) -> None:
        self.interval_s = max(0.05, float(interval_s))
        self.pinned = pinned
        self.pid = os.getpid()
        self.latest: dict[str, Any] = {}
        self.polls = self.errors = 0
        self.users = 0
        self.max_rss = 0  # run-long peak RSS, kept across the phase resets of VmHWM
        self._phases = 0  # open phases (nested phases share one reset)
        self._stop = threading.Event()
        self.poll_once()
        self._thread = threading.Thread(target=self._run, name="vramwatch-host", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, interval_s: float, pinned: Callable[[], int | None] | None = None) -> HostPoller:
        """This process's shared poller (started on first use). Pair with :meth:`release`."""
        with _shared_lock:
            poller = _shared.get(os.getpid())
            if poller is None or poller._stop.is_set():
                poller = _shared[os.getpid()] = cls(interval_s, pinned)
            elif pinned is not None and poller.pinned is None:
                poller.pinned = pinned
            poller.users += 1
            return poller

    def release(self) -> None:
        """One monitor is done with it; the last one stops the thread."""
        with _shared_lock:
            self.users -= 1
            if self.users > 0:
                return
            if _shared.get(self.pid) is self:
                del _shared[self.pid]
        self.close()

    def poll_once(self) -> dict[str, Any]:
        try:
            reading = read_host(self.pid, self.pinned)
        except Exception:
            self.errors += 1
            return self.latest
        self.latest = {k: v for k, v in reading.items() if v is not None}  # replaced whole: one atomic store
        self.polls += 1
        return self.latest

    def begin_phase(self) -> None:
        """Start measuring a phase's peak RSS (see the module docstring). Phase starts only."""
        if self.pid != os.getpid():
            return
        if self._phases == 0:
            self.max_rss = max(self.max_rss, peak_rss_bytes() or 0)
            reset_peak_rss()
        self._phases += 1

    def end_phase(self) -> dict[str, Any]:
        """A fresh reading whose ``host_rss_bytes`` is the peak since the (outermost) phase began."""
        reading = dict(self.poll_once())
        if self._phases > 0:
            self._phases -= 1
            peak = peak_rss_bytes()
            if peak is not None and peak > reading.get("host_rss_bytes", 0):
                reading["host_rss_bytes"] = peak
        self.max_rss = max(self.max_rss, reading.get("host_rss_bytes", 0))
        return reading

    def stats(self) -> dict[str, Any]:
        return {"host_polls": self.polls, "host_errors": self.errors,
                "host_rss_max_bytes": max(self.max_rss, peak_rss_bytes() or 0) or None}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._pid_is_ours() and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _pid_is_ours(self) -> bool:
        return self.pid == os.getpid()


__all__ = ["HOST_FIELDS", "HostPoller", "available_bytes", "children_rss_bytes", "descendants", "peak_rss_bytes",
           "read_host", "reset_peak_rss", "rss_bytes"]
