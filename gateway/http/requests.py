"""Request plumbing shared by the routes: bounded JSON bodies and bearer-key authentication (with
the suspension check for the routes that spend)."""

from __future__ import annotations

import re
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from billing.invoices.account_state import AccountStates
from billing.keys.store import KeyStore, KeyStoreUnavailable, Principal, looks_like_key
from gateway.batches.line import batch_line
from gateway.http.errors import AuthenticationFailed, InvalidRequest, NotFound, PayloadTooLarge, PermissionDenied, RequestTimeout, ServiceUnavailable


MAX_ID = 2**31 - 1  # ids are 32-bit integers in the database: anything larger is no id at all


def id_value(raw: str) -> int | None:
    """A path or query id: a positive 32-bit integer written in ASCII digits, else None."""
    if not re.fullmatch(r"[0-9]{1,10}", raw):
        return None
    value = int(raw)
    return value if 1 <= value <= MAX_ID else None


def query_limit(request: Request, default: int, most: int) -> int:
    """A list's `limit` query parameter: `default` when absent or empty (`?limit=`), else an integer
    from 1 to `most` in ASCII digits (not '²', which str.isdigit() takes, nor 5,000 digits), or a 400."""
    raw = request.query_params.get("limit")
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be an integer from 1 to {most}", param="limit")
    return int(raw)


def path_id(request: Request, name: str, what: str, param: str = "id") -> int:
    """The id in the path parameter `name`, or a 404 naming the kind of thing (`what`) not found."""
    value = id_value(request.path_params[name])
    if value is None:
        raise NotFound(f"No such {what}.", param=param)
    return value


def header(request: Request, name: bytes) -> str | None:
    """A request header's first value by its lower-case `name`, read off the ASGI scope's raw list
    (ASGI servers give names lower-cased). `request.headers.get` does the same through a KeyError
    for every absent header, which costs more than the rest of the lookup on the request path."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (413 past it); a client that leaves before it has
    arrived is a 408 nobody reads, not an unhandled error."""
    declared = header(request, b"content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:  # the client left (or the read deadline closed it): nobody reads the answer
        raise RequestTimeout("the request body did not arrive") from None
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> Any:
    body = await read_body(request, limit)
    if not body:
        raise InvalidRequest("request body is empty; send a JSON object")
    return _decode_json(body)


async def read_optional_json(request: Request, limit: int) -> Any:
    """The JSON body as read_json reads it, or None when the request sends none (an optional body)."""
    body = await read_body(request, limit)
    return _decode_json(body) if body.strip() else None


def _decode_json(body: bytes) -> Any:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.args[0] if exc.args else 'parse error'}") from None
    if b"\\u0000" in body and _has_nul(value):  # no database text column can hold one
        raise InvalidRequest("strings must not contain NUL characters (\\u0000)")
    if too_deep(body, value):
        raise InvalidRequest(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


# How deep a request's JSON may nest. orjson reads up to 1,024 levels, but what the gateway writes
# again (a batch line, a cache key, a tool call's arguments) must fit orjson.dumps' 255 and the json
# module's recursion; no API body needs more than a few dozen.
MAX_JSON_DEPTH = 128


def too_deep(raw: bytes | str, value: Any) -> bool:
    """Whether `value` (parsed from `raw`) nests more than MAX_JSON_DEPTH arrays and objects. A body
    with fewer brackets than that cannot: counted in C, so most bodies are never walked."""
    if (raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")) <= MAX_JSON_DEPTH:
        return False
    level = [(value, 1)]
    while level:
        item, depth = level.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        if isinstance(item, dict):
            level.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            level.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def _has_nul(value: Any) -> bool:
    stack = [value]  # iterative: JSON may nest deeper than Python's recursion limit
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def bearer_key(request: Request) -> str:
    given = header(request, b"authorization")
    if not given:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'.", code="missing_api_key"
        )
    scheme, _, value = given.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthenticationFailed("Authorization header must be 'Bearer <API key>'.")
    return value.strip()


async def authenticate(request: Request, keys: KeyStore, key: str | None = None, *, states: AccountStates | None = None) -> Principal:
    """The caller's principal; 401 for a missing, unknown, revoked or expired key (as OpenAI and
    Anthropic answer a revoked one: the SDKs' AuthenticationError; the code says which).
    `key`: found elsewhere than in `Authorization: Bearer` (Anthropic's `x-api-key`). `states`: for
    the routes that spend (generate, embed, batch), also 403 for a key of a suspended account (unpaid
    invoices; no I/O). A line of a batch (gateway/batches/runner.py) is its batch's principal."""
    line = batch_line(request.scope)
    if line is not None:
        principal = line.principal
    else:
        key = bearer_key(request) if key is None else key
        try:
            found = await keys.authenticate(key) if looks_like_key(key) else None
        except KeyStoreUnavailable:
            raise ServiceUnavailable("The key store is unavailable; retry shortly.", code="database_unavailable", headers={"Retry-After": "1"}) from None
        if found is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        if found.revoked:
            raise AuthenticationFailed("This API key has been revoked.", code="key_revoked")
        if found.expired():
            raise AuthenticationFailed("This API key has expired.", code="key_expired")
        principal = found
    suspended = states.suspension(principal) if states is not None else None
    if suspended is not None:
        raise PermissionDenied(suspended, code="account_suspended")
    return principal


async def authenticate_admin(request: Request, keys: KeyStore) -> Principal:
    principal = await authenticate(request, keys)
    if not principal.is_admin:
        raise PermissionDenied("This endpoint needs an admin key.", code="admin_required")
    return principal


def public_origin(request: Request) -> str:
    """The origin this request reached the server at: TOLLGATE_PUBLIC_URL when a proxy in front
    terminates TLS (the request itself then says http), else the request's own scheme and host."""
    configured = request.app.state.settings.http.public_url
    return configured or f"{request.url.scheme}://{request.url.netloc}"
