"""What an exception raised by a route becomes: the API's error body, never a bare 500.

    APIError       its own status and body (gateway/http/errors.py draws the tree)
    HTTPException  Starlette's (404 unknown path, 405 method), in the same shape
    anything else  503 `database_unavailable` for an outage of the database, else a logged 500
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from billing.keys.format import mask_keys
from gateway.api.anthropic.errors import anthropic_caller, in_the_apis_shape
from gateway.api.anthropic.errors import error_response as anthropic_error_response
from gateway.http.errors import APIError, MethodNotAllowed, NotFound, ServiceUnavailable

log = logging.getLogger("tollgate")


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        err: APIError = MethodNotAllowed(f"Method {request.method} is not allowed for {request.url.path}.")
    elif exc.status_code == 404:
        err = NotFound(f"Unknown path {request.url.path}.")
        if anthropic_caller(request):
            # A path no route has, asked by a caller that speaks Anthropic's API (its SDKs send both):
            # Anthropic's not_found_error, which those SDKs read, whatever the path.
            return anthropic_error_response(err, request.scope.get("state", {}).get("request_id", ""))
    else:
        err = APIError(str(exc.detail))
        err.status_code = exc.status_code
        err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return in_the_apis_shape(err, request.scope)


async def unexpected_error(request: Request, exc: Exception) -> Response:
    if database_unreachable(exc):  # an outage, not a bug: say so, and that a retry may work
        log.warning("database unreachable on %s %s: %s", request.method, mask_keys(request.url.path), type(exc).__name__)
        return ServiceUnavailable("The database is unavailable; retry shortly.", code="database_unavailable",
                                  headers={"Retry-After": "1"}).response()
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, mask_keys(request.url.path), exc_info=exc)  # a key pasted into a path
    return APIError("The server had an error while processing your request.").response()


async def error_response(scope: Any, exc: Exception) -> Any:
    """What Starlette's exception handlers would answer, for the routes dispatched without them."""
    request = Request(scope)
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, HTTPException):
        return await http_error(request, exc)
    return await unexpected_error(request, exc)


def database_unreachable(exc: BaseException) -> bool:
    if isinstance(exc, (OperationalError, InterfaceError)) or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
        return True
    return isinstance(exc, (ConnectionError, asyncio.TimeoutError, TimeoutError)) or (
        isinstance(exc, OSError) and exc.errno is not None and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH)
    )


# The app's exception handlers (Starlette's), by the exception they answer.
HANDLERS: dict[Any, Any] = {APIError: api_error, HTTPException: http_error, Exception: unexpected_error}
