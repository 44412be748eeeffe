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
* before the C unpickler builds anything, the bytes are proven within a budget (data opcodes
  only, memo, references, DUPs, objects, container lengths and depth, flat-atom keys, integer
  sizes, a deadline): by the grammar of what torch writes, recognised at C speed
  (:mod:`vramwatch.evidence.pickle_grammar`), or, for anything else, by a walk opcode by
  opcode (:mod:`vramwatch.evidence.pickle_budget`), so the extension opcodes, a memo index
  of 2^26 or a tuple a million deep as a key are refused, naming the budget, before they
  cost anything.

Bounds: at most ``max_bytes`` of pickle (after gzip inflation, read incrementally into one
buffer, so a gzip bomb stops at the bound and the input is never held twice); the walk's
budget (proportional to the size, :meth:`~vramwatch.evidence.pickle_budget.Budget.for_size`)
and its deadline (:data:`DEADLINE_S`); :func:`check_shape` afterwards refuses a top level that
is not a snapshot. Cost: the proof (about 2x the C unpickler for torch's output, the walk
about 15x for anything else; once per stored file and process: files proven are remembered,
and the collector proves an upload while it arrives) plus the C unpickler; memory: the inflated bytes once plus what the
snapshot's objects take (about 6x the pickle's size for torch's output).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import pickle
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from vramwatch.bounded import Inflater, LimitExceeded
from vramwatch.evidence import pickle_budget, pickle_grammar

#: Largest pickle (inflated) accepted: a 20,000-entry history with Python stacks is tens of MB.
MAX_PICKLE_BYTES = 512 * 2**20
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20

#: Seconds one snapshot's budget walk may take (a real 20,000-block snapshot: well under one).
DEADLINE_S = 20.0
#: Files walked within their budget, remembered by (device, inode, size, mtime): a stored
#: snapshot never changes, so a second read of it (another diff, the suspects, the post-mortem)
#: costs only the C unpickler.
_VERIFIED: OrderedDict[tuple[int, int, int, int], None] = OrderedDict()
_VERIFIED_MAX = 4096
_verified_lock = threading.Lock()


