"""Request bodies of ``POST /api/v1/samples``: inflate, split, decode and validate *while
counting*, so no body can make the collector build more objects than the limits allow.
:func:`decode_body` is the one function that turns a body into samples.

Guarantees (docs/reliability.md, "memory per request"):

* gzip is inflated in blocks of :data:`BLOCK_BYTES` (256 KiB); past ``max_decompressed`` bytes the
  body is refused (413) before the next block is produced;
* NDJSON (and a single JSON object, which is one line) is decoded one block of complete lines
  (about :data:`BLOCK_BYTES`) at a time; at ``max_samples`` + 1 samples the body is refused (413).
  A line may be at most :data:`MAX_LINE_BYTES` long, so one line cannot hide millions of values;
* a JSON array (``[...]``) is never decoded whole: it is decoded in blocks of whole items of
  about :data:`BLOCK_BYTES`, as NDJSON is. A block is cut where one object ends and the next
  begins (``}`` ``,`` ``{``, found by ``rfind``) and taken when it decodes as valid samples: a
  cut inside a string or a nested value cannot decode, so the decoder proves the cut. Any
  other block is read item by item (one C regular-expression match per item, strings and up to
  four levels of nesting skipped in C; a deeper item walked token by token within its cap): its
  items are counted before it is decoded (413 at ``max_samples`` + 1), an item may be at most
  :data:`MAX_LINE_BYTES` long, like a line, and a bad one is named by its index. Either way a
  block is at most about :data:`BLOCK_BYTES` and its items are counted before they are validated;
* each block is decoded and validated in one C pass
  (:func:`vramwatch.wire.decode_samples`, the wire's one acceptor). A block it does not take
  whole is parsed again line by line or item by item (orjson; its lines are counted before
  they are decoded) and each item validated (:func:`vramwatch.wire.validate`, the same
  acceptor), so every bad sample is counted and the first ``max_errors`` are named; only
  such a block is parsed twice;
* the kept samples may hold at most :data:`VALUES_PER_SAMPLE` x ``max_samples`` fields and
  extra keys in all (413 past it: the hook halves the batch);
* JSON nested deeper than :data:`MAX_DEPTH` levels is refused (400), never a RecursionError.

Peak memory of one request is then about: the raw body (at most ``max_body_bytes``; twice
that while its chunks are joined) + one block and its decoded objects (at most ~10 MB for a
hostile block of tiny values) + the kept valid samples (~1.7 KB for a typical sample; at most
1.6 M fields in all, about 130 MB whatever their shape) — under 256 MB with the defaults, array
or NDJSON, plain or gzip (bench/attack_bench.py and bench/bodies_bench.py measure it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from vramwatch.bounded import Inflater, LimitExceeded
from vramwatch.wire import FIELD_TABLE, MAX_EXTRA_KEYS, Sample, WireError, decode_samples, validate

#: gzip output and raw input are handled in blocks of this many bytes (small: one block is
#: one C call holding the GIL, and its objects are the transient memory)
BLOCK_BYTES = 256 * 1024
#: longest NDJSON line (a valid sample is well under 8 KB, even with 64 extra keys)
MAX_LINE_BYTES = 64 * 1024
#: the kept samples' fields plus extra keys may be at most this many per allowed sample
#: (a hook's sample has 15-30 fields): 50,000 samples with 64 extra keys each would be
#: ~350 MB of Python objects; the budget stops such a body at ~17,000 (413: split)
VALUES_PER_SAMPLE = 32
#: deepest JSON nesting a body may hold (orjson's limit; a sample nests two levels)
MAX_DEPTH = 1024
#: most fields plus extra keys one valid sample can hold (the field budget is exact only past it)
_MOST_VALUES = len(FIELD_TABLE) + MAX_EXTRA_KEYS

_NON_BLANK_LINE = re.compile(rb"[^ \t\r\n][^\n]*")
_NOT_BLANK = re.compile(rb"[^ \t\r\n\x0b\x0c]")  # what bytes.isspace() does not count as blank

class SlowBody(Exception):
    """A body that needs more of the slow path (items parsed or validated one by one in Python)
    than :func:`decode_body` was allowed (``max_slow_items``): decode it again off the event loop."""


class BodyError(WireError):
    """The body as a whole is unusable (400): not JSON, bad gzip."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__("body", message)


