"""POST /v1/chat/completions and POST /v1/completions: OpenAI's chat and text completions. Thin: the
body is parsed here, the work is the serving pipeline's (gateway/serving/)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.http.logs import request_id_of
from gateway.http.requests import authenticate, read_json
from gateway.serving.completions import CompletionService
from gateway.serving.generate import answer
from gateway.serving.generation_response import CompletedResponse, GenerationResponse


async def _generate(request: Request, model: type[Any], kind: str) -> Any:
    state = request.app.state
    request_id = request_id_of(request)  # made by RequestContext; also the ledger row's id
    principal = await authenticate(request, state.keys, states=state.billing.states)  # 403 for a suspended account
    raw = await read_json(request, state.settings.http.max_body_bytes)
    service: CompletionService = state.service
    raw, engine = service.resolve(raw, kind)  # the model, once: a routing model (`auto`) names the one it chooses
    body = parse(model, raw, passthrough=engine is not None and engine.passthrough)  # see Engine.passthrough
    if kind == "chat":
        body.check_tool_results()
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


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
