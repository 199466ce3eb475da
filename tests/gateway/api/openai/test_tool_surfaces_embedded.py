"""Tools and structured outputs through /v1/responses and /v1/messages on the embedded model (the
real SmolLM2-135M on the `hf` engine, guided decoding): a named tool choice makes the model call
the tool, its arguments match the tool's schema, the result goes back and the model answers; a
json_schema text.format parses into the pydantic model; usage equals the ledger row."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.conftest import MODEL, Gateway
from tests.gateway.api.openai.test_tool_surfaces import ANTHROPIC_TOOLS, RESPONSES_TOOLS, WEATHER_PARAMS, no_unknown_fields, sse

QUESTION = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture
def client(customer: dict[str, Any], client_for: Any) -> Any:
    return client_for(customer["key"])


async def test_responses_named_tool_call_round_trip(gateway: Gateway, client: Any) -> None:
    choice = {"type": "function", "name": "get_weather"}
    first = await client.responses.create(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=choice, max_output_tokens=40, **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    row = await gateway.ledger_row(first.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (first.usage.input_tokens, first.usage.output_tokens, "responses")

    # Streamed: the same call, its arguments as deltas, every event one the SDK's models declare.
    raw = await client.responses.with_raw_response.create(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=choice,
                                                          max_output_tokens=40, stream=True, **GREEDY)
    events = sse(await raw.http_response.aread())
    for name, payload in events:
        no_unknown_fields(TypeAdapter(ResponseStreamEvent).validate_python(payload), name + ": ")
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    deltas = [p["delta"] for n, p in events if n == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == calls[0].arguments  # streamed as the model writes them
    async with client.responses.stream(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=choice, max_output_tokens=40, **GREEDY) as stream:
        helper = "".join([e.delta async for e in stream if e.type == "response.function_call_arguments.delta"])
        final = await stream.get_final_response()
    assert helper == [o for o in final.output if o.type == "function_call"][0].arguments == calls[0].arguments
    row = await gateway.ledger_row(final.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)

    # The result goes back through previous_response_id; with tool_choice none the model answers in text.
    second = await client.responses.create(model=MODEL, previous_response_id=first.id, tools=RESPONSES_TOOLS, tool_choice="none",
                                           input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}],
                                           max_output_tokens=30, **GREEDY)
    assert [o.type for o in second.output] == ["message"] and second.output_text
    row = await gateway.ledger_row(second.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["api"]) == (second.usage.input_tokens, "responses")
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": first.output_text or None, "tool_calls": [
                        {"id": calls[0].call_id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                    {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 degrees and sunny"}]
    assert second.usage.input_tokens == len(gateway.engine.encode_chat(conversation))  # the call and its result are the billed prompt


TWO_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
             {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}]


async def test_parallel_calls_are_items_of_their_own_and_no_content_streamed_or_not(gateway: Gateway, client: Any) -> None:
    """With tool_choice required the model writes two calls, a newline between them. Each call is an
    output item with an id of its own, and the newline is no message: streamed and not, the same
    items in the same order (Responses); a chat message with calls only has content null and its
    stream no content delta (OpenAI's shapes)."""
    ask = {"model": MODEL, "input": QUESTION, "tools": TWO_TOOLS, "tool_choice": "required", "max_output_tokens": 100, **GREEDY}
    whole = await client.responses.create(**ask)
    assert [o.type for o in whole.output] == ["function_call", "function_call"], whole.output
    ids = [o.id for o in whole.output]
    assert len(set(ids)) == 2 and [o.id for o in (await client.responses.retrieve(whole.id)).output] == ids
    async with client.responses.stream(**ask) as stream:
        final = await stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [(o.type, o.name, o.arguments) for o in whole.output]
    assert len({o.id for o in final.output}) == 2

    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TWO_TOOLS]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": tools, "tool_choice": "required",
            "max_tokens": 100, **GREEDY}
    message = (await client.chat.completions.create(**chat)).choices[0].message
    assert message.content is None and len(message.tool_calls) == 2, message
    chunks = [c async for c in await client.chat.completions.create(**chat, stream=True)]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices), [c.choices[0].delta for c in chunks if c.choices]
    assert len({d.index for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []}) == 2


async def test_responses_parse_with_a_pydantic_model(gateway: Gateway, client: Any) -> None:
    class City(BaseModel):
        name: str
        country: str
        capital: bool  # (a number would let the 135M model write digits until max_output_tokens)

    for seed_question in ("Describe Paris.", "Describe Tokyo.", "Describe Lima."):
        parsed = await client.responses.parse(model=MODEL, input=seed_question, text_format=City, max_output_tokens=80, **GREEDY)
        assert isinstance(parsed.output_parsed, City), parsed.output_text
        row = await gateway.ledger_row(parsed.id.removeprefix("resp_"))
        assert (row["prompt_tokens"], row["completion_tokens"]) == (parsed.usage.input_tokens, parsed.usage.output_tokens)


