"""What grew between two allocator snapshots, by the line of code that allocated it.

Input: two ``torch.cuda.memory._snapshot()`` documents (the ``Snapshot`` / ``Segment`` /
``Block`` / ``Frame`` TypedDicts in ``torch/cuda/memory.py``), loaded safely
(:mod:`vramwatch.evidence.safe_pickle`). Output: a :class:`SnapshotDiff`.

Rules
-----
* **Live** blocks are ``active_allocated`` and the blocks waiting for another stream before
  they become free (``active_awaiting_free`` in torch's docstring, ``active_pending_free`` in
  what its C++ actually writes: both count). ``inactive`` blocks are the allocator's cache:
  their change is reported apart (:attr:`SnapshotDiff.cached`) and never counted as growth.
* A block's **allocation site** is the first of its frames (innermost first) that is not in
  torch, vramwatch, the standard library or native code (:data:`DEFAULT_SKIP`; more patterns,
  e.g. a framework's, through ``skip``). When every frame is skipped the outermost one is the
  site (the frame nearest the user's code). A block without frames was allocated while
  allocator history was not recording: it counts in :attr:`SnapshotDiff.untraced`, never as a
  site.
* Per site: bytes (the blocks' ``size``, what the allocator holds for them) and blocks in each
  snapshot and their change. Sites are keyed by (file, line, function), never by address, so
  blocks freed and allocated again at a stable site (churn) net to the site's true change.
* Order: by growth in bytes, then in blocks, then by file and line (deterministic).

Cost: one pass over each snapshot's blocks; per block, frames are read until the site (each
file name is classified once and cached). Bounds: at most :data:`MAX_BLOCKS` blocks per
snapshot and :data:`MAX_FRAMES` frames read per block; a snapshot of the wrong shape is a
:class:`SnapshotFormatError` naming the place (``segments[3].blocks[2].size``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramwatch.errors import VramwatchError
from vramwatch.evidence.patterns import PatternError, compile_glob

LIVE_STATES = frozenset({"active_allocated", "active_awaiting_free", "active_pending_free"})
CACHED_STATE = "inactive"
MAX_BLOCKS = 2_000_000
MAX_FRAMES = 256
#: work units (blocks read + frames read) one diff may spend on both snapshots: memo-shared
#: frame lists make a small pickle describe far more frames than it holds (a real 20,000-block
#: pair spends about 0.3 M)
MAX_WORK = 40_000_000
#: seconds one diff may take (checked every few thousand blocks)
DEADLINE_S = 20.0
#: characters of a file or function name kept (a longer name is cut: the site and its stack)
MAX_NAME_CHARS = 4096
#: largest block size and line number read (a larger one is a format error, never arithmetic)
MAX_BLOCK_BYTES = 2**64
MAX_LINE = 2**31
#: frames kept per site for the report (innermost first)
STACK_FRAMES = 24


def _own_package_pattern() -> str:
    """vramwatch's own modules and subpackages, by name (so a checkout folder that happens to be
    called ``vramwatch`` does not hide the user's scripts in it)."""
    root = Path(__file__).resolve().parents[1]
    names = sorted({p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir()
                                                          if (p / "__init__.py").is_file()})
    return r"(?:^|/)vramwatch/(?:" + "|".join(re.escape(n) for n in names) + r")(?:\.py$|/)"


#: Frames that are never an allocation site (regular expressions, searched in the file name
#: with ``\\`` read as ``/``): torch and its generated code, vramwatch, the standard library,
#: native (C/C++) frames of ``stacks="all"``.
DEFAULT_SKIP: tuple[str, ...] = (
    r"(?:^|/)(?:torch|functorch|torchgen)/",
    r"(?:^|/)torchinductor_[^/]*/",  # torch.compile's generated kernels (the call site is the user's)
    r"(?:^|/)(?:site|dist)-packages/triton/",
    _own_package_pattern(),
    r"(?:^|/)lib/python3(?:\.\d+)?/(?!site-packages/|dist-packages/)",  # the standard library
    r"(?:^|/)Lib/(?!site-packages/)",
    r"^<frozen ",
    r"\.(?:c|cc|cpp|cxx|h|hpp|cu|cuh)$|\.so(?:\.\d+)*$|^\?\?$|^$",  # native frames
)


class SnapshotFormatError(VramwatchError, ValueError):
    """A snapshot that does not have torch's documented shape; the message names where."""

    status = 422


