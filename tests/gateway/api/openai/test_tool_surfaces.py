"""Tools and structured outputs through the Responses API (/v1/responses) and Anthropic's Messages
API (/v1/messages), with the official SDKs as clients (openai, anthropic, openai-agents), end to
end against the in-process TensorRT-LLM engine. TensorRT-LLM cannot run here: its engine is the
contract-tested test double (tests/fakes/trtllm.py), whose "model" writes the text a test sets
(`LLM.continuation`: a Hermes tool call, JSON, or an answer). Everything else is real: the gateway,
its translation to and from the chat completion the engine serves, Postgres, the ledger.

What must hold: a function call comes back as the API's own item or block (streamed as argument
deltas, every event passing the SDK's models), the tool's result goes back to the model as the
chat template's tool message, usage equals the ledger row (api = the surface), stored responses
keep function calls for previous_response_id, text.format reaches guided decoding, and cached
answers are served and metered on both routes as chat's are."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError
from pydantic import BaseModel, TypeAdapter

from tests.engines.conftest import models_db, tollgate_with, upstreams  # noqa: F401 - fixtures: Tollgates configured by a models.yaml, scripted upstreams
from tests.engines.backends.test_openai_pool import pool_yaml
from tests.fakes.upstream import WORDS, Behaviour
from tests.fakes import trtllm as double

QUESTION = "What is the weather in Paris?"
CALL = ' Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = " It is 18C in Paris."
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMS, "strict": True}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_PARAMS}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMS}}]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Any:
    return double.install(monkeypatch)


@pytest.fixture
def gw(api: Any, tollgate_with: Any) -> Any:  # noqa: F811
    return tollgate_with("""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
        tool_parser: hermes
        cache: true
        llm_options: {guided_decoding_backend: xgrammar}
    """)


def says(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """What the double's model writes for every request from now on."""
    monkeypatch.setattr(double.LLM, "continuation", text)


def calls_until_it_has_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The double's model calls get_weather until the conversation holds a tool result, then answers."""
    def continuation(llm: Any) -> str:
        conversation = llm.tokenizer.templates[-1]["conversation"] if llm.tokenizer.templates else []
        return ANSWER if any(m.get("role") == "tool" for m in conversation) else CALL
    monkeypatch.setattr(double.LLM, "continuation", property(continuation))


def llm_of(gw: Any) -> Any:
    return gw.engines()["llama"].primary.unwrapped()._llm


def last_template(gw: Any) -> dict[str, Any]:
    return llm_of(gw).tokenizer.templates[-1]


