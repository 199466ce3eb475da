"""POST /v1/embeddings through the openai SDK against the real gateway and all-MiniLM-L6-v2."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from engines.base import EngineError
from tests.conftest import Gateway, price_in_force, until
from tests.engine_ids import EmbeddedIds

EMB = "all-minilm-l6-v2"


async def set_limits(gw: Gateway, path: str, limits: dict[str, Any]) -> None:
    async with gw.admin_client() as admin:
        r = await admin.patch(path, json={"limits": limits})
        assert r.status_code == 200, r.text


def model_of(gw: Gateway) -> Any:
    return gw.app.state.embeddings.models[EMB]


async def embed_raw(client: Any, **kw: Any) -> tuple[Any, str]:
    raw = await client.embeddings.with_raw_response.create(model=EMB, **kw)
    return raw.parse(), raw.headers["x-request-id"]


async def test_shapes_usage_and_ledger_row(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    client = client_for(key["key"])
    texts = ["The cat sat on the mat.", "A kitten is a young cat.", "Quantum chromodynamics describes quarks."]
    embedded = EmbeddedIds.on(model_of(gateway))
    mark = len(embedded.inputs)
    resp, rid = await embed_raw(client, input=texts, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert all(len(d.embedding) == 384 for d in resp.data)
    vecs = np.array([d.embedding for d in resp.data])
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.2  # a real sentence model, not noise
    model = model_of(gateway)
    expected = sum(len(model.encode_text(t)) for t in texts)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == expected
    assert resp.model == EMB
    row = await gateway.only_row(rid)
    assert (row["model"], row["prompt_tokens"], row["completion_tokens"], row["status"]) == (EMB, expected, 0, "completed")
    assert row["prompt_tokens"] == embedded.since(mark)  # the ids the model itself ran on
    assert row["key_id"] == key["id"] and row["cached"] is False

    single = await client.embeddings.create(model=EMB, input="hello world", encoding_format="float")
    assert len(single.data) == 1 and len(single.data[0].embedding) == 384


async def test_base64_equals_float_and_token_ids_equal_text(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    client = client_for(key["key"])
    text = "Embeddings are vectors."
    as_float = (await client.embeddings.create(model=EMB, input=text, encoding_format="float")).data[0].embedding
    # The SDK asks for base64 by default and decodes it itself.
    via_sdk = (await client.embeddings.create(model=EMB, input=text)).data[0].embedding
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {key['key']}"}) as h:
        r = await h.post("/embeddings", json={"model": EMB, "input": text, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    decoded = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (384,)
    assert np.allclose(decoded, as_float, atol=1e-6)
    assert np.allclose(via_sdk, as_float, atol=1e-6)

    ids = model_of(gateway).encode_text(text)
    by_ids = await client.embeddings.create(model=EMB, input=ids, encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, as_float, atol=1e-5)
    assert by_ids.usage.prompt_tokens == len(ids)
    two = await client.embeddings.create(model=EMB, input=[ids, ids[:2]], encoding_format="float")
    assert len(two.data) == 2 and two.usage.prompt_tokens == len(ids) + 2


async def test_concurrent_requests_are_batched_and_equal_one_by_one(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    client = client_for(key["key"])
    texts = [f"sentence number {i} about {'cats ' * (i % 5)}and dogs" for i in range(16)]
    alone = []
    for t in texts:
        alone.append((await client.embeddings.create(model=EMB, input=t, encoding_format="float")).data[0].embedding)
    stats = model_of(gateway).stats
    batches_before, inputs_before = stats.batches, stats.inputs
    together = await asyncio.gather(*(client.embeddings.create(model=EMB, input=t, encoding_format="float") for t in texts))
    batches = stats.batches - batches_before
    assert stats.inputs - inputs_before == len(texts)
    assert batches < len(texts), "concurrent requests should share forward passes"
    for one, many in zip(alone, together):
        assert np.allclose(one, many.data[0].embedding, atol=1e-5)


async def test_errors_dimensions_and_limits(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    client = client_for(key["key"])
    ok = await client.embeddings.create(model=EMB, input="x y z", dimensions=384, encoding_format="float")
    assert len(ok.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as err:
        await client.embeddings.create(model=EMB, input="x", dimensions=128)
    assert err.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="no-such-embedder", input="x")
    with pytest.raises(openai.BadRequestError) as err:
        await client.embeddings.create(model=EMB, input="word " * 400)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model=EMB, input=[""])
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model=EMB, input=[10**9])

    # Limits: a key with a tiny monthly token budget is refused before any work, and nothing is billed.
    limited = await gateway.new_key()
    await set_limits(gateway, f"/admin/keys/{limited['id']}", {"monthly_tokens": 10})
    lc = client_for(limited["key"])
    small = await lc.embeddings.create(model=EMB, input="two words", encoding_format="float")
    assert small.usage.prompt_tokens <= 10
    with pytest.raises(openai.RateLimitError):
        await lc.embeddings.create(model=EMB, input="this sentence has clearly more than ten tokens in it, surely", encoding_format="float")
    await gateway.flush_ledger()  # every row the server recorded for these requests is in the database
    assert await gateway.ledger_count(key_id=limited["id"]) == 1  # the refusal left none


async def test_a_matryoshka_model_cuts_to_fewer_dimensions_and_refuses_more_before_admission(gateway: Gateway, client_for: Any) -> None:
    """Fewer dimensions than the model's: the vector cut and normalised; more: a 400 and no row (the
    refusal came after the request was admitted and billed, a `completed` row for a 400)."""
    key = await gateway.new_key()
    client = client_for(key["key"])
    model = gateway.app.state.embeddings.models[EMB]
    model.matryoshka = True  # a model built in code with it; models.yaml has no such setting
    try:
        cut = await client.embeddings.create(model=EMB, input="hello world", dimensions=128, encoding_format="float")
        assert len(cut.data[0].embedding) == 128 and abs(float(np.linalg.norm(cut.data[0].embedding)) - 1.0) < 1e-6
        with pytest.raises(openai.BadRequestError) as err:
            await client.embeddings.create(model=EMB, input="hello world", dimensions=1000)
        assert err.value.body["param"] == "dimensions"
    finally:
        model.matryoshka = False
    await gateway.flush_ledger()
    assert await gateway.ledger_count(key_id=key["id"]) == 1  # the cut one's; the refusal left none


async def test_priced_like_completions(gateway: Gateway, client_for: Any) -> None:
    async with gateway.admin_client() as admin:
        r = await admin.post("/admin/prices", json={"model": EMB, "input_per_million": "0.020", "output_per_million": "0"})
        assert r.status_code == 201, r.text
    await price_in_force(gateway, EMB, "0.020")
    key = await gateway.new_key()
    resp, rid = await embed_raw(client_for(key["key"]), input="priced input text", encoding_format="float")
    row = await gateway.ledger_row(rid)
    assert row["cost_nanos"] == resp.usage.prompt_tokens * 20  # $0.02 / 1M tokens = 20 nano-USD per token


async def test_priced_at_the_accounts_override(gateway: Gateway, client_for: Any) -> None:
    """A reseller's multiplier applies to embeddings as to completions (and to its invoices)."""
    async with gateway.admin_client() as admin:
        r = await admin.post("/admin/prices", json={"model": EMB, "input_per_million": "0.020", "output_per_million": "0"})
        assert r.status_code == 201, r.text
        account = await gateway.new_account()
        r = await admin.post(f"/admin/accounts/{account['id']}/prices", json={"model": EMB, "multiplier": "0.5"})
        assert r.status_code == 201, r.text
    client = client_for((await gateway.new_key(account["id"]))["key"])
    deadline = asyncio.get_running_loop().time() + 15  # the serving price book refreshes every few seconds
    while True:
        resp, rid = await embed_raw(client, input="discounted input text", encoding_format="float")
        row = await gateway.ledger_row(rid)
        if row["cost_nanos"] == resp.usage.prompt_tokens * 10 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.5)
    assert row["cost_nanos"] == resp.usage.prompt_tokens * 10  # half of 20 nano-USD per token


