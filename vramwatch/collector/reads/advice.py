"""Decision routes: ``GET /api/v1/runs/{run}/advice``, ``GET /api/v1/runs/{run}/figures`` and
``GET /api/v1/compare?a=&b=``.

The advice reads the tracks the collector already holds: every live series' engine is a
:class:`~vramwatch.decisions.online.DecisionEngine` that has folded the run in as it arrived, so an
answer costs a copy of each rank (:meth:`LiveState.views`, under the collector's lock) and a fit per
rank (O(ranks x buckets²)), not a replay. An evicted run is revived by the live state (from the
store, kept for the next request). Figures and compare replay the run
(their step-time medians are not kept live). Answers are cached per run and parameters, keyed by
the run's sample count in the live state, so a dashboard polling an unchanged run costs a dict
lookup; any new sample invalidates. All three are heavy reads (:mod:`~vramwatch.collector.reads.heavy`:
a few at once, in threads of their own, a 503 past the queue).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request

from vramwatch.collector.reads.heavy import heavy
from vramwatch.collector.state.live import LiveState
from vramwatch.decisions import MAX_CHECKPOINTS, MAX_PLATEAU_STEPS
from vramwatch.decisions.advice import decide
from vramwatch.decisions.compare import compare as compare_runs
from vramwatch.decisions.figures import RunFigures
from vramwatch.decisions.grid import OffGrid
from vramwatch.decisions.observe import RunObservation, observe
from vramwatch.decisions.readiness import ReadinessConfig
from vramwatch.decisions.views import RunView, fitted, judge
from vramwatch.verdicts import LOW_HEADROOM_FRACTION
from vramwatch.wire import Sample

router = APIRouter()

_CACHE_SIZE = 32
_cache: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
_lock = threading.Lock()

Margin = Annotated[float, Query(ge=0.0, lt=1.0, allow_inf_nan=False)]
Tokens = Annotated[int | None, Query(ge=1, le=2**53)]
Steps = Annotated[int, Query(ge=0, le=MAX_PLATEAU_STEPS)]


def _version(request: Request, run: str, field: str = "run") -> int:
    live = request.app.state.live
    # a finished run evicted from live state is rebuilt from the store (collector/state/live.py)
    states = live.for_run(run) or live.revived(run, request.app.state.store.iter_samples)
    if not states:
        raise HTTPException(404, f"{field}: no run named {run!r}")
    return sum(s.samples for s in states)


def live_view(live: LiveState, run: str, config: ReadinessConfig,
              replay: Callable[[str], Iterable[Sample]] | None = None) -> RunView | None:
    """The run as the decisions read it, from the live series' engines (None: no such run); how
    each process ended is the collector's own run-life folds (vramwatch.runlife).
    O(ranks x (buckets² + processes)), each rank held only while it is copied."""
    views, lives, samples = live.views(run, config, replay)
    if not views:
        return None
    return judge(run, [fitted(v) for v in views], samples, lives)


def run_view_of(request: Request, run: str, config: ReadinessConfig, field: str = "run") -> RunView:
    """The run from the live tracks (an evicted run revived from the store); 404 when unknown."""
    view = live_view(request.app.state.live, run, config, request.app.state.store.iter_samples)
    if view is None:
        raise HTTPException(404, f"{field}: no run named {run!r}")
    return view


def _observe(request: Request, run: str) -> RunObservation:
    runs = observe(request.app.state.store.iter_samples(run))
    if run not in runs:
        raise HTTPException(404, f"run: no samples stored for {run!r}")
    return runs[run]


def _cached(key: tuple[Any, ...], build: Any) -> dict[str, Any]:
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    doc = build()
    with _lock:
        _cache[key] = doc
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return doc


@router.get("/api/v1/runs/{run:path}/advice")
async def advice(
    request: Request,
    run: str,
    margin: Margin = LOW_HEADROOM_FRACTION,
    target_tokens: Tokens = None,
    plateau_steps: Steps = 2000,
    checkpoints: Annotated[int, Query(ge=0, le=MAX_CHECKPOINTS)] = 1,
    reference: Annotated[list[str] | None, Query(max_length=8)] = None,
    granularity: Tokens = None,
    target_global_tokens: Tokens = None,
) -> dict[str, Any]:
    """Readiness, largest tokens per step that fit, a target's judgement and the next step.

    ``reference`` (repeatable): runs of the same job at other batch settings (their token fit,
    what they proved and where they ran out of memory). ``granularity``: settable batches are
    multiples of it (tokens per rank; default declared by the training loop, else inferred).
    ``target_global_tokens``: a target as the global batch (``target_tokens`` is per rank); one
    that is not on the grid is a 422 naming the grid. A heavy read (reads/heavy.py).
    """
    refs = tuple(reference or ())
    config = ReadinessConfig(plateau_steps=plateau_steps, checkpoints=checkpoints, margin=margin)

    def build() -> dict[str, Any]:
        versions = tuple(_version(request, r, "reference") for r in refs)
        key = ("advice", id(request.app), run, _version(request, run), margin, target_tokens, plateau_steps,
               checkpoints, refs, versions, granularity, target_global_tokens)
        try:
            return _cached(key, lambda: decide(
                run_view_of(request, run, config), [run_view_of(request, r, config, "reference") for r in refs],
                config=config, margin=margin, target_tokens=target_tokens, granularity=granularity,
                target_global_tokens=target_global_tokens).as_dict())
        except OffGrid as exc:
            field = "target_global_tokens" if target_global_tokens else "target_tokens"
            raise HTTPException(422, f"{field}: {exc}") from None

    return await heavy(request.app.state).run("advice", build)


@router.get("/api/v1/runs/{run:path}/figures")
async def figures(request: Request, run: str) -> dict[str, Any]:
    """Per rank what compare and the CI gate read (plateau, peaks per phase, worst headroom, step
    time): a front joins these from every collector holding part of a run, and ``vramwatch
    compare``/``gate --url`` compare runs from them. A heavy read (a replay of the run)."""
    def build() -> dict[str, Any]:
        key = ("figures", id(request.app), run, _version(request, run))
        return _cached(key, lambda: RunFigures.of(_observe(request, run)).as_dict())

    return await heavy(request.app.state).run("figures", build)


@router.get("/api/v1/compare")
async def compare(request: Request, a: Annotated[str, Query(min_length=1)], b: Annotated[str, Query(min_length=1)]
                  ) -> dict[str, Any]:
    """Two stored runs side by side per rank (plateau, peaks per phase, headroom, step time). A
    heavy read (a replay of both runs)."""
    def build() -> dict[str, Any]:
        key = ("compare", id(request.app), a, _version(request, a), b, _version(request, b))
        return _cached(key, lambda: compare_runs(_observe(request, a), _observe(request, b)).as_dict())

    return await heavy(request.app.state).run("compare", build)
