"""`vramwatch analyze`: stream trace files through one TrendEngine per series.

Memory is bounded by the number of series (and the events they raise), never by the
number of samples: files are read line by line, validated, and folded in.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterable
from typing import Any

from ..wire import Sample, WireError, iter_samples
from .core import EngineConfig, TrendEngine

#: Events kept per series in the document; beyond it only a count is kept.
MAX_EVENTS_PER_SERIES = 10_000


class _Series:
    __slots__ = ("dropped_events", "engine", "events", "update")

    def __init__(self, config: EngineConfig | None) -> None:
        self.engine = TrendEngine(config)
        self.update = self.engine.update  # bound once: this is the per-sample call
        self.events: list[dict[str, Any]] = []
        self.dropped_events = 0


def analyze_paths(paths: Iterable[str | os.PathLike[str]], config: EngineConfig | None = None) -> dict[str, Any]:
    """The `vramwatch analyze --json` document for trace files (.jsonl / .jsonl.gz).

    Samples are fed in file order, files in the given order. Raises
    :class:`~vramwatch.wire.WireError` naming the file (and line) that cannot be read.
    """
    series: dict[tuple[str, str, int], _Series] = {}
    for path in paths:
        name = os.fspath(path)
        try:
            _fold(series, iter_samples(name), config)
        except WireError:
            raise
        except FileNotFoundError:
            raise WireError(name, "no such file") from None
        except IsADirectoryError:
            raise WireError(name, "is a directory, not a trace file") from None
        except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise WireError(name, f"cannot read: {exc}") from None
        except UnicodeDecodeError as exc:
            raise WireError(name, f"not a JSON Lines trace: {exc}") from None
    return _document(series)


def analyze_samples(samples: Iterable[Sample], config: EngineConfig | None = None) -> dict[str, Any]:
    """The same document for validated samples from any source (``--from FORMAT`` importers)."""
    series: dict[tuple[str, str, int], _Series] = {}
    _fold(series, samples, config)
    return _document(series)


def _fold(series: dict[tuple[str, str, int], _Series], samples: Iterable[Sample], config: EngineConfig | None) -> None:
    for sample in samples:
        key = (sample["run"], sample["host"], sample["rank"])
        entry = series.get(key)
        if entry is None:
            entry = series[key] = _Series(config)
        new = entry.update(sample)
        if new:
            room = MAX_EVENTS_PER_SERIES - len(entry.events)
            entry.events.extend(new[:room])
            entry.dropped_events += max(0, len(new) - room)


def _document(series: dict[tuple[str, str, int], _Series]) -> dict[str, Any]:
    out = []
    for (run, host, rank), entry in sorted(series.items()):
        engine = entry.engine
        item: dict[str, Any] = {
            "run": run,
            "host": host,
            "rank": rank,
            "state": engine.state,
            "events": entry.events,
            "samples": engine.samples,
            "summary": engine.summary(),
        }
        if entry.dropped_events:
            item["events_dropped"] = entry.dropped_events
        out.append(item)
    return {"series": out}


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f} GB"


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _describe(event: dict[str, Any]) -> str:
    kind = event["type"]
    step = event["step"]
    if kind == "leak":
        return (
            f"step {step}: LEAK ({event.get('source')}) {event['slope_bytes_per_step'] / 1e6:.2f} MB/step, "
            f"OOM in {_steps(event.get('steps_to_oom'))} steps ({_duration(event.get('seconds_to_oom'))})"
        )
    if kind == "fragmentation":
        return (
            f"step {step}: FRAGMENTATION reserved-allocated {_gb(event.get('reserved_minus_allocated_bytes'))}, "
            f"split {_gb(event.get('inactive_split_bytes'))}, retries {event.get('alloc_retries')}; "
            f"{event.get('recommendation')}"
        )
    if kind in ("checkpoint_spike", "eval_spike", "phase_spike", "periodic_spike"):
        return (
            f"step {step}: {kind} peak {_gb(event.get('peak_bytes'))}, "
            f"+{_gb(event.get('above_plateau_bytes'))} above plateau, headroom {_gb(event.get('headroom_bytes'))}"
        )
    if kind == "plateau":
        return f"step {step}: plateau at {_gb(event.get('plateau_bytes'))} reserved"
    if kind == "plateau_break":
        return f"step {step}: plateau break ({event.get('cause')}) from {_gb(event.get('plateau_bytes'))}"
    if kind == "restart":
        return f"step {step}: restart (was at step {event.get('from_step')})"
    if kind == "oom":
        return f"step {step}: OOM (count {event.get('ooms')})"
    return f"step {step}: {kind}"


def format_table(doc: dict[str, Any], max_events: int = 12) -> str:
    """Readable per-rank view of an analyze document."""
    header = ("run", "host", "rank", "state", "plateau", "headroom", "slope/step", "steps to OOM", "time to OOM")
    rows = []
    for item in doc["series"]:
        summary = item.get("summary", {})
        slope = summary.get("slope_bytes_per_step")
        rows.append(
            (
                str(item["run"]),
                str(item["host"]),
                str(item["rank"]),
                item["state"].upper() if item["state"] in ("leak", "fragmentation") else item["state"],
                _gb(summary.get("plateau_bytes")),
                _gb(summary.get("headroom_bytes")),
                "-" if slope is None else f"{slope / 1e6:.2f} MB",
                _steps(summary.get("steps_to_oom")),
                _duration(summary.get("seconds_to_oom")),
            )
        )
    if not rows:
        return "no samples\n"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    lines.append("")
    for item in doc["series"]:
        notable = [e for e in item["events"] if e["type"] not in ("checkpoint_spike", "eval_spike", "phase_spike")]
        spikes = [e for e in item["events"] if e["type"] in ("checkpoint_spike", "eval_spike", "phase_spike")]
        if not notable and not spikes:
            continue
        lines.append(f"{item['run']} {item['host']} rank {item['rank']}:")
        for event in notable[-max_events:]:
            lines.append("  " + _describe(event))
        if spikes:
            worst = min(spikes, key=lambda e: e.get("headroom_bytes", 0))
            lines.append(f"  {len(spikes)} phase spikes; tightest: " + _describe(worst))
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["MAX_EVENTS_PER_SERIES", "analyze_paths", "analyze_samples", "format_table"]
