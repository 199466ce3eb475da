"""The response cache through the openai SDK: real engine, real ledger, memory and Redis stores."""

from __future__ import annotations

import uuid
from decimal import ROUND_HALF_UP, Decimal
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.serving.cache import ResponseCache
from tests.conftest import MODEL, Gateway, on_server_loop, price_in_force, start_gateway, until

ON = {"X-Tollgate-Cache": "on"}


@pytest.fixture(scope="module")
def cache_gw(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A private gateway: these tests set a price for the model and change the cache's rules."""
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-cache"))
    try:
        yield gw
    finally:
        server.__exit__()


@pytest.fixture
def cache_config(cache_gw: Gateway) -> Iterator[Any]:
    config = cache_gw.app.state.response_cache.config
    saved = (config.ttl_seconds, config.hit_price, config.models)
    yield config
    config.ttl_seconds, config.hit_price, config.models = saved


def messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Count from one to five. ({uuid.uuid4().hex[:6]})"}]


async def chat(client: Any, msgs: list[dict[str, str]], headers: dict[str, str] | None = ON, **kw: Any) -> tuple[Any, Any]:
    params = {"max_tokens": 8, "temperature": 0, **kw}
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, extra_headers=headers or {}, **params)
    return raw.parse(), raw.headers


async def stored(gw: Gateway) -> None:
    """Barrier: the entries of the misses answered so far are in the store (they are written in the
    background, after the answer)."""
    cache = gw.app.state.response_cache
    await on_server_loop(gw.app, cache.flush())
    assert not cache._writes, "a response-cache write still pending after flush"


def entry_key(account_id: int, msgs: list[dict[str, str]], **params: Any) -> str:
    """The store key of a chat request as `chat()` sends it (the body's fields but model, as the SDK sends them)."""
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0, **params}
    gen = SimpleNamespace(engine_request=SimpleNamespace(extra=body), principal=SimpleNamespace(account_id=account_id),
                          model=MODEL, kind="chat", api="chat")
    return ResponseCache.key(gen)  # type: ignore[arg-type]


async def held(gw: Gateway, key: str) -> bool:
    return await on_server_loop(gw.app, gw.app.state.response_cache.get(key)) is not None


async def expired(gw: Gateway, key: str) -> None:
    """Waits until the store no longer holds the entry: its TTL has run out."""

    async def gone() -> bool:
        return not await held(gw, key)

    await until(gone, "the entry expired", timeout=10.0, every=0.05)


async def test_hit_after_miss_is_billed_by_the_rule_and_counted(cache_gw: Gateway, client_for: Any, cache_config: Any) -> None:
    async with cache_gw.admin_client() as admin:
        r = await admin.post("/admin/prices", json={"model": MODEL, "input_per_million": "1.000", "output_per_million": "3.000"})
        assert r.status_code == 201, r.text
    await price_in_force(cache_gw, MODEL, "1.000")
    client = client_for((await cache_gw.new_key())["key"], cache_gw)
    msgs = messages()
    first, h1 = await chat(client, msgs)
    assert h1.get("x-tollgate-cache") is None
    row1 = await cache_gw.only_row(h1["x-request-id"])
    assert row1["cached"] is False and row1["cost_nanos"] > 0
    assert (row1["prompt_tokens"], row1["completion_tokens"]) == await cache_gw.produced.counts(h1["x-request-id"])  # the engine's ids
    await stored(cache_gw)

    second, h2 = await chat(client, msgs)
    assert h2["x-tollgate-cache"] == "hit"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.model_dump() == first.usage.model_dump()
    assert second.model == MODEL and second.id != first.id
    row2 = await cache_gw.only_row(h2["x-request-id"])
    assert row2["cached"] is True and row2["status"] == "completed"
    # A hit bills the cached generation's tokens: what the engine produced for the original request.
    assert (row2["prompt_tokens"], row2["completion_tokens"]) == await cache_gw.produced.counts(h1["x-request-id"])
    assert h2["x-request-id"] not in cache_gw.produced.requests  # the engine never saw the hit
    assert row2["cost_nanos"] == 0  # default rule: hits are free

    cache_config.hit_price = Decimal("0.5")
    third, h3 = await chat(client, msgs)
    assert h3["x-tollgate-cache"] == "hit"
    row3 = await cache_gw.only_row(h3["x-request-id"])
    assert (row3["prompt_tokens"], row3["completion_tokens"]) == await cache_gw.produced.counts(h1["x-request-id"])
    assert row3["cached"] is True and row3["cost_nanos"] == int((Decimal(row1["cost_nanos"]) * Decimal("0.5")).quantize(Decimal(1), ROUND_HALF_UP))

    async with httpx.AsyncClient(base_url=cache_gw.base_url) as h:
        text = (await h.get("/metrics")).text
    assert f'tollgate_response_cache_lookups_total{{model="{MODEL}",result="hit"}}' in text
    assert "tollgate_response_cache_hit_ratio" in text


