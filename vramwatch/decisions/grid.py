"""The grid of settable batches: which tokens per step per rank a person can actually set.

Every batch the advice names (the next step, the largest that fits, a back-off) is a multiple of
the grid's step, and a target a person types must be one. The step comes from what the run states,
the first that applies:

1. ``option``: ``--granularity N`` (the API's ``granularity``), the operator's word;
2. ``declared``: the training loop declared it on its samples (``vw.step(step, tokens=n,
   token_grid=g)``, or ``seq_len=L`` with an optional ``grad_accum=a``: micro-batches of whole
   sequences are settable in steps of ``L x a`` tokens per rank); the latest process's word wins;
3. ``inferred`` from the batches seen: the largest divisor of every exact batch (processes whose
   tokens never varied) that is at most :data:`WINDOW` of the smallest of them, and at most
   :data:`MAX_STEP`. Dividing every batch seen keeps each previous setting settable (the
   procedure's "straight back"); :data:`WINDOW` keeps a settable batch inside the seed's 5-10 %
   back-off window, so no back-off is forced to cut deeper than the procedure asks. With tokens
   varying inside every process (packing up to a cap) nothing exact was seen: the largest power
   of two within :data:`VARYING_SHARE` of the largest batch, a loose grid (``strict`` false: it
   rounds what the advice names, it refuses no target).

The answer says which grid it used and why (:attr:`Grid.why`). Pure; inference is O(settings x
:data:`MAX_STEP`) (a divisor search below the cap).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: An inferred step never exceeds this (a context length: settable batches are multiples of it).
MAX_STEP = 4096
#: The seed's back-off window is 5-10 % below a batch: an inferred step at most this share of the
#: smallest batch seen leaves a settable batch inside it.
WINDOW = 0.05
#: Tokens varying inside every process: the step is the largest power of two within this share.
VARYING_SHARE = 0.02
SOURCES = ("option", "declared", "inferred")
#: Sample ``extra`` keys a training loop may declare its grid with (tokens per rank).
DECLARED_KEY = "token_grid"
SEQ_KEY, ACCUM_KEY = "seq_len", "grad_accum"


class OffGrid(ValueError):
    """A target that is not a settable batch: one line that names the grid (CLI exit 2, a 4xx)."""


@dataclass(frozen=True)
class Grid:
    step: int  # tokens per step per rank between two settable batches
    source: str  # of SOURCES
    why: str  # the reason, in words with its numbers
    #: targets off it are refused; False when tokens vary (packing: any cap can be set, the step only
    #: rounds the batches the advice names)
    strict: bool = True

    def settable(self, tokens: float) -> int:
        """The largest settable batch at or below ``tokens`` (0 when none is)."""
        return max(0, int(tokens // self.step * self.step))

    def next_settable(self, tokens: int, at_least: float) -> int:
        """The smallest settable batch above ``tokens`` and at least ``at_least``."""
        g = self.step
        n = (max(tokens, int(at_least - 1)) // g + 1) * g
        while n < at_least:
            n += g
        return n

    def on(self, tokens: int) -> bool:
        """``tokens`` is a batch a person can set on this grid (any positive one on a loose grid)."""
        return tokens > 0 and (not self.strict or tokens % self.step == 0)

    def describe(self, world: int) -> str:
        """``8,192 global (1,024 per rank), inferred: ...``: global first, as a person sets it."""
        return f"{self.step * world:,} global ({self.step:,} per rank), {self.source}: {self.why}"

    def as_dict(self, world: int) -> dict[str, Any]:
        return {"tokens_per_step": self.step, "global_tokens_per_step": self.step * world, "source": self.source,
                "why": self.why, "strict": self.strict}


def declared_step(extra: Any) -> int | None:
    """The grid a sample's ``extra`` declares (tokens per rank), or None: ``token_grid``, else
    ``seq_len`` x ``grad_accum`` (1 when absent). Non-positive or non-integral values declare nothing."""
    if not isinstance(extra, dict):
        return None
    step = _whole(extra.get(DECLARED_KEY))
    if step is None:
        seq, accum = _whole(extra.get(SEQ_KEY)), _whole(extra.get(ACCUM_KEY, 1))
        step = seq * accum if seq is not None and accum is not None else None
    return step


def _whole(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    n = int(value)
    return n if n == value and n > 0 else None


def choose(option: int | None, declared: int | None, exact: Iterable[int], varying_max: int) -> Grid:
    """The grid (rules in the module docstring): ``option`` the operator's, ``declared`` the
    latest process's declaration, ``exact`` every exact batch seen, ``varying_max`` the largest
    batch of processes whose tokens varied."""
    if option:
        return Grid(option, "option", "set by --granularity")
    if declared:
        return Grid(declared, "declared", "declared by the training loop (token_grid, or seq_len x grad_accum)")
    seen = sorted({x for x in exact if x > 0})
    if seen:
        return _inferred(seen)
    g = 1
    while g * 2 <= min(MAX_STEP, varying_max * VARYING_SHARE):
        g *= 2
    if not varying_max:
        return Grid(1, "inferred", "no tokens seen", strict=False)
    return Grid(g, "inferred", f"tokens vary inside every process (up to {varying_max:,}): the largest power of "
                               f"two within {VARYING_SHARE:.0%} of it", strict=False)


def _inferred(seen: list[int]) -> Grid:
    common = math.gcd(*seen)
    cap = min(MAX_STEP, int(WINDOW * seen[0]))
    step = next(d for d in range(max(1, cap), 0, -1) if common % d == 0)
    batches = ", ".join(f"{x:,}" for x in seen[:4]) + (", ..." if len(seen) > 4 else "")
    return Grid(step, "inferred", f"the largest step dividing every batch seen per rank ({batches}) and at most "
                                  f"{WINDOW:.0%} of the smallest, so each earlier batch stays settable and a "
                                  "5-10 % back-off has a settable batch")


__all__ = ["ACCUM_KEY", "DECLARED_KEY", "MAX_STEP", "SEQ_KEY", "SOURCES", "VARYING_SHARE", "WINDOW", "Grid", "OffGrid",
           "choose", "declared_step"]
