"""Response classes shared by the routers."""

from __future__ import annotations

import math
from typing import Any

import orjson
from fastapi.responses import Response

from vramwatch.errors import VramwatchError


class JSONBytes(Response):
    """JSON via orjson: the API returns large numeric arrays (series, heatmaps)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def json_error(status: int, detail: str, **extra: Any) -> Response:
    return JSONBytes({"detail": detail, **extra}, status_code=status)


async def validation_error(request: Any, exc: Any) -> Response:
    """FastAPI's 422 for a request that failed validation (the same ``detail`` list, each entry
    naming its field in ``loc``) for any input it echoes back: ``{"rank": 1e309}`` parses to
    inf and ``NaN`` to nan, which the JSON encoder refused (the 422 became a 500), and a body
    that is not UTF-8 made the encoder raise. Non-finite numbers are echoed as null, bytes
    with replacement characters; integers of any size stay exact (stdlib JSON, not orjson)."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    return JSONResponse({"detail": jsonable_encoder(_echoable(exc.errors()))}, status_code=422)


def _echoable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _echoable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_echoable(v) for v in value]
    return value


async def refusal(request: Any, exc: VramwatchError) -> Response:
    """Any error vramwatch raises on purpose that a route did not answer itself: its status
    (:class:`vramwatch.errors.VramwatchError`) and its one line as ``detail``; a store that cannot
    be used asks the client to retry."""
    status = exc.status if isinstance(exc.status, int) else 502
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONBytes({"detail": str(exc)}, status_code=status, headers=headers)


def install_error_handlers(app: Any) -> None:
    """The error renderers every vramwatch app (collector, front) shares: the API maps errors once."""
    from fastapi.exceptions import RequestValidationError

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(VramwatchError, refusal)
