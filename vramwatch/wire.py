"""Wire format, schema 1: the one definition of a vramwatch sample.

A sample is one rank at one step (or one phase event), a flat JSON object. The hook
builds them, the collector validates and stores them, trace files hold them one per
line (JSON Lines, optionally gzipped), and ``vramwatch analyze`` reads them. Samples
travel as plain ``dict`` objects: the hot paths (hook, ingest, analyze) never pay for
object construction.
"""

from __future__ import annotations

import gzip
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypedDict

import orjson

SCHEMA_VERSION = 1

#: Largest integer accepted anywhere: JSON numbers beyond 2**53 lose precision in
#: browsers and in any float-based consumer, and no GPU has 9 PB.
MAX_INT = 2**53

#: Oldest plausible timestamp (2000-01-01). Anything earlier is a unit mistake.
MIN_TS = 946684800.0

# Identity fields are constant for one process (run, rank, incarnation); the store keeps
# them once per series.
IDENTITY_FIELDS = ("run", "host", "rank", "incarnation", "local_rank", "world_size", "uuid", "gpu", "pid")


class Sample(TypedDict, total=False):
    schema: int
    run: str
    host: str
    rank: int
    step: int
    ts: float
    phase: str
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    ooms: int
    nvml_used_bytes: int | None  # null: NVML unavailable, never a fake zero
    total_bytes: int
    # optional
    local_rank: int
    world_size: int
    uuid: str
    gpu: int
    pid: int
    process_used_bytes: int
    active_bytes: int
    step_time_s: float
    tokens: int
    incarnation: str
    allocator: str  # "native" (default) or "cudaMallocAsync"
    extra: dict[str, float]