async def openai_client(gw: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


# Fields of OpenAI's API that the SDK's models do not declare (its tests read them as extras).
NOT_IN_THE_SDK = {"Response": {"store"}}


def no_unknown_fields(model: BaseModel, where: str = "") -> None:
    """Strict: every field the gateway sent is one the SDK's model declares (the SDK's models accept
    and keep unknown fields, so validation alone would not see a misspelt one)."""
    unknown = set(model.model_extra or ()) - NOT_IN_THE_SDK.get(type(model).__name__, set())
    assert not unknown, f"{where}{type(model).__name__} has fields the SDK does not know: {unknown}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                no_unknown_fields(item, f"{where}{name}.")


# Responses API ---------------------------------------------------------------------------------------------
async def test_responses_function_call_round_trip_and_usage_equals_ledger_row(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from openai.types.responses import Response

    says(monkeypatch, CALL)
    client = await openai_client(gw)
    first = await client.responses.create(model="llama", input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="auto", temperature=0)
    no_unknown_fields(Response.model_validate(first.model_dump(mode="json", exclude_unset=True)))
    template = last_template(gw)
    assert template["tools"] == [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True}}]  # chat's shape
    message, call = first.output
    assert (message.type, message.content[0].text, first.output_text) == ("message", " Let me check. ", " Let me check. ")
    assert (call.type, call.name, json.loads(call.arguments), call.status) == ("function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and first.status == "completed"
    assert (first.tools[0].name, first.tools[0].parameters, first.tool_choice) == ("get_weather", WEATHER_PARAMS, "auto")
    result = llm_of(gw).requests[-1]
    assert first.usage.input_tokens == len(result.prompt_token_ids)  # the tools are in the billed prompt
    row = await gw.ledger_row(first.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"], row["status"]) == (
        first.usage.input_tokens, first.usage.output_tokens, "responses", "completed")

    # The call's result goes back (the output items passed back as OpenAI's docs show): the model
    # sees its own call as the assistant's tool_calls and the result as a tool message.
    says(monkeypatch, ANSWER)
    items = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
    second = await client.responses.create(model="llama", input=items, tools=RESPONSES_TOOLS, temperature=0)
    conversation = last_template(gw)["conversation"]
    assert conversation[1] == {"role": "assistant", "content": " Let me check. ", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]}
    assert conversation[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "18C"}
    assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
    listed = await client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "function_call", "function_call_output"]
    assert (listed.data[2].call_id, listed.data[3].output) == (call.call_id, "18C")

    # The same through previous_response_id: the stored response kept its function call.
    says(monkeypatch, CALL)
    stored = await client.responses.create(model="llama", input=QUESTION, tools=RESPONSES_TOOLS, temperature=0)
    assert (await client.responses.retrieve(stored.id)).output[1].call_id == stored.output[1].call_id
    says(monkeypatch, ANSWER)
    follow = await client.responses.create(model="llama", previous_response_id=stored.id, tools=RESPONSES_TOOLS, temperature=0,
                                           input=[{"type": "function_call_output", "call_id": stored.output[1].call_id, "output": "18C"}])
    conversation = last_template(gw)["conversation"]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool"]
    assert conversation[1]["tool_calls"][0]["id"] == conversation[2]["tool_call_id"] == stored.output[1].call_id
    assert follow.output_text == ANSWER
    row = await gw.ledger_row(follow.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["api"]) == (follow.usage.input_tokens, "responses") and follow.usage.input_tokens == len(
        llm_of(gw).requests[-1].prompt_token_ids)


