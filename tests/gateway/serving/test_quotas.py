"""Quotas through the gateway with the real model, on every limiter backend (in-process, Redis,
and a local Redis Cluster of 3 masters + 3 replicas)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from billing.quota.limits import Limits
from billing.quota import LedgerTotals, RedisLimiter, Scope
from engines.base import EngineOutput, EngineRequest
from tests.fakes.engine import FakeEngine
from tests.conftest import MODEL, REDIS_URL, SECRET, Gateway, minute_with_room, price_in_force, require_redis, start_gateway, stop_server

PROMPT = [{"role": "user", "content": "Say yes."}]
# A prompt the model answers at length: every admitted request uses all of its max_tokens, so it
# spends exactly what it reserved and the number a budget admits is exact (checked, see `full`).
FILL = [{"role": "user", "content": "Write a long poem about rivers."}]


@pytest.fixture(params=["memory", "redis", "cluster"])
def gw(request: pytest.FixtureRequest) -> Gateway:
    return request.getfixturevalue({"memory": "gateway", "redis": "redis_gateway", "cluster": "cluster_gateway"}[request.param])


async def counters(gw: Gateway, kind: str, scope_id: int) -> dict[str, int]:
    scope = Scope(kind, scope_id, Limits())
    if gw.settings.redis.url:
        db = create_engine(gw.db_url)
        lim = RedisLimiter(gw.settings.redis.url, LedgerTotals(db), prefix=gw.settings.redis.prefix, timeout=1.0)
        try:
            return await lim.counters(scope)
        finally:
            await lim.close()
            await db.dispose()
    return await gw.app.state.limiter.counters(scope)


async def settled(gw: Gateway, kind: str, scope_id: int, timeout: float = 10.0) -> dict[str, int]:
    """Counters once every hold of the scope is released."""
    deadline = time.monotonic() + timeout
    while True:
        c = await counters(gw, kind, scope_id)
        if c.get("in_flight", 0) == 0 and c.get("held_tokens", 0) == 0:
            return c
        assert time.monotonic() < deadline, f"holds not released: {c}"
        await asyncio.sleep(0.05)


async def ledger_tokens(gw: Gateway, column: str, value: int, *, rows: int | None = None, tokens: int | None = None,
                        timeout: float = 10.0) -> tuple[int, int]:
    """(rows, tokens) in the ledger for a key or account. Rows are written by a background batch
    writer after the request settles; given the expected `rows` or `tokens`, waits (up to
    `timeout`) for the writer to catch up before answering, so a slow batch is not a mismatch."""
    db = create_engine(gw.db_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            async with db.connect() as conn:
                row = (
                    await conn.execute(
                        sa.text(f"SELECT count(*), coalesce(sum(prompt_tokens + completion_tokens), 0) FROM ledger_entries WHERE {column} = :v"),
                        {"v": value},
                    )
                ).one()
            found = int(row[0]), int(row[1])
            caught_up = (rows is None or found[0] >= rows) and (tokens is None or found[1] >= tokens)
            if caught_up or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.05)
    finally:
        await db.dispose()


async def set_limits(gw: Gateway, path: str, limits: dict[str, Any]) -> dict[str, Any]:
    async with gw.admin_client() as admin:
        r = await admin.patch(path, json={"limits": limits})
        assert r.status_code == 200, r.text
        return r.json()


async def prompt_tokens(client: Any, messages: list[dict[str, str]] = FILL) -> int:
    resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    return resp.usage.prompt_tokens


async def fire(client: Any, n: int, max_tokens: int = 4, messages: list[dict[str, str]] = FILL) -> list[Any]:
    async def one() -> Any:
        try:
            return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        except openai.APIStatusError as exc:
            return exc
    return await asyncio.gather(*[one() for _ in range(n)])


def full(served: list[Any], per_request: int) -> list[Any]:
    """The served responses, after checking each used exactly what it reserved (prompt + max_tokens):
    the precondition that makes `budget // per_request` the exact number a budget admits."""
    assert all(r.usage.total_tokens == per_request and r.choices[0].finish_reason == "length" for r in served), (
        [(r.usage.total_tokens, r.choices[0].finish_reason) for r in served if r.usage.total_tokens != per_request])
    return served


async def test_200_concurrent_requests_never_overspend_a_key(gw: Gateway, client_for: Any) -> None:
    per_request = await prompt_tokens(client_for((await gw.new_key())["key"], gw)) + 4  # measured on another key
    key = await gw.new_key()
    client = client_for(key["key"], gw)
    budget = 20 * per_request
    await set_limits(gw, f"/admin/keys/{key['id']}", {"monthly_tokens": budget})

    results = await fire(client, 200)
    ok = full([r for r in results if not isinstance(r, Exception)], per_request)
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(ok) == budget // per_request  # exactly: not one more, not one fewer
    assert len(refused) == 200 - len(ok)
    for exc in refused:
        assert exc.status_code == 429
        body = exc.response.json()["error"]
        assert body["type"] == "insufficient_quota" and body["code"] == "monthly_tokens"
        assert "monthly_tokens" in body["message"]
        assert int(exc.response.headers["retry-after"]) > 0
    c = await settled(gw, "key", key["id"])
    await gw.flush_ledger()
    count, tokens = await ledger_tokens(gw, "key_id", key["id"])
    assert count == len(ok)  # one row per admitted request, none for a refusal
    assert tokens == len(ok) * per_request == budget
    assert c["month_tokens"] == tokens


async def test_account_limit_shared_by_five_keys(gw: Gateway, client_for: Any) -> None:
    per_request = await prompt_tokens(client_for((await gw.new_key())["key"], gw)) + 4  # another account
    account = await gw.new_account()
    keys = [await gw.new_key(account["id"]) for _ in range(5)]
    budget = 12 * per_request
    await set_limits(gw, f"/admin/accounts/{account['id']}", {"monthly_tokens": budget})
    batches = await asyncio.gather(*[fire(client_for(k["key"], gw), 20) for k in keys])
    results = [r for batch in batches for r in batch]
    ok = full([r for r in results if not isinstance(r, Exception)], per_request)
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(ok) == budget // per_request  # across the five keys, exactly
    assert all(r.status_code == 429 and r.response.json()["error"]["code"] == "monthly_tokens" for r in refused)
    c = await settled(gw, "account", account["id"])
    await gw.flush_ledger()
    count, tokens = await ledger_tokens(gw, "account_id", account["id"])
    assert count == len(ok) and tokens == budget
    assert c["month_tokens"] == tokens


async def test_max_concurrent_holds_and_disconnect_releases(gw: Gateway, client_for: Any) -> None:
    key = await gw.new_key()
    await set_limits(gw, f"/admin/keys/{key['id']}", {"max_concurrent": 2})
    client = client_for(key["key"], gw)
    long = [{"role": "user", "content": "Write a long poem about rivers."}]
    streams = [await client.chat.completions.create(model=MODEL, messages=long, max_tokens=300, stream=True) for _ in range(2)]
    for s in streams:
        await anext(aiter(s))
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
    err = info.value.response.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "max_concurrent"
    assert info.value.response.headers["retry-after"] == "1"
    for s in streams:
        await s.close()  # client disconnect: cancelled rows, reservations released
    c = await settled(gw, "key", key["id"])
    assert c["in_flight"] == 0
    await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
    assert await gw.ledger_count(key_id=key["id"], status="cancelled") == 2


async def test_rpm_limit_and_ratelimit_headers(gw: Gateway, customer: dict[str, Any] | None = None) -> None:
    key = await gw.new_key()
    await set_limits(gw, f"/admin/keys/{key['id']}", {"rpm": 2, "tpm": 100_000})
    await minute_with_room(20)  # the three requests in one minute's window
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2}
        first = await c.post("/chat/completions", json=body)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(first.headers["x-ratelimit-remaining-tokens"]) < 100000
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        assert (await c.post("/chat/completions", json=body)).status_code == 200
        third = await c.post("/chat/completions", json=body)
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "rpm"
        assert 1 <= int(third.headers["retry-after"]) <= 60
        assert third.headers["x-ratelimit-remaining-requests"] == "0"


async def test_a_limits_change_mid_minute_keeps_the_requests_running_in_its_window(gw: Gateway, client_for: Any) -> None:
    """rpm 4 with 4 streams admitted and running, then raised to 5 in the same minute: one more is
    admitted, not five. The change rebuilds the counters from the ledger, which has no rows for the
    running requests yet: the in-process limiter took this minute's window from the ledger too and
    admitted 5 more (9 against 5) while Redis kept its rpm key (a limits audit; seed.lua)."""
    key = await gw.new_key()
    client = client_for(key["key"], gw)
    await set_limits(gw, f"/admin/keys/{key['id']}", {"rpm": 4})
    await minute_with_room(45)  # the streams and the requests after the change in one minute's window
    streams = [await client.chat.completions.create(model=MODEL, messages=FILL, max_tokens=200, stream=True) for _ in range(4)]
    for s in streams:
        await anext(aiter(s))
    await set_limits(gw, f"/admin/keys/{key['id']}", {"rpm": 5})
    admitted = 0
    for _ in range(3):
        try:
            await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)
            admitted += 1
        except openai.RateLimitError as exc:
            assert exc.response.json()["error"]["code"] == "rpm"
    for s in streams:
        await s.close()
    assert admitted == 1


async def test_a_limit_cleared_and_set_again_by_another_process_counts_the_usage_in_between(gw: Gateway, client_for: Any) -> None:
    """`tollgate keys limits` (another process: the gateway is not told) clears a key's monthly
    budget, requests run unlimited, then it sets the same budget again: those requests count. An
    unlimited scope takes no holds and settles nothing, so its counters stood still meanwhile; the
    gateway now rebuilds them when its key cache reads limits other than those it served
    (KeyStore.on_limits_changed). Before, 7 of 10 requests were admitted after the limit came back,
    820 tokens against 410 (a limits audit), on every backend."""
    from tests import cli_runner

    key = await gw.new_key()
    client = client_for(key["key"], gw)
    per = await prompt_tokens(client, PROMPT) + 1  # a request below: its prompt and at most 1 token
    budget = 10 * per
    env = {**os.environ, "DATABASE_URL": gw.db_url, "TOLLGATE_SECRET": SECRET}

    def cli(*argv: str) -> None:
        done = cli_runner.tollgate(["keys", "limits", str(key["id"]), *argv], env)
        assert done.returncode == 0, done.stderr

    async def budget_seen(limited: bool) -> None:
        """Until a request holding more than the whole budget is refused (the limit seen) or admitted."""
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=budget, temperature=0)
                seen = not limited
            except openai.RateLimitError:
                seen = limited
            if seen:
                return
            assert time.monotonic() < deadline, f"the gateway did not see the limit {'set' if limited else 'cleared'}"
            await asyncio.sleep(0.1)

    async def admitted(n: int) -> int:
        done = 0
        for _ in range(n):
            try:
                await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1, temperature=0)
                done += 1
            except openai.RateLimitError as exc:
                assert exc.response.json()["error"]["code"] == "monthly_tokens"
        return done

    cli("--monthly-tokens", str(budget))
    await budget_seen(limited=True)
    assert await admitted(3) == 3
    cli("--clear", "monthly_tokens")
    await budget_seen(limited=False)
    assert await admitted(10) == 10  # past the budget, while there is none
    await gw.flush_ledger()
    cli("--monthly-tokens", str(budget))
    await budget_seen(limited=True)
    assert await admitted(3) == 0


@pytest.mark.parametrize("limited_first", [None, "account"])
async def test_a_limit_set_while_unlimited_requests_run_counts_them_when_they_end(gw: Gateway, client_for: Any,
                                                                                 limited_first: str | None) -> None:
    """An account with no limits (or one whose key has none: its requests hold on the account
    alone) runs 3 long streams; a monthly budget is set meanwhile on the scope without one. The
    counters are rebuilt from the ledger at the next admission, which has no rows of the streams
    yet, and the streams took no hold there: they now settle their usage on the newly limited scope
    too when they end (Meter.hold_now), so the month's counter equals the ledger. Before, it missed
    them until the next rebuild: a spend audit set a $0.01 budget during 30 streams and the
    account went on to $0.016."""
    account = await gw.new_account()
    key = await gw.new_key(account["id"])
    client = client_for(key["key"], gw)
    if limited_first == "account":
        await set_limits(gw, f"/admin/accounts/{account['id']}", {"monthly_tokens": 1_000_000})
    scope, path = ("account", f"/admin/accounts/{account['id']}") if limited_first is None else ("key", f"/admin/keys/{key['id']}")
    streams = [await client.chat.completions.create(model=MODEL, messages=FILL, max_tokens=40, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}) for _ in range(3)]
    for s in streams:
        await anext(aiter(s))  # admitted, running, no hold (nothing was limited)
    await set_limits(gw, path, {"monthly_tokens": 1_000_000})
    await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1)  # the rebuild: the ledger without the streams
    for s in streams:
        async for _ in s:
            pass
    _rows, tokens = await ledger_tokens(gw, "account_id", account["id"], rows=4)
    assert (await settled(gw, scope, account["id"] if scope == "account" else key["id"]))["month_tokens"] == tokens
    if scope == "key":
        assert (await settled(gw, "account", account["id"]))["month_tokens"] == tokens  # held there all along


class GatedEngine(FakeEngine):
    """Streams each request's first token, then waits for `gate` (set from any thread) before the rest."""

    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.gate = threading.Event()

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        first = True
        async for out in super().stream(request):
            yield out
            if first:
                first = False
                await asyncio.to_thread(self.gate.wait, 60)


