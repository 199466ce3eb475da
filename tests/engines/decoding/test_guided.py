"""Guided decoding and tool-call shaping below the gateway: the grammar builders (engines/decoding/structured.py,
engines/decoding/guided.py), the streamed hermes parser against every way the text may be cut, and the hf
engine in a process of its own following a schema (the grammar travels through its pipe)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from engines.base import FINISH_STOP, EngineOutput, EngineRequest, EngineRequestRejected, SamplingParams
from engines.decoding.structured import AnswerShape, HermesDeltas, Llama3Deltas, plan
from tests.engines.backends.test_hf_process import EngineLoop

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def streamed(text: str, cuts: list[int], parser: HermesDeltas | Llama3Deltas | None = None) -> tuple[str, dict[int, dict[str, str]]]:
    """The content and calls (index -> name, id, arguments) a streamed parser makes of `text` cut at `cuts`."""
    parser = parser or HermesDeltas()
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for i, piece in enumerate(pieces):
        out, deltas = parser.push(piece, final=i == len(pieces) - 1)
        content += out
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": "", "id": "", "arguments": ""})
            call["id"] = d.get("id") or call["id"]
            call["name"] += d["function"].get("name") or ""
            call["arguments"] += d["function"].get("arguments") or ""
    return content, calls


@pytest.mark.parametrize("seed", range(30))
def test_streamed_hermes_calls_are_the_same_however_the_text_is_cut(seed: int) -> None:
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {north}"}}\n</tool_call>\n'
            '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call> done <tool')
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 25)))
    content, calls = streamed(text, cuts)
    assert content == "Let me check."  # the text before the first call; after a call, none (vLLM's hermes parser)
    assert shaped_answer(text, cuts, stream=False)[0] == content  # the whole answer's parser agrees
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris {north}"}
    assert json.loads(calls[1]["arguments"]) == {"city": "Rome"}  # name after arguments: sent whole at its end
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_call_cut_by_max_tokens_keeps_what_was_written() -> None:
    content, calls = streamed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [5, 30])
    assert content == "" and calls[0]["arguments"] == '{"city": "Par'


def test_the_whole_answer_non_streamed_carries_the_calls() -> None:
    shape = AnswerShape("hermes", stream=False)
    shape.shaped(EngineOutput(text="<tool_call>\n{\"name\": \"get_weather\", "))
    out = shape.shaped(EngineOutput(text="\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>", finish_reason=FINISH_STOP))
    assert out.raw_choice is not None and out.raw_choice["finish_reason"] == "tool_calls"
    (call,) = out.raw_choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and out.raw_choice["message"]["content"] is None


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def shaped_answer(text: str, cuts: list[int], stream: bool) -> tuple[str | None, list[str]]:
    """(content, call arguments) of an answer shaped from `text` cut at `cuts`, as the client gets it."""
    shape = AnswerShape("hermes", stream=stream)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content: str | None = None
    args: dict[int, str] = {}
    for i, piece in enumerate(pieces):
        out = shape.shaped(EngineOutput(text=piece, finish_reason=FINISH_STOP if i == len(pieces) - 1 else None))
        if out.raw_choice is None:
            continue
        if stream:
            delta = out.raw_choice["delta"]
            if "content" in delta:
                content = (content or "") + delta["content"]
            for d in delta.get("tool_calls") or []:
                args[d["index"]] = args.get(d["index"], "") + (d["function"].get("arguments") or "")
        elif out.raw_choice.get("message"):
            content = out.raw_choice["message"]["content"]
            args = {i: c["function"]["arguments"] for i, c in enumerate(out.raw_choice["message"].get("tool_calls") or [])}
    return content, [args[i] for i in sorted(args)]


@pytest.mark.parametrize("seed", range(10))
def test_whitespace_between_calls_is_no_content_streamed_or_not(seed: int) -> None:
    """OpenAI's message that only calls tools has content null, and its stream no content delta: the
    newline a hermes model writes between two calls is neither, however the text is cut. Text before
    a call is content, the same streamed and not."""
    rng = random.Random(seed)
    for text, content in ((TWO_CALLS, None), ("\n" + TWO_CALLS + "\n", None), ("Sure.\n" + TWO_CALLS, "Sure.\n"), (TWO_CALLS + "\nDone.", None),
                          ("\n\nHello \n", "\n\nHello \n")):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        for stream in (False, True):
            got, args = shaped_answer(text, cuts, stream)
            assert got == content, (stream, cuts, got)
            assert args == ([] if "tool_call" not in text else ['{"city": "Oslo"}', '{"city": "Rome"}']), (stream, args)
    assert shaped_answer(" \n", [1], stream=True) == (" \n", [])  # no call: whitespace is the answer


@pytest.mark.parametrize("cut", ["\n</tool_call", "\n</tool_", "\n<", "\n", ""])
def test_a_whole_call_whose_closing_tag_was_cut_is_a_call_streamed_or_not(cut: str) -> None:
    """max_tokens ended the answer inside `</tool_call>`, after the call's JSON: a call both ways
    (the non-streamed answer used to give the call's markup as content while the stream gave a call)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' + cut
    for stream in (False, True):
        assert shaped_answer(text, [9, 30], stream) == (None, ['{"city": "Oslo"}']), (stream, cut)


def test_plans_name_the_field_they_refuse() -> None:
    with pytest.raises(EngineRequestRejected) as caught:
        plan({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, "hermes", True)
    assert caught.value.param == "response_format.json_schema.schema" and "nope" in str(caught.value)
    with pytest.raises(EngineRequestRejected) as caught:
        plan({"response_format": {"type": "json_object"}}, "hermes", False)  # asynchronous batching: no masks
    assert caught.value.param == "response_format" and "asynchronously" in str(caught.value)
    with pytest.raises(EngineRequestRejected) as caught:
        plan({"tools": [WEATHER]}, None, True)
    assert caught.value.param == "tools"
    assert plan({"tools": [WEATHER], "tool_choice": "none"}, "hermes", True) is None
    named = plan({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "llama3_json", True)
    assert named is not None and named.grammar is not None and '"parameters"' in named.grammar


@pytest.fixture(scope="module")
def separate() -> Iterator[EngineLoop]:
    box = EngineLoop()
    box.run(box.engine.start())
    try:
        yield box
    finally:
        box.close()


def test_the_engine_process_follows_the_schema(separate: EngineLoop) -> None:
    """The grammar goes through the pipe to the engine process, whose batching applies the mask."""
    proc = separate.engine
    assert proc.guided
    messages = [{"role": "user", "content": "Invent a person: JSON with a name and an age."}]
    body = {"messages": messages, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}

    async def answer() -> list[str]:
        texts = []
        for _ in range(3):
            req = EngineRequest(request_id=uuid.uuid4().hex, max_tokens=40, sampling=SamplingParams(temperature=1.0),
                                prompt_token_ids=proc.encode_chat(messages), extra=body)
            outs = [out async for out in proc.stream(req)]
            assert outs[-1].finish_reason == FINISH_STOP
            texts.append("".join(o.text for o in outs))
        return texts

    for text in separate.run(answer()):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_schemas_as_sdks_send_them_compile() -> None:
    """pydantic's schemas (what openai's parse and LangChain send): nested models as $defs/$ref,
    enums, optional fields as anyOf with null; and auto tool choice with a response format."""
    from typing import Literal

    from pydantic import BaseModel

    class Address(BaseModel):
        city: str
        country: Literal["FR", "DE", "IT"]

    class Person(BaseModel):
        name: str
        nickname: str | None = None
        home: Address
        past: list[Address]

    schema = Person.model_json_schema()
    assert "$defs" in schema
    assert plan({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}}, "hermes", True) is not None
    both = plan({"tools": [WEATHER], "tool_choice": "auto", "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "hermes", True)
    assert both is not None and both.grammar is not None and both.parser == "hermes"  # calls or the JSON answer


@pytest.mark.parametrize("seed", range(30))
def test_streamed_llama3_json_calls_are_the_same_however_the_text_is_cut(seed: int) -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa\\"ris} {", "days": [1, 2]}} ; '
            '{"parameters": {"city": "Rome"}, "name": "get_weather"}')
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 25)))
    content, calls = streamed(text, cuts, Llama3Deltas())
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Pa"ris} {', "days": [1, 2]}
    assert json.loads(calls[1]["arguments"]) == {"city": "Rome"}  # name after arguments: sent whole at its end
    arguments_deltas = []
    parser = Llama3Deltas()
    for piece in [text[:40], text[40:60], text[60:]]:
        arguments_deltas += [d for d in parser.push(piece)[1] if "id" not in d]
    assert len(arguments_deltas) >= 2  # the first call's arguments left as they were written