class BodyTooLargeError(BodyError):
    """The body is past a size or count limit (413); nothing was stored."""

    status = 413


class InflatedTooLargeError(BodyTooLargeError):
    """A gzip body inflates past the limit it was given (``limit``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"decompressed body exceeds {limit} bytes")
        self.limit = limit


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


# ---------------------------------------------------------------- gzip


def iter_inflated(data: bytes, limit: int, block: int = BLOCK_BYTES) -> Iterator[bytes]:
    """Inflate a gzip body block by block, refusing to grow past ``limit`` bytes, through the one
    bounded inflater (:class:`vramwatch.bounded.Inflater`).

    Several concatenated members (``cat a.gz b.gz``) are one body, as for
    ``gzip.decompress``; trailing zero padding is ignored; anything else after the last
    member is an error, never silently dropped. Raises :class:`BodyError` /
    :class:`InflatedTooLargeError`. Memory: at most ``block`` bytes of output at a time.
    """
    inflater = Inflater(limit, "gzip", "max_decompressed", step=block)
    try:
        yield from inflater.feed(data)
        inflater.finish()
    except LimitExceeded:
        raise InflatedTooLargeError(limit) from None
    except OSError as exc:
        raise BodyError(str(exc)) from None


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Inflate a whole gzip body (at most ``limit`` bytes); see :func:`iter_inflated`."""
    return b"".join(iter_inflated(data, limit))


def gzip_size(data: bytes) -> int:
    """The inflated size a gzip body's trailer declares (of its last member, modulo 2**32): exact
    for what a hook sends, a claim only for anything else (inflating enforces the real limit)."""
    return int.from_bytes(data[-4:], "little") if len(data) >= 18 else 0


# ---------------------------------------------------------------- lines


class _Block(NamedTuple):
    """Whole lines ``buf[start:end]`` (no newline at either end), the first of them numbered ``lineno``."""

    lineno: int
    buf: bytes
    start: int
    end: int

    def view(self) -> memoryview:
        return memoryview(self.buf)[self.start:self.end]

    def has_long_line(self) -> bool:
        """Whether a line is longer than MAX_LINE_BYTES: one rfind per window of that size, not per line."""
        buf, pos, end = self.buf, self.start, self.end
        while end - pos > MAX_LINE_BYTES:
            newline = buf.rfind(b"\n", pos, pos + MAX_LINE_BYTES + 1)
            if newline < 0:
                return True
            pos = newline + 1
        return False


def _line_blocks(chunks: Iterable[bytes]) -> Iterator[_Block]:
    """Blocks of whole lines, about BLOCK_BYTES each, from arbitrary chunks (views of the chunks:
    a body that is one chunk is never copied)."""
    carry = b""
    lineno = 1
    for chunk in chunks:
        buf = carry + chunk if carry else chunk
        start = 0
        while True:
            end = start + BLOCK_BYTES
            cut = buf.rfind(b"\n", start, end) if end < len(buf) else buf.rfind(b"\n", start)
            if cut < 0:
                break
            yield _Block(lineno, buf, start, cut)
            lineno += buf.count(b"\n", start, cut) + 1
            start = cut + 1
        carry = buf[start:] if start else buf
        if len(carry) > MAX_LINE_BYTES:
            raise BodyTooLargeError(f"line {lineno}: longer than {MAX_LINE_BYTES} bytes")
    if carry:
        yield _Block(lineno, carry, 0, len(carry))


def _invalid(exc: orjson.JSONDecodeError) -> str:
    if exc.msg.startswith("depth limit"):  # orjson's refusal of deep nesting: name the limit
        return f"JSON nested deeper than {MAX_DEPTH} levels"
    return f"invalid JSON: {exc}"


