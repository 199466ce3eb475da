"""A small asyncio RESP2 client that only runs Lua scripts, for the quota hot path.

redis-py's asyncio client costs a lot of CPU per command (a blocking pool, argument checks,
`asyncio.timeout`, retry wrappers, generic command packing). The quota limiter sends one script
call per admission and one per settlement, so it uses this instead:

* one TCP connection shared by every caller, requests pipelined on it: a call writes its command
  and appends a future to a FIFO; replies (parsed by hiredis) resolve the futures in order. A call
  on an idle connection is written at once; calls made while others are outstanding are gathered
  and written together at the end of the event loop's turn (one send for many callers);
* a call may linger (`evalsha(..., linger=s)`, the limiter's settlements): it waits up to `s` for
  a later call and leaves in that call's send, both replies read together; nothing waits for it;
* one timer per call (`loop.call_at`): on expiry the caller gets `RespTimeoutError` and the FIFO
  slot stays, so the late reply is read and dropped and the replies that follow stay aligned;
* a lost connection (or a failed write) fails every pending call with `RespConnectionError` and
  is dropped; the next call reconnects, concurrent callers sharing that one connect;
* EVALSHA first, EVAL (which loads the script) when Redis answers NOSCRIPT.

Only `redis://host:port/db` URLs (with optional username/password) are supported; see
`ScriptRunner.supports`. Callers keep redis-py for `rediss://` and `unix://`.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import hiredis

__all__ = ["ResponseError", "RespConnectionError", "RespTimeoutError", "Script", "ScriptRunner"]


class ResponseError(Exception):
    """Redis answered with an error reply (the message is the exception's text)."""


class RespConnectionError(ConnectionError):
    """No connection to Redis, or it was lost while the call was pending."""


class RespTimeoutError(TimeoutError):
    """Redis did not answer within the call's deadline (or the connect timeout)."""


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _coerce(value: Any) -> bytes:
    """The uncommon argument types (the hot ones are handled inline in `_pack`)."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"invalid argument type for a Redis command: {type(value).__name__}")
    if isinstance(value, int):
        return b"%d" % value
    if isinstance(value, float):
        return repr(value).encode()
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"invalid argument type for a Redis command: {type(value).__name__}")


def _pack(head: bytes, args: Sequence[Any]) -> bytes:
    """`head` (the array header and the leading bulk strings) followed by `args` as bulk strings."""
    out = [head]
    append = out.append
    for arg in args:
        kind = type(arg)
        if kind is str:
            data = arg.encode()
        elif kind is int:
            data = b"%d" % arg
        elif kind is bytes:
            data = arg
        else:
            data = _coerce(arg)
        append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


def command(*parts: Any) -> bytes:
    """Any command as a RESP array of bulk strings (connect handshake, tests)."""
    return _pack(b"*%d\r\n" % len(parts), parts)


class Script:
    """A Lua script: its source and SHA1 (computed here, so no SCRIPT LOAD round trip)."""

    __slots__ = ("source", "sha", "_evalsha", "_eval")

    def __init__(self, source: str) -> None:
        self.source = source
        raw = source.encode()
        self.sha = hashlib.sha1(raw).hexdigest()
        # EVALSHA sha 0 / EVAL source 0: everything but the array header and the arguments.
        self._evalsha = b"$7\r\nEVALSHA\r\n" + _bulk(self.sha.encode()) + b"$1\r\n0\r\n"
        self._eval = b"$4\r\nEVAL\r\n" + _bulk(raw) + b"$1\r\n0\r\n"

    def __repr__(self) -> str:
        return f"Script(sha={self.sha})"


def _expire(conn: "_Connection", fut: asyncio.Future[Any]) -> None:
    """A call's deadline passed: the caller gets a timeout; its FIFO slot stays for the late reply."""
    if not fut.done():
        fut.set_exception(RespTimeoutError("Redis did not answer in time"))
    conn.check_stall()


class _Connection(asyncio.Protocol):
    """One Redis connection: writes pipelined commands, resolves their futures in reply order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, owner: "ScriptRunner", stall_after: float) -> None:
        self.loop = loop
        self.owner = owner
        self.stall_after = stall_after
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.outbox: list[bytes] | None = None  # requests queued for the next _flush
        self._flush_at: asyncio.Handle | None = None  # that flush: at this turn's end, or a linger's timer
        self._lingering = False  # whether the outbox holds only requests that may linger
        self.lost = False
        self.closed: asyncio.Future[None] = loop.create_future()
        self.active = 0.0  # when a reply last came in, or the FIFO last went from empty to busy

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.active = self.loop.time()
        reader = self.reader
        pending = self.pending
        try:
            reader.feed(data)
            while True:
                reply = reader.gets()
                if reply is False:
                    return
                fut = pending.popleft()  # IndexError: a reply nobody asked for
                if not fut.done():  # done: timed out or cancelled; the late reply is dropped
                    fut.set_result(reply)
        except Exception as exc:  # protocol error, undecodable reply, stray reply: the stream is unusable
            self.abort(f"bad reply stream ({type(exc).__name__}: {exc})")

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(f"connection to Redis lost ({type(exc).__name__ if exc else 'closed'})")
        if not self.closed.done():
            self.closed.set_result(None)

    # -- used by ScriptRunner

    def send(self, payload: bytes, linger: float = 0.0) -> asyncio.Future[Any]:
        """Queues one request; the future gets its reply (an error reply as a ResponseError object).
        `linger`: the request may wait up to this many seconds to leave with a later one (one send
        and one reply read for both); a request without linger takes it along at the end of this turn."""
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            self.abort("connection to Redis is closing")
            raise RespConnectionError("connection to Redis lost")
        fut = self.loop.create_future()
        pending = self.pending
        pending.append(fut)
        if len(pending) == 1:
            self.active = self.loop.time()  # the FIFO went from empty to busy
        outbox = self.outbox
        if linger:
            if outbox is None:
                self.outbox = [payload]
                self._flush_at = self.loop.call_later(linger, self._flush)
                self._lingering = True
            else:
                outbox.append(payload)
            return fut
        if outbox is None:
            if len(pending) == 1:  # idle: nothing to batch with, write now
                self._write(payload)
                return fut
            self.outbox = [payload]
            self._flush_at = self.loop.call_soon(self._flush)
        else:
            outbox.append(payload)  # the flush at the end of this turn takes it
            if self._lingering:  # only lingering requests waited: they leave with this one, at this turn's end
                self._lingering = False
                self._flush_at.cancel()  # type: ignore[union-attr]
                self._flush_at = self.loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        outbox, self.outbox = self.outbox, None
        self._lingering = False
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if outbox and not self.lost:
            self._write(outbox[0] if len(outbox) == 1 else b"".join(outbox))

    def _write(self, data: bytes) -> None:
        try:
            self.transport.write(data)  # type: ignore[union-attr]
        except Exception as exc:
            self.abort(f"write to Redis failed ({type(exc).__name__})")

    def check_stall(self) -> None:
        """Drops a connection that has had calls outstanding and received nothing for `stall_after`
        (a half-open socket to a host that went away would otherwise time out every call forever)."""
        if self.pending and not self.lost and self.loop.time() - self.active >= self.stall_after:
            self.abort("Redis stopped answering on this connection")

    def abort(self, reason: str) -> None:
        self._lose(reason)
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self._lose("connection to Redis closed")
        if self.transport is not None:
            self.transport.close()

    def _lose(self, reason: str) -> None:
        self.outbox = None
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if not self.lost:
            self.lost = True
            self.owner._dropped(self)
        pending = self.pending
        while pending:
            fut = pending.popleft()
            if not fut.done():
                fut.set_exception(RespConnectionError(reason))


def parse_url(url: str) -> dict[str, Any]:
    """host, port, db, username, password from a redis:// URL, the way redis-py's from_url reads them."""
    parsed = urlparse(url)
    if parsed.scheme != "redis":
        raise ValueError(f"unsupported Redis URL scheme for the script runner: {parsed.scheme!r}")
    query = {k: v[0] for k, v in parse_qs(parsed.query).items() if v}
    db: int = 0
    if "db" in query:
        db = int(query["db"])
    elif parsed.path:
        try:
            db = int(unquote(parsed.path).replace("/", ""))
        except ValueError:
            pass
    return {
        "host": unquote(parsed.hostname) if parsed.hostname else "localhost",
        "port": int(parsed.port) if parsed.port else 6379,
        "db": db,
        "username": unquote(parsed.username) if parsed.username else query.get("username"),
        "password": unquote(parsed.password) if parsed.password else query.get("password"),
    }


class ScriptRunner:
    """Runs Lua scripts on one pipelined connection. Reconnects lazily after a loss.

    `timeout`: seconds each call may take (None: no deadline). `connect_timeout`: seconds a connect,
    AUTH and SELECT included, may take. `stall_after`: a connection with calls outstanding that
    receives nothing for this long is dropped when a call's deadline passes (default: 10 timeouts,
    at least 1 s).
    """

    @staticmethod
    def supports(url: str) -> bool:
        return urlparse(url).scheme == "redis"

    def __init__(
        self, url: str, *, timeout: float | None = 0.05, connect_timeout: float | None = None,
        stall_after: float | None = None,
    ) -> None:
        opts = parse_url(url)
        self.host: str = opts["host"]
        self.port: int = opts["port"]
        self.db: int = opts["db"]
        self.username: str | None = opts["username"]
        self.password: str | None = opts["password"]
        self.timeout = timeout
        self.connect_timeout = connect_timeout if connect_timeout is not None else timeout
        self.stall_after = stall_after if stall_after is not None else max(1.0, 10 * (timeout or 0.1))
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None

    async def evalsha(self, script: Script, args: Sequence[Any], linger: float = 0.0) -> Any:
        """EVALSHA sha 0 args...; EVAL source 0 args... if Redis does not have the script yet.
        `linger`: the call may wait that long to share a send with a later call (see _Connection.send);
        its deadline starts when it leaves."""
        conn = self._conn
        if conn is None or conn.loop is not asyncio.get_running_loop():
            conn = await self._connect()
        loop = conn.loop
        deadline = None if self.timeout is None else loop.time() + self.timeout + linger
        tail = _pack(b"*%d\r\n" % (len(args) + 3) + script._evalsha, args)
        reply = await self._request(conn, tail, deadline, linger)
        if type(reply) is ResponseError:
            if not str(reply).startswith("NOSCRIPT"):
                raise reply
            conn = self._conn or await self._connect()
            reply = await self._request(conn, _pack(b"*%d\r\n" % (len(args) + 3) + script._eval, args), deadline)
            if type(reply) is ResponseError:
                raise reply
        return reply

    async def execute(self, *parts: Any) -> Any:
        """Any command (not on the hot path): returns the reply, raises an error reply."""
        conn = self._conn
        if conn is None or conn.loop is not asyncio.get_running_loop():
            conn = await self._connect()
        deadline = None if self.timeout is None else conn.loop.time() + self.timeout
        reply = await self._request(conn, command(*parts), deadline)
        if type(reply) is ResponseError:
            raise reply
        return reply

    @staticmethod
    async def _request(conn: _Connection, payload: bytes, deadline: float | None, linger: float = 0.0) -> Any:
        fut = conn.send(payload, linger)
        if deadline is None:
            return await fut
        timer = conn.loop.call_at(deadline, _expire, conn, fut)
        try:
            return await fut
        finally:
            timer.cancel()

    async def _connect(self) -> _Connection:
        """Single flight: concurrent callers wait for the same connect."""
        loop = asyncio.get_running_loop()
        task = self._connecting
        if task is None or task.get_loop() is not loop:
            task = self._connecting = loop.create_task(self._open(loop))
            task.add_done_callback(self._connect_done)
        return await asyncio.shield(task)

    def _connect_done(self, task: asyncio.Task[_Connection]) -> None:
        if self._connecting is task:
            self._connecting = None
        if not task.cancelled():
            task.exception()  # retrieved here: a waiter may have been cancelled meanwhile

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        conn = _Connection(loop, self, self.stall_after)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await loop.create_connection(lambda: conn, self.host, self.port)
                await self._handshake(conn)
        except TimeoutError:
            conn.abort("connect timed out")
            raise RespTimeoutError(f"connect to Redis at {self.host}:{self.port} timed out") from None
        except (OSError, RespConnectionError) as exc:
            conn.abort("connect failed")
            raise RespConnectionError(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from None
        except BaseException:
            conn.abort("connect failed")
            raise
        old = self._conn
        if old is not None and old is not conn:
            if old.loop is loop:
                old.close()
            else:
                old.lost = True  # belongs to another (likely closed) loop: just forget it
        self._conn = conn
        return conn

    async def _handshake(self, conn: _Connection) -> None:
        if self.username or self.password:
            if self.username:
                reply = await conn.send(command("AUTH", self.username, self.password or ""))
                if isinstance(reply, ResponseError) and "wrong number of arguments" in str(reply):
                    reply = await conn.send(command("AUTH", self.password or ""))  # Redis < 6: password only
            else:
                reply = await conn.send(command("AUTH", self.password))
            if isinstance(reply, ResponseError):
                raise RespConnectionError(f"AUTH failed: {reply}")
        if self.db:
            reply = await conn.send(command("SELECT", self.db))
            if isinstance(reply, ResponseError):
                raise RespConnectionError(f"SELECT {self.db} failed: {reply}")

    def _dropped(self, conn: _Connection) -> None:
        if self._conn is conn:
            self._conn = None

    async def close(self) -> None:
        """Closes the connection (pending calls fail with RespConnectionError); a later call reconnects."""
        task = self._connecting
        if task is not None and not task.done():
            task.cancel()
        conn = self._conn
        self._conn = None
        if conn is None:
            return
        conn.close()
        if conn.loop is asyncio.get_running_loop() and not conn.closed.done():
            await asyncio.wait([conn.closed], timeout=1.0)
