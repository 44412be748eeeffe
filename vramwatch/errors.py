"""The root of every error vramwatch raises on purpose, with what it means to a caller.

A refusal (bad input, a limit reached, a database that cannot be read, a peer that does not
answer) is a :class:`VramwatchError`: it carries the CLI's exit code (2: the user's input or
settings, 1: an outage or a failure to finish) and the HTTP status the API answers it with. The
CLI's ``main`` and the collector's API map it once, from these two numbers, instead of command by
command and route by route. A subclass keeps its standard base too (``ValueError``,
``RuntimeError``) so code that caught those goes on working. Nothing of vramwatch is imported here.
"""

from __future__ import annotations

#: the user's arguments, input or settings: one line on stderr
EXIT_USAGE = 2
#: an outage or a failure to finish (a collector down, an unclean shutdown)
EXIT_FAILURE = 1


class VramwatchError(Exception):
    """An error vramwatch raises on purpose; ``str(exc)`` is the one line a person reads, naming
    the input or the setting. ``exit_code`` for the CLI, ``status`` for the API."""

    exit_code: int = EXIT_USAGE
    status: int = 400


__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "VramwatchError"]
