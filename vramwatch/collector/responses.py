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