async def test_responses_stream_of_a_function_call_passes_the_sdk_models(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from openai.types.responses import ResponseStreamEvent

    events_model = TypeAdapter(ResponseStreamEvent)
    says(monkeypatch, CALL)
    client = await openai_client(gw)
    raw = await client.responses.with_raw_response.create(model="llama", input=QUESTION, tools=RESPONSES_TOOLS, stream=True, temperature=0)
    events = sse(await raw.http_response.aread())
    kinds = [name for name, _ in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * (kinds.count("response.output_text.delta")),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    for name, payload in events:
        assert payload["type"] == name
        no_unknown_fields(events_model.validate_python(payload), name + ": ")
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    added = events[kinds.index("response.output_item.added", 3)][1]
    assert (added["output_index"], added["item"]["type"], added["item"]["name"], added["item"]["arguments"]) == (1, "function_call", "get_weather", "")

    # The SDK's stream helper: the arguments it assembles from the deltas are the call's.
    async with client.responses.stream(model="llama", input=QUESTION, tools=RESPONSES_TOOLS, temperature=0) as stream:
        seen = [e async for e in stream]
        final = await stream.get_final_response()
    streamed = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
    done = next(e for e in seen if e.type == "response.function_call_arguments.done")
    call = final.output[1]
    assert streamed == done.arguments == call.arguments and json.loads(streamed) == {"city": "Paris"}
    assert (call.type, call.name, done.item_id, done.output_index) == ("function_call", "get_weather", call.id, 1)
    row = await gw.ledger_row(final.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (final.usage.input_tokens, final.usage.output_tokens, "responses")


def test_streamed_call_pieces_from_an_openai_pool_become_one_function_call_item() -> None:
    """The renderer alone, with a tool call in the pieces an OpenAI-compatible upstream streams (id and
    name first, the arguments split over chunks), after some text: every event passes the SDK's models."""
    from types import SimpleNamespace

    from openai.types.responses import Response, ResponseStreamEvent

    from gateway.api.openai.responses import ResponseRenderer
    from gateway.api.openai.responses_protocol import ResponsesRequest

    gen = SimpleNamespace(request_id="abc", created=1, model="m", prompt_tokens=7, completion_tokens=5, cached_tokens=None, finish_reason="stop")
    request = ResponsesRequest(model="m", input="hi", tools=RESPONSES_TOOLS)
    render = ResponseRenderer(gen, request)  # type: ignore[arg-type]
    chunks = [{"content": "Sure."}, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    raw = render.first() + b"".join(render.delta("", None, {"index": 0, "delta": d, "finish_reason": None}) for d in chunks) + render.end()
    events = sse(raw)
    for name, payload in events:
        no_unknown_fields(TypeAdapter(ResponseStreamEvent).validate_python(payload), name + ": ")
    assert "".join(p["delta"] for n, p in events if n == "response.function_call_arguments.delta") == '{"city": "Paris"}'
    final = Response.model_validate(events[-1][1]["response"])
    assert [(o.type, getattr(o, "call_id", None)) for o in final.output] == [("message", None), ("function_call", "call_1")]
    assert final.output[1].arguments == '{"city": "Paris"}' and final.output_text == "Sure."


async def test_responses_text_format_reaches_guided_decoding_and_parse_works(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    class Weather(BaseModel):
        city: str
        temperature_c: int

    says(monkeypatch, '{"city": "Paris", "temperature_c": 18}')
    client = await openai_client(gw)
    parsed = await client.responses.parse(model="llama", input=QUESTION, text_format=Weather, temperature=0)
    assert parsed.output_parsed == Weather(city="Paris", temperature_c=18)
    guide = llm_of(gw).requests[-1].sampling_params.guided_decoding
    assert set(guide.json["properties"]) == {"city", "temperature_c"} and guide.json["additionalProperties"] is False
    assert (parsed.text.format.type, parsed.text.format.name, parsed.text.format.strict) == ("json_schema", "Weather", True)
    row = await gw.ledger_row(parsed.id.removeprefix("resp_"))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (parsed.usage.input_tokens, parsed.usage.output_tokens, "responses")

    plain = await client.responses.create(model="llama", input=QUESTION, text={"format": {"type": "json_object"}}, temperature=0)
    assert llm_of(gw).requests[-1].sampling_params.guided_decoding == double.GuidedDecodingParams(json_object=True)
    assert json.loads(plain.output_text) == {"city": "Paris", "temperature_c": 18}


async def test_responses_refusals_name_the_responses_field(api: Any, tollgate_with: Any) -> None:  # noqa: F811
    plain = tollgate_with("""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
    """)  # no guided decoding backend, no tool parser
    client = await openai_client(plain)
    with pytest.raises(BadRequestError) as caught:
        await client.responses.create(model="llama", input=QUESTION, text={"format": {"type": "json_object"}})
    assert caught.value.body["param"] == "text.format" and "text.format needs guided decoding" in caught.value.body["message"]
    with pytest.raises(BadRequestError) as caught:
        await client.responses.create(model="llama", input=QUESTION, tools=RESPONSES_TOOLS)
    assert caught.value.body["param"] == "tools"
    with pytest.raises(BadRequestError) as caught:
        await client.responses.create(model="llama", input=QUESTION, tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools" and "web_search" in caught.value.body["message"]


async def test_openai_agents_one_tool_agent_run(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenAI Agents SDK's default model (the Responses API) against the gateway: the model calls
    the tool, the agent runs it and sends its result back, the model answers."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # nothing is sent to OpenAI's trace collector (no network here)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "18C"

    calls_until_it_has_the_result(monkeypatch)
    client = await openai_client(gw)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="llama", openai_client=client))
    result = await Runner.run(agent, QUESTION)
    assert asked == ["Paris"] and result.final_output == ANSWER
    conversation = last_template(gw)["conversation"]
    assert conversation[-1] == {"role": "tool", "tool_call_id": conversation[-2]["tool_calls"][0]["id"], "content": "18C"}
    assert len(result.raw_responses) == 2
    for response in result.raw_responses:
        row = await gw.ledger_row(response.response_id.removeprefix("resp_"))
        assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (
            response.usage.input_tokens, response.usage.output_tokens, "responses")

    # Streamed (the SDK reads the typed events, function call arguments included), the same run.
    streamed = Runner.run_streamed(agent, QUESTION)
    kinds = [e.type async for e in streamed.stream_events()]
    assert asked == ["Paris", "Paris"] and streamed.final_output == ANSWER and "raw_response_event" in kinds
    assert [r.usage.output_tokens for r in streamed.raw_responses] == [r.usage.output_tokens for r in result.raw_responses]


# Anthropic Messages API ------------------------------------------------------------------------------------
async def claude(gw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0)


async def test_messages_tool_use_round_trip_and_usage_equals_ledger_row(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    says(monkeypatch, CALL)
    client = await claude(gw)
    question = [{"role": "user", "content": QUESTION}]
    msg = await client.messages.create(model="llama", max_tokens=100, messages=question, tools=ANTHROPIC_TOOLS,
                                       tool_choice={"type": "auto"}, extra_body={"temperature": 0})
    assert last_template(gw)["tools"] == CHAT_TOOLS
    text, use = msg.content
    assert (text.type, text.text, msg.stop_reason) == ("text", " Let me check. ", "tool_use")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"}) and use.id.startswith("toolu_")
    assert msg.usage.input_tokens == len(llm_of(gw).requests[-1].prompt_token_ids)
    row = await gw.ledger_row(msg.id.removeprefix("msg_"))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (msg.usage.input_tokens, msg.usage.output_tokens, "messages")
    counted = await client.messages.count_tokens(model="llama", messages=question, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == msg.usage.input_tokens  # the tools counted as the engine bills them

    # The tool's result goes back as Anthropic's docs show: the assistant turn as it came, a tool_result.
    says(monkeypatch, ANSWER)
    follow = [*question, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18C"}]}]}]
    answer = await client.messages.create(model="llama", max_tokens=100, messages=follow, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    conversation = last_template(gw)["conversation"]
    assert conversation[1] == {"role": "assistant", "content": " Let me check. ", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert conversation[2] == {"role": "tool", "tool_call_id": use.id, "content": "18C"}
    assert (answer.content[0].text, answer.stop_reason) == (ANSWER, "end_turn")
    counted = await client.messages.count_tokens(model="llama", messages=follow, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens


async def test_messages_stream_of_a_tool_use(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from anthropic.types import RawMessageStreamEvent

    says(monkeypatch, CALL)
    client = await claude(gw)
    question = [{"role": "user", "content": QUESTION}]
    async with client.messages.with_streaming_response.create(model="llama", max_tokens=100, messages=question, tools=ANTHROPIC_TOOLS,
                                                              stream=True, extra_body={"temperature": 0}) as raw:
        events = sse(await raw.read())
    kinds = [(name, p.get("content_block", p.get("delta", {})).get("type")) for name, p in events]
    texts = kinds.count(("content_block_delta", "text_delta"))
    assert kinds == [("message_start", None), ("content_block_start", "text"), ("ping", None), *[("content_block_delta", "text_delta")] * texts,
                     ("content_block_stop", None), ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    for name, payload in events:
        if name != "ping":
            no_unknown_fields(TypeAdapter(RawMessageStreamEvent).validate_python(payload), name + ": ")
    assert [p["index"] for n, p in events if n.startswith("content_block")] == [0] * (texts + 2) + [1, 1, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    # The SDK's stream helper: it assembles the tool_use block's input from the input_json_deltas.
    async with client.messages.stream(model="llama", max_tokens=100, messages=question, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0}) as stream:
        partial = "".join([e.partial_json async for e in stream if e.type == "input_json"])
        final = await stream.get_final_message()
    use = final.content[1]
    assert json.loads(partial) == use.input == {"city": "Paris"} and (use.name, final.stop_reason) == ("get_weather", "tool_use")
    row = await gw.ledger_row(final.id.removeprefix("msg_"))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (final.usage.input_tokens, final.usage.output_tokens, "messages")


# the response cache on both routes ----------------------------------------------------------------------------
async def flush_cache(gw: Any) -> None:
    """Barrier: the cache's background writes are done (run on the server thread's loop)."""
    loop = gw.app.state.ledger._task.get_loop()
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(gw.app.state.response_cache.flush(), loop))


def answer_text(body: dict[str, Any]) -> str:
    return str(body["content"][0]["text"] if "content" in body else body["output"][0]["content"][0]["text"])


async def test_cache_hits_on_responses_and_messages_are_served_and_metered_as_chats(gw: Any) -> None:
    key = (await gw.new_key())["key"]
    headers = {"Authorization": f"Bearer {key}"}
    bodies = {"/v1/responses": {"model": "llama", "input": QUESTION, "max_output_tokens": 16, "temperature": 0},
              "/v1/messages": {"model": "llama", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 9, "temperature": 0}}
    async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=30) as c:
        for path, body in bodies.items():
            first = await c.post(path, json=body)
            await flush_cache(gw)
            second = await c.post(path, json=body)
            assert first.status_code == second.status_code == 200, second.text
            assert (first.headers.get("x-tollgate-cache"), second.headers.get("x-tollgate-cache")) == (None, "hit"), path
            a, b = first.json(), second.json()
            assert a["usage"] == b["usage"] and answer_text(a) == answer_text(b) != ""
            rows = [await gw.ledger_row(r.headers["x-request-id"]) for r in (first, second)]
            api = path.rsplit("/", 1)[1]
            assert [(r["api"], r["cached"]) for r in rows] == [(api, False), (api, True)]
            assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] and rows[0]["completion_tokens"] == rows[1]["completion_tokens"]
            streamed = await c.post(path, json={**body, "stream": True})  # a stream is served from the same entry
            assert streamed.headers.get("x-tollgate-cache") == "hit" and (await gw.ledger_row(streamed.headers["x-request-id"]))["cached"] is True
            if path == "/v1/responses":  # a hit is stored as any response is
                assert (await c.get(f"/v1/responses/{b['id']}")).json()["output"] == b["output"]


# a client that leaves mid-stream ------------------------------------------------------------------------------
async def test_a_client_leaving_a_tool_stream_leaves_a_cancelled_row_with_what_was_generated(gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.05)
    says(monkeypatch, " Let me look that up for you, one moment please, I am checking the forecast now." + CALL)
    key = (await gw.new_key())["key"]
    llm = llm_of(gw)
    bodies = {"/v1/responses": ({"model": "llama", "input": QUESTION, "tools": RESPONSES_TOOLS, "stream": True}, '"response.output_text.delta"'),
              "/v1/messages": ({"model": "llama", "messages": [{"role": "user", "content": QUESTION}], "tools": ANTHROPIC_TOOLS,
                                "max_tokens": 200, "stream": True}, '"text_delta"')}
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        for path, (body, delta) in bodies.items():
            async with c.stream("POST", path, json=body) as resp:
                request_id = resp.headers["x-request-id"]
                seen = 0
                async for line in resp.aiter_lines():
                    seen += delta in line
                    if seen == 2:
                        break
            deadline = asyncio.get_running_loop().time() + 5
            while llm.running:  # the engine request is aborted, not left to run
                assert asyncio.get_running_loop().time() < deadline, "the engine kept generating after the client left"
                await asyncio.sleep(0.02)
            assert llm.requests[-1].request_id in llm.aborts
            row = await gw.ledger_row(request_id)
            generated = len(llm.requests[-1].outputs[0].token_ids)
            assert (row["status"], row["api"]) == ("cancelled", path.rsplit("/", 1)[1])
            assert row["completion_tokens"] == generated >= 2 and row["prompt_tokens"] == len(llm.requests[-1].prompt_token_ids)


# an OpenAI-compatible pool: the translated chat completion goes upstream --------------------------------------
async def test_a_pool_gets_the_chat_completion_and_its_tool_call_pieces_come_back(upstreams: Any, tollgate_with: Any) -> None:  # noqa: F811
    up, url = upstreams()
    pool = tollgate_with(pool_yaml(url))
    calls = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    client = await openai_client(pool)
    for stream in (False, True):
        up.script.append(Behaviour(tool_calls=calls))
        if stream:
            async with client.responses.stream(model="pool", input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=50) as events:
                pieces = [e.delta async for e in events if e.type == "response.function_call_arguments.delta"]
                resp = await events.get_final_response()
            assert pieces == ['{"city":', ' "Paris"}']  # the upstream's pieces, one delta each
        else:
            resp = await client.responses.create(model="pool", input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=50)
        sent = up.requests[-1]
        assert sent.path == "/v1/chat/completions" and sent.body["messages"] == [{"role": "user", "content": QUESTION}]
        assert (sent.body["tools"], sent.body["max_tokens"], sent.body["model"]) == (
            [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True}}], 50, "upstream-name")
        [call] = resp.output
        assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_0", "get_weather", '{"city": "Paris"}')
        row = await pool.ledger_row(resp.id.removeprefix("resp_"))
        assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (17, resp.usage.output_tokens, "responses")  # the upstream's usage
    up.script.append(Behaviour(tool_calls=calls))
    async with await claude(pool) as anthropic_client:
        async with anthropic_client.messages.stream(model="pool", max_tokens=50, messages=[{"role": "user", "content": QUESTION}],
                                                    tools=ANTHROPIC_TOOLS) as events:
            final = await events.get_final_message()
        assert ([(b.type, b.name, b.input) for b in final.content], final.stop_reason) == ([("tool_use", "get_weather", {"city": "Paris"})], "tool_use")
        assert up.requests[-1].body["tools"] == CHAT_TOOLS
        text = await anthropic_client.messages.create(model="pool", max_tokens=50, messages=[{"role": "user", "content": QUESTION}])
        assert (text.content[0].text, text.stop_reason) == ("".join(WORDS), "end_turn")


# the translations alone ---------------------------------------------------------------------------------------
def test_tool_choices_and_formats_translate_to_chats() -> None:
    from gateway.api.anthropic.protocol import MessagesRequest
    from gateway.api.openai.responses_protocol import ResponsesRequest

    def responses(**fields: Any) -> dict[str, Any]:
        return ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": RESPONSES_TOOLS, **fields}).chat_body()

    def messages(**fields: Any) -> dict[str, Any]:
        return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                               "tools": ANTHROPIC_TOOLS, **fields}).chat_body()

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert [responses(tool_choice=c).get("tool_choice") for c in ("auto", "none", "required", {"type": "function", "name": "get_weather"})] == [
        "auto", "none", "required", named]
    assert [messages(tool_choice=c)["tool_choice"] for c in ({"type": "auto"}, {"type": "none"}, {"type": "any"},
                                                              {"type": "tool", "name": "get_weather"})] == ["auto", "none", "required", named]
    assert messages(tool_choice={"type": "any", "disable_parallel_tool_use": True})["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in messages(tool_choice={"type": "auto"})
    assert responses(parallel_tool_calls=False)["parallel_tool_calls"] is False
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert responses(text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    assert responses(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in responses(text={"format": {"type": "text"}})
    assert messages(stop_sequences=[f"s{i}" for i in range(10)])["stop"] == [f"s{i}" for i in range(10)]  # Anthropic allows more than chat's 4


async def test_over_quota_streams_are_429s_in_each_apis_shape_without_a_row(gw: Any) -> None:
    import openai

    from tests.gateway.serving.test_quotas import set_limits

    key = await gw.new_key()
    await set_limits(gw, f"/admin/keys/{key['id']}", {"monthly_tokens": 40})
    client = AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.responses.create(model="llama", input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=100, stream=True)
    assert refused.value.body["type"] == "insufficient_quota" and int(refused.value.response.headers["retry-after"]) >= 1
    async with anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key["key"], max_retries=0) as claude_client:
        with pytest.raises(anthropic.BadRequestError) as caught:  # Anthropic's answer to usage limits reached
            await claude_client.messages.create(model="llama", max_tokens=100, messages=[{"role": "user", "content": QUESTION}],
                                                tools=ANTHROPIC_TOOLS, stream=True)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.response.headers["x-should-retry"] == "false"
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=key["id"]) == 0
