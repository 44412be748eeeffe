"""The hook's configuration: one object, one table of ``VRAMWATCH_*`` environment variables.

:class:`Config` holds every setting of a rank's monitor. :meth:`Config.from_env` reads the
environment once (arguments win over the environment); :func:`vramwatch.init` is the
convenience that does ``Monitor(Config.from_env(**kwargs))``. :data:`ENV` lists every
``VRAMWATCH_*`` variable the project reads -- the hook's and the collector's -- and is
the source of the table in the README (``tests/hook/test_hook.py`` checks they agree and that no
module under ``vramwatch/`` reads a variable missing from it).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import SplitResult, urlsplit

#: what the torch probe does with the allocator's peak counter after each read
PEAK_POLICIES = ("reset", "never")


def collector_url(url: str) -> SplitResult:
    """``url`` (``http(s)://host[:port][/prefix]``; a bare ``host:port`` means http) split, or a
    ValueError naming it: checked when the configuration is read, so a bad URL stops the run
    before training starts rather than at the first flush."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ValueError(f"url: must be http(s)://host[:port][/prefix], got {url!r}")
    return parts


class EnvVar(NamedTuple):
    name: str
    side: str  # "hook" or "collector"
    field: str | None  # the Config field it fills (hook side)
    meaning: str


ENV: tuple[EnvVar, ...] = (
    EnvVar("VRAMWATCH_URL", "hook", "url", "collector URL; unset: JSONL trace files under VRAMWATCH_DIR"),
    EnvVar("VRAMWATCH_TOKEN", "both", "token",
           "bearer token (hook: sent on ingest; collector: required on ingest); surrounding spaces are stripped"),
    EnvVar("VRAMWATCH_RUN", "hook", "run", "run name (default: from torchrun/SLURM, else host-time-pid)"),
    EnvVar("VRAMWATCH_HOST", "hook", "host", "host name in samples (default: SLURMD_NODENAME, else the hostname)"),
    EnvVar("VRAMWATCH_PROBE", "hook", "probe", "auto | torch | simulated | none (default auto)"),
    EnvVar("VRAMWATCH_DIR", "hook", "out_dir", "trace directory without a URL (default ./vramwatch-traces)"),
    EnvVar("VRAMWATCH_SPOOL_DIR", "hook", "spool_dir",
           "spool for undelivered samples (default $XDG_CACHE_HOME/vramwatch/spool)"),
    EnvVar("VRAMWATCH_DISABLE", "hook", "enabled", "1/true/yes: the hook is a no-op"),
    EnvVar("VRAMWATCH_EXIT_TIMEOUT", "hook", "exit_timeout_s",
           "seconds the exit handler may spend flushing (default 5)"),
    EnvVar("VRAMWATCH_SIM_SCENARIO", "hook", "sim_scenario", "simulated probe: scenario name (overrides scenario=)"),
    EnvVar("VRAMWATCH_SIM_SEED", "hook", "sim_seed", "simulated probe: random seed"),
    EnvVar("VRAMWATCH_SNAPSHOTS", "hook", "snapshots",
           "0/false/no/off: ignore the collector's capture directives and register no OOM observer (default on)"),
    EnvVar("VRAMWATCH_DB", "collector", None, "collector database file (vramwatch serve --db)"),
)

_TRUE = ("1", "true", "yes", "on")


def _text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    text = _text(env, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: must be a number, got {text!r}") from None
    if not 0 <= value < math.inf:  # inf: an exit handler that never gives up on a dead collector
        raise ValueError(f"{name}: must be a finite number >= 0, got {text!r}")
    return value


@dataclass(frozen=True)
class Config:
    """Everything a :class:`~vramwatch.hook.Monitor` needs. Build it with :meth:`from_env`."""

    url: str | None = None
    token: str | None = None
    run: str | None = None
    host: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    probe: Any = "auto"  # a name in PROBE_NAMES or a Probe instance
    device: int | None = None
    peak: str = "reset"
    scenario: str | None = None
    sim_scenario: str | None = None
    sim_seed: int | None = None
    nvml_interval_s: float = 1.0
    host_interval_s: float = 1.0  # host memory (RSS, MemAvailable, pinned) poll interval
    flush_interval_s: float = 1.0  # the longest a sample waits before a POST (adaptive below it)
    batch_size: int = 512
    max_queue: int = 8192
    backoff_max_s: float = 30.0
    out_dir: Path | None = None
    spool_dir: Path | None = None
    max_spool_bytes: int = 512 * 1024 * 1024  # per rank, across restarts (adopted spools count)
    exit_timeout_s: float = 5.0
    enabled: bool = True
    # a delivery.SharedWorker: one thread drives the senders of many monitors in this process
    # (load generators simulating many ranks); None: the monitor's sender owns its thread
    delivery_worker: Any = None
    # allocator snapshots the collector asks for (docs/evidence.md); CUDA + a collector URL only
    snapshots: bool = True
    snapshot_max_entries: int = 20_000  # allocator history entries kept while capturing

    def __post_init__(self) -> None:
        if self.peak not in PEAK_POLICIES:
            raise ValueError(f"peak: must be one of {', '.join(PEAK_POLICIES)}, got {self.peak!r}")
        for name in ("flush_interval_s", "nvml_interval_s", "host_interval_s", "backoff_max_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name}: must be a positive finite number, got {getattr(self, name)!r}")
        if not 0 <= self.exit_timeout_s < math.inf:  # inf: a process that never exits while a collector is down
            raise ValueError(f"exit_timeout_s: must be a finite number >= 0, got {self.exit_timeout_s!r}")
        for name in ("batch_size", "max_queue", "max_spool_bytes", "snapshot_max_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /, **kwargs: Any) -> Config:
        """Keyword arguments win; unset ones come from the ``VRAMWATCH_*`` variables of :data:`ENV`.

        Raises ``ValueError`` naming the argument or variable when a value is wrong.
        """
        env = os.environ if env is None else env
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unexpected argument(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {k: v for k, v in kwargs.items() if v is not None}
        url_from_env = "url" not in values
        values.setdefault("url", _text(env, "VRAMWATCH_URL"))
        if values["url"]:
            try:
                collector_url(values["url"])  # parse now: a bad URL stops the run before training starts
            except ValueError as exc:
                raise ValueError("VRAMWATCH_URL" + str(exc)[3:] if url_from_env else str(exc)) from None
        token = values.get("token")
        values["token"] = token.strip() or None if isinstance(token, str) else _text(env, "VRAMWATCH_TOKEN")
        values.setdefault("run", _text(env, "VRAMWATCH_RUN"))
        values.setdefault("host", _text(env, "VRAMWATCH_HOST"))
        values.setdefault("probe", (_text(env, "VRAMWATCH_PROBE") or "auto").lower())
        for field, name in (("out_dir", "VRAMWATCH_DIR"), ("spool_dir", "VRAMWATCH_SPOOL_DIR")):
            value = values.get(field) or _text(env, name)
            values[field] = Path(value) if value is not None else None
        if "enabled" not in values:
            values["enabled"] = (_text(env, "VRAMWATCH_DISABLE") or "").lower() not in _TRUE
        values.setdefault("exit_timeout_s", _float(env, "VRAMWATCH_EXIT_TIMEOUT", 5.0))
        if "snapshots" not in values:
            values["snapshots"] = (_text(env, "VRAMWATCH_SNAPSHOTS") or "1").lower() not in ("0", "false", "no", "off")
        values["sim_scenario"] = values.get("sim_scenario") or _text(env, "VRAMWATCH_SIM_SCENARIO")
        if "sim_seed" not in values and _text(env, "VRAMWATCH_SIM_SEED") is not None:
            try:
                values["sim_seed"] = int(_text(env, "VRAMWATCH_SIM_SEED") or "")
            except ValueError:
                raise ValueError(f"VRAMWATCH_SIM_SEED: must be an integer, got {env['VRAMWATCH_SIM_SEED']!r}") from None
        return cls(**values)

    def spool_root(self) -> Path:
        """Where this rank's spool files live (``spool_dir``, else the user's cache directory)."""
        if self.spool_dir is not None:
            return Path(self.spool_dir)
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(cache) / "vramwatch" / "spool"

    def trace_root(self) -> Path:
        return Path(self.out_dir) if self.out_dir is not None else Path("vramwatch-traces")


def client_env(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """``(VRAMWATCH_URL, VRAMWATCH_TOKEN)`` for command-line clients of a collector or front
    (``vramwatch capture``, ``postmortem --url``); surrounding spaces stripped, empty is None."""
    env = os.environ if env is None else env
    return _text(env, "VRAMWATCH_URL"), _text(env, "VRAMWATCH_TOKEN")


def env_table() -> str:
    """The Markdown table of :data:`ENV` (what the README shows)."""
    rows = ["| variable | read by | meaning |", "|---|---|---|"]
    rows += [f"| `{var.name}` | {var.side} | {var.meaning} |" for var in ENV]
    return "\n".join(rows)


__all__ = ["ENV", "Config", "EnvVar", "client_env", "env_table"]
