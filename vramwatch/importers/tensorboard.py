"""TensorBoard event files (``events.out.tfevents.*``): memory scalars → samples.

The tags to read and the fields they become are one table, ``tensorboard_keys.toml``
(Megatron-LM, torchtitan, Lightning DeviceStatsMonitor), extendable with ``--keys FILE``.
Scalars logged for the same step are folded into one sample; tags not in the table are
skipped without being decoded (a substring test on the raw record).

No TensorFlow or tensorboard package is needed: the file is TFRecord framing (length,
masked CRC-32C of the length, an ``Event`` protobuf, masked CRC-32C of the data) and the
few protobuf fields read here are decoded by hand. Both CRCs are checked for every record
that holds a mapped tag (pure-Python CRC-32C costs ~0.2 µs per byte, so unmapped
records, most of a training log, are framed by the length CRC only). A torn record at the
end of a file still being written ends the file quietly; corruption elsewhere is a row
error naming the record.

Memory: one step's fields and one record at a time; a record's length field is checked
against ``max_record_bytes`` before anything is read (a length of 2^60 is refused, naming
the record, not allocated).
"""

from __future__ import annotations

import math
import os
import struct
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import IO, Any

from vramwatch.bounded import LimitExceeded, open_input, read_capped, size_text
from vramwatch.importers.common import (
    DEFAULT_HOST,
    RECORD_FLAG,
    ImportOptions,
    ImportStats,
    RowError,
    as_bytes,
    base_sample,
    capacity_from_share,
    checked,
)
from vramwatch.wire import FIELDS, Sample

# ---------------------------------------------------------------- the key table

MAX_KEYS_BYTES = 1 << 20


@dataclass(frozen=True)
class KeyMapping:
    tag: str
    field: str
    scale: float = 1.0
    level: bool = False
    capacity_percent_of: str | None = None
    source: str = ""


def load_keys(extra_path: str | None = None) -> dict[str, KeyMapping]:
    """The built-in table, with the entries of ``extra_path`` (same TOML layout) over it."""
    text = resources.files("vramwatch.importers").joinpath("tensorboard_keys.toml").read_text("utf-8")
    table = _parse_keys(tomllib.loads(text), "tensorboard_keys.toml")
    if extra_path:
        try:
            with open(extra_path, "rb") as fh:  # a key table is a few KiB: 1 MiB at most
                text = read_capped(fh, MAX_KEYS_BYTES, extra_path, "key table").decode("utf-8")
            table.update(_parse_keys(tomllib.loads(text), extra_path))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, LimitExceeded) as exc:
            raise RowError(extra_path, 0, "keys", f"cannot read the key table: {exc}") from None
    return table


def _parse_keys(doc: dict[str, Any], where: str) -> dict[str, KeyMapping]:
    """The ``[keys.TAG]`` tables of a key-table document; a value of the wrong type is a RowError
    naming ``keys.TAG.NAME`` (TOML has booleans, infinities and bare numbers a typo can produce)."""
    keys = doc.get("keys", {})
    if not isinstance(keys, dict):
        raise RowError(where, 0, "keys", f"must be a table of [keys.\"TAG\"] entries, got {keys!r}")
    out = {}
    for tag, entry in keys.items():
        if not isinstance(entry, dict):
            raise RowError(where, 0, f"keys.{tag}", f"must be a table (field = ..., scale = ...), got {entry!r}")
        field = entry.get("field")
        valid = isinstance(field, str) and (field in FIELDS or (field.startswith("extra.") and len(field) > 6))
        if not valid:
            raise RowError(where, 0, f"keys.{tag}", f"field must be a schema-1 field or extra.NAME, got {field!r}")
        scale, level = entry.get("scale", 1), entry.get("level", False)
        percent_of, source = entry.get("capacity_percent_of"), entry.get("source", "")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
            raise RowError(where, 0, f"keys.{tag}.scale", f"must be a positive finite number, got {scale!r}")
        if not isinstance(level, bool):
            raise RowError(where, 0, f"keys.{tag}.level", f"must be true or false, got {level!r}")
        if not (percent_of is None or isinstance(percent_of, str)) or not isinstance(source, str):
            raise RowError(where, 0, f"keys.{tag}", "capacity_percent_of and source must be strings")
        out[tag] = KeyMapping(tag, field, float(scale), level, percent_of, source)
    return out


