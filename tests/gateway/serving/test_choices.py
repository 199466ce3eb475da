"""n > 1 on the hf engine (engines/backends/hf_choices.py): n sequences of one request, streamed and not, chat
and text, also with a response format; the prompt billed once and every sequence's tokens billed;
what it cannot do (n above its limit, best_of > n) refused with a 400 naming the field, before any
quota is held or any row written. The trtllm engine's n / best_of: tests/engines/backends/test_trtllm.py."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import MODEL, Gateway

QUESTION = [{"role": "user", "content": "Say hi."}]


async def test_n_choices_on_the_hf_engine(gateway: Gateway, client_for: Any) -> None:
    engine = gateway.app.state.service.engines[MODEL]
    assert engine.max_choices == 16
    key = await gateway.new_key()
    client = client_for(key["key"])

    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, n=3, max_tokens=6, temperature=1.0)
    body = raw.parse()
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length") for c in body.choices)
    row = await gateway.ledger_row(raw.headers["x-request-id"])
    assert body.usage.prompt_tokens == row["prompt_tokens"] == len(engine.encode_chat(QUESTION))  # the prompt once
    assert body.usage.completion_tokens == row["completion_tokens"] <= 3 * 6  # every sequence
    assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(raw.headers["x-request-id"])  # the engine's ids, all 3

    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, max_tokens=6, stream=True,
                                                  stream_options={"include_usage": True})
    texts, finishes, roles, usage = {0: "", 1: "", 2: ""}, {}, set(), None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles |= {c.index} if c.delta.role == "assistant" else set()
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0, 1, 2} and set(finishes) == {0, 1, 2} and all(texts.values())
    assert usage is not None and 3 <= usage.completion_tokens <= 3 * 6

    text = await client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=5)
    assert [c.index for c in text.choices] == [0, 1] and all(c.text for c in text.choices) and 2 <= text.usage.completion_tokens <= 10

    # Sampled at temperature 1, a string of "maxLength": 12 may be 12 rare characters of up to 4 byte tokens
    # each (48 tokens), which max_tokens cut ('length', seen in CI). Here every character of the answer is
    # ASCII, so at most one token each even spelled letter by letter: '{"greeting": "' (14), up to 10 letters
    # and '"}' (2) make <= 26 tokens, 27 with the end of sequence, so 'stop' within 40 is the guarantee, not luck.
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "pattern": "^[a-z]{1,10}$"}},
              "required": ["greeting"], "additionalProperties": False}
    guided = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "g", "schema": schema}})
    for choice in guided.choices:
        assert choice.finish_reason == "stop" and set(json.loads(choice.message.content)) == {"greeting"}


async def test_what_n_cannot_do_is_a_400_naming_the_field(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    client = client_for(key["key"])
    calls = [
        ("n", "invalid_value", lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, n=17, max_tokens=2)),
        ("best_of", "unsupported_parameter", lambda: client.completions.create(model=MODEL, prompt="Hi", best_of=2, max_tokens=2)),
    ]
    for param, code, call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            await call()
        error = refused.value.body
        assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=key["id"]) == 0  # refused before admission: nothing metered


async def test_a_client_leaving_ends_every_choice(gateway: Gateway) -> None:
    import asyncio
    import time

    import httpx

    key = await gateway.new_key()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "n": 3, "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        async with c.stream("POST", "/chat/completions", json=body) as resp:
            request_id = resp.headers["x-request-id"]
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 6:
                    break
    row = await gateway.ledger_row(request_id)
    assert row["status"] == "cancelled" and 0 < row["completion_tokens"] < 3 * 200
    deadline = time.monotonic() + 5
    while gateway.engine.requests_in_flight():  # every choice's engine request ends with the client
        assert time.monotonic() < deadline, f"{gateway.engine.requests_in_flight()} requests still in the engine"
        await asyncio.sleep(0.05)
