"""A pickle read against a budget before anything is built: what a snapshot may cost.

The C unpickler builds whatever the bytes describe, and a few bytes can describe a lot: a
memo index of 2^26 (9 bytes) allocates a 1 GB memo table, a run of ``DUP``s 8 bytes of stack
per byte, a tuple nested a million deep as a dict key overflows the C stack while it is
hashed, and memo-shared containers turn a 768-byte gzip into millions of blocks. So every
pickle is first *walked* here, opcode by opcode, building nothing but a shape per stack
entry, and refused (:class:`~vramwatch.evidence.safe_pickle.UnsafePickle` naming the budget)
as soon as any bound is passed; only a walk that ends within the budget is handed to the C
unpickler, which then builds exactly what was walked (the same bytes).

What is bounded, checked as each opcode is read (:class:`Budget`):

* **opcodes**: only data opcodes (no global, call, persistent id or extension code);
* **memo**: an index (``PUT``/``BINPUT``/``LONG_BINPUT``) at most ``memo``, and at most
  ``memo`` entries (``MEMOIZE``);
* **references**: every value pushed (including ``GET`` and ``DUP``) and every ``MARK`` counts;
  at most ``refs`` in all (``dups`` of them by ``DUP``), so the containers' slots and the marks
  stack are bounded;
* **objects**: values created (atoms and containers) at most ``objects``;
* **containers**: at most ``length`` items each, nested at most ``depth`` deep; a container
  already placed in another cannot grow (what ``pickle.dumps`` writes never does; this keeps
  the depth exact and refuses cycles);
* **keys**: a dict key or set element is a flat atom (str, bytes, int, float, bool, None),
  never a tuple (hashing never recurses);
* **atoms**: an integer of at most ``int_bytes`` bytes (``int_digits`` digits in text form),
  checked before it is parsed; a string within the bytes left;
* **time**: a ``deadline`` (monotonic seconds), checked every 65,536 opcodes.

The budgets proportional to the input (:meth:`Budget.for_size`) keep what the unpickler then
builds within a fixed multiple of the input's size; the absolute ones (depth, length,
integer size) are far above what ``torch.cuda.memory._snapshot()`` writes.

Cost: one pass in Python over the opcodes; runs of one-byte ``BINGET`` (most of a snapshot's
opcodes: its stacks are lists of shared frame dicts) are consumed by one C-level match each.
About as long as the C unpickler itself on a real snapshot (``docs/benchmarks.md``). Memory:
one small record per container created, one dict entry per memo entry.
"""

from __future__ import annotations

import pickletools
import re
import struct
import time
from dataclasses import dataclass

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_BINGET_RUN = re.compile(rb"(?:h[\x00-\xff])+")
_CHECK_EVERY = 1 << 16