async def test_a_hit_bills_the_cached_generations_own_ids(cache_gw: Gateway, client_for: Any) -> None:
    client = client_for((await cache_gw.new_key())["key"], cache_gw)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    _, h1 = await chat(client, question, stop=[" is"], max_tokens=30)
    produced = await cache_gw.produced.finished(h1["x-request-id"])
    # The stop string's token is generated and billed but not sent: the text alone would count one less.
    assert len(cache_gw.engine.encode_text(produced.text)) != len(produced.ids), (produced.text, produced.ids)
    await stored(cache_gw)
    hit, h2 = await chat(client, question, stop=[" is"], max_tokens=30)
    assert h2["x-tollgate-cache"] == "hit"
    row = await cache_gw.only_row(h2["x-request-id"])
    assert row["cached"] is True
    assert (row["prompt_tokens"], row["completion_tokens"]) == (hit.usage.prompt_tokens, hit.usage.completion_tokens) == (produced.prompt, len(produced.ids))


async def test_no_hit_across_accounts_params_or_nondeterministic(cache_gw: Gateway, client_for: Any, cache_config: Any) -> None:
    a = client_for((await cache_gw.new_key())["key"], cache_gw)
    b = client_for((await cache_gw.new_key())["key"], cache_gw)
    msgs = messages()
    await chat(a, msgs)
    await stored(cache_gw)
    assert (await chat(a, msgs))[1].get("x-tollgate-cache") == "hit"
    _, hb = await chat(b, msgs)  # another account: never the first account's entry
    assert hb.get("x-tollgate-cache") is None
    assert (await cache_gw.ledger_row(hb["x-request-id"]))["cached"] is False
    assert (await chat(a, msgs, max_tokens=7))[1].get("x-tollgate-cache") is None
    assert (await chat(a, msgs, stop=["\n\n"]))[1].get("x-tollgate-cache") is None
    assert (await chat(a, [{"role": "user", "content": msgs[0]["content"] + "!"}]))[1].get("x-tollgate-cache") is None
    # Not opted in: no header and the model is not in the cached set.
    assert (await chat(a, msgs, headers=None))[1].get("x-tollgate-cache") is None
    # Opted in, but sampling without a seed is not deterministic: never cached.
    for _ in range(2):
        assert (await chat(a, msgs, temperature=0.8))[1].get("x-tollgate-cache") is None
    # A fixed seed is deterministic: cached.
    await chat(a, msgs, temperature=0.8, seed=7)
    await stored(cache_gw)
    assert (await chat(a, msgs, temperature=0.8, seed=7))[1].get("x-tollgate-cache") == "hit"
    # The per-model switch, and the per-request bypass.
    cache_config.models = frozenset({MODEL})
    assert (await chat(a, msgs, headers=None))[1].get("x-tollgate-cache") == "hit"
    assert (await chat(a, msgs, headers={"X-Tollgate-Cache": "off"}))[1].get("x-tollgate-cache") is None


async def test_n_choices_are_never_answered_from_the_cache(cache_gw: Gateway, client_for: Any) -> None:
    """An entry holds one choice's text: a request for n > 1 choices answered from it came back with
    one empty choice (its usage still the n sequences'). Such a request is not cached: the same n
    choices every time, streamed or not."""
    a = client_for((await cache_gw.new_key())["key"], cache_gw)
    msgs = messages()
    for _ in range(2):
        body, headers = await chat(a, msgs, n=2, seed=7, temperature=1.0, max_tokens=6)
        await stored(cache_gw)
        assert headers.get("x-tollgate-cache") is None and [c.index for c in body.choices] == [0, 1]
        assert all(c.message.content for c in body.choices), body
    stream = await a.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=7, temperature=1.0, max_tokens=6,
                                             stream=True, extra_headers=ON)
    texts: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1] and all(texts.values()), texts


