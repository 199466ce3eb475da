"""A prepaid balance across two gateway processes (issue 25): `tollgate serve` twice on one Postgres
and one Redis, an `openai` pool to a scripted upstream (no model), the official SDKs as clients.

200 concurrent requests against a $0.01 balance: each costs exactly its worst case (input free,
7 output tokens x $28.571/1M = 199,997 nano-USD, and the upstream answers 7 tokens), so exactly
10,000,000 // 199,997 = 50 are admitted, the other 150 get OpenAI's 429 insufficient_quota naming
the balance, and the spend is 9,999,850 nano-USD: 150 left, to the nano."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import sqlalchemy as sa

from billing import migrate
from billing.credits.balance import CreditBook
from billing.db import create_engine
from billing.keys.store import KeyStore
from billing.prices.book import PriceBook
from tests.conftest import REDIS_URL, SECRET, require_redis, run_coro
from tests.engines.conftest import upstreams  # noqa: F401  (fixture)
from tests.processes import GatewayProcess

CENT = 10_000_000
WORST = 7 * 28_571
MODELS = """models:
  - id: remote
    backend: openai
    context_length: 4096
    replicas: ["{url}"]
    health_path: null
"""


async def setup(url: str, input_price: str = "0") -> tuple[str, dict[str, Any], int]:
    """An admin key; a prepaid account with $0.01 and a key; the model's price."""
    db = create_engine(url)
    try:
        keys = KeyStore(db, SECRET.encode())
        admin_account = await keys.ensure_account("admin")
        admin = (await keys.create_key(admin_account["id"], name="admin", is_admin=True))["key"]
        account = await keys.create_account("prepaid-" + uuid.uuid4().hex[:6])
        key = await keys.create_key(account["id"])
        await PriceBook(db).add("remote", input_price, "28.571")
        book = CreditBook(db)
        await book.set_mode(account["id"], "prepaid")
        await book.add(account["id"], "topup", CENT, reason="test")
        return str(admin), key, int(account["id"])
    finally:
        await db.dispose()


async def ledger(url: str, account: int, expect: int) -> tuple[int, int]:
    """(rows, their cost) once the gateways' writers have landed `expect` rows (or 30 s passed)."""
    db = create_engine(url)
    try:
        deadline = time.monotonic() + 30
        while True:
            async with db.connect() as conn:
                count, cost = (await conn.execute(sa.text(
                    "SELECT count(*), coalesce(sum(cost_nanos), 0) FROM ledger_entries WHERE account_id = :a"), {"a": account})).one()
            if count >= expect or time.monotonic() > deadline:
                return int(count), int(cost)
            await asyncio.sleep(0.1)
    finally:
        await db.dispose()