async def test_a_limit_set_elsewhere_counts_running_requests_of_a_key_this_gateway_hears_no_more_of(
    fresh_pg_database: Any, tmp_path: Path
) -> None:
    """Two gateways on one Redis. A runs 3 streams of an account with no limits (no holds); a budget
    is set on the account through B and B serves one request of it (the counters rebuilt from the
    ledger, which has no rows of the streams yet). A is asked nothing more of the key, so its key
    cache never reads the new limits; its limits recheck (the keys of running requests without a
    hold on both scopes, every key cache time) does: the streams settle on the account when they
    end, and the counters are rebuilt at the next admission if the recheck came after B's rebuild,
    so the counters the next request is admitted against equal the ledger. Before, they missed the
    streams (the edge the last change left open: a gateway that serves no request of the key
    meanwhile)."""
    require_redis(REDIS_URL)
    db_url = fresh_pg_database(migrated=True)
    redis = {"url": REDIS_URL, "prefix": f"tgtest:{uuid.uuid4().hex[:8]}:", "timeout": 0.25}
    gated = GatedEngine("gated")
    server_a, a = start_gateway(db_url, gated, tmp_path / "a", redis=redis)  # type: ignore[arg-type]
    server_b, b = start_gateway(db_url, FakeEngine("gated"), tmp_path / "b", redis=redis)  # type: ignore[arg-type]
    try:
        account = await a.new_account()
        key = await a.new_key(account["id"])
        on_a, on_b = (openai.AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0, timeout=60) for gw in (a, b))
        streams = [await on_a.chat.completions.create(model="gated", messages=PROMPT, max_tokens=5, stream=True,
                                                      stream_options={"include_usage": True}) for _ in range(3)]
        for s in streams:
            await anext(aiter(s))  # admitted, running, no hold (nothing was limited)
        await set_limits(b, f"/admin/accounts/{account['id']}", {"monthly_tokens": 1_000_000})
        await on_b.chat.completions.create(model="gated", messages=PROMPT, max_tokens=1)  # the rebuild, on B
        meter = a.app.state.service.meter
        deadline = time.monotonic() + 10
        while ("account", account["id"]) not in meter._limits_now and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # A's recheck; the counters below say whether it came in time
        gated.gate.set()
        for s in streams:
            async for _ in s:
                pass
        await a.flush_ledger()
        # The next admission: the counters it admits against (rebuilt there if A's recheck came after B's).
        await on_b.chat.completions.create(model="gated", messages=PROMPT, max_tokens=1)
        await b.flush_ledger()
        _rows, tokens = await ledger_tokens(a, "account_id", account["id"], rows=5)
        assert (await settled(a, "account", account["id"]))["month_tokens"] == tokens
    finally:
        gated.gate.set()
        stop_server(server_a)
        stop_server(server_b)


