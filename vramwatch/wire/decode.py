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

from vramwatch.wire.fields import (
    ALLOCATORS,
    FIELD_TABLE,
    MAX_EXTRA_KEYS,
    MAX_INT,
    MIN_TS,
    PHASE_RE,
    SCHEMA_VERSIONS,
    Sample,
)
from vramwatch.wire.validate import _consistent, _known_phases, _plain_name

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


def _struct_ok(s: Any) -> bool | None:
    """What the Struct cannot say about one decoded sample: names (cached per tuple), the extra
    object, the common cross-field check. None: sparse, foreign memory or cudaMallocAsync, the
    general rules (:func:`wire._consistent`) are to run on its dict."""
    names = (s.run, s.host, s.uuid, s.incarnation, s.phase)
    if names not in _known_names:
        if not _names_ok(s):
            return False
        if len(_known_names) < 4096:
            _known_names.add(names)
    unset = msgspec.UNSET
    if s.extra is not unset and not _extra_ok(s.extra):
        return False
    allocated, reserved, peak, total = s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes, s.total_bytes
    if (type(allocated) is int and type(reserved) is int and type(peak) is int
            and s.foreign_used_bytes is unset and s.allocator != "cudaMallocAsync"):
        used = s.nvml_used_bytes
        return (allocated <= reserved <= total and peak >= allocated and total > 0
                and (used is None or used is unset or used <= total))
    return None


def _make() -> tuple[Callable[[bytes], Sample | None], Callable[..., list[Sample] | None],
                     Callable[[bytes], Any]] | None:
    if msgspec is None:
        return None
    structs = tuple(_struct(v) for v in SCHEMA_VERSIONS)
    schema1 = structs[SCHEMA_VERSIONS.index(1)]
    decode = msgspec.json.Decoder(Union[structs]).decode  # type: ignore[arg-type]  # noqa: UP007
    decode_list = msgspec.json.Decoder(list[Union[structs]]).decode  # type: ignore[index]  # noqa: UP007
    decode_lines = msgspec.json.Decoder(Union[structs]).decode_lines  # type: ignore[arg-type]  # noqa: UP007
    to_builtins = msgspec.to_builtins
    errors = (msgspec.ValidationError, msgspec.DecodeError)

    def decode_line_fast(line: bytes) -> Sample | None:
        """The validated sample of one JSON line, or None: "take orjson + wire.validate".

        JSON numbers are finite here (msgspec refuses out-of-range ones, as orjson does), so
        only the bounds need checking.
        """
        try:
            s = decode(line)
        except errors:
            return None
        ok = _struct_ok(s)
        if ok is False:
            return None
        sample = to_builtins(s)
        return None if ok is None and _consistent(sample) is not None else sample

    def decode_body_fast(body: bytes, now: float | None = None, max_future_s: float = 300.0) -> list[Sample] | None:
        """A whole request body (JSON array, one object or NDJSON, already inflated) validated in
        one pass, or None: "take ``wire.parse_body`` + ``wire.validate``", which name the bad line
        and field. Same samples as ``[validate(x, now=now, max_future_s=max_future_s) for x in
        parse_body(body)]`` (values and types; keys in table order). Cost: about 0.8 of an orjson
        parse of the body plus ~0.5 µs per sample."""
        first = body[:1]
        if first.isspace() or not first:
            first = body.lstrip()[:1]
        try:
            # NDJSON line by line in one C call, blank lines skipped as the slow path skips them;
            # no copy of the body (a 1000-sample batch is ~0.5 MB: each copy was page faults)
            decoded = decode_list(body) if first == b"[" else decode_lines(body)
        except errors:
            return None
        if not decoded:
            return None  # an empty body is an error the slow path names
        checks = [_struct_ok(s) for s in decoded]
        if False in checks or (now is not None and max(s.ts for s in decoded) > now + max_future_s):
            return None
        samples: list[Sample] = to_builtins(decoded)
        if None in checks and any(ok is None and _consistent(x) is not None
                                  for ok, x in zip(checks, samples, strict=True)):
            return None
        return samples

    def decode_line_lazy(line: bytes) -> Any:
        """:func:`decode_line_fast`, except that a plainly valid schema-1 sample (no general rule
        left to run) comes back as its Struct, not yet a dict: one attribute per field,
        ``msgspec.UNSET`` when absent; :data:`sample_of` makes the dict decode_line_fast returns.
        Saves building a dict (~0.5 of a parse) for a reader that needs only some fields
        (``TrendEngine.update_struct``). None: take orjson + wire.validate."""
        try:
            s = decode(line)
        except errors:
            return None
        ok = _struct_ok(s)
        if ok is True and type(s) is schema1:
            return s
        if ok is False:
            return None
        sample = to_builtins(s)
        return None if ok is None and _consistent(sample) is not None else sample

    return decode_line_fast, decode_body_fast, decode_line_lazy


_made = _make()
#: ``decode_line_fast(line) -> Sample | None``; None itself when msgspec is not installed.
decode_line_fast: Callable[[bytes], Sample | None] | None = None if _made is None else _made[0]
#: ``decode_body_fast(body, now=None, max_future_s=300.0) -> list[Sample] | None`` (ingest); None
#: itself when msgspec is not installed.
decode_body_fast: Callable[..., list[Sample] | None] | None = None if _made is None else _made[1]
#: ``decode_line_lazy(line) -> Sample | Struct | None`` (analyze); None itself when msgspec is not installed.
decode_line_lazy: Callable[[bytes], Any] | None = None if _made is None else _made[2]
#: The dict of a Struct from :data:`decode_line_lazy` (what decode_line_fast returns for its line).
sample_of: Callable[[Any], Sample] | None = None if msgspec is None else msgspec.to_builtins

__all__ = ["decode_body_fast", "decode_line_fast", "decode_line_lazy", "sample_of"]
