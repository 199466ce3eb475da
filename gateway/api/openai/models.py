"""GET /v1/models and GET /v1/models/{model_id}: the models a key may use, generation and
embedding alike, each with what the caller's account pays for it now."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from billing.keys.store import Principal
from billing.prices.book import EffectivePrice
from engines.base import Engine
from gateway.http.errors import NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import authenticate


def _model_card(engine: Engine, price: EffectivePrice | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": engine.owned_by}
    if price is not None:
        # What the caller's account pays now (its overrides applied), exact decimal strings.
        card["pricing"] = {
            "input_per_million": format(price.input_per_million, "f"),
            "output_per_million": format(price.output_per_million, "f"),
            "currency": price.currency,
        }
    return card


async def _priced_card(request: Request, principal: Principal, engine: Engine) -> dict[str, Any]:
    return _model_card(engine, await request.app.state.prices.current_for(principal.account_id, engine.model_id))


async def _embedding_card(request: Request, principal: Principal, model: Any) -> dict[str, Any]:
    """An embedding model's card: its vectors' size once it has loaded (`dimensions`)."""
    card = await _priced_card(request, principal, model)
    card["type"] = "embedding"
    if model.dimensions:
        card["dimensions"] = model.dimensions
    return card


def _embedding_models(request: Request) -> dict[str, Any]:
    service = request.app.state.embeddings
    return service.models if service is not None else {}


def usable_engines(request: Request, principal: Principal) -> list[Engine]:
    """The generation models the key may use, each once (an alias resolves to the same engine under
    another name), for both APIs' model lists."""
    engines: dict[str, Engine] = request.app.state.service.engines
    return [e for mid, e in engines.items() if mid == e.model_id and principal.may_use(mid)]


async def list_models(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    data = [await _priced_card(request, principal, e) for e in usable_engines(request, principal)]
    data += [await _embedding_card(request, principal, m) for mid, m in _embedding_models(request).items() if principal.may_use(mid)]
    return json_response({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    model_id = request.path_params["model_id"]
    engine = request.app.state.service.engines.get(model_id)
    if engine is not None and (principal.may_use(model_id) or principal.may_use(engine.model_id)):
        return json_response(await _priced_card(request, principal, engine))
    embedding = _embedding_models(request).get(model_id)
    if embedding is not None and principal.may_use(model_id):
        return json_response(await _embedding_card(request, principal, embedding))
    raise NotFound(f"The model {model_id!r} does not exist.", param="model", code="model_not_found")

