"""Foreign processes by name: the hooks' side-channel reports, kept per rank, on /metrics.

``POST /api/v1/processes`` (ingest credentials) carries a :class:`ProcessReport`: the
processes other than the trainer that NVML lists on a rank's GPU, named from ``/proc`` on the
rank's host (:mod:`vramwatch.evidence.foreign`). The collector keeps the latest report per
rank (:class:`ProcessBook`): in memory, and per run in a JSON file beside the database
(``<db>.processes/``, rewritten only when a rank's list changes; at most ``max_runs`` files,
the oldest removed), so the post-mortem and ``vramwatch postmortem --db`` still name them after
a restart. A process whose PID is a rank of the same run on the same host is that rank, not
foreign: it is left out wherever reports are read (:func:`foreign_only`).

``vramwatch_foreign_process_used_bytes{run,rank,Hostname,UUID,gpu,pid,process,container,
description,device}`` exposes each named process while its run is on /metrics (``description``:
"a Jupyter kernel (pid 4242, ipykernel_launcher)"; ``device``: "GPU 3" as the host numbers it);
the ``VramwatchForeignProcessOnGPU`` alert joins it in its annotation.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from vramwatch.evidence.foreign import ProcessReport, holds
from vramwatch.probe.nvml import MAX_FOREIGN
from vramwatch.probe.processes import MAX_CMDLINE, MAX_COMM, ForeignProcess
from vramwatch.redact import redact_text
from vramwatch.wire import MAX_INT, MAX_NAME, MIN_TS

#: the body of POST /api/v1/processes, at most
MAX_BODY_BYTES = 64 * 1024
FAMILY = "vramwatch_foreign_process_used_bytes"
FAMILY_HELP = ("Device memory NVML lists for one named process on a training GPU that is not a rank of the run "
               "(pid, process name, container, a description and the GPU as the host numbers it, as labels).")
LABELS = ("run", "rank", "Hostname", "UUID", "gpu", "pid", "process", "container", "description", "device")

_Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]


class ProcessBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    pid: int = Field(ge=0, le=2**31)
    used_bytes: int | None = Field(ge=0, le=MAX_INT)
    name: str = Field("", max_length=MAX_COMM)
    cmdline: str = Field("", max_length=MAX_CMDLINE)
    container: str = Field("", max_length=64, pattern=r"^[0-9a-f]*$")


class ReportBody(BaseModel):
    """The side channel's body; strict: every field named, typed and bounded, nothing else."""

    model_config = ConfigDict(strict=True, extra="forbid")

    run: _Name
    host: _Name
    rank: int = Field(ge=0, le=MAX_INT)
    ts: float = Field(ge=MIN_TS, le=4102444800.0)
    gpu: int | None = Field(None, ge=0, le=4096)
    uuid: str | None = Field(None, max_length=MAX_NAME)
    processes: list[ProcessBody] = Field(max_length=MAX_FOREIGN)

    def report(self) -> ProcessReport:
        procs = tuple(ForeignProcess(p.pid, p.used_bytes, redact_text(p.name), redact_text(p.cmdline), p.container)
                      for p in self.processes)  # redacted again on receipt: a hook of any version, or none
        return ProcessReport(self.run, self.host, self.rank, self.ts, self.gpu, self.uuid, procs)


def report_doc(report: ProcessReport) -> dict[str, Any]:
    """A report as the API serves it: each process with its description and the one sentence."""
    device = report.device()
    doc = report.to_dict()
    doc["device"] = device
    doc["processes"] = [{**p.to_dict(), "summary": holds(p, device)} for p in report.processes]
    return doc


def rank_pids(live: Any, run: str) -> dict[str, set[int]]:
    """PIDs of the run's ranks per host (from their latest samples)."""
    out: dict[str, set[int]] = {}
    for series in live.for_run(run) if live is not None else ():
        pid = (series.last or {}).get("pid")
        if pid is not None:
            out.setdefault(series.host, set()).add(pid)
    return out


def foreign_only(report: ProcessReport, pids: dict[str, set[int]]) -> ProcessReport:
    """The report without processes that are ranks of the same run on the same host."""
    mine = pids.get(report.host, set())
    if not mine.intersection(p.pid for p in report.processes):
        return report
    kept = tuple(p for p in report.processes if p.pid not in mine)
    return ProcessReport(report.run, report.host, report.rank, report.ts, report.gpu, report.uuid, kept)


