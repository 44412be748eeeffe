"""Typed outcomes of one export: what the processor counts and how it reacts.

An exporter never raises and never makes the caller match message text: it returns an
:class:`ExportResult` whose :class:`ExportOutcome` says what happened to the samples and whose
:class:`ExportFailure` (when something went wrong) says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class ExportOutcome(enum.Enum):
    SUCCESS = "success"  # handled: delivered, or some rejected for good (counted)
    RETRY = "retry"  # not delivered, worth retrying later: keep them (spool) and back off
    DROPPED = "dropped"  # refused for good: counted and dropped, never retried


class ExportFailure(enum.Enum):
    NETWORK = "network"  # refused, reset, timeout, DNS
    SERVER = "server"  # 5xx, 408, 425, 429: the collector is busy or down
    AUTH = "auth"  # 401/403: wrong or missing VRAMWATCH_TOKEN
    REDIRECT = "redirect"  # 3xx: the URL points somewhere else; never followed with a body
    TOO_LARGE = "too_large"  # 413 even for one sample: the collector's limit is misconfigured
    INVALID = "invalid"  # 422: some samples invalid
    REFUSED = "refused"  # another 4xx
    REPLY_TOO_LARGE = "reply_too_large"  # the reply exceeded what the protocol needs
    WRITE = "write"  # a local file could not be written


@dataclass(frozen=True)
class Directive:
    """One instruction from the collector's reply (e.g. a future ``snapshot``); unknown ones are kept, not run."""

    type: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExportResult:
    outcome: ExportOutcome
    delivered: int = 0  # samples the collector took (accepted + duplicates)
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0  # dropped for good by the collector (422 invalid, other 4xx)
    posts: int = 0  # requests made
    failures: int = 0  # requests that failed
    failure: ExportFailure | None = None
    status: int | None = None  # HTTP status of the last failing response
    detail: str = ""
    retry: list[bytes] = field(default_factory=list)  # lines to keep (ExportOutcome.RETRY), oldest first
    replayed: int = 0  # of delivered: from the spool
    spooled: int = 0  # lines written to the spool during this export
    spool_dropped: int = 0  # lines the spool could not keep (cap or disk full)
    flush_interval_s: float | None = None  # the collector's hint
    directives: tuple[Directive, ...] = ()
    location: str | None = None  # a redirect's target (reported, never followed)

    def merge(self, other: ExportResult) -> None:
        """Fold a later request's result into this one (splits, replays)."""
        for name in ("delivered", "accepted", "duplicates", "rejected", "posts", "failures", "replayed",
                     "spooled", "spool_dropped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.failure is not None:
            self.failure, self.status, self.detail = other.failure, other.status, other.detail
            self.location = other.location or self.location
        if other.flush_interval_s is not None:
            self.flush_interval_s = other.flush_interval_s
        self.directives += other.directives

    def describe(self) -> str:
        """One line for ``last_error`` (``HTTP 503: ...`` for HTTP failures)."""
        head = f"HTTP {self.status}" if self.status is not None else (self.failure.value if self.failure else "ok")
        return f"{head}: {self.detail}" if self.detail else head


__all__ = ["Directive", "ExportFailure", "ExportOutcome", "ExportResult"]
