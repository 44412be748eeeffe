"""Validation of one decoded sample against :data:`~vramwatch.wire.fields.FIELD_TABLE`.

:func:`validate` is the one entry point: a fast path for samples already in canonical form
(a cache of shapes, one min/max over the whole numbers) and a slow path that normalises or
names the first bad field. Both accept exactly the same samples (tests/test_wire.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import itemgetter
from typing import Any, NamedTuple

from vramwatch.wire.fields import (
    _CONTROL_RE,
    ALLOCATORS,
    FIELD_BY_NAME,
    FIELD_TABLE,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MAX_NAME,
    MIN_TS,
    PHASE_RE,
    SCHEMA_VERSIONS,
    TRAIN_PHASE,
    Sample,
    WireError,
    invisible_character,
)


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
    bad = invisible_character(value)
    if bad is not None:
        raise WireError(name, f"must not contain control or invisible characters (found {bad})")
    return value


def _extra(name: str, value: Any) -> dict[str, float]:
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


def _check(name: str, kind: str, value: Any) -> Any:
    if kind == "b" or kind == "i":
        return _int(name, value)
    if kind == "s":
        return _name(name, value)
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
    if kind == "flag":
        if type(value) is not bool:
            raise WireError(name, f"must be true or false, got {value!r}")
        return value
    if kind == "extra":
        return _extra(name, value)
    raise AssertionError(kind)  # pragma: no cover


_MISSING = object()
_known_phases: set[str] = {TRAIN_PHASE, "eval", "checkpoint"}
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


#: the Python type each kind has in canonical form (anything else: the slow path normalises or refuses)
_CANONICAL = {"i": int, "b": int, "s": str, "ts": float, "f": float, "phase": str, "allocator": str,
              "extra": dict, "flag": bool}
_NAME_KINDS = ("s", "phase", "allocator")
_QUICK = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes")


class _Shape(NamedTuple):
    """What is left to check of a sample once its schema, keys (in order) and value types are
    known: the value checks, as getters built once per shape."""

    ints: Callable[[dict[str, Any]], tuple[int, ...]]  # every whole-number value: range 0..2**53
    floats: tuple[str, ...]  # kind "f": finite and >= 0 (ts is checked apart)
    names: Callable[[dict[str, Any]], tuple[str, ...]]  # names, phase, allocator: checked once per tuple
    name_kinds: tuple[tuple[str, str], ...]  # (kind, field) in the order of ``names``
    extra: bool
    quick: bool  # allocated, reserved and peak measured, no foreign memory: the common cross-check


def _shape(schema: int, obj: dict[str, Any]) -> _Shape | None:
    """The checks for samples shaped like ``obj``, or None when the shape alone sends it to the
    slow path (unknown or missing field, a type that is not canonical, a null the schema drops)."""
    if schema not in SCHEMA_VERSIONS:
        return None
    ints, floats, names = [], [], []
    for name, value in obj.items():
        field = FIELD_BY_NAME.get(name)
        if field is None:
            return None
        if value is None:
            if schema not in field.nullable:
                return None  # refused, or dropped by the slow path
            continue
        if type(value) is not _CANONICAL[field.kind]:
            return None
        if field.kind in ("i", "b"):
            ints.append(name)
        elif field.kind == "f":
            floats.append(name)
        elif field.kind in _NAME_KINDS:
            names.append((field.kind, name))
    if any(schema in f.required and f.name not in obj for f in FIELD_TABLE):
        return None
    quick = all(obj.get(name) is not None for name in _QUICK) and "foreign_used_bytes" not in obj
    return _Shape(itemgetter(*ints), tuple(floats), itemgetter(*(n for _, n in names)), tuple(names),
                  "extra" in obj, quick)


#: shape (schema, keys in order, value types) -> its checks; bounded (a hostile client sending a new
#: key order per sample gets the plan built each time, never a growing cache)
_SHAPES: dict[tuple[Any, ...], _Shape | None] = {}
#: name tuples (run, host, phase, ...) already checked
_known_name_tuples: set[tuple[str, ...]] = set()


def _plain_names(shape: _Shape, names: tuple[str, ...]) -> bool:
    for (kind, _), value in zip(shape.name_kinds, names, strict=True):
        if kind == "s":
            if not _plain_name(value):
                return False
        elif kind == "phase":
            if value not in _known_phases and not PHASE_RE.match(value):
                return False
        elif value not in ALLOCATORS:
            return False
    if len(_known_name_tuples) < 4096:
        _known_name_tuples.add(names)
    return True


def _plainly_valid(obj: dict[str, Any]) -> bool:
    """Fast path for the common case: every field already in canonical form and valid.

    False means "take the slow path", which either normalises or names the bad field; both
    paths accept exactly the same samples (tests/test_wire.py checks agreement). Cost: one
    tuple of the keys and value types looked up in a cache of shapes (what is required,
    present, typed right is known per shape), then one min/max over the whole numbers, the
    names as one cached tuple and the cross-field rules: no per-field ``get``.
    """
    schema = obj.get("schema")
    if type(schema) is not int:
        return False
    key = (schema, *obj, *map(type, obj.values()))
    shape = _SHAPES.get(key, _MISSING)
    if shape is _MISSING:
        shape = _shape(schema, obj)
        if len(_SHAPES) < 1024:
            _SHAPES[key] = shape
    if shape is None:
        return False
    ints = shape.ints(obj)
    if min(ints) < 0 or max(ints) > MAX_INT:
        return False
    if not MIN_TS <= obj["ts"] < math.inf:
        return False
    for name in shape.floats:
        if not 0.0 <= obj[name] < math.inf:
            return False
    names = shape.names(obj)
    if names not in _known_name_tuples and not _plain_names(shape, names):
        return False
    if shape.extra:
        extra = obj["extra"]
        if len(extra) > MAX_EXTRA_KEYS or not all(
                _plain_name(key, 64) and type(number) in (int, float) and -MAX_INT <= number <= MAX_INT
                for key, number in extra.items()):
            return False
    if shape.quick and obj.get("allocator") != "cudaMallocAsync":
        allocated, reserved, total, used = (obj["allocated_bytes"], obj["reserved_bytes"], obj["total_bytes"],
                                            obj.get("nvml_used_bytes"))
        return (allocated <= reserved <= total and obj["peak_allocated_bytes"] >= allocated and total > 0
                and (used is None or used <= total))
    return _consistent(obj) is None  # sparse, foreign memory or cudaMallocAsync: the general rules


def _consistent(s: dict[str, Any]) -> WireError | None:
    """The cross-field rules, on a sample whose fields are each valid (None = not measured)."""
    get = s.get
    allocated, reserved, total = get("allocated_bytes"), get("reserved_bytes"), s["total_bytes"]
    used, peak = get("nvml_used_bytes"), get("peak_allocated_bytes")
    if allocated is None and used is None:
        return WireError("allocated_bytes", "a sample needs at least one memory level: allocated_bytes or "
                                            "nvml_used_bytes")
    if allocated is not None:
        if reserved is not None:
            if allocated > reserved and get("allocator") != "cudaMallocAsync":
                return WireError("allocated_bytes", f"{allocated} exceeds reserved_bytes {reserved}")
        elif allocated > total:
            return WireError("allocated_bytes", f"{allocated} exceeds total_bytes {total}")
        if peak is not None and peak < allocated:
            return WireError("peak_allocated_bytes", f"{peak} is below allocated_bytes {allocated}")
    if total == 0:
        return WireError("total_bytes", "must be the device capacity, not 0")
    if reserved is not None and reserved > total:
        return WireError("reserved_bytes", f"{reserved} exceeds total_bytes {total}")
    if used is not None and used > total:
        return WireError("nvml_used_bytes", f"{used} exceeds total_bytes {total}")
    foreign = get("foreign_used_bytes")
    if foreign is not None and foreign > total:
        return WireError("foreign_used_bytes", f"{foreign} exceeds total_bytes {total}")
    return None


def validate(obj: Any, *, now: float | None = None, max_future_s: float = 300.0) -> Sample:
    """Check one decoded sample and return it normalised (floats of whole bytes → int).

    ``now``: when given, timestamps more than ``max_future_s`` ahead of it are rejected
    (a clock that far off would corrupt every time-based number).
    A field that was not measured is absent or null in the result: read it with ``get``.
    Raises :class:`WireError` naming the first bad field; never returns a partial sample.
    Cost: a few µs for a canonical sample (the fast path), more only for odd ones.
    """
    if type(obj) is not dict:
        raise WireError("sample", f"must be a JSON object, got {type(obj).__name__}")
    if _plainly_valid(obj) and (now is None or obj["ts"] <= now + max_future_s):
        return obj  # type: ignore[return-value]
    return _validate_slow(obj, now, max_future_s)


def _validate_slow(obj: dict[str, Any], now: float | None, max_future_s: float) -> Sample:
    schema = obj.get("schema")
    if type(schema) is not int or schema not in SCHEMA_VERSIONS:
        raise WireError("schema", f"unknown schema {schema!r}; this collector speaks schemas "
                                  f"{', '.join(map(str, SCHEMA_VERSIONS))}")
    out: dict[str, Any] = {}
    for f in FIELD_TABLE:  # in table order: the first bad field is named, whatever the key order
        value = obj.get(f.name, _MISSING)
        if value is _MISSING:
            if schema in f.required:
                raise WireError(f.name, "is required")
        elif value is None and schema in f.nullable:
            out[f.name] = None  # not measured
        elif value is not None or schema in f.required:  # else: an explicit null optional is absent
            out[f.name] = _check(f.name, f.kind, value)
    if len(obj) > len(out):
        for name in obj:
            if name not in FIELD_BY_NAME:
                raise WireError(str(name)[:64], "unknown field")
    error = _consistent(out)
    if error is not None:
        raise error
    if now is not None and out["ts"] > now + max_future_s:
        raise WireError("ts", f"is {out['ts'] - now:.0f} s in the future; check the clock on host {out['host']!r}")
    return out  # type: ignore[return-value]


