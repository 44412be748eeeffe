"""Routes for evidence: capture requests, snapshot upload/list/download/diff, leak suspects,
the foreign-process side channel, the post-mortem.

``make_router(ingest_auth, read_auth)`` takes the app's two auth dependencies, so this
module knows nothing about tokens. State it reads from ``app.state``: ``snapshots``
(:class:`SnapshotStore`), ``directives`` (:class:`DirectiveBoard`), ``diffs``
(:class:`~vramwatch.collector.snapshots.diffs.DiffCache`), ``processes``
(:class:`~vramwatch.collector.ingest.processes.ProcessBook`), ``live`` and ``store``.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import math
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from vramwatch.collector.ingest import processes as _processes
from vramwatch.collector.reads.heavy import heavy
from vramwatch.collector.snapshots.diffs import check_skip, enrich_postmortem, run_suspects
from vramwatch.collector.snapshots.directives import DEFAULT_STEPS, MAX_STEPS, SnapshotError, SnapshotStore
from vramwatch.evidence import postmortem as _postmortem
from vramwatch.wire import MAX_INT, MAX_NAME, series_key

_CHUNK = 1 << 20
#: seconds an upload waits for a slot (``max_concurrent_uploads``) before a 503
UPLOAD_QUEUE_S = 60.0
log = logging.getLogger("vramwatch.collector")


class CaptureRequest(BaseModel):
    """The capture body. Strict: ``true`` or ``"0"`` is not a rank, ``1.0`` not a step count,
    and an unknown key (``"step"`` for ``steps``) is refused rather than silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    rank: int | None = Field(None, ge=0, le=MAX_INT, description="one rank; all ranks of the run when omitted")
    host: str | None = Field(None, max_length=MAX_NAME)
    steps: int = Field(DEFAULT_STEPS, ge=1, le=MAX_STEPS, description="steps of allocator history to record")


def _name(field_name: str, value: str) -> str:
    if not value or len(value) > MAX_NAME or not value.isprintable():
        raise HTTPException(422, f"{field_name}: must be 1..{MAX_NAME} printable characters")
    return value


def _error(exc: SnapshotError) -> JSONResponse:
    return JSONResponse({"detail": str(exc), "field": exc.field}, status_code=exc.status)


def run_keys(request: Request) -> Callable[[str], list[tuple[str, str, int]]]:
    live = request.app.state.live
    return lambda run: [s.key for s in live.for_run(run)]


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON. A browser can send JSON cross-site only after a
    CORS preflight, which this collector never grants, so a cookie-authenticated capture
    request comes from the dashboard's own origin (or a client holding the token)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise HTTPException(415, f"content-type: must be application/json, got {ctype or 'none'!r}")


def make_router(ingest_auth: Callable[..., Any], read_auth: Callable[..., Any]) -> APIRouter:
    router = APIRouter()
    write = [Depends(ingest_auth)]
    read = [Depends(read_auth)]

    # read credentials (the dashboard's cookie) may ask for a capture: it only asks a rank to
    # record a few steps, one pending directive per rank and trigger, each rank at most once per
    # --capture-interval (DirectiveBoard.request_manual: 429 when every rank asked was too recent)
    @router.post("/api/v1/runs/{run:path}/capture", dependencies=[*read, Depends(require_json)])
    def capture(request: Request, run: str, body: CaptureRequest) -> dict[str, Any]:
        keys = [k for k in run_keys(request)(run)
                if (body.rank is None or k[2] == body.rank) and (body.host is None or k[1] == body.host)]
        if not keys:
            what = f"rank {body.rank} of run {run!r}" if body.rank is not None else f"run {run!r}"
            raise HTTPException(404, f"rank: no {what} is known to this collector")
        board = request.app.state.directives
        ids, wait = board.request_manual(keys, steps=body.steps)
        if not ids and wait:
            raise HTTPException(429, f"rank: captured less than {board.manual_interval_s:g} s ago "
                                     f"(--capture-interval); retry in {math.ceil(wait)} s",
                                headers={"Retry-After": str(math.ceil(wait))})
        return {"run": run, "directives": len(ids), "ranks": sorted({k[2] for k in keys})}

    router.post("/api/v1/snapshots", dependencies=write, status_code=201)(upload)

    @router.get("/api/v1/runs/{run:path}/snapshots", dependencies=read)
    def snapshots(request: Request, run: str) -> list[dict[str, Any]]:
        return [i.to_dict() for i in request.app.state.snapshots.list(run)]

    router.get("/api/v1/snapshots/{snapshot_id}", dependencies=read)(download)

    @router.get("/api/v1/runs/{run:path}/postmortem", dependencies=read)
    async def postmortem(request: Request, run: str,
                         silent_after_s: Annotated[float | None, Query(gt=0, le=86400)] = None) -> dict[str, Any]:
        state = request.app.state
        return await heavy(state).run("postmortem", lambda: postmortem_doc(state, run, silent_after_s))

    _add_diff_routes(router, read)
    _add_process_routes(router, write, read)
    return router


