"""The one JSON response of the gateway: orjson-encoded (exact Decimals as strings where the
caller made them so), `application/json`, with the headers given."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(payload: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json", headers=headers)