async def test_rpm_set_again_in_the_minute_it_was_cleared_counts_the_requests_in_between(gw: Gateway) -> None:
    """rpm 3, 2 requests, the limit cleared, 5 requests (no holds), rpm 3 again in the same minute:
    the minute has 7 requests, so none more. The rebuild takes the larger of the kept window (from
    before the clear) and the ledger's minute, per count; keeping the window alone admitted 1 (a
    review of the change that kept it)."""
    key = await gw.new_key()
    path = f"/admin/keys/{key['id']}"
    await minute_with_room(30)
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 1}

        async def answers(n: int) -> list[int]:
            return [(await c.post("/chat/completions", json=body)).status_code for _ in range(n)]

        await set_limits(gw, path, {"rpm": 3})
        assert await answers(2) == [200, 200]
        await set_limits(gw, path, {"rpm": None})
        assert await answers(5) == [200] * 5
        await gw.flush_ledger()
        await set_limits(gw, path, {"rpm": 3})
        assert await answers(2) == [429, 429]


async def test_spend_budget_reached_at_exact_decimal_price(gw: Gateway, client_for: Any) -> None:
    model_price = {"model": MODEL, "input_per_million": "1.250", "output_per_million": "2.500"}
    async with gw.admin_client() as admin:
        r = await admin.post("/admin/prices", json=model_price)
        assert r.status_code == 201, r.text
        assert (await admin.post("/admin/prices", json={**model_price, "input_per_million": 0.1})).status_code == 400
        assert (await admin.post("/admin/prices", json={**model_price, "input_per_million": "0.0001"})).status_code == 400
    await price_in_force(gw, MODEL, "1.250")
    key = await gw.new_key()
    client = client_for(key["key"], gw)
    p = await prompt_tokens(client, PROMPT)  # 1 completion token
    cost = p * 1250 + 1 * 2500  # nano-USD at $1.25/M in, $2.50/M out
    budget = Decimal(cost * 4) / Decimal(10**9)
    await set_limits(gw, f"/admin/keys/{key['id']}", {"monthly_spend": str(budget)})
    results = await fire(client, 6, max_tokens=1, messages=PROMPT)
    ok = [r for r in results if not isinstance(r, Exception)]
    assert len(ok) == 3  # 1 before the limit + 3 = 4 * cost exactly; the rest are refused
    assert all(r.status_code == 429 and r.response.json()["error"]["type"] == "insufficient_quota" for r in results if isinstance(r, Exception))
    c = await settled(gw, "key", key["id"])
    assert c["month_nanos"] == 4 * cost
    deadline = time.monotonic() + 10
    while await gw.ledger_count(key_id=key["id"]) < 4:  # settled counters do not mean the rows' batch has landed
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            costs = (await conn.execute(sa.text("SELECT cost_nanos FROM ledger_entries WHERE key_id = :k"), {"k": key["id"]})).scalars().all()
    finally:
        await db.dispose()
    assert costs == [cost] * 4


