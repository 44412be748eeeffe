"""Token-dependent scenarios for the simulator, with the truth the advice is scored against.

Each scenario is a base scenario of :mod:`vramwatch.probe.simulated` plus the token
parameters: train samples carry ``tokens`` and the step's transient is
``act_fixed + act * tokens / tokens_ref`` (linear with an intercept, so the proportional
assumption is knowingly off). :func:`token_truth` computes, from the simulator's own rank
model (not from samples), the device need at any tokens and the largest tokens per step
that keeps the margin at every phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramwatch.probe.simulated import H200_TOTAL_BYTES, rank_model, scenario_params, simulate_trace

#: name -> (base scenario, token parameters). KoHRM-like: 16k-22.5k local token slots.
TOKEN_SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    # variable-length batches (padding-free packing with a cap): tokens 35-100 % of the cap
    "varlen": ("checkpoint", {"tokens_per_step": 16384, "seq_min": 0.35, "seq_skew": 2.0, "act_frac": 0.36,
                              "act_fixed_frac": 0.03, "act_jitter_frac": 0.03}),
    # the same with long batches rare (the wall is hit by one long batch late)
    "varlen_rare_long": ("checkpoint", {"tokens_per_step": 16384, "seq_min": 0.35, "seq_skew": 4.0,
                                        "act_frac": 0.36, "act_fixed_frac": 0.03, "act_jitter_frac": 0.03}),
    # batch composition matters as much as length (10 % more activation at equal tokens), long batches rare
    "varlen_noisy": ("checkpoint", {"tokens_per_step": 16384, "seq_min": 0.35, "seq_skew": 4.0, "act_frac": 0.34,
                                    "act_fixed_frac": 0.03, "act_jitter_frac": 0.10}),
    # fixed token slots (KoHRM: 22,528 per GPU); tokens never vary inside the run
    "fixed": ("checkpoint", {"tokens_per_step": 22528, "seq_min": 1.0, "tokens_ref": 22528, "act_frac": 0.40,
                             "act_fixed_frac": 0.03}),
    # fixed slots, near the wall: ~127-130 GB of 143.8 GB as in the notes
    "fixed_tight": ("checkpoint", {"tokens_per_step": 22528, "seq_min": 1.0, "tokens_ref": 22528,
                                   "act_frac": 0.46, "act_fixed_frac": 0.03}),
    # the checkpoint phase is the binding phase, eval phases too
    "varlen_eval": ("eval", {"tokens_per_step": 16384, "seq_min": 0.35, "seq_skew": 2.0, "act_frac": 0.30,
                             "act_fixed_frac": 0.02, "ckpt_every": 1000, "eval_act_frac": 0.45,
                             "act_jitter_frac": 0.03}),
    # attention without flash: a quadratic share, which a linear fit under-projects (docs/decisions.md)
    "varlen_quadratic": ("checkpoint", {"tokens_per_step": 16384, "seq_min": 0.35, "seq_skew": 2.0,
                                        "act_frac": 0.28, "act_quad_frac": 0.08, "act_fixed_frac": 0.03,
                                        "act_jitter_frac": 0.03}),
}


def token_params(name: str, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """(base scenario, parameters) of a token scenario, with ``overrides`` applied."""
    if name not in TOKEN_SCENARIOS:
        raise ValueError(f"unknown token scenario {name!r}; choose one of {', '.join(TOKEN_SCENARIOS)}")
    base, params = TOKEN_SCENARIOS[name]
    return base, {**params, **overrides}


def token_trace(name: str, *, steps: int, run: str, rank: int = 0, seed: int = 0,
                total_bytes: int = H200_TOTAL_BYTES, **overrides: Any) -> list[dict[str, Any]]:
    """One rank's samples of a token scenario (deterministic given ``seed``)."""
    base, params = token_params(name, **overrides)
    return list(simulate_trace(base, steps=steps, run=run, rank=rank, seed=seed, total_bytes=total_bytes,
                               **params))


@dataclass(frozen=True)
class TokenTruth:
    """Ground truth of one rank after warm-up (from the simulator's parameters)."""

    total_bytes: int
    floor_bytes: float
    outside_bytes: float
    slack_bytes: float
    act_fixed_bytes: float
    bytes_per_token: float  # upper envelope: the largest activation at the same tokens
    quad_bytes: float  # superlinear part at tokens_ref
    tokens_ref: int
    phase_transients: dict[str, float]
    cliff_tokens: int | None = None  # above this batch the checkpoint needs cliff_bytes more
    cliff_bytes: float = 0.0

    def need(self, tokens: float) -> dict[str, float]:
        """Device need per phase at ``tokens`` per step (reserved rounding ignored: < 2 MiB)."""
        base = self.floor_bytes + self.slack_bytes + self.outside_bytes
        rel = tokens / self.tokens_ref
        out = {"train": base + self.act_fixed_bytes + self.bytes_per_token * tokens + self.quad_bytes * rel * rel}
        for phase, transient in self.phase_transients.items():
            out[phase] = base + transient
        if "checkpoint" in out and self.cliff_tokens is not None and tokens > self.cliff_tokens:
            out["checkpoint"] += self.cliff_bytes
        return out

    def worst_need(self, tokens: float) -> float:
        return max(self.need(tokens).values())

    def max_tokens(self, margin: float) -> int:
        limit = self.total_bytes * (1 - margin)
        if self.worst_need(0) > limit:
            return 0
        lo, hi = 0, 1
        while self.worst_need(hi) <= limit:
            hi *= 2
        while hi - lo > 1:  # every phase's need is non-decreasing in tokens: bisect
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.worst_need(mid) <= limit else (lo, mid)
        return lo


def token_truth(name: str, *, rank: int = 0, seed: int = 0, total_bytes: int = H200_TOTAL_BYTES,
                at_step: int = 100_000, **overrides: Any) -> TokenTruth:
    """Truth for one rank of a token scenario, read off the simulator's model at ``at_step``."""
    base, params = token_params(name, **overrides)
    p = scenario_params(base, **params)
    model = rank_model(base, rank=rank, seed=seed, total_bytes=total_bytes, **params)
    floor = model.floor(at_step)
    ref = model.tokens_ref
    phases: dict[str, float] = {}
    if p["ckpt_every"]:
        phases["checkpoint"] = model.act_fixed + model.act + p["ckpt_above_frac"] * total_bytes
    if p["eval_every"]:
        phases["eval"] = p["eval_act_frac"] * total_bytes
    per_token = model.act * (1.0 + p["act_jitter_frac"]) / ref
    return TokenTruth(total_bytes, floor, model.ctx, model.waste(at_step), model.act_fixed, per_token,
                      p["act_quad_frac"] * total_bytes, ref, phases, p["ckpt_cliff_tokens"],
                      p["ckpt_cliff_frac"] * total_bytes)




def regression_overrides(name: str, growth: float, *, total_bytes: int = H200_TOTAL_BYTES) -> dict[str, Any]:
    """Overrides that make a candidate's training peak ``growth`` larger than the scenario's
    (more persistent memory: the usual regression, e.g. a new buffer kept across steps)."""
    base, params = token_params(name)
    p = scenario_params(base, **params)
    truth = token_truth(name, total_bytes=total_bytes)
    peak = truth.need(p["tokens_per_step"])["train"] - truth.outside_bytes - truth.slack_bytes
    return {"base_frac": p["base_frac"] + growth * peak / total_bytes}


__all__ = ["TOKEN_SCENARIOS", "TokenTruth", "regression_overrides", "token_params", "token_trace", "token_truth"]
