"""Patterns a reader gives (``skip=`` of a snapshot diff): globs, matched in linear time.

A reader's pattern is never compiled as a regular expression: Python's ``re`` backtracks, and
``(.|.)*Q`` against a long file name runs for minutes in C while holding the GIL (the whole
collector stops answering). A :class:`Glob` has two wildcards, ``*`` (any run of characters,
``/`` included) and ``?`` (one character); every other character is itself (``[``, ``]`` and
control characters are refused so that nobody mistakes it for a regular expression or a
shell class). A glob matches *anywhere* in the text, as if written ``*pattern*``, so a plain
``site-packages/lightning/`` matches every file under that folder.

Cost: the pattern's ``*``-separated pieces are found left to right, each at its leftmost
place (a piece without ``?`` by ``str.find``, in C); leftmost placement is always right for
``*``-only globs, so nothing is ever retried: at most ``len(text) * len(piece)`` character
comparisons per piece, and for ``?``-free pieces the C search's linear time.
"""

from __future__ import annotations

from dataclasses import dataclass

#: longest pattern accepted (characters)
MAX_PATTERN_CHARS = 200
_REFUSED = frozenset("[]")


class PatternError(ValueError):
    """A pattern that is not a glob this module accepts; the message names the pattern."""


def _find(text: str, piece: str, start: int) -> int:
    """Leftmost index >= ``start`` where ``piece`` (``?``: any one character) occurs, else -1."""
    if "?" not in piece:
        return text.find(piece, start)
    fixed = max(piece.split("?"), key=len)  # the longest literal part anchors the search
    offset = piece.index(fixed) if fixed else 0
    at = start
    last = len(text) - len(piece)
    while at <= last:
        if fixed:
            hit = text.find(fixed, at + offset)
            if hit < 0:
                return -1
            at = hit - offset
            if at > last:
                return -1
        if all(p == "?" or p == c for p, c in zip(piece, text[at:at + len(piece)], strict=True)):
            return at
        at += 1
    return -1


@dataclass(frozen=True)
class Glob:
    """One reader pattern (see the module docstring); :func:`compile_glob` checks it."""

    pattern: str
    pieces: tuple[str, ...]

    def search(self, text: str) -> bool:
        """Whether the glob matches anywhere in ``text`` (linear in ``text`` per piece)."""
        at = 0
        for piece in self.pieces:
            hit = _find(text, piece, at)
            if hit < 0:
                return False
            at = hit + len(piece)
        return True


def compile_glob(pattern: str, *, what: str = "pattern") -> Glob:
    """A :class:`Glob`; :class:`PatternError` naming ``what`` for an empty, overlong or refused one."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"{what}: a pattern is 1..{MAX_PATTERN_CHARS} characters")
    bad = next((c for c in pattern if c in _REFUSED or not c.isprintable()), None)
    if bad is not None:
        raise PatternError(f"{what}: {pattern[:60]!r} holds {bad!r}; patterns are globs (* and ?), "
                           "not regular expressions or character classes")
    return Glob(pattern, tuple(p for p in pattern.split("*") if p))


__all__ = ["MAX_PATTERN_CHARS", "Glob", "PatternError", "compile_glob"]