def test_200_concurrent_requests_on_two_processes_spend_at_most_the_balance(
    upstreams: Any, fresh_pg_database: Any, tmp_path: Path  # noqa: F811
) -> None:
    require_redis(REDIS_URL)
    _server, upstream = upstreams()
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    admin_key, key, account = run_coro(setup(url))
    models = tmp_path / "models.yaml"
    models.write_text(MODELS.format(url=upstream))
    env = dict(REDIS_URL=REDIS_URL, TOLLGATE_REDIS_PREFIX=f"tgtest:prepaid:{uuid.uuid4().hex[:8]}:", TOLLGATE_MODELS=str(models),
               TOLLGATE_EMBEDDINGS="off", TOLLGATE_CREDITS_CHECK_SECONDS="0")
    gateways = [GatewayProcess(url, tmp_path / f"data{i}", admin_key, **env) for i in (0, 1)]
    try:
        for gw in gateways:
            gw.start()

        async def fire() -> list[Any]:
            clients = [openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key["key"], max_retries=0, timeout=60) for gw in gateways]

            async def one(i: int) -> Any:
                try:
                    return await clients[i % 2].chat.completions.create(
                        model="remote", max_tokens=7, messages=[{"role": "user", "content": "hi"}])
                except openai.APIStatusError as exc:
                    return exc

            try:
                return list(await asyncio.gather(*(one(i) for i in range(200))))
            finally:
                for c in clients:
                    await c.close()

        results = run_coro(fire())
        served = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(served) == CENT // WORST == 50  # exactly: not one more, not one fewer
        assert all(r.usage.completion_tokens == 7 for r in served)  # each used its whole worst case
        assert len(refused) == 150
        for exc in refused:
            assert exc.status_code == 429, exc
            body = exc.body
            assert (body["type"], body["code"]) == ("insufficient_quota", "insufficient_quota")
            assert "prepaid balance ($0.000000150 available)" in body["message"]
        rows, cost = run_coro(ledger(url, account, 50))
        assert (rows, cost) == (50, 50 * WORST)
        assert cost <= CENT and CENT - cost == 150

        with httpx.Client(base_url=gateways[1].base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as admin:
            balance = admin.get(f"/admin/accounts/{account}/credits").json()
            assert (balance["billing_mode"], balance["balance_nanos"], balance["balance"]) == ("prepaid", 150, "0.000000150")

        # Anthropic's answer on /v1/messages for the same refusal: a credit balance too low is its 400
        claude = anthropic.Anthropic(base_url=gateways[0].base_url, api_key=key["key"], max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as refused_msg:
            claude.messages.create(model="remote", max_tokens=7, messages=[{"role": "user", "content": "hi"}])
        assert refused_msg.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "prepaid balance" in refused_msg.value.body["error"]["message"]  # type: ignore[index]

        # A top-up through one process's admin API is spendable at once on the other
        with httpx.Client(base_url=gateways[0].base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as admin:
            r = admin.post(f"/admin/accounts/{account}/credits", json={"kind": "topup", "amount": "0.000199847", "reason": "exact"})
            assert r.status_code == 201, r.text
            assert r.json()["admin_key_id"] is not None
            bad = admin.post(f"/admin/accounts/{account}/credits", json={"kind": "topup", "amount": 0.5})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "amount"
        sdk = openai.OpenAI(base_url=gateways[1].base_url + "/v1", api_key=key["key"], max_retries=0)
        assert sdk.chat.completions.create(model="remote", max_tokens=7, messages=[{"role": "user", "content": "hi"}]).usage
        with pytest.raises(openai.RateLimitError):
            sdk.chat.completions.create(model="remote", max_tokens=7, messages=[{"role": "user", "content": "hi"}])
        rows, cost = run_coro(ledger(url, account, 51))
        assert (rows, CENT + 199_847 - cost) == (51, 0)  # spent to the last nano
    finally:
        for gw in gateways:
            gw.stop()


def test_an_estimated_prompt_never_takes_a_prepaid_balance_below_zero(
    upstreams: Any, fresh_pg_database: Any, tmp_path: Path  # noqa: F811
) -> None:
    """A pool without `tokenizer:` holds a cl100k estimate of the prompt (9 tokens for "hi"); the
    upstream's exact usage says 17. Each request is charged at most its hold: the row keeps the
    upstream's 17 tokens, the balance never goes below zero. Before, each was charged its 17 tokens
    in full, 8 x 28,571 nano-USD past its hold, and 40 concurrent requests on $0.01 took the balance
    to about -$0.0019 (an audit's figure)."""
    from engines.backends.openai_stream import TokenCounter

    require_redis(REDIS_URL)
    _server, upstream = upstreams()
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    admin_key, key, account = run_coro(setup(url, input_price="28.571"))
    counter = TokenCounter("cl100k_base")
    counter.load()
    estimate = len(counter.encode_chat([{"role": "user", "content": "hi"}]))
    assert estimate < 17  # the case: the upstream bills more prompt than was held
    hold = (estimate + 7) * 28_571
    models = tmp_path / "models.yaml"
    models.write_text(MODELS.format(url=upstream))
    env = dict(REDIS_URL=REDIS_URL, TOLLGATE_REDIS_PREFIX=f"tgtest:prepaid:{uuid.uuid4().hex[:8]}:", TOLLGATE_MODELS=str(models),
               TOLLGATE_EMBEDDINGS="off", TOLLGATE_CREDITS_CHECK_SECONDS="0")
    gateway = GatewayProcess(url, tmp_path / "data", admin_key, **env)
    try:
        gateway.start()

        async def fire() -> list[Any]:
            async with openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key["key"], max_retries=0, timeout=60) as client:
                async def one() -> Any:
                    try:
                        return await client.chat.completions.create(model="remote", max_tokens=7, messages=[{"role": "user", "content": "hi"}])
                    except openai.RateLimitError as exc:
                        return exc

                return list(await asyncio.gather(*(one() for _ in range(40))))

        served = [r for r in run_coro(fire()) if not isinstance(r, Exception)]
        assert served and all(r.usage.prompt_tokens == 17 for r in served)
        rows, cost = run_coro(ledger(url, account, len(served)))
        assert rows == len(served)
        assert cost == len(served) * hold <= CENT  # each charged its hold, not (17 + 7) x 28,571
        with httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as admin:
            balance = admin.get(f"/admin/accounts/{account}/credits").json()
        assert balance["balance_nanos"] == CENT - len(served) * hold >= 0, balance
        db = create_engine(url)

        async def tokens() -> list[int]:
            try:
                async with db.connect() as conn:
                    return list((await conn.execute(sa.text("SELECT prompt_tokens FROM ledger_entries WHERE account_id = :a"),
                                                    {"a": account})).scalars())
            finally:
                await db.dispose()

        assert set(run_coro(tokens())) == {17}  # the ledger keeps the upstream's count
    finally:
        gateway.stop()
