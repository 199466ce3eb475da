"""OpenAI's Files and Batch APIs: /v1/files and /v1/batches, per account (another account's file
or batch is not found)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from billing.batches.store import new_batch_id
from billing.models import utcnow
from gateway.batches.results import OPENAI_ENDPOINTS, WINDOWS, BadInput, openai_view, parse_input
from gateway.http.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge, RequestTimeout, ServiceUnavailable
from gateway.http.requests import authenticate, header, query_limit, read_json
from gateway.http.json_response import json_response

UPLOAD_PURPOSES = ("batch",)


def _state(request: Request) -> Any:
    state = request.app.state
    if state.batch_store is None:
        raise ServiceUnavailable("The Batch API is off on this server (TOLLGATE_BATCHES).", code="batches_disabled")
    return state


EXPIRY_SECONDS = (3600, 2_592_000)  # OpenAI's bounds of an expires_after: 1 hour to 30 days
# OpenAI: "By default, files with purpose=batch expire after 30 days" (its SDK's FileCreateParams.expires_after)
BATCH_FILE_SECONDS = 2_592_000


def expiry_seconds(anchor: Any, seconds: Any, param: str) -> int:
    """OpenAI's `expires_after` ({anchor: "created_at", seconds}) as seconds, or the 400 naming the part."""
    if anchor != "created_at":
        raise InvalidRequest(f"{param}.anchor must be 'created_at'", param=f"{param}.anchor", code="invalid_value")
    if isinstance(seconds, str) and seconds.isascii() and seconds.isdigit() and len(seconds) < 10:
        seconds = int(seconds)  # a multipart form's field is text
    if type(seconds) is not int or not EXPIRY_SECONDS[0] <= seconds <= EXPIRY_SECONDS[1]:
        raise InvalidRequest(f"{param}.seconds must be an integer from {EXPIRY_SECONDS[0]} (1 hour) to {EXPIRY_SECONDS[1]} (30 days)",
                             param=f"{param}.seconds", code="invalid_value")
    return seconds


METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's Metadata: 16 pairs, keys 64 characters, values 512


def check_metadata(metadata: Any) -> None:
    """OpenAI's Metadata, or the 400 saying which of its bounds this one passes (the pairs, a key's
    length, a value's length or type): one message for all of them named none of the lengths."""
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string keys and string values", param="metadata", code="invalid_value")
    if len(metadata) > METADATA_PAIRS:
        raise InvalidRequest(f"metadata has {len(metadata)} pairs; at most {METADATA_PAIRS}", param="metadata", code="invalid_value")
    for k, v in metadata.items():
        if len(k) > METADATA_KEY:
            raise InvalidRequest(f"metadata key {k[:METADATA_KEY]!r}... has {len(k)} characters; at most {METADATA_KEY}",
                                 param="metadata", code="invalid_value")
        if not isinstance(v, str):
            raise InvalidRequest(f"metadata value of {k!r} must be a string", param="metadata", code="invalid_value")
        if len(v) > METADATA_VALUE:
            raise InvalidRequest(f"metadata value of {k!r} has {len(v)} characters; at most {METADATA_VALUE}",
                                 param="metadata", code="invalid_value")


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="id", code="file_not_found")


