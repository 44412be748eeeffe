"""A restarted process inherits its rank's leak: an unfixed leak is found again within a few
hundred steps of the restart (not after a fresh warm-up), and a fixed one is not re-called."""

from __future__ import annotations

import random

import pytest
from incident_runs import T0, GiB, MiB, sample

from vramwatch.engine import TrendEngine


def _rank(leak_after_restart: float, *, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = [sample("r", 0, step, T0 + step, "a", 40 * GiB + 40 * MiB * max(0, step - 600) + rng.gauss(0, 8 * MiB))
           for step in range(1300)]
    t1 = T0 + 1500
    out += [sample("r", 0, step, t1 + step, "b", 40 * GiB + leak_after_restart * (step - 1001)
                   + rng.gauss(0, 8 * MiB)) for step in range(1001, 2400)]
    return out


def _leaks(samples: list[dict]) -> list[dict]:
    engine = TrendEngine()
    return [e for s in samples for e in engine.update(s) if e["type"] == "leak"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_an_unfixed_leak_is_found_again_within_a_few_hundred_steps_of_the_restart(seed: int) -> None:
    first, again = _leaks(_rank(40 * MiB, seed=seed))[:2]
    assert first["step"] < 1400
    assert 1001 < again["step"] <= 1001 + 400, again
    assert again["onset_step"] == 1001
    assert again["slope_bytes_per_step"] == pytest.approx(40 * MiB, rel=0.1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_fixed_leak_is_not_called_again_after_the_restart(seed: int) -> None:
    leaks = _leaks(_rank(0.0, seed=seed))
    assert [e for e in leaks if e["step"] > 1001] == []


def test_without_the_inheritance_a_fresh_process_would_take_a_warm_up_to_find_it() -> None:
    """The control: the restarted process alone (no earlier process) is judged from scratch."""
    leaks = _leaks([s for s in _rank(40 * MiB) if s["incarnation"] == "b"])
    assert not leaks or leaks[0]["step"] > 1001 + 400
