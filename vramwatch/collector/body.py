"""Request bodies of ``POST /api/v1/samples``: inflate, split, decode and validate *while
counting*, so no body can make the collector build more objects than the limits allow.

Guarantees (docs/reliability.md, "memory per request"):

* gzip is inflated in blocks of :data:`BLOCK_BYTES` (256 KiB); past ``max_decompressed`` bytes the
  body is refused (413) before the next block is produced;
* NDJSON (and a single JSON object, which is one line) is decoded one block of complete
  lines at a time. The lines of a block are counted (one C-level regex pass) *before* they
  are decoded: at ``max_samples`` + 1 the body is refused (413) without decoding that block.
  A line may be at most :data:`MAX_LINE_BYTES` long, so one line cannot hide millions of
  values;
* a JSON array (``[...]``) is decoded whole, so it may be at most :data:`MAX_ARRAY_BYTES`
  once inflated (about 10,000 typical samples; NDJSON has no such cap);
* each decoded item is validated at once; valid samples are kept (they are the batch), an
  invalid one is counted and at most ``max_errors`` of them are described;
* the kept samples may hold at most :data:`VALUES_PER_SAMPLE` x ``max_samples`` fields and
  extra keys in all (413 past it: the hook halves the batch).

Fast path: a body of at most :data:`FAST_BODY_BYTES` once inflated (a hook's batch always is) is
first decoded and validated in one C pass (:func:`vramwatch.wire.decode.decode_body_fast`,
msgspec). It only ever says "all valid, within every bound above" (then its samples are the
batch, identical to the slow path's) or "not plainly so"; then the body is decoded again by the
bounded path below, which refuses it or names each bad sample and field exactly as before. Its
memory stays within the JSON array bound (it decodes at most :data:`FAST_BODY_BYTES` at once).

Peak memory of one request is then about: the raw body (at most ``max_body_bytes``) +
one block and its decoded objects (at most ~10 MB for a hostile block of tiny values) +
the kept valid samples (~1.7 KB for a typical sample; at most 1.6 M fields in all,
about 130 MB whatever their shape) — under 256 MB with the defaults (bench/attack_bench.py
measures it).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from vramwatch.wire import FIELD_TABLE, MAX_EXTRA_KEYS, Sample, WireError, validate
from vramwatch.wire.decode import decode_body_fast

#: gzip output and raw input are handled in blocks of this many bytes (small: one block is
#: one C call holding the GIL, and its objects are the transient memory)
BLOCK_BYTES = 256 * 1024
#: longest NDJSON line (a valid sample is well under 8 KB, even with 64 extra keys)
MAX_LINE_BYTES = 64 * 1024
#: the kept samples' fields plus extra keys may be at most this many per allowed sample
#: (a hook's sample has 15-30 fields): 50,000 samples with 64 extra keys each would be
#: ~350 MB of Python objects; the budget stops such a body at ~17,000 (413: split)
VALUES_PER_SAMPLE = 32
#: largest JSON array body once inflated (decoded whole: ~35 bytes of Python per byte at worst)
MAX_ARRAY_BYTES = 4 * 1024 * 1024
#: bodies up to this size once inflated try the one-pass decoder first (the array bound: the
#: same worst-case memory); a hook's batch is at most 1 MiB (delivery's max_batch_bytes)
FAST_BODY_BYTES = MAX_ARRAY_BYTES
#: most fields plus extra keys one valid sample can hold (the field budget is exact only past it)
_MOST_VALUES = len(FIELD_TABLE) + MAX_EXTRA_KEYS

_NON_BLANK_LINE = re.compile(rb"[^ \t\r\n][^\n]*")
_GZIP_MAGIC = b"\x1f\x8b"


class BodyError(WireError):
    """The body as a whole is unusable (400): not JSON, bad gzip."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__("body", message)


class BodyTooLargeError(BodyError):
    """The body is past a size or count limit (413); nothing was stored."""

    status = 413


@dataclass
class SampleError:
    index: int
    field: str
    message: str


@dataclass
class DecodedBody:
    """Valid samples (empty once any item was invalid: the batch is all or nothing), the
    first ``max_errors`` errors, and counts."""

    samples: list[Sample] = field(default_factory=list)
    errors: list[SampleError] = field(default_factory=list)
    items: int = 0
    rejected: int = 0
    #: decoded by the one-pass fast path (see the module docstring)
    fast: bool = False


# ---------------------------------------------------------------- gzip


