"""Structured JSON logs with a request id on every line, and the ASGI middleware that sets it.

Every request gets a server-made id (it is also the ledger row's `request_id` and is returned as
`x-request-id`). A client may send its own `x-request-id` (or `x-client-request-id`): when it is
a plain token (letters, digits, `._:-`, at most 128 characters) it is logged as
`client_request_id` and echoed back as `x-client-request-id`, with anything in it shaped like an API
key masked (`sk-***`: clients do send a key there by mistake); anything else is ignored. Headers,
bodies and query strings are never logged, and a key pasted into a path is masked, so keys cannot
leak through here.

A client that leaves before its response started (a non-streamed completion it stopped waiting for)
is logged and counted as 499, nginx's "client closed request", never as the 500 uvicorn would have
sent to a client still there.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from billing.keys.format import mask_keys
from gateway.api.anthropic.errors import in_the_apis_shape
from gateway.http.hardening import WATCH_KEY, repeated_query_parameter, secure

request_id_var: ContextVar[str | None] = ContextVar("tollgate_request_id", default=None)
client_request_id_var: ContextVar[str | None] = ContextVar("tollgate_client_request_id", default=None)
CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response started
access_log = logging.getLogger("tollgate.access")


def new_request_id() -> str:
    """128 random bits as 32 hex digits (uuid4's shape without building a UUID)."""
    return os.urandom(16).hex()


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (a fresh one when it runs without the middleware)."""
    rid = request.scope.get("state", {}).get("request_id")
    return rid if rid else new_request_id()


def client_request_id(raw_headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's own id from `x-request-id` (first) or `x-client-request-id`, when it is a plain
    token, with anything in it shaped like an API key masked; read from the ASGI scope's raw
    (lower-case) header list."""
    own = other = None
    for name, value in raw_headers:
        if name == b"x-request-id":
            if own is None:
                own = value
        elif name == b"x-client-request-id" and other is None:
            other = value
    raw = (own or other or b"").decode("latin-1")
    return mask_keys(raw) if raw and CLIENT_ID.fullmatch(raw) else None


@functools.lru_cache(maxsize=4)
def _second_text(sec: int) -> str:
    return datetime.fromtimestamp(sec, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def iso_ms(created: float) -> str:
    """`created` as ISO 8601 UTC with milliseconds (what `isoformat(timespec="milliseconds")` gives),
    the date and time of day formatted once a second."""
    sec = int(created)
    us = round((created - sec) * 1e6)  # as datetime rounds a timestamp: to the microsecond, half to even
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    return f"{_second_text(sec)}.{us // 1000:03d}+00:00"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, request ids, extra `fields`, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": iso_ms(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": mask_keys(record.getMessage()),  # a key a message or a library's exception text carries
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
            entry["exc"] = mask_keys(self.formatException(record.exc_info))
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """`TOLLGATE_LOG_FORMAT=text`: one plain line, with what is shaped like a key masked as in JSON."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_keys(super().format(record))


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    """Root logging for the server; uvicorn's loggers propagate here (run it with log_config=None)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    global _json_handler
    _json_handler = handler if fmt == "json" else None


_json_handler: logging.StreamHandler[Any] | None = None  # the handler configure_logging installed (json)


def write_access_line(msg: str, rid: str, crid: str | None, fields: dict[str, Any]) -> bool:
    """The access log's line, written the way the JSON handler would write the record
    `access_log.info(msg, extra={"fields": fields})` (the same keys in the same order), without
    building a LogRecord: every request writes one. Only while logging is as configure_logging left it
    (its JSON handler alone on the root, nothing added on the access logger); else False, and the
    caller logs through `logging`. A failed write is reported like the handler's own (handleError)."""
    handler = _json_handler
    root = logging.root
    if handler is None or root.handlers != [handler] or handler.filters or access_log.handlers or access_log.filters \
            or not access_log.propagate or root.filters:
        return False
    entry: dict[str, Any] = {"ts": iso_ms(time.time()), "level": "info", "logger": access_log.name, "msg": msg, "request_id": rid}
    if crid is not None:
        entry["client_request_id"] = crid
    entry.update(fields)
    line = orjson.dumps(entry, default=str).decode() + handler.terminator
    handler.acquire()
    try:
        handler.stream.write(line)
        handler.flush()
    except Exception:  # as StreamHandler.emit does: reported once, not written again through logging
        handler.handleError(logging.makeLogRecord({"name": access_log.name, "msg": msg}))
    finally:
        handler.release()
    return True


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
        crid = client_request_id(scope["headers"])
        scope.setdefault("state", {})["request_id"] = rid
        tokens = (request_id_var.set(rid), client_request_id_var.set(crid))
        status = 500
        responded = False
        started = time.perf_counter()
        # Whether the client has left: the guarded protocol's connection watch (`tollgate serve`),
        # else an `http.disconnect` seen on the way to the app.
        watch = scope.get(WATCH_KEY)
        left = False
        if watch is None:
            server_receive = receive

            async def receive_noting_disconnect() -> Message:
                nonlocal left
                message = await server_receive()
                if message["type"] == "http.disconnect":
                    left = True
                return message

            receive = receive_noting_disconnect

        async def send_with_ids(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                # A response that starts after the client left reaches no one: 499, as below.
                status = CLIENT_CLOSED_REQUEST if (watch.lost if watch is not None else left) else message["status"]
                responded = True
                ids = ((b"x-request-id", rid.encode()),)
                if crid is not None:
                    ids += ((b"x-client-request-id", crid.encode()),)
                message["headers"] = secure(message.get("headers") or [], ids)
            await send(message)

        try:
            query = scope.get("query_string")
            refused = repeated_query_parameter(query) if query else None
            if refused is not None:
                await in_the_apis_shape(refused, scope)(scope, receive, send_with_ids)
            else:
                await self.app(scope, receive, send_with_ids)
        except Exception as exc:
            if self.on_error is None or responded:
                raise
            await (await self.on_error(scope, exc))(scope, receive, send_with_ids)
        finally:
            if not responded and (watch.lost if watch is not None else left):
                status = CLIENT_CLOSED_REQUEST  # nothing was sent because nobody was listening, not a server error
            route = _route_name(scope)
            if access_log.isEnabledFor(logging.INFO):
                method = scope["method"]
                path = mask_keys(scope["path"])  # a key pasted into a URL stays out of the logs
                fields = {
                    "method": method, "path": path, "route": route, "status": status,
                    "duration_ms": round((time.perf_counter() - started) * 1000.0, 2),
                }
                if not write_access_line(f"{method} {path} {status}", rid, crid, fields):
                    access_log.info("%s %s %d", method, path, status, extra={"fields": fields})
            metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
            if metrics is not None:
                metrics.http_response(route, status)
            request_id_var.reset(tokens[0])
            client_request_id_var.reset(tokens[1])
