"""Structured JSON logs with a request id on every line, and the ASGI middleware that sets it.

Every request gets a server-made id (it is also the ledger row's `request_id` and is returned as
`x-request-id`). A client may send its own `x-request-id` (or `x-client-request-id`): when it is
a plain token (letters, digits, `._:-`, at most 128 characters) it is logged as
`client_request_id` and echoed back as `x-client-request-id`; anything else is ignored. Headers,
bodies and query strings are never logged, so keys cannot leak through here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

import orjson
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.hardening import repeated_query_parameter, secure

request_id_var: ContextVar[str | None] = ContextVar("tollgate_request_id", default=None)
client_request_id_var: ContextVar[str | None] = ContextVar("tollgate_client_request_id", default=None)
CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
KEY_LIKE = re.compile(r"sk-[A-Za-z0-9_\-]{4,}")
access_log = logging.getLogger("tollgate.access")


def new_request_id() -> str:
    """128 random bits as 32 hex digits (uuid4's shape without building a UUID)."""
    return os.urandom(16).hex()


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (a fresh one when it runs without the middleware)."""
    rid = request.scope.get("state", {}).get("request_id")
    return rid if rid else new_request_id()


def client_request_id(headers: Headers) -> str | None:
    raw = headers.get("x-request-id") or headers.get("x-client-request-id")
    return raw if raw is not None and CLIENT_ID.fullmatch(raw) else None


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, request ids, extra `fields`, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid is not None:
            entry["request_id"] = rid
        crid = client_request_id_var.get()
        if crid is not None:
            entry["client_request_id"] = crid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    """Root logging for the server; uvicorn's loggers propagate here (run it with log_config=None)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def _route_name(scope: Scope) -> str:
    endpoint = scope.get("endpoint")
    if endpoint is None:
        return "unmatched"
    return getattr(endpoint, "__name__", type(endpoint).__name__)


class RequestContext:
    """Plain ASGI (keeps streaming and context variables intact), the app's one middleware: request
    ids, access log, HTTP metrics, security headers and the repeated-query-parameter guard."""

    def __init__(self, app: ASGIApp, on_error: Any = None) -> None:
        self.app = app
        # With `on_error(scope, exc) -> ASGI response`, an exception before the response started is
        # answered here (the generation routes, dispatched without Starlette's error middleware).
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        crid = client_request_id(Headers(scope=scope))
        scope.setdefault("state", {})["request_id"] = rid
        tokens = (request_id_var.set(rid), client_request_id_var.set(crid))
        status = 500
        responded = False
        started = time.perf_counter()

        async def send_with_ids(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status = message["status"]
                responded = True
                ids = ((b"x-request-id", rid.encode()),)
                if crid is not None:
                    ids += ((b"x-client-request-id", crid.encode()),)
                message["headers"] = secure(message.get("headers") or [], ids)
            await send(message)

        try:
            refused = repeated_query_parameter(scope)
            if refused is not None:
                await refused.response()(scope, receive, send_with_ids)
            else:
                await self.app(scope, receive, send_with_ids)
        except Exception as exc:
            if self.on_error is None or responded:
                raise
            await (await self.on_error(scope, exc))(scope, receive, send_with_ids)
        finally:
            route = _route_name(scope)
            if access_log.isEnabledFor(logging.INFO):
                path = KEY_LIKE.sub("sk-***", scope["path"])  # a key pasted into a URL stays out of the logs
                access_log.info(
                    "%s %s %d", scope["method"], path, status,
                    extra={"fields": {
                        "method": scope["method"], "path": path, "route": route, "status": status,
                        "duration_ms": round((time.perf_counter() - started) * 1000.0, 2),
                    }},
                )
            metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
            if metrics is not None:
                metrics.http_response(route, status)
            request_id_var.reset(tokens[0])
            client_request_id_var.reset(tokens[1])
