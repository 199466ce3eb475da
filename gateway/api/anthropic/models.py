"""GET /v1/models and GET /v1/models/{model_id} as Anthropic's Models API answers them, for a caller
that speaks it (`anthropic-version` or `x-api-key`, as Anthropic's SDKs and docs send): the
generation models a key may use as `ModelInfo` objects, paged by `after_id` / `before_id` /
`limit`. Embedding models are OpenAI's only."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engines.base import Engine
from gateway.api.anthropic.messages import _answered, api_key
from gateway.api.openai.models import usable_engines
from gateway.http.errors import InvalidRequest, NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import authenticate

RELEASED = "1970-01-01T00:00:00Z"  # the release date is unknown: Anthropic's ModelInfo then says the epoch
LIMIT_DEFAULT, LIMIT_MAX = 20, 1000


def _info(engine: Engine) -> dict[str, Any]:
    info: dict[str, Any] = {"type": "model", "id": engine.model_id, "display_name": engine.model_id, "created_at": RELEASED,
                            "lifecycle": "active"}
    if engine.context_length:
        info["max_input_tokens"] = engine.context_length
    return info


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return LIMIT_DEFAULT
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= LIMIT_MAX:  # "²" is a digit int() refuses
        raise InvalidRequest(f"limit: must be an integer from 1 to {LIMIT_MAX}", param="limit")
    return int(raw)


async def _list(request: Request, request_id: str) -> Response:
    principal = await authenticate(request, request.app.state.keys, api_key(request))
    models = [_info(e) for e in usable_engines(request, principal)]
    ids = [m["id"] for m in models]
    after, before, limit = request.query_params.get("after_id"), request.query_params.get("before_id"), _limit(request)
    if after is not None and before is not None:
        raise InvalidRequest("give at most one of after_id and before_id", param="before_id")
    for name, cursor in (("after_id", after), ("before_id", before)):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"{name}: no model {cursor!r}", param=name)
    if after is not None:
        page = models[ids.index(after) + 1:][:limit]
        more = ids.index(after) + 1 + limit < len(models)
    elif before is not None:
        start = max(0, ids.index(before) - limit)
        page, more = models[start:ids.index(before)], start > 0
    else:
        page, more = models[:limit], limit < len(models)
    return json_response({"data": page, "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
                          "has_more": more}, headers={"request-id": request_id})


async def _get(request: Request, request_id: str) -> Response:
    principal = await authenticate(request, request.app.state.keys, api_key(request))
    model_id = request.path_params["model_id"]
    engine = request.app.state.service.engines.get(model_id)
    if engine is None or not (principal.may_use(model_id) or principal.may_use(engine.model_id)):
        raise NotFound(f"model: {model_id}", param="model", code="model_not_found")
    return json_response(_info(engine), headers={"request-id": request_id})


async def list_models(request: Request) -> Any:
    return await _answered(request, _list)


async def get_model(request: Request) -> Any:
    return await _answered(request, _get)
