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

from billing.keys import Principal
from billing.response_models import StoredResponse
from engines.base import FINISH_LENGTH
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.http import authenticate, read_json
from gateway.logs import request_id_of
from gateway.openai_responses_protocol import ResponsesRequest
from gateway.protocol import parse
from gateway.responses import CompletedResponse, GenerationResponse
from gateway.serving import CompletionService, Generation

log = logging.getLogger("tollgate.openai_responses")
TABLE = StoredResponse.__table__
PURGE_EVERY = 60.0  # seconds between deletions of expired stored responses (per process)
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,75}")  # anything else is no stored response's id


def _event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponseRenderer:
    """OpenAI's Response shapes for GenerationResponse (ChunkRenderer's methods): one assistant
    message with one output_text part. `final` is the finished Response object (for the store)."""

    def __init__(self, gen: Generation, request: ResponsesRequest) -> None:
        self.gen = gen
        self.request = request
        self.id = "resp_" + gen.request_id
        self.item_id = "msg_" + gen.request_id
        self.seq = 0
        self.pieces: list[str] = []
        self.final: dict[str, Any] | None = None

    def _next(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self.seq
        self.seq += 1
        return _event(payload)

    def _status(self) -> str:
        return "incomplete" if self.gen.finish_reason == FINISH_LENGTH else "completed"

    def usage(self) -> dict[str, Any]:
        gen = self.gen
        return {
            "input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens or 0, "cache_write_tokens": 0},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.request
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
            "parallel_tool_calls": True,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }

    def _finished(self, text: str) -> dict[str, Any]:
        status = self._status()
        self.final = self.response(status, [self._item(status, [self._part(text)])], self.usage())
        return self.final

    # ChunkRenderer's methods

    def first(self) -> bytes:
        created = self.response("in_progress", [])
        return (
            self._next({"type": "response.created", "response": created})
            + self._next({"type": "response.in_progress", "response": created})
            + self._next({"type": "response.output_item.added", "output_index": 0, "item": self._item("in_progress", [])})
            + self._next({"type": "response.content_part.added", "item_id": self.item_id, "output_index": 0, "content_index": 0,
                          "part": self._part("")})
        )

    def delta(self, text: str, finish_reason: str | None, raw_choice: dict[str, Any] | None = None) -> bytes:
        if raw_choice is not None:  # a pass-through engine's OpenAI chunk choice
            text = (raw_choice.get("delta") or {}).get("content") or ""
        if not text:
            return b""
        self.pieces.append(text)
        return self._next({"type": "response.output_text.delta", "item_id": self.item_id, "output_index": 0, "content_index": 0,
                           "delta": text, "logprobs": []})

    def end(self) -> bytes:
        text = "".join(self.pieces)
        final = self._finished(text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return (
            self._next({"type": "response.output_text.done", **where, "text": text, "logprobs": []})
            + self._next({"type": "response.content_part.done", **where, "part": self._part(text)})
            + self._next({"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]})
            + self._next({"type": "response.completed" if final["status"] == "completed" else "response.incomplete", "response": final})
        )

    def error(self, err: APIError) -> bytes:
        """A stream that fails after its status line: an `error` event, then `response.failed`."""
        text = "".join(self.pieces)
        failed = self.response("failed", [self._item("incomplete", [self._part(text)])] if text else [], self.usage(),
                               {"code": "server_error", "message": err.message})
        return (
            self._next({"type": "error", "code": err.code, "message": err.message, "param": err.param})
            + self._next({"type": "response.failed", "response": failed})
        )

    def error_body(self, err: APIError) -> tuple[int, bytes]:
        return err.status_code, orjson.dumps(err.body())

    def body(self, text: str, raw_choice: dict[str, Any] | None = None) -> bytes:
        if raw_choice is not None:  # a pass-through engine's OpenAI choice
            text = (raw_choice.get("message") or {}).get("content") or ""
        return orjson.dumps(self._finished(text))


def input_items(request: ResponsesRequest, request_id: str) -> list[dict[str, Any]]:
    """This turn's input as OpenAI's input items (what GET .../input_items lists)."""
    raw = request.input if isinstance(request.input, list) else [{"role": "user", "content": request.input}]
    out = []
    for i, item in enumerate(raw):
        content = item["content"]
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else [
            {"type": p["type"] if p["type"] != "text" else "input_text", "text": p["text"], **({"annotations": []} if p["type"] == "output_text" else {})}
            for p in content
        ]
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
        store = getattr(state, "response_store", None)
        if store is None:
            store = state.response_store = cls(state.db, state.settings.responses_retention_days)
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

    async def put(self, gen: Generation, request: ResponsesRequest, messages: list[dict[str, str]], final: dict[str, Any]) -> None:
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
    def __init__(self, gen: Generation, outputs: Any, headers: dict[str, str], render: ResponseRenderer, keep: Any) -> None:
        super().__init__(gen, outputs, headers, render)
        self.keep = keep


class StoredCompletedResponse(_Storing, CompletedResponse):
    def __init__(self, gen: Generation, service: Any, headers: dict[str, str], render: ResponseRenderer, keep: Any) -> None:
        super().__init__(gen, service, headers, render)
        self.keep = keep


def _json(payload: Any, request_id: str, status_code: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json", headers={"x-request-id": request_id})


async def _history(store: ResponseStore, principal: Principal, previous_id: str) -> list[dict[str, str]]:
    """The earlier turns of a conversation: the previous response's conversation and its answer."""
    row = await store.get(principal.account_id, previous_id)
    if row is None:
        raise InvalidRequest(f"Previous response with id {previous_id!r} not found.", param="previous_response_id",
                             code="previous_response_not_found")
    answer = "".join(
        part.get("text", "") for item in orjson.loads(row.response)["output"] if item.get("type") == "message"
        for part in item.get("content", ()) if part.get("type") == "output_text"
    )
    return [*orjson.loads(row.messages), {"role": "assistant", "content": answer}]


async def create_response(request: Request) -> Any:
    state = request.app.state
    request_id = request_id_of(request)
    principal = await authenticate(request, state.keys)
    state.billing.guard(principal)  # 403 for keys of a suspended account (unpaid invoices)
    body: ResponsesRequest = parse(ResponsesRequest, await read_json(request, state.settings.max_body_bytes))
    store = ResponseStore.of(request)
    history = await _history(store, principal, body.previous_response_id) if body.previous_response_id else []
    service: CompletionService = state.service
    gen = service.prepare_responses(principal, body, request_id, body.chat_messages(history))
    try:
        await service.admit(gen)
    except BaseException:
        gen.engine.cancel(request_id)  # gives back the place the scheduler held at prepare
        raise
    # Admitted from here on: the metered stream (or complete()) settles the quota and writes the row.
    headers = {"x-request-id": request_id, **(gen.hold.headers if gen.hold else {})}
    render = ResponseRenderer(gen, body)
    conversation = history + body.input_messages()

    async def keep(final: dict[str, Any]) -> None:
        await store.put(gen, body, conversation, final)

    keeper = keep if body.store is not False else None
    if not gen.stream and gen.engine.completes:
        return StoredCompletedResponse(gen, service, headers, render, keeper)
    return StoredGenerationResponse(gen, service.metered(gen), headers, render, keeper)


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
    raw_limit = query.get("limit") or "20"
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100", param="limit")
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
    page = items[: int(raw_limit)]
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
