"""Anthropic's Messages API through the official anthropic SDK against the real model and real
Postgres: metered exactly like chat (one row per admitted request, `api = "messages"`), Anthropic's
events, stop reasons and error shapes. Also: the embedding model in /v1/models, and each API's row
says which API it came through."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.api.anthropic.messages import error_shape
from gateway.http.errors import EngineNotReady, EngineOverloaded, InvalidRequest, RateLimited
from tests.conftest import MODEL, Gateway, minute_with_room
from tests.gateway.serving.test_disconnect import wait_engine_idle
from tests.gateway.serving.test_quotas import set_limits

SYSTEM = "You are a helpful assistant."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and the sea."}]
EVENTS = ["message_start", "content_block_start", "ping"]
ENDING = ["content_block_stop", "message_delta", "message_stop"]
# The SDK no longer has sampling arguments (newer Claude models take none); the API still does.
GREEDY = {"temperature": 0}


def request_id_of(message_id: str) -> str:
    return message_id.removeprefix("msg_")


@pytest.fixture
async def claude(gateway: Gateway, customer: dict[str, Any]) -> Any:
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=customer["key"], max_retries=0, timeout=120) as client:
        yield client


async def test_message_answers_like_chat_and_usage_equals_ledger_row(
    gateway: Gateway, customer: dict[str, Any], claude: Any, client_for: Any
) -> None:
    msg = await claude.messages.create(model=MODEL, system=SYSTEM, messages=QUESTION, max_tokens=30, extra_body=GREEDY)
    assert (msg.type, msg.role, msg.model) == ("message", "assistant", MODEL)
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    [block] = msg.content
    assert block.type == "text" and "Paris" in block.text
    # The same conversation through chat completions: the same prompt, the same greedy answer.
    chat = await client_for(customer["key"]).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION], max_tokens=30, temperature=0)
    assert chat.choices[0].message.content == block.text
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)

    row = await gateway.only_row(request_id_of(msg.id))
    assert (row["status"], row["finish_reason"], row["api"]) == ("completed", "stop", "messages")
    assert (row["account_id"], row["key_id"], row["model"]) == (customer["account_id"], customer["id"], MODEL)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (msg.usage.input_tokens, msg.usage.output_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(msg.id))  # the engine's own ids
    assert row["ttft_ms"] is not None and row["total_ms"] >= row["ttft_ms"] > 0
    assert (await gateway.ledger_row(chat.id.split("-", 1)[1]))["api"] == "chat"


async def test_stream_events_in_order_and_usage_equals_ledger_row(gateway: Gateway, claude: Any) -> None:
    plain = await claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=30, extra_body=GREEDY)
    async with claude.messages.with_streaming_response.create(
        model=MODEL, messages=QUESTION, max_tokens=30, extra_body=GREEDY, stream=True
    ) as raw:
        names = [line.removeprefix("event: ") async for line in raw.iter_lines() if line.startswith("event: ")]
    assert names == EVENTS + ["content_block_delta"] * (len(names) - 6) + ENDING  # the SDK's stream hides `ping`
    stream = await claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=30, extra_body=GREEDY, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * len(deltas) + ENDING
    # (not compared with the raw stream's delta count: two streams may cut the same text into
    # different pieces, outputs coalescing while the client lags on a loaded machine)
    assert len(deltas) > 1 and all(d.delta.type == "text_delta" and d.index == 0 for d in deltas)
    start, delta = events[0].message, events[-2]
    assert start.content == [] and start.stop_reason is None and start.usage.output_tokens == 0
    assert "".join(d.delta.text for d in deltas) == plain.content[0].text
    assert delta.delta.stop_reason == "end_turn"

    row = await gateway.only_row(request_id_of(start.id))
    assert (row["status"], row["api"]) == ("completed", "messages")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (start.usage.input_tokens, delta.usage.output_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(start.id))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (plain.usage.input_tokens, plain.usage.output_tokens)


async def test_stream_helper_final_message(gateway: Gateway, claude: Any) -> None:
    async with claude.messages.stream(model=MODEL, messages=LONG, max_tokens=12, extra_body=GREEDY) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    row = await gateway.only_row(request_id_of(final.id))
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (final.usage.input_tokens, 12, "length")
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(final.id))


async def test_max_tokens_and_stop_sequences(gateway: Gateway, claude: Any) -> None:
    cut_short = await claude.messages.create(model=MODEL, messages=LONG, max_tokens=5, extra_body=GREEDY)
    assert (cut_short.stop_reason, cut_short.usage.output_tokens) == ("max_tokens", 5)

    plain = await claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=30, extra_body=GREEDY)
    assert " is " in plain.content[0].text
    cut = await claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=30, extra_body=GREEDY, stop_sequences=["zebra", " is"])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", " is")
    assert cut.content[0].text == plain.content[0].text.split(" is")[0]
    assert cut.usage.output_tokens < plain.usage.output_tokens
    row = await gateway.only_row(request_id_of(cut.id))
    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("completed", "stop", cut.usage.output_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(cut.id))

    stream = await claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=30, extra_body=GREEDY, stop_sequences=[" is"], stream=True)
    events = [e async for e in stream]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == cut.content[0].text
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", " is")
    assert events[-2].usage.output_tokens == cut.usage.output_tokens


async def test_bad_input_is_an_anthropic_400_and_nothing_is_metered(gateway: Gateway, customer: dict[str, Any], claude: Any) -> None:
    headers = {"x-api-key": customer["key"], "anthropic-version": "2023-06-01"}
    bad_bodies = {
        "max_tokens": {"model": MODEL, "messages": QUESTION},
        "messages[0].role": {"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]},
        "messages": {"model": MODEL, "max_tokens": 5, "messages": []},
        "messages[0].content[0].type": {"model": MODEL, "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "stop_sequences": {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "stop_sequences": "no"},
        "temperature": {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "temperature": 1.5},
        "tools[0].type": {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0].input_schema": {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "tools": [{"name": "f"}]},
        "tool_choice.type": {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "tool_choice": {"type": "sometimes"}},
        "messages[0].content": {"model": MODEL, "max_tokens": 5, "messages": [  # a result for no tool_use
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "18C"}]}]},
    }
    call = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]
    more = [  # what Anthropic refuses too (its messages: "all messages must have non-empty content ...",
        # "`tool_use` ids were found without `tool_result` blocks immediately after"); metadata is {user_id}
        ("messages[2].content", {"model": MODEL, "max_tokens": 5, "messages": [*QUESTION, {"role": "assistant", "content": "ok"},
                                                                                 {"role": "user", "content": ""}]}),
        ("messages[1].content", {"model": MODEL, "max_tokens": 5, "messages": [*QUESTION, {"role": "assistant", "content": []},
                                                                                 *QUESTION]}),
        ("messages[0].content[0].text", {"model": MODEL, "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Hi"}]}]}),
        ("toolu_1", {"model": MODEL, "max_tokens": 5, "messages": [*call, {"role": "user", "content": "thanks"}]}),
        ("metadata.user_id", {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "metadata": {"user_id": 12345}}),
        ("metadata.session", {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "metadata": {"session": "s"}}),
        # Anthropic: "text content blocks must contain non-whitespace text", "each stop sequence must contain non-whitespace"
        ("messages[0].content[0].text", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": " \n"}]}]}),
        ("stop_sequences", {"model": MODEL, "max_tokens": 5, "messages": QUESTION, "stop_sequences": ["end", " "]}),
    ]
    async with httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=60) as c:
        for field, body in [*bad_bodies.items(), *more]:
            r = await c.post("/v1/messages", json=body)
            assert r.status_code == 400, (field, r.text)
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert field in r.json()["error"]["message"], (field, r.text)
            assert r.json()["request_id"] == r.headers["request-id"], r.text  # as Anthropic's error bodies carry it
        r = await c.post("/v1/messages", content=b"{not json")
        assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")
    # The same through the SDK: a typed BadRequestError with Anthropic's body.
    for messages in ([], [{"role": "system", "content": "hi"}]):
        with pytest.raises(anthropic.BadRequestError) as caught:
            await claude.messages.create(model=MODEL, messages=messages, max_tokens=5)
        assert caught.value.status_code == 400
        assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing_model:
        await claude.messages.create(model="no-such-model", messages=QUESTION, max_tokens=5)
    assert missing_model.value.body["error"]["type"] == "not_found_error"
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 0
    # The server keeps serving.
    ok = await claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=3, extra_body=GREEDY)
    assert ok.usage.output_tokens == 3
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 1


async def test_keys_x_api_key_and_bearer(gateway: Gateway, customer: dict[str, Any]) -> None:
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key="sk-wrong-" + "x" * 40, max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await wrong.messages.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert caught.value.status_code == 401
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
                                 "request_id": caught.value.request_id}  # the body's id is the request-id header's
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as c:
        r = await c.post("/v1/messages", json={"model": MODEL, "messages": QUESTION, "max_tokens": 5})
        assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error")
        assert "x-api-key" in r.json()["error"]["message"]
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, auth_token=customer["key"], max_retries=0) as bearer:
        msg = await bearer.messages.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body=GREEDY)
    assert (await gateway.ledger_row(request_id_of(msg.id)))["key_id"] == customer["id"]


async def test_a_revoked_key_is_an_authentication_error(gateway: Gateway) -> None:
    """Anthropic answers a key that no longer works 401 authentication_error (the SDK's
    AuthenticationError), not 403: permission_error is for a valid key lacking access."""
    key = await gateway.new_key()
    async with gateway.admin_client() as admin:
        assert (await admin.delete(f"/admin/keys/{key['id']}")).status_code == 200
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=key["key"], max_retries=0) as revoked:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await revoked.messages.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert caught.value.body["error"] == {"type": "authentication_error", "message": "This API key has been revoked."}


async def test_over_quota_is_anthropics_error_without_a_row(gateway: Gateway) -> None:
    """A monthly limit (or a prepaid balance) is what Anthropic answers for usage limits or a credit
    balance too low: a 400 invalid_request_error, which its SDK does not retry; a rate limit is a
    429 rate_limit_error, which it retries after Retry-After."""
    key = await gateway.new_key()
    await set_limits(gateway, f"/admin/keys/{key['id']}", {"monthly_tokens": 40})
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=key["key"], max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model=MODEL, messages=QUESTION, max_tokens=100)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "monthly" in caught.value.body["error"]["message"] and caught.value.response.headers["x-should-retry"] == "false"
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=key["id"]) == 0
    # the same limit on the OpenAI route: OpenAI's 429 insufficient_quota, which no SDK retries either
    openai_client = openai.AsyncOpenAI(base_url=gateway.v1, api_key=key["key"], max_retries=0)
    with pytest.raises(openai.RateLimitError) as quota:
        await openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=100)  # type: ignore[arg-type]
    assert quota.value.code == "monthly_tokens" and quota.value.response.headers["x-should-retry"] == "false"
    await openai_client.close()
    limited = await gateway.new_key()
    await set_limits(gateway, f"/admin/keys/{limited['id']}", {"rpm": 1})
    await minute_with_room(20)  # the two requests in one minute's window
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=limited["key"], max_retries=0) as client:
        await client.messages.create(model=MODEL, messages=QUESTION, max_tokens=1)
        with pytest.raises(anthropic.RateLimitError) as slow:
            await client.messages.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert slow.value.status_code == 429 and slow.value.body["error"]["type"] == "rate_limit_error"
    assert int(slow.value.response.headers["retry-after"]) >= 1 and "x-should-retry" not in slow.value.response.headers


async def test_disconnect_mid_stream_leaves_one_cancelled_row(gateway: Gateway, customer: dict[str, Any]) -> None:
    received = ""
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=customer["key"], max_retries=0) as client:
        async with client.messages.with_streaming_response.create(
            model=MODEL, messages=LONG, max_tokens=200, extra_body=GREEDY, stream=True
        ) as response:
            request_id = response.headers["request-id"]
            deltas = 0
            async for line in response.iter_lines():
                if line.startswith("data: ") and '"text_delta"' in line:
                    received += anthropic_text(line)
                    deltas += 1
                    if deltas == 3:
                        break
        # leaving the block closes the connection mid-generation
    await wait_engine_idle(gateway, within=2.0)
    row = await gateway.ledger_row(request_id)
    assert (row["status"], row["finish_reason"], row["api"]) == ("cancelled", "cancelled", "messages")
    assert row["prompt_tokens"] == len(gateway.engine.encode_chat(LONG))
    seen = len(gateway.engine.encode_text(received))
    assert seen <= row["completion_tokens"] <= seen + 1 < 200
    await gateway.flush_ledger()
    assert await gateway.ledger_count(request_id=request_id) == 1


def anthropic_text(line: str) -> str:
    return str(json.loads(line[len("data: "):])["delta"]["text"])


async def test_count_tokens_equals_the_billed_prompt(gateway: Gateway, claude: Any) -> None:
    counted = await claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    msg = await claude.messages.create(model=MODEL, system=SYSTEM, messages=QUESTION, max_tokens=2, extra_body=GREEDY)
    assert counted.input_tokens == msg.usage.input_tokens
    without_system = await claude.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert without_system.input_tokens == len(gateway.engine.encode_chat(QUESTION)) != counted.input_tokens
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=(await gateway.ledger_row(request_id_of(msg.id)))["key_id"]) == 1


async def test_count_tokens_refuses_what_messages_refuses(claude: Any) -> None:
    """A prompt /v1/messages refuses is no prompt to count: extended thinking, a final assistant
    prefill (count_tokens used to answer 37 and 45 for them)."""
    for extra, param in (({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
                         ({"messages": [*QUESTION, {"role": "assistant", "content": "The capital is"}]}, "messages[1].role")):
        ask = {"model": MODEL, "messages": QUESTION, **extra}
        for call in (lambda: claude.messages.count_tokens(**ask), lambda: claude.messages.create(max_tokens=2, **ask)):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await call()
            assert param in refused.value.message or param == "thinking" and "thinking" in refused.value.message, refused.value.message
    assert (await claude.messages.count_tokens(model=MODEL, messages=QUESTION, thinking={"type": "disabled"})).input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as refused:  # said as what it is, not as an unsupported block type
        await claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert "needs its text" in refused.value.message, refused.value.message


async def test_models_answer_anthropic_callers_in_anthropics_shape(gateway: Gateway, claude: Any, customer: dict[str, Any],
                                                                    client_for: Any) -> None:
    """Anthropic's SDK and docs call /v1/models with x-api-key and anthropic-version: ModelInfo objects
    (the SDK's type, no field it does not declare), paged, generation models only; errors in
    Anthropic's shape. The OpenAI SDK on the same path still gets OpenAI's list."""
    from anthropic.types import ModelInfo

    page = await claude.models.list()
    assert [m.id for m in page.data] == [MODEL] and page.first_id == page.last_id == MODEL and page.has_more is False
    for info in [*page.data, await claude.models.retrieve(MODEL)]:
        assert (info.type, info.display_name, info.lifecycle, info.max_input_tokens) == ("model", MODEL, "active", gateway.engine.context_length)
        assert info.created_at.year == 1970 and not info.model_extra
        ModelInfo.model_validate(info.model_dump(mode="json"))
    async with httpx.AsyncClient(base_url=gateway.base_url, headers={"x-api-key": customer["key"], "anthropic-version": "2023-06-01"}) as raw:
        listed = await raw.get("/v1/models", params={"limit": 1})
        assert listed.status_code == 200 and listed.headers["request-id"] and set(listed.json()) == {"data", "first_id", "last_id", "has_more"}
        assert (await raw.get("/v1/models", params={"after_id": MODEL})).json() == {"data": [], "first_id": None, "last_id": None, "has_more": False}
        for path, params, status, kind in (("/v1/models/no-such-model", {}, 404, "not_found_error"),
                                           ("/v1/models", {"limit": "0"}, 400, "invalid_request_error"),
                                           ("/v1/models", {"after_id": "nope"}, 400, "invalid_request_error")):
            r = await raw.get(path, params=params)
            assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
        r = await raw.get("/v1/models", headers={"x-api-key": "sk-" + "x" * 43})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        for typo in ("/v1/messagez", "/v1/message/batches"):  # a path no route has: Anthropic's not_found_error too
            r = await raw.post(typo, json={})
            assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error", r.text
    async with httpx.AsyncClient(base_url=gateway.base_url, headers={"authorization": f"Bearer {customer['key']}"}) as raw:
        assert (await raw.post("/v1/messagez", json={})).json()["error"]["code"] == "not_found"  # OpenAI's, for its callers
    openai_page = await client_for(customer["key"]).models.list()
    assert {m.object for m in openai_page.data} == {"model"} and MODEL in {m.id for m in openai_page.data}


def test_error_shapes_and_statuses() -> None:
    assert error_shape(EngineOverloaded("full")) == (529, {"type": "error", "error": {"type": "overloaded_error", "message": "full"}})
    assert error_shape(EngineNotReady("loading"))[0:1] == (503,) and error_shape(EngineNotReady("x"))[1]["error"]["type"] == "api_error"
    assert error_shape(RateLimited("slow down"))[1]["error"]["type"] == "rate_limit_error"
    assert error_shape(InvalidRequest("bad"))[0] == 400


async def test_embedding_model_is_listed_and_retrievable(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    embedded = await client.embeddings.create(model="all-minilm-l6-v2", input="hello")  # also: it has loaded
    listed = {m.id: m for m in (await client.models.list()).data}
    assert set(listed) == {MODEL, "all-minilm-l6-v2"}
    card = await client.models.retrieve("all-minilm-l6-v2")
    assert (card.id, card.object, card.type, card.dimensions) == ("all-minilm-l6-v2", "model", "embedding", len(embedded.data[0].embedding))
    assert listed["all-minilm-l6-v2"].dimensions == 384
    narrow = await gateway.new_key(customer["account_id"], models=[MODEL])
    narrow_client = client_for(narrow["key"])
    assert [m.id for m in (await narrow_client.models.list()).data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        await narrow_client.models.retrieve("all-minilm-l6-v2")


async def test_each_row_says_which_api(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    client = client_for(customer["key"])
    raw = await client.embeddings.with_raw_response.create(model="all-minilm-l6-v2", input="hello")
    text = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2, temperature=0)
    assert (await gateway.ledger_row(raw.headers["x-request-id"]))["api"] == "embeddings"
    assert (await gateway.ledger_row(text.id.split("-", 1)[1]))["api"] == "completions"


async def test_what_answers_before_the_route_speaks_anthropics_shape_on_its_paths(gateway: Gateway, customer: dict[str, Any]) -> None:
    """An unknown method or path under /v1/messages and a repeated query parameter are refused before
    any route runs: in Anthropic's shape there (its SDKs read error.type); a path no route has, in
    the shape of the API its caller speaks."""
    headers = {"x-api-key": customer["key"], "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=30) as http:
        for method, path, status, kind in (("GET", "/v1/messages", 405, "invalid_request_error"),
                                           ("POST", "/v1/messages/nope", 404, "not_found_error"),
                                           ("POST", "/v1/messages/count_tokens?beta=1&beta=2", 400, "invalid_request_error")):
            r = await http.request(method, path, json={})
            assert r.status_code == status, (path, r.text)
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], (path, body)
            assert r.headers["request-id"], path
        r = await http.get("/v1/nope")  # no route's path, asked by a caller that speaks Anthropic's API: its shape too
        assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    async with httpx.AsyncClient(base_url=gateway.base_url, headers={"authorization": f"Bearer {customer['key']}"}) as http:
        r = await http.get("/v1/nope")  # an OpenAI caller: OpenAI's shape
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    claude = anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=customer["key"], max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.post("/v1/messages/nope", cast_to=httpx.Response, body={})
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


WEATHER_CALL = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}]
WEATHER_TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def weather_result(**block: Any) -> list[dict[str, Any]]:
    return [*WEATHER_CALL, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "city not found", **block}]}]


def weather_chat(result: str) -> list[dict[str, Any]]:
    """The chat messages the model's template gets for WEATHER_CALL and a tool result saying `result`."""
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [WEATHER_CALL[0], {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": result}]


async def test_a_tool_result_with_is_error_reaches_the_model_marked_as_an_error(gateway: Gateway, customer: dict[str, Any], claude: Any) -> None:
    """Anthropic's ToolResultBlockParam has `is_error: bool`: the tool failed, and the model is told so.
    A chat tool message has no such flag, so its text says it ("Error: ..."); the prompt billed is
    that one (it used to be the plain result's, is_error dropped). A non-boolean is a 400, no row."""
    failed = await claude.messages.create(model=MODEL, max_tokens=5, messages=weather_result(is_error=True), extra_body=GREEDY)
    assert failed.usage.input_tokens == len(gateway.engine.encode_chat(weather_chat("Error: city not found")))
    assert failed.usage.input_tokens != len(gateway.engine.encode_chat(weather_chat("city not found")))
    row = await gateway.only_row(request_id_of(failed.id))
    assert (row["prompt_tokens"], row["api"]) == (failed.usage.input_tokens, "messages")
    for block, text in (({"is_error": False}, "city not found"), ({}, "city not found"), ({"is_error": True, "content": ""}, "Error"),
                        ({"is_error": True, "content": [{"type": "text", "text": "city "}, {"type": "text", "text": "not found"}]},
                         "Error: city not found")):
        counted = await claude.messages.count_tokens(model=MODEL, messages=weather_result(**block))
        assert counted.input_tokens == len(gateway.engine.encode_chat(weather_chat(text))), block
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=5, messages=weather_result(is_error="yes"))
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    # naming the field that is wrong (the content list's block), not the content's other form (a string)
    assert refused.value.body["error"]["message"].startswith("invalid value for 'messages[2].content[0].is_error'"), refused.value.body
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 1


async def test_cache_control_is_accepted_ignored_and_usage_says_nothing_was_cached(gateway: Gateway, customer: dict[str, Any], claude: Any) -> None:
    """Anthropic takes `cache_control` ({"type": "ephemeral", "ttl"?: "5m" | "1h"}) on system, message
    and tool_result content blocks, tools, and the request itself (the SDK's CacheControlEphemeralParam),
    at most 4 breakpoints. No prompt cache is controlled here: the prompt is the same as without them,
    and usage says nothing was written to a cache (cache_creation_input_tokens 0 and its breakdown).
    A malformed one, or a fifth, is Anthropic's 400 naming it, and nothing is metered."""
    mark, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C", "cache_control": mark}]}
    marked = {"system": [{"type": "text", "text": SYSTEM, "cache_control": hour}], "tools": [{**WEATHER_TOOL, "cache_control": mark}],
              "messages": [*WEATHER_CALL, {"role": "user", "content": [result, {"type": "text", "text": "And now?", "cache_control": mark}]}]}
    plain = {"system": SYSTEM, "tools": [WEATHER_TOOL], "messages": [*WEATHER_CALL, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}, {"type": "text", "text": "And now?"}]}]}
    msg = await claude.messages.create(model=MODEL, max_tokens=5, cache_control=mark, extra_body=GREEDY, **marked)
    assert msg.usage.input_tokens == (await claude.messages.count_tokens(model=MODEL, **plain)).input_tokens
    assert msg.usage.input_tokens == (await claude.messages.count_tokens(model=MODEL, cache_control=mark, **marked)).input_tokens
    assert (msg.usage.cache_creation_input_tokens, msg.usage.cache_read_input_tokens) == (0, 0)
    assert msg.usage.cache_creation is not None and msg.usage.cache_creation.model_dump() == {
        "ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0}
    row = await gateway.only_row(request_id_of(msg.id))
    assert row["prompt_tokens"] == msg.usage.input_tokens
    headers = {"x-api-key": customer["key"], "anthropic-version": "2023-06-01"}
    text = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]}]
    five = [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": mark} for i in range(5)]}]
    bad = [("messages[0].content[0].cache_control.type", {"messages": text}),
           ("system[0].cache_control.ttl", {"messages": QUESTION, "system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}),
           ("tools[0].cache_control", {"messages": QUESTION, "tools": [{**WEATHER_TOOL, "cache_control": "ephemeral"}]}),
           ("cache_control.type", {"messages": QUESTION, "cache_control": {}}),
           ("messages[2].content[0].content[0].cache_control.type", {"messages": weather_result(content=[{"type": "text", "text": "x", "cache_control": {"type": 1}}])}),
           ("A maximum of 4 blocks with cache_control may be provided. Found 5.", {"messages": five})]
    async with httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=60) as c:
        for needle, body in bad:
            for path, extra in (("/v1/messages", {"max_tokens": 5}), ("/v1/messages/count_tokens", {})):
                r = await c.post(path, json={"model": MODEL, **extra, **body})
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (needle, r.text)
                assert needle in r.json()["error"]["message"], (needle, r.text)
    four = [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": mark} for i in range(4)]}]
    assert (await claude.messages.create(model=MODEL, max_tokens=2, messages=four, cache_control=mark, extra_body=GREEDY)).usage.output_tokens == 2
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 2


async def test_the_requests_cache_control_takes_a_breakpoint_slot_unless_the_last_block_has_its_own(
        gateway: Gateway, customer: dict[str, Any], claude: Any) -> None:
    """Anthropic's prompt-caching guide ("Combining with block-level caching"): the request's
    `cache_control` (automatic caching) puts a breakpoint on the last cacheable block, and "uses one
    of the 4 available breakpoint slots"; "If 4 explicit block-level breakpoints already exist, the
    API returns a 400 error (no slots left for automatic caching)"; "If the last block already has an
    explicit cache_control with the same TTL, automatic caching is a no-op"; with a different TTL,
    "the API returns a 400 error". It used to be checked and never counted: 4 + 1 was served."""
    mark = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"Rule {i}.", "cache_control": mark} for i in range(4)]

    def ask(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": blocks}]
    plain, last_marked = ask([{"type": "text", "text": "Hi"}]), ask([{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}}])
    for call in (lambda **kw: claude.messages.create(max_tokens=2, extra_body=GREEDY, **kw), claude.messages.count_tokens):
        for refused, needle in (
            ({"system": system, "messages": plain}, "A maximum of 4 blocks with cache_control may be provided. Found 5."),  # 4 + the automatic one
            ({"system": system, "messages": QUESTION}, "Found 5."),  # a string content is one unmarked block
            ({"system": system[:3], "messages": ask([{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}])},
             "cache_control: the automatic cache breakpoint (ttl '5m') falls on messages[0].content[0], whose cache_control has another ttl ('1h')"),
        ):
            with pytest.raises(anthropic.BadRequestError) as caught:
                await call(model=MODEL, cache_control=mark, **refused)
            assert caught.value.status_code == 400 and caught.value.body["error"]["type"] == "invalid_request_error", caught.value.body
            assert needle in caught.value.body["error"]["message"], caught.value.body
        # 3 + the automatic one; 4 whose last is the last block's, with the same TTL (5m is the default): no slot of its own
        for served in ({"system": system[:3], "messages": plain}, {"system": system[:3], "messages": last_marked}):
            assert await call(model=MODEL, cache_control=mark, **served) is not None
        with pytest.raises(anthropic.BadRequestError) as other_ttl:  # the same 4, the request's an hour: the last block's TTL differs
            await call(model=MODEL, cache_control={"type": "ephemeral", "ttl": "1h"}, system=system[:3], messages=last_marked)
        assert "another ttl ('5m')" in other_ttl.value.body["error"]["message"], other_ttl.value.body
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 2


async def test_service_tier_is_taken_and_usage_says_the_tier_it_ran_at(gateway: Gateway, customer: dict[str, Any], claude: Any) -> None:
    """Anthropic's `service_tier` request parameter is "auto" (priority capacity if any) or
    "standard_only"; its Usage says `service_tier` "standard" | "priority" | "batch". There is no
    priority capacity here: every request runs, and says it ran, at the standard tier (the
    non-streamed Message and the stream's message_start alike); another value is a 400 naming it."""
    for tier in ("auto", "standard_only", None):
        ask = {"service_tier": tier} if tier else {}
        msg = await claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY, **ask)
        assert msg.usage.service_tier == "standard", tier
        stream = await claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY, stream=True, **ask)
        events = [e async for e in stream]
        assert events[0].type == "message_start" and events[0].message.usage.service_tier == "standard", tier
        assert (await gateway.only_row(request_id_of(msg.id)))["completion_tokens"] == msg.usage.output_tokens
    for wrong in ("priority", "standard", 1):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body={"service_tier": wrong})
        assert "service_tier" in refused.value.body["error"]["message"], refused.value.body
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 6
