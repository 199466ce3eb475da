"""billing/quota/resp.py: the pipelined script client, against the real Redis and against small local
servers that misbehave on purpose (never answer, answer late, drop the connection)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import hiredis
import pytest
import redis.asyncio as aioredis

from billing.quota import LedgerTotals, RedisLimiter
from billing.quota.resp import ResponseError, RespConnectionError, RespTimeoutError, Script, ScriptRunner, command

REDIS_URL = "redis://127.0.0.1:6379/0"
ECHO = Script("return ARGV")


@pytest.fixture
async def runner() -> AsyncIterator[ScriptRunner]:
    r = ScriptRunner(REDIS_URL, timeout=2.0)
    yield r
    await r.close()


def unique_script(body: str) -> Script:
    """A script Redis has never seen (its SHA is new), so the first call takes the NOSCRIPT path."""
    return Script(f"-- test {uuid.uuid4().hex}\n{body}")


# --------------------------------------------------------------------------------------------
# Against the real Redis


async def test_concurrent_calls_are_pipelined_and_each_gets_its_own_reply(runner: ScriptRunner) -> None:
    replies = await asyncio.gather(*[runner.evalsha(ECHO, [i, f"s{i}", b"b", "é"]) for i in range(500)])
    assert replies == [[str(i), f"s{i}", "b", "é"] for i in range(500)]
    assert runner._conn is not None and not runner._conn.pending  # one connection, FIFO drained


class CountingWrites:
    """The connection's transport, counting its writes."""

    def __init__(self, transport: Any) -> None:
        self.transport, self.writes = transport, 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def test_a_lingering_call_leaves_with_the_next_call_or_alone_after_its_linger(runner: ScriptRunner) -> None:
    key = f"tgtest:linger:{uuid.uuid4().hex}"
    incr = unique_script("return redis.call('INCR', ARGV[1])")
    read = unique_script("return redis.call('GET', ARGV[1])")
    await runner.evalsha(read, [key])  # connected, and both scripts loaded (no NOSCRIPT round trip below)
    await runner.evalsha(incr, [key + ":warm"])
    assert runner._conn is not None
    counting = runner._conn.transport = CountingWrites(runner._conn.transport)  # type: ignore[assignment]
    try:
        started = time.monotonic()
        settle = asyncio.ensure_future(runner.evalsha(incr, [key], linger=5.0))
        await asyncio.sleep(0.05)
        assert not settle.done() and counting.writes == 0  # waiting for company
        # The next call takes it along: one write, Redis runs them in order, both answered at once.
        assert await runner.evalsha(read, [key]) == "1"
        assert await settle == 1 and counting.writes == 1 and time.monotonic() - started < 2.0
        started = time.monotonic()
        alone = await runner.evalsha(incr, [key], linger=0.05)  # nobody comes: it leaves after its linger
        assert alone == 2 and 0.045 <= time.monotonic() - started < 2.0 and counting.writes == 2
        # Lingering calls join each other and whatever flush comes first.
        both = await asyncio.gather(runner.evalsha(incr, [key], linger=0.05), runner.evalsha(incr, [key], linger=5.0))
        assert sorted(both) == [3, 4] and counting.writes == 3
    finally:
        await runner.execute("DEL", key, key + ":warm")


async def test_reply_shapes_match_redis_py_decoded(runner: ScriptRunner) -> None:
    script = Script("return {1, 'x', {2, {3, 'y'}}, redis.status_reply('OK'), false, tonumber(ARGV[1])}")
    ours = await runner.evalsha(script, [42])
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        theirs = await client.register_script(script.source)(keys=[], args=[42])
    finally:
        await client.aclose()
    assert ours == theirs == [1, "x", [2, [3, "y"]], "OK", None, 42]
    assert await runner.evalsha(Script("return 7"), []) == 7
    assert await runner.evalsha(Script("return 'text'"), []) == "text"
    assert await runner.evalsha(Script("return nil"), []) is None


async def test_noscript_falls_back_to_eval_which_loads_the_script(runner: ScriptRunner) -> None:
    script = unique_script("return {'ran', ARGV[1]}")
    assert await runner.execute("SCRIPT", "EXISTS", script.sha) == [0]
    assert await runner.evalsha(script, ["a"]) == ["ran", "a"]  # NOSCRIPT, then EVAL
    assert await runner.execute("SCRIPT", "EXISTS", script.sha) == [1]
    assert await runner.evalsha(script, ["b"]) == ["ran", "b"]  # EVALSHA now
    # Many concurrent first calls of an unknown script all succeed (each retries with EVAL).
    fresh = unique_script("return ARGV[1]")
    assert await asyncio.gather(*[runner.evalsha(fresh, [i]) for i in range(50)]) == [str(i) for i in range(50)]