def iter_inflated(data: bytes, limit: int, block: int = BLOCK_BYTES) -> Iterator[bytes]:
    """Inflate a gzip body block by block, refusing to grow past ``limit`` bytes.

    Several concatenated members (``cat a.gz b.gz``) are one body, as for
    ``gzip.decompress``; trailing zero padding is ignored; anything else after the last
    member is an error, never silently dropped. Raises :class:`BodyError` /
    :class:`BodyTooLargeError`. Memory: at most ``block`` bytes of output at a time.
    """
    size = 0
    rest = data
    while True:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        pending = rest
        while not inflater.eof:
            try:
                out = inflater.decompress(pending, min(block, limit - size + 1))
            except zlib.error as exc:
                raise BodyError(f"invalid gzip data: {exc}") from None
            pending = inflater.unconsumed_tail
            if out:
                size += len(out)
                if size > limit:
                    raise BodyTooLargeError(f"decompressed body exceeds {limit} bytes")
                yield out
            elif not pending and not inflater.eof:
                raise BodyError("truncated gzip data")
        rest = inflater.unused_data
        if not rest.strip(b"\x00"):  # trailing zero padding (tape-style) is harmless
            return
        if rest[:2] != _GZIP_MAGIC:
            raise BodyError(f"{len(rest)} bytes of trailing data after the gzip stream")


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Inflate a whole gzip body (at most ``limit`` bytes); see :func:`iter_inflated`."""
    return b"".join(iter_inflated(data, limit))


def _iter_blocks(data: bytes, block: int = BLOCK_BYTES) -> Iterator[bytes]:
    for start in range(0, len(data), block):
        yield data[start:start + block]


# ---------------------------------------------------------------- lines


def _line_blocks(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(number of the block's first line, block of whole lines) from arbitrary chunks."""
    carry = b""
    lineno = 1
    for chunk in chunks:
        buf = carry + chunk if carry else chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            carry = buf
        else:
            block, carry = buf[:cut], buf[cut + 1:]
            yield lineno, block
            lineno += block.count(b"\n") + 1
        if len(carry) > MAX_LINE_BYTES:
            raise BodyTooLargeError(f"line {lineno}: longer than {MAX_LINE_BYTES} bytes")
    if carry:
        yield lineno, carry


def _decode_lines_slowly(block: bytes, lineno: int) -> list[Any]:
    """Per-line decoding of one block, to name the first bad line."""
    items = []
    for number, line in enumerate(block.split(b"\n"), lineno):
        if line.strip():
            try:
                items.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise BodyError(f"line {number}: invalid JSON: {exc}") from None
    return items


def _decode_block(block: bytes, lineno: int, room: int, max_samples: int) -> list[Any]:
    lines = _NON_BLANK_LINE.findall(block)
    if len(lines) > room:
        raise BodyTooLargeError(f"more than {max_samples} samples; at most {max_samples} per request")
    if not lines:
        return []
    if max(map(len, lines)) > MAX_LINE_BYTES:
        raise BodyTooLargeError(f"a line near line {lineno} is longer than {MAX_LINE_BYTES} bytes")
    # one C call for the whole block: NDJSON of objects is an array once lines are joined
    try:
        items = orjson.loads(b"[" + b",".join(lines) + b"]")
        if len(items) == len(lines):
            return items
    except orjson.JSONDecodeError:
        pass
    return _decode_lines_slowly(block, lineno)


# ---------------------------------------------------------------- bodies


class _Collector:
    def __init__(self, now: float | None, max_future_s: float, max_errors: int, max_values: int) -> None:
        self.out = DecodedBody()
        self.now = now
        self.max_future_s = max_future_s
        self.max_errors = max_errors
        self.max_values = max_values
        self.values = 0

    def add(self, items: list[Any]) -> None:
        out = self.out
        for item in items:
            index = out.items
            out.items += 1
            try:
                sample = validate(item, now=self.now, max_future_s=self.max_future_s)
            except WireError as exc:
                out.rejected += 1
                out.samples = []  # all or nothing: free the batch at the first bad sample
                if len(out.errors) < self.max_errors:
                    out.errors.append(SampleError(index, exc.field, exc.message))
                continue
            if not out.rejected:
                extra = sample.get("extra")
                self.values += len(sample) + (len(extra) if extra else 0)
                if self.values > self.max_values:
                    out.samples = []
                    raise BodyTooLargeError(
                        f"more than {self.max_values} fields and extra keys in all (sample {index}); "
                        "split the batch")
                out.samples.append(sample)


def decode_body(
    data: bytes,
    *,
    gzipped: bool,
    max_decompressed: int,
    max_samples: int,
    now: float | None = None,
    max_future_s: float = 300.0,
    max_errors: int = 50,
    max_values: int | None = None,
) -> DecodedBody:
    """Decode and validate a request body in bounded blocks (see the module docstring).

    Raises :class:`BodyError` (400) or :class:`BodyTooLargeError` (413) for the body as a
    whole; per-sample problems are returned in ``errors``. CPU: one C pass (msgspec) for a
    valid body; otherwise inflating again plus the bounded pass, C-level except the
    per-sample validation.
    """
    fast = decode_fast(data, gzipped=gzipped, max_inflated=FAST_BODY_BYTES, max_decompressed=max_decompressed,
                       max_samples=max_samples, now=now, max_future_s=max_future_s, max_values=max_values)
    if fast is not None:
        return fast
    budget = max_values if max_values is not None else VALUES_PER_SAMPLE * max_samples
    chunks = iter_inflated(data, max_decompressed) if gzipped else _iter_blocks(data)
    first = b""
    for first in chunks:
        if first.strip():
            break
    else:
        raise BodyError("is empty")
    collector = _Collector(now, max_future_s, max_errors, budget)
    if first.lstrip()[:1] == b"[":
        collector.add(_decode_array(first, chunks, max_samples))
        return collector.out

    def rest() -> Iterator[bytes]:
        yield first
        yield from chunks

    for lineno, block in _line_blocks(rest()):
        collector.add(_decode_block(block, lineno, max_samples - collector.out.items, max_samples))
    if collector.out.items == 0:
        raise BodyError("is empty")
    return collector.out


