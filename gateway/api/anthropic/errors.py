"""Anthropic's error shape for the gateway's errors: `{"type": "error", "error": {"type", "message"}}`
with Anthropic's status codes. Apart from the Messages routes (gateway/api/anthropic/messages.py) so that
what answers before a route runs (the drain's refusal, an unknown path or method, a repeated query
parameter: `in_the_apis_shape`) can speak it too.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.http.errors import APIError, EngineOverloaded
from gateway.http.json_response import json_response

ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status == 529:
        return "overloaded_error"
    return "api_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error")


def error_shape(err: APIError, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    """Anthropic's status and body for one of our errors: a full engine is 529 `overloaded_error`
    (what Anthropic's SDKs retry); other 5xx are `api_error`, 4xx their Anthropic type; a prepaid
    balance or a monthly limit is a 400 `invalid_request_error`, as Anthropic answers a credit
    balance too low or usage limits reached (a 429 there is a rate limit, which its SDK retries). The body
    carries the request's id (`request_id`, as Anthropic's do) when there is one."""
    if isinstance(err, EngineOverloaded):
        status, kind = 529, "overloaded_error"
    elif err.error_type == "insufficient_quota":  # a balance or spend limit: Anthropic's is a 400 (credit too low, usage limits)
        status, kind = 400, "invalid_request_error"
    else:
        status, kind = err.status_code, anthropic_type(err.status_code)
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return status, body


def error_response(err: APIError, request_id: str) -> Response:
    status, body = error_shape(err, request_id)
    headers = {**err.headers, "request-id": request_id, "x-request-id": request_id}
    return json_response(body, status, headers)


def anthropic_caller(request: Any) -> bool:
    """Whether the request speaks Anthropic's API (its SDKs send both headers; OpenAI's neither)."""
    return "anthropic-version" in request.headers or "x-api-key" in request.headers


def in_the_apis_shape(err: APIError, scope: Any) -> Response:
    """`err` in the shape of the API the request called, for what answers before (or instead of) its
    route: Anthropic's on the Messages routes (its SDKs read `error.type`), else OpenAI's."""
    if scope.get("path", "").startswith("/v1/messages"):
        return error_response(err, scope.get("state", {}).get("request_id", ""))
    return err.response()