async def test_ttl(cache_gw: Gateway, client_for: Any, cache_config: Any) -> None:
    cache_config.ttl_seconds = 1.5  # room for a hit on a loaded machine; expiry is waited for, not slept
    key = await cache_gw.new_key()
    client = client_for(key["key"], cache_gw)
    msgs = messages()
    await chat(client, msgs)
    await stored(cache_gw)
    assert await held(cache_gw, entry_key(key["account_id"], msgs))  # the key expired() watches is this entry's
    assert (await chat(client, msgs))[1].get("x-tollgate-cache") == "hit"
    await expired(cache_gw, entry_key(key["account_id"], msgs))
    assert (await chat(client, msgs))[1].get("x-tollgate-cache") is None


async def collect_stream(gw: Gateway, key: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    import json

    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key}", **ON}, timeout=120) as h:
        async with h.stream("POST", "/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
            return events, dict(r.headers)


async def test_streamed_replay_equals_original(cache_gw: Gateway, client_for: Any) -> None:
    key = (await cache_gw.new_key())["key"]
    body = {"model": MODEL, "messages": messages(), "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    original, h1 = await collect_stream(cache_gw, key, body)
    assert "x-tollgate-cache" not in h1
    await stored(cache_gw)
    replayed, h2 = await collect_stream(cache_gw, key, body)
    assert h2["x-tollgate-cache"] == "hit"

    def strip(events: list[dict[str, Any]]) -> list[Any]:
        return [(e["choices"], e.get("usage"), e["model"], e["object"]) for e in events]

    assert strip(replayed) == strip(original)  # the same chunks, in the same order
    row = await cache_gw.only_row(h2["x-request-id"])
    assert row["cached"] is True and row["completion_tokens"] == original[-1]["usage"]["completion_tokens"]
    assert (row["prompt_tokens"], row["completion_tokens"]) == await cache_gw.produced.counts(h1["x-request-id"])
    # The plain request shares the entry and says the same.
    client = client_for(key, cache_gw)
    plain, h3 = await chat(client, body["messages"], max_tokens=10)
    assert h3["x-tollgate-cache"] == "hit"
    streamed_text = "".join(c["delta"].get("content", "") for e in original for c in e["choices"])
    assert plain.choices[0].message.content == streamed_text


async def test_redis_store_hit_after_miss_and_ttl(redis_gateway: Gateway, client_for: Any) -> None:
    config = redis_gateway.app.state.response_cache.config
    assert type(redis_gateway.app.state.response_cache.store).__name__ == "RedisStore"
    saved = config.ttl_seconds
    config.ttl_seconds = 1.5  # room for a hit on a loaded machine; expiry is waited for, not slept
    try:
        key = await redis_gateway.new_key()
        client = client_for(key["key"], redis_gateway)
        msgs = messages()
        first, h1 = await chat(client, msgs)
        await stored(redis_gateway)
        assert await held(redis_gateway, entry_key(key["account_id"], msgs))  # the key expired() watches is this entry's
        second, h2 = await chat(client, msgs)
        assert h2["x-tollgate-cache"] == "hit"
        assert second.choices[0].message.content == first.choices[0].message.content
        row = await redis_gateway.only_row(h2["x-request-id"])
        assert row["cached"] is True
        assert (row["prompt_tokens"], row["completion_tokens"]) == await redis_gateway.produced.counts(h1["x-request-id"])
        other = client_for((await redis_gateway.new_key())["key"], redis_gateway)
        assert (await chat(other, msgs))[1].get("x-tollgate-cache") is None
        await expired(redis_gateway, entry_key(key["account_id"], msgs))
        assert (await chat(client, msgs))[1].get("x-tollgate-cache") is None
    finally:
        config.ttl_seconds = saved