async def upload(
    request: Request,
    run: Annotated[str, Query(max_length=MAX_NAME)],
    host: Annotated[str, Query(max_length=MAX_NAME)],
    rank: Annotated[int, Query(ge=0, le=MAX_INT)],
    step: Annotated[int, Query(ge=0, le=MAX_INT)],
    trigger: Annotated[str, Query(max_length=64)] = "manual",
    directive: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """Streamed to a temporary file (never held whole), at most ``max_concurrent_uploads`` at
    once (others wait ``UPLOAD_QUEUE_S``, then 503), every disk write and the gzip check in a
    worker thread; a refusal stores nothing."""
    store: SnapshotStore = request.app.state.snapshots
    names = {"run": _name("run", run), "host": _name("host", host), "trigger": _name("trigger", trigger),
             "directive": None if directive is None else _name("directive", directive)}
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > store.max_snapshot_bytes:
        return _error(SnapshotError("body", f"larger than {store.max_snapshot_bytes} bytes (max_snapshot_bytes)",
                                    413))
    try:
        async with asyncio.timeout(UPLOAD_QUEUE_S):
            await store.upload_slots.acquire()
    except TimeoutError:
        return JSONResponse({"detail": f"busy: {store.max_concurrent_uploads} snapshot uploads at once "
                                       "(--max-concurrent-uploads); retry later", "field": "body"},
                            status_code=503, headers={"Retry-After": "30"})
    try:
        return await _receive(request, store, rank=rank, step=step, **names)
    finally:
        store.upload_slots.release()


def download(request: Request, snapshot_id: str) -> Response:
    try:
        info, path = request.app.state.snapshots.open(snapshot_id)
    except SnapshotError as exc:
        return _error(exc)
    opened = _gunzipped(path, snapshot_id)
    if opened is None:
        return _error(SnapshotError("id", f"snapshot {snapshot_id}: the stored file is not readable gzip data "
                                          "(damaged on disk); delete it", 409))
    fh, first = opened

    def stream() -> Iterator[bytes]:
        # gunzip while sending: memory_viz opens the plain pickle; memory stays O(chunk)
        try:
            chunk = first
            while chunk:
                yield chunk
                chunk = fh.read(_CHUNK)
        except (OSError, EOFError, zlib.error) as exc:  # damaged past its start: the body ends early
            log.warning("snapshot %s: stopped sending, the stored file is damaged: %s", snapshot_id, exc)
        finally:
            fh.close()

    name = f"{info.run}-rank{info.rank}-step{info.step}.pickle"
    return StreamingResponse(stream(), media_type="application/octet-stream",
                             headers={"Content-Disposition": content_disposition(name)})


async def _receive(request: Request, store: SnapshotStore, **fields: Any) -> Response:
    """One upload's body into the store, a block of up to :data:`_CHUNK` at a time."""
    upload = await asyncio.to_thread(store.begin)
    try:
        block: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            block.append(chunk)
            size += len(chunk)
            if size >= _CHUNK:
                await asyncio.to_thread(upload.write, b"".join(block))
                block, size = [], 0
        if block:
            await asyncio.to_thread(upload.write, b"".join(block))
        info = await asyncio.to_thread(upload.commit, **fields)
        request.app.state.directives.on_snapshot(info)  # a leak's first snapshot asks for its second
    except SnapshotError as exc:
        await asyncio.to_thread(upload.abort)
        return _error(exc)
    except ClientDisconnect:  # the uploader left mid-body: nobody to answer, nothing kept
        await asyncio.to_thread(upload.abort)
        return Response(status_code=400)
    except BaseException:
        await asyncio.to_thread(upload.abort)
        raise
    return JSONResponse(info.to_dict(), status_code=201)


def content_disposition(filename: str) -> str:
    """An attachment header any name can travel in: an ASCII fallback and the UTF-8 name in
    RFC 5987's ``filename*`` (a header value is Latin-1: a CJK run name was a 500)."""
    fallback = "".join(c if 32 <= ord(c) < 127 and c not in '"\\/' else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


def _gunzipped(path: Any, snapshot_id: str) -> tuple[Any, bytes] | None:
    """The stored file opened for inflating and its first block; None when it is not readable
    gzip (damaged on disk, or written by something else): checked before any byte is sent."""
    fh = None
    try:
        fh = gzip.open(path, "rb")  # noqa: SIM115 - closed by the caller's stream
        return fh, fh.read(_CHUNK)
    except (OSError, EOFError, zlib.error):
        if fh is not None:
            fh.close()
        log.warning("snapshot %s: the stored file is not readable gzip data", snapshot_id)
        return None


def postmortem_doc(state: Any, run: str, silent_after_s: float | None) -> dict[str, Any]:
    """The post-mortem of ``run`` (404 when the store has none): judged by the live state, so this
    answer and /runs, /ranks, /metrics tell one story (each rank's silence window from its cadence);
    a window asked for (``silent_after_s``) is a judgement of its own. Cost: one sequential read of
    the run's samples (two for a window asked for)."""
    store = state.store
    if run not in store.runs():
        raise HTTPException(404, f"run: no run {run!r}")
    live = state.live
    states = live.for_run(run) or live.revived(run, store.iter_samples)
    story = live.story(run, states, time.time()) if states and silent_after_s is None else None
    pm = _postmortem.build(run, lambda: store.iter_samples(run), now=time.time(), silent_after_s=silent_after_s,
                           story=story)
    return enrich_postmortem(pm, snapshots=state.snapshots, diffs=state.diffs, processes=state.processes,
                             live=live).to_dict()


def _add_diff_routes(router: APIRouter, read: list[Any]) -> None:
    @router.get("/api/v1/runs/{run:path}/snapshots/diff", dependencies=read)
    async def snapshot_diff(request: Request, run: str, old: Annotated[str, Query(max_length=64)],
                            new: Annotated[str, Query(max_length=64)], top: Annotated[int, Query(ge=1, le=1000)] = 50,
                            skip: Annotated[list[str] | None, Query()] = None) -> Response:
        """Live memory per allocation site in two of the run's snapshots, by growth (the
        ``vramwatch snapshots diff --json`` document, plus both snapshots and the steps between)."""
        state = request.app.state

        def build() -> Response:
            try:
                patterns = check_skip(skip or [])
                infos = {name: state.diffs.open(name, ident)[0] for name, ident in (("old", old), ("new", new))}
                for name, info in infos.items():
                    if info.run != run:
                        raise SnapshotError(name, f"snapshot {info.id} is not of run {run!r}", 404)
                result = state.diffs.diff(old, new, patterns)
            except SnapshotError as exc:
                return _error(exc)
            doc = {"run": run, "old": infos["old"].to_dict(), "new": infos["new"].to_dict(),
                   "steps": infos["new"].step - infos["old"].step, **result.to_dict()}
            doc["sites"] = doc["sites"][:top]
            return JSONResponse(doc)

        return await heavy(state).run("diff", build)

    @router.get("/api/v1/runs/{run:path}/suspects", dependencies=read)
    async def suspects(request: Request, run: str) -> list[dict[str, Any]]:
        """Each leaking rank's growing allocation sites between two of its snapshots."""
        state = request.app.state
        return await heavy(state).run("suspects", lambda: [
            s.to_dict() for s in run_suspects(state.diffs, state.live, run, state.snapshots.list(run))])


def _add_process_routes(router: APIRouter, write: list[Any], read: list[Any]) -> None:
    @router.post("/api/v1/processes", dependencies=[*write, Depends(require_json)])
    async def report_processes(request: Request) -> dict[str, Any]:
        """A rank's report of the other processes on its GPU (the hook's side channel)."""
        try:
            raw = await _bounded_body(request, _processes.MAX_BODY_BYTES)
            body = _processes.ReportBody.model_validate_json(raw or b"null")
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None
        report = body.report()
        if request.app.state.live.get(report.run, report.host, report.rank) is None:
            raise HTTPException(404, f"rank: no rank {report.rank} on {report.host!r} in run {report.run!r} "
                                "(send samples first)")
        request.app.state.processes.put(report)
        return {"processes": len(report.processes)}

    @router.get("/api/v1/runs/{run:path}/processes", dependencies=read)
    def processes(request: Request, run: str) -> list[dict[str, Any]]:
        """Per rank, the other processes on its GPU by name (ranks of the run left out)."""
        state = request.app.state
        pids = _processes.rank_pids(state.live, run)
        return [{**_processes.report_doc(_processes.foreign_only(r, pids)),
                 "received": state.processes.received(r.run, r.host, r.rank)} for r in state.processes.run(run)]


async def _bounded_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"body: larger than {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPException(400, "body: the client left before sending it") from None
    return b"".join(chunks)


def reply_directives(state: Any, samples: list[Any]) -> list[dict[str, Any]]:
    """Directives for the series in this ingest batch (empty almost always: one dict look-up each)."""
    board = getattr(state, "directives", None)
    if board is None or not board.pending():
        return []
    keys = {series_key(s) for s in samples}
    return [d.to_dict() for d in board.take(keys)]
