"""Every error status comes back OpenAI-shaped, raises the SDK's matching exception, and the
server keeps serving afterwards."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from engines.backends.hf import HFEngine
from gateway.app import create_app
from gateway.config import Settings
from tests.conftest import MODEL, SECRET, Gateway, ServerThread, bootstrap

QUESTION = [{"role": "user", "content": "Say hi."}]
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}


def assert_openai_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


async def still_serving(gateway: Gateway, key: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        r = await c.post("/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 200, r.text


async def test_missing_and_invalid_keys_are_401(gateway: Gateway, client_for: Any, customer: dict[str, Any]) -> None:
    bad = "sk-" + "x" * 43
    with pytest.raises(openai.AuthenticationError) as info:
        await client_for(bad).chat.completions.create(model=MODEL, messages=QUESTION)
    err = assert_openai_shape(info.value.response.json())
    assert bad not in err["message"]
    async with httpx.AsyncClient(base_url=gateway.v1) as c:
        r = await c.post("/chat/completions", json={"model": MODEL, "messages": QUESTION})
        assert r.status_code == 401
        assert assert_openai_shape(r.json())["code"] == "missing_api_key"
        r = await c.get("/models", headers={"Authorization": "Basic abc"})
        assert r.status_code == 401
    await still_serving(gateway, customer["key"])


async def test_revoked_key_is_401(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    client = client_for(key["key"])
    await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    async with gateway.admin_client() as admin:
        r = await admin.delete(f"/admin/keys/{key['id']}")
        assert r.status_code == 200 and r.json()["revoked_at"]
    # OpenAI answers a revoked key 401 (its error-codes guide): the SDK's AuthenticationError.
    with pytest.raises(openai.AuthenticationError) as info:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert assert_openai_shape(info.value.response.json())["code"] == "key_revoked"


async def test_expired_key_is_401(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key(expires_at=(datetime.now(timezone.utc) + timedelta(hours=1)).isoformat())
    db = create_engine(gateway.db_url)
    try:  # its hour has passed (before its first use: nothing cached it)
        async with db.begin() as conn:
            await conn.execute(sa.text("UPDATE api_keys SET expires_at = :t WHERE id = :i"),
                               {"t": datetime.now(timezone.utc) - timedelta(minutes=1), "i": key["id"]})
    finally:
        await db.dispose()
    with pytest.raises(openai.AuthenticationError) as info:
        await client_for(key["key"]).chat.completions.create(model=MODEL, messages=QUESTION)
    assert assert_openai_shape(info.value.response.json())["code"] == "key_expired"


async def test_a_key_cannot_be_created_already_expired(gateway: Gateway) -> None:
    """It would never authenticate: a 400 naming `expires_at`, before the account is looked up."""
    past = (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()
    async with gateway.admin_client() as admin:
        for account_id in ((await gateway.new_account())["id"], 10**9):
            r = await admin.post("/admin/keys", json={"account_id": account_id, "expires_at": past})
            assert r.status_code == 400 and r.json()["error"]["param"] == "expires_at", r.text


async def test_model_not_allowed_for_key_is_403(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key(models=["some-other-model"])
    client = client_for(key["key"])
    with pytest.raises(openai.PermissionDeniedError) as info:
        await client.chat.completions.create(model=MODEL, messages=QUESTION)
    err = assert_openai_shape(info.value.response.json())
    assert err["code"] == "model_not_allowed" and err["param"] == "model"
    assert (await client.models.list()).data == []


async def test_unknown_model_is_404(client_for: Any, customer: dict[str, Any]) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client_for(customer["key"]).chat.completions.create(model="no-such-model", messages=QUESTION)
    err = assert_openai_shape(info.value.response.json())
    assert err["code"] == "model_not_found" and err["param"] == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"messages": QUESTION}, "model"),
        ({"model": MODEL, "messages": "hello"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "temperature": 7}, "temperature"),
        ({"model": MODEL, "messages": QUESTION, "stream": "yes"}, "stream"),
        ({"model": MODEL, "messages": QUESTION, "n": 17}, "n"),
        ({"model": MODEL, "messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": MODEL, "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"model": MODEL, "messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
        # OpenAI's deprecated function calling: refused by name, not run without the functions
        ({"model": MODEL, "messages": QUESTION, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"model": MODEL, "messages": QUESTION, "function_call": {"name": "f"}}, "function_call"),
        # a tool result answers a call made earlier in the conversation, by its id
        ({"model": MODEL, "messages": [*QUESTION, {"role": "tool", "content": "18 degrees"}]}, "messages[1].tool_call_id"),
        ({"model": MODEL, "messages": [*QUESTION, ASSISTANT_CALL, {"role": "tool", "tool_call_id": "call_other", "content": "x"}]},
         "messages[2].tool_call_id"),
    ],
)
async def test_invalid_chat_requests_are_400(gateway: Gateway, customer: dict[str, Any], body: dict[str, Any], param: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}) as c:
        r = await c.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert assert_openai_shape(r.json())["param"] == param


async def test_a_replayed_conversation_with_a_refusal_and_a_tool_result_is_served(gateway: Gateway, customer: dict[str, Any]) -> None:
    """What OpenAI's SDK sends back of earlier turns: an assistant refusal part (the SDK's
    ChatCompletionContentPartRefusalParam) and a tool result answering its call. The refusal is
    what the model said; the prompt billed holds it."""
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say."}]}
    messages = [*QUESTION, refusal, {"role": "user", "content": "Then the weather?"}, ASSISTANT_CALL,
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}, timeout=60) as c:
        r = await c.post("/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3})
        assert r.status_code == 200, r.text
        plain = [*QUESTION, {"role": "assistant", "content": "I cannot say."}, {"role": "user", "content": "Then the weather?"}]
        counted = await c.post("/chat/completions", json={"model": MODEL, "messages": plain, "max_tokens": 3})
    assert counted.json()["usage"]["prompt_tokens"] < r.json()["usage"]["prompt_tokens"]
    assert counted.json()["usage"]["prompt_tokens"] == len(gateway.engine.encode_chat(plain))


async def test_sdk_raises_bad_request_for_n_above_the_engines_limit(client_for: Any, customer: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        await client_for(customer["key"]).chat.completions.create(model=MODEL, messages=QUESTION, n=17)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe{}", b"[" * 5000 + b"]" * 5000])
async def test_malformed_bodies_are_400(gateway: Gateway, customer: dict[str, Any], raw: bytes) -> None:
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}) as c:
        r = await c.post("/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert assert_openai_shape(r.json())["type"] == "invalid_request_error"


async def test_invalid_text_completion_requests_are_400(gateway: Gateway, customer: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}) as c:
        for body in (
            {"model": MODEL},
            {"model": MODEL, "prompt": ["a", "b"]},
            {"model": MODEL, "prompt": []},
            {"model": MODEL, "prompt": [1, 2, 10**9]},
            {"model": MODEL, "prompt": [-1]},
            {"model": MODEL, "prompt": "x", "echo": True},
            {"model": MODEL, "prompt": "x", "best_of": 3},
            {"model": MODEL, "prompt": "x", "logprobs": 2},
        ):
            r = await c.post("/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert_openai_shape(r.json())


async def test_prompt_longer_than_context_is_400(gateway: Gateway, client_for: Any, customer: dict[str, Any]) -> None:
    n = gateway.engine.context_length
    long_prompt = "hello " * (n + 10)
    with pytest.raises(openai.BadRequestError) as info:
        await client_for(customer["key"]).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    err = assert_openai_shape(info.value.response.json())
    assert err["code"] == "context_length_exceeded"
    await still_serving(gateway, customer["key"])


async def test_a_completion_bound_past_the_context_is_400_on_every_api(gateway: Gateway, client_for: Any, customer: dict[str, Any]) -> None:
    """A prompt plus max_tokens past the context is refused with context_length_exceeded, as OpenAI,
    Anthropic and vLLM answer, on each API's own bound; not cut to the room in silence. Nothing is
    admitted (no ledger row); a bound that fits exactly is admitted."""
    context = gateway.engine.context_length
    client = client_for(customer["key"])
    ask = [{"role": "user", "content": "Say hi."}]
    chat_prompt = (await client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1)).usage.prompt_tokens  # type: ignore[union-attr, arg-type]
    text_prompt = (await client.completions.create(model=MODEL, prompt="Say hi.", max_tokens=1)).usage.prompt_tokens  # type: ignore[union-attr]
    claude = anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=customer["key"], max_retries=0)
    messages_prompt = (await claude.messages.create(model=MODEL, max_tokens=1, messages=ask)).usage.input_tokens  # type: ignore[arg-type]
    responses_prompt = (await client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=16)).usage.input_tokens  # type: ignore[union-attr]
    await gateway.flush_ledger()
    rows = await gateway.ledger_count(key_id=customer["id"])
    over = {
        "chat max_tokens": lambda: client.chat.completions.create(model=MODEL, messages=ask, max_tokens=context - chat_prompt + 1),  # type: ignore[arg-type]
        "chat max_completion_tokens": lambda: client.chat.completions.create(
            model=MODEL, messages=ask, max_completion_tokens=context - chat_prompt + 1, stream=True),  # type: ignore[arg-type]
        "completions": lambda: client.completions.create(model=MODEL, prompt="Say hi.", max_tokens=context - text_prompt + 1),
        "responses": lambda: client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=context - responses_prompt + 1),
    }
    for name, call in over.items():
        with pytest.raises(openai.BadRequestError) as info:
            await call()
        err = assert_openai_shape(info.value.response.json())
        assert err["code"] == "context_length_exceeded" and f"maximum context length is {context} tokens" in err["message"], (name, err)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=context - messages_prompt + 1, messages=ask)  # type: ignore[arg-type]
    assert refused.value.body["error"]["type"] == "invalid_request_error", refused.value.body  # type: ignore[index]
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=customer["id"]) == rows  # nothing admitted
    # exactly the room is admitted (the stream's first chunk is enough: the bound passed admission)
    stream = await client.chat.completions.create(model=MODEL, messages=ask, max_tokens=context - chat_prompt, stream=True)  # type: ignore[arg-type]
    async for _ in stream:
        break
    await stream.close()
    await still_serving(gateway, customer["key"])


async def test_body_over_the_limit_is_413(gateway: Gateway, customer: dict[str, Any]) -> None:
    big = "a" * (gateway.settings.http.max_body_bytes + 1)
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}) as c:
        r = await c.post("/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": big}]})
        assert r.status_code == 413
        assert assert_openai_shape(r.json())["code"] == "payload_too_large"

        async def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(gateway.settings.http.max_body_bytes // 65536 + 2):
                yield b"a" * 65536

        r = await c.post("/chat/completions", content=chunked())
        assert r.status_code == 413
    await still_serving(gateway, customer["key"])


async def test_engine_at_capacity_is_503(gateway: Gateway, client_for: Any, customer: dict[str, Any]) -> None:
    engine = gateway.engine
    saved = engine.capacity
    client = client_for(customer["key"])
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to one hundred."}], max_tokens=200, stream=True
    )
    try:
        engine.capacity = engine.requests_in_flight() or 1
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=QUESTION)
        assert info.value.status_code == 503
        assert assert_openai_shape(info.value.response.json())["code"] == "engine_overloaded"
        assert info.value.response.headers["retry-after"]
    finally:
        engine.capacity = saved
        await stream.close()
    await still_serving(gateway, customer["key"])


async def test_model_not_loaded_is_503(fresh_pg_database: Any, tmp_path: Any, client_for: Any) -> None:
    db_url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(db_url, SECRET)
    loading = HFEngine(model_id=MODEL)  # never started: still "loading"
    app = create_app(Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp_path), engines={MODEL: loading})
    with ServerThread(app) as server:
        base = f"http://127.0.0.1:{server.port}"
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
            assert (await admin.get("/healthz")).status_code == 200
            assert (await admin.get("/readyz")).status_code == 503
            account = (await admin.post("/admin/accounts", json={"name": "early"})).json()
            key = (await admin.post("/admin/keys", json={"account_id": account["id"]})).json()["key"]
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=QUESTION)
        assert info.value.status_code == 503
        assert assert_openai_shape(info.value.response.json())["code"] == "engine_not_ready"


async def test_unknown_path_and_method_are_openai_shaped(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url) as c:
        r = await c.get("/v1/nothing-here")
        assert r.status_code == 404
        assert_openai_shape(r.json())
        r = await c.get("/v1/chat/completions")
        assert r.status_code == 405
        assert_openai_shape(r.json())


async def test_server_survives_a_burst_of_bad_requests(gateway: Gateway, customer: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}) as c:
        bodies = [b"{", b"null", b'{"model": 1}', b'{"model": "x", "messages": [null]}', b'{"messages": [{"role": "user"}]}']
        results = await asyncio.gather(*[c.post("/chat/completions", content=b) for b in bodies * 10])
    assert {r.status_code for r in results} <= {400, 404}
    await still_serving(gateway, customer["key"])


async def test_a_key_pasted_into_a_path_or_model_is_never_echoed(gateway: Gateway, customer: dict[str, Any]) -> None:
    secret = customer["key"]
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {secret}"}) as c:
        r1 = await c.get(f"/models/{secret}")
        r2 = await c.post("/chat/completions", json={"model": secret, "messages": QUESTION})
    for r in (r1, r2):
        assert r.status_code == 404
        assert secret not in r.text and secret[3:20] not in r.text


async def test_a_key_in_a_field_name_the_error_names_is_masked(gateway: Gateway) -> None:
    """A 400 names the field it refuses; a field named after a key (`metadata.sk-...`) is masked there
    as in the message."""
    key = (await gateway.new_key())["key"]
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        r = await http.post("/responses", json={"model": MODEL, "input": "x", "metadata": {key: 1}})
    assert r.status_code == 400, r.status_code
    err = assert_openai_shape(r.json())
    assert key not in r.text and err["param"].startswith("metadata.sk-***"), err["param"]
    await still_serving(gateway, key)
