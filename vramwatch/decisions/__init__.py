"""Decisions on top of the verdicts: how many tokens fit, is this batch ready, did this change regress memory.

Flat modules, one concern each: :mod:`.model` (floor + transient memory model per rank),
:mod:`.observe` (one pass over a run from the database or trace files), :mod:`.readiness`,
:mod:`.advice`, :mod:`.compare`, :mod:`.gate`, :mod:`.scenarios` (simulator truth). See
docs/decisions.md.
"""

#: the largest readiness thresholds a caller may set (the API's bounds and the CLI's; here, not in
#: readiness.py, so the CLI's argument parser does not import the engine): a plateau of 2**53
#: steps already never holds; the checkpoint bound keeps a typo from reading as "never ready"
MAX_PLATEAU_STEPS = 2**53
MAX_CHECKPOINTS = 10_000
