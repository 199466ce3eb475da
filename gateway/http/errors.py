"""Errors the API returns, always shaped like OpenAI's.

    APIError (500, server_error)
     ├── InvalidRequest (400, invalid_request_error)
     │    └── ContextLengthExceeded (400, code context_length_exceeded)
     ├── AuthenticationFailed (401, invalid_request_error, code invalid_api_key)
     ├── PermissionDenied (403, permission_error)
     ├── NotFound (404, invalid_request_error)
     │    └── ModelNotFound (404, code model_not_found)
     ├── MethodNotAllowed (405)
     ├── RequestTimeout (408, code request_timeout): the request did not arrive in time
     ├── Conflict (409)
     ├── PayloadTooLarge (413)
     ├── HeadersTooLarge (431)
     ├── RateLimited (429, rate_limit_exceeded)
     └── ServiceUnavailable (503, service_unavailable)
          ├── EngineOverloaded (503, code engine_overloaded)
          └── EngineNotReady (503, code engine_not_ready)

Messages never contain API keys.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from billing.keys.format import mask_keys
from gateway.http.json_response import json_response

# Anything shaped like an API key is masked in every error message, whatever echoed it (the same
# rule as the logs and echoed headers: billing/keys/format.py).
redact = mask_keys


class APIError(Exception):
    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = redact(message)
        super().__init__(message)
        self.message = message
        self.param = redact(param) if param else param  # a field named by the caller: `metadata.sk-...`
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return json_response(self.body(), self.status_code, self.headers)


class InvalidRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(APIError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status_code = 403
    error_type = "permission_error"


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(APIError):
    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(APIError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"


class RequestTimeout(APIError):
    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class HeadersTooLarge(APIError):
    status_code = 431
    error_type = "invalid_request_error"
    code = "headers_too_large"


class PayloadTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class RateLimited(APIError):
    status_code = 429
    error_type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class ServiceUnavailable(APIError):
    status_code = 503
    error_type = "service_unavailable"
    code = "service_unavailable"


class EngineOverloaded(ServiceUnavailable):
    code = "engine_overloaded"


class EngineNotReady(ServiceUnavailable):
    code = "engine_not_ready"