async def test_messages_tool_use_round_trip_and_stream_helper(gateway: Gateway, customer: dict[str, Any]) -> None:
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=customer["key"], max_retries=0, timeout=120) as claude:
        question = [{"role": "user", "content": QUESTION}]
        choice = {"type": "tool", "name": "get_weather"}
        raw = await claude.messages.with_raw_response.create(model=MODEL, max_tokens=40, messages=question, tools=ANTHROPIC_TOOLS,
                                                             tool_choice=choice, extra_body=GREEDY)
        msg = await raw.parse()
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather" and msg.stop_reason == "tool_use", msg.content
        # The body is what GET /openapi.json says a Message is (it used to say text blocks only, and no tool_use stop reason)
        async with httpx.AsyncClient(base_url=gateway.base_url) as http:
            served = (await http.get("/openapi.json")).json()
        jsonschema.validate(raw.http_response.json(), served["components"]["schemas"]["Message"])
        jsonschema.validate(uses[0].input, WEATHER_PARAMS)
        row = await gateway.ledger_row(msg.id.removeprefix("msg_"))
        assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (msg.usage.input_tokens, msg.usage.output_tokens, "messages")
        counted = await claude.messages.count_tokens(model=MODEL, messages=question, tools=ANTHROPIC_TOOLS, tool_choice=choice)
        assert counted.input_tokens == msg.usage.input_tokens

        async with claude.messages.stream(model=MODEL, max_tokens=40, messages=question, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                          extra_body=GREEDY) as stream:
            partial = "".join([e.partial_json async for e in stream if e.type == "input_json"])
            final = await stream.get_final_message()
        streamed_use = [b for b in final.content if b.type == "tool_use"][0]
        assert json.loads(partial) == streamed_use.input == uses[0].input and final.stop_reason == "tool_use"

        follow = [*question, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}]}]
        answer = await claude.messages.create(model=MODEL, max_tokens=30, messages=follow, tools=ANTHROPIC_TOOLS,
                                              tool_choice={"type": "none"}, extra_body=GREEDY)
        assert answer.content[0].type == "text" and answer.content[0].text and answer.stop_reason in ("end_turn", "max_tokens")
        conversation = [*question, {"role": "assistant", "content": "".join(b.text for b in msg.content if b.type == "text") or None, "tool_calls": [
                            {"id": uses[0].id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}]},
                        {"role": "tool", "tool_call_id": uses[0].id, "content": "18 degrees and sunny"}]
        assert answer.usage.input_tokens == len(gateway.engine.encode_chat(conversation))


async def test_openai_agents_one_tool_agent_on_the_embedded_model(gateway: Gateway, client: Any) -> None:
    """The Agents SDK against the real model: the first turn must call the tool (tool_choice names it,
    enforced by guided decoding); the SDK then resets tool_choice (its default), and the model answers
    from the tool's result."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "18 degrees and sunny"

    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40))
    result = await Runner.run(agent, QUESTION, max_turns=3)
    assert len(asked) == 1 and isinstance(result.final_output, str) and result.final_output
    for response in result.raw_responses:
        row = await gateway.ledger_row(response.response_id.removeprefix("resp_"))
        assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (
            response.usage.input_tokens, response.usage.output_tokens, "responses")


async def test_misshapen_tool_fields_are_400s_naming_them(gateway: Gateway, customer: dict[str, Any]) -> None:
    """A tool_choice whose `function` is no object, or an assistant turn whose tool_calls are not
    call objects, is the client's error (400 naming the field), never a 500; the server keeps serving."""
    import httpx

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}]
    question = [{"role": "user", "content": QUESTION}]
    bodies = {
        "tool_choice": {"tools": tools, "tool_choice": {"type": "function", "function": "get_weather"}, "messages": question},
        "tool_choice ": {"tools": tools, "tool_choice": {"type": "function", "function": ["get_weather"]}, "messages": question,
                         "stream": True},
        "messages": {"tools": tools, "messages": [*question, {"role": "assistant", "tool_calls": "x"},
                                                  {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}]},
        "messages ": {"tools": tools, "messages": [*question, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                                                                   "function": "get_weather"}]},
                                                   {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}]},
    }
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}, timeout=60) as c:
        for param, body in bodies.items():
            r = await c.post("/chat/completions", json={"model": MODEL, "max_tokens": 5, **body})
            assert r.status_code == 400, (param, r.status_code, r.text)
            assert r.json()["error"]["param"] == param.strip(), (param, r.text)
        ok = await c.post("/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": question})
        assert ok.status_code == 200


async def test_messages_structured_output_and_thinking(gateway: Gateway, customer: dict[str, Any]) -> None:
    """Anthropic's structured outputs (output_config.format json_schema) are honoured as chat's
    response_format is (guided decoding); extended thinking, which this model cannot do, is a 400
    rather than silently left out; thinking disabled is fine."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "capital": {"type": "boolean"}},
              "required": ["name", "capital"], "additionalProperties": False}
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=customer["key"], max_retries=0, timeout=120) as claude:
        question = [{"role": "user", "content": "Describe Paris."}]
        msg = await claude.messages.create(model=MODEL, max_tokens=60, messages=question, extra_body=GREEDY,
                                           output_config={"format": {"type": "json_schema", "schema": schema}})
        [block] = msg.content
        jsonschema.validate(json.loads(block.text), schema)
        for bad, param in (({"format": {"type": "json_schema"}}, "output_config.format"), ({"effort": "huge"}, "output_config.effort"),
                           ({"format": {"type": "json_schema", "schema": schema}, "verbosity": 2}, "output_config")):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(model=MODEL, max_tokens=5, messages=question, output_config=bad)  # type: ignore[arg-type]
            assert refused.value.body["error"]["message"].startswith(param + " "), refused.value.body
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(model=MODEL, max_tokens=2000, messages=question, thinking={"type": "enabled", "budget_tokens": 1024})
        assert refused.value.body["error"]["message"].startswith("extended thinking is not supported"), refused.value.body
        plain = await claude.messages.create(model=MODEL, max_tokens=3, messages=question, thinking={"type": "disabled"}, extra_body=GREEDY)
        assert plain.usage.output_tokens == 3