class BudgetExceeded(ValueError):
    """The pickle needs more than its budget (``limit`` names which)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"refused: {message} (snapshot budget: {limit})")
        self.limit = limit


@dataclass(frozen=True)
class Budget:
    """What one pickle may build; :meth:`for_size` derives the proportional parts."""

    refs: int = 50_000_000
    #: ``pickle.dumps`` never writes DUP: a few for hand-made pickles
    dups: int = 1024
    objects: int = 20_000_000
    memo: int = 10_000_000
    length: int = 4_000_000
    depth: int = 64
    int_bytes: int = 32
    int_digits: int = 80
    #: a monotonic deadline (``time.monotonic()`` seconds), None: none
    deadline: float | None = None

    @classmethod
    def for_size(cls, size: int, *, deadline: float | None = None) -> Budget:
        """The budget for a pickle of ``size`` bytes: references and objects at most one per two
        bytes and memo entries one per four (a real snapshot uses about a third of each), with a
        floor for small files; a container's items at most :attr:`length` or the references'
        bound, whichever is larger; DUPs at most :attr:`dups` whatever the size."""
        floor = 1 << 16
        return cls(refs=max(floor, size // 2), objects=max(floor, size // 2),
                   memo=max(floor, size // 4), length=max(cls.length, size // 2), deadline=deadline)


# A shape is one int: 0 a flat atom; (depth << 1) a tuple or frozenset that deep (immutable:
# its depth is exact); (depth << 1) | 1 a list, dict, set or bytearray (mutable). Keys must be
# 0, so ``any(keys)`` refuses a non-atom key in C; ``max(items) >> 1`` is the items' depth.
_MUTABLE_NEW = (1 << 1) | 1


def _refuse(limit: str, message: str) -> BudgetExceeded:
    return BudgetExceeded(limit, message)


def _line(data: bytes | memoryview, pos: int, limit: int, what: str) -> int:
    """End (exclusive, at the newline) of a text argument of at most ``limit`` bytes."""
    end = bytes(data[pos:pos + limit + 1]).find(b"\n")
    if end < 0:
        raise _refuse("int_digits" if what == "integer" else "length", f"a text {what} longer than {limit} bytes")
    return pos + end


def _end_of(data: bytes | memoryview, pos: int, n: int) -> int:
    """Position after ``n`` bytes from ``pos``, refused past the end of the pickle."""
    if n < 0 or pos + n > len(data):
        raise _refuse("bytes", f"not a pickle: a value of {n:,} bytes runs past its end")
    return pos + n


class _Walk:
    """The walk's state: the stack of shapes, marks, memo (shapes by index) and counters."""

    __slots__ = ("b", "dups", "marks", "memo", "objects", "refs", "stack", "texts")

    def __init__(self, budget: Budget) -> None:
        self.b = budget
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: list[int | None] = []
        self.refs = self.dups = self.objects = 0
        self.texts: tuple[int, ...] = ()  # where the latest two strings start (a global's name)

    def items(self) -> list[int]:
        """The values above the latest mark, popped with it."""
        if not self.marks:
            raise _refuse("opcodes", "an opcode needs a mark the pickle never set")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        if len(items) > self.b.length:
            raise _refuse("length", f"a container of more than {self.b.length:,} items")
        return items

    def fill(self, items: list[int], keyed: bool) -> None:
        """``items`` added to the mutable container under them (alternate keys when ``keyed``)."""
        stack = self.stack
        if not stack or not stack[-1] & 1:
            raise _refuse("opcodes", "items added to a value that is not a list, dict or set")
        if keyed and any(items[::2]):
            raise _refuse("keys", "a dict key or set element is not a flat atom (str, bytes, number, None)")
        if items:
            shape = ((max(items) >> 1) + 1) << 1 | 1
            if shape > stack[-1]:
                if shape >> 1 > self.b.depth:
                    raise _refuse("depth", f"containers nested more than {self.b.depth} deep")
                stack[-1] = shape

    def frozen(self, items: list[int], flat: bool) -> None:
        """A tuple (or, ``flat``, a frozenset: atoms only) of ``items`` pushed."""
        if flat and any(items):
            raise _refuse("keys", "a set element is not a flat atom (str, bytes, number, None)")
        depth = (max(items) >> 1) + 1 if items else 1
        if depth > self.b.depth:
            raise _refuse("depth", f"containers nested more than {self.b.depth} deep")
        self.objects += 1
        self.refs += 1
        self.stack.append(depth << 1)

    def put(self, index: int) -> None:
        memo = self.memo
        if index >= self.b.memo:
            raise _refuse("memo", f"a memo index of {index:,} (at most {self.b.memo:,})")
        if not self.stack:
            raise _refuse("opcodes", "a memo put with nothing on the stack")
        if index >= len(memo):
            memo.extend([None] * (index + 1 - len(memo)))
        memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        shape = self.memo[index] if index < len(self.memo) else None
        if shape is None:
            raise _refuse("memo", f"a memo get of index {index:,}, never put")
        self.stack.append(shape)
        self.refs += 1

    def check(self) -> None:
        b = self.b
        if self.refs > b.refs:
            raise _refuse("refs", f"more than {b.refs:,} values pushed")
        if self.objects > b.objects:
            raise _refuse("objects", f"more than {b.objects:,} objects")
        if self.dups > b.dups:
            raise _refuse("dups", f"more than {b.dups:,} DUP opcodes")
        if len(self.memo) > b.memo:
            raise _refuse("memo", f"more than {b.memo:,} memo entries")
        if b.deadline is not None and time.monotonic() > b.deadline:
            raise _refuse("deadline", "the read took longer than its deadline")


