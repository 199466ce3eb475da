"""Request plumbing shared by the routes: bounded JSON bodies and bearer-key authentication."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from billing.keys import KeyStore, Principal, looks_like_key
from gateway.errors import AuthenticationFailed, InvalidRequest, PayloadTooLarge, PermissionDenied


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise InvalidRequest("request body is empty; send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.args[0] if exc.args else 'parse error'}") from None


def bearer_key(request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'.", code="missing_api_key"
        )
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthenticationFailed("Authorization header must be 'Bearer <API key>'.")
    return value.strip()


async def authenticate(request: Request, keys: KeyStore) -> Principal:
    """The caller's principal; 401 for a missing or unknown key, 403 for a revoked or expired one."""
    key = bearer_key(request)
    principal = await keys.authenticate(key) if looks_like_key(key) else None
    if principal is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    if principal.revoked:
        raise PermissionDenied("This API key has been revoked.", code="key_revoked")
    if principal.expired():
        raise PermissionDenied("This API key has expired.", code="key_expired")
    return principal


async def authenticate_admin(request: Request, keys: KeyStore) -> Principal:
    principal = await authenticate(request, keys)
    if not principal.is_admin:
        raise PermissionDenied("This endpoint needs an admin key.", code="admin_required")
    return principal
