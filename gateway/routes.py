"""The routes: thin; each reads what it needs from `request.app.state` (a Services) and hands the
work to the service that owns it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.keys.store import Principal
from billing.prices.book import EffectivePrice
from engines.base import Engine
from gateway.admin import routes as admin
from gateway.api.account import alerts as account_alerts, credits as account_credits, invoices as account_invoices
from gateway.webhooks import stripe as stripe_webhooks
from gateway.api.anthropic import messages as anthropic_api
from gateway.api.openai import embeddings as embeddings_api, responses as openai_responses
from gateway.dashboard import views as dashboard
from gateway.batches import anthropic_api as batch_anthropic, openai_api as batch_openai
from gateway.http.errors import EngineNotReady, NotFound, ServiceUnavailable
from gateway.serving.generate import answer
from gateway.http.requests import authenticate, read_json
from gateway.http.json_response import json_response
from gateway.http.logs import request_id_of
from gateway.http.metrics import metrics_endpoint
from gateway.api.openapi import openapi_document
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.serving.generation_response import CompletedResponse, GenerationResponse
from gateway.serving.completions import CompletionService
from gateway.api.account.usage import get_usage


async def _generate(request: Request, model: type[Any], kind: str) -> Any:
    state = request.app.state
    request_id = request_id_of(request)  # made by RequestContext; also the ledger row's id
    principal = await authenticate(request, state.keys, states=state.billing.states)  # 403 for a suspended account
    raw = await read_json(request, state.settings.http.max_body_bytes)
    service: CompletionService = state.service
    raw, engine = service.resolve(raw, kind)  # the model, once: a routing model (`auto`) names the one it chooses
    body = parse(model, raw, passthrough=engine is not None and engine.passthrough)  # see Engine.passthrough
    if kind == "chat":
        gen = service.prepare_chat(principal, body, request_id, engine)
    else:
        gen = service.prepare_text(principal, body, request_id, engine)
    return await answer(
        request, service, gen,
        streamed=lambda outputs, headers, admission: GenerationResponse(gen, outputs, headers, admission=admission),
        completed=lambda headers, admission: CompletedResponse(gen, service, headers, admission=admission),
    )


async def chat_completions(request: Request) -> Any:
    return await _generate(request, ChatCompletionRequest, "chat")


async def completions(request: Request) -> Any:
    return await _generate(request, CompletionRequest, "text")


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


async def list_models(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    engines: dict[str, Engine] = request.app.state.service.engines
    # Aliases resolve to the same engine under another key; the list names each model once.
    data = [await _priced_card(request, principal, e) for mid, e in engines.items() if mid == e.model_id and principal.may_use(mid)]
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


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    if request.app.draining:  # SIGTERM: out of the load balancer at once (gateway/http/drain.py)
        return ServiceUnavailable("This server is shutting down.", code="draining", headers={"Retry-After": "1"}).response()
    engines: dict[str, Engine] = request.app.state.service.engines
    failed = request.app.state.load_failures
    if failed:
        reasons = "; ".join(f"{mid}: {why}" for mid, why in failed.items())
        return ServiceUnavailable(f"models failed to load: {reasons}", code="model_load_failed").response()
    pending = [mid for mid, e in engines.items() if not e.ready]
    if pending:
        return EngineNotReady(f"models still loading: {', '.join(pending)}", headers={"Retry-After": "5"}).response()
    return json_response({"status": "ready", "models": list(engines)})


# Most of the traffic: dispatched before Starlette's router (gateway/app.py:Gateway).
HOT = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}

ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/openapi.json", openapi_document, methods=["GET"]),
    *admin.routes,  # /admin/...: every one behind the admin-key check (gateway/admin/guard.py)
    Route("/v1/usage", get_usage, methods=["GET"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
    *dashboard.routes,
    *account_invoices.routes,
    *stripe_webhooks.routes,
    *account_credits.routes,
    *account_alerts.routes,
    *embeddings_api.routes,
    *anthropic_api.routes,
    *openai_responses.routes,
    *batch_openai.routes,  # /v1/files, /v1/batches
    *batch_anthropic.routes,  # /v1/messages/batches
]
