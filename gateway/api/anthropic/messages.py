"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The route is thin: the key comes from `x-api-key` (or `Authorization: Bearer`), the body is an
`anthropic_protocol.MessagesRequest`, and the generation goes through the same CompletionService
as chat (prepare, admit, metered, one ledger row with `api = "messages"`) and the same
GenerationResponse (connection watch, disconnects, closing). Only the shapes differ, and they live
in `MessageRenderer`: Anthropic's SSE events and Message body, and errors as
`{"type": "error", "error": {"type", "message"}}` with Anthropic's status codes (gateway/api/anthropic/errors.py).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.keys.format import mask_keys
from engines.base import FINISH_LENGTH, FINISH_STOP
from gateway.api.anthropic.errors import error_response, error_shape
from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.batches.line import batch_line
from gateway.http.errors import APIError, AuthenticationFailed, ServiceUnavailable
from gateway.http.requests import authenticate, read_json
from gateway.http.logs import request_id_of
from gateway.api.openai.protocol import parse
from gateway.serving.generate import answer
from gateway.http.json_response import json_response
from gateway.serving.generation_response import CompletedResponse, GenerationResponse
from gateway.serving.completions import CompletionService, Generation

log = logging.getLogger("tollgate.anthropic")


def stop_reason(gen: Generation, called: bool = False) -> str | None:
    if gen.finish_reason == FINISH_LENGTH:
        return "max_tokens"
    if gen.finish_reason in ("tool_calls", "function_call"):  # a pass-through engine's upstream says it
        return "tool_use"
    if gen.finish_reason == "content_filter":  # the upstream's filter withheld the answer: Anthropic's refusal
        return "refusal"
    if gen.finish_reason == FINISH_STOP:
        if called:
            return "tool_use"
        return "stop_sequence" if gen.stop_sequence is not None else "end_turn"
    return None


def _event(name: bytes, payload: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def tool_use_id(call_id: str | None, fallback: str) -> str:
    """A tool call's id as Anthropic writes it; a tool_result's tool_use_id comes back as the same string."""
    if not call_id:
        return fallback
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as Anthropic's `input` object (an object whatever the model wrote)."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def usage_of(gen: Generation, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` is the input not read from a cache; the three input fields
    add up to the whole prompt (what the engine reported cached is `cache_read_input_tokens`)."""
    cached = min(gen.cached_tokens or 0, gen.prompt_tokens)
    return {"input_tokens": gen.prompt_tokens - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": output_tokens}


class MessageRenderer:
    """Anthropic's shapes for GenerationResponse (ChunkRenderer's methods). The engine's chat output
    becomes content blocks in the order it came: text a `text` block, each tool call a `tool_use`
    block (streamed as `input_json_delta`s). A block starts when its first piece arrives and stops
    when the next one starts or the message ends; `stop_reason` is `tool_use` when the model called one."""

    def __init__(self, gen: Generation, service_tier: str = "standard") -> None:
        self.gen = gen
        self.service_tier = service_tier  # usage.service_tier: "standard", or "batch" for a batch's line
        self.id = "msg_" + gen.request_id
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the type of the block being streamed
        self.calls: dict[int, int] = {}  # a streamed tool call's index -> its block's index
        # The open tool_use block's argument pieces: sent as one input_json_delta when the block
        # closes, as the object the non-streamed body's `input` is (tool_input), so that what the
        # SDK assembles always parses (an upstream's arguments need not be JSON)
        self.arguments: list[str] | None = None

    def _message(self, content: list[dict[str, Any]], stop: str | None, output_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.gen.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": self.gen.stop_sequence if stop == "stop_sequence" else None,
            # The Message's usage as Anthropic's has it: no cache written (cache_control is ignored), the tier it ran at
            "usage": {**usage_of(self.gen, output_tokens), "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
                      "service_tier": self.service_tier},
        }

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._stop()
        out += _event(b"content_block_start", {"type": "content_block_start", "index": self.blocks, "content_block": block})
        if self.blocks == 0:
            out += _event(b"ping", {"type": "ping"})  # where Anthropic sends it: after the first block starts
        self.blocks += 1
        self.open = block["type"]
        return out

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        out = b""
        if self.arguments is not None:
            joined, self.arguments = "".join(self.arguments), None
            if joined.strip():
                out = self._delta(self.blocks - 1, {"type": "input_json_delta",
                                                    "partial_json": orjson.dumps(tool_input(joined)).decode()})
        return out + _event(b"content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return _event(b"content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _call(self, call: dict[str, Any]) -> bytes:
        out = b""
        key = call.get("index", 0)
        function = call.get("function") or {}
        if key not in self.calls:
            self.calls[key] = self.blocks
            out += self._start({"type": "tool_use", "id": tool_use_id(call.get("id"), f"toolu_{self.gen.request_id}_{self.blocks}"),
                                "name": function.get("name") or "", "input": {}})
            self.arguments = []
        piece = function.get("arguments") or ""
        if piece and self.arguments is not None and self.calls[key] == self.blocks - 1:  # the open block's
            self.arguments.append(piece)
        return out

    # ChunkRenderer's methods

    def first(self) -> bytes:
        return _event(b"message_start", {"type": "message_start", "message": self._message([], None, 0)})

    def delta(self, text: str, finish_reason: str | None, raw_choice: dict[str, Any] | None = None) -> bytes:
        calls: list[dict[str, Any]] = []
        if raw_choice is not None:  # the engine's OpenAI chunk choice: content and tool call deltas
            delta = raw_choice.get("delta") or {}
            text, calls = delta.get("content") or "", delta.get("tool_calls") or []
        out = b""
        if text:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out += self._delta(self.blocks - 1, {"type": "text_delta", "text": text})
        for call in calls:
            out += self._call(call)
        return out

    def end(self) -> bytes:
        out = self._start({"type": "text", "text": ""}) if self.blocks == 0 else b""  # nothing generated: one empty text block
        stop = stop_reason(self.gen, bool(self.calls))
        usage = usage_of(self.gen, self.gen.completion_tokens)  # cumulative: the input's split is known by now
        delta = {"stop_reason": stop, "stop_sequence": self.gen.stop_sequence if stop == "stop_sequence" else None}
        return (
            out + self._stop()
            + _event(b"message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            + _event(b"message_stop", {"type": "message_stop"})
        )

    def error(self, err: APIError) -> bytes:
        return _event(b"error", error_shape(err, self.gen.request_id)[1])

    def error_body(self, err: APIError) -> tuple[int, bytes]:
        status, body = error_shape(err, self.gen.request_id)
        return status, orjson.dumps(body)

    def body(self, text: str, raw_choice: dict[str, Any] | None = None) -> bytes:
        calls: list[dict[str, Any]] = []
        if raw_choice is not None:  # the engine's whole OpenAI choice: content and tool calls
            message = raw_choice.get("message") or {}
            text, calls = message.get("content") or "", message.get("tool_calls") or []
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        for i, call in enumerate(calls):
            function = call.get("function") or {}
            content.append({"type": "tool_use", "id": tool_use_id(call.get("id"), f"toolu_{self.gen.request_id}_{i}"),
                            "name": function.get("name") or "", "input": tool_input(function.get("arguments") or "")})
        return orjson.dumps(self._message(content, stop_reason(self.gen, bool(calls)), self.gen.completion_tokens))


def api_key(request: Request) -> str | None:
    """Anthropic's SDKs send `x-api-key`; `Authorization: Bearer` (their `auth_token`) works too."""
    if batch_line(request.scope) is not None:  # a line of a batch: authenticate() gives its principal
        return None
    key = (request.headers.get("x-api-key") or "").strip()
    if key:
        return key
    if "authorization" not in request.headers:
        raise AuthenticationFailed("You didn't provide an API key. Send it in the 'x-api-key' header.", code="missing_api_key")
    return None  # the bearer key