#: opcodes that push one new atom, with their fixed argument size
_ATOMS = {ord("N"): 0, 0x88: 0, 0x89: 0, ord("J"): 4, ord("K"): 1, ord("M"): 2, ord("G"): 8}
#: string opcodes and the width of their length field
_STRINGS = {0x8C: 1, ord("U"): 1, ord("C"): 1, ord("X"): 4, ord("T"): 4, ord("B"): 4, 0x8D: 8, 0x8E: 8, 0x96: 8}
_LENGTH = {1: None, 4: _U32, 8: _U64}
_TEXT_ATOMS = {ord("I"): "integer", ord("L"): "integer", ord("F"): "float", ord("S"): "string", ord("V"): "string"}


def walk(data: bytes | memoryview, budget: Budget) -> None:
    """Walk the pickle in ``data`` against ``budget``; :class:`BudgetExceeded` at the first bound
    passed or opcode refused. Returns when ``STOP`` is reached within the budget."""
    w = _Walk(budget)
    stack, marks, memo = w.stack, w.marks, w.memo
    n, pos, ops = len(data), 0, 0
    run = _BINGET_RUN.match
    look = memo.__getitem__
    while pos < n:
        op = data[pos]
        ops += 1
        if not ops & (_CHECK_EVERY - 1):
            w.check()
        if op == 0x68:  # BINGET: a run of them at once
            found = run(data, pos)
            if found is None:
                raise _refuse("bytes", "not a pickle: it ends inside an opcode")
            end = found.end()
            try:
                got = list(map(look, data[pos + 1:end:2]))
            except IndexError:
                got = [None]
            if None in got:
                raise _refuse("memo", "a memo get of an index never put")
            stack += got
            w.refs += len(got)
            pos = end
            continue
        pos += 1
        if op == 0x94:  # MEMOIZE
            if not stack:
                raise _refuse("opcodes", "a memo put with nothing on the stack")
            memo.append(stack[-1])
        elif op == 0x28:  # MARK: a slot of the marks stack, counted as a reference
            marks.append(len(stack))
            w.refs += 1
        elif op in _ATOMS:
            pos += _ATOMS[op]
            w.objects += 1
            w.refs += 1
            stack.append(0)
        elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            w.objects += 1
            w.refs += 1
            stack.append(_MUTABLE_NEW)
        elif op == 0x75 or op == 0x65 or op == 0x90:  # SETITEMS, APPENDS, ADDITEMS
            items = w.items()
            if op == 0x75 and len(items) & 1:
                raise _refuse("opcodes", "SETITEMS with an odd number of items")
            w.fill(items, op != 0x65)
        elif op == 0x6A:  # LONG_BINGET
            w.get(_U32.unpack_from(data, pos)[0])
            pos += 4
        elif op == 0x8A or op == 0x8B:  # LONG1 / LONG4: the size bounded before the int is made
            size = data[pos] if op == 0x8A else _I32.unpack_from(data, pos)[0]
            if size < 0 or size > budget.int_bytes:
                raise _refuse("int_bytes", f"an integer of {size:,} bytes (at most {budget.int_bytes})")
            pos = _end_of(data, pos + (1 if op == 0x8A else 4), size)
            w.objects += 1
            w.refs += 1
            stack.append(0)
        elif op in _STRINGS:
            fmt = _LENGTH[_STRINGS[op]]
            size = data[pos] if fmt is None else fmt.unpack_from(data, pos)[0]
            w.texts = (w.texts[-1], pos - 1) if w.texts else (pos - 1,)
            pos = _end_of(data, pos + _STRINGS[op], size)
            w.objects += 1
            w.refs += 1
            stack.append(_MUTABLE_NEW if op == 0x96 else 0)  # a bytearray is no key
        else:
            pos = _other(w, data, pos, op)
            if pos < 0:
                w.check()
                if len(stack) != 1 or marks:
                    raise _refuse("opcodes", "STOP with other than one value or with an open mark")
                return
    raise _refuse("bytes", "not a pickle: it ends without STOP")


#: GLOBAL, STACK_GLOBAL, INST: opcodes that name a callable (refused with its name)
_GLOBALS = {ord("c"), 0x93, ord("i")}


def _global_name(w: _Walk, data: bytes | memoryview, pos: int, op: int) -> str:
    """``module.name`` of the callable an opcode names, as far as the bytes tell (for the message)."""
    if op in (ord("c"), ord("i")):
        text = bytes(data[pos:pos + 400]).split(b"\n")
        return ".".join(t.decode("utf-8", "replace") for t in text[:2])[:200]
    if op == 0x93 and len(w.texts) == 2:
        return ".".join(_text_at(data, at) for at in w.texts)[:200]
    return "a global"


