"""What each remedy would save on the binding rank, and the batch it would allow.

Every figure comes from this run: the categories the hook counted (``vw.watch``: parameters,
gradients, optimizer state; activations = the step's peak minus those), the binding rank's memory
model (floor, the transient fitted against tokens, the allocator's slack, memory outside it), the
fragmentation verdict and the other processes on the GPU. The batch after a remedy goes through
the same :class:`~vramwatch.decisions.model.RankModel` ``advise`` uses: the model with the saving
applied, :meth:`~vramwatch.decisions.model.RankModel.max_tokens` at the same margin.

The assumptions a remedy rests on beyond the run's numbers are the constants below, each stated in
the remedy's ``basis``; docs/decisions.md lists them. O(ranks) per call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from vramwatch.decisions.memory import MemoryFacts
from vramwatch.decisions.model import RankModel
from vramwatch.units import gib

#: 8-bit optimizers keep each fp32 state element in one byte: 3/4 of the state saved
EIGHT_BIT_SAVES = 0.75
#: checkpointing every block keeps its input and recomputes the rest: about this share of the
#: per-token activations stays (the block inputs plus one block being recomputed)
CHECKPOINT_KEEPS = 0.25
#: and costs about one more forward per step (a forward is about a third of forward + backward)
CHECKPOINT_SLOWER = 1 / 3
#: autocast to bf16/fp16 keeps activations in 2 bytes instead of 4
MIXED_PRECISION_KEEPS = 0.5
#: parameters at least this share fp32 count as "fp32 training"
FP32_SHARE = 0.5
#: torch versions: expandable segments exist from 2.1; before 2.5 combining them with
#: max_split_size_mb could hit allocator asserts near OOM (pytorch/pytorch#134338)
EXPANDABLE_SINCE = (2, 1)
EXPANDABLE_WITH_SPLIT_SINCE = (2, 5)

REMEDIES = ("eight_bit_optimizer", "activation_checkpointing", "gradient_accumulation", "shorter_sequences", "lora",
            "mixed_precision", "sharding", "expandable_segments", "close_foreign_process")


@dataclass(frozen=True)
class Remedy:
    """One remedy for the binding rank: what it saves, the batch it would allow, what it costs."""

    remedy: str  # one of REMEDIES
    saves_bytes: int
    rank: int
    host: str
    tokens_per_step_after: int | None  # the model's largest batch with the saving (None: no token fit)
    costs: str
    basis: str  # the run's numbers and the assumption the saving rests on
    text: str

    def as_dict(self) -> dict[str, Any]:
        return {"remedy": self.remedy, "saves_bytes": self.saves_bytes, "rank": self.rank, "host": self.host,
                "tokens_per_step_after": self.tokens_per_step_after, "costs": self.costs, "basis": self.basis,
                "text": self.text}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Remedy:
        return cls(str(doc["remedy"]), int(doc["saves_bytes"]), int(doc["rank"]), str(doc.get("host", "")),
                   doc.get("tokens_per_step_after"), str(doc["costs"]), str(doc["basis"]), str(doc["text"]))


@dataclass(frozen=True)
class _Relief:
    """A saving as the model sees it: fixed bytes off, the per-token transient scaled."""

    fixed: float = 0.0
    per_token: float = 1.0
    outside: float = 0.0
    slack: float = 0.0


def _relieved(m: RankModel, r: _Relief) -> RankModel:
    t = m.train
    floor_off = min(float(m.floor_bytes), r.fixed)
    # what the floor does not hold (gradients freed at the step boundary) comes off the transient
    train = replace(t, intercept_bytes=t.intercept_bytes - (r.fixed - floor_off),
                    bytes_per_token=t.bytes_per_token * r.per_token, bytes_per_token2=t.bytes_per_token2 * r.per_token)
    return replace(m, floor_bytes=int(m.floor_bytes - floor_off), train=train,
                   outside_bytes=max(0, int(m.outside_bytes - r.outside)),
                   slack_bytes=max(0, int(m.slack_bytes - r.slack)))


def _tokens_after(m: RankModel | None, relief: _Relief, margin: float) -> int | None:
    if m is None or not m.train.usable:
        return None
    return _relieved(m, relief).max_tokens(margin)[0]


def _per_token(m: RankModel | None, tokens: int | None) -> float | None:
    """The transient's token-proportional part at ``tokens`` (the activations the batch makes)."""
    if m is None or not m.train.usable or not tokens:
        return None
    t = m.train
    return t.bytes_per_token * tokens + t.bytes_per_token2 * tokens * tokens


def _version(text: str | None) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def _conf(text: str | None) -> dict[str, str]:
    pairs = (p.split(":", 1) for p in (text or "").split(",") if ":" in p)
    return {k.strip(): v.strip() for k, v in pairs}