async def test_a_failed_embedding_is_billed_nothing(gateway: Gateway, client_for: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Billed whole or not at all: when the model fails the request, 503 engine_error, and its row
    says error with no tokens and no cost (a completion that fails is billed what it used)."""
    async with gateway.admin_client() as admin:
        r = await admin.post("/admin/prices", json={"model": EMB, "input_per_million": "0.020", "output_per_million": "0"})
        assert r.status_code == 201, r.text
    await price_in_force(gateway, EMB, "0.020")

    async def fails(ids: list[list[int]]) -> list[list[float]]:
        raise EngineError("the embedding model stopped")

    monkeypatch.setattr(model_of(gateway), "embed", fails)
    client = client_for((await gateway.new_key())["key"]).with_options(max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        await client.embeddings.create(model=EMB, input="this input is never embedded", encoding_format="float")
    assert err.value.status_code == 503 and err.value.code == "engine_error", err.value.body
    row = await gateway.only_row(err.value.response.headers["x-request-id"])
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"], row["cost_nanos"], row["finish_reason"]) == ("error", 0, 0, 0, None)


@pytest.mark.parametrize("where", ["model", "rendering"])
async def test_a_failure_that_is_not_the_engine_s_is_an_error_row(gateway: Gateway, client_for: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   where: str) -> None:
    """A failure of the server's own (an exception other than EngineError from the model's wrapper,
    or while the vectors are rendered into the body) answers 500 and its row says `error`, billed
    nothing: before, the first left it `cancelled` (as if the client had left) and the second
    `completed` (settled before the body was built)."""
    model = model_of(gateway)
    real_embed = model.embed

    async def fails(ids: list[list[int]]) -> list[list[float]]:
        raise RuntimeError("a bug in the model's wrapper")

    async def unrenderable(ids: list[list[int]]) -> list[list[float]]:
        vectors = await real_embed(ids)
        return [["not a number"] * len(v) for v in vectors]  # type: ignore[misc]

    monkeypatch.setattr(model, "embed", fails if where == "model" else unrenderable)
    key = await gateway.new_key()
    client = client_for(key["key"]).with_options(max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        await client.embeddings.create(model=EMB, input="this input is never answered", encoding_format="base64")
    assert err.value.status_code == 500, err.value.body  # the unhandled error's answer: no x-request-id, found by its key
    await until(lambda: gateway.ledger_count(key_id=key["id"]), "the request's row")
    await gateway.flush_ledger()
    db = create_engine(gateway.db_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT status, prompt_tokens, cost_nanos FROM ledger_entries WHERE key_id = :k"),
                                       {"k": key["id"]})).all()
    finally:
        await db.dispose()
    assert [(status, tokens, cost or 0) for status, tokens, cost in rows] == [("error", 0, 0)]  # cost None: no price in force


async def test_an_embedding_whose_request_is_cancelled_is_a_cancelled_row(gateway: Gateway, client_for: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's task cancelled while the model runs (what a batch runner does to a line of a
    batch cancelled or taken from it): its row says `cancelled`, no tokens, no cost; `error` is for a
    failure (the model's or the server's), which this is not."""
    async def cancelled(ids: list[list[int]]) -> list[list[float]]:
        raise asyncio.CancelledError()  # what the route's await of the model gets when its task is cancelled

    monkeypatch.setattr(model_of(gateway), "embed", cancelled)
    key = await gateway.new_key()
    client = client_for(key["key"]).with_options(max_retries=0)
    with pytest.raises(openai.APIStatusError):
        await client.embeddings.create(model=EMB, input="this input is never embedded", encoding_format="float")
    await until(lambda: gateway.ledger_count(key_id=key["id"]), "the request's row")
    await gateway.flush_ledger()
    db = create_engine(gateway.db_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT status, prompt_tokens, completion_tokens, cost_nanos FROM ledger_entries "
                                               "WHERE key_id = :k"), {"k": key["id"]})).all()
    finally:
        await db.dispose()
    assert [(status, prompt, completion, cost or 0) for status, prompt, completion, cost in rows] == [("cancelled", 0, 0, 0)]
