"""OpenAI's Responses API through the official openai SDK against the real model and real Postgres:
metered exactly like chat (one row per admitted request, `api = "responses"`), the Response shape
and the typed stream events with their sequence numbers, OpenAI's errors, the store (retrieve,
delete, input items, per account, retention) and previous_response_id (earlier turns billed as
prompt tokens)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from gateway.config import load_settings
from tests.conftest import MODEL, Gateway
from tests.gateway.serving.test_disconnect import wait_engine_idle
from tests.gateway.serving.test_quotas import set_limits

SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
LONG = "Write a very long story about a lighthouse keeper and the sea."
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def request_id_of(response_id: str) -> str:
    return response_id.removeprefix("resp_")


@pytest.fixture
def client(customer: dict[str, Any], client_for: Any) -> Any:
    return client_for(customer["key"])


async def test_create_answers_like_chat_and_usage_equals_ledger_row(
    gateway: Gateway, customer: dict[str, Any], client: Any
) -> None:
    resp = await client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=30, temperature=0)
    assert (resp.object, resp.status, resp.model, resp.incomplete_details, resp.error) == ("response", "completed", MODEL, None, None)
    [item] = resp.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    [part] = item.content
    assert part.type == "output_text" and part.annotations == [] and part.text == resp.output_text
    assert "Paris" in resp.output_text
    # The same conversation through chat completions: the same prompt, the same greedy answer.
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], max_tokens=30, temperature=0)
    assert chat.choices[0].message.content == resp.output_text
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0

    row = await gateway.only_row(request_id_of(resp.id))
    assert (row["status"], row["finish_reason"], row["api"]) == ("completed", "stop", "responses")
    assert (row["account_id"], row["key_id"], row["model"]) == (customer["account_id"], customer["id"], MODEL)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (resp.usage.input_tokens, resp.usage.output_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(resp.id))  # the engine's own ids
    assert row["ttft_ms"] is not None and row["total_ms"] >= row["ttft_ms"] > 0

    # input as a list of message items with input_text parts: the same prompt as the string.
    listed = await client.responses.create(model=MODEL, instructions=SYSTEM, max_output_tokens=30, temperature=0, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert (listed.output_text, listed.usage.input_tokens) == (resp.output_text, resp.usage.input_tokens)


async def test_stream_events_in_order_with_sequence_numbers_and_usage_equals_ledger_row(gateway: Gateway, client: Any) -> None:
    plain = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0)
    stream = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert kinds == OPENING + ["response.output_text.delta"] * len(deltas) + CLOSING + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, done, completed = events[0].response, events[-4], events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == completed.id
    text = "".join(d.delta for d in deltas)
    assert text == done.text == plain.output_text == completed.output_text
    assert all(d.item_id == events[2].item.id and (d.output_index, d.content_index) == (0, 0) for d in deltas)
    assert completed.status == "completed" and completed.usage.output_tokens == plain.usage.output_tokens

    row = await gateway.only_row(request_id_of(completed.id))
    assert (row["status"], row["api"]) == ("completed", "responses")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (completed.usage.input_tokens, completed.usage.output_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(completed.id))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (plain.usage.input_tokens, plain.usage.output_tokens)

    # The SDK's stream helper: text deltas and the final response it assembles.
    async with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0) as helper:
        streamed = "".join([e.delta async for e in helper if e.type == "response.output_text.delta"])
        final = await helper.get_final_response()
    assert streamed == final.output_text == plain.output_text
    row = await gateway.only_row(request_id_of(final.id))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(final.id))


async def test_max_output_tokens_is_incomplete(gateway: Gateway, client: Any) -> None:
    cut = await client.responses.create(model=MODEL, input=LONG, max_output_tokens=16, temperature=0)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == ("incomplete", "max_output_tokens", 16)
    assert cut.output[0].status == "incomplete"
    row = await gateway.only_row(request_id_of(cut.id))
    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("completed", "length", 16)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(request_id_of(cut.id))
    stream = await client.responses.create(model=MODEL, input=LONG, max_output_tokens=16, temperature=0, stream=True)
    events = [e async for e in stream]
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 16
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == cut.output_text


async def test_bad_input_is_a_400_naming_the_field_and_nothing_is_metered(gateway: Gateway, customer: dict[str, Any], client: Any) -> None:
    bad_bodies = {
        "input": {"model": MODEL},
        "input[0].type": {"model": MODEL, "input": [{"type": "item_reference", "id": "msg_x"}]},
        "input[0].call_id": {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},  # answers no call
        "input[0].content[0].type": {"model": MODEL, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
        "input[0].role": {"model": MODEL, "input": [{"role": "tool", "content": "hi"}]},
        "temperature": {"model": MODEL, "input": QUESTION, "temperature": 3},
        "max_output_tokens": {"model": MODEL, "input": QUESTION, "max_output_tokens": 15},  # OpenAI's minimum is 16
        "tools": {"model": MODEL, "input": QUESTION, "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        "tool_choice": {"model": MODEL, "input": QUESTION, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
        "text.format": {"model": MODEL, "input": QUESTION, "text": {"format": {"type": "grammar"}}},
        "background": {"model": MODEL, "input": QUESTION, "background": True},
        "previous_response_id": {"model": MODEL, "input": QUESTION, "previous_response_id": "resp_nosuch"},
        "truncation": {"model": MODEL, "input": QUESTION, "truncation": "middle"},
        "include[0]": {"model": MODEL, "input": QUESTION, "include": ["no.such.thing"]},
        "include[1]": {"model": MODEL, "input": QUESTION, "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]},
        "input[0].content[0].text": {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        # the engine's refusals of a translated field, named as the Responses API names them (not chat's names)
        "tools[0].name": {"model": MODEL, "input": QUESTION, "tools": [{"type": "function", "name": "bad name!", "parameters": {}}]},
        "text.format.schema": {"model": MODEL, "input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}},
    }
    bad_bodies["text.format.schema "] = {"model": MODEL, "input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x"}}}
    async with httpx.AsyncClient(base_url=gateway.base_url, headers={"Authorization": f"Bearer {customer['key']}"}, timeout=60) as c:
        for field, body in bad_bodies.items():
            r = await c.post("/v1/responses", json={"max_output_tokens": 16, **body})  # short, were it served
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == field.strip(), (field, r.text)
        r = await c.post("/v1/responses", content=b"{not json")
        assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as unknown:  # the Responses API's answer (chat's is a 404)
        await client.responses.create(model="no-such-model", input=QUESTION)
    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    assert unknown.value.body["message"] == "The requested model 'no-such-model' does not exist."  # type: ignore[index]
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 0
    # The server keeps serving.
    ok = await client.responses.create(model=MODEL, input=LONG, max_output_tokens=16, temperature=0)
    assert ok.usage.output_tokens == 16
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 1


async def test_wrong_key_is_401(gateway: Gateway, client_for: Any) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await client_for("sk-wrong-" + "x" * 40).responses.create(model=MODEL, input=QUESTION, max_output_tokens=16)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await client_for("sk-wrong-" + "x" * 40).responses.retrieve("resp_x")


async def test_over_quota_is_a_429_without_a_row(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    await set_limits(gateway, f"/admin/keys/{key['id']}", {"monthly_tokens": 40})
    with pytest.raises(openai.RateLimitError) as caught:
        await client_for(key["key"]).responses.create(model=MODEL, input=QUESTION, max_output_tokens=100)
    assert caught.value.status_code == 429 and int(caught.value.response.headers["retry-after"]) >= 1
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=key["id"]) == 0


async def test_disconnect_mid_stream_leaves_one_cancelled_row_and_nothing_stored(
    gateway: Gateway, customer: dict[str, Any], client: Any
) -> None:
    received = ""
    async with client.responses.with_streaming_response.create(
        model=MODEL, input=LONG, max_output_tokens=200, temperature=0, stream=True
    ) as response:
        request_id = response.headers["x-request-id"]
        deltas = 0
        async for line in response.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                received += json.loads(line[len("data: "):])["delta"]
                deltas += 1
                if deltas == 3:
                    break
    # leaving the block closes the connection mid-generation
    await wait_engine_idle(gateway, within=10.0)  # an engine step on the shared 2-core machine can take seconds
    row = await gateway.ledger_row(request_id)
    assert (row["status"], row["finish_reason"], row["api"]) == ("cancelled", "cancelled", "responses")
    assert row["prompt_tokens"] == len(gateway.engine.encode_chat([{"role": "user", "content": LONG}]))
    seen = len(gateway.engine.encode_text(received))
    assert seen <= row["completion_tokens"] <= seen + 1 < 200
    await gateway.flush_ledger()
    assert await gateway.ledger_count(request_id=request_id) == 1
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_" + request_id)


async def test_store_retrieve_input_items_delete_and_other_accounts(gateway: Gateway, client: Any, client_for: Any) -> None:
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    resp = await client.responses.create(model=MODEL, input=items, max_output_tokens=20, temperature=0, metadata={"ticket": "42"})
    assert resp.store is True and resp.metadata == {"ticket": "42"}
    got = await client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    listed = await client.responses.input_items.list(resp.id, order="asc")
    assert [(i.role, i.content[0].type, i.content[0].text) for i in listed.data] == [
        ("developer", "input_text", "Answer briefly."), ("user", "input_text", QUESTION)]
    assert listed.first_id == listed.data[0].id and listed.has_more is False
    newest = await client.responses.input_items.list(resp.id, limit=1)
    assert [i.role for i in newest.data] == ["user"] and newest.has_more is True
    # an assistant's turn in the input is listed as the model's output: output_text with annotations
    # (ResponseOutputMessage); an input_text part there matches no item of the SDK's ResponseItem
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "assistant", "content": [{"type": "output_text", "text": "How can I help?"}]}, {"role": "user", "content": QUESTION}]
    chat = await client.responses.create(model=MODEL, input=turns, max_output_tokens=16, temperature=0)
    raw = await client.responses.input_items.with_raw_response.list(chat.id, order="asc")
    from openai.types.responses.response_item import ResponseItem
    from pydantic import TypeAdapter
    parsed = [TypeAdapter(ResponseItem).validate_python(item) for item in raw.http_response.json()["data"]]
    assert [(type(i).__name__, i.content[0].type) for i in parsed] == [  # type: ignore[union-attr]
        ("ResponseInputMessageItem", "input_text"), ("ResponseOutputMessage", "output_text"),
        ("ResponseOutputMessage", "output_text"), ("ResponseInputMessageItem", "input_text")]
    assert [i.content[0].annotations for i in parsed[1:3]] == [[], []]  # type: ignore[union-attr]

    # A streamed response is stored as its response.completed says, before that event is sent.
    async with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        final = await stream.get_final_response()
    assert (await client.responses.retrieve(final.id)).output_text == final.output_text

    other = client_for((await gateway.new_key())["key"])  # another account
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.input_items.list(resp.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(resp.id)
    with pytest.raises(openai.BadRequestError) as caught:
        await other.responses.create(model=MODEL, input="And Germany?", previous_response_id=resp.id, max_output_tokens=16)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert (await client.responses.retrieve(resp.id)).id == resp.id  # untouched by the other account

    await client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(resp.id)

    unstored = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_retention_hides_expired_responses(gateway: Gateway, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    resp = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16)
    db = create_engine(gateway.db_url)
    try:
        async with db.begin() as conn:
            expires = (await conn.execute(sa.text("SELECT created_at, expires_at FROM stored_responses WHERE id = :i"), {"i": resp.id})).one()
            assert expires.expires_at - expires.created_at == timedelta(days=gateway.settings.responses.retention_days)
            await conn.execute(sa.text("UPDATE stored_responses SET expires_at = :t WHERE id = :i"),
                               {"t": datetime.now(timezone.utc) - timedelta(seconds=1), "i": resp.id})
    finally:
        await db.dispose()
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)
    monkeypatch.setenv("TOLLGATE_RESPONSES_RETENTION_DAYS", "7")
    assert load_settings().responses.retention_days == 7.0


async def test_previous_response_id_bills_earlier_turns_as_prompt_tokens(gateway: Gateway, client: Any) -> None:
    first = await client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=20, temperature=0)
    second = await client.responses.create(
        model=MODEL, instructions=SYSTEM, input="And of Germany?", previous_response_id=first.id, max_output_tokens=20, temperature=0)
    assert second.previous_response_id == first.id
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Germany?"}]
    assert second.usage.input_tokens == len(gateway.engine.encode_chat(conversation))
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    chat = await client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=20, temperature=0)
    assert (chat.usage.prompt_tokens, chat.choices[0].message.content) == (second.usage.input_tokens, second.output_text)
    row = await gateway.ledger_row(request_id_of(second.id))
    assert (row["prompt_tokens"], row["completion_tokens"], row["api"]) == (second.usage.input_tokens, second.usage.output_tokens, "responses")
    # A third turn carries both earlier turns; the earlier response deleted, the chain still holds.
    await client.responses.delete(first.id)
    third = await client.responses.create(model=MODEL, input="Thanks.", previous_response_id=second.id, max_output_tokens=16, temperature=0)
    assert third.usage.input_tokens == len(gateway.engine.encode_chat(
        conversation[1:] + [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}]))


async def test_truncation_auto_drops_the_first_turns_until_the_prompt_fits(gateway: Gateway, client: Any) -> None:
    """truncation "auto" drops items from the beginning of the conversation until the prompt and its
    bound fit the context (the instructions stay); "disabled", the default, is a 400. What is billed
    is what the model saw; the stored conversation keeps every turn."""
    context = gateway.engine.context_length
    long_turn = "word " * (context * 3 // 5)  # two of them do not fit
    first = await client.responses.create(model=MODEL, instructions=SYSTEM, input=long_turn, max_output_tokens=16, temperature=0)
    assert first.truncation == "disabled"
    for truncation in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, instructions=SYSTEM, input=long_turn, previous_response_id=first.id,
                                          max_output_tokens=16, temperature=0, **truncation)
        assert refused.value.code == "context_length_exceeded"
    second = await client.responses.create(model=MODEL, instructions=SYSTEM, input=long_turn, previous_response_id=first.id,
                                           max_output_tokens=16, temperature=0, truncation="auto")
    assert second.truncation == "auto" and second.status in ("completed", "incomplete")
    seen = [{"role": "system", "content": SYSTEM}, {"role": "assistant", "content": first.output_text},  # the first item dropped
            {"role": "user", "content": long_turn}]
    assert second.usage.input_tokens == len(gateway.engine.encode_chat(seen)) < context
    row = await gateway.only_row(request_id_of(second.id))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (second.usage.input_tokens, second.usage.output_tokens)
    db = create_engine(gateway.db_url)
    try:
        async with db.connect() as conn:
            stored = (await conn.execute(sa.text("SELECT messages FROM stored_responses WHERE id = :id"), {"id": second.id})).scalar_one()
    finally:
        await db.dispose()
    assert [m["role"] for m in json.loads(stored)] == ["user", "assistant", "user"]  # stored: every turn
    # a conversation that fits is not touched
    short = await client.responses.create(model=MODEL, input="And of Germany?", previous_response_id=first.id,
                                          max_output_tokens=16, temperature=0, truncation="auto")
    assert short.usage.input_tokens > first.usage.input_tokens


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == "event: " + payload["type"]
            out.append(payload)
    return out


def test_every_event_validates_against_the_sdk_models_and_a_failure_is_error_then_response_failed() -> None:
    """The renderer alone: each event passes the openai SDK's own pydantic models strictly (the SDK
    itself only constructs them), and a stream that fails after its first byte ends with an
    `error` event and `response.failed`, numbered on from the deltas."""
    from types import SimpleNamespace

    from openai.types.responses import Response as SDKResponse, ResponseStreamEvent
    from pydantic import TypeAdapter

    from gateway.http.errors import ServiceUnavailable
    from gateway.api.openai.responses import ResponseRenderer
    from gateway.api.openai.responses_protocol import ResponsesRequest

    events = TypeAdapter(ResponseStreamEvent)

    def renderer() -> ResponseRenderer:
        gen = SimpleNamespace(request_id="abc", created=1, model=MODEL, prompt_tokens=7, completion_tokens=2, cached_tokens=None,
                              finish_reason="stop")
        return ResponseRenderer(gen, ResponsesRequest(model=MODEL, input="hi"))  # type: ignore[arg-type]

    ok = renderer()
    stream = _events(ok.first() + ok.delta("Hel", None) + ok.delta("lo", "stop") + ok.end())
    for payload in stream:
        events.validate_python(payload)
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    final = SDKResponse.model_validate(stream[-1]["response"])
    assert (final.status, final.output_text, final.usage.total_tokens) == ("completed", "Hello", 9)
    assert SDKResponse.model_validate_json(ok.body("Hello")).output_text == "Hello"

    failing = renderer()
    stream = _events(failing.first() + failing.delta("Hel", None) + failing.error(ServiceUnavailable("engine died", code="engine_error")))
    for payload in stream:
        events.validate_python(payload)
    assert [e["type"] for e in stream[-2:]] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    assert stream[-2]["message"] == "engine died" and stream[-1]["response"]["status"] == "failed"
    assert stream[-1]["response"]["error"] == {"code": "server_error", "message": "engine died"}


async def test_store_and_continuation_on_sqlite(sqlite_gateway: Gateway, client_for: Any) -> None:
    """The same store on the embedded default (SQLite, the same migration history)."""
    client = client_for((await sqlite_gateway.new_key())["key"], sqlite_gateway)
    first = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    second = await client.responses.create(model=MODEL, input="And of Germany?", previous_response_id=first.id, max_output_tokens=16)
    assert second.usage.input_tokens == len(sqlite_gateway.engine.encode_chat([
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Germany?"}]))
    row = await sqlite_gateway.ledger_row(request_id_of(second.id))
    assert (row["prompt_tokens"], row["api"]) == (second.usage.input_tokens, "responses")
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)


async def test_suspended_account_is_refused_before_admission(
    gateway: Gateway, customer: dict[str, Any], client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The billing guard (unpaid invoices) as chat's: 403 account_suspended, no row. The account's
    delinquency is stubbed in the guard's own lookup (tests/billing/stripe/test_stripe.py makes a real one)."""
    states = gateway.app.state.billing.states
    real = states.suspension
    monkeypatch.setattr(states, "suspension", lambda p, now=None: "suspended for INV-9" if p.account_id == customer["account_id"] else real(p, now))
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, stream=True)
    assert caught.value.body["code"] == "account_suspended" and "INV-9" in caught.value.body["message"]
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 0
    monkeypatch.setattr(states, "suspension", real)
    assert (await client.responses.create(model=MODEL, input=LONG, max_output_tokens=16, temperature=0)).usage.output_tokens == 16