class UnsafePickle(ValueError):
    """The bytes are not a snapshot this module will load; the message says why, in one line."""


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(f"refused: the pickle names {module}.{name} (a snapshot names no class or "
                           "function; loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("refused: the pickle holds a persistent id (not a snapshot)")


def loads(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_PICKLE_BYTES,
          deadline_s: float | None = DEADLINE_S, verified: bool = False) -> Any:
    """Unpickle builtin data only, within a budget; :class:`UnsafePickle` for anything else
    (never executes code). The bytes are first walked against
    :meth:`~vramwatch.evidence.pickle_budget.Budget.for_size` (the refusal names the budget),
    then built by the C unpickler, read in place (no copy of the input). ``verified``: these
    exact bytes passed the walk before (:func:`read_snapshot` remembers files it walked)."""
    if len(data) > max_bytes:
        raise UnsafePickle(f"larger than {max_bytes} bytes")
    if not verified:
        walk(data, deadline_s)
    try:
        with paused_gc():
            return _DataOnlyUnpickler(_View(data)).load()
    except UnsafePickle:
        raise
    except RecursionError:
        raise UnsafePickle("not a snapshot: nested too deeply") from None
    except Exception as exc:  # truncated stream, bad opcode
        raise UnsafePickle(f"not a pickle ({type(exc).__name__}: {str(exc)[:200]})") from None


def walk(data: bytes | bytearray | memoryview, deadline_s: float | None = DEADLINE_S) -> None:
    """``data`` proven within :meth:`~vramwatch.evidence.pickle_budget.Budget.for_size`:
    by the grammar of what torch writes (:mod:`~vramwatch.evidence.pickle_grammar`, at C
    speed) or, when it is undecided, by the opcode walk (:mod:`~vramwatch.evidence.pickle_budget`);
    :class:`UnsafePickle` naming the budget passed."""
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    budget = pickle_budget.Budget.for_size(len(data), deadline=deadline)
    try:
        if not pickle_grammar.proves(data, budget):
            pickle_budget.walk(data, budget)
    except pickle_budget.BudgetExceeded as exc:
        raise UnsafePickle(str(exc)) from None
    except (IndexError, struct.error):
        raise UnsafePickle("not a pickle (truncated, or a memo get of an index never put)") from None


class _View(io.RawIOBase):
    """The bytes as the file the C unpickler reads (``peek`` lets it prefetch), never copied whole."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._mv, self._pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos:end])
        self._pos = end
        return out

    def peek(self, n: int = 0) -> bytes:
        return bytes(self._mv[self._pos:self._pos + max(n, 1)])

    def readinto(self, buffer: Any) -> int:
        chunk = self.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def readline(self, size: int | None = -1) -> bytes:
        end = bytes(self._mv[self._pos:self._pos + _CHUNK]).find(b"\n")
        return self.read(_CHUNK if end < 0 else end + 1)


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


def inflate(raw: bytes | BinaryIO, *, max_bytes: int = MAX_PICKLE_BYTES) -> bytearray:
    """``raw`` as plain pickle bytes: gunzipped when it starts with the gzip magic (the one
    inflater, :class:`~vramwatch.bounded.Inflater`), at most ``max_bytes`` after inflation (a
    gzip bomb stops at the bound, having inflated at most one more step). The output is
    appended in place into one buffer (large buffers grow by remapping): never two copies."""
    stream = io.BytesIO(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    head = stream.read(2)
    zipped = head == _GZIP_MAGIC
    data = bytearray()
    inflater = Inflater(max_bytes, "snapshot", "max_bytes", step=_CHUNK) if zipped else None
    chunk = head
    try:
        while chunk:
            for piece in inflater.feed(chunk) if inflater is not None else (chunk,):
                data += piece
                if len(data) > max_bytes:
                    raise LimitExceeded("snapshot", "max_bytes", "")
            chunk = stream.read(_CHUNK)
        if inflater is not None:
            inflater.finish()
    except LimitExceeded:
        raise UnsafePickle(f"larger than {max_bytes} bytes{' after gzip inflation' if zipped else ''}") from None
    except (OSError, EOFError) as exc:
        if not zipped:
            raise  # the file could not be read: the caller's OSError
        raise UnsafePickle(f"not gzip data ({type(exc).__name__}: {exc})") from None
    return data


def check_shape(obj: Any) -> dict[str, Any]:
    """The loaded object when its top level is a snapshot (a dict with a ``segments`` list)."""
    if not isinstance(obj, dict):
        raise UnsafePickle(f"not a snapshot: the pickle holds a {type(obj).__name__}, not a dict")
    if not isinstance(obj.get("segments"), list):
        raise UnsafePickle("not a snapshot: no 'segments' list (torch.cuda.memory._snapshot() output has one)")
    return obj


def load_snapshot(raw: bytes | BinaryIO, *, max_bytes: int = MAX_PICKLE_BYTES, verified: bool = False
                  ) -> dict[str, Any]:
    """A snapshot from plain or gzip pickle bytes (or a binary stream), safely and within bounds."""
    return check_shape(loads(inflate(raw, max_bytes=max_bytes), max_bytes=max_bytes, verified=verified))


def _file_key(fh: BinaryIO) -> tuple[int, int, int, int]:
    st = os.fstat(fh.fileno())
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_snapshot(path: str | Path, *, max_bytes: int = MAX_PICKLE_BYTES) -> dict[str, Any]:
    """:func:`load_snapshot` of a file (plain or gzip); OSError when it cannot be read. A file
    already walked within its budget by this process (unchanged since) is not walked again."""
    with open(path, "rb") as fh:
        key = _file_key(fh)
        with _verified_lock:
            seen = key in _VERIFIED
        snapshot = load_snapshot(fh, max_bytes=max_bytes, verified=seen)
    if not seen:
        remember(key)
    return snapshot


def remember_file(path: str | Path) -> None:
    """A stored file proven within its budget while it arrived (the collector's upload reads
    its inflated pieces through :class:`~vramwatch.evidence.pickle_grammar.Recognizer`): its
    reads skip the proof."""
    with open(path, "rb") as fh:
        remember(_file_key(fh))


def proven_before(path: str | Path) -> bool:
    """Whether this process proved ``path`` within its budget since it last changed."""
    with open(path, "rb") as fh:
        key = _file_key(fh)
    with _verified_lock:
        return key in _VERIFIED


def remember(key: tuple[int, int, int, int]) -> None:
    with _verified_lock:
        _VERIFIED[key] = None
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


__all__ = ["DEADLINE_S", "MAX_PICKLE_BYTES", "UnsafePickle", "check_shape", "inflate", "load_snapshot", "loads",
           "paused_gc", "proven_before", "read_snapshot", "remember_file"]
