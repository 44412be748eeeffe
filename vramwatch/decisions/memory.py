"""A rank's memory by category, and whether its step peaks follow the longest input sequence.

:class:`MemoryFold` folds a rank's samples in (O(1) per sample, bounded memory) and keeps:

- the latest parameter, gradient and optimizer-state bytes (``vw.watch``: sparse fields, carried
  forward), the fp32 part of the parameters, the latest training step's peak and allocated bytes,
  inactive split bytes, bytes of other processes on the GPU, torch's version and the allocator's
  settings (sent once per process);
- the step's longest sequence (``vw.step(seq_len=...)``) against the step's transient (``peak -
  allocated``): running sums for their correlation and least-squares slope, and a 1 %-wide
  histogram of the lengths for their quantiles.

:meth:`MemoryFold.facts` hands the decisions a frozen :class:`MemoryFacts`; its
:attr:`MemoryFacts.input_peak` is the typed finding :class:`InputPeak` ("this rank's step peaks
follow the longest sequence": the post-mortem names an ``input_peak`` cause from it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

#: the lengths' histogram: buckets 1 % wide (log scale), at most this many (a longer tail folds in)
SEQ_BUCKET = math.log(1.01)
MAX_SEQ_BUCKETS = 2048
#: peaks follow the sequence length when, over at least MIN_SEQ_STEPS training steps whose longest
#: sequence spans at least MIN_SEQ_SPREAD (max / min), the transient correlates with it at least this
MIN_SEQ_STEPS = 20
MIN_SEQ_SPREAD = 1.2
MIN_SEQ_CORRELATION = 0.8
#: the length cap a ``shorter_sequences`` remedy proposes: this quantile of the observed lengths
SEQ_CAP_QUANTILE = 0.9


@dataclass(frozen=True)
class InputPeak:
    """Finding: this rank's step peaks follow the step's longest sequence (variable-length inputs)."""

    host: str
    rank: int
    steps: int  # training steps that carried seq_len
    correlation: float  # Pearson's r of the transient against seq_len
    bytes_per_seq_token: float  # least-squares slope of the transient per token of the longest sequence
    seq_len_min: int
    seq_len_max: int
    seq_len_cap: int  # the SEQ_CAP_QUANTILE of the observed lengths
    step_at_longest: int  # the step of the longest sequence
    transient_at_longest_bytes: int

    @property
    def cap_saves_bytes(self) -> int:
        """The transient a cap at :attr:`seq_len_cap` removes from the longest step (the fitted slope)."""
        return max(0, int(self.bytes_per_seq_token * (self.seq_len_max - self.seq_len_cap)))

    def explains(self, seq_len: int | None) -> bool:
        """Whether a step with this longest sequence is an input peak: longer than the cap (the
        SEQ_CAP_QUANTILE of the lengths seen), so its transient is among the run's largest. What the
        post-mortem asks of an OOM's last step (``MemoryFacts.seq_len_last``)."""
        return seq_len is not None and seq_len > self.seq_len_cap

    @property
    def sentence(self) -> str:
        return (f"rank {self.rank}'s step peaks follow the longest sequence (r = {self.correlation:.2f} over "
                f"{self.steps:,} steps, {self.bytes_per_seq_token / 2**20:.2f} MiB per token of length; "
                f"lengths {self.seq_len_min:,} to {self.seq_len_max:,}, the longest at step {self.step_at_longest:,})")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cap_saves_bytes": self.cap_saves_bytes, "text": self.sentence}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> InputPeak:
        names = cls.__dataclass_fields__
        return cls(**{k: doc[k] for k in names})


@dataclass(frozen=True)
class MemoryFacts:
    """What one rank's memory is made of, as its latest samples state it (None: not measured)."""

    host: str
    rank: int
    params_bytes: int | None = None
    grads_bytes: int | None = None
    optimizer_bytes: int | None = None
    params_fp32_bytes: int | None = None
    peak_bytes: int | None = None  # the latest training step's peak allocated
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    inactive_split_bytes: int | None = None
    foreign_bytes: int | None = None
    total_bytes: int | None = None
    torch_version: str | None = None
    alloc_conf: str | None = None
    allocator: str | None = None
    seq_len_last: int | None = None  # the latest training step's longest sequence
    fragmented: bool = False  # the trend engine's fragmentation verdict
    input_peak: InputPeak | None = None

    @property
    def watched(self) -> bool:
        return self.params_bytes is not None

    @property
    def activation_bytes(self) -> int | None:
        """Activations and temporaries at the step's peak: the peak minus parameters, gradients and
        optimizer state (None unless the model is watched and the peak measured)."""
        if self.peak_bytes is None or not self.watched:
            return None
        held = (self.params_bytes or 0) + (self.grads_bytes or 0) + (self.optimizer_bytes or 0)
        return max(0, self.peak_bytes - held)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["activation_bytes"] = self.activation_bytes
        out["input_peak"] = self.input_peak.as_dict() if self.input_peak else None
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MemoryFacts:
        """Inverse of :meth:`as_dict` (a front reads its shards' documents back)."""
        names = [k for k in cls.__dataclass_fields__ if k != "input_peak"]
        peak = doc.get("input_peak")
        return cls(**{k: doc.get(k) for k in names if k in doc},
                   input_peak=InputPeak.from_dict(peak) if peak else None)


