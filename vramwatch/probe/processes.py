"""Who another process on the training GPU is: name, command line, container, from ``/proc``.

NVML lists the processes holding memory on a GPU by PID and bytes
(``nvmlDeviceGetComputeRunningProcesses`` / ``GetGraphicsRunningProcesses``). A PID means
something only in the PID namespace NVML answered in; :mod:`vramwatch.probe.nvml` names
processes only when the trainer finds its own PID in the list (same namespace), so a PID here
is never read from another process's ``/proc``.

Reads are bounded (``comm`` 64 bytes, ``cmdline`` 4 KiB, ``cgroup`` 8 KiB) and cached per
(PID, start time): a PID reused by a new process is read again, a known one costs one read of
``/proc/PID/stat`` per poll (about 10 µs), on the NVML poller's thread, never the training
thread. A process that is gone, or whose ``/proc`` files this user may not read, keeps what was
readable (often just the PID: "when visible from the host").

Command lines leave the host (to the collector), and people put secrets in them: every secret
(URL userinfo, secret-named options and variables, headers, ``curl -u``: the forms
:mod:`vramwatch.redact` lists) is replaced by ``***`` before anything is kept.

:class:`ForeignProcess` is the record every consumer shares (the hook's report, the
collector's API and metrics, the post-mortem); :meth:`ForeignProcess.describe` is the one
sentence that names it ("a Jupyter kernel (pid 4242, ipykernel_launcher)").
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vramwatch.redact import redact_args

MAX_COMM = 64
MAX_CMDLINE = 512  # kept (and sent); 4 KiB are read
_READ_CMDLINE = 4096
_READ_CGROUP = 8192
#: container ids as cgroup paths spell them (docker, containerd/CRI, CRI-O, podman): 64 hex digits
_CONTAINER_RE = re.compile(r"(?:docker|cri-containerd|crio|libpod)?[-/:]?([0-9a-f]{64})(?:\.scope)?(?:/|$)")

#: (kind, words): the first whose word appears in the program or the command line names the kind
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("a Jupyter kernel", ("ipykernel", "jupyter", "colab_kernel")),
    ("an inference server", ("vllm", "sglang", "tritonserver", "text-generation-launcher", "ollama",
                             "lmdeploy", "tensorrt_llm")),
    ("a display server", ("xorg", "xwayland", "gnome-shell", "kwin", "gdm")),
    ("a Python process", ("python",)),
)


@dataclass(frozen=True)
class ForeignProcess:
    """A process holding memory on a training GPU that is not this rank."""

    pid: int
    #: what NVML attributes to it (None: NVML does not say, e.g. under WDDM)
    used_bytes: int | None
    name: str = ""  # /proc/PID/comm
    cmdline: str = ""  # arguments joined by spaces, at most MAX_CMDLINE characters
    container: str = ""  # the container id's first 12 hex digits, when the cgroup names one

    @property
    def program(self) -> str:
        """What runs: ``-m``'s module, else the script, else the executable's name."""
        args = self.cmdline.split()
        if not args:
            return self.name or "unknown"
        exe = os.path.basename(args[0])
        if exe.startswith("python"):
            for i, arg in enumerate(args[1:], 1):
                if arg == "-m" and i + 1 < len(args):
                    return args[i + 1]
                if arg == "-c":
                    return f"{exe} -c"
                if not arg.startswith("-"):
                    return os.path.basename(arg)
        return exe

    @property
    def kind(self) -> str:
        text = f"{self.program} {self.name} {self.cmdline}".lower()
        return next((kind for kind, words in KINDS if any(w in text for w in words)), "a process")

    def describe(self) -> str:
        """``a Jupyter kernel (pid 4242, ipykernel_launcher)``, plus the container when known."""
        where = f", container {self.container}" if self.container else ""
        return f"{self.kind} (pid {self.pid}, {self.program}{where})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "description": self.describe()}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ForeignProcess:
        return cls(int(doc["pid"]), None if doc.get("used_bytes") is None else int(doc["used_bytes"]),
                   str(doc.get("name") or ""), str(doc.get("cmdline") or ""), str(doc.get("container") or ""))


def _read(path: Path, limit: int) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit)
    except OSError:
        return None


def _text(raw: bytes | None) -> str:
    return "" if raw is None else raw.decode("utf-8", "replace")


def redact(args: list[str]) -> list[str]:
    """Arguments with their secrets replaced: :func:`vramwatch.redact.redact_args`, the one
    redaction the collector applies again on receipt."""
    return redact_args(args)


def _printable(text: str, limit: int) -> str:
    return "".join(c if c.isprintable() else " " for c in text).strip()[:limit]


def start_time(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (after the parenthesised name, which may hold spaces)."""
    raw = _text(_read(proc / str(pid) / "stat", 1024))
    tail = raw.rpartition(")")[2].split()
    return tail[19] if len(tail) > 19 else None


def container_id(cgroup: str) -> str:
    """The container id a ``/proc/PID/cgroup`` names (first 12 hex digits), else ''."""
    for line in cgroup.splitlines():
        found = _CONTAINER_RE.search(line.rpartition(":")[2])
        if found:
            return found.group(1)[:12]
    return ""


def identify(pid: int, used_bytes: int | None, proc: Path = Path("/proc")) -> ForeignProcess:
    """What ``/proc`` says about ``pid``, each read bounded; unreadable parts stay empty."""
    base = proc / str(pid)
    name = _printable(_text(_read(base / "comm", MAX_COMM)), MAX_COMM)
    args = _text(_read(base / "cmdline", _READ_CMDLINE)).split("\0")
    cmdline = _printable(" ".join(redact([a for a in args if a])), MAX_CMDLINE)
    return ForeignProcess(pid, used_bytes, name, cmdline, container_id(_text(_read(base / "cgroup", _READ_CGROUP))))


class ProcessNames:
    """``identify`` with a cache keyed by (PID, start time); bounded to ``max_entries`` PIDs."""

    def __init__(self, proc: Path = Path("/proc"), max_entries: int = 256) -> None:
        self.proc = proc
        self.max_entries = max_entries
        self._known: dict[int, tuple[str | None, ForeignProcess]] = {}
        self.reads = 0

    def lookup(self, pid: int, used_bytes: int | None) -> ForeignProcess:
        started = start_time(pid, self.proc)
        hit = self._known.get(pid)
        if hit is None or hit[0] != started:
            if len(self._known) >= self.max_entries:
                self._known.clear()
            self.reads += 1
            hit = self._known[pid] = (started, identify(pid, None, self.proc))
        known = hit[1]
        return ForeignProcess(pid, used_bytes, known.name, known.cmdline, known.container)


__all__ = ["KINDS", "ForeignProcess", "ProcessNames", "container_id", "identify", "redact", "start_time"]