def _decode_lines_slowly(block: _Block) -> list[Any]:
    """Per-line decoding of one block, to name the first bad line."""
    items = []
    for number, line in enumerate(block.buf[block.start:block.end].split(b"\n"), block.lineno):
        if line.strip():
            try:
                items.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise BodyError(f"line {number}: {_invalid(exc)}") from None
    return items


def _parse_block(block: _Block, room: int, max_samples: int) -> list[Any]:
    """The items of one block, parsed (not validated); its lines are counted first."""
    lines = _NON_BLANK_LINE.findall(block.view())
    if len(lines) > room:
        raise BodyTooLargeError(f"more than {max_samples} samples; at most {max_samples} per request")
    if not lines:
        return []
    if max(map(len, lines)) > MAX_LINE_BYTES:
        raise BodyTooLargeError(f"a line near line {block.lineno} is longer than {MAX_LINE_BYTES} bytes")
    # one C call for the whole block: NDJSON of objects is an array once lines are joined
    try:
        items = orjson.loads(b"[" + b",".join(lines) + b"]")
        if len(items) == len(lines):
            return items
    except orjson.JSONDecodeError:
        pass
    return _decode_lines_slowly(block)


# ---------------------------------------------------------------- arrays

_STRING = rb'"(?:[^"\\]++|\\.)*+"'


def _nested(levels: int) -> bytes:
    """A bracketed value nested at most ``levels`` deep, strings skipped (bracket kinds are not
    matched here: the decoder refuses a mismatch)."""
    group = rb"[\[{](?:[^\"\[\]{}]++|" + _STRING + rb")*+[\]}]"
    for _ in range(levels - 1):
        group = rb"[\[{](?:[^\"\[\]{}]++|" + _STRING + rb"|" + group + rb")*+[\]}]"
    return group


#: one top-level item of an array: anything but a bracket, a quote or a comma, strings, values
#: nested up to four levels (a sample nests two); possessive throughout: linear time
_ITEM = re.compile(rb"(?:[^\"\[\]{},]++|" + _STRING + rb"|" + _nested(4) + rb")++", re.S)
#: what the walk of a deeper item looks at: strings, brackets, commas, a quote that opens no string
_TOKEN = re.compile(_STRING + rb'|[\[\]{},"]', re.S)


def _walk(buf: bytes, pos: int, limit: int) -> int:
    """Where the item at ``pos`` ends (its comma, or a closing bracket at its level), looking at
    ``buf[pos:limit]`` token by token; -1 when it does not end there."""
    depth = 0
    for token in _TOKEN.finditer(buf, pos, limit):
        char = buf[token.start()]
        if char in b"[{":
            depth += 1
        elif char in b"]}":
            if not depth:
                return token.start()
            depth -= 1
        elif char == 44 and not depth:  # ','
            return token.start()
        elif char == 34 and token.end() - token.start() == 1:  # a string not closed within the window
            return -1
    return -1


def _item_end(buf: bytes, pos: int, index: int, final: bool) -> int:
    """The position of the separator after the item at ``pos`` (',' or the array's ']'); -1 when
    more of the body is needed to tell. Raises when the item is longer than MAX_LINE_BYTES or the
    body ends inside it."""
    limit = min(len(buf), pos + MAX_LINE_BYTES + 1)
    found = _ITEM.match(buf, pos, limit)
    end = found.end() if found else pos
    if end >= limit or buf[end] not in b",]":
        end = _walk(buf, pos, limit)
    if end >= 0:
        if buf[end] not in b",]":
            raise BodyError(f"item {index}: invalid JSON: unexpected {chr(buf[end])!r}")
        return end
    if limit - pos > MAX_LINE_BYTES:
        raise BodyTooLargeError(f"item {index}: longer than {MAX_LINE_BYTES} bytes")
    if final:
        raise BodyError(f"item {index}: invalid JSON: the array is not closed")
    return -1