def decode_fast(
    data: bytes,
    *,
    gzipped: bool,
    max_inflated: int,
    max_decompressed: int,
    max_samples: int,
    now: float | None = None,
    max_future_s: float = 300.0,
    max_errors: int = 50,
    max_values: int | None = None,
) -> DecodedBody | None:
    """:func:`decode_body`'s one-pass fast path alone, for a body of at most ``max_inflated``
    bytes once inflated: the batch, or None ("not plainly valid or bigger: call decode_body").

    Cost: inflating and decoding at most ``max_inflated`` bytes (one C pass each), so a
    caller can bound the time it spends here (the collector runs it on its event loop for
    a hook-sized body, :mod:`vramwatch.collector.ingest`). ``max_errors`` is accepted so
    both functions take the same arguments; the fast path names no errors."""
    budget = max_values if max_values is not None else VALUES_PER_SAMPLE * max_samples
    limit = min(max_inflated, FAST_BODY_BYTES)
    if gzipped:
        limit = min(limit, max_decompressed)
    fast = _decode_fast(data, gzipped, limit, max_samples, now, max_future_s, budget)
    return None if fast is None else DecodedBody(samples=fast, items=len(fast), fast=True)


def _decode_fast(data: bytes, gzipped: bool, limit: int, max_samples: int, now: float | None,
                 max_future_s: float, budget: int) -> list[Sample] | None:
    """The batch when the one-pass decoder accepts the whole body (at most ``limit`` bytes
    inflated) within every bound of the slow path, else None (the slow path then decides: it
    inflates again, which costs only bodies that are refused, too large or not canonical)."""
    if decode_body_fast is None or len(data) > limit:
        return None
    if gzipped:
        try:  # one block: a single-member body inflates into one buffer, joined without a copy
            text = b"".join(iter_inflated(data, limit, block=limit + 1))
        except BodyError:  # bad gzip or bigger than the fast bound: the slow path says which
            return None
    else:
        text = data
    if len(text) > MAX_LINE_BYTES and text.lstrip()[:1] != b"[" and _longest_line(text) > MAX_LINE_BYTES:
        return None
    samples = decode_body_fast(text, now=now, max_future_s=max_future_s)
    if samples is None or len(samples) > max_samples:
        return None
    if len(samples) * _MOST_VALUES > budget and sum(
            len(s) + len(s.get("extra") or ()) for s in samples) > budget:
        return None
    return samples


def _longest_line(text: bytes) -> int:
    """Length of the longest line of ``text`` without splitting it (no copy: one find per line)."""
    longest = start = 0
    while (end := text.find(b"\n", start)) >= 0:
        longest = max(longest, end - start)
        start = end + 1
    return max(longest, len(text) - start)


def _decode_array(first: bytes, chunks: Iterator[bytes], max_samples: int) -> list[Any]:
    parts, size = [first], len(first)
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_ARRAY_BYTES:
            raise BodyTooLargeError(
                f"a JSON array body may be at most {MAX_ARRAY_BYTES} bytes; send NDJSON (one sample "
                "per line) for bigger batches")
        parts.append(chunk)
    try:
        items = orjson.loads(b"".join(parts))
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"invalid JSON: {exc}") from None
    if type(items) is not list:  # pragma: no cover - '[' always parses to a list
        raise BodyError("must be a JSON array or NDJSON")
    if len(items) > max_samples:
        raise BodyTooLargeError(f"{len(items)} samples; at most {max_samples} per request")
    return items


def parse_body(data: bytes) -> list[Any]:
    """Decode a whole body (array, one object or NDJSON) without validating; for tools and
    tests. Bounded like :func:`decode_body` (no sample-count limit)."""
    first = data.lstrip()[:1]
    if not first:
        raise BodyError("is empty")
    if first == b"[":
        return _decode_array(data, iter(()), 2**62)
    items: list[Any] = []
    for lineno, block in _line_blocks(_iter_blocks(data)):
        items.extend(_decode_block(block, lineno, 2**62, 2**62))
    return items


__all__ = [
    "BLOCK_BYTES", "MAX_ARRAY_BYTES", "MAX_LINE_BYTES", "BodyError", "BodyTooLargeError", "DecodedBody",
    "SampleError", "decode_body", "decode_fast", "gunzip_limited", "iter_inflated", "parse_body",
]