@dataclass(frozen=True)
class Site:
    """Where live memory was allocated: the first frame outside the skipped code."""

    file: str
    line: int
    function: str

    def text(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class SiteChange:
    site: Site
    bytes_old: int
    bytes_new: int
    blocks_old: int
    blocks_new: int
    #: the stack of the site's largest block (newest snapshot first), "file:line:function", innermost first
    stack: tuple[str, ...] = ()

    @property
    def bytes_delta(self) -> int:
        return self.bytes_new - self.bytes_old

    @property
    def blocks_delta(self) -> int:
        return self.blocks_new - self.blocks_old

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.site.file, "line": self.site.line, "function": self.site.function,
                "stack": list(self.stack), "bytes_old": self.bytes_old, "bytes_new": self.bytes_new,
                "bytes_delta": self.bytes_delta, "blocks_old": self.blocks_old, "blocks_new": self.blocks_new,
                "blocks_delta": self.blocks_delta}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SiteChange:
        return cls(Site(str(doc["file"]), int(doc["line"]), str(doc["function"])), int(doc["bytes_old"]),
                   int(doc["bytes_new"]), int(doc["blocks_old"]), int(doc["blocks_new"]),
                   tuple(str(f) for f in doc.get("stack", ())))


@dataclass(frozen=True)
class Amount:
    """Bytes and blocks of one kind (live, cached, untraced) in both snapshots."""

    bytes_old: int = 0
    bytes_new: int = 0
    blocks_old: int = 0
    blocks_new: int = 0

    @property
    def bytes_delta(self) -> int:
        return self.bytes_new - self.bytes_old

    @property
    def blocks_delta(self) -> int:
        return self.blocks_new - self.blocks_old

    def to_dict(self) -> dict[str, int]:
        return {"bytes_old": self.bytes_old, "bytes_new": self.bytes_new, "bytes_delta": self.bytes_delta,
                "blocks_old": self.blocks_old, "blocks_new": self.blocks_new, "blocks_delta": self.blocks_delta}

    @classmethod
    def from_dict(cls, doc: dict[str, Any] | None) -> Amount:
        doc = doc or {}
        return cls(*(int(doc.get(k, 0)) for k in ("bytes_old", "bytes_new", "blocks_old", "blocks_new")))


@dataclass(frozen=True)
class SnapshotDiff:
    #: every site with live memory in either snapshot, by growth (largest first), cut to ``top``
    sites: tuple[SiteChange, ...]
    #: sites before the cut
    sites_total: int
    live: Amount
    #: inactive blocks: the allocator's cache, never growth
    cached: Amount
    #: live blocks without frames (allocated while history was not recording)
    untraced: Amount
    skip: tuple[str, ...] = field(default=())

    def growing(self) -> list[SiteChange]:
        """The sites that hold more bytes than before (the leak suspects), largest first; more
        blocks in the same bytes is churn (other shapes), not growth."""
        return [s for s in self.sites if s.bytes_delta > 0]

    def to_dict(self) -> dict[str, Any]:
        return {"sites": [s.to_dict() for s in self.sites], "sites_total": self.sites_total,
                "live": self.live.to_dict(), "cached": self.cached.to_dict(), "untraced": self.untraced.to_dict(),
                "skip": list(self.skip)}


