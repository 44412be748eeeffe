"""Validation of samples: one acceptor (:mod:`vramwatch.wire.structs`) for every form they come in.

* :func:`validate`: one decoded sample (a dict: the hook's, an importer's, a line orjson parsed);
* :func:`decode_line`: one JSON line of a trace file;
* :func:`decode_samples`: a request body's text (a JSON array, one object or NDJSON).

Each goes through the Structs generated from the field table and the checks after them; none
has rules of its own. Two things are not acceptance:

* **representation**: a whole-number field written as a float (``"step": 3.0``) is that number,
  and an optional field that null does not measure, written as null, is absent. The Structs
  take the canonical form only, so :func:`validate` rewrites these two and asks the Structs
  again (only when they refused: a canonical sample pays nothing);
* **the error message** of a refused sample: :func:`_refusal` walks the fields in table order
  and names the first bad one (``WireError(field, message)``, as the 422 documents, ``analyze``
  and the importers report it). It never accepts anything; tests/wire/test_wire.py checks that it
  finds a fault in every sample the Structs refuse.
"""

from __future__ import annotations

import math
import re
from typing import Any

from vramwatch.wire.fields import (
    ALLOCATORS,
    FIELD_BY_NAME,
    FIELD_TABLE,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MAX_NAME,
    MIN_TS,
    PHASE_RE,
    SCHEMA_VERSIONS,
    Sample,
    WireError,
    invisible_character,
)
from vramwatch.wire.structs import (
    ERRORS,
    SCHEMA1,
    SampleStruct,
    accepted,
    as_sample,
    consistent,
    convert,
    decode_array,
    decode_lines,
    decode_one,
)

_WHOLE_KINDS = ("i", "b")
_NOT_BLANK = re.compile(rb"[^ \t\r\n]")
#: number fields a sample holds as floats: an int there makes the accepted dict differ from the input
_FLOATS = tuple(f.name for f in FIELD_TABLE if f.kind in ("ts", "f"))
#: per schema, the optional fields whose null measures nothing: written as null, they are absent
_ABSENT_IF_NULL = {v: frozenset(f.name for f in FIELD_TABLE if v not in f.nullable and v not in f.required)
                   for v in SCHEMA_VERSIONS}


def validate(obj: Any, *, now: float | None = None, max_future_s: float = 300.0) -> Sample:
    """Check one decoded sample and return it normalised (floats of whole bytes → int, numbers
    of float fields → float, an explicit null that measures nothing → absent).

    ``now``: when given, timestamps more than ``max_future_s`` ahead of it are rejected
    (a clock that far off would corrupt every time-based number).
    A field that was not measured is absent or null in the result: read it with ``get``.
    Raises :class:`WireError` naming the first bad field; never returns a partial sample.
    Cost: ~3 µs for a typical sample (``msgspec.convert`` into the schema's Struct and the
    checks after it); a sample already in canonical form is returned as it is, not copied.
    """
    if type(obj) is not dict:
        raise WireError("sample", f"must be a JSON object, got {type(obj).__name__}")
    sample = _accept(obj, now, max_future_s)
    if sample is None:
        canonical = _canonical(obj)
        if canonical is not None:
            sample = _accept(canonical, now, max_future_s)
    if sample is None:
        # no rule naming the fault would be a disagreement tests/wire/test_wire.py looks for: say so
        raise _refusal(obj, now, max_future_s) or WireError("sample", "not accepted by the wire schema")
    return sample


def _accept(obj: dict[str, Any], now: float | None, max_future_s: float) -> Sample | None:
    try:
        s = convert(obj, SampleStruct)
    except (*ERRORS, RecursionError):  # RecursionError: a value nested past the decoder's depth
        return None
    ok = accepted(s, now, max_future_s)
    if ok is False:
        return None
    if ok is True and _as_accepted(obj):
        return obj  # type: ignore[return-value]
    sample = as_sample(s)
    return sample if ok or consistent(sample) is None else None


def _as_accepted(obj: dict[str, Any]) -> bool:
    """Whether an accepted ``obj`` already is the Struct's dict (so it is returned, not copied):
    its float fields hold floats (an int there becomes a float)."""
    return all(type(obj.get(name, 0.0)) is float for name in _FLOATS)


def _canonical(obj: dict[str, Any]) -> dict[str, Any] | None:
    """``obj`` in the form the Structs take: whole-number fields written as whole floats (3.0) as
    ints, an explicit null of an optional field whose null measures nothing left out; None when
    there is nothing to rewrite (then there is nothing to ask the Structs again)."""
    schema = obj.get("schema")
    absent = _ABSENT_IF_NULL.get(schema) if type(schema) is int else None
    changed = None
    for name, value in obj.items():
        if value is None:
            if absent is not None and name in absent:
                changed = dict(obj) if changed is None else changed
                del changed[name]
        elif type(value) is float and value.is_integer() and name != "schema":
            field = FIELD_BY_NAME.get(name)
            if field is not None and field.kind in _WHOLE_KINDS:
                changed = dict(obj) if changed is None else changed
                changed[name] = int(value)
    return changed


def decode_line(line: bytes, lazy: bool = False) -> Any:
    """The accepted sample of one JSON line, or None: "take ``validate(orjson.loads(line))``",
    which rewrites a sample not in canonical form or raises the :class:`WireError` naming the
    field (or the caller's JSON error). Same sample as that would return (keys in table order).

    ``lazy``: a plainly valid schema-1 sample (no cross-field rule left to run) comes back as its
    Struct, not yet a dict: one attribute per field, ``UNSET`` when absent;
    ``as_sample`` makes the dict. Saves building a dict (~0.5 of a parse) for a reader
    that needs only some fields (``TrendEngine.update_struct``). Cost: one C pass.
    """
    try:
        s = decode_one(line)  # names bound at import: this runs once per line of a trace
    except (*ERRORS, RecursionError):
        return None
    ok = accepted(s)
    if ok is True and lazy and type(s) is SCHEMA1:
        return s
    if ok is False:
        return None
    sample = as_sample(s)
    return sample if ok or consistent(sample) is None else None


