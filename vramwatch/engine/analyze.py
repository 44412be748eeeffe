"""`vramwatch analyze`: stream trace files through one TrendEngine per series.

Memory is bounded by the number of series (and the events they raise), never by the
number of samples or by what a line holds: files are read in 1 MiB blocks split into lines
(:class:`vramwatch.bounded.Lines`), each line decoded, validated and folded in; a line
longer than ``max_line_bytes`` (1 MiB) is never held whole: it is a bad line, named.

Messy files: by default a bad line (invalid JSON, a sample that fails validation) is
counted, named (``file:line: field: message``, the first :data:`MAX_BAD_LINES` kept) and
skipped; ``strict=True`` raises :class:`~vramwatch.wire.WireError` on the first one. A
file that cannot be read at all (missing, a directory, broken gzip) always raises.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Iterable
from typing import Any

import orjson

from vramwatch.bounded import LONG_LINE, Lines, open_input
from vramwatch.engine.config import EngineConfig
from vramwatch.engine.core import TrendEngine
from vramwatch.units import duration as _duration
from vramwatch.units import gib, mib, rate
from vramwatch.wire import Sample, WireError, decode_line, validate
from vramwatch.wire.structs import as_sample
from vramwatch.wire.tracefile import MAX_LINE_BYTES, long_line

#: Events kept per series in the document; beyond it only a count is kept.
MAX_EVENTS_PER_SERIES = 10_000
#: Bad lines named in the document (all are counted).
MAX_BAD_LINES = 20


class _Series:
    __slots__ = ("dropped_events", "engine", "events", "update", "update_struct")

    def __init__(self, config: EngineConfig | None) -> None:
        self.engine = TrendEngine(config)
        self.update = self.engine.update  # bound once: these are the per-sample calls
        self.update_struct = self.engine.update_struct
        self.events: list[dict[str, Any]] = []
        self.dropped_events = 0

    def keep(self, new: list[dict[str, Any]]) -> None:
        """Keep new events up to :data:`MAX_EVENTS_PER_SERIES`, count the rest (called only when
        a sample raised events, which is rare: the per-sample cost stays the bound update)."""
        room = MAX_EVENTS_PER_SERIES - len(self.events)
        self.events.extend(new[:room])
        self.dropped_events += max(0, len(new) - room)


class _BadLines:
    """Counts bad lines and keeps the first few, named; raises at once when strict."""

    __slots__ = ("count", "named", "strict")

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.count = 0
        self.named: list[str] = []

    def add(self, where: str, field: str, message: str) -> None:
        if self.strict:
            raise WireError(f"{where}: {field}" if field else where, message)
        self.count += 1
        if len(self.named) < MAX_BAD_LINES:
            self.named.append(f"{where}: {field}: {message}" if field else f"{where}: {message}")




def _feed(name: str, series: dict[tuple[str, str, int], _Series], config: EngineConfig | None,
          bad: _BadLines, max_line_bytes: int = MAX_LINE_BYTES) -> None:
    """The per-sample loop: decode, validate, find the series, fold in.

    Kept flat because it is the hot path. Lines come in ~1 MiB blocks but each is
    decoded and folded in at once, while its dict is still in cache (decoding a whole chunk
    first and folding afterwards measured ~30 % slower). Each line is its own JSON document.
    A line is decoded and validated in one C pass (:func:`vramwatch.wire.decode_line`); a line
    it does not accept as written takes ``orjson.loads`` + ``wire.validate``, which rewrite whole
    floats or name the bad field. A plainly valid schema-1 line stays a decoded struct that the
    engine reads by attribute (``TrendEngine.update_struct``: the same verdicts as its dict,
    which is built only for the samples the engine keeps); building every sample's dict cost as
    much as the engine itself.
    """
    loads, decode = orjson.loads, decode_line
    entry: Any = None
    key: tuple[str, str, int] | None = None
    number = 0
    with open_input(name) as fh:
        for lines in Lines(fh, max_line_bytes).blocks():
            for line in lines:
                number += 1
                if line is LONG_LINE:
                    error = long_line(f"{name}:{number}", max_line_bytes)
                    bad.add(error.field, "", error.message)
                    continue
                try:
                    sample = decode(line, True) or validate(loads(line))  # True: lazy
                except orjson.JSONDecodeError as exc:
                    if line.strip():  # a blank line is no sample and no error
                        bad.add(f"{name}:{number}", "", f"invalid JSON: {exc}")
                    continue
                except WireError as exc:
                    bad.add(f"{name}:{number}", exc.field, exc.message)
                    continue
                plain = type(sample) is dict
                if plain:
                    run, host, rank = sample["run"], sample["host"], sample["rank"]
                else:
                    run, host, rank = sample.run, sample.host, sample.rank
                if key is None or key[2] != rank or key[0] != run or key[1] != host:  # runs of one series
                    key = (run, host, rank)
                    entry = series.get(key)
                    if entry is None:
                        entry = series[key] = _Series(config)
                new = entry.update(sample) if plain else entry.update_struct(sample, as_sample)
                if new:
                    entry.keep(new)


def analyze_paths(
    paths: Iterable[str | os.PathLike[str]], config: EngineConfig | None = None, *, strict: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> dict[str, Any]:
    """The `vramwatch analyze --json` document for trace files (.jsonl / .jsonl.gz).

    Samples are fed in file order, files in the given order. ``skipped_lines`` counts the
    bad lines skipped, ``bad_lines`` names the first :data:`MAX_BAD_LINES`. Raises
    :class:`~vramwatch.wire.WireError` naming the file that cannot be read, or with
    ``strict`` the first bad line (file, line and field; a line longer than ``max_line_bytes``
    is a bad line).
    """
    series: dict[tuple[str, str, int], _Series] = {}
    bad = _BadLines(strict)
    for path in paths:
        name = os.fspath(path)
        try:
            _feed(name, series, config, bad, max_line_bytes)
        except WireError:
            raise
        except FileNotFoundError:
            raise WireError(name, "no such file") from None
        except IsADirectoryError:
            raise WireError(name, "is a directory, not a trace file") from None
        except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise WireError(name, f"cannot read: {exc}") from None
    return _document(series, bad)


def analyze_samples(samples: Iterable[Sample], config: EngineConfig | None = None) -> dict[str, Any]:
    """The same document for validated samples from any source (``--from FORMAT`` importers,
    which count their own bad rows: ``skipped_lines`` is 0 here, the caller fills it in)."""
    series: dict[tuple[str, str, int], _Series] = {}
    for sample in samples:
        key = (sample["run"], sample["host"], sample["rank"])
        entry = series.get(key)
        if entry is None:
            entry = series[key] = _Series(config)
        new = entry.update(sample)
        if new:
            entry.keep(new)
    return _document(series, _BadLines(strict=False))


def _document(series: dict[tuple[str, str, int], _Series], bad: _BadLines) -> dict[str, Any]:
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
    return {"series": out, "skipped_lines": bad.count, "bad_lines": bad.named}


def _gb(value: float | None) -> str:
    return gib(value)


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _spike_words(event: dict[str, Any]) -> str:
    """How a spike compares with the training peak, in words that match the numbers: a phase
    that stays below the training peak is a non-event and is called that."""
    headroom = f"headroom {_gb(event.get('headroom_bytes'))}"
    above = event.get("above_training_peak_bytes")
    train = event.get("training_peak_bytes")
    if above is None:
        return headroom
    if above <= 0:
        return f"below the training peak ({_gb(train)}), {headroom}"
    return f"{_gb(above)} above the training peak ({_gb(train)}), {headroom}"


def _describe(event: dict[str, Any]) -> str:
    kind = event["type"]
    step = event["step"]
    if kind == "leak":
        return (
            f"step {step}: LEAK ({event.get('source')}) since step {event.get('onset_step')}, "
            f"{rate(event['slope_bytes_per_step'])}, "
            f"OOM in {_steps(event.get('steps_to_oom'))} steps ({_duration(event.get('seconds_to_oom'))}"
            + ("" if (span := _range(event)) is None else f", {span}") + ")"
        )
    if kind == "fragmentation":
        return (
            f"step {step}: FRAGMENTATION reserved-allocated {_gb(event.get('reserved_minus_allocated_bytes'))}, "
            f"split {_gb(event.get('inactive_split_bytes'))}, retries {event.get('alloc_retries')}; "
            f"{event.get('recommendation')}"
        )
    if kind in ("checkpoint_spike", "eval_spike", "phase_spike", "periodic_spike"):
        return f"step {step}: {kind} peak {_gb(event.get('peak_bytes'))}, " + _spike_words(event)
    if kind == "plateau":
        return f"step {step}: plateau at {_gb(event.get('plateau_bytes'))} reserved"
    if kind == "plateau_break":
        if event.get("relevel"):
            return (
                f"step {step}: plateau re-levelled ({event.get('cause')} ratcheted reserved once) "
                f"{_gb(event.get('plateau_bytes'))} -> {_gb(event.get('new_plateau_bytes'))}"
            )
        return f"step {step}: plateau break ({event.get('cause')}) from {_gb(event.get('plateau_bytes'))}"
    if kind == "restart":
        return f"step {step}: restart (was at step {event.get('from_step')})"
    if kind == "oom":
        return f"step {step}: OOM (count {event.get('ooms')})"
    if kind == "suspected_oom":
        why = "with the device near full" if event.get("reason") == "near_full" else "at the top of its climb"
        return (f"step {step}: SUSPECTED OOM: device used fell from {_gb(event.get('used_before_bytes'))} to "
                f"{_gb(event.get('used_after_bytes'))} {why} (no OOM counter on device data)")
    return f"step {step}: {kind}"


def _range(figures: dict[str, Any]) -> str | None:
    """The forecast's range (``low to high``), when the leak event or the summary gives one."""
    low, high = figures.get("seconds_to_oom_low"), figures.get("seconds_to_oom_high")
    return None if low is None or high is None else f"{_duration(low)} to {_duration(high)}"


def _time_to_oom(summary: dict[str, Any]) -> str:
    """The table's time to OOM: the forecast, and its range beside it when there is one."""
    span = _range(summary)
    return _duration(summary.get("seconds_to_oom")) + ("" if span is None else f" ({span})")


def _headroom_key(event: dict[str, Any]) -> float:
    headroom = event.get("headroom_bytes")
    return math.inf if headroom is None else headroom


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
                mib(slope),
                _steps(summary.get("steps_to_oom")),
                _time_to_oom(summary),
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
            worst = min(spikes, key=_headroom_key)
            lines.append(f"  {len(spikes)} phase spikes; tightest: " + _describe(worst))
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["MAX_BAD_LINES", "MAX_EVENTS_PER_SERIES", "analyze_paths", "analyze_samples", "format_table"]
