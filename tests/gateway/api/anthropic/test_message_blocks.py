"""One model answer as Anthropic's content blocks, whole (MessageRenderer.body) and streamed
(content_block_* events): the same blocks in the same order. The hermes answer's content is the
text before its first call, as vLLM's hermes parser has it; a newline between two calls or text
after a call is no text block (it used to be one in the stream, and joined first in the body)."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest

from engines.base import FINISH_STOP, EngineOutput
from engines.decoding.structured import AnswerShape
from gateway.api.anthropic.messages import MessageRenderer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


def generation() -> Any:
    return types.SimpleNamespace(request_id="rid", model="m", stop_sequence=None, finish_reason="stop", prompt_tokens=10,
                                 cached_tokens=None, completion_tokens=5)


def outputs(text: str, stream: bool, size: int) -> list[EngineOutput]:
    shape = AnswerShape("hermes", stream=stream)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [shape.shaped(EngineOutput(text=p, finish_reason=FINISH_STOP if i == len(pieces) - 1 else None)) for i, p in enumerate(pieces)]


def whole(text: str, size: int) -> list[tuple[str, str]]:
    last = outputs(text, False, size)[-1]
    body = json.loads(MessageRenderer(generation()).body(last.text, last.raw_choice))
    return [(b["type"], b.get("text") or b["name"]) for b in body["content"]]


def streamed(text: str, size: int) -> list[tuple[str, str]]:
    render = MessageRenderer(generation())
    raw = render.first() or b""
    for out in outputs(text, True, size):
        if out.raw_choice is not None:
            raw += render.delta(out.text, None, out.raw_choice)
    raw += render.end()
    blocks: list[dict[str, Any]] = []
    for event in raw.decode().split("\n\n"):
        if not event:
            continue
        data = json.loads(event.split("data: ", 1)[1])
        if data["type"] == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif data["type"] == "content_block_delta" and data["delta"]["type"] == "text_delta":
            blocks[data["index"]]["text"] += data["delta"]["text"]
    return [(b["type"], b.get("text") or b["name"]) for b in blocks]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize(("text", "blocks"), [
    ("Let me check.\n" + CALL, [("text", "Let me check.\n"), ("tool_use", "get_weather")]),
    (CALL + "\nI will wait for the result.", [("tool_use", "get_weather")]),
    ("Sure.\n" + CALL + "\n" + CALL2, [("text", "Sure.\n"), ("tool_use", "get_weather"), ("tool_use", "get_time")]),
    ("\n" + CALL + "\n" + CALL2 + "\n", [("tool_use", "get_weather"), ("tool_use", "get_time")]),
    ("No tools needed.", [("text", "No tools needed.")]),
])
def test_the_same_blocks_in_the_same_order_streamed_or_not(text: str, blocks: list[tuple[str, str]], size: int) -> None:
    assert whole(text, size) == blocks
    assert streamed(text, size) == blocks