# files ---------------------------------------------------------------------------------------------
async def upload_file(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    most = state.settings.batches.files_max_bytes
    declared = header(request, b"content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared[:19]) > most + 64 * 1024:  # the form's own bytes besides the file
        raise PayloadTooLarge(f"the file is larger than the {most}-byte limit", param="file")
    if not (header(request, b"content-type") or "").startswith("multipart/form-data"):
        raise InvalidRequest("send the file as multipart/form-data with the fields file and purpose", param="file")
    try:
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, filename, content, expires_after = await _upload_of(form, most)
    except ClientDisconnect:  # the client left mid-upload: nobody reads the answer
        raise RequestTimeout("the upload did not arrive") from None
    if len(content) > most:
        raise PayloadTooLarge(f"the file is larger than the {most}-byte limit", param="file")
    if not content:
        raise InvalidRequest("the file is empty", param="file")
    info = await state.files.put(principal.account_id, purpose, filename, content, expires_after)
    return json_response(info.view())


async def _upload_of(form: Any, most: int) -> tuple[str, str, bytes, int | None]:
    """The form's purpose, filename, content (at most `most` + 1 bytes read) and expires_after."""
    purpose = form.get("purpose")
    upload = form.get("file")
    if not isinstance(purpose, str) or not purpose:
        raise InvalidRequest("purpose is required", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"purpose {purpose!r} is not supported here; use one of {list(UPLOAD_PURPOSES)}", param="purpose",
                             code="invalid_purpose")
    if upload is None or isinstance(upload, str):
        raise InvalidRequest("file is required", param="file")
    filename = (upload.filename or "upload.jsonl")[:255]
    if "\x00" in filename:  # kept in a text column
        raise InvalidRequest("the file's name must not contain NUL characters (\\u0000)", param="file")
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    # None asked: a batch input file expires after 30 days, as at OpenAI (it was kept until deleted, `expires_at: null`)
    expires_after = BATCH_FILE_SECONDS if anchor is None and seconds is None else expiry_seconds(anchor, seconds, "expires_after")
    return purpose, filename, await upload.read(most + 1), expires_after


async def list_files(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    limit = query_limit(request, 10_000, 10_000)  # OpenAI's default and most
    order = request.query_params.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    found = await state.files.list(principal.account_id, purpose=request.query_params.get("purpose") or None, limit=limit + 1,
                                   after=request.query_params.get("after") or None, ascending=order == "asc")
    data = [f.view() for f in found[:limit]]
    return json_response({"object": "list", "data": data, "has_more": len(found) > limit,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


async def get_file(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    file_id = request.path_params["file_id"]
    info = await state.files.get(principal.account_id, file_id)
    if info is None:
        raise _no_file(file_id)
    return json_response(info.view())


async def file_content(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    file_id = request.path_params["file_id"]
    content = await state.files.content(principal.account_id, file_id)
    if content is None:
        raise _no_file(file_id)
    return Response(content, media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    file_id = request.path_params["file_id"]
    if not await state.files.delete(principal.account_id, file_id):
        raise _no_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


# batches -------------------------------------------------------------------------------------------
async def create_batch(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys, states=state.billing.states)  # 403 for a suspended account
    body = await read_json(request, state.settings.http.max_body_bytes)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    file_id, endpoint, window, metadata = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window"), body.get("metadata")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("input_file_id is required", param="input_file_id")
    if endpoint not in OPENAI_ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {list(OPENAI_ENDPOINTS)}", param="endpoint", code="invalid_value")
    if not isinstance(window, str) or window not in WINDOWS:  # a list or object is no key of WINDOWS
        raise InvalidRequest(f"completion_window must be one of {list(WINDOWS)}", param="completion_window", code="invalid_value")
    if metadata is not None:
        check_metadata(metadata)
    output_expiry = body.get("output_expires_after")
    if output_expiry is not None:
        if not isinstance(output_expiry, dict):
            raise InvalidRequest("output_expires_after must be an object {anchor, seconds}", param="output_expires_after")
        output_expiry = expiry_seconds(output_expiry.get("anchor"), output_expiry.get("seconds"), "output_expires_after")
    info = await state.files.get(principal.account_id, file_id)
    if info is None:
        raise _no_file(file_id)
    if info.purpose != "batch":
        raise InvalidRequest(f"file {file_id} has purpose {info.purpose!r}; a batch's input file has purpose 'batch'",
                             param="input_file_id", code="invalid_purpose")
    content = await state.files.content(principal.account_id, file_id) or b""
    now = utcnow()
    values: dict[str, Any] = {
        "id": new_batch_id(), "account_id": principal.account_id, "key_id": principal.key_id, "api": "openai",
        "endpoint": endpoint, "input_file_id": file_id, "completion_window": window, "status": "validating",
        "metadata_json": orjson.dumps(metadata).decode() if metadata else None, "output_expires_seconds": output_expiry,
        "created_at": now, "expires_at": now + timedelta(seconds=state.settings.batches.window_seconds or WINDOWS[window]),
    }
    try:
        lines, values["model"] = parse_input(content, endpoint, state.settings.batches.max_lines)
    except BadInput as exc:
        # As OpenAI: the batch is made and fails its validation, the reason in `errors.data` (the
        # line, OpenAI's code); nothing of it runs or is billed.
        values.update(status="failed", failed_at=now, errors_json=orjson.dumps([exc.error()]).decode())
        lines = []
    batch = await state.batch_store.create(values, lines)
    if lines:
        state.batch_runner.wake()
    return json_response(await _view(state, batch))


async def _view(state: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's Batch object: its lines' counts and the usage its ledger rows hold so far."""
    return openai_view(batch, await state.batch_store.counts(batch["id"]), await state.batch_store.tokens(batch))


async def _own_batch(request: Request) -> tuple[Any, dict[str, Any]]:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    batch_id = request.path_params["batch_id"]
    batch = await state.batch_store.get(batch_id, principal.account_id)
    if batch is None or batch["api"] != "openai":
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")
    return state, batch


async def get_batch(request: Request) -> Response:
    state, batch = await _own_batch(request)
    return json_response(await _view(state, batch))


async def cancel_batch(request: Request) -> Response:
    state, batch = await _own_batch(request)
    if await state.batch_store.move(batch["id"], "cancelling", from_=("validating", "in_progress")):
        state.batch_runner.wake()
    elif batch["status"] not in ("cancelling", "cancelled"):
        # OpenAI's answer (409, its SDK's ConflictError): "Cannot cancel a batch with status 'completed'."
        raise Conflict(f"Cannot cancel a batch with status '{batch['status']}'.", param="batch_id", code="invalid_state")
    found = await state.batch_store.get(batch["id"])
    return json_response(await _view(state, found))


async def list_batches(request: Request) -> Response:
    state = _state(request)
    principal = await authenticate(request, state.keys)
    limit = query_limit(request, 20, 100)
    found = await state.batch_store.list(principal.account_id, "openai", limit=limit + 1, after=request.query_params.get("after") or None)
    data = [await _view(state, b) for b in found[:limit]]
    return json_response({"object": "list", "data": data, "has_more": len(found) > limit,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


routes = [
    Route("/v1/files", upload_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
]