def decode_samples(text: bytes | memoryview, *, now: float | None = None,
                   max_future_s: float = 300.0) -> list[Sample] | None:
    """Every sample of a body's text (a JSON array, one object or NDJSON, blank lines skipped) in
    one C pass, or None when any of them is not accepted as written (or there are none): then
    each is to go through :func:`validate`, which rewrites or names it. Same samples as that
    would return (JSON nested past the decoder's depth included: the caller's parser names it).
    Cost: about 0.8 of an orjson parse of the text plus ~0.5 µs per sample.
    """
    found = _NOT_BLANK.search(text)
    if found is None:
        return None
    try:
        # NDJSON line by line in one C call, without copying the text
        decoded = decode_array(text) if found.group() == b"[" else decode_lines(text)
    except (*ERRORS, RecursionError):
        return None
    if not decoded:
        return None
    checks = [accepted(s, now, max_future_s) for s in decoded]
    if False in checks:
        return None
    samples: list[Sample] = as_sample(decoded)
    if None in checks and any(ok is None and consistent(x) is not None
                              for ok, x in zip(checks, samples, strict=True)):
        return None
    return samples


# ---------------------------------------------------------------- the message of a refusal


def _int(name: str, value: Any) -> None:
    # bool is an int subclass; true is not a byte count.
    if type(value) is int:
        if not 0 <= value <= MAX_INT:
            raise WireError(name, f"must be between 0 and 2**53, got {value}")
    elif type(value) is float:
        if not (math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_INT):
            raise WireError(name, f"must be a whole number between 0 and 2**53, got {value!r}")
    else:
        raise WireError(name, f"must be an integer, got {type(value).__name__}")


def _name(name: str, value: Any, limit: int = MAX_NAME) -> None:
    if type(value) is not str:
        raise WireError(name, f"must be a string, got {type(value).__name__}")
    if not value or len(value) > limit:
        raise WireError(name, f"must be 1 to {limit} characters long")
    bad = invisible_character(value)
    if bad is not None:
        raise WireError(name, f"must not contain control or invisible characters (found {bad})")


def _extra(name: str, value: Any) -> None:
    if type(value) is not dict:
        raise WireError(name, "must be a flat object of numbers")
    if len(value) > MAX_EXTRA_KEYS:
        raise WireError(name, f"at most {MAX_EXTRA_KEYS} keys")
    for key, number in value.items():
        _name(f"extra.{key}"[:80], key, 64)
        if type(number) not in (int, float) or not math.isfinite(number) or abs(number) > MAX_INT:
            raise WireError(f"extra.{key}"[:80], "must be a finite number")


def _number(name: str, kind: str, value: Any) -> None:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise WireError(name, f"must be a finite number, got {value!r}")
    if kind == "ts" and value < MIN_TS:
        raise WireError(name, f"must be unix seconds after 2000-01-01, got {value!r}")
    if value < 0:
        raise WireError(name, f"must not be negative, got {value!r}")


def _check(name: str, kind: str, value: Any) -> None:
    """The rule of one field of ``kind``, as a message: raises the WireError naming it."""
    if kind in _WHOLE_KINDS:
        _int(name, value)
    elif kind == "s":
        _name(name, value)
    elif kind in ("ts", "f"):
        _number(name, kind, value)
    elif kind == "phase":
        if type(value) is not str or not PHASE_RE.match(value):
            raise WireError(name, "must be a short name: 1-32 of A-Z a-z 0-9 _ . : -")
    elif kind == "allocator":
        if value not in ALLOCATORS:
            raise WireError(name, f"must be one of {', '.join(ALLOCATORS)}")
    elif kind == "flag":
        if type(value) is not bool:
            raise WireError(name, f"must be true or false, got {value!r}")
    elif kind == "extra":
        _extra(name, value)


_MISSING = object()


def _refusal(obj: dict[str, Any], now: float | None, max_future_s: float) -> WireError | None:
    """The error naming the first bad field of a sample the Structs refused, in table order
    whatever the key order; then unknown fields, the cross-field rules and the clock. None:
    no rule names a fault (for a sample the Structs accept)."""
    try:
        schema = obj.get("schema")
        if type(schema) is not int or schema not in SCHEMA_VERSIONS:
            return WireError("schema", f"unknown schema {schema!r}; this collector speaks schemas "
                                       f"{', '.join(map(str, SCHEMA_VERSIONS))}")
        out: dict[str, Any] = {}
        for f in FIELD_TABLE:
            value = obj.get(f.name, _MISSING)
            if value is _MISSING:
                if schema in f.required:
                    return WireError(f.name, "is required")
            elif value is None and schema in f.nullable:
                out[f.name] = None  # not measured
            elif value is not None or schema in f.required:  # else: an explicit null optional is absent
                _check(f.name, f.kind, value)
                out[f.name] = value
        for name in obj:
            if name not in FIELD_BY_NAME:
                return WireError(str(name)[:64], "unknown field")
        error = consistent(out)
        if error is not None:
            return error
        if now is not None and out["ts"] > now + max_future_s:
            return WireError("ts", f"is {out['ts'] - now:.0f} s in the future; check the clock on host "
                                   f"{out['host']!r}")
    except WireError as exc:
        return exc
    return None
