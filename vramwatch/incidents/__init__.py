"""Incidents: the failures that ended a run's processes, grouped (one OOM that took the job down
and the restart of every rank is one incident), each with its cause derived from evidence, what
is still wrong at the end (open findings), and the next step with exact commands.

- ``findings.py``: typed findings; each holds the numbers its sentence states and renders it;
- ``track.py``: the per-process evidence, folded from a run's samples with one trend engine per
  rank (a restarted process judged against its rank's leak);
- ``derive.py``: grouping the run-life model's deaths into incidents (from the story alone: the
  ``/runs`` count) and naming their causes (with the evidence);
- ``nextsteps.py``: what to do, in order.

Layer: above ``decisions`` and ``engine`` (reads both and ``runlife``), below ``evidence`` (the
post-mortem renders it).
"""

from vramwatch.incidents.derive import Incident, Report, count, derive, group
from vramwatch.incidents.nextsteps import NextAction, next_steps
from vramwatch.incidents.track import Tracker

__all__ = ["Incident", "NextAction", "Report", "Tracker", "count", "derive", "group", "next_steps"]
