"""Importers: GPU-memory records other tools already write → schema-1 samples.

``vramwatch import --from FORMAT`` and ``vramwatch analyze --from FORMAT`` read these;
``vramwatch watch`` reuses the Prometheus conversion live. One module per format, each
a generator ``read(path, options, stats) -> Iterator[Sample]`` that streams its file and
yields validated, sparse samples (only what the source measured).

| format        | module          | what a sample gets                                          |
|---------------|-----------------|-------------------------------------------------------------|
| ``nvidia-smi``  | nvidia_smi.py   | nvml_used_bytes, total_bytes, uuid, gpu                     |
| ``tensorboard`` | tensorboard.py  | what the key table maps (allocated, reserved, ...)          |
| ``wandb``       | wandb.py        | nvml_used_bytes, total_bytes, gpu                           |
| ``prometheus``  | prometheus.py   | nvml_used_bytes, total_bytes, uuid, gpu (dcgm-exporter)     |
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Iterator

from vramwatch.importers import nvidia_smi, prometheus, tensorboard, wandb
from vramwatch.importers.common import (
    MAX_LINE_BYTES,
    MAX_RECORD_BYTES,
    ImportOptions,
    ImportStats,
    RowError,
    parse_size,
)
from vramwatch.wire import Sample

Reader = Callable[[str, ImportOptions, ImportStats], Iterator[Sample]]

#: ``--from`` names → readers. ``jsonl`` (vramwatch's own traces) is handled by the callers.
FORMATS: dict[str, Reader] = {
    "nvidia-smi": nvidia_smi.read,
    "tensorboard": tensorboard.read,
    "wandb": wandb.read,
    "prometheus": prometheus.read,
}
NATIVE = "jsonl"
CHOICES = (NATIVE, *FORMATS)


def iter_import(paths: Iterable[str | os.PathLike[str]], fmt: str, options: ImportOptions,
                stats: ImportStats | None = None) -> Iterator[Sample]:
    """Every sample of ``paths`` read as ``fmt``, file after file.

    Raises :class:`RowError` (a :class:`~vramwatch.wire.WireError`) naming file, line and
    column at the first bad row, unless ``options.skip_invalid``: then ``stats`` counts it.
    A file that cannot be read raises :class:`UnreadableInput` (an OSError) naming it.
    """
    reader = FORMATS[fmt]
    stats = stats if stats is not None else ImportStats()
    stats.skip_invalid = options.skip_invalid
    for path in paths:
        name = os.fspath(path)
        try:
            yield from reader(name, options, stats)
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
            # a file that cannot be read at all (truncated gzip, not UTF-8): say which one
            raise UnreadableInput(f"{name}: {exc}") from None


class UnreadableInput(OSError):
    """An input file that cannot be read (not a bad row: ``--skip-invalid`` cannot skip it)."""


def input_paths(paths: Iterable[str], fmt: str) -> list[str]:
    """Check the inputs exist; TensorBoard also takes log directories. Raises FileNotFoundError."""
    out = []
    for path in paths:
        if fmt == "tensorboard" and os.path.isdir(path):
            if not tensorboard.event_files(path):
                raise FileNotFoundError(f"{path}: no events.out.tfevents.* files under it")
            out.append(path)
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise FileNotFoundError(f"cannot read {path}: no such file")
    return out


__all__ = [
    "CHOICES", "FORMATS", "MAX_LINE_BYTES", "MAX_RECORD_BYTES", "NATIVE", "ImportOptions", "ImportStats", "RowError",
    "UnreadableInput", "input_paths", "iter_import", "parse_size",
]