_CARRIED = ("params_bytes", "grads_bytes", "optimizer_bytes", "params_fp32_bytes", "torch_version", "alloc_conf")
_WANTED = frozenset((*_CARRIED, "seq_len"))
#: the latest training step's measurements the facts read (from the trend engine's latest train sample)
_MEASURED = (("peak_bytes", "peak_allocated_bytes"), ("allocated_bytes", "allocated_bytes"),
             ("reserved_bytes", "reserved_bytes"), ("inactive_split_bytes", "inactive_split_bytes"),
             ("foreign_bytes", "foreign_used_bytes"), ("total_bytes", "total_bytes"), ("allocator", "allocator"))


class _SeqStats:
    """Sums of (seq_len, transient) for their correlation and slope, and the lengths' histogram."""

    __slots__ = ("lengths", "n", "seq_max", "seq_min", "step_at_longest", "sx", "sxx", "sxy", "sy", "syy",
                 "transient_at_longest")

    def __init__(self, seq: int) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.syy = self.sxy = 0.0
        self.seq_min = self.seq_max = seq
        self.step_at_longest = self.transient_at_longest = 0
        self.lengths: dict[int, int] = {}

    def add(self, seq: int, transient: int, step: int) -> None:
        x, y = float(seq), float(transient)
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.syy += y * y
        self.sxy += x * y
        if seq < self.seq_min:
            self.seq_min = seq
        if seq >= self.seq_max:
            self.seq_max, self.step_at_longest, self.transient_at_longest = seq, step, transient
        key = int(math.log(seq) / SEQ_BUCKET)
        if key in self.lengths or len(self.lengths) < MAX_SEQ_BUCKETS:
            self.lengths[key] = self.lengths.get(key, 0) + 1

    def quantile(self, q: float) -> int:
        total = sum(self.lengths.values())
        seen = 0
        for key in sorted(self.lengths):
            seen += self.lengths[key]
            if seen >= q * total:
                return min(self.seq_max, int(math.exp((key + 1) * SEQ_BUCKET)))
        return self.seq_max

    def finding(self, host: str, rank: int) -> InputPeak | None:
        n = self.n
        if n < MIN_SEQ_STEPS or self.seq_max < MIN_SEQ_SPREAD * self.seq_min:
            return None
        vx, vy = n * self.sxx - self.sx * self.sx, n * self.syy - self.sy * self.sy
        if vx <= 0 or vy <= 0:
            return None
        cov = n * self.sxy - self.sx * self.sy
        r = cov / math.sqrt(vx * vy)
        if r < MIN_SEQ_CORRELATION:
            return None
        return InputPeak(host, rank, n, round(r, 4), cov / vx, self.seq_min, self.seq_max,
                         self.quantile(SEQ_CAP_QUANTILE), self.step_at_longest, self.transient_at_longest)


class MemoryFold:
    """The online fold behind :class:`MemoryFacts` (one per rank). Holds nothing until a sample
    carries a category, a runtime setting or ``seq_len`` (a series' resident budget is small)."""

    __slots__ = ("latest", "seq", "seq_len_last")

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None
        self.seq: _SeqStats | None = None
        self.seq_len_last: int | None = None

    @staticmethod
    def wanted(sample: dict[str, Any]) -> bool:
        """Whether ``sample`` carries anything a fold keeps (a category, a runtime setting, seq_len)."""
        return not _WANTED.isdisjoint(sample)  # C speed: most samples carry none of them

    def fold(self, sample: dict[str, Any]) -> None:
        """O(1): a few dict reads, and the sums when the sample carries ``seq_len``."""
        get = sample.get
        for name in _CARRIED:  # sparse: absent is "unchanged"
            value = get(name)
            if value is not None:
                if self.latest is None:
                    self.latest = {}
                self.latest[name] = value
        seq = get("seq_len")
        if not seq or sample["phase"] != "train":
            return
        self.seq_len_last = seq
        peak, allocated = get("peak_allocated_bytes"), get("allocated_bytes")
        if peak is not None and allocated is not None:
            if self.seq is None:
                self.seq = _SeqStats(seq)
            self.seq.add(int(seq), peak - allocated, sample["step"])

    def input_peak(self, host: str, rank: int) -> InputPeak | None:
        """The finding when the step peaks follow ``seq_len`` (the thresholds above), else None."""
        return None if self.seq is None else self.seq.finding(host, rank)

    def facts(self, host: str, rank: int, *, fragmented: bool, last: dict[str, Any] | None) -> MemoryFacts:
        """A frozen copy (O(length buckets)); ``last``: the rank's latest training sample."""
        measured = {name: last.get(field) for name, field in _MEASURED} if last else {}
        return MemoryFacts(host, rank, **(self.latest or {}), **measured, seq_len_last=self.seq_len_last,
                           fragmented=fragmented, input_peak=self.input_peak(host, rank))


__all__ = ["MIN_SEQ_CORRELATION", "InputPeak", "MemoryFacts", "MemoryFold"]
