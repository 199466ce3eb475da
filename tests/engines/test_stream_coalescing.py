"""Chunks that arrived together leave together: the `openai` backend marks outputs it already holds
the next of (`EngineOutput.more`), the SSE response writes those in one send, and nothing is held
while the upstream is silent. The upstream here is a raw asyncio server that sends its events in
two bursts with a pause between them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from engines.base import EngineOutput, EngineRequest, FINISH_STOP
from engines.openai_pool import OpenAIPoolEngine
from gateway.responses import GenerationResponse
from gateway.serving import Generation

PAUSE = 0.4


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(text: str | None, finish: str | None = None) -> bytes:
    delta = {"content": text} if text is not None else {}
    return _event({"id": "u", "object": "chat.completion.chunk", "created": 0, "model": "up",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


async def _bursty_upstream(first: list[bytes], second: list[bytes]) -> tuple[asyncio.AbstractServer, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + b"".join(first))
        await writer.drain()
        await asyncio.sleep(PAUSE)
        writer.write(b"".join(second))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1"


# The first burst ends with an event that carries no output (an empty delta): c is marked `more`,
# and the engine must still release it before it waits.
FIRST = [_chunk("a"), _chunk("b"), _chunk("c"), _chunk(None)]
SECOND = [_chunk("d"), _chunk(None, "stop"),
          _event({"id": "u", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}),
          b"data: [DONE]\n\n"]


async def test_outputs_already_here_are_marked_and_released_before_a_wait() -> None:
    server, url = await _bursty_upstream(FIRST, SECOND)
    engine = OpenAIPoolEngine(model_id="m", replicas=[url], context_length=4096, health_path=None, retries=0)
    await engine.start()
    try:
        request = EngineRequest(request_id="r1", max_tokens=16, prompt_token_ids=[1, 2, 3],
                                extra={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        started = time.monotonic()
        seen: list[tuple[str, bool, float]] = []
        async for out in engine.stream(request):
            seen.append((out.text, out.more, time.monotonic() - started))
        texts = [t for t, _more, _at in seen if t]
        assert texts == ["a", "b", "c", "d"]
        # a, b and c: the next event was already read, so each may be held.
        first_burst = [(t, more) for t, more, at in seen if at < PAUSE / 2]
        assert [(t, more) for t, more in first_burst if t] == [("a", True), ("b", True), ("c", True)]
        # Before the engine waits for the second burst, an output without `more` has been yielded,
        # so a consumer holding a, b and c writes them during the pause, not after it.
        assert first_burst[-1] == ("", False), f"nothing released before the pause: {seen}"
        assert seen[-1][1] is False  # the last output never asks to be held
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()


class _Outputs:
    """An engine stream as GenerationResponse consumes it: a list of outputs, then the end."""

    def __init__(self, outputs: list[EngineOutput]) -> None:
        self.items = list(outputs)

    def __aiter__(self) -> "_Outputs":
        return self

    async def __anext__(self) -> EngineOutput:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    async def aclose(self) -> None:
        self.items.clear()


async def test_the_sse_response_writes_held_chunks_in_one_send() -> None:
    class _Engine:
        model_id = "m"

        def cancel(self, request_id: str) -> None:
            pass

    gen = Generation(request_id="r2", principal=None, engine=_Engine(), engine_request=None,  # type: ignore[arg-type]
                     kind="chat", stream=True, include_usage=True, prompt_tokens=3)
    outputs = [
        EngineOutput("a", more=True), EngineOutput("b", more=True), EngineOutput("c"),
        EngineOutput("d", more=True), EngineOutput("", finish_reason=FINISH_STOP, completion_tokens=4),
    ]
    gen.finish_reason = FINISH_STOP
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    await GenerationResponse(gen, _Outputs(outputs), {})({"type": "http"}, receive, send)  # type: ignore[arg-type]
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    # the role chunk with a, b, c in one write; then d with the finish, usage and [DONE]
    assert len(bodies) == 2, bodies
    events = [b for body in bodies for b in body.split(b"\n\n") if b]
    assert events[-1] == b"data: [DONE]"
    deltas = [orjson.loads(e[6:])["choices"][0]["delta"] for e in events[:-2]]
    assert [d.get("content") for d in deltas] == ["", "a", "b", "c", "d", None]
    assert bodies[0].count(b"data: ") == 4 and sent[-1]["more_body"] is False
