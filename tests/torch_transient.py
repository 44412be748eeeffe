"""Real activation memory of a small PyTorch transformer on CPU, for checking the transient fit.

The GPU allocator is not here, so the transient is measured as what autograd must keep
from the forward pass for the backward pass: the bytes of every distinct storage saved
through ``torch.autograd.graph.saved_tensors_hooks`` (activations, attention scores,
logits; the weights saved by linear layers are a constant, the intercept). On a GPU the
step's peak adds backward temporaries on top; the shape of the dependence on tokens is
the same. Naive attention (no flash kernel) keeps ``B x heads x T x T`` scores, so memory
at equal tokens grows with the sequence length: the real-data case for the convex fit.

Used by tests/decisions/test_decisions_torch.py and bench/decisions_bench.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 2048
GiB = 1024**3


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)  # naive: T x T
        x = x + self.out((scores @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([_Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)
        self._measured: dict[tuple[int, int], int] = {}

    def saved_bytes(self, batch: int, seq: int) -> int:
        """Bytes autograd keeps for the backward of one step on ``batch x seq`` tokens.

        Deterministic for a shape (sizes, not values), so each shape is measured once.
        """
        known = self._measured.get((batch, seq))
        if known is None:
            known = self._measured[(batch, seq)] = self._measure(batch, seq)
        return known

    def _measure(self, batch: int, seq: int) -> int:
        ids = torch.randint(0, VOCAB, (batch, seq))
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            nn.functional.cross_entropy(self.head(x).view(-1, VOCAB), ids.view(-1))
        return sum(storages.values())


@dataclass(frozen=True)
class Batch:
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def samples(model: TinyLM, batches: list[Batch], *, run: str = "torch-cpu", floor: int = 40 * GiB,
            total: int = 80 * GiB, scale: int = 1) -> Iterator[dict[str, Any]]:
    """Schema-1 train samples whose transient is the measured one (x ``scale``, to GPU sizes)."""
    reserved = 0
    for step, b in enumerate(batches, start=1):
        transient = model.saved_bytes(b.batch, b.seq) * scale
        reserved = max(reserved, floor + transient)  # a caching allocator keeps what it grew to
        yield {"schema": 1, "run": run, "host": "cpu", "rank": 0, "step": step, "ts": 1.7e9 + step,
               "phase": "train", "allocated_bytes": floor, "reserved_bytes": reserved,
               "peak_allocated_bytes": floor + transient, "inactive_split_bytes": 0, "alloc_retries": 0,
               "ooms": 0, "nvml_used_bytes": None, "total_bytes": total, "tokens": b.tokens}