def test_a_llama3_json_answer_that_is_no_call_is_content() -> None:
    assert streamed("Paris is sunny.", [3, 7], Llama3Deltas()) == ("Paris is sunny.", {})
    assert streamed('{"answer": 42}', [3, 7], Llama3Deltas()) == ('{"answer": 42}', {})


async def test_a_llama3_json_model_calls_the_named_tool(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The llama3_json parser end to end on the real model: the tools described in its format, the
    named call forced by its grammar, streamed as argument deltas, parsed back into the call."""
    monkeypatch.setattr(engine, "tool_parser", "llama3_json")
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"], "additionalProperties": False}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    body = {"messages": messages, "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True}
    prompt = engine.encode_chat(messages, [weather])
    assert '"parameters": <args-json-object>' in engine.tokenizer.decode(prompt)
    req = EngineRequest(request_id=uuid.uuid4().hex, max_tokens=40, sampling=SamplingParams(temperature=0.0), prompt_token_ids=prompt, extra=body)
    outs = [out async for out in engine.stream(req)]
    deltas = [d for o in outs if o.raw_choice for d in o.raw_choice["delta"].get("tool_calls", [])]
    assert outs[-1].raw_choice["finish_reason"] == "tool_calls"
    assert deltas[0]["function"]["name"] == "get_weather" and len(deltas) > 2
    arguments = json.loads("".join(d["function"].get("arguments", "") for d in deltas))
    jsonschema.validate(arguments, city)
