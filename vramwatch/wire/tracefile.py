"""Trace files: samples one per line (JSON Lines), optionally gzipped; read by ``vramwatch
analyze``/``import``, written by the hook's file mode and the spool. Re-exported by ``wire``.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from vramwatch.bounded import LONG_LINE, Lines, open_input, size_text
from vramwatch.wire.codec import encode_lines
from vramwatch.wire.fields import Sample, WireError
from vramwatch.wire.validate import decode_line, validate

#: the longest line a trace file may hold (a sample is well under 1 KiB; ingest takes 64 KiB)
MAX_LINE_BYTES = 1 << 20
LINE_FLAG = "--max-line-bytes"


def long_line(where: str, max_line_bytes: int) -> WireError:
    """The error of a line longer than ``max_line_bytes`` (never read whole: :class:`bounded.Lines`)."""
    return WireError(where, f"line longer than {size_text(max_line_bytes)} ({LINE_FLAG})")


def iter_file(path: str | os.PathLike[str], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, Any]]:
    """Stream (line number, decoded object) from a .jsonl or .jsonl.gz trace.

    Decoding errors raise :class:`WireError` with the line number; validation is the
    caller's choice (``analyze`` and ``import`` both validate). Memory: one 1 MiB block and
    one line (at most ``max_line_bytes``; a longer one is a WireError naming its line).
    """
    with open_input(path) as fh:
        for lineno, line in enumerate(Lines(fh, max_line_bytes), 1):
            if line is LONG_LINE:
                raise long_line(f"{path}:{lineno}", max_line_bytes)
            if not line.strip():
                continue
            try:
                yield lineno, orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise WireError(f"{path}:{lineno}", f"invalid JSON: {exc}") from None


def iter_samples(path: str | os.PathLike[str], on_bad: Callable[[WireError], None] | None = None,
                 max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Sample]:
    """Validated samples from a trace file; the first bad line raises WireError naming it
    (file:line: field), or with ``on_bad`` is handed to it and skipped (``import --skip-invalid``).

    A line is decoded and validated in one C pass (:func:`~vramwatch.wire.validate.decode_line`);
    a line it does not accept as written takes ``orjson.loads`` + ``validate``, which rewrite
    it or name the bad field. A line longer than ``max_line_bytes`` is a bad line (never held
    whole).
    """
    decode = decode_line
    with open_input(path) as fh:
        for lineno, line in enumerate(Lines(fh, max_line_bytes), 1):
            if line is LONG_LINE:
                if on_bad is None:
                    raise long_line(f"{path}:{lineno}", max_line_bytes)
                on_bad(long_line(f"{path}:{lineno}", max_line_bytes))
                continue
            sample = decode(line)
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