async def test_error_replies_raise_and_the_connection_stays_aligned(runner: ScriptRunner) -> None:
    failing = Script("return redis.error_reply('QUOTA broken ' .. ARGV[1])")
    with pytest.raises(ResponseError, match="QUOTA broken 1"):
        await runner.evalsha(failing, [1])
    with pytest.raises(ResponseError, match="Unknown Redis command"):
        await runner.evalsha(Script("return redis.call('NOSUCHCOMMAND')"), [])
    mixed = await asyncio.gather(
        *[runner.evalsha(failing if i % 3 == 0 else ECHO, [i]) for i in range(60)], return_exceptions=True
    )
    for i, reply in enumerate(mixed):
        if i % 3 == 0:
            assert isinstance(reply, ResponseError) and f"QUOTA broken {i}" in str(reply)
        else:
            assert reply == [str(i)]


async def test_argument_encoding(runner: ScriptRunner) -> None:
    assert await runner.evalsha(ECHO, [0, -5, 2**70, 1.5, "", b"\x00\r\n", "ü"]) == [
        "0", "-5", str(2**70), "1.5", "", "\x00\r\n", "ü"
    ]
    with pytest.raises(TypeError):
        await runner.evalsha(ECHO, [True])
    with pytest.raises(TypeError):
        await runner.evalsha(ECHO, [None])
    assert command("SET", "k", 1) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"


async def test_reconnects_after_the_server_drops_the_connection(runner: ScriptRunner) -> None:
    assert await runner.evalsha(ECHO, ["before"]) == ["before"]
    conn = runner._conn
    assert conn is not None
    client_id = await runner.execute("CLIENT", "ID")
    admin = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        assert await admin.client_kill_filter(_id=client_id) == 1
    finally:
        await admin.aclose()
    deadline = time.monotonic() + 5
    while runner._conn is conn:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert conn.lost
    assert await runner.evalsha(ECHO, ["after"]) == ["after"]
    assert await runner.execute("CLIENT", "ID") != client_id
    # Closing it ourselves works the same way: the next call reconnects.
    assert runner._conn is not None
    runner._conn.transport.abort()  # type: ignore[union-attr]
    await asyncio.sleep(0.05)
    assert await runner.evalsha(ECHO, ["again"]) == ["again"]


async def test_select_uses_the_urls_database() -> None:
    key = f"tgresp:{uuid.uuid4().hex}"
    admin = aioredis.Redis.from_url("redis://127.0.0.1:6379/3", decode_responses=True)
    runner = ScriptRunner("redis://127.0.0.1:6379/3", timeout=2.0)
    try:
        await admin.set(key, "in-db-3", ex=60)
        assert await runner.evalsha(Script("return redis.call('GET', ARGV[1])"), [key]) == "in-db-3"
    finally:
        await admin.delete(key)
        await admin.aclose()
        await runner.close()


async def test_connect_refused_raises_connection_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    runner = ScriptRunner(f"redis://127.0.0.1:{port}/0", timeout=0.5)
    with pytest.raises(RespConnectionError):
        await runner.evalsha(ECHO, [1])
    assert isinstance(RespConnectionError("x"), ConnectionError)
    await runner.close()


def test_url_parsing_and_fallback_schemes() -> None:
    r = ScriptRunner("redis://us%40er:p%3Ass@example.com:6390/4", timeout=1.0)
    assert (r.host, r.port, r.db, r.username, r.password) == ("example.com", 6390, 4, "us@er", "p:ss")
    r = ScriptRunner("redis://:secret@localhost?db=2", timeout=1.0)
    assert (r.host, r.port, r.db, r.username, r.password) == ("localhost", 6379, 2, None, "secret")
    assert ScriptRunner.supports("redis://x") and not ScriptRunner.supports("rediss://x")
    assert not ScriptRunner.supports("unix:///tmp/redis.sock")
    with pytest.raises(ValueError):
        ScriptRunner("rediss://localhost", timeout=1.0)
    totals = LedgerTotals(None)  # type: ignore[arg-type]
    assert RedisLimiter(REDIS_URL, totals).lean
    assert not RedisLimiter(REDIS_URL, totals, lean=False).lean
    assert not RedisLimiter("rediss://127.0.0.1:6379/0", totals).lean
    assert not RedisLimiter("unix:///tmp/redis.sock", totals).lean