# ---------------------------------------------------------------- TFRecord + protobuf

def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated right 15 bits, plus a constant."""
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class _Torn(Exception):
    """The file ends inside a record (a writer still running, or killed)."""


class _Corrupt(Exception):
    """A record's framing is wrong: not an event file, or damaged."""


def iter_records(fh: IO[bytes], max_bytes: int = 64 * 2**20, where: str = "") -> Iterator[tuple[int, bytes, int]]:
    """(record number, data, stored data CRC) for each TFRecord; the data CRC is checked by the
    caller. A record longer than ``max_bytes`` raises :class:`LimitExceeded` before it is read."""
    number = 0
    while True:
        head = fh.read(12)
        if not head:
            return
        number += 1
        if len(head) < 12:
            raise _Torn(number)
        length, length_crc = struct.unpack("<QI", head)
        if masked_crc32c(head[:8]) != length_crc:
            raise _Corrupt(number)
        if length > max_bytes:
            raise LimitExceeded(f"{where}: record {number}", RECORD_FLAG,
                                f"length field says {length:,} bytes, more than {size_text(max_bytes)}")
        body = fh.read(length + 4)
        if len(body) < length + 4:
            raise _Torn(number)
        yield number, body[:length], struct.unpack("<I", body[length:])[0]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message; LEN values are bytes."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


# TensorProto dtypes (tensorflow/core/framework/types.proto)
_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64 = 1, 2, 3, 9
_PACKED = {5: ("<f", 4), 6: ("<d", 8)}


def _tensor_scalar(buf: bytes) -> float | None:
    """The single number of a scalar TensorProto (new-style ``tf.summary.scalar``)."""
    dtype, content = None, None
    for number, wire, value in _fields(buf):
        if number == 1:
            dtype = value
        elif number == 4:
            content = value
        elif number in _PACKED:
            fmt, size = _PACKED[number]
            return struct.unpack(fmt, value[:size] if wire == 2 else value)[0]
        elif number in (7, 10):  # int_val / int64_val (varint, maybe packed)
            return float(_varint(value, 0)[0] if wire == 2 else value)
    if content is not None:
        fmt = {_DT_FLOAT: "<f", _DT_DOUBLE: "<d", _DT_INT32: "<i", _DT_INT64: "<q"}.get(dtype or 0)
        if fmt and len(content) == struct.calcsize(fmt):
            return float(struct.unpack(fmt, content)[0])
    return None


def parse_event(data: bytes) -> tuple[float, int, list[tuple[str, float]]]:
    """(wall_time, step, [(tag, value)]) of one ``Event`` with a scalar summary."""
    wall_time, step, values = 0.0, 0, []
    for number, _wire, value in _fields(data):
        if number == 1:
            wall_time = struct.unpack("<d", value)[0]
        elif number == 2:
            step = value
        elif number == 5:  # Summary
            for vnum, _w, item in _fields(value):
                if vnum != 1:
                    continue
                tag, scalar = None, None
                for fnum, fwire, fval in _fields(item):
                    if fnum == 1:
                        tag = fval.decode("utf-8", "replace")
                    elif fnum == 2 and fwire == 5:
                        scalar = struct.unpack("<f", fval)[0]
                    elif fnum == 8 and fwire == 2:
                        scalar = _tensor_scalar(fval)
                if tag is not None and scalar is not None:
                    values.append((tag, float(scalar)))
    return wall_time, step, values


# ---------------------------------------------------------------- importer

def event_files(path: str) -> list[str]:
    """A directory → its event files (recursive, sorted by name: TensorBoard's order)."""
    if not os.path.isdir(path):
        return [path]
    found = []
    for root, _dirs, files in os.walk(path):
        found.extend(os.path.join(root, f) for f in files if "tfevents" in f)
    return sorted(found)


@dataclass
class _Identity:
    run: str
    host: str
    rank: int
    incarnation: str
    #: the device capacity once derived (it does not change within a file)
    total_bytes: int | None = None