class WireError(ValueError):
    """A sample or request body that cannot be true; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# (name, kind) in the order samples are written. Kinds: "b" byte count / counter
# (int >= 0), "i" small int >= 0, "s" name, "f" float >= 0.
REQUIRED: tuple[tuple[str, str], ...] = (
    ("schema", "i"),
    ("run", "s"),
    ("host", "s"),
    ("rank", "i"),
    ("step", "i"),
    ("ts", "ts"),
    ("phase", "phase"),
    ("allocated_bytes", "b"),
    ("reserved_bytes", "b"),
    ("peak_allocated_bytes", "b"),
    ("inactive_split_bytes", "b"),
    ("alloc_retries", "b"),
    ("ooms", "b"),
    ("nvml_used_bytes", "b?"),
    ("total_bytes", "b"),
)
OPTIONAL: tuple[tuple[str, str], ...] = (
    ("local_rank", "i"),
    ("world_size", "i"),
    ("uuid", "s"),
    ("gpu", "i"),
    ("pid", "i"),
    ("process_used_bytes", "b"),
    ("active_bytes", "b"),
    ("step_time_s", "f"),
    ("tokens", "b"),
    ("incarnation", "s"),
    ("allocator", "allocator"),
    ("extra", "extra"),
)
FIELDS: dict[str, str] = dict(REQUIRED + OPTIONAL)
REQUIRED_NAMES = tuple(name for name, _ in REQUIRED)

ALLOCATORS = ("native", "cudaMallocAsync")
MAX_NAME = 128
MAX_PHASE = 32
MAX_EXTRA_KEYS = 64
#: What a phase name may be (the hook checks names with the same pattern before sending).
PHASE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,32}\Z")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _int(name: str, value: Any) -> int:
    # bool is an int subclass; true is not a byte count.
    if type(value) is int:
        if 0 <= value <= MAX_INT:
            return value
        raise WireError(name, f"must be between 0 and 2**53, got {value}")
    if type(value) is float:
        if math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_INT:
            return int(value)
        raise WireError(name, f"must be a whole number between 0 and 2**53, got {value!r}")
    raise WireError(name, f"must be an integer, got {type(value).__name__}")


def _name(name: str, value: Any, limit: int = MAX_NAME) -> str:
    if type(value) is not str:
        raise WireError(name, f"must be a string, got {type(value).__name__}")
    if not value or len(value) > limit:
        raise WireError(name, f"must be 1 to {limit} characters long")
    if _CONTROL_RE.search(value):
        raise WireError(name, "must not contain control characters")
    return value


def _check(name: str, kind: str, value: Any) -> Any:
    if kind == "b" or kind == "i":
        return _int(name, value)
    if kind == "s":
        return _name(name, value)
    if kind == "b?":
        return None if value is None else _int(name, value)
    if kind == "ts" or kind == "f":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise WireError(name, f"must be a finite number, got {value!r}")
        if kind == "ts" and value < MIN_TS:
            raise WireError(name, f"must be unix seconds after 2000-01-01, got {value!r}")
        if value < 0:
            raise WireError(name, f"must not be negative, got {value!r}")
        return float(value)
    if kind == "phase":
        if type(value) is not str or not PHASE_RE.match(value):
            raise WireError(name, "must be a short name: 1-32 of A-Z a-z 0-9 _ . : -")
        return value
    if kind == "allocator":
        if value not in ALLOCATORS:
            raise WireError(name, f"must be one of {', '.join(ALLOCATORS)}")
        return value
    if kind == "extra":
        if type(value) is not dict:
            raise WireError(name, "must be a flat object of numbers")
        if len(value) > MAX_EXTRA_KEYS:
            raise WireError(name, f"at most {MAX_EXTRA_KEYS} keys")
        out = {}
        for key, number in value.items():
            _name(f"extra.{key}"[:80], key, 64)
            if type(number) not in (int, float) or not math.isfinite(number) or abs(number) > MAX_INT:
                raise WireError(f"extra.{key}"[:80], "must be a finite number")
            out[key] = number
        return out
    raise AssertionError(kind)  # pragma: no cover


_REQUIRED_INTS = ("rank", "step", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes",
                  "inactive_split_bytes", "alloc_retries", "ooms", "total_bytes")
_OPTIONAL_INTS = tuple(name for name, kind in OPTIONAL if kind in ("i", "b"))
_OPTIONAL_NAMES = tuple(name for name, kind in OPTIONAL if kind == "s")
_MISSING = object()
_known_phases: set[str] = {"train", "eval", "checkpoint"}


# run/host/uuid/incarnation repeat on every sample: remember the ones already checked
# (bounded, so hostile clients cannot grow it).
_known_names: set[str] = set()


def _plain_name(value: Any, limit: int = MAX_NAME) -> bool:
    if type(value) is not str:
        return False
    if limit == MAX_NAME and value in _known_names:
        return True
    ok = 0 < len(value) <= limit and _CONTROL_RE.search(value) is None
    if ok and limit == MAX_NAME and len(_known_names) < 4096:
        _known_names.add(value)
    return ok


def _plainly_valid(obj: dict[str, Any]) -> bool:
    """Fast path for the common case: every field already in canonical form and valid.

    False means "take the slow path", which either normalises or names the bad field;
    both paths accept exactly the same samples (tests/test_wire.py checks agreement).
    """
    try:
        if obj["schema"] != 1 or type(obj["schema"]) is not int:
            return False
        for name in _REQUIRED_INTS:
            value = obj[name]
            if type(value) is not int or value < 0 or value > MAX_INT:
                return False
        used = obj["nvml_used_bytes"]
        ts = obj["ts"]
        phase = obj["phase"]
        run, host = obj["run"], obj["host"]
    except KeyError:
        return False
    if used is not None and (type(used) is not int or used < 0 or used > MAX_INT):
        return False
    if type(ts) is not float or not MIN_TS <= ts < math.inf:
        return False
    if type(phase) is not str:
        return False
    if phase not in _known_phases:
        if not PHASE_RE.match(phase):
            return False
        if len(_known_phases) < 256:
            _known_phases.add(phase)
    if not (_plain_name(run) and _plain_name(host)):
        return False
    if len(obj) > len(REQUIRED):
        # look up the optional fields by name (no walk over every key): a key that is none
        # of them shows up as a count mismatch and sends the sample to the slow path
        get = obj.get
        found = 0
        for name in _OPTIONAL_INTS:
            value = get(name, _MISSING)
            if value is not _MISSING:
                if type(value) is not int or value < 0 or value > MAX_INT:
                    return False
                found += 1
        for name in _OPTIONAL_NAMES:
            value = get(name, _MISSING)
            if value is not _MISSING:
                if not _plain_name(value):
                    return False
                found += 1
        value = get("step_time_s", _MISSING)
        if value is not _MISSING:
            if type(value) is not float or not 0.0 <= value < math.inf:
                return False
            found += 1
        value = get("allocator", _MISSING)
        if value is not _MISSING:
            if value != "native":  # cudaMallocAsync relaxes a cross-check: slow path
                return False
            found += 1
        value = get("extra", _MISSING)
        if value is not _MISSING:
            if type(value) is not dict or len(value) > MAX_EXTRA_KEYS:
                return False
            for key, number in value.items():
                if not _plain_name(key, 64) or type(number) not in (int, float) or not abs(number) <= MAX_INT:
                    return False
            found += 1
        if len(obj) != len(REQUIRED) + found:
            return False
    allocated, reserved, total = obj["allocated_bytes"], obj["reserved_bytes"], obj["total_bytes"]
    return (
        allocated <= reserved <= total
        and obj["peak_allocated_bytes"] >= allocated
        and total > 0
        and (used is None or used <= total)
    )


def validate(obj: Any, *, now: float | None = None, max_future_s: float = 300.0) -> Sample:
    """Check one decoded sample and return it normalised (floats of whole bytes → int).

    ``now``: when given, timestamps more than ``max_future_s`` ahead of it are rejected
    (a clock that far off would corrupt every time-based number).
    Raises :class:`WireError` naming the first bad field; never returns a partial sample.
    """
    if type(obj) is not dict:
        raise WireError("sample", f"must be a JSON object, got {type(obj).__name__}")
    if _plainly_valid(obj) and (now is None or obj["ts"] <= now + max_future_s):
        return obj  # type: ignore[return-value]
    return _validate_slow(obj, now, max_future_s)


def _validate_slow(obj: dict[str, Any], now: float | None, max_future_s: float) -> Sample:
    schema = obj.get("schema")
    if schema != 1 or type(schema) is not int:
        raise WireError("schema", f"unknown schema {schema!r}; this collector speaks schema {SCHEMA_VERSION}")
    out: dict[str, Any] = {}
    for name, kind in REQUIRED:
        if name not in obj:
            raise WireError(name, "is required")
        out[name] = _check(name, kind, obj[name])
    if len(obj) > len(REQUIRED):
        for name, value in obj.items():
            if name in out:
                continue
            kind = FIELDS.get(name)
            if kind is None:
                raise WireError(str(name)[:64], "unknown field")
            if value is None:
                continue  # an explicit null optional is the same as absent
            out[name] = _check(name, kind, value)
    allocated, reserved, total = out["allocated_bytes"], out["reserved_bytes"], out["total_bytes"]
    if allocated > reserved and out.get("allocator") != "cudaMallocAsync":
        raise WireError("allocated_bytes", f"{allocated} exceeds reserved_bytes {reserved}")
    if out["peak_allocated_bytes"] < allocated:
        raise WireError("peak_allocated_bytes", f"{out['peak_allocated_bytes']} is below allocated_bytes {allocated}")
    if total == 0:
        raise WireError("total_bytes", "must be the device capacity, not 0")
    if reserved > total:
        raise WireError("reserved_bytes", f"{reserved} exceeds total_bytes {total}")
    used = out["nvml_used_bytes"]
    if used is not None and used > total:
        raise WireError("nvml_used_bytes", f"{used} exceeds total_bytes {total}")
    if now is not None and out["ts"] > now + max_future_s:
        raise WireError("ts", f"is {out['ts'] - now:.0f} s in the future; check the clock on host {out['host']!r}")
    return out  # type: ignore[return-value]


def series_key(sample: Sample) -> tuple[str, str, int]:
    """A series is (run, host, rank): what the engine, the dashboard and analyze key on."""
    return (sample["run"], sample["host"], sample["rank"])


# ---------------------------------------------------------------- encoding

def encode(sample: Sample) -> bytes:
    """One sample as a JSON line (no newline)."""
    return orjson.dumps(sample)


def encode_lines(samples: Iterable[Sample]) -> bytes:
    """NDJSON body: one sample per line, newline-terminated."""
    return b"".join(orjson.dumps(s) + b"\n" for s in samples)


def decode_line(line: bytes | str) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise WireError("body", f"invalid JSON: {exc}") from None


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Compatibility alias of :func:`vramwatch.collector.body.gunzip_limited` (bounded inflate)."""
    from vramwatch.collector.body import gunzip_limited as inflate

    return inflate(data, limit)


