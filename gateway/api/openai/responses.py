"""OpenAI's Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`.

The route is thin: the body is an `openai_responses_protocol.ResponsesRequest`, and the generation
goes through the same CompletionService as chat (prepare, admit, metered, one ledger row with
`api = "responses"`) and the same GenerationResponse (connection watch, disconnects, closing).
Only the shapes differ, and they live in `ResponseRenderer`: the Response object and the typed SSE
events the openai SDK parses, each with its `sequence_number`. Errors before the response are
OpenAI's usual `{"error": {...}}` bodies.

With `store` (the default, as OpenAI's) a finished response is kept per account (`stored_responses`)
before its last byte leaves, so a client that read it can retrieve it or continue from it at once.
`previous_response_id` puts the earlier turns in front of this turn's input: they are prompt tokens
of this request, metered and billed as such.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Send

from billing.keys.store import Principal
from billing.stored_responses import StoredResponse
from engines.base import FINISH_LENGTH
from gateway.http.errors import APIError, InvalidRequest, NotFound
from gateway.http.requests import authenticate, query_limit, read_json
from gateway.http.logs import request_id_of
from gateway.api.openai.responses_protocol import ResponsesRequest
from gateway.api.openai.protocol import parse
from gateway.serving.generate import answer
from gateway.http.json_response import json_response
from gateway.serving.admission import Admission
from gateway.serving.generation_response import CompletedResponse, GenerationResponse
from gateway.serving.completions import RESPONSES_PARAMS, CompletionService, Generation, renamed

log = logging.getLogger("tollgate.openai_responses")
TABLE = StoredResponse.__table__
PURGE_EVERY = 60.0  # seconds between deletions of expired stored responses (per process)
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,75}")  # anything else is no stored response's id


def _event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponseRenderer:
    """OpenAI's Response shapes for GenerationResponse (ChunkRenderer's methods). The engine's chat
    output becomes output items in the order it came: text an assistant `message` item with one
    `output_text` part, each tool call a `function_call` item (streamed as argument deltas). Items
    open when their first piece arrives and close when the next item opens or the response ends.
    `final` is the finished Response object (for the store)."""

    def __init__(self, gen: Generation, request: ResponsesRequest) -> None:
        self.gen = gen
        self.request = request
        self.id = "resp_" + gen.request_id
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items, in order; the last may be open
        self.open: dict[str, Any] | None = None
        self.texts: dict[int, list[str]] = {}  # output_index of a message item -> its text pieces
        self.calls: dict[int, int] = {}  # a streamed tool call's index -> its item's output_index
        self.final: dict[str, Any] | None = None

    def _next(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self.seq
        self.seq += 1
        return _event(payload)

    def _item_status(self) -> str:
        return "incomplete" if self.gen.finish_reason == FINISH_LENGTH else "completed"

    def usage(self) -> dict[str, Any]:
        gen = self.gen
        return {
            "input_tokens": gen.prompt_tokens,
            # the part of the prompt the row counts cached (its cached_tokens): never more than the prompt
            "input_tokens_details": {"cached_tokens": min(gen.cached_tokens or 0, gen.prompt_tokens), "cache_write_tokens": 0},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, index: int, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": f"msg_{self.gen.request_id}" + (f"_{index}" if index else ""), "type": "message", "status": status,
                "role": "assistant", "content": content}

    def _function_call(self, index: int, call: dict[str, Any], status: str) -> dict[str, Any]:
        function = call.get("function") or {}
        return {"id": f"fc_{self.gen.request_id}_{index}", "type": "function_call", "status": status,
                "call_id": call.get("id") or f"call_{self.gen.request_id}_{index}", "name": function.get("name") or "",
                "arguments": function.get("arguments") or ""}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.request
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.gen.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.gen.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.echoed_tools(),
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
        }

    def _finished(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        status = "incomplete" if self.gen.finish_reason == FINISH_LENGTH else "completed"
        self.final = self.response(status, output, self.usage())
        return self.final

    # streaming: items open and close as the engine's output arrives

    def _close(self, status: str) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        index = self.items.index(item)
        item["status"] = status
        if item["type"] == "message":
            text = "".join(self.texts[index])
            item["content"] = [self._part(text)]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return (
                self._next({"type": "response.output_text.done", **where, "text": text, "logprobs": []})
                + self._next({"type": "response.content_part.done", **where, "part": self._part(text)})
                + self._next({"type": "response.output_item.done", "output_index": index, "item": item})
            )
        return (
            self._next({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                        "arguments": item["arguments"]})
            + self._next({"type": "response.output_item.done", "output_index": index, "item": item})
        )

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != "message":
            out += self._close("completed")
            index = len(self.items)
            self.open = self._message(index, "in_progress", [])
            self.items.append(self.open)
            self.texts[index] = []
            out += self._next({"type": "response.output_item.added", "output_index": index, "item": dict(self.open)})
            out += self._next({"type": "response.content_part.added", "item_id": self.open["id"], "output_index": index,
                               "content_index": 0, "part": self._part("")})
        index = len(self.items) - 1
        self.texts[index].append(text)
        return out + self._next({"type": "response.output_text.delta", "item_id": self.open["id"], "output_index": index,
                                 "content_index": 0, "delta": text, "logprobs": []})

    def _call(self, delta: dict[str, Any]) -> bytes:
        """A tool call's chunk: its first opens a function_call item (id and name), each carries a
        piece of its arguments (an engine that parses whole calls sends them in one)."""
        out = b""
        key = delta.get("index", 0)
        index = self.calls.get(key)
        if index is None:
            out += self._close("completed")
            index = self.calls[key] = len(self.items)
            self.open = self._function_call(index, {**delta, "function": {**(delta.get("function") or {}), "arguments": ""}}, "in_progress")
            self.items.append(self.open)
            out += self._next({"type": "response.output_item.added", "output_index": index, "item": dict(self.open)})
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece:
            self.items[index]["arguments"] += piece
            out += self._next({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                               "output_index": index, "delta": piece})
        return out

    # ChunkRenderer's methods

    def first(self) -> bytes:
        created = self.response("in_progress", [])
        return self._next({"type": "response.created", "response": created}) + self._next({"type": "response.in_progress", "response": created})

    def delta(self, text: str, finish_reason: str | None, raw_choice: dict[str, Any] | None = None) -> bytes:
        calls: list[dict[str, Any]] = []
        if raw_choice is not None:  # the engine's OpenAI chunk choice: content and tool call deltas
            delta = raw_choice.get("delta") or {}
            text, calls = delta.get("content") or "", delta.get("tool_calls") or []
        out = self._text(text) if text else b""
        for call in calls:
            out += self._call(call)
        return out

    def end(self) -> bytes:
        out = self._close(self._item_status())
        if not self.items:  # nothing was generated: one empty message, as OpenAI answers
            out += self._text("") + self._close(self._item_status())
        final = self._finished(self.items)
        return out + self._next({"type": "response.completed" if final["status"] == "completed" else "response.incomplete", "response": final})

    def error(self, err: APIError) -> bytes:
        """A stream that fails after its status line: an `error` event, then `response.failed`."""
        if self.open is not None and self.open["type"] == "message":
            self.open["content"] = [self._part("".join(self.texts[self.items.index(self.open)]))]
        for item in self.items:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        failed = self.response("failed", self.items, self.usage(), {"code": "server_error", "message": err.message})
        return (
            self._next({"type": "error", "code": err.code, "message": err.message, "param": err.param})
            + self._next({"type": "response.failed", "response": failed})
        )

    def error_body(self, err: APIError) -> tuple[int, bytes]:
        return err.status_code, orjson.dumps(renamed(err, RESPONSES_PARAMS).body())

    def body(self, text: str, raw_choice: dict[str, Any] | None = None) -> bytes:
        calls: list[dict[str, Any]] = []
        if raw_choice is not None:  # the engine's whole OpenAI choice: content and tool calls
            message = raw_choice.get("message") or {}
            text, calls = message.get("content") or "", message.get("tool_calls") or []
        status = self._item_status()
        output = [self._message(0, status, [self._part(text)])] if text or not calls else []
        output += [self._function_call(index, call, "completed") for index, call in enumerate(calls, start=len(output))]
        return orjson.dumps(self._finished(output))


def input_items(request: ResponsesRequest, request_id: str) -> list[dict[str, Any]]:
    """This turn's input as OpenAI's input items (what GET .../input_items lists)."""
    raw = request.input if isinstance(request.input, list) else [{"role": "user", "content": request.input}]
    out = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind == "function_call":
            out.append({"id": item.get("id") or f"fc_{request_id}_{i}", "type": "function_call", "status": "completed",
                        "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]})
            continue
        if kind == "function_call_output":
            out.append({"id": item.get("id") or f"fco_{request_id}_{i}", "type": "function_call_output", "status": "completed",
                        "call_id": item["call_id"], "output": item["output"]})
            continue
        content = item["content"]
        # An assistant's message is listed as the model's output (ResponseOutputMessage: output_text
        # parts with annotations); the others' as input (input_text parts).
        text_type = "output_text" if item["role"] == "assistant" else "input_text"
        parts = [{"type": text_type, "text": content}] if isinstance(content, str) else [
            {"type": text_type, "text": p["text"]} if p["type"] in ("text", "input_text", "output_text") else dict(p)
            for p in content
        ]
        for part in parts:
            if part["type"] == "output_text":
                part["annotations"] = []
        out.append({"id": f"msg_{request_id}_{i}", "type": "message", "role": item["role"], "status": "completed", "content": parts})
    return out


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


class ResponseStore:
    """Stored responses in the database, per account; expired ones are invisible and purged."""

    def __init__(self, db: AsyncEngine, retention_days: float) -> None:
        self.db = db
        self.retention = timedelta(days=retention_days) if retention_days > 0 else None
        self._purged = 0.0

    @classmethod
    def of(cls, request: Request) -> "ResponseStore":
        state = request.app.state
        store = state.response_store
        if store is None:
            store = state.response_store = cls(state.db, state.settings.responses.retention_days)
        return store

    def _visible(self, account_id: int, response_id: str) -> Any:
        now = datetime.now(timezone.utc)
        return sa.and_(
            TABLE.c.id == response_id, TABLE.c.account_id == account_id,
            sa.or_(TABLE.c.expires_at.is_(None), TABLE.c.expires_at > now),
        )

    async def get(self, account_id: int, response_id: str) -> Any:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        async with self.db.connect() as conn:
            return (await conn.execute(sa.select(TABLE).where(self._visible(account_id, response_id)))).first()

    async def delete(self, account_id: int, response_id: str) -> bool:
        if not RESPONSE_ID.fullmatch(response_id):
            return False
        async with self.db.begin() as conn:
            return bool((await conn.execute(TABLE.delete().where(self._visible(account_id, response_id)))).rowcount)

    async def put(self, gen: Generation, request: ResponsesRequest, messages: list[dict[str, Any]], final: dict[str, Any]) -> None:
        now = datetime.now(timezone.utc)
        async with self.db.begin() as conn:
            if self.retention is not None and time.monotonic() - self._purged > PURGE_EVERY:
                self._purged = time.monotonic()
                await conn.execute(TABLE.delete().where(TABLE.c.expires_at < now))
            await conn.execute(TABLE.insert().values(
                id=final["id"], account_id=gen.principal.account_id, key_id=gen.principal.key_id, model=gen.model,
                status=final["status"], previous_response_id=request.previous_response_id,
                messages=orjson.dumps(messages).decode(), input_items=orjson.dumps(input_items(request, gen.request_id)).decode(),
                response=orjson.dumps(final).decode(), created_at=now,
                expires_at=now + self.retention if self.retention is not None else None,
            ))


class _Storing:
    """Keeps the finished response (`store`) before the last bytes of its body leave."""

    gen: Generation
    render: ResponseRenderer
    keep: Any  # async (final) -> None, or None when `store` is false

    async def _respond(self, send: Send) -> None:
        async def storing_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body") and self.keep and self.render.final:
                final, self.render.final = self.render.final, None
                try:
                    await self.keep(final)
                except Exception as exc:  # served and metered; only the stored copy is missing
                    log.error("response %s could not be stored: %s", self.gen.request_id, type(exc).__name__)
            await send(message)

        await super()._respond(storing_send)  # type: ignore[misc]


class StoredGenerationResponse(_Storing, GenerationResponse):
    def __init__(self, gen: Generation, outputs: Any, headers: dict[str, str], render: ResponseRenderer, keep: Any,
                 admission: Admission) -> None:
        super().__init__(gen, outputs, headers, render, admission=admission)
        self.keep = keep


class StoredCompletedResponse(_Storing, CompletedResponse):
    def __init__(self, gen: Generation, service: Any, headers: dict[str, str], render: ResponseRenderer, keep: Any,
                 admission: Admission) -> None:
        super().__init__(gen, service, headers, render, admission=admission)
        self.keep = keep


def _json(payload: Any, request_id: str, status_code: int = 200) -> Response:
    return json_response(payload, status_code, {"x-request-id": request_id})


def answer_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output as the assistant turn a continuation starts from: its text, and
    its function calls as `tool_calls` (their outputs come in the next request's input)."""
    text = "".join(
        part.get("text", "") for item in output if item.get("type") == "message"
        for part in item.get("content", ()) if part.get("type") == "output_text"
    )
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item.get("type") == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


