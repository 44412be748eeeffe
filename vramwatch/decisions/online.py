"""The collector's per-series engine with the decision figures folded in online.

:class:`DecisionEngine` has the :class:`~vramwatch.engine.TrendEngine` public surface the
collector uses (``update``, ``summary()``, ``state``, ``events``, ``samples``) and adds,
per rank, a memory-model builder, the readiness bookkeeping and the rank's processes as trials
(:class:`~vramwatch.decisions.observe.RankTrack`). ``summary()`` gains:

* ``max_tokens_per_step``: largest settable tokens per step (on the grid of this rank's batches,
  :func:`.evidence.infer_grid`) that keeps the default margin
  (:data:`vramwatch.verdicts.LOW_HEADROOM_FRACTION`) at the worst phase, below any batch at
  which this rank ran out of memory for a reason of the batch; None when unknown;
* ``tokens_per_step_max_observed``: largest tokens per step seen;
* ``readiness``: ``ready`` / ``not_ready`` / ``unsafe`` with the default thresholds.

``view(config)`` hands the advice route a frozen copy of the rank (:mod:`.views`): the collector's
``/advice`` decides on the tracks it already holds instead of replaying the store.

Locking is the owner's: the collector's live state updates and copies its engines under its own
lock (:class:`vramwatch.collector.state.live.LiveState`), so this class takes none.

Cost: per sample, the engine's update plus O(1); the model is refitted (O(buckets²), under a
millisecond) only when a bucket maximum changed and at most once per :data:`REFIT_EVERY` samples;
the other figures are re-judged every :data:`RECHECK_EVERY` samples or on an OOM, so a scrape
mostly reads cached figures.
"""

from __future__ import annotations

from typing import Any

from vramwatch.decisions.model import RankModelBuilder, TransientFit
from vramwatch.decisions.observe import RankTrack
from vramwatch.decisions.proven import infer_grid
from vramwatch.decisions.readiness import ReadinessConfig, rank_readiness
from vramwatch.decisions.reasons import BATCH_CAUSES
from vramwatch.decisions.views import RankView, raw_view
from vramwatch.engine import TrendEngine
from vramwatch.verdicts import LOW_HEADROOM_FRACTION

#: Samples between refits of the transient (only when a bucket maximum changed).
REFIT_EVERY = 256
#: Samples between re-judging readiness and the largest batch on the cached fit.
RECHECK_EVERY = 32

_CONFIG = ReadinessConfig()
#: The figures before the first judgement (shared: figures are replaced, never mutated).
_UNJUDGED: dict[str, Any] = {"max_tokens_per_step": None, "tokens_per_step_max_observed": None, "readiness": None}


class DecisionEngine:
    """A TrendEngine plus the decision figures; a drop-in ``engine_factory`` for ``LiveState``."""

    __slots__ = ("_checked_at", "_figures", "_fit", "_fit_version", "_fitted_at", "_ooms_seen", "_track")

    def __init__(self, engine: TrendEngine | None = None) -> None:
        # the live figures never read the median step time: no step-time ring (2 KB per series)
        self._track = RankTrack("", "", 0, engine=engine or TrendEngine(), builder=RankModelBuilder(timing=False))
        self._fit: TransientFit | None = None
        self._fit_version = -1
        self._fitted_at = 0
        self._checked_at = -RECHECK_EVERY
        self._ooms_seen = 0
        self._figures = _UNJUDGED

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

    def update(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        """Engine update plus O(1) bookkeeping; returns the engine's new events. The caller holds
        whatever lock guards this engine against a concurrent :meth:`view`."""
        track = self._track
        if not track.run:  # one engine per series: its identity is the first sample's (a run is never "")
            track.run, track.host, track.rank = sample["run"], sample["host"], sample["rank"]
        return track.update(sample)

    def view(self, config: ReadinessConfig) -> RankView:
        """A frozen copy of the rank, its fit left to :func:`.views.fitted` (outside):
        O(buckets + processes + phases). Call it under the lock :meth:`update` is called under."""
        return raw_view(self._track, config, timing=False)

    def figures(self) -> dict[str, Any]:
        """The decision figures, O(1) amortised per call.

        Recomputed when :data:`RECHECK_EVERY` samples arrived or an OOM was counted since
        the last time (cheap: the cached fit, the current floor); the transient fit itself is
        redone only when a bucket maximum changed and :data:`REFIT_EVERY` samples arrived.
        """
        track = self._track
        builder = track.builder
        if builder.samples - self._checked_at < RECHECK_EVERY and track.ooms == self._ooms_seen:
            return self._figures
        self._checked_at, self._ooms_seen = builder.samples, track.ooms
        if self._fit is None or (builder.version != self._fit_version
                                 and builder.samples - self._fitted_at >= REFIT_EVERY):
            self._fit, self._fit_version, self._fitted_at = builder.fit(), builder.version, builder.samples
        model = builder.model(self._fit, timing=False)
        tokens, _ = model.max_tokens(LOW_HEADROOM_FRACTION)
        trials = track.trials()
        ceiling = min((t.oom.tokens for t in trials
                       if t.oom is not None and t.oom.cause in BATCH_CAUSES and t.oom.tokens), default=None)
        if ceiling is not None and (tokens is None or tokens >= ceiling):
            tokens = ceiling - 1  # what ran out of memory bounds what the model says
        if tokens:  # a batch a person can set: on this rank's grid (the advice's, from its trials alone)
            tokens = infer_grid(trials, trials).settable(tokens)
        self._figures = {
            "max_tokens_per_step": tokens,
            "tokens_per_step_max_observed": model.tokens_seen_max,
            "readiness": rank_readiness(track, _CONFIG).verdict,
        }
        return self._figures

    def summary(self) -> dict[str, Any]:
        return {**self._track.engine.summary(), **self.figures()}


__all__ = ["RECHECK_EVERY", "REFIT_EVERY", "DecisionEngine"]