class SiteRule:
    """Which frames are skipped: :data:`DEFAULT_SKIP` (fixed regular expressions, linear on any
    name) plus ``extra`` reader patterns, which are globs matched in linear time
    (:mod:`vramwatch.evidence.patterns`; a bad one is a ValueError naming ``skip``). File names
    are classified once each (names longer than :data:`MAX_NAME_CHARS` are classified by their
    first characters)."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self.extra = tuple(extra)
        try:
            self._globs = tuple(compile_glob(p, what="skip") for p in self.extra)
        except PatternError as exc:
            raise ValueError(str(exc)) from None
        self._re = re.compile("|".join(f"(?:{p})" for p in DEFAULT_SKIP))
        self._cache: dict[str, bool] = {}

    def skipped(self, filename: str) -> bool:
        hit = self._cache.get(filename)
        if hit is None:
            name = filename[:MAX_NAME_CHARS].replace("\\", "/")
            hit = self._re.search(name) is not None or any(g.search(name) for g in self._globs)
            self._cache[filename] = hit
            if len(self._cache) > 1_000_000:  # bounded: a hostile snapshot's million names
                self._cache.clear()
        return hit


@dataclass
class _Tally:
    bytes: int = 0
    blocks: int = 0
    largest: int = -1
    frames: Any = None  # the largest block's frame list


@dataclass
class _Census:
    """One snapshot read: live bytes per site, cached and untraced totals."""

    sites: dict[SiteKey, _Tally] = field(default_factory=dict)
    live: list[int] = field(default_factory=lambda: [0, 0])
    cached: list[int] = field(default_factory=lambda: [0, 0])
    untraced: list[int] = field(default_factory=lambda: [0, 0])


def _where(what: str, path: str) -> SnapshotFormatError:
    return SnapshotFormatError(f"{path}: {what} (not torch.cuda.memory._snapshot() output)")


SiteKey = tuple[str, int, str]


class Work:
    """What one diff may still spend: :data:`MAX_WORK` units (a block read, a frame read) and a
    monotonic deadline; :class:`SnapshotFormatError` naming the bound when either is passed."""

    def __init__(self, units: int = MAX_WORK, deadline_s: float | None = DEADLINE_S) -> None:
        self.left = units
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise SnapshotFormatError(f"segments: reading the blocks' frames needs more than {MAX_WORK:,} "
                                      "work units (snapshot budget: work)")

    def check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise SnapshotFormatError("segments: the diff took longer than its deadline (snapshot budget: deadline)")


_NO_FRAMES: list[Any] = []


def _site_of(frames: Any, rule: SiteRule, where: tuple[int, int], work: Work) -> SiteKey | None:
    """(file, line, function) of the block's site; None when it has no frames."""
    path = "segments[{}].blocks[{}].frames".format(*where)
    if type(frames) is not list:
        raise _where("frames is not a list", path)
    last = None
    for i, frame in enumerate(frames):
        if i == MAX_FRAMES:
            break
        try:
            key = (frame["filename"], frame["line"], frame["name"])
        except (TypeError, KeyError):
            raise _where("a frame without filename, line and name", f"{path}[{i}]") from None
        if type(key[0]) is not str or type(key[1]) is not int or type(key[2]) is not str or \
                not 0 <= key[1] <= MAX_LINE:
            raise _where("a frame's filename/name is not text or its line not a line number", f"{path}[{i}]")
        if len(key[0]) > MAX_NAME_CHARS or len(key[2]) > MAX_NAME_CHARS:
            key = (key[0][:MAX_NAME_CHARS], key[1], key[2][:MAX_NAME_CHARS])
        if not rule.skipped(key[0]):
            work.spend(i + 1)
            return key
        last = key
    work.spend(min(len(frames), MAX_FRAMES) + 1)
    return last  # every frame read is torch's or vramwatch's: the one nearest the user (None: no frames)


def _bad_block(block: Any, path: str) -> SnapshotFormatError:
    """What is wrong with a block that failed the census's inline check."""
    if type(block) is not dict:
        return _where("a block is not a dict", path)
    size = block.get("size")
    if type(size) is int and type(block.get("state")) is str:
        return _where(f"a block size outside 0..2^64 ({str(size)[:40]})", f"{path}.size")
    return _where("a block without an integer size and a state", path)


def census(snapshot: dict[str, Any], rule: SiteRule, work: Work | None = None) -> _Census:
    """Live bytes and blocks per allocation site, and the cached and untraced totals, within
    ``work`` (a frame list shared by many blocks is read once)."""
    work = work or Work()
    segments = snapshot.get("segments") if isinstance(snapshot, dict) else None
    if type(segments) is not list:
        raise _where("no segments list", "segments")
    out = _Census()
    seen = 0
    shared: dict[int, SiteKey | None] = {}  # id(frames) -> site, while the snapshot holds the lists
    for si, segment in enumerate(segments):
        blocks = segment.get("blocks") if type(segment) is dict else None
        if type(blocks) is not list:
            raise _where("a segment without a blocks list", f"segments[{si}]")
        seen += len(blocks)
        if seen > MAX_BLOCKS:
            raise SnapshotFormatError(f"segments: more than {MAX_BLOCKS} blocks")
        work.check_time()
        for bi, block in enumerate(blocks):
            if not bi & 4095:
                work.check_time()
            try:
                size, state = block["size"], block["state"]
            except (TypeError, KeyError):
                raise _bad_block(block, f"segments[{si}].blocks[{bi}]") from None
            if type(block) is not dict or type(size) is not int or type(state) is not str or \
                    not 0 <= size <= MAX_BLOCK_BYTES:
                raise _bad_block(block, f"segments[{si}].blocks[{bi}]")
            if state not in LIVE_STATES:
                if state == CACHED_STATE:
                    out.cached[0] += size
                    out.cached[1] += 1
                continue
            out.live[0] += size
            out.live[1] += 1
            frames = block.get("frames", _NO_FRAMES)
            site = shared.get(id(frames), False)
            if site is False:
                site = shared[id(frames)] = _site_of(frames, rule, (si, bi), work)
            if site is None:
                out.untraced[0] += size
                out.untraced[1] += 1
                continue
            tally = out.sites.get(site)
            if tally is None:
                tally = out.sites[site] = _Tally()
            tally.bytes += size
            tally.blocks += 1
            if size > tally.largest:
                tally.largest, tally.frames = size, frames
    return out


