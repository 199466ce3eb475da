"""Structured outputs and tool calls on the embedded hf engine (issue 21), through the real gateway with
the openai SDK and LangChain as clients: `response_format` json_object / json_schema enforced by guided
decoding (engines/decoding/guided.py), tools rendered into the prompt and parsed into `tool_calls`
(engines/decoding/structured.py), streamed as argument deltas; every answer metered like chat."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import MODEL, Gateway, start_gateway, stop_server

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Invent a person. Answer in JSON with their name and age."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"], "additionalProperties": False},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def gw(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway for this module, on its own database, serving the session's embedded model."""
    server, gateway = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-structured"))
    try:
        yield gateway
    finally:
        stop_server(server)


@pytest.fixture
async def key(gw: Gateway) -> dict[str, Any]:
    return await gw.new_key()


def sdk(gw: Gateway, key: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=300)


async def assert_metered(gw: Gateway, request_id: str, usage: Any, status: str = "completed") -> dict[str, Any]:
    """The ledger row says what the client was told: the same prompt and completion tokens."""
    row = await gw.ledger_row(request_id)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert row["status"] == status
    return row


# structured outputs ---------------------------------------------------------------------------
async def test_json_schema_answers_validate_in_20_of_20_seeded_runs(gw: Gateway, key: dict[str, Any]) -> None:
    client = sdk(gw, key)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def one(seed: int) -> Any:
        return await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK_PERSON, response_format=fmt, max_tokens=64, temperature=1.0, seed=seed)  # room for the longest person

    raws = await asyncio.gather(*(one(seed) for seed in range(20)))
    for raw in raws:
        resp = raw.parse()
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        await assert_metered(gw, raw.headers["x-request-id"], resp.usage)
    print(f"\n20 of 20 valid, e.g. {raws[0].parse().choices[0].message.content}")


async def test_json_object_streamed_parses_and_its_usage_is_the_ledgers(gw: Gateway, key: dict[str, Any]) -> None:
    client = sdk(gw, key)
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format={"type": "json_object"}, max_tokens=60, temperature=0,
        stream=True, stream_options={"include_usage": True})
    text, finish, usage, request_id = "", None, None, None
    async for chunk in stream:
        request_id = chunk.id.removeprefix("chatcmpl-")
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)
    assert usage is not None and request_id is not None
    await assert_metered(gw, request_id, usage)


async def test_beta_parse_fills_a_pydantic_model(gw: Gateway, key: dict[str, Any]) -> None:
    client = sdk(gw, key)
    for parse in (client.beta.chat.completions.parse, client.chat.completions.parse):
        resp = await parse(model=MODEL, messages=ASK_PERSON, response_format=Person, max_tokens=96, temperature=0.8)  # room for the longest Person
        person = resp.choices[0].message.parsed
        assert isinstance(person, Person), resp.choices[0].message.content
        assert 0 <= person.age <= 120


async def test_langchain_with_structured_output(gw: Gateway, key: dict[str, Any]) -> None:
    from langchain_openai import ChatOpenAI

    # 96 tokens: a tool call wraps the object (hermes tags, the name, "arguments") and a 24-character name
    # can take a token a character; at 40 a sampled name could cut the call short (None from LangChain).
    # seeded: the hf engine honours it, so the sample is the same every run (unseeded, a long sampled name
    # cut one call short once in a full run)
    llm = ChatOpenAI(base_url=gw.v1, api_key=key["key"], model=MODEL, max_tokens=96, temperature=0.5, max_retries=0, seed=7)
    for method in ("json_schema", "function_calling"):  # response_format, then a named tool_choice
        person = await llm.with_structured_output(Person, method=method).ainvoke("Invent a person with a name and an age.")
        assert isinstance(person, Person), (method, person)


async def test_an_answer_cut_by_max_tokens_says_length(gw: Gateway, key: dict[str, Any]) -> None:
    client = sdk(gw, key)
    long_text = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a story as JSON."}], max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": long_text}})
    resp = raw.parse()
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.choices[0].message.content.startswith('{"story": "')
    await assert_metered(gw, raw.headers["x-request-id"], resp.usage)


