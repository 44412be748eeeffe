"""The transient fit on a real PyTorch model (CPU): activation memory measured, not simulated.

See tests/torch_transient.py for what is measured (autograd-saved bytes of a small
transformer with naive attention) and why it stands in for the step's transient.
"""

from __future__ import annotations

import random

import pytest
from torch_transient import Batch, TinyLM, samples

from vramwatch.decisions.observe import observe


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM()


def fitted(model: TinyLM, batches: list[Batch]):
    return observe(samples(model, batches, scale=1000))["torch-cpu"].tracks()[0].builder.model()


def test_variable_sequence_length_is_convex_and_the_fit_follows_it(model) -> None:
    rng = random.Random(0)
    batches = [Batch(4, 16 * rng.randint(4, 24)) for _ in range(80)]  # 256-1,536 tokens, T up to 384
    fit = fitted(model, batches).train
    assert fit.method == "envelope_quadratic" and fit.bytes_per_token2 > 0
    for factor in (1.1, 1.3):
        b = Batch(4, int(384 * factor))
        measured = model.saved_bytes(b.batch, b.seq) * 1000
        assert fit.transient(b.tokens) == pytest.approx(measured, rel=0.01)


def test_mixed_compositions_take_the_worst_one_as_the_envelope(model) -> None:
    rng = random.Random(1)
    batches = [Batch(rng.randint(1, 1536 // t), t) for t in (rng.choice((64, 128, 256)) for _ in range(120))]
    fit = fitted(model, batches).train
    assert fit.method == "envelope"
    b = Batch(8, 256)  # 1.33x the largest tokens seen, in the worst composition seen (T = 256)
    measured = model.saved_bytes(b.batch, b.seq) * 1000
    error = (fit.transient(b.tokens) - measured) / measured
    assert abs(error) < 0.05
    assert fit.uncertainty_frac >= abs(error)  # the stated uncertainty covers what happened
    # the cloud below the envelope (shorter sequences at equal tokens) does not pull it down
    shorter = Batch(16, 128)
    assert fit.transient(shorter.tokens) > model.saved_bytes(shorter.batch, shorter.seq) * 1000
