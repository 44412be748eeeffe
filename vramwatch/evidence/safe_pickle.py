"""Load an allocator snapshot pickle without running code: a refusal, never an execution.

``pickle.load`` executes whatever a pickle names (``os.system`` through ``__reduce__``, any
importable callable), and snapshots reach the collector over HTTP from any rank and the CLI
from any file. torch's ``_snapshot()`` output is built only from builtin containers and
scalars (dict, list, tuple, str, int, float, bool, None), none of which needs a global to
unpickle. So the unpickler here refuses *every* global:

* ``find_class`` raises :class:`UnsafePickle` for any ``GLOBAL`` / ``STACK_GLOBAL`` (and for
  the extension-registry opcodes ``EXT1/2/4``, which resolve through ``find_class``);
  without a callable on the stack, ``REDUCE``, ``NEWOBJ``, ``BUILD`` and ``INST``/``OBJ``
  cannot call anything;
* ``persistent_load`` raises (no ``PERSID``/``BINPERSID`` object ids);
* out-of-band buffers (protocol 5) are refused by the C unpickler without a ``buffers`` list;
* a process-wide extension registry (``copyreg.add_extension``) caches resolved objects
  where ``find_class`` no longer sees them: when one is present the bytes are first walked
  opcode by opcode (:func:`pickletools.genops`, pure Python, slower) and any opcode outside
  :data:`_DATA_OPCODES` is refused before anything is built.

Bounds: at most ``max_bytes`` of pickle (after gzip inflation, read incrementally, so a gzip
bomb stops at the bound); :func:`check_shape` afterwards refuses a top level that is not a
snapshot. Cost: the C unpickler's speed (about 0.1-0.3 s per 100 MB of pickle); memory is
what the snapshot's objects take (a few times the pickle's size).
"""

from __future__ import annotations

import contextlib
import copyreg
import gc
import gzip
import io
import pickle
import pickletools
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

#: Largest pickle (inflated) accepted: a 20,000-entry history with Python stacks is tens of MB.
MAX_PICKLE_BYTES = 512 * 2**20
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20

#: Opcodes that build only builtin data (no global, no call, no persistent id, no extension).
_DATA_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
})


class UnsafePickle(ValueError):
    """The bytes are not a snapshot this module will load; the message says why, in one line."""


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(f"refused: the pickle names {module}.{name} (a snapshot names no class or "
                           "function; loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("refused: the pickle holds a persistent id (not a snapshot)")


def _scan_opcodes(data: bytes) -> None:
    """Refuse any opcode outside :data:`_DATA_OPCODES` before anything is built."""
    try:
        for opcode, _arg, pos in pickletools.genops(data):
            if opcode.name not in _DATA_OPCODES:
                raise UnsafePickle(f"refused: opcode {opcode.name} at byte {pos} (a snapshot needs only data)")
    except UnsafePickle:
        raise
    except Exception as exc:  # truncated or garbage bytes
        raise UnsafePickle(f"not a pickle ({type(exc).__name__}: {exc})") from None


def loads(data: bytes, *, max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """Unpickle builtin data only; :class:`UnsafePickle` for anything else (never executes code)."""
    if len(data) > max_bytes:
        raise UnsafePickle(f"larger than {max_bytes} bytes")
    if copyreg._inverted_registry:  # extension codes in use in this process: walk the opcodes first
        _scan_opcodes(data)
    try:
        with paused_gc():
            return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except UnsafePickle:
        raise
    except RecursionError:
        raise UnsafePickle("not a snapshot: nested too deeply") from None
    except Exception as exc:  # truncated stream, bad opcode, an EXT code nobody registered
        raise UnsafePickle(f"not a pickle ({type(exc).__name__}: {str(exc)[:200]})") from None


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused for the block (restored as it was, so nesting and a
    caller that keeps it off are safe). A snapshot is millions of containers and no cycles:
    with collection on, each generation's pass walks all of them while they are built and used
    (about twice the load and diff time, ``bench/snapshot_diff_bench.py``). Wrap a load and
    everything done with the snapshot until it is dropped."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def inflate(raw: bytes | BinaryIO, *, max_bytes: int = MAX_PICKLE_BYTES) -> bytes:
    """``raw`` as plain pickle bytes: gunzipped when it starts with the gzip magic, at most
    ``max_bytes`` after inflation (read in 1 MiB pieces: a gzip bomb stops at the bound)."""
    stream = io.BytesIO(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    head = stream.read(2)
    zipped = head == _GZIP_MAGIC
    try:
        source: BinaryIO = gzip.GzipFile(fileobj=_Prefixed(head, stream)) if zipped else _Prefixed(head, stream)
        data = _read_bounded(source, max_bytes)
    except (OSError, EOFError, zlib.error) as exc:
        raise UnsafePickle(f"not gzip data ({type(exc).__name__}: {exc})") from None
    if data is None:
        raise UnsafePickle(f"larger than {max_bytes} bytes{' after gzip inflation' if zipped else ''}")
    return data


def _read_bounded(source: BinaryIO, max_bytes: int) -> bytes | None:
    parts, size = [], 0
    while chunk := source.read(min(_CHUNK, max_bytes + 1 - size)):
        parts.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            return None
    return b"".join(parts)


class _Prefixed(io.RawIOBase):
    """A stream whose first bytes were already read (the magic sniffed off it)."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n], self._head = self._head[:n], self._head[n:]
            return n
        chunk = self._rest.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)


def check_shape(obj: Any) -> dict[str, Any]:
    """The loaded object when its top level is a snapshot (a dict with a ``segments`` list)."""
    if not isinstance(obj, dict):
        raise UnsafePickle(f"not a snapshot: the pickle holds a {type(obj).__name__}, not a dict")
    if not isinstance(obj.get("segments"), list):
        raise UnsafePickle("not a snapshot: no 'segments' list (torch.cuda.memory._snapshot() output has one)")
    return obj


def load_snapshot(raw: bytes | BinaryIO, *, max_bytes: int = MAX_PICKLE_BYTES) -> dict[str, Any]:
    """A snapshot from plain or gzip pickle bytes (or a binary stream), safely and within bounds."""
    return check_shape(loads(inflate(raw, max_bytes=max_bytes), max_bytes=max_bytes))


def read_snapshot(path: str | Path, *, max_bytes: int = MAX_PICKLE_BYTES) -> dict[str, Any]:
    """:func:`load_snapshot` of a file (plain or gzip); OSError when it cannot be read."""
    with open(path, "rb") as fh:
        return load_snapshot(fh, max_bytes=max_bytes)


__all__ = ["MAX_PICKLE_BYTES", "UnsafePickle", "check_shape", "inflate", "load_snapshot", "loads", "paused_gc",
           "read_snapshot"]