def _stack(frames: Any) -> tuple[str, ...]:
    if not frames:
        return ()
    return tuple(f"{str(f['filename'])[:MAX_NAME_CHARS]}:{f['line']}:{str(f['name'])[:MAX_NAME_CHARS]}"
                 for f in frames[:STACK_FRAMES])


def _amount(old: list[int], new: list[int]) -> Amount:
    return Amount(old[0], new[0], old[1], new[1])


def diff(old: dict[str, Any], new: dict[str, Any], *, skip: Sequence[str] = (), top: int | None = None,
         deadline_s: float | None = DEADLINE_S) -> SnapshotDiff:
    """The per-site change from ``old`` to ``new`` (see the module docstring); ``top`` cuts the
    site list after sorting (``sites_total`` keeps the count before the cut). Both snapshots
    share one :class:`Work` budget (:data:`MAX_WORK` units, ``deadline_s``)."""
    rule = SiteRule(skip)
    work = Work(MAX_WORK, deadline_s)
    a, b = census(old, rule, work), census(new, rule, work)
    changes = []
    for site in a.sites.keys() | b.sites.keys():
        was, now = a.sites.get(site, _Tally()), b.sites.get(site, _Tally())
        frames = now.frames if now.frames is not None else was.frames
        changes.append(SiteChange(Site(*site), was.bytes, now.bytes, was.blocks, now.blocks, _stack(frames)))
    changes.sort(key=lambda c: (-c.bytes_delta, -c.blocks_delta, c.site.file, c.site.line, c.site.function))
    total = len(changes)
    if top is not None:
        changes = changes[: max(0, top)]
    return SnapshotDiff(tuple(changes), total, _amount(a.live, b.live), _amount(a.cached, b.cached),
                        _amount(a.untraced, b.untraced), rule.extra)


def _mib(n: int) -> str:
    return f"{n / 2**20:+,.1f} MiB" if n else "0"


def render_text(result: SnapshotDiff, *, old_name: str = "old", new_name: str = "new") -> str:
    """The table ``vramwatch snapshots diff`` prints."""
    lines = [f"live memory {old_name} → {new_name}: {result.live.bytes_old / 2**20:,.1f} → "
             f"{result.live.bytes_new / 2**20:,.1f} MiB ({_mib(result.live.bytes_delta)}, "
             f"{result.live.blocks_delta:+,} blocks)"]
    if result.sites:
        lines.append(f"{'bytes Δ':>14} {'blocks Δ':>9} {'bytes old':>12} {'bytes new':>12}  allocation site")
    for s in result.sites:
        lines.append(f"{_mib(s.bytes_delta):>14} {s.blocks_delta:>+9,} {s.bytes_old / 2**20:>10,.1f}Mi "
                     f"{s.bytes_new / 2**20:>10,.1f}Mi  {s.site.text()}")
    if result.sites_total > len(result.sites):
        lines.append(f"  … {result.sites_total - len(result.sites)} more sites (--top)")
    u, c = result.untraced, result.cached
    if u.blocks_old or u.blocks_new:
        lines.append(f"untraced (allocated while history was off): {_mib(u.bytes_delta)}, {u.blocks_delta:+,} blocks")
    lines.append(f"cached by the allocator (inactive, not growth): {_mib(c.bytes_delta)} "
                 f"({c.bytes_old / 2**20:,.1f} → {c.bytes_new / 2**20:,.1f} MiB)")
    return "\n".join(lines)


__all__ = ["CACHED_STATE", "DEFAULT_SKIP", "LIVE_STATES", "Amount", "Site", "SiteChange", "SiteRule",
           "SnapshotDiff", "SnapshotFormatError", "Work", "census", "diff", "render_text"]
