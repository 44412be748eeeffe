"""The callbacks' one call of ``Monitor.watch``: a framework hands over its model and optimizers."""

from __future__ import annotations

import warnings
from typing import Any

from vramwatch.hook import HookWarning, Monitor


def watch_quietly(monitor: Monitor | None, model: Any, optimizer: Any) -> None:
    """``monitor.watch(model, optimizer)``, warning instead of raising: a framework's unusual wrapper
    must not stop the training it observes (the categories are then missing, nothing else)."""
    if monitor is None or model is None:
        return
    try:
        monitor.watch(model, optimizer)
    except Exception as exc:
        warnings.warn(f"vramwatch: watch() could not count this model's memory by category "
                      f"({type(exc).__name__}: {exc}); the other numbers go on", HookWarning, stacklevel=2)
