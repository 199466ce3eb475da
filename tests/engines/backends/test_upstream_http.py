"""The lean upstream client (engines/backends/upstream_http.py) against a real HTTP server: the scripted
OpenAI-compatible upstream under uvicorn."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import orjson
import pytest

from engines.backends.upstream_http import UpstreamPool
from tests.engines.conftest import upstreams  # noqa: F401  (fixture)
from tests.fakes.upstream import Behaviour

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                     "stream_options": {"include_usage": True}})
HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}


def payloads(items: list[tuple[str, Any]]) -> list[str]:
    """The event payloads of the queue items, in order, as text ("events" items carry several)."""
    out: list[str] = []
    for kind, value in items:
        if kind == "data":
            out.append(value)
        elif kind == "events":
            out += [v.decode() if isinstance(v, bytes) else v for v in value]
    return out


async def drain(exchange: Any) -> list[tuple[str, Any]]:
    items = []
    while True:
        kind, value = await asyncio.wait_for(exchange.queue.get(), 10)
        items.append((kind, value))
        if kind in ("eof", "status", "error"):
            await exchange.close(grace=1.0)
            return items


async def test_streams_events_and_reuses_one_connection(upstreams: Any) -> None:
    server, url = upstreams()
    pool = UpstreamPool(connect_timeout=2, keepalive_expiry=30)
    try:
        for _ in range(5):
            items = await drain(pool.exchange(url + "/chat/completions", BODY, HEADERS))
            events = payloads(items)
            data = [orjson.loads(v) for v in events if v != "[DONE]"]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c.get("choices"))
            assert text == "The capital of France is Paris."
            assert any(c.get("usage") for c in data) and events[-1] == "[DONE]" and items[-1] == ("eof", None)
        assert pool.opened == 1  # keep-alive: every request after the first reused the connection
        assert len(server.requests) == 5 and server.requests[0].body["stream"] is True
    finally:
        await pool.aclose()


async def test_an_error_status_is_read_whole(upstreams: Any) -> None:
    server, url = upstreams()
    server.default = Behaviour(status=429, error_message="slow down")
    pool = UpstreamPool(connect_timeout=2, keepalive_expiry=30)
    try:
        (kind, (status, raw)), = await drain(pool.exchange(url + "/chat/completions", BODY, HEADERS))
        assert kind == "status" and status == 429 and b"slow down" in raw
    finally:
        await pool.aclose()


async def test_a_closed_exchange_mid_stream_does_not_go_back_to_the_pool(upstreams: Any) -> None:
    server, url = upstreams()
    server.default = Behaviour(tokens=["x"] * 50, token_delay=0.05)
    pool = UpstreamPool(connect_timeout=2, keepalive_expiry=30)
    try:
        exchange = pool.exchange(url + "/chat/completions", BODY, HEADERS)
        assert (await asyncio.wait_for(exchange.queue.get(), 10))[0] == "events"
        await exchange.close()  # the client left: the rest of the body is not read
        for _ in range(100):
            if server.requests[0].disconnected_at is not None:
                break
            await asyncio.sleep(0.02)
        assert server.requests[0].disconnected_at is not None  # the upstream saw the connection go
        server.default = Behaviour()
        assert (await drain(pool.exchange(url + "/chat/completions", BODY, HEADERS)))[-1] == ("eof", None)
        assert pool.opened == 2
    finally:
        await pool.aclose()


async def test_a_dropped_connection_and_a_refused_one_are_errors(upstreams: Any) -> None:
    server, url = upstreams()
    server.default = Behaviour(drop_after=2)
    pool = UpstreamPool(connect_timeout=2, keepalive_expiry=30)
    try:
        items = await drain(pool.exchange(url + "/chat/completions", BODY, HEADERS))
        assert len(payloads(items)) >= 1 and items[-1][0] == "error"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens here once closed
        items = await drain(pool.exchange(f"http://127.0.0.1:{port}/v1/chat/completions", BODY, HEADERS))
        assert items[0][0] == "error" and "ConnectError" in items[0][1]
    finally:
        await pool.aclose()


async def serve_raw(pieces: list[bytes]) -> tuple[asyncio.Server, str]:
    """A server that answers one request with these bytes, written piece by piece (a pause between)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