def parse_body(data: bytes) -> list[Any]:
    """Compatibility alias of :func:`vramwatch.collector.body.parse_body` (array, object or NDJSON)."""
    from vramwatch.collector.body import parse_body as parse

    return parse(data)


# ---------------------------------------------------------------- trace files

def _open_read(path: str | os.PathLike[str]) -> IO[bytes]:
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller's with-block
    if raw.peek(2)[:2] == b"\x1f\x8b":  # sniff, so a misnamed gzip still reads
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


def iter_file(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """Stream (line number, decoded object) from a .jsonl or .jsonl.gz trace.

    Decoding errors raise :class:`WireError` with the line number; validation is the
    caller's choice (``analyze`` and ``import`` both validate).
    """
    with _open_read(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise WireError(f"{path}:{lineno}", f"invalid JSON: {exc}") from None


def iter_samples(path: str | os.PathLike[str]) -> Iterator[Sample]:
    """Validated samples from a trace file; the first bad line raises WireError naming it."""
    for lineno, obj in iter_file(path):
        try:
            yield validate(obj)
        except WireError as exc:
            raise WireError(f"{path}:{lineno}: {exc.field}", exc.message) from None


class TraceWriter:
    """Append samples to a .jsonl (or .jsonl.gz, by suffix) trace file."""

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = "ab" if append else "wb"
        self._fh: IO[bytes] = (
            gzip.open(self.path, mode) if self.path.suffix == ".gz" else open(self.path, mode)  # noqa: SIM115
        )

    def write(self, samples: Iterable[Sample]) -> None:
        self._fh.write(encode_lines(samples))

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_file(path: str | os.PathLike[str], samples: Iterable[Sample]) -> None:
    """Write a whole trace file (truncating)."""
    with TraceWriter(path, append=False) as writer:
        writer.write(samples)


__all__ = [
    "SCHEMA_VERSION",
    "Sample",
    "TraceWriter",
    "WireError",
    "decode_line",
    "encode",
    "encode_lines",
    "gunzip_limited",
    "iter_file",
    "iter_samples",
    "parse_body",
    "series_key",
    "validate",
    "write_file",
]
