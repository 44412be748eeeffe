"""The collector's per-series engine with the decision figures folded in online.

:class:`DecisionEngine` has the :class:`~vramwatch.engine.TrendEngine` public surface the
collector uses (``update``, ``summary()``, ``state``, ``events``, ``samples``) and adds,
per rank, a memory-model builder and the readiness bookkeeping
(:class:`~vramwatch.decisions.observe.RankTrack`). ``summary()`` gains:

* ``max_tokens_per_step``: largest tokens per step that keeps the default margin
  (:data:`vramwatch.verdicts.LOW_HEADROOM_FRACTION`) at the worst phase; None when unknown;
* ``tokens_per_step_max_observed``: largest tokens per step seen;
* ``readiness``: ``ready`` / ``not_ready`` / ``unsafe`` with the default thresholds.

Cost: per sample, the engine's update plus O(1); the model is refitted (O(buckets²),
~5 ms) at most once per :data:`REFIT_EVERY` samples, so a scrape reads cached figures.
"""

from __future__ import annotations

from typing import Any

from vramwatch.engine import TrendEngine
from vramwatch.verdicts import LOW_HEADROOM_FRACTION

from .observe import RankTrack
from .readiness import ReadinessConfig, rank_readiness

#: Samples between refits of the memory model (and re-judging readiness) for the live figures.
REFIT_EVERY = 256

_CONFIG = ReadinessConfig()


class DecisionEngine:
    """A TrendEngine plus the decision figures; a drop-in ``engine_factory`` for ``LiveState``."""

    def __init__(self, engine: TrendEngine | None = None) -> None:
        self._track = RankTrack("", "", 0, engine=engine or TrendEngine())
        self._fitted_at = -REFIT_EVERY
        self._figures: dict[str, Any] = {"max_tokens_per_step": None, "tokens_per_step_max_observed": None,
                                         "readiness": None}

    # the TrendEngine surface the collector reads
    @property
    def engine(self) -> TrendEngine:
        return self._track.engine

    @property
    def state(self) -> str:
        return self._track.engine.state

    @property
    def events(self) -> Any:
        return self._track.engine.events

    @property
    def samples(self) -> int:
        return self._track.engine.samples

    def __getattr__(self, name: str) -> Any:
        # anything else the engine offers (config, plateau_breaks, ...) reads through
        return getattr(self._track.engine, name)

    def update(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """Engine update plus O(1) bookkeeping; returns the engine's new events."""
        track = self._track
        track.run, track.host, track.rank = sample["run"], sample["host"], sample["rank"]
        return track.update(sample)

    def figures(self) -> dict[str, Any]:
        """The decision figures, refitted when :data:`REFIT_EVERY` samples have arrived since."""
        track = self._track
        if track.builder.samples - self._fitted_at >= REFIT_EVERY:
            self._fitted_at = track.builder.samples
            model = track.builder.model()
            tokens, _ = model.max_tokens(LOW_HEADROOM_FRACTION)
            self._figures = {
                "max_tokens_per_step": tokens,
                "tokens_per_step_max_observed": model.tokens_seen_max,
                "readiness": rank_readiness(track, _CONFIG).verdict,
            }
        return self._figures

    def summary(self) -> dict[str, Any]:
        return {**self._track.engine.summary(), **self.figures()}


__all__ = ["REFIT_EVERY", "DecisionEngine"]
