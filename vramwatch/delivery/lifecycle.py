"""One exit registry for everything that must flush when the process ends (monitors and
their processors), and per-instance fork handling.

``atexit`` runs :func:`close_all` once: the newest registrations close first (a monitor
registered after its processor closes it itself), all within one shared deadline
(``VRAMWATCH_EXIT_TIMEOUT``, :class:`vramwatch.config.Config`). Objects are held weakly.

:func:`on_fork_in_child` registers ``obj.method`` with ``os.register_at_fork`` through a weak
reference, as OpenTelemetry's BatchProcessor does: each instance resets itself in a forked
child; a collected instance costs nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Any, Protocol


class Closable(Protocol):
    def close(self, timeout: float = 5.0) -> bool: ...


_registry: list[weakref.ref[Any]] = []


def register(obj: Closable) -> None:
    """Close ``obj`` at exit (in this process only; forked children never inherit the duty)."""
    _registry.append(weakref.ref(obj))
    if len(_registry) > 64:
        _registry[:] = [ref for ref in _registry if ref() is not None]


def unregister(obj: Closable) -> None:
    _registry[:] = [ref for ref in _registry if ref() is not None and ref() is not obj]


def on_fork_in_child(obj: Any, method: str) -> None:
    ref = weakref.WeakMethod(getattr(obj, method))

    def reinit() -> None:
        bound = ref()
        if bound is not None:
            try:
                bound()
            except Exception:
                pass  # a child must start whatever happens

    os.register_at_fork(after_in_child=reinit)


def _forget_in_child() -> None:
    _registry.clear()


def dying_of_an_exception() -> bool:
    """True at exit after an unhandled exception (the interpreter set ``sys.last_value``): the
    process is not ending cleanly, so a monitor closed now must not mark its end as ``exit``."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def close_all(timeout: float | None = None) -> None:
    if timeout is None:
        from vramwatch.config import Config

        try:
            timeout = Config.from_env().exit_timeout_s
        except ValueError:
            timeout = 5.0
    deadline = time.monotonic() + timeout
    for ref in reversed(list(_registry)):
        obj = ref()
        if obj is None:
            continue
        try:
            obj.close(max(0.1, deadline - time.monotonic()))
        except Exception:
            pass  # the exit of a training process must not fail because of telemetry
    _registry.clear()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(close_all)

__all__ = ["close_all", "dying_of_an_exception", "on_fork_in_child", "register", "unregister"]
