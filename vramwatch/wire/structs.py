"""The acceptor of a sample: one ``msgspec`` Struct per schema version, generated from
:data:`~vramwatch.wire.fields.FIELD_TABLE`, and the checks a Struct cannot state, run after it.

A Struct says, in C while decoding: the schema (a tagged union on ``schema``), no unknown field,
every field's type, range and length, which fields a schema requires and where null means "not
measured" (kept as None); an absent optional field is ``UNSET`` and left out of the sample's
dict. The Structs take samples in canonical form only (whole numbers as integers, an optional
field that null does not measure left out rather than null): :mod:`vramwatch.wire.validate`
rewrites the other forms. What is left for :func:`accepted`: invisible characters in names, the
phase pattern, the extra object's keys, the cross-field rules (:func:`consistent`) and the clock.

Everything that accepts a sample goes through these Structs: :func:`vramwatch.wire.validate`
(a dict, by ``msgspec.convert``), trace lines and request bodies (JSON, by the decoders here).
Cost: about 0.6 of an ``orjson.loads`` of the same line to decode, ~0.3 µs per sample for the
checks after it (names are checked once per distinct tuple, a bounded cache).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal, Union

import msgspec

from vramwatch.wire.fields import (
    _CONTROL_RE,
    ALLOCATORS,
    FIELD_TABLE,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MAX_NAME,
    MIN_TS,
    PHASE_RE,
    SCHEMA_VERSIONS,
    TRAIN_PHASE,
    WireError,
)

_FINITE = sys.float_info.max  # an upper bound refuses inf (and a lower one NaN: it compares false)
#: the phase pattern's length bound (PHASE_PATTERN: 1-32 characters)
_PHASE_LEN = 32


def _types() -> dict[str, Any]:
    meta = msgspec.Meta
    whole = Annotated[int, meta(ge=0, le=MAX_INT)]
    number = Union[Annotated[int, meta(ge=-MAX_INT, le=MAX_INT)],  # noqa: UP007 - msgspec's union
                   Annotated[float, meta(ge=-MAX_INT, le=MAX_INT)]]
    return {
        "i": whole, "b": whole,
        "s": Annotated[str, meta(min_length=1, max_length=MAX_NAME)],  # invisible characters: accepted()
        "ts": Annotated[float, meta(ge=MIN_TS, le=_FINITE)],
        "f": Annotated[float, meta(ge=0.0, le=_FINITE)],
        "phase": Annotated[str, meta(min_length=1, max_length=_PHASE_LEN)],  # the pattern: accepted()
        "allocator": Literal[ALLOCATORS],  # type: ignore[valid-type]
        "extra": Annotated[dict[Annotated[str, meta(min_length=1, max_length=64)], number],
                           meta(max_length=MAX_EXTRA_KEYS)],
        "flag": bool,
    }


def _struct(version: int) -> type:
    """The Struct of one schema version, fields in table order (so its dict is in the table's order)."""
    types = _types()
    fields: list[tuple[Any, ...]] = []
    for f in FIELD_TABLE:
        if f.name == "schema":
            continue  # the tag
        kind: Any = types[f.kind]
        if version in f.nullable:
            kind = kind | None  # null = not measured, kept as None
        if version in f.required:
            fields.append((f.name, kind))
        else:
            fields.append((f.name, kind | msgspec.UnsetType, msgspec.UNSET))  # absent: left out of the dict
    return msgspec.defstruct(f"Schema{version}Sample", fields, tag_field="schema", tag=version,
                             forbid_unknown_fields=True, kw_only=True, gc=False)  # numbers and names only: no cycles


STRUCTS: tuple[type, ...] = tuple(_struct(v) for v in SCHEMA_VERSIONS)
SCHEMA1 = STRUCTS[SCHEMA_VERSIONS.index(1)]
SampleStruct = Union[STRUCTS]  # type: ignore[valid-type]  # noqa: UP007
#: what a refused decode or conversion raises
ERRORS = (msgspec.ValidationError, msgspec.DecodeError)

decode_one = msgspec.json.Decoder(SampleStruct).decode
decode_array = msgspec.json.Decoder(list[SampleStruct]).decode  # type: ignore[valid-type]
decode_lines = msgspec.json.Decoder(SampleStruct).decode_lines
convert = msgspec.convert
#: a Struct's sample dict (fields in table order, absent ones omitted)
as_sample = msgspec.to_builtins
UNSET = msgspec.UNSET

_BOUND = 4096
#: (run, host, uuid, incarnation, phase) tuples already checked: they repeat on every sample of
#: a series (bounded, so a hostile client cannot grow it)
_known_names: set[tuple[Any, ...]] = set()
#: key tuples of extra objects already checked
_known_keys: set[tuple[str, ...]] = set()


def _remember(known: set[Any], value: Any) -> None:
    if len(known) < _BOUND:
        known.add(value)


def _names_ok(names: tuple[Any, ...]) -> bool:
    *texts, phase = names
    if phase != TRAIN_PHASE and not PHASE_RE.match(phase):
        return False
    return not any(type(t) is str and _CONTROL_RE.search(t) for t in texts)


def _extra_ok(extra: dict[str, Any]) -> bool:
    keys = tuple(extra)
    if keys in _known_keys:
        return True
    if any(_CONTROL_RE.search(key) for key in keys):
        return False
    _remember(_known_keys, keys)
    return True


def _last_words_ok(s: Any) -> bool:
    """The last words' texts are visible characters (a marker is rare: checked each time)."""
    texts = (s.last_words_type, s.last_words_message, s.last_words_phase)
    return not any(type(t) is str and _CONTROL_RE.search(t) for t in texts)


def accepted(s: Any, now: float | None = None, max_future_s: float = 300.0) -> bool | None:
    """What the Struct cannot say about one decoded sample: names, the extra object's keys,
    the clock, and the common cross-field check. None: a sparse, foreign-memory or
    cudaMallocAsync sample, for which :func:`consistent` is to run on its dict."""
    names = (s.run, s.host, s.uuid, s.incarnation, s.torch_version, s.alloc_conf, s.phase)
    if names not in _known_names:
        if not _names_ok(names):
            return False
        _remember(_known_names, names)
    if s.extra is not UNSET and not _extra_ok(s.extra):
        return False
    if (s.last_words_type is not UNSET or s.last_words_message is not UNSET or s.last_words_phase is not UNSET) and (
            not _last_words_ok(s)):
        return False
    if now is not None and s.ts > now + max_future_s:
        return False
    allocated, reserved, peak, total = s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes, s.total_bytes
    if (type(allocated) is int and type(reserved) is int and type(peak) is int
            and s.foreign_used_bytes is UNSET and s.allocator != "cudaMallocAsync"):
        used = s.nvml_used_bytes
        return (allocated <= reserved <= total and peak >= allocated and total > 0
                and (used is None or used is UNSET or used <= total))
    return None


def consistent(s: dict[str, Any]) -> WireError | None:
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
