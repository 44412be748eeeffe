"""The hook's sample numbering and the numbers a step passes: pure bookkeeping on the training
thread, O(1) per call, no I/O.

``seq`` joins ``(run, host, rank, incarnation, step, phase)`` in the idempotency key: a train
sample holds its pass's base, a second checkpoint at one step the next number, the end markers
the next after that. A loop that goes back in steps within one process (a notebook cell run
again) starts a new pass: the same process goes on, and its samples take the next ``seq`` range
so none is a duplicate of the earlier pass's.
"""

from __future__ import annotations

import math
import numbers as _numbers
import re
from typing import Any

from vramwatch.wire import MAX_INT

#: ``seq`` range of one pass of the training loop (phases and markers at one step stay far below it)
LAP_SEQ = 1 << 20
_EXTRA_KEY_RE = re.compile(r"[^\x00-\x1f\x7f]{1,64}\Z")
#: step() keywords that are wire fields (the rest go to extra): the batch's tokens, its longest sequence
STEP_FIELDS = ("tokens", "seq_len")


class SeqCounter:
    """The next ``seq`` per (step, phase) within one pass of the loop."""

    __slots__ = ("counts", "lap", "step")

    def __init__(self) -> None:
        self.step = -1
        self.counts: dict[str, int] = {}
        self.lap = 0  # the current pass's base

    def new_lap(self) -> None:
        """The loop went back in steps: the next pass's range."""
        self.lap += LAP_SEQ
        self.step, self.counts = -1, {}

    def phase(self, step: int, name: str) -> int:
        """0 (plus the pass's base) for the first phase of this name after ``step``, 1 for a second
        one (two checkpoint callbacks at one step), ..."""
        if step != self.step:
            self.step, self.counts = step, {}
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        return self.lap + n

    def next(self, step: int, phase: str) -> int:
        """The next free ``seq`` of ``phase`` at ``step`` (the train sample holds the base; markers follow)."""
        if phase == "train" and (step != self.step or "train" not in self.counts):
            self.phase(step, "train")  # the train sample itself holds the base
        return self.phase(step, phase)


def add_numbers(sample: dict[str, Any], numbers: dict[str, Any]) -> tuple[int, str | None]:
    """Put ``vw.step(**numbers)`` into ``sample``: :data:`STEP_FIELDS` as wire fields, the rest in
    ``extra``. Returns how many were ignored (not finite, out of range, not a number) and the
    name of the first that was not a number at all (the hook warns once about it)."""
    extra: dict[str, float] = {}
    ignored, not_number = 0, None
    for key, value in numbers.items():
        if type(value) not in (int, float):
            if isinstance(value, _numbers.Real):
                value = float(value)  # numpy scalars; never a tensor (.item() would sync the GPU)
            else:
                ignored += 1
                not_number = not_number or f"{key}={type(value).__name__}"
                continue
        if not math.isfinite(value) or abs(value) > MAX_INT:
            ignored += 1
            continue
        if key in STEP_FIELDS and value >= 0:
            sample[key] = int(value)
        elif _EXTRA_KEY_RE.match(key):
            extra[key] = value
    if extra:
        sample["extra"] = extra
    return ignored, not_number


__all__ = ["LAP_SEQ", "STEP_FIELDS", "SeqCounter", "add_numbers"]
