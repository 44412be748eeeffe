"""Decisions on top of the verdicts: how many tokens fit, is this batch ready, did this change regress memory.

Flat modules, one concern each: :mod:`.model` (floor + transient memory model per rank),
:mod:`.observe` (one pass over a run from the database or trace files), :mod:`.readiness`,
:mod:`.advice`, :mod:`.compare`, :mod:`.gate`, :mod:`.scenarios` (simulator truth). See
docs/decisions.md.
"""