def _last_non_blank(buf: bytes, low: int, high: int) -> int:
    """The position of the last byte in ``buf[low:high]`` that is not JSON whitespace; ``low - 1``
    if none within 256 bytes (no cut is guessed across a longer run of blanks)."""
    stop = max(low, high - 256)
    high -= 1
    while high >= stop and buf[high] in b" \t\r\n":
        high -= 1
    return high if high >= stop else low - 1


class _ArrayReader:
    """The top-level items of a JSON array body arriving in chunks (``first``: blanks, '[', ...),
    handed out in blocks of whole items of about BLOCK_BYTES, each as JSON array text.

    :meth:`guess` cuts where an object (or array) ends and the next begins (``}`` ``,`` ``{``,
    found by ``rfind``): the decoder proves such a cut, since a block cut inside a string or a
    nested value cannot decode. Where it does not prove out (a block with a bad item, a cut that
    fell in a string), :meth:`exact` walks the items one by one (:func:`_item_end`), counting them
    and naming a bad one. Holds one chunk plus at most a block and a line of lookahead."""

    def __init__(self, first: bytes, chunks: Iterator[bytes]) -> None:
        self.buf, self.pos = first, _NOT_BLANK.search(first).end()  # type: ignore[union-attr]
        self.chunks, self.final, self.done, self.index = chunks, False, False, 0

    def _fill(self, need: int) -> None:
        while not self.final and len(self.buf) - self.pos < need:
            more = next(self.chunks, None)
            if more is None:
                self.final = True
            else:
                self.buf, self.pos = self.buf[self.pos:] + more, 0

    def guess(self) -> tuple[bytes, int] | None:
        """``(text, end)``: a block of whole items if the cut holds (the decoder tells), or None."""
        self._fill(BLOCK_BYTES + 1)
        buf, pos = self.buf, self.pos
        end = pos + BLOCK_BYTES
        if end < len(buf):  # cut before the last object (or array) that begins in the window
            for _ in range(8):
                end = max(buf.rfind(b"{", pos, end), buf.rfind(b"[", pos, end))
                comma = _last_non_blank(buf, pos, end)
                if comma <= pos:
                    return None
                if buf[comma] == 44 and buf[_last_non_blank(buf, pos, comma)] in b"}]":  # '}' ',' '{'
                    return b"[" + buf[pos:comma] + b"]", comma + 1
            return None
        close = _last_non_blank(buf, pos, len(buf))  # the body's end is here (final): all of it
        if close < pos or buf[close] != 93 or _NOT_BLANK.search(buf, pos, close) is None:
            return None
        return b"[" + buf[pos:close] + b"]", len(buf)

    def advance(self, end: int, items: int) -> None:
        """A guessed block was taken whole (``items`` of them)."""
        self.pos, self.index = end, self.index + items
        self.done = end == len(self.buf) and self.final

    def exact(self, max_samples: int) -> tuple[int, bytes] | None:
        """``(index of its first item, text)``: the next block, item by item; None for ``[]``.
        Past ``max_samples`` items the body is refused (413) before the block is decoded."""
        first, start, end = self.index, -1, 0
        while not self.done:
            stop = _item_end(self.buf, self.pos, self.index, self.final)
            if stop < 0:
                if start >= 0:
                    break  # hand out what is whole; the next block starts after more arrived
                self._fill(len(self.buf) - self.pos + 1)
                continue
            buf = self.buf
            if _NOT_BLANK.search(buf, self.pos, stop) is None:
                if buf[stop] != 93 or self.index:
                    raise BodyError(f"item {self.index}: invalid JSON: no value before {chr(buf[stop])!r}")
                self.pos = stop + 1  # '[]'
                self._end()
                return None
            start, end = self.pos if start < 0 else start, stop
            self.index += 1
            self.pos = stop + 1
            if self.index > max_samples:
                raise BodyTooLargeError(f"more than {max_samples} samples; at most {max_samples} per request")
            if buf[stop] == 93:
                self._end()
            elif end - start >= BLOCK_BYTES:
                break
        return first, b"[" + self.buf[start:end] + b"]"

    def _end(self) -> None:
        """The array closed: what follows must be blank."""
        self.done = True
        if _NOT_BLANK.search(self.buf, self.pos) or any(_NOT_BLANK.search(rest) for rest in self.chunks):
            raise BodyError("invalid JSON: more after the array's closing ']'")