@dataclass(frozen=True)
class _Rank:
    """The binding rank's figures every remedy reads."""

    f: MemoryFacts
    m: RankModel | None
    world: int
    margin: float

    @property
    def tokens(self) -> int | None:
        return (self.m.tokens_seen_max or self.m.tokens_last) if self.m else None  # the worst step seen

    def remedy(self, name: str, saves: float, relief: _Relief, costs: str, basis: str, text: str) -> Remedy:
        after = _tokens_after(self.m, relief, self.margin)
        batch = f"; the model then allows {after:,} tokens per step at the {self.margin:.0%} margin" if after else ""
        return Remedy(name, int(saves), self.f.rank, self.f.host, after, costs, basis, f"{text}: saves "
                      f"{gib(saves)} on rank {self.f.rank}{batch}")


def _state_remedies(b: _Rank) -> list[Remedy]:
    f, out = b.f, []
    opt, grads, params = f.optimizer_bytes or 0, f.grads_bytes or 0, f.params_bytes or 0
    if opt:
        saves = EIGHT_BIT_SAVES * opt
        out.append(b.remedy("eight_bit_optimizer", saves, _Relief(fixed=saves),
                            "an 8-bit optimizer (bitsandbytes AdamW8bit): a small accuracy risk, a little slower",
                            f"optimizer state {gib(opt)}, assumed fp32 (Adam's two moments): 4 to 1 byte per element",
                            "Keep the optimizer state in 8 bits"))
    if grads or opt:
        saves = grads + opt
        out.append(b.remedy("lora", saves, _Relief(fixed=saves),
                            "LoRA or freezing: fewer trainable weights, a quality risk for full fine-tuning or "
                            "pre-training; no speed cost",
                            f"gradients {gib(grads)} + optimizer state {gib(opt)} of what would be frozen "
                            "(the adapters' own state not counted)",
                            "Freeze the base weights (LoRA adapters or frozen layers)"))
    if b.world > 1 and params + grads + opt:
        share = 1 - 1 / b.world
        saves = share * (params + grads + opt)
        out.append(b.remedy("sharding", saves, _Relief(fixed=saves),
                            "parameters all-gathered in forward and backward: about 1.5x the data-parallel "
                            "communication (ZeRO-1/2, sharding only optimizer state and gradients, costs none extra)",
                            f"(parameters {gib(params)} + gradients {gib(grads)} + optimizer state {gib(opt)}) x "
                            f"(1 - 1/{b.world}) ranks; ZeRO-1 alone saves {gib(share * opt)}, ZeRO-2 "
                            f"{gib(share * (opt + grads))}",
                            f"Shard parameters, gradients and optimizer state across the {b.world} ranks "
                            "(FSDP, ZeRO-3)"))
    return out


