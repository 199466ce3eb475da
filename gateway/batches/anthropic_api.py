"""Anthropic's Message Batches: /v1/messages/batches create, retrieve, list (after_id, before_id),
cancel, results (JSONL) and delete (an ended batch), on the same runner and engine path as OpenAI's batches (each request is a /v1/messages
call); errors in Anthropic's shape."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.batches.store import new_batch_id
from billing.models import utcnow
from gateway.api.anthropic.messages import _answered, api_key
from gateway.batches.results import WINDOWS, anthropic_line, anthropic_view
from gateway.http.errors import InvalidRequest, NotFound, ServiceUnavailable
from gateway.http.requests import authenticate, public_origin, query_limit, read_json
from gateway.http.json_response import json_response
from gateway.http.logs import request_id_of

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


async def _caller(request: Request, *, spends: bool = False) -> tuple[Any, Any]:
    """The state and the caller; `spends`: a route that spends, refused to a suspended account."""
    state = request.app.state
    if state.batch_store is None:
        raise ServiceUnavailable("The Batch API is off on this server (TOLLGATE_BATCHES).")
    return state, await authenticate(request, state.keys, api_key(request), states=state.billing.states if spends else None)


def _view(request: Request, batch: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    return anthropic_view(batch, counts, public_origin(request))  # results_url: where the SDK fetches the results, with its key


async def _create(request: Request, request_id: str) -> Response:
    state, principal = await _caller(request, spends=True)
    # A Message Batch is its requests inline: bounded like an uploaded batch file (Anthropic's own bound
    # is 256 MB), not like one request's body.
    body = await read_json(request, state.settings.batches.files_max_bytes)
    requests = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(requests, list) or not requests:
        raise InvalidRequest("requests: must be a non-empty list", param="requests")
    if len(requests) > state.settings.batches.max_lines:
        raise InvalidRequest(f"requests: a batch has at most {state.settings.batches.max_lines} requests", param="requests")
    lines: list[tuple[str, str]] = []
    seen: set[str] = set()
    for i, item in enumerate(requests):
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        params = item.get("params") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise InvalidRequest(f"requests.{i}.custom_id: must be 1 to 64 letters, digits, '-' or '_'", param=f"requests.{i}.custom_id")
        if custom_id in seen:
            raise InvalidRequest(f"requests.{i}.custom_id: {custom_id!r} is used twice", param=f"requests.{i}.custom_id")
        seen.add(custom_id)
        # Only the batch's own shape is checked here. Anthropic validates each request's params when it
        # runs and answers a bad one as that request's `errored` result, the others still run; the
        # Messages route does the same for a line here (a missing model or max_tokens included).
        if not isinstance(params, dict):
            raise InvalidRequest(f"requests.{i}.params: must be an object (a Messages request)", param=f"requests.{i}.params")
        if params.get("stream"):
            raise InvalidRequest(f"requests.{i}.params.stream: streaming is not supported in a batch", param=f"requests.{i}.params.stream")
        lines.append((custom_id, orjson.dumps(params).decode()))
    now = utcnow()
    batch = await state.batch_store.create({
        "id": new_batch_id("msgbatch_"), "account_id": principal.account_id, "key_id": principal.key_id, "api": "anthropic",
        "endpoint": "/v1/messages", "completion_window": "24h", "status": "validating",
        "created_at": now, "expires_at": now + timedelta(seconds=state.settings.batches.window_seconds or WINDOWS["24h"]),
    }, lines)
    state.batch_runner.wake()
    return json_response(_view(request, batch, await state.batch_store.counts(batch["id"])))


async def _own(request: Request) -> tuple[Any, dict[str, Any]]:
    state, principal = await _caller(request)
    batch_id = request.path_params["batch_id"]
    batch = await state.batch_store.get(batch_id, principal.account_id)
    if batch is None or batch["api"] != "anthropic":
        raise NotFound(f"message_batch {batch_id!r} not found")
    return state, batch


async def _retrieve(request: Request, request_id: str) -> Response:
    state, batch = await _own(request)
    return json_response(_view(request, batch, await state.batch_store.counts(batch["id"])))


async def _cancel(request: Request, request_id: str) -> Response:
    state, batch = await _own(request)
    if await state.batch_store.move(batch["id"], "cancelling", from_=("validating", "in_progress")):
        state.batch_runner.wake()
    found = await state.batch_store.get(batch["id"])
    return json_response(_view(request, found, await state.batch_store.counts(batch["id"])))


async def _results(request: Request, request_id: str) -> Response:
    state, batch = await _own(request)
    if batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        raise InvalidRequest(f"message_batch {batch['id']!r} has not ended yet; its results are not ready")
    lines = await state.batch_store.lines(batch["id"])
    body = b"".join(orjson.dumps(anthropic_line(line)) + b"\n" for line in lines if line.state == "done")
    return Response(body, media_type="application/binary")


async def _list(request: Request, request_id: str) -> Response:
    state, principal = await _caller(request)
    limit = query_limit(request, 20, 1000)
    after, before = request.query_params.get("after_id") or None, request.query_params.get("before_id") or None
    if after and before:
        raise InvalidRequest("give after_id or before_id, not both", param="before_id")
    # before_id: the page just newer than that batch (the SDK's way back), newest first like every page
    found = await state.batch_store.list(principal.account_id, "anthropic", limit=limit + 1, after=after, before=before)
    page = found[-limit:] if before else found[:limit]
    data = [_view(request, b, await state.batch_store.counts(b["id"])) for b in page]
    return json_response({"data": data, "has_more": len(found) > limit,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


async def _delete(request: Request, request_id: str) -> Response:
    state, batch = await _own(request)
    deleted = await state.batch_store.delete(batch["id"], batch["account_id"])
    if deleted is None:  # deleted by another call in between
        raise NotFound(f"message_batch {batch['id']!r} not found")
    if not deleted:
        raise InvalidRequest(f"message_batch {batch['id']!r} is still processing: cancel it, and delete it once it has ended")
    return json_response({"id": batch["id"], "type": "message_batch_deleted"})


def _route(handler: Any) -> Any:
    async def endpoint(request: Request) -> Any:
        response = await _answered(request, handler)
        # Anthropic's request id on every answer (the SDK's `_request_id`), as its errors carry it
        response.headers.setdefault("request-id", request_id_of(request))
        return response

    return endpoint


routes = [
    Route("/v1/messages/batches", _route(_create), methods=["POST"]),
    Route("/v1/messages/batches", _route(_list), methods=["GET"]),
    Route("/v1/messages/batches/{batch_id}", _route(_retrieve), methods=["GET"]),
    Route("/v1/messages/batches/{batch_id}", _route(_delete), methods=["DELETE"]),
    Route("/v1/messages/batches/{batch_id}/cancel", _route(_cancel), methods=["POST"]),
    Route("/v1/messages/batches/{batch_id}/results", _route(_results), methods=["GET"]),
]