async def _history(store: ResponseStore, principal: Principal, previous_id: str) -> list[dict[str, Any]]:
    """The earlier turns of a conversation: the previous response's conversation and its answer."""
    row = await store.get(principal.account_id, previous_id)
    if row is None:
        raise InvalidRequest(f"Previous response with id {previous_id!r} not found.", param="previous_response_id",
                             code="previous_response_not_found")
    return [*orjson.loads(row.messages), *answer_messages(orjson.loads(row.response)["output"])]


async def create_response(request: Request) -> Any:
    state = request.app.state
    request_id = request_id_of(request)
    principal = await authenticate(request, state.keys, states=state.billing.states)  # 403 for a suspended account
    body: ResponsesRequest = parse(ResponsesRequest, await read_json(request, state.settings.http.max_body_bytes))
    store = ResponseStore.of(request)
    history = await _history(store, principal, body.previous_response_id) if body.previous_response_id else []
    service: CompletionService = state.service
    gen = service.prepare_responses(principal, body, request_id, history)  # as the chat completion it translates to
    render = ResponseRenderer(gen, body)
    conversation = history + body.input_messages()

    async def keep(final: dict[str, Any]) -> None:
        await store.put(gen, body, conversation, final)

    keeper = keep if body.store is not False else None

    return await answer(
        request, service, gen,
        streamed=lambda outputs, headers, admission: StoredGenerationResponse(gen, outputs, headers, render, keeper, admission),
        completed=lambda headers, admission: StoredCompletedResponse(gen, service, headers, render, keeper, admission),
    )


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id {response_id!r} not found.", param="response_id", code="not_found")


async def get_response(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    response_id = request.path_params["response_id"]
    row = await ResponseStore.of(request).get(principal.account_id, response_id)
    if row is None:
        raise _not_found(response_id)
    return Response(row.response.encode(), media_type="application/json", headers={"x-request-id": request_id_of(request)})


async def delete_response(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    response_id = request.path_params["response_id"]
    if not await ResponseStore.of(request).delete(principal.account_id, response_id):
        raise _not_found(response_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True}, request_id_of(request))


async def list_input_items(request: Request) -> Response:
    """This turn's input items, newest first by default (`order`), `limit` (1-100, 20) after `after`."""
    principal = await authenticate(request, request.app.state.keys)
    response_id = request.path_params["response_id"]
    query = request.query_params
    order = query.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    limit = query_limit(request, 20, 100)
    row = await ResponseStore.of(request).get(principal.account_id, response_id)
    if row is None:
        raise _not_found(response_id)
    items = orjson.loads(row.input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"No input item with id {after!r} in this response.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return _json({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page),
    }, request_id_of(request))


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]