# tools ----------------------------------------------------------------------------------------
async def test_tool_round_trip(gw: Gateway, key: dict[str, Any]) -> None:
    """The model calls the tool (tool_choice required), the client sends the result back, the model
    answers. Each turn's prompt as billed is the conversation with the tools as the engine rendered it."""
    client = sdk(gw, key)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0)
    first = raw.parse()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    row = await assert_metered(gw, raw.headers["x-request-id"], first.usage)
    assert row["prompt_tokens"] == len(gw.engine.encode_chat(ASK_WEATHER, [WEATHER])) > len(gw.engine.encode_chat(ASK_WEATHER))

    turn = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "weather": "sunny, 21 C"})}]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0)
    answer = raw.parse()
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    row = await assert_metered(gw, raw.headers["x-request-id"], answer.usage)
    sent = [{k: v for k, v in m.items()} for m in turn]
    assert row["prompt_tokens"] == len(gw.engine.encode_chat(sent))  # tool_choice none: the tools are not shown
    print(f"\ncalled {call.function.name}({call.function.arguments}); answered {answer.choices[0].message.content!r}")


async def test_streamed_tool_call_arrives_as_argument_deltas(gw: Gateway, key: dict[str, Any]) -> None:
    client = sdk(gw, key)
    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
    deltas, finish, usage, request_id = [], None, None, None
    async for chunk in stream:
        request_id = chunk.id.removeprefix("chatcmpl-")
        usage = chunk.usage or usage
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    head, *rest = deltas
    assert head.id and head.function.name == "get_weather" and head.function.arguments == ""
    assert len(rest) > 1 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert usage is not None and request_id is not None
    await assert_metered(gw, request_id, usage)


async def test_tool_choice_none_and_auto_answer_with_text_or_calls(gw: Gateway, key: dict[str, Any]) -> None:
    client = sdk(gw, key)
    for choice in ("none", "auto"):
        resp = await client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=choice, max_tokens=20, temperature=0)
        message = resp.choices[0].message
        if choice == "none":
            assert message.tool_calls is None and message.content
        for call in message.tool_calls or []:  # auto: whatever the model chose, well formed
            assert call.function.name == "get_weather"


# what is refused, and metering ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": 17}, "n"),
        ({"tools": [WEATHER], "tool_choice": "required", "n": 2, "stream": True, "logprobs": True}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ],
)
async def test_what_the_engine_cannot_do_is_a_400_naming_the_field(gw: Gateway, key: dict[str, Any], fields: dict[str, Any], param: str) -> None:
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        r = await c.post("/chat/completions", json={"model": MODEL, "messages": ASK_PERSON, "max_tokens": 5, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=key["id"]) == 0  # refused before admission: no row


async def test_disconnect_mid_structured_stream_leaves_a_cancelled_row(gw: Gateway, key: dict[str, Any]) -> None:
    story = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story as JSON."}], "max_tokens": 200, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": story}}}
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        async with c.stream("POST", "/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            chunks = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    chunks += 1
                    if chunks == 3:
                        break
    row = await gw.ledger_row(request_id)
    assert row["status"] == "cancelled" and row["finish_reason"] == "cancelled"
    assert 3 <= row["completion_tokens"] < 200


async def test_quota_refusal_is_the_same_429(gw: Gateway) -> None:
    key = await gw.new_key()
    async with gw.admin_client() as admin:
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": 50}})
        assert r.status_code == 200, r.text
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk(gw, key).chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=40)
    error = caught.value.body
    assert error["type"] == "insufficient_quota" and error["code"] == "monthly_tokens"
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=key["id"]) == 0


async def test_a_grammar_that_fails_mid_answer_is_an_error_not_an_answer(gw: Gateway, key: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance can give up on a grammar mid-answer (its resource limits): the request then ends
    (only the end of sequence is allowed) and must say it failed, not pass the cut text off as the
    schema's JSON."""
    from engines.decoding import guided

    real = guided.Guide.catch_up

    def failing(self: guided.Guide, tokenizer: Any, generated: list[int]) -> None:
        real(self, tokenizer, generated)
        if len(generated) >= 3 and self.failed is None:
            self._fail("step limit reached (simulated)")

    monkeypatch.setattr(guided.Guide, "catch_up", failing)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with pytest.raises(openai.InternalServerError) as caught:
        await sdk(gw, key).chat.completions.create(model=MODEL, messages=ASK_PERSON, response_format=fmt, max_tokens=40)
    assert caught.value.status_code == 503 and "guided decoding failed: step limit reached" in caught.value.message
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=key["id"], status="error") == 1