class ProcessBook:
    """Latest report per rank, by run; persisted per run (see the module docstring). Thread-safe."""

    def __init__(self, folder: str | os.PathLike[str] | None, *, max_runs: int = 1024) -> None:
        self.folder = None if folder is None else Path(folder)
        self.max_runs = max_runs
        self._runs: dict[str, dict[tuple[str, int], ProcessReport]] = {}
        self._received: dict[tuple[str, str, int], float] = {}
        self._lock = threading.Lock()

    @classmethod
    def beside(cls, db_path: str, **kw: Any) -> ProcessBook:
        return cls(str(db_path) + ".processes", **kw)

    def _file(self, run: str) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / (hashlib.sha256(run.encode()).hexdigest()[:32] + ".json")

    def _loaded(self, run: str) -> dict[tuple[str, int], ProcessReport]:
        ranks = self._runs.get(run)
        if ranks is None:
            ranks = {}
            path = self._file(run)
            try:
                doc = json.loads(path.read_text()) if path is not None and path.is_file() else {}
                for item in doc.get("reports", []) if doc.get("run") == run else []:
                    report = ProcessReport.from_dict(item)
                    ranks[(report.host, report.rank)] = report
            except (OSError, ValueError, KeyError, TypeError):
                ranks = {}  # a damaged file names nothing rather than something wrong
            if len(self._runs) >= self.max_runs:
                self._runs.pop(next(iter(self._runs)))
            self._runs[run] = ranks
        return ranks

    def put(self, report: ProcessReport, now: float | None = None) -> None:
        key = (report.host, report.rank)
        with self._lock:
            ranks = self._loaded(report.run)
            before = ranks.get(key)
            if report.processes:
                ranks[key] = report
            else:
                ranks.pop(key, None)
            self._received[(report.run, *key)] = time.time() if now is None else now
            if before is None or before.processes != report.processes:
                self._write(report.run, ranks)

    def _write(self, run: str, ranks: dict[tuple[str, int], ProcessReport]) -> None:
        path = self._file(run)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name("." + path.name + ".tmp")
        tmp.write_text(json.dumps({"run": run, "reports": [r.to_dict() for r in ranks.values()]}))
        os.replace(tmp, path)
        files = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - self.max_runs)]:
            old.unlink(missing_ok=True)

    def run(self, run: str) -> list[ProcessReport]:
        with self._lock:
            return sorted(self._loaded(run).values(), key=lambda r: (r.rank, r.host))

    def received(self, run: str, host: str, rank: int) -> float | None:
        return self._received.get((run, host, rank))

    def reporting_runs(self) -> set[str]:
        """Runs with a report in memory (a live hook re-sends its report every minute)."""
        with self._lock:
            return {run for run, ranks in self._runs.items() if ranks}


class ForeignProcessCollector(Collector):
    """:data:`FAMILY` for the runs on /metrics (same labels as the rank families, plus the
    process's). ``render_text`` writes the same samples as ``collect``."""

    def __init__(self, book: ProcessBook, live: Any, exported: Callable[[], set[tuple[str, str, int]]]) -> None:
        self.book, self.live, self.exported = book, live, exported

    def _rows(self) -> Iterator[tuple[tuple[str, ...], int]]:
        keys = self.exported()
        # only runs that have reports: a scrape of 4,096 ranks without any costs one set operation
        for run in sorted(self.book.reporting_runs() & {k[0] for k in keys}):
            pids = rank_pids(self.live, run)
            for report in self.book.run(run):
                series = self.live.get(run, report.host, report.rank)
                if (run, report.host, report.rank) not in keys or series is None:
                    continue
                for p in foreign_only(report, pids).processes:
                    if p.used_bytes is None:
                        continue
                    yield ((run, str(report.rank), report.host, series.uuid or "",
                            "" if series.gpu is None else str(series.gpu), str(p.pid), p.name, p.container,
                            p.describe(), report.device()), p.used_bytes)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(FAMILY, FAMILY_HELP, labels=LABELS)
        for labels, value in self._rows():
            family.add_metric(list(labels), float(value))
        yield family

    def render_text(self) -> str:
        parts = [f"# HELP {FAMILY} {FAMILY_HELP}\n# TYPE {FAMILY} gauge\n"]
        for labels, value in self._rows():
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(LABELS, labels, strict=True))
            parts.append(f"{FAMILY}{{{text}}} {value}\n")
        return "".join(parts)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