def _text_at(data: bytes | memoryview, at: int) -> str:
    width = _STRINGS[data[at]]
    fmt = _LENGTH[width]
    size = data[at + 1] if fmt is None else fmt.unpack_from(data, at + 1)[0]
    return bytes(data[at + 1 + width:at + 1 + width + min(size, 200)]).decode("utf-8", "replace")


def _memo_op(w: _Walk, data: bytes | memoryview, pos: int, op: int) -> int:
    """BINPUT, LONG_BINPUT, PUT and GET (text index): the position after the argument."""
    if op == 0x71:  # BINPUT
        w.put(data[pos])
        return pos + 1
    if op == 0x72:  # LONG_BINPUT
        w.put(_U32.unpack_from(data, pos)[0])
        return pos + 4
    end = _line(data, pos, 20, "integer")
    try:
        index = int(bytes(data[pos:end]))
    except ValueError:
        raise _refuse("opcodes", "a memo index that is not a number") from None
    w.put(max(index, 0)) if op == 0x70 else w.get(max(index, 0))
    return end + 1


def _other(w: _Walk, data: bytes | memoryview, pos: int, op: int) -> int:
    """The rarer opcodes; the position after the argument, -1 at STOP."""
    stack = w.stack
    if op == 0x2E:  # STOP
        return -1
    if op == 0x95:  # FRAME
        return pos + 8
    if op == 0x80:  # PROTO
        return pos + 1
    if op == 0x61 or op == 0x73:  # APPEND, SETITEM
        k = 1 if op == 0x61 else 2
        if len(stack) <= k:
            raise _refuse("opcodes", "APPEND/SETITEM with too little on the stack")
        items = stack[-k:]
        del stack[-k:]
        w.fill(items, op == 0x73)
    elif op in (0x71, 0x72, 0x70, 0x67):
        return _memo_op(w, data, pos, op)
    elif op == 0x32:  # DUP
        if not stack:
            raise _refuse("opcodes", "DUP with nothing on the stack")
        stack.append(stack[-1])
        w.dups += 1
        w.refs += 1
        if w.dups > w.b.dups:
            raise _refuse("dups", f"more than {w.b.dups:,} DUP opcodes")
    elif op == 0x30:  # POP
        if w.marks and w.marks[-1] == len(stack):
            w.marks.pop()
        elif stack:
            stack.pop()
        else:
            raise _refuse("opcodes", "POP with nothing on the stack")
    elif op == 0x31:  # POP_MARK
        w.items()
    elif op in _TEXT_ATOMS:
        what = _TEXT_ATOMS[op]
        end = _line(data, pos, w.b.int_digits if what == "integer" else len(data), what)
        w.objects += 1
        w.refs += 1
        stack.append(0)
        return end + 1
    elif op == 0x29:  # EMPTY_TUPLE
        w.frozen([], False)
    elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
        k = op - 0x84
        if len(stack) < k:
            raise _refuse("opcodes", "a tuple of more items than the stack holds")
        items = stack[-k:]
        del stack[-k:]
        w.frozen(items, False)
    elif op == 0x74 or op == 0x91:  # TUPLE, FROZENSET
        w.frozen(w.items(), op == 0x91)
    elif op == 0x6C or op == 0x64:  # LIST, DICT from the marked items
        items = w.items()
        if op == 0x64 and len(items) & 1:
            raise _refuse("opcodes", "DICT with an odd number of items")
        w.objects += 1
        w.refs += 1
        stack.append(_MUTABLE_NEW)
        w.fill(items, op == 0x64)
    else:
        if op in _GLOBALS:
            raise _refuse("opcodes", f"the pickle names {_global_name(w, data, pos, op)} (a snapshot names no "
                          "class or function; loading it could run code)")
        known = pickletools.code2op.get(chr(op))
        name = known.name if known is not None else f"0x{op:02x}"
        raise _refuse("opcodes", f"opcode {name} at byte {pos - 1} (a snapshot needs only data)")
    return pos


__all__ = ["Budget", "BudgetExceeded", "walk"]
