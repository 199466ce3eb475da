"""A lean HTTP/1.1 client for the `openai` backend's streamed POSTs to plain-http replicas.

The profile of the gateway in front of a fast upstream (docs/performance.md) put ~38% of the
process's time in one httpx exchange per request, most of it in httpcore's pool bookkeeping and
anyio's stream layers rather than in moving bytes. This client does only what the pool needs:

    - keep-alive connections per (host, port), reused last-in first-out, dropped after
      `keepalive_expiry` idle seconds or when the server closes them;
    - one write per request (head and JSON body), TCP_NODELAY;
    - the response parsed by httptools (the C parser uvicorn already uses), chunked or sized
      bodies alike; a 200 body is split into SSE events as it arrives and put on the exchange's
      queue (the events of one read as one item), any other status is read whole (up to 64 KiB kept) and put as ("status", ...).

It speaks to the `_Exchange` protocol of engines/backends/openai_pool.py: a `queue` of ("data", str),
("events", [payload, ...]) (the events of one read together, each a str or the bytes after
`data: `), ("status", (code, bytes)), ("eof", None), ("error", str) and ("cancel", None) items,
`interrupt()` and `close(grace)`. https replicas keep using httpx (TLS is not this module's job).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import httptools

from engines.backends.openai_stream import SSEDecoder

MAX_ERROR_BODY = 65536


class Inbox:
    """An exchange's items for its one consumer: what it used of asyncio.Queue (put_nowait, empty,
    get_nowait, get) without the queue's Event, putter line and task accounting, and a `get` with
    a deadline of its own (a timer on the waiter instead of an `asyncio.timeout` scope around it)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[tuple[str, Any]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: tuple[str, Any]) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> tuple[str, Any]:
        """The oldest item; IndexError when there is none."""
        return self._items.popleft()

    async def get(self, timeout: float | None = None) -> tuple[str, Any]:
        """The oldest item, waiting for one; TimeoutError after `timeout` seconds without one."""
        while not self._items:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        return self._items.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the exchange using it gets the parsed response."""

    def __init__(self, pool: "UpstreamPool", key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.exchange: "LeanExchange | None" = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: Any = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._parser is None:
            self._fail("data from the upstream with no request in flight")
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("the upstream switched protocols")
        except httptools.HttpParserError as exc:
            self._fail(f"RemoteProtocolError: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.lost(f"ReadError: {exc}" if exc else "RemoteProtocolError: the upstream closed the connection")

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost follows

    # a request
    def send(self, exchange: "LeanExchange", head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.exchange = exchange
        self._parser = httptools.HttpResponseParser(exchange)
        self.transport.write(head + body)

    def finished(self, keep_alive: bool) -> None:
        """The exchange read its response to the end."""
        self.exchange, self._parser = None, None
        if keep_alive and not self.closed:
            self.pool.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        self.exchange = None
        if self.transport is not None:
            self.transport.close()

    def _fail(self, reason: str) -> None:
        exchange, self.exchange = self.exchange, None
        self.close()
        if exchange is not None:
            exchange.lost(reason)


class UpstreamPool:
    """Idle keep-alive connections per (host, port)."""

    def __init__(self, *, connect_timeout: float, keepalive_expiry: float, max_idle: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_expiry = keepalive_expiry
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self.opened = 0  # connections made, for tests and metrics

    @staticmethod
    def handles(url: str) -> bool:
        return url.startswith("http://")

    def idle_connection(self, host: str, port: int) -> _Connection | None:
        """The most recently used live idle connection to (host, port), or None."""
        idle = self._idle.get((host, port))
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.close()
        return None

    async def connection(self, host: str, port: int) -> _Connection:
        key = (host, port)
        conn = self.idle_connection(host, port)
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, protocol = await loop.create_connection(lambda: _Connection(self, key), host, port)
        self.opened += 1
        return protocol

    def put_back(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        if len(idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def exchange(self, url: str, body: bytes, headers: dict[str, str]) -> "LeanExchange":
        return LeanExchange(self, url, body, headers)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


@functools.lru_cache(maxsize=256)
def _request_parts(url: str, headers: tuple[tuple[str, str], ...]) -> tuple[str, int, bytes, bytes]:
    """(host, port, the request head up to the content length's value, the rest of the head): the
    same for every request to one URL with the same headers, so built once."""
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    start = f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-length: ".encode("latin-1")
    rest = "".join(f"\r\n{name}: {value}" for name, value in (("connection", "keep-alive"), *headers)) + "\r\n\r\n"
    return parts.hostname or "127.0.0.1", parts.port or 80, start, rest.encode("latin-1")


class LeanExchange:
    """One streamed POST; also the httptools callback object for its response."""

    def __init__(self, pool: UpstreamPool, url: str, body: bytes, headers: dict[str, str]) -> None:
        self.queue = Inbox()
        self._pool = pool
        self._conn: _Connection | None = None
        self._status = 0
        self._error_body = bytearray()
        self._pending = b""  # an incomplete SSE event (an incomplete line once `_whole_events` is off)
        self._whole_events = True  # events cut at blank lines while the body has no CR line ends
        self._sse: SSEDecoder | None = None  # made when an event needs it (most never do)
        self._ending: asyncio.Future[None] | None = None  # what close(grace) waits on, while it does
        self._ended = False  # the response was read to its end, or the exchange failed
        host, port, start, rest = _request_parts(url, tuple(headers.items()))
        self._head = start + b"%d" % len(body) + rest
        self._body = body
        conn = pool.idle_connection(host, port)
        self.task: asyncio.Task[None] | None = None
        if conn is not None:  # the usual case: a kept-alive connection, the request goes out now
            self._conn = conn
            try:
                conn.send(self, self._head, body)
            except Exception as exc:  # a transport that broke while idle: the pool moves on
                self._conn = None
                conn.close()
                self._end(("error", f"WriteError: {type(exc).__name__}"))
        else:
            self.task = asyncio.get_running_loop().create_task(self._start(host, port))

    async def _start(self, host: str, port: int) -> None:
        try:
            conn = await self._pool.connection(host, port)
        except TimeoutError:
            self._end(("error", "ConnectTimeout"))
            return
        except OSError as exc:
            self._end(("error", f"ConnectError: {exc}"))
            return
        if self._ended:  # closed while connecting
            self._pool.put_back(conn)
            return
        self._conn = conn
        conn.send(self, self._head, self._body)

    # httptools callbacks --------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        assert self._conn is not None and self._conn._parser is not None
        self._status = self._conn._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            if len(self._error_body) < MAX_ERROR_BODY:
                self._error_body += body[: MAX_ERROR_BODY - len(self._error_body)]
            return
        data = self._pending + body if self._pending else body
        if self._whole_events and b"\r" not in data:
            self._pending = self._take_events(data)
            return
        self._whole_events = False  # CR line ends: line by line from here on (the decoder keeps state)
        lines = data.split(b"\n")
        self._pending = lines.pop()
        events = self._feed(lines)
        if events:
            self.queue.put_nowait(("events", events))

    def _take_events(self, data: bytes) -> bytes:
        """The complete events of `data` onto the queue as one item; returns the incomplete rest.
        An event that is one `data:` line (what OpenAI, vLLM and trtllm-serve send) is cut out of
        the bytes as it is; anything else (comments, several lines, other fields) goes through the
        decoder with the blank line that ended it. Between events the decoder holds nothing, so
        both ways agree."""
        parts = data.split(b"\n\n")
        rest = parts.pop()
        events: list[bytes | str] = []
        for part in parts:
            if part[:5] == b"data:" and b"\n" not in part:
                events.append(part[6:] if part[5:6] == b" " else part[5:])
            else:
                events += self._feed([*part.split(b"\n"), b""])
        if events:
            self.queue.put_nowait(("events", events))
        return rest

    def _feed(self, lines: list[bytes]) -> list[str]:
        """Lines (without their LF; a CR before it dropped) through the decoder: the events they end."""
        if self._sse is None:
            self._sse = SSEDecoder()
        feed = self._sse.feed
        return [e for e in (feed(line.rstrip(b"\r").decode("utf-8", "replace")) for line in lines) if e is not None]

    def on_message_complete(self) -> None:
        conn = self._conn
        keep_alive = bool(conn is not None and conn._parser is not None and conn._parser.should_keep_alive())
        if self._status == 200:
            if self._pending or self._sse is not None:  # else nothing is left to end: no decoder needed
                events = self._feed([*self._pending.split(b"\n"), b""])  # the body's end ends its last event
                if events:
                    self.queue.put_nowait(("events", events))
            item: tuple[str, Any] = ("eof", None)
        else:
            item = ("status", (self._status, bytes(self._error_body)))
        self._conn = None
        if conn is not None:
            conn.finished(keep_alive)
        self._end(item)

    # the connection's news -------------------------------------------------------------------
    def lost(self, reason: str) -> None:
        self._conn = None
        self._end(("error", reason))

    def _end(self, item: tuple[str, Any]) -> None:
        if not self._ended:
            self._ended = True
            self.queue.put_nowait(item)
            if self._ending is not None and not self._ending.done():
                self._ending.set_result(None)

    # the consumer's side ---------------------------------------------------------------------
    def interrupt(self) -> None:
        self.queue.put_nowait(("cancel", None))

    async def close(self, grace: float = 0.0) -> None:
        """Ends the exchange. With a grace period a response about to end is read to its end, so
        its connection is kept; otherwise a connection with a response still coming is closed."""
        if grace and not self._ended:
            self._ending = asyncio.get_running_loop().create_future()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ending, grace)
        self._ended = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # mid-response: the rest of it is not read
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
