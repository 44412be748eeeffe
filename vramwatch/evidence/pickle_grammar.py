"""The fast proof that a pickle is within its budget: what torch writes, recognised in C.

:mod:`~vramwatch.evidence.pickle_budget` walks every opcode in Python, about 15x the C
unpickler's time on a real snapshot. But what ``torch.cuda.memory._snapshot()`` pickles
(protocol 4 or 5: dicts, lists, memoized strings, ints, floats, bools, None, tuples of atoms
such as ``segment_pool_id``) is a regular language, so one compiled pattern recognises it in
sre's C loop, a window at a time; the budgets then follow from the grammar and from byte
counts, with no Python work per opcode. A pickle the grammar does not take (a tuple holding
a reference, ``DUP``, ``BINPUT``, a text opcode, anything hand-made) is *undecided*, never
refused here: :func:`~vramwatch.evidence.safe_pickle.walk` then walks it opcode by opcode.

Why each budget holds for a pickle the grammar takes (:class:`Recognizer`):

* **opcodes**: only data opcodes, and of those only the ones above (no global, call,
  persistent id, extension code, ``DUP``, ``PUT``/``BINPUT``/``LONG_BINPUT``, ``LONG4``,
  text-mode numbers, ``FROZENSET``);
* **memo**: entries are made only by ``MEMOIZE``, one index past the last (sequential, so
  never a table sized by a hostile index); at most the count of its byte (0x94) in the data,
  an upper bound (arguments may hold that byte too). A get of an index never put is the C
  unpickler's error, which allocates nothing;
* **objects** and **references**: at most the count of the bytes that open an object-making
  (or value-pushing, or mark-setting) opcode, again an upper bound; a container's length is at
  most the references;
* **keys and depth**: a tuple is made only of the literal atoms just before it (never of a
  reference), so every hashable container is one level deep and hashing never recurses;
  lists, dicts and sets may nest, which CPython builds and frees without C recursion
  (the unpickler's stack, the trashcan) and compares with its recursion check;
* **atoms**: ``LONG1`` integers of at most 32 bytes (``int_bytes``), strings within the data;
* **time**: the pattern is linear (possessive repetition: no backtracking across tokens, at
  most three atoms of look-ahead inside one), :data:`TOKENS_PER_CALL` tokens per call, each one
  short C call (the GIL is free between them), with the deadline checked between windows.

Cost: about 2x the C unpickler's time on a real snapshot, against 15x for the walk
(``bench/bounds_bench.py``); memory: one window's byte counts and the bytes of a
token cut by a piece's end (at most a tuple of atoms).
"""

from __future__ import annotations

import re
import struct
import time

from vramwatch.evidence.pickle_budget import Budget, BudgetExceeded

#: tokens matched in one C call (about 40 KB, 1-2 ms of a real snapshot: the GIL is free between)
TOKENS_PER_CALL = 16_384
#: a piece's last bytes, scanned again with the next (a token's look-ahead is under 1 KB)
HOLD = 4096
#: bytes counted in one call
WINDOW = 1 << 20
_ANY = rb"[\x00-\xff]"


def _counted(op: bytes, most: int) -> bytes:
    """``op``, a one-byte length of at most ``most`` and that many bytes, as one alternation."""
    sizes = b"|".join(re.escape(bytes([k])) + (_ANY + b"{%d}" % k if k else b"") for k in range(most + 1))
    return re.escape(op) + b"(?:" + sizes + b")"


#: one atom: BININT, BININT1, BININT2, LONG1 (<= 32 bytes), None/True/False, BINFLOAT, SHORT_BINUNICODE
_ATOM = (rb"(?:J" + _ANY + rb"{4}|K" + _ANY + rb"|M" + _ANY + rb"{2}|" + _counted(b"\x8a", 32)
         + rb"|[N\x88\x89]|G" + _ANY + rb"{8}|" + _counted(b"\x8c", 255) + rb")")
#: an atom as a tuple's item: after a FRAME, before a MEMOIZE
_ITEM = rb"(?:\x95" + _ANY + rb"{8})?" + _ATOM + rb"\x94?"
#: an atom alone, or exactly the one, two or three atoms a TUPLE1/2/3 takes
_ATOM_OR_TUPLE = _ITEM + rb"(?:\x85|" + _ITEM + rb"\x86|" + _ITEM + _ITEM + rb"\x87)?"
_TOKEN = (rb"h" + _ANY + rb"|j" + _ANY + rb"{4}"  # BINGET, LONG_BINGET (most of a snapshot)
          rb"|[\x94\]}\x8feua\x90sld)]"  # MEMOIZE, empty containers, APPEND(S), SETITEM(S), ADDITEMS, LIST, DICT
          rb"|\((?:" + _ITEM + rb")*+t"  # TUPLE of the atoms after its MARK
          rb"|\(|\x95" + _ANY + rb"{8}|" + _ATOM_OR_TUPLE)  # MARK, FRAME
