"""Chunks that arrived together leave together: the `openai` backend folds the outputs it read in one
go into one (`EngineOutput.before`), the SSE response relays each as its own chunk in one send, and
nothing is held while the upstream is silent; a non-streamed answer is collected and leaves once, at
the end. The upstream here is a raw asyncio server that sends its events in two bursts with a pause
between them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from engines.base import EngineOutput, EngineRequest, FINISH_STOP
from engines.backends.openai_pool import OpenAIPoolEngine
from gateway.serving.generation_response import GenerationResponse
from gateway.serving.completions import Generation

pytestmark = pytest.mark.solo  # when outputs leave, against a 0.4 s pause: alone on the machine (tests/conftest.py)

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


# The first burst ends with an event that carries no output (an empty delta): a, b and c must still
# leave before the engine waits for the second burst.
FIRST = [_chunk("a"), _chunk("b"), _chunk("c"), _chunk(None)]
SECOND = [_chunk("d"), _chunk(None, "stop"),
          _event({"id": "u", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}),
          b"data: [DONE]\n\n"]


def _parts(out: EngineOutput) -> list[str]:
    return [p.text for p in out.before or ()] + [out.text]


async def _run(stream: bool) -> list[tuple[EngineOutput, float]]:
    server, url = await _bursty_upstream(FIRST, SECOND)
    engine = OpenAIPoolEngine(model_id="m", replicas=[url], context_length=4096, health_path=None, retries=0)
    await engine.start()
    try:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            body["stream"] = True
        request = EngineRequest(request_id="r1", max_tokens=16, prompt_token_ids=[1, 2, 3], extra=body)
        started = time.perf_counter()
        return [(out, time.perf_counter() - started) async for out in engine.stream(request)]
    finally:
        await engine.stop()
        server.close()
        await server.wait_closed()


async def test_outputs_read_together_leave_as_one_before_a_wait() -> None:
    seen = await _run(stream=True)
    assert len(seen) == 2, [(_parts(o), o.finish_reason) for o, _ in seen]
    (first, first_at), (last, last_at) = seen
    # a, b and c arrived together: one output carries them, and it left before the pause.
    assert _parts(first) == ["a", "b", "c"] and not first.finished and first_at < PAUSE / 2
    assert [p.raw_choice["delta"]["content"] for p in first.before or ()] == ["a", "b"]  # relayed as they came
    assert first.completion_tokens == 3
    # d, the finish and the usage came after the pause, together: the final output carries d.
    assert _parts(last) == ["d", ""] and last.finish_reason == FINISH_STOP and last_at >= PAUSE
    assert (last.prompt_tokens, last.completion_tokens, last.estimated) == (3, 4, False)


async def test_a_non_streamed_answer_leaves_once_and_says_when_it_began() -> None:
    seen = await _run(stream=False)
    assert len(seen) == 1
    out, at = seen[0]
    arrived = time.perf_counter()  # the answer came at the end: after the upstream's pause
    assert out.finish_reason == FINISH_STOP and at >= PAUSE and out.before is None
    assert out.raw_choice is not None and out.raw_choice["message"]["content"] == "abcd"
    # the TTFT, not the total: the first tokens came a pause before the answer (measured from the
    # answer, not from the engine's start, which a loaded machine makes slow)
    assert out.first_token_at is not None and arrived - out.first_token_at >= PAUSE / 2
    assert (out.prompt_tokens, out.completion_tokens) == (3, 4)


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


async def test_the_sse_response_relays_each_part_and_writes_an_output_in_one_send() -> None:
    class _Engine:
        model_id = "m"

        def cancel(self, request_id: str) -> None:
            pass

    gen = Generation(request_id="r2", principal=None, engine=_Engine(), engine_request=None,  # type: ignore[arg-type]
                     kind="chat", stream=True, include_usage=True, prompt_tokens=3)
    outputs = [
        EngineOutput("c", before=[EngineOutput("a"), EngineOutput("b")]),
        EngineOutput("", finish_reason=FINISH_STOP, completion_tokens=4, before=[EngineOutput("d")]),
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


def test_text_pieces_taken_directly_merge_as_add_merges_them() -> None:
    # engines/backends/openai_pool.py takes a chunk that is only a piece of text with `add_piece`; the merged
    # choice must be the one `add` makes of the same chunks, whatever comes around those pieces.
    from engines.backends.openai_stream import ChoiceAccumulator

    chat = [
        {"delta": {"role": "assistant", "content": ""}}, {"delta": {"content": "Hel"}}, {"delta": {"content": "lo"}},
        {"delta": {"reasoning": "hm"}}, {"delta": {"content": " there"}},
        {"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]}},
        {"delta": {"content": "!"}, "logprobs": {"content": [{"token": "!", "logprob": -0.1}]}},
        {"delta": {}, "finish_reason": "stop"},
    ]
    text = [{"text": "a"}, {"text": ""}, {"text": "b", "logprobs": None}, {"text": "c", "finish_reason": "length"}]
    for is_chat, chunks in ((True, chat), (False, text)):
        general, direct = ChoiceAccumulator(is_chat), ChoiceAccumulator(is_chat)
        field = "content" if is_chat else "text"
        for chunk in chunks:
            choice = {"index": 0, "finish_reason": None, **chunk}
            general.add(choice)
            part = choice.get("delta") if is_chat else choice
            piece = part.get(field) if not is_chat or len(part) == 1 else None
            taken = (choice["finish_reason"] is None and choice.get("logprobs") is None and isinstance(piece, str)
                     and piece != "" and direct.add_piece(field, piece))
            if not taken:
                direct.add(choice)
        assert direct.choice() == general.choice()

    # A field that is not text so far is left to `add`.
    acc = ChoiceAccumulator(True)
    acc.add({"index": 0, "delta": {"content": ["not", "text"]}})
    assert acc.add_piece("content", "x") is False