def _activation_remedies(b: _Rank) -> list[Remedy]:
    f, m, out = b.f, b.m, []
    tokens = b.tokens
    per_token = _per_token(m, tokens)
    acts = per_token if per_token is not None else f.activation_bytes
    if acts:
        saves = (1 - CHECKPOINT_KEEPS) * acts
        source = (f"the run's tokens-to-peak slope: {m.train.bytes_per_token / 2**10:,.1f} KiB per token at "  # type: ignore[union-attr]
                  f"{tokens:,} tokens = {gib(acts)}" if per_token is not None else
                  f"activations and temporaries at the peak {gib(acts)} (peak minus the watched categories)")
        out.append(b.remedy("activation_checkpointing", saves, _Relief(per_token=CHECKPOINT_KEEPS),
                            f"recompute: one more forward per step, about +{CHECKPOINT_SLOWER:.0%} step time",
                            f"{source}; assumes checkpointing every block keeps {CHECKPOINT_KEEPS:.0%} of them",
                            "Checkpoint activations (torch.utils.checkpoint per block)"))
        if f.params_bytes and (f.params_fp32_bytes or 0) >= FP32_SHARE * f.params_bytes:
            saves = (1 - MIXED_PRECISION_KEEPS) * acts
            out.append(b.remedy("mixed_precision", saves, _Relief(per_token=MIXED_PRECISION_KEEPS),
                                "bf16 numerics (fp16 needs loss scaling); usually faster on tensor cores",
                                f"parameters are {gib(f.params_fp32_bytes)} of {gib(f.params_bytes)} fp32; assumes the "
                                f"activations ({gib(acts)}) are fp32 too and autocast halves them",
                                "Train in mixed precision (torch.autocast to bf16)"))
    if per_token is not None and tokens and m is not None:
        fits = m.max_tokens(b.margin)[0] or 0
        micro = fits if 0 < fits < tokens else tokens // 2
        if micro > 0:
            steps = -(-tokens // micro)
            saves = per_token - (_per_token(m, micro) or 0)
            out.append(Remedy("gradient_accumulation", int(saves), f.rank, f.host, micro,
                              f"the same {tokens:,} tokens per optimizer step in {steps} micro-steps: more kernel "
                              "launches, lower throughput where the micro-batch no longer fills the GPU",
                              f"the fitted per-token cost at {tokens:,} against {micro:,} tokens",
                              f"Accumulate gradients over {steps} micro-batches of {micro:,} tokens: saves "
                              f"{gib(saves)} on rank {f.rank}"))
    peak = f.input_peak
    if peak is not None and peak.cap_saves_bytes > 0:
        saves = peak.cap_saves_bytes
        out.append(b.remedy("shorter_sequences", saves, _Relief(fixed=saves),
                            f"inputs over {peak.seq_len_cap:,} tokens truncated or split (data changes); bucketing "
                            "by length keeps them and changes the batches' composition",
                            f"{peak.sentence}; capped at the {peak.seq_len_cap:,}-token 90th percentile",
                            f"Cap sequences at {peak.seq_len_cap:,} tokens or bucket batches by length"))
    return out


def _allocator_remedies(b: _Rank) -> list[Remedy]:
    f, out = b.f, []
    conf = _conf(f.alloc_conf)
    version = _version(f.torch_version)
    split = "max_split_size_mb" in conf
    set_already = conf.get("expandable_segments", "").lower() in ("true", "1")
    ok_version = version is None or version >= EXPANDABLE_SINCE
    harmful = split and (version is None or version < EXPANDABLE_WITH_SPLIT_SINCE)
    if (f.fragmented and f.inactive_split_bytes and f.allocator != "cudaMallocAsync" and not set_already
            and ok_version and not harmful):
        saves = f.inactive_split_bytes
        checked = f"torch {f.torch_version}" if version else "torch's version not reported (needs 2.1 or later)"
        out.append(b.remedy("expandable_segments", saves, _Relief(slack=saves),
                            "none known for one process per GPU; an allocator setting, set before CUDA starts",
                            f"fragmentation verdict; inactive split blocks {gib(saves)}; {checked}, allocator "
                            f"settings {f.alloc_conf or 'not reported'}",
                            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    if f.foreign_bytes:
        out.append(b.remedy("close_foreign_process", f.foreign_bytes, _Relief(outside=f.foreign_bytes),
                            "none for this run; the other process (a stale notebook kernel, another job) loses its "
                            "state", f"other processes hold {gib(f.foreign_bytes)} on rank {f.rank}'s GPU (NVML)",
                            "Close the other process on this GPU"))
    return out


def remedies(memory: list[MemoryFacts], models: list[RankModel], binding_rank: int | None, world: int,
             margin: float) -> tuple[Remedy, ...]:
    """The remedies for the binding rank (``binding_rank``, else the rank with the least headroom at
    its worst phase), largest saving first. Empty when no rank has figures."""
    if not memory:
        return ()
    by_rank = {(m.host, m.rank): m for m in models}

    def headroom(f: MemoryFacts) -> float:
        m = by_rank.get((f.host, f.rank))
        return (m.total_bytes - m.worst_need()[0]) if m and m.total_bytes else float("inf")

    chosen = [f for f in memory if f.rank == binding_rank] if binding_rank is not None else []
    facts = chosen[0] if chosen else min(memory, key=lambda f: (headroom(f), f.rank))
    b = _Rank(facts, by_rank.get((facts.host, facts.rank)), world, margin)
    found = [*_state_remedies(b), *_activation_remedies(b), *_allocator_remedies(b)]
    return tuple(sorted((r for r in found if r.saves_bytes > 0), key=lambda r: (-r.saves_bytes, r.remedy)))


def remedy_lines(memory: tuple[MemoryFacts, ...], found: tuple[Remedy, ...]) -> list[str]:
    """``vramwatch advise``'s text for the categories, the input-peak findings and the remedies."""
    lines = []
    rank = found[0].rank if found else None
    for f in memory:
        if f.watched and (rank is None or f.rank == rank):
            acts = f.activation_bytes
            peak = "" if acts is None else f", activations and temporaries {gib(acts)} at the step's peak"
            lines.append(f"memory of rank {f.rank}: parameters {gib(f.params_bytes)}, gradients {gib(f.grads_bytes)}, "
                         f"optimizer state {gib(f.optimizer_bytes)}{peak}")
    lines += [f"inputs: {f.input_peak.sentence}" for f in memory if f.input_peak is not None]
    if found:
        lines.append(f"remedies for rank {rank}, largest saving first:")
        lines += [f"  - {r.remedy}: {r.text} (costs: {r.costs})" for r in found]
    return lines


__all__ = ["REMEDIES", "Remedy", "remedies", "remedy_lines"]