def test_a_truncation_that_starts_at_a_calls_output_is_a_conversation_it_may_try() -> None:
    """`truncation: auto` tries cuts of the conversation; one can start with a call's output whose
    call was cut away. The chat check that a tool message answers an earlier call is the chat API's
    own (the Responses API checks its call ids itself): such a cut is tried, not a 400 (the review
    of this change found the check there refusing it)."""
    from gateway.api.openai.protocol import parse
    from gateway.api.openai.responses_protocol import ResponsesRequest
    from gateway.serving.completions import chat_equivalent

    request = parse(ResponsesRequest, {"model": "m", "truncation": "auto", "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "a", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "b", "output": "rain"}]})
    body = request.chat_body()
    for keep in range(1, request.droppable() + 1):
        cut = {**body, "messages": list(body["messages"])}
        request.keep_from(cut["messages"], keep)
        assert chat_equivalent(cut, False, ()).messages, keep


async def test_max_output_tokens_below_16_is_openais_400(gateway: Gateway, customer: dict[str, Any], client: Any) -> None:
    """OpenAI's Responses API refuses a max_output_tokens below 16 (chat's max_tokens takes 1): a 400
    invalid_request_error, param max_output_tokens, code integer_below_min_value, in its own words.
    Nothing is admitted, so nothing is metered; 16 is served."""
    for n in (0, 1, 15):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=n, stream=stream)
            assert caught.value.status_code == 400
            assert caught.value.body == {  # type: ignore[comparison-overlap]
                "message": f"Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got {n} instead.",
                "type": "invalid_request_error", "param": "max_output_tokens", "code": "integer_below_min_value"}
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 0
    ok = await client.responses.create(model=MODEL, input=LONG, max_output_tokens=16, temperature=0)
    assert (ok.max_output_tokens, ok.usage.output_tokens) == (16, 16)
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == 1
