"""Generated runs whose samples carry what ``vw.watch`` and ``vw.step(seq_len=...)`` send: the
simulator's token scenarios with the categories (sparse: on the first training sample, and again
when they change), the longest sequence per step, and the hook's runtime settings."""

from __future__ import annotations

from typing import Any

from vramwatch.probe.simulated import simulate_trace
from vramwatch.simulation.tokens import token_trace

#: batch rows per step: seq_len = tokens // ROWS (padding to the longest: tokens follow it)
ROWS = 8


def with_categories(samples: list[dict[str, Any]], *, params: int, grads: int, optimizer: int, fp32: int,
                    torch_version: str = "2.4.0", alloc_conf: str = "-", change_at: int | None = None,
                    seq: bool = True, foreign: int | None = None) -> list[dict[str, Any]]:
    """``samples`` as the hook sends them with a watched model: categories on the first training
    sample (the optimizer state doubled at ``change_at``, sent again then), seq_len per step."""
    first = True
    for s in samples:
        if s["phase"] != "train":
            continue
        if first:
            s.update(params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer, params_fp32_bytes=fp32,
                     torch_version=torch_version, alloc_conf=alloc_conf)
            first = False
        if change_at is not None and s["step"] == change_at:
            s["optimizer_bytes"] = 2 * optimizer
        if seq and s.get("tokens"):
            s["seq_len"] = s["tokens"] // ROWS
        if foreign is not None:
            s["foreign_used_bytes"] = foreign
    return samples


def watched_varlen(run: str, *, ranks: int = 2, steps: int = 3200, floor: int, **kwargs: Any) -> list[dict[str, Any]]:
    """The ``varlen`` token scenario on ``ranks`` ranks, its floor split into parameters (1/4), gradients
    (1/4) and optimizer state (1/2, half of it before ``change_at``), all fp32; rank 1 shares its GPU with
    another process (2 GiB)."""
    out: list[dict[str, Any]] = []
    optimizer = floor // 2 // (2 if kwargs.get("change_at") is not None else 1)
    for r in range(ranks):
        trace = token_trace("varlen", steps=steps, run=run, rank=r, seed=r, world_size=ranks)
        out += with_categories(trace, params=floor // 4, grads=floor // 4, optimizer=optimizer, fp32=floor // 4,
                               foreign=2 * 2**30 if r == 1 else None, **kwargs)
    return out


def fragmented(run: str, *, torch_version: str, alloc_conf: str, steps: int = 4000) -> list[dict[str, Any]]:
    """One rank of the simulator's fragmentation scenario, watched, with the given runtime settings."""
    trace = list(simulate_trace("fragmentation", steps=steps, run=run, seed=3))
    return with_categories(trace, params=8 * 2**30, grads=8 * 2**30, optimizer=16 * 2**30, fp32=8 * 2**30,
                           torch_version=torch_version, alloc_conf=alloc_conf, seq=False)
