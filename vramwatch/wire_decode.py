"""Decode and validate a trace line in one C pass (``vramwatch analyze``'s fast path).

One ``msgspec`` Struct per schema version is generated from :data:`vramwatch.wire.FIELD_TABLE`
(a tagged union on ``schema``; unknown fields forbidden; each field's type, range and
nullability from the table), so a canonical line is parsed and type/range-checked without
building an intermediate dict. What a Struct cannot say (invisible characters in names, the
phase pattern, the extra object's keys, the cross-field rules) is checked afterwards on the
decoded object, with the same caches as :func:`vramwatch.wire.validate`'s fast path.

Guarantee: the fast path only says "valid" or "not plainly valid". :func:`decode_line_fast`
returns the sample exactly as ``wire.validate(orjson.loads(line))`` would (same keys, values,
types and key order), or None; on None the caller takes ``orjson.loads`` + ``wire.validate``,
which normalises or raises the :class:`~vramwatch.wire.WireError` naming the field. It never
accepts a line the slow path refuses (tests/test_wire.py checks agreement on mutated samples).

``msgspec`` is optional (the ``server`` extra): without it :data:`decode_line_fast` is None and
``analyze`` decodes with orjson and validates in Python, with the same results.
Cost: about 0.6 of an ``orjson.loads`` of the same line plus ~0.3 for building the dict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from vramwatch.wire import (
    ALLOCATORS,
    FIELD_TABLE,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MIN_TS,
    PHASE_RE,
    SCHEMA_VERSIONS,
    Sample,
    _consistent,
    _known_phases,
    _plain_name,
)

try:  # optional: the hook never needs it, analyze is only faster with it
    import msgspec
except ImportError:  # pragma: no cover - exercised where msgspec is absent
    msgspec = None  # type: ignore[assignment]




def _types() -> dict[str, Any]:
    meta = msgspec.Meta
    whole = Annotated[int, meta(ge=0, le=MAX_INT)]
    return {
        "i": whole, "b": whole,
        "s": str,  # length and invisible characters: _plain_name afterwards (cached per name)
        "ts": Annotated[float, meta(ge=MIN_TS)],
        "f": Annotated[float, meta(ge=0.0)],
        "phase": str,  # pattern: _known_phases / PHASE_RE afterwards
        "allocator": Literal[ALLOCATORS],  # type: ignore[valid-type]
        "extra": dict[str, Union[int, float]],  # noqa: UP007 - keys and bounds checked afterwards
        "flag": bool,
    }


def _struct(version: int) -> type:
    """The Struct for one schema version, fields in table order (so its dict is in the slow path's order)."""
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
            # an explicit null of a non-nullable optional is dropped by the slow path: not plain here
            fields.append((f.name, kind | msgspec.UnsetType, msgspec.UNSET))
    return msgspec.defstruct(f"Schema{version}Sample", fields, tag_field="schema", tag=version,
                             forbid_unknown_fields=True, kw_only=True, gc=False)  # numbers and names only: no cycles


#: (run, host, uuid, incarnation, phase) tuples already checked: they repeat on every sample of a
#: series (bounded, so a hostile file cannot grow it).
_known_names: set[tuple[Any, ...]] = set()


def _names_ok(s: Any) -> bool:
    """Names and phase of a decoded Struct: what :func:`wire.validate` checks (length,
    invisible characters, the phase pattern)."""
    if s.phase not in _known_phases and not PHASE_RE.match(s.phase):
        return False
    unset = msgspec.UNSET
    return _plain_name(s.run) and _plain_name(s.host) and all(
        name is unset or _plain_name(name) for name in (s.uuid, s.incarnation))


def _extra_ok(extra: dict[str, Any]) -> bool:
    return len(extra) <= MAX_EXTRA_KEYS and all(
        _plain_name(key, 64) and -MAX_INT <= number <= MAX_INT for key, number in extra.items())


def _make() -> Callable[[bytes], Sample | None] | None:
    if msgspec is None:
        return None
    structs = tuple(_struct(v) for v in SCHEMA_VERSIONS)
    decode = msgspec.json.Decoder(Union[structs]).decode  # type: ignore[arg-type]  # noqa: UP007
    to_builtins, unset, known = msgspec.to_builtins, msgspec.UNSET, _known_names
    errors = (msgspec.ValidationError, msgspec.DecodeError)

    def decode_line_fast(line: bytes) -> Sample | None:
        """The validated sample of one JSON line, or None: "take orjson + wire.validate".

        Kept flat: it is analyze's per-line call. JSON numbers are finite here (msgspec refuses
        out-of-range ones, as orjson does), so only the bounds need checking.
        """
        try:
            s = decode(line)
        except errors:
            return None
        names = (s.run, s.host, s.uuid, s.incarnation, s.phase)
        if names not in known:
            if not _names_ok(s):
                return None
            if len(known) < 4096:
                known.add(names)
        if s.extra is not unset and not _extra_ok(s.extra):
            return None
        allocated, reserved, peak, total = s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes, s.total_bytes
        if (type(allocated) is int and type(reserved) is int and type(peak) is int
                and s.foreign_used_bytes is unset and s.allocator != "cudaMallocAsync"):
            used = s.nvml_used_bytes
            if not (allocated <= reserved <= total and peak >= allocated and total > 0
                    and (used is None or used is unset or used <= total)):
                return None
            return to_builtins(s)  # type: ignore[no-any-return]
        sample = to_builtins(s)  # sparse, foreign memory or cudaMallocAsync: the general rules
        return None if _consistent(sample) is not None else sample

    return decode_line_fast


#: ``decode_line_fast(line) -> Sample | None``; None itself when msgspec is not installed.
decode_line_fast: Callable[[bytes], Sample | None] | None = _make()

__all__ = ["decode_line_fast"]