def _loads_or_none(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def _parse_items(first: int, text: bytes) -> list[Any]:
    """The items of one block of an array (parsed, not validated); a bad one is named by index."""
    try:
        return orjson.loads(text)  # type: ignore[no-any-return]
    except orjson.JSONDecodeError as exc:
        whole = exc
    pos, index = 1, first
    while pos < len(text):  # the block's items are whole: each ends at a ',' or the final ']'
        end = _item_end(text, pos, index, True)
        try:
            orjson.loads(text[pos:end])
        except orjson.JSONDecodeError as exc:
            raise BodyError(f"item {index}: {_invalid(exc)}") from None
        pos, index = end + 1, index + 1
    raise BodyError(_invalid(whole))  # pragma: no cover - a block's items decode as its whole


class _Batch:
    """The samples of one body as its blocks are decoded: kept while all are valid, errors
    named, counts and the field budget enforced."""

    def __init__(self, max_samples: int, now: float | None, max_future_s: float, max_errors: int,
                 max_values: int, max_slow_items: int | None = None) -> None:
        self.out = DecodedBody()
        self.max_samples = max_samples
        self.now = now
        self.max_future_s = max_future_s
        self.max_errors = max_errors
        self.max_values = max_values
        #: items that may still be validated one by one (None: any number)
        self.slow_room = max_slow_items
        self.values_bound = 0  # an upper bound of the kept samples' values, while under the budget
        self.values: int | None = None  # their exact count, once the bound passed the budget

    def lines(self, block: _Block) -> None:
        samples = decode_samples(block.view(), now=self.now, max_future_s=self.max_future_s)
        if samples is None:  # not every line accepted as written: parse line by line, name each
            self._spend(block.buf.count(b"\n", block.start, block.end) + 1)  # its lines, at most
            self._validate(_parse_block(block, self.max_samples - self.out.items, self.max_samples))
            return
        if block.end - block.start > MAX_LINE_BYTES and block.has_long_line():
            raise BodyTooLargeError(f"a line near line {block.lineno} is longer than {MAX_LINE_BYTES} bytes")
        if self.out.items + len(samples) > self.max_samples:
            raise BodyTooLargeError(f"more than {self.max_samples} samples; at most {self.max_samples} per request")
        self._keep(samples)

    def array(self, reader: _ArrayReader) -> None:
        """Every block of an array's items: a guessed block taken whole when it decodes as valid
        samples (one C pass), else the next block item by item (counted first; bad items named)."""
        while not reader.done:
            guessed = reader.guess()
            if guessed is not None:
                samples = decode_samples(guessed[0], now=self.now, max_future_s=self.max_future_s)
                items = samples if samples is not None else _loads_or_none(guessed[0])
                if items is not None:  # the cut holds: the block decodes
                    if self.out.items + len(items) > self.max_samples:
                        raise BodyTooLargeError(f"more than {self.max_samples} samples; at most {self.max_samples} "
                                                "per request")
                    reader.advance(guessed[1], len(items))
                    if samples is None:
                        self._validate(items)
                    else:
                        self._keep(samples)
                    continue
            if self.slow_room is not None:
                raise SlowBody()  # item by item is the slow path throughout: off the event loop
            block = reader.exact(self.max_samples)
            if block is None:
                continue
            samples = decode_samples(block[1], now=self.now, max_future_s=self.max_future_s)
            if samples is None:
                self._validate(_parse_items(*block))
            else:
                self._keep(samples)

    def _spend(self, items: int) -> None:
        """``items`` more for the slow path: :class:`SlowBody` past ``max_slow_items`` in all."""
        if self.slow_room is not None:
            self.slow_room -= items
            if self.slow_room < 0:
                raise SlowBody()

    def _keep(self, samples: list[Sample]) -> None:
        out = self.out
        first = out.items
        out.items += len(samples)
        if out.rejected:
            return  # all or nothing: a refused sample was seen, nothing more is kept
        self._budget(samples, first)
        out.samples.extend(samples)

    def _validate(self, items: list[Any]) -> None:
        self._spend(len(items))
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
                self._budget([sample], index)
                out.samples.append(sample)

    def _budget(self, samples: list[Sample], first: int) -> None:
        """Fields plus extra keys of the kept samples, at most ``max_values``: an upper bound
        while it is under the budget (a hook's batch always is), counted exactly past it."""
        if self.values is None:
            bound = self.values_bound + len(samples) * _MOST_VALUES
            if bound <= self.max_values:
                self.values_bound = bound
                return
            self.values = sum(map(_values, self.out.samples))
        for index, sample in enumerate(samples, first):
            self.values += _values(sample)
            if self.values > self.max_values:
                self.out.samples = []
                raise BodyTooLargeError(f"more than {self.max_values} fields and extra keys in all (sample "
                                        f"{index}); split the batch")


def _values(sample: Sample) -> int:
    extra = sample.get("extra")
    return len(sample) + (len(extra) if extra else 0)


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
    max_slow_items: int | None = None,
) -> DecodedBody:
    """Decode and validate a request body in bounded blocks (see the module docstring).

    Raises :class:`BodyError` (400) or :class:`BodyTooLargeError` (413) for the body as a
    whole (:class:`InflatedTooLargeError` past ``max_decompressed``); per-sample problems are
    returned in ``errors``. CPU: inflating, and one C pass per block of a valid body; a block
    with a refused sample is parsed again (orjson) and its items validated one by one.
    ``max_slow_items``: raise :class:`SlowBody` rather than parse or validate more items one by one
    (the caller decodes on the event loop and goes to a worker thread for more).
    """
    budget = max_values if max_values is not None else VALUES_PER_SAMPLE * max_samples
    batch = _Batch(max_samples, now, max_future_s, max_errors, budget, max_slow_items)
    chunks = iter_inflated(data, max_decompressed) if gzipped else iter((data,))
    first = b""
    for first in chunks:
        if first and not first.isspace():
            break
    else:
        raise BodyError("is empty")
    if _NOT_BLANK.search(first).group() == b"[":  # type: ignore[union-attr]
        batch.array(_ArrayReader(first, chunks))
        return batch.out

    def rest() -> Iterator[bytes]:
        yield first
        yield from chunks

    for block in _line_blocks(rest()):
        batch.lines(block)
    if batch.out.items == 0:
        raise BodyError("is empty")
    return batch.out


def parse_body(data: bytes) -> list[Any]:
    """Decode a whole body (array, one object or NDJSON) without validating; for tools and
    tests. Bounded like :func:`decode_body` (no sample-count limit)."""
    found = _NOT_BLANK.search(data)
    if found is None:
        raise BodyError("is empty")
    items: list[Any] = []
    if found.group() == b"[":
        reader = _ArrayReader(data, iter(()))
        while not reader.done:
            block = reader.exact(2**62)
            if block is not None:
                items.extend(_parse_items(*block))
        return items
    for block in _line_blocks((data,)):
        items.extend(_parse_block(block, 2**62, 2**62))
    return items


__all__ = [
    "BLOCK_BYTES", "MAX_DEPTH", "MAX_LINE_BYTES", "BodyError", "BodyTooLargeError", "DecodedBody",
    "InflatedTooLargeError", "SampleError", "SlowBody", "decode_body", "gunzip_limited", "gzip_size", "iter_inflated",
    "parse_body",
]