@dataclass
class _Step:
    step: int
    ts: float
    record: int
    values: dict[str, float]


def read(path: str, options: ImportOptions, stats: ImportStats) -> Iterator[Sample]:
    """Samples from one event file (or every event file under a directory)."""
    keys = load_keys(options.keys_path)
    for name in event_files(path):
        yield from _read_file(name, options, stats, keys)


def _read_file(path: str, options: ImportOptions, stats: ImportStats, keys: dict[str, KeyMapping]) -> Iterator[Sample]:
    needles = [tag.encode() for tag in keys]
    run = options.run or _run_name(path)
    identity = _Identity(run, options.host or DEFAULT_HOST, options.rank or 0, os.path.basename(path)[:128])
    current: _Step | None = None
    with open_input(path) as fh:
        try:
            for number, data, data_crc in iter_records(fh, options.max_record_bytes, path):
                if not any(n in data for n in needles):
                    continue
                stats.rows += 1
                if masked_crc32c(data) != data_crc:
                    stats.bad(RowError(path, f"record {number}", "data", "checksum mismatch (corrupt record)"))
                    continue
                try:
                    wall_time, step, values = parse_event(data)
                except (ValueError, IndexError, struct.error) as exc:
                    stats.bad(RowError(path, f"record {number}", "event", f"cannot decode: {exc}"))
                    continue
                for tag, value in values:
                    if tag not in keys:
                        continue
                    if current is None or step != current.step:
                        if current is not None:
                            yield from _emit(path, current, keys, identity, options, stats)
                        current = _Step(step, wall_time, number, {})
                    current.values[tag] = value
        except _Torn:
            pass  # the writer is still running (or was killed mid-write): what is whole counts
        except _Corrupt as exc:
            raise RowError(path, f"record {exc.args[0]}", "length",
                           "checksum mismatch: not a TensorBoard event file, or corrupt") from None
    if current is not None:
        yield from _emit(path, current, keys, identity, options, stats)


def _run_name(path: str) -> str:
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent or "tensorboard"


def _emit(path: str, group: _Step, keys: dict[str, KeyMapping], identity: _Identity,
          options: ImportOptions, stats: ImportStats) -> Iterator[Sample]:
    sample = _fold(path, group, keys, identity, options, stats)
    if sample is not None:
        out = checked(sample, path, f"record {group.record}", stats)
        if out is not None:
            yield out


def _fold(path: str, group: _Step, keys: dict[str, KeyMapping], identity: _Identity,
          options: ImportOptions, stats: ImportStats) -> dict[str, Any] | None:
    sample = base_sample(identity.run, identity.host, identity.rank, group.step, group.ts)
    sample["incarnation"] = identity.incarnation
    extra: dict[str, float] = {}
    where = f"record {group.record}"
    level_tag = None
    for tag, value in group.values.items():
        key = keys[tag]
        if key.capacity_percent_of:
            partner = group.values.get(key.capacity_percent_of)
            if partner is not None and value > 0 and identity.total_bytes is None:
                identity.total_bytes = capacity_from_share(partner * keys[key.capacity_percent_of].scale, value)
            continue
        if not math.isfinite(value) or value < 0:
            stats.bad(RowError(path, where, tag, f"must be a finite non-negative number, got {value!r}"))
            return None
        if key.field.startswith("extra."):
            extra[key.field[6:]] = value * key.scale
            continue
        sample[key.field] = as_bytes(value, key.scale)
        if key.level:
            level_tag = tag
    if "allocated_bytes" not in sample and level_tag is not None:
        sample["allocated_bytes"] = sample[keys[level_tag].field]
        extra["level_is_window_peak"] = 1
    if options.total_bytes is not None:
        sample["total_bytes"] = options.total_bytes
    elif identity.total_bytes is not None:
        sample["total_bytes"] = identity.total_bytes
    if "total_bytes" not in sample:
        stats.bad(RowError(path, where, ", ".join(sorted(group.values)),
                           "the event file does not say the device's capacity: pass --device-memory SIZE"))
        return None
    if extra:
        sample["extra"] = extra
    return sample