async def test_limit_changes_are_validated(gw: Gateway) -> None:
    key = await gw.new_key()
    async with gw.admin_client() as admin:
        for bad in ({"rpm": -5}, {"rpm": "x"}, {"monthly_spend": 3.5}, {"unknown": 1}):
            r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith("limits")
        assert (await admin.patch(f"/admin/keys/{key['id']}", json={"limits": "no"})).status_code == 400
        assert (await admin.patch("/admin/keys/99999", json={"limits": {"rpm": 1}})).status_code == 404
        assert (await admin.patch("/admin/accounts/99999", json={"limits": {"rpm": 1}})).status_code == 404
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"rpm": 5, "monthly_spend": "10.5"}})
        assert r.json()["limits"] == {"rpm": 5, "monthly_spend": "10.5"}
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"rpm": None}})
        assert r.json()["limits"] == {"monthly_spend": "10.5"}


HOLD = 2.0  # seconds: the shortest hold the settings take is 1


@pytest.fixture(scope="module", params=["memory", "redis"])
def short_hold(request: pytest.FixtureRequest, engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A gateway whose quota holds last HOLD seconds unless renewed (in-process limiter, Redis)."""
    groups: dict[str, Any] = {"quotas": {"hold_seconds": HOLD}}
    if request.param == "redis":
        require_redis(REDIS_URL)
        groups["redis"] = {"url": REDIS_URL, "prefix": f"tgtest:{uuid.uuid4().hex[:8]}:", "timeout": 0.25}
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-hold"), **groups)
    try:
        yield gw
    finally:
        stop_server(server)


async def test_a_request_running_past_the_hold_time_keeps_its_place(short_hold: Gateway, client_for: Any) -> None:
    """A stream that outlives the hold time still holds its reservation: with max_concurrent 1, a
    second request is refused until the first ends (before renewal, its hold expired under it)."""
    gw = short_hold
    key = await gw.new_key()
    await set_limits(gw, f"/admin/keys/{key['id']}", {"max_concurrent": 1})
    client = client_for(key["key"], gw)
    stream = await client.chat.completions.create(model=MODEL, messages=FILL, max_tokens=1500, stream=True, temperature=0)
    chunks = aiter(stream)
    await anext(chunks)  # admitted: its hold was taken before this first chunk
    past = time.time() + HOLD + 0.5  # past the hold's first expiry
    async for _ in chunks:
        if time.time() > past:
            break
    else:
        pytest.fail("the stream ended before its hold's first expiry: the test needs a longer one")
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
    assert info.value.response.json()["error"]["code"] == "max_concurrent"
    await stream.close()
    assert (await settled(gw, "key", key["id"]))["in_flight"] == 0
    await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
