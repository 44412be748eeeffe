"""Trace files: samples one per line (JSON Lines), optionally gzipped; read by ``vramwatch
analyze``/``import``, written by the hook's file mode and the spool. Re-exported by ``wire``.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from vramwatch.wire.codec import encode_lines
from vramwatch.wire.decode import decode_line_fast
from vramwatch.wire.fields import Sample, WireError
from vramwatch.wire.validate import validate


def _open_read(path: str | os.PathLike[str]) -> IO[bytes]:
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller's with-block
    if raw.peek(2)[:2] == b"\x1f\x8b":  # sniff, so a misnamed gzip still reads
        return _Gunzip(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


class _Gunzip(gzip.GzipFile):
    """A GzipFile whose corrupt deflate data raises ``BadGzipFile`` (an OSError, which every
    reader of trace files reports as an unreadable file) instead of ``zlib.error`` (which
    none expected: a traceback from import, advise, compare and gate)."""

    def read(self, size: int = -1) -> bytes:
        try:
            return super().read(size)
        except zlib.error as exc:
            raise gzip.BadGzipFile(f"corrupt gzip data: {exc}") from None

    def readline(self, size: int | None = -1) -> bytes:
        try:
            return super().readline(size)
        except zlib.error as exc:
            raise gzip.BadGzipFile(f"corrupt gzip data: {exc}") from None

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line


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


def iter_samples(path: str | os.PathLike[str], on_bad: Callable[[WireError], None] | None = None
                 ) -> Iterator[Sample]:
    """Validated samples from a trace file; the first bad line raises WireError naming it
    (file:line: field), or with ``on_bad`` is handed to it and skipped (``import --skip-invalid``).

    A canonical line is decoded and validated in one pass (:mod:`vramwatch.wire.decode`, when
    msgspec is installed); any other line takes ``orjson.loads`` + ``validate``, which
    normalise it or name the bad field: the same samples and errors either way.
    """
    fast = decode_line_fast
    with _open_read(path) as fh:
        for lineno, line in enumerate(fh, 1):
            sample = None if fast is None else fast(line)
            if sample is None:
                if not line.strip():
                    continue
                try:
                    sample = validate(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    error = WireError(f"{path}:{lineno}", f"invalid JSON: {exc}")
                except WireError as exc:
                    error = WireError(f"{path}:{lineno}: {exc.field}", exc.message)
                if sample is None:
                    if on_bad is None:
                        raise error
                    on_bad(error)
                    continue
            yield sample


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
