"""Response classes shared by the routers."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response


class JSONBytes(Response):
    """JSON via orjson: the API returns large numeric arrays (series, heatmaps)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def json_error(status: int, detail: str, **extra: Any) -> Response:
    return JSONBytes({"detail": detail, **extra}, status_code=status)


async def validation_error(request: Any, exc: Any) -> Response:
    """FastAPI's 422 for a request that failed validation (same ``detail`` list, each entry
    naming its field in ``loc``), rendered by orjson: the input echoed back may be a float
    the stdlib encoder refuses (``{"rank": 1e309}`` parses to inf, ``NaN`` to nan), which
    turned the 422 into a 500. orjson writes them as null. A body that is not UTF-8 is echoed
    with replacement characters."""
    from fastapi.encoders import jsonable_encoder

    return JSONBytes({"detail": jsonable_encoder(_text_bytes(exc.errors()))}, status_code=422)


def _text_bytes(value: Any) -> Any:
    # jsonable_encoder decodes bytes as strict UTF-8 (a body of b"\xff" raised in the handler)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {k: _text_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_text_bytes(v) for v in value]
    return value


def install_error_handlers(app: Any) -> None:
    """The error renderers every vramwatch app (collector, front) shares."""
    from fastapi.exceptions import RequestValidationError

    app.add_exception_handler(RequestValidationError, validation_error)