async def test_events_come_out_whole_however_the_body_is_cut_and_framed() -> None:
    # One-line `data:` events (cut out of the bytes), a comment, a two-line event, `data:` without its
    # space, an event cut mid-line and mid-blank-line across reads, and an unterminated last event.
    body = (b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\n\ndata:{"c":3}\n\nevent: x\ndata: {"d"'
            b':4}\n\ndata: {"e":5}\n\ndata: [DONE]')
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    expected = ['{"a":1}', '{"b":\n2}', '{"c":3}', '{"d":4}', '{"e":5}', "[DONE]"]
    # LF line ends, CRLF ones, and CRLF from the middle of the second event on
    for framed in (body, body.replace(b"\n", b"\r\n"), body[:20] + body[20:].replace(b"\n", b"\r\n")):
        cuts = [0, 9, 15, 40, 41, 70, len(framed)]  # mid-line, mid-blank-line, between events
        chunks = [framed[a:b] for a, b in zip(cuts, cuts[1:])]
        pieces = [head] + [b"%x\r\n%b\r\n" % (len(c), c) for c in chunks] + [b"0\r\n\r\n"]
        server, url = await serve_raw(pieces)
        pool = UpstreamPool(connect_timeout=2, keepalive_expiry=30)
        try:
            items = await drain(pool.exchange(url + "/chat/completions", BODY, HEADERS))
            assert payloads(items) == expected and items[-1] == ("eof", None)
        finally:
            await pool.aclose()
            server.close()


def test_events_read_together_decode_as_each_alone_would() -> None:
    from engines.backends.openai_pool import _json_object, _json_objects

    cases: list[list[Any]] = [
        [b'{"a":1}', b'{"b":[2]}', b'{"c":"x,y]"}'],  # the usual burst: one parser call
        [b'{"a":1},{"b":2}', b'{"c":3}'],  # two values in one event: the array parses, its count does not match
        [b'{"a":1},{"b":2}', b""],  # two values in one event, none in the next: the same count, no parse
        [b'{"a":1},{"b":2}', b" ", b'{"c":3}'],
        [b'{"a":1}', b"not json", b'{"c":3}'],
        [b'{"a":1}', b"[1]", b"null", b"7"],  # JSON that is not an object
        [b'{"a":1}', '{"s":"decoded by the SSE decoder"}'],  # a str among bytes
        [b'{"a":1}', b"[DONE]", b'{"after":1}'],  # nothing after [DONE] counts
        [b" [DONE] "],
        [b'{"a":1}'],
    ]
    for events in cases:
        done_at = next((i for i, e in enumerate(events) if e.strip() in (b"[DONE]", "[DONE]")), None)
        before = events if done_at is None else events[:done_at]
        assert _json_objects(events) == ([_json_object(e) for e in before], done_at is not None), events


async def test_the_inbox_hands_items_over_in_order_and_times_out() -> None:
    from engines.backends.upstream_http import Inbox

    inbox = Inbox()
    assert inbox.empty()
    with pytest.raises(IndexError):
        inbox.get_nowait()
    waiter = asyncio.ensure_future(inbox.get(5.0))
    await asyncio.sleep(0)
    inbox.put_nowait(("events", [b"1"]))
    inbox.put_nowait(("eof", None))
    assert await waiter == ("events", [b"1"])
    assert inbox.get_nowait() == ("eof", None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await inbox.get(0.05)
    assert 0.04 <= loop.time() - started < 2
    inbox.put_nowait(("eof", None))  # nobody waits: kept for the next get
    assert await inbox.get(0.05) == ("eof", None)
    # a consumer cancelled while it waits leaves no waiter behind: the next one is served
    cancelled = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    later = asyncio.ensure_future(inbox.get(5.0))
    await asyncio.sleep(0)
    inbox.put_nowait(("cancel", None))
    assert await later == ("cancel", None)