# --------------------------------------------------------------------------------------------
# Against local servers that misbehave


Behaviour = Callable[[int, list[bytes]], Any]


class FakeRedis:
    """Reads RESP commands; `behaviour(connection_number, command)` returns the reply bytes, None
    (never answer), "close" (drop the connection), or a (delay, bytes) pair. Replies stay in order."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.connections = 0
        self.commands: list[list[bytes]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self.writers.append(writer)
        parser = hiredis.Reader()
        try:
            while data := await reader.read(65536):
                parser.feed(data)
                while (cmd := parser.gets()) is not False:
                    self.commands.append(cmd)
                    if cmd[0] in (b"AUTH", b"SELECT"):
                        writer.write(b"+OK\r\n")
                        continue
                    reply = self.behaviour(number, cmd)
                    if reply == "close":
                        writer.close()
                        return
                    if isinstance(reply, tuple):
                        await asyncio.sleep(reply[0])
                        reply = reply[1]
                    if reply is not None:
                        writer.write(reply)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()


def echo(cmd: list[bytes]) -> bytes:
    """What `return ARGV` would answer for EVALSHA sha 0 args..."""
    return command(*cmd[3:])


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Behaviour], Any]]:
    servers: list[FakeRedis] = []

    async def make(behaviour: Behaviour) -> tuple[FakeRedis, str]:
        server = FakeRedis(behaviour)
        servers.append(server)
        return server, await server.start()

    yield make
    for server in servers:
        await server.stop()


async def test_timeout_against_a_server_that_never_answers(fake: Any) -> None:
    server, url = await fake(lambda n, cmd: None)
    runner = ScriptRunner(url, timeout=0.1, stall_after=60)
    try:
        started = time.monotonic()
        results = await asyncio.gather(*[runner.evalsha(ECHO, [i]) for i in range(20)], return_exceptions=True)
        elapsed = time.monotonic() - started
        assert all(isinstance(r, RespTimeoutError) and isinstance(r, TimeoutError) for r in results)
        assert 0.09 <= elapsed < 1.0
        assert server.connections == 1  # one connect shared by the concurrent callers
        assert runner._conn is not None and len(runner._conn.pending) == 20  # slots kept for late replies
    finally:
        await runner.close()


async def test_a_late_reply_is_dropped_and_the_next_reply_goes_to_its_own_caller(fake: Any) -> None:
    def behaviour(n: int, cmd: list[bytes]) -> Any:
        return (0.3, echo(cmd)) if cmd[3] == b"slow" else echo(cmd)

    _server, url = await fake(behaviour)
    runner = ScriptRunner(url, timeout=0.1, stall_after=60)
    try:
        slow = asyncio.ensure_future(runner.evalsha(ECHO, ["slow"]))
        await asyncio.sleep(0.01)
        fast = asyncio.ensure_future(runner.evalsha(ECHO, ["fast", 1]))  # answered after "slow"
        with pytest.raises(RespTimeoutError):
            await slow
        with pytest.raises(RespTimeoutError):
            await fast  # the server answers in order: "fast" is also behind the 0.3 s reply
        await asyncio.sleep(0.4)  # both late replies arrive and are dropped
        assert runner._conn is not None and not runner._conn.pending
        assert await runner.evalsha(ECHO, ["next"]) == ["next"]
        # A caller cancelled while waiting frees nothing out of order either.
        gone = asyncio.ensure_future(runner.evalsha(ECHO, ["slow"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        runner.timeout = 2.0
        assert await runner.evalsha(ECHO, ["after-cancel"]) == ["after-cancel"]
    finally:
        await runner.close()


async def test_connection_lost_mid_call_fails_every_pending_call_then_reconnects(fake: Any) -> None:
    def behaviour(n: int, cmd: list[bytes]) -> Any:
        if n == 1:
            return "close" if cmd[3] == b"boom" else None  # first connection: hang, then drop
        return echo(cmd)

    server, url = await fake(behaviour)
    runner = ScriptRunner(url, timeout=5.0)
    try:
        waiting = [asyncio.ensure_future(runner.evalsha(ECHO, [i])) for i in range(10)]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        results = await asyncio.gather(runner.evalsha(ECHO, ["boom"]), *waiting, return_exceptions=True)
        assert time.monotonic() - started < 2  # failed at once, not at the 5 s deadline
        assert all(isinstance(r, RespConnectionError) and isinstance(r, ConnectionError) for r in results)
        assert runner._conn is None
        assert await runner.evalsha(ECHO, ["ok"]) == ["ok"]  # lazily reconnected
        assert server.connections == 2
    finally:
        await runner.close()


async def test_a_failed_write_fails_every_pending_call_and_drops_the_connection(fake: Any) -> None:
    server, url = await fake(lambda n, cmd: (0.2, echo(cmd)) if cmd[3] == b"slow" else echo(cmd))
    runner = ScriptRunner(url, timeout=5.0)
    try:
        slow = asyncio.ensure_future(runner.evalsha(ECHO, ["slow"]))  # written at once (idle connection)
        await asyncio.sleep(0.02)
        conn = runner._conn
        assert conn is not None and len(conn.pending) == 1

        def broken(data: bytes) -> None:
            raise RuntimeError("write failed")

        conn.transport.write = broken  # type: ignore[union-attr, method-assign]
        # These queue behind "slow" and go out in one write, which fails: everything pending fails.
        results = await asyncio.gather(slow, *[runner.evalsha(ECHO, [i]) for i in range(5)], return_exceptions=True)
        assert all(isinstance(r, RespConnectionError) for r in results)
        assert conn.lost and runner._conn is None
        assert await runner.evalsha(ECHO, ["ok"]) == ["ok"]
        assert server.connections == 2
    finally:
        await runner.close()


async def test_a_stalled_connection_is_dropped_and_replaced(fake: Any) -> None:
    server, url = await fake(lambda n, cmd: None if n == 1 else echo(cmd))
    runner = ScriptRunner(url, timeout=0.1, stall_after=0.25)
    try:
        for _ in range(3):  # the third deadline finds nothing received for >= 0.25 s
            with pytest.raises(RespTimeoutError):
                await runner.evalsha(ECHO, [1])
        assert runner._conn is None
        assert await runner.evalsha(ECHO, ["fresh"]) == ["fresh"]
        assert server.connections == 2
    finally:
        await runner.close()


async def test_connect_sends_auth_and_select_and_times_out_when_unanswered(fake: Any) -> None:
    server, url = await fake(lambda n, cmd: echo(cmd))
    port = url.split(":")[2].split("/")[0]
    runner = ScriptRunner(f"redis://us%40er:p%3Ass@127.0.0.1:{port}/5", timeout=1.0)
    try:
        assert await runner.evalsha(ECHO, ["x"]) == ["x"]
        assert server.commands[:2] == [[b"AUTH", b"us@er", b"p:ss"], [b"SELECT", b"5"]]
    finally:
        await runner.close()

    silent_auth = FakeRedis(lambda n, cmd: None)  # AUTH never answered: a server that only accepts
    silent_auth.handle = _accept_only  # type: ignore[method-assign]
    url3 = await silent_auth.start()
    runner = ScriptRunner(url3.replace("redis://", "redis://:pw@"), timeout=1.0, connect_timeout=0.1)
    try:
        started = time.monotonic()
        with pytest.raises(RespTimeoutError):
            await asyncio.gather(runner.evalsha(ECHO, [1]), runner.evalsha(ECHO, [2]))
        assert time.monotonic() - started < 1.0
    finally:
        await runner.close()
        await silent_auth.stop()


async def _accept_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.read(65536):
            pass
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


# --------------------------------------------------------------------------------------------
# RedisLimiter on both paths gives the same answers


async def test_limiter_lean_and_redis_py_paths_agree() -> None:
    from billing.quota.limits import Limits
    from billing.quota import Scope, ScopeTotals

    class NoLedger:
        async def for_scopes(self, scopes: list[Scope], now: float) -> dict[str, ScopeTotals]:
            return {s.name: ScopeTotals() for s in scopes}

    prefix = f"tgresp:{uuid.uuid4().hex[:8]}:"
    key = Scope("key", 1, Limits(rpm=100, monthly_tokens=1000))
    outcomes = []
    for lean in (True, False):
        lim = RedisLimiter(REDIS_URL, NoLedger(), prefix=f"{prefix}{lean}:", timeout=1.0, lean=lean)  # type: ignore[arg-type]
        try:
            assert lim.lean is lean
            hold = await lim.reserve(f"r-{uuid.uuid4().hex}", [key], 300, 0, now=1_795_000_000.0)
            settled = await lim.settle(hold, 200, 0)
            again = await lim.settle(hold, 200, 0)
            outcomes.append((hold.remaining, settled, again, await lim.counters(key, now=1_795_000_000.0)))
        finally:
            await lim.flush_all()
            await lim.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1:3] == (True, False)
