"""Defences against hostile clients that the routes never see (docs/reliability.md).

    guarded_http_protocol()   uvicorn's httptools protocol with a deadline for receiving each request
                              (slowloris: 408 and the connection closed) and a cap on header bytes (431)
    secure()                  `nosniff` on every response; HTML pages without their own policy get a
                              strict CSP, no framing and no referrer
    repeated_query_parameter() a query parameter given twice is a 400, not whichever copy a handler reads

The last two run inside gateway/http/logs.py's RequestContext, the app's one middleware layer (one
`send` wrapper per request instead of three: docs/performance.md).

Request bodies are capped by `read_json` (413); malformed JSON, invalid UTF-8 and JSON nested
deeper than orjson's limit are 400s there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.api.anthropic.errors import in_the_apis_shape
from gateway.http.errors import APIError, HeadersTooLarge, InvalidRequest, RequestTimeout

log = logging.getLogger("tollgate.hardening")

PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


WATCH_KEY = "tollgate.connection_watch"


class ConnectionWatch:
    """Put in each request's scope by the guarded protocol: a response that waits on its engine
    without reading the request registers what to do when the client goes away, instead of running
    a task that waits for `http.disconnect` (one task fewer per request)."""

    __slots__ = ("lost", "_callbacks")

    def __init__(self) -> None:
        self.lost = False
        self._callbacks: list[Any] = []

    def on_lost(self, callback: Any) -> None:
        """`callback()` when the connection is lost before the response completes (at once if it
        already was)."""
        if self.lost:
            callback()
        else:
            self._callbacks.append(callback)

    def forget(self) -> None:
        self._callbacks.clear()

    def fire(self) -> None:
        self.lost = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a response's cancel must not break the protocol
                log.exception("disconnect callback failed")


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """Each request must arrive whole (headers and body) within `read_timeout` of its first byte
    (or of the connection opening); its headers may take at most `max_header_bytes`."""

    read_timeout = 30.0
    max_header_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers = True
        self._pending_bytes = 0  # bytes received since the current request's headers began
        self._header_bytes = 0  # URL and header bytes the parser has seen for it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # flow control keeps the real transport
        self.transport = HeadWithBody(transport, self.loop)  # type: ignore[assignment]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            watch = cycle.scope.get(WATCH_KEY)
            if watch is not None:
                watch.fire()

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            self._pending_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._pending_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, self._too_large())  # still no end of the headers in sight

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[WATCH_KEY] = ConnectionWatch()  # type: ignore[literal-required]
        self._header_bytes = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if self._header_bytes <= self.max_header_bytes:
            super().on_headers_complete()
            return
        # The whole header block came at once: answer 431 through a normal cycle instead of the app.
        app, self.app = self.app, _refusing_app(self._too_large())
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(f"request headers are larger than the {self.max_header_bytes}-byte limit")

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_headers, self._pending_bytes = True, 0
        super().on_message_complete()
        # The whole request is in: reading paused for a large body resumes, so that a client that
        # leaves is seen (its ConnectionWatch fires) while the response waits on the engine. Not for
        # a pipelined request queued behind the current one: that pause bounds what a client can queue.
        if not self.pipeline:
            self.flow.resume_reading()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            self._refuse(408, RequestTimeout(f"the request was not received within {self.read_timeout:g} seconds"))
        else:
            # The app already answered (e.g. 401 before reading the body) but the body never came.
            log.warning("closing a connection whose request body did not arrive within %gs", self.read_timeout)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request the parser refused (conflicting Content-Length and Transfer-Encoding, a bad
        length, bytes no request line has): a 400 in the API's shape, as the 408 and 431 are, not
        uvicorn's plain text."""
        self._refuse(400, InvalidRequest(f"the HTTP request is malformed: {msg.rstrip('.')}", code="malformed_request"))

    def _refuse(self, status: int, err: APIError) -> None:
        # in the shape of the API called (Anthropic's on /v1/messages), as far as the request line came
        path = self.cycle.scope.get("path", "") if self.cycle is not None else (getattr(self, "url", b"") or b"").decode("latin-1")
        body = in_the_apis_shape(err, {"path": path}).body
        head = STATUS_LINE[status] + b"content-type: application/json\r\nconnection: close\r\n"
        head += b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        self.transport.write(head + bytes(body))
        self.transport.close()


class HeadWithBody:
    """The connection's transport, except that a response head (a write that starts with a status
    line) waits for the next write, the body's first bytes, and leaves with it in one send: uvicorn
    writes the head and the body separately, and on loopback each send costs tens of microseconds
    (docs/performance.md). A head that no write follows in the same event-loop turn goes out alone at
    the start of the next; closing sends it first."""

    __slots__ = ("_transport", "_loop", "_head", "_alone", "is_closing")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        # The transport's own method, bound here: uvicorn asks it as each response completes and the
        # guarded protocol asks it too (3 times a streamed request, counted in bench/request_path.py's
        # run); through __getattr__ each was one more Python call.
        self.is_closing = transport.is_closing
        self._loop = loop
        self._head: bytes | None = None
        self._alone: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._alone.cancel()  # type: ignore[union-attr]
            self._transport.write(head + data)
        elif data[:5] == b"HTTP/":
            self._head = data
            self._alone = self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        if self._head is not None:
            self._alone.cancel()  # type: ignore[union-attr]
            self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's
        return getattr(self._transport, name)


def _refusing_app(err: APIError) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = in_the_apis_shape(err, scope)
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    return app


def guarded_http_protocol(*, read_timeout: float = 30.0, max_header_bytes: int = 64 * 1024) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits."""
    return type(
        "GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"read_timeout": read_timeout, "max_header_bytes": max_header_bytes}
    )


def _worker_limits() -> tuple[float, int]:
    from gateway.config import worker_settings

    settings = worker_settings()
    if settings is None:
        return GuardedHttpToolsProtocol.read_timeout, GuardedHttpToolsProtocol.max_header_bytes
    return settings.http.request_read_timeout, settings.http.max_header_bytes


class EnvGuardedHttpToolsProtocol(GuardedHttpToolsProtocol):
    """The guarded protocol by import string, for worker processes (`tollgate serve --workers N`):
    its limits come from the Settings the parent handed its workers (gateway/config.py:for_workers)."""

    read_timeout, max_header_bytes = _worker_limits()


def repeated_query_parameter(query: bytes) -> APIError | None:
    """Every query parameter of this API takes one value: a repeated one (`?account_id=1&account_id=2`,
    parameter pollution) in a request's query string is a 400 rather than whichever copy a handler
    happens to read. The caller asks only for a request that has a query string (most have none)."""
    names = [name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True)]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return InvalidRequest(f"query parameter {repeated[0]!r} is given more than once", param=repeated[0])
    return None


_PAGE_RAW = [(name.encode(), value.encode()) for name, value in PAGE_HEADERS.items()]


def secure(raw: list[tuple[bytes, bytes]], extra: tuple[tuple[bytes, bytes], ...] = ()) -> list[tuple[bytes, bytes]]:
    """A response's raw headers with `extra` (names not already there) and `nosniff` added; HTML pages
    without their own policy also get the strict page headers. ASGI header names are lower-case."""
    names = {name.lower() for name, _ in raw}
    out = list(raw)
    out += [h for h in extra if h[0] not in names]
    if b"x-content-type-options" not in names:
        out.append((b"x-content-type-options", b"nosniff"))
    if b"content-security-policy" not in names:
        ctype = next((v for n, v in raw if n.lower() == b"content-type"), b"")
        if ctype.startswith(b"text/html"):
            out += [h for h in _PAGE_RAW if h[0] not in names]
    return out