async def _answered(request: Request, answer: Any) -> Any:
    """Runs a route's body; whatever fails before the response is Anthropic-shaped, never OpenAI's."""
    request_id = request_id_of(request)
    try:
        return await answer(request, request_id)
    except APIError as err:
        return error_response(err, request_id)
    except Exception as exc:
        from gateway.http.error_handlers import database_unreachable  # the app's one judgement of an outage

        if database_unreachable(exc):
            err: APIError = ServiceUnavailable("The database is unavailable; retry shortly.", headers={"Retry-After": "1"})
        else:
            log.error("unhandled %s on %s %s", type(exc).__name__, request.method, mask_keys(request.url.path), exc_info=exc)  # a key pasted into a path
            err = APIError("The server had an error while processing your request.")
        return error_response(err, request_id)


async def create_message(request: Request) -> Any:
    return await _answered(request, _create_message)


async def _create_message(request: Request, request_id: str) -> Any:
    state = request.app.state
    principal = await authenticate(request, state.keys, api_key(request), states=state.billing.states)  # 403 for a suspended account
    body = parse(MessagesRequest, await read_json(request, state.settings.http.max_body_bytes))
    service: CompletionService = state.service
    gen = service.prepare_messages(principal, body, request_id)  # as the chat completion it translates to
    render = MessageRenderer(gen, "batch" if batch_line(request.scope) is not None else "standard")  # no priority tier here

    return await answer(
        request, service, gen,
        streamed=lambda outputs, headers, admission: GenerationResponse(gen, outputs, headers, render, admission=admission),
        completed=lambda headers, admission: CompletedResponse(gen, service, headers, render, admission=admission),
        headers={"request-id": request_id},
    )


async def count_tokens(request: Request) -> Response:
    """The prompt tokens a Messages request would be billed for; nothing is generated or metered."""
    return await _answered(request, _count_tokens)


async def _count_tokens(request: Request, request_id: str) -> Response:
    state = request.app.state
    principal = await authenticate(request, state.keys, api_key(request), states=state.billing.states)
    body = parse(CountTokensRequest, await read_json(request, state.settings.http.max_body_bytes))
    service: CompletionService = state.service
    chat, engine = service.resolve(body.chat_body(), "chat")  # a routing model (`auto`): the one it would choose
    engine = service.engine_for(chat["model"], principal, engine)
    tokens = len(service.prompt_of(engine, chat, "messages", {}))  # what the engine bills
    return json_response({"input_tokens": tokens}, headers={"request-id": request_id})


routes = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]