_TOKENS = re.compile(rb"(?:" + _TOKEN + rb"){0,%d}+" % TOKENS_PER_CALL)

#: first bytes of the opcodes that make an object, push a reference, or memoize
_MAKES = b"JKM\x8aN\x88\x89G\x8cX]}\x8f)\x85\x86\x87tld"
_REFERS = b"hj("  # a MARK is a slot of the unpickler's marks stack
_MEMOIZES = b"\x94"
_BINUNICODE = 0x58  # X: a string of 256 bytes or more, skipped by its length
_U32 = struct.Struct("<I")


class Recognizer:
    """Feed a pickle's bytes in pieces (:meth:`feed`), then :meth:`finish` and :meth:`proven`:
    True when the grammar took every byte and the bounds fit ``Budget.for_size`` of the whole;
    False when undecided (walk it instead). Raises :class:`BudgetExceeded` only for the deadline.
    A piece's last :data:`HOLD` bytes are scanned again with the next piece, so a token cut by
    a piece's end is read whole."""

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self.size = 0
        self.undecided = False
        self._makes = self._refers = self._memoizes = 0
        self._tail = b""
        self._skip = 0  # bytes of a long string still to come
        self._started = False

    def feed(self, piece: bytes | bytearray | memoryview, *, final: bool = False) -> None:
        if self.undecided:
            return
        piece = memoryview(piece).cast("B")
        self._count(piece)
        if self._skip:
            taken = min(self._skip, len(piece))
            self._skip -= taken
            piece = piece[taken:]
        buf: bytes | memoryview = self._tail + piece.tobytes() if self._tail else piece
        pos = 0
        if not self._started:
            if len(buf) < 2 and not final:
                self._tail = bytes(buf)
                return
            if len(buf) < 2 or buf[0] != 0x80 or buf[1] not in (4, 5):
                self.undecided = True
                return
            self._started, pos = True, 2
        self._tail = bytes(buf[self._scan(buf, pos, final):])
        if len(self._tail) > HOLD + WINDOW:  # a token longer than a window: not what torch writes
            self.undecided = True

    def finish(self) -> None:
        """The end of the pickle: the held-back bytes scanned to the end."""
        self.feed(b"", final=True)

    def proven(self, budget: Budget | None = None) -> bool:
        """Whether the whole pickle is proven within ``budget`` (default: ``Budget.for_size``)."""
        if self.undecided or self._skip or self._tail != b".":
            return False
        b = budget or Budget.for_size(self.size)
        refs = self._makes + self._refers
        return self._memoizes <= b.memo and self._makes <= b.objects and refs <= b.refs and refs <= b.length

    def _count(self, piece: memoryview) -> None:
        self.size += len(piece)
        for start in range(0, len(piece), WINDOW):
            chunk = piece[start:start + WINDOW].tobytes()
            self._makes += len(chunk) - len(chunk.translate(None, _MAKES))
            self._refers += len(chunk) - len(chunk.translate(None, _REFERS))
            self._memoizes += chunk.count(_MEMOIZES)

    def _scan(self, buf: bytes | memoryview, pos: int, final: bool) -> int:
        """Tokens from ``pos``; where the next scan resumes: the end when ``final``, else the
        last token boundary at least :data:`HOLD` bytes before the end (what follows may be
        a token the piece's end cut)."""
        end = len(buf)
        resume = pos
        while pos < end:
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise BudgetExceeded("deadline", "the read took longer than its deadline")
            reached = _TOKENS.match(buf, pos).end()
            if reached == pos:
                if buf[pos] != _BINUNICODE or end - pos < 5:
                    if not final and pos <= end - HOLD:  # not a cut token: one the grammar does not take
                        self.undecided = True
                    break  # STOP, a token cut by the piece's end, or one the grammar does not take
                reached = pos + 5 + _U32.unpack_from(buf, pos + 1)[0]
                if reached > end:
                    self._skip = reached - end
                    return end
            pos = reached
            if final or pos <= end - HOLD:
                resume = pos
        return pos if final else resume


def proves(data: bytes | bytearray | memoryview, budget: Budget) -> bool:
    """Whether ``data`` is proven within ``budget`` by the grammar (False: undecided, walk it)."""
    recognizer = Recognizer(budget.deadline)
    recognizer.feed(data, final=True)
    return recognizer.proven(budget)


__all__ = ["HOLD", "TOKENS_PER_CALL", "WINDOW", "Recognizer", "proves"]
