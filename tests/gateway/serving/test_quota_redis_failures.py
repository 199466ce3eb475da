"""Redis failures and several gateways: fail-closed refuses fast, fail-open keeps serving, counters
are rebuilt from the ledger after a restart, and two gateway processes share budgets exactly."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, SECRET, Gateway, missing, start_gateway, stop_server
from tests.gateway.serving.test_quotas import fire, full, ledger_tokens, prompt_tokens, set_limits, settled

PROMPT = [{"role": "user", "content": "Say yes."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private redis-server this test may kill and restart (never the shared one)."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.tmp = tmp
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if shutil.which("redis-server") is None:
            missing("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


async def post_chat(gw: Gateway, key: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        return await c.post("/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": 3, "temperature": 0})


async def quota_store(gw: Gateway) -> tuple[int, str]:
    """/readyz's status and what it says of the quota store."""
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as c:
        ready = await c.get("/readyz")
        return ready.status_code, ready.json().get("quota_store")


async def wait_rows(gw: Gateway, key_id: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while await gw.ledger_count(key_id=key_id) < n:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_redis_killed_fail_closed_and_fail_open_then_rebuilt(
    private_redis: RedisServer, engine: Any, fresh_pg_database: Any, tmp_path: Path
) -> None:
    db_url = fresh_pg_database(migrated=True)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    common = dict(redis={"url": private_redis.url, "prefix": prefix})  # default 50 ms Redis timeout
    closed_srv, closed = start_gateway(db_url, engine, tmp_path / "closed", **common)
    open_srv, opened = start_gateway(db_url, engine, tmp_path / "open", quotas={"fail_open": True}, **common)
    try:
        key = await closed.new_key()
        await set_limits(closed, f"/admin/keys/{key['id']}", {"monthly_tokens": 1_000_000, "rpm": 1000})
        for gw in (closed, opened):
            assert (await post_chat(gw, key["key"])).status_code == 200

        assert await quota_store(closed) == (200, "reachable")
        private_redis.kill()
        # still ready (each process answers by its fail mode); the body tells monitoring
        assert await quota_store(closed) == await quota_store(opened) == (200, "unreachable")
        started = time.monotonic()
        refused = await post_chat(closed, key["key"])
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "quota_unavailable"
        assert refused.headers["retry-after"]
        assert time.monotonic() - started < 1.0  # never hangs on a dead Redis
        for _ in range(3):
            served = await post_chat(opened, key["key"])
            assert served.status_code == 200  # fail-open keeps serving and meters to the ledger
        refused_fast = time.monotonic()
        assert (await post_chat(closed, key["key"])).status_code == 503
        assert time.monotonic() - refused_fast < 0.5

        private_redis.start()  # empty: every counter is gone
        await wait_rows(closed, key["id"], 5)
        await asyncio.sleep(1.1)  # breaker cool-down
        for gw in (closed, opened):
            assert (await post_chat(gw, key["key"])).status_code == 200
        assert await quota_store(closed) == (200, "reachable")
        await wait_rows(closed, key["id"], 7)
        c = await settled_at(closed, private_redis, prefix, key["id"])
        _count, tokens = await ledger_tokens(closed, "key_id", key["id"])
        assert c["month_tokens"] == tokens  # rebuilt from the ledger, fail-open usage included
    finally:
        stop_server(open_srv)
        stop_server(closed_srv)


async def settled_at(gw: Gateway, redis: RedisServer, prefix: str, key_id: int, scope: tuple[str, int] | None = None) -> dict[str, int]:
    """The counters of the key (or of `scope`, (kind, id)) once none of its requests holds."""
    from billing.db import create_engine
    from billing.quota.limits import Limits
    from billing.quota import LedgerTotals, RedisLimiter, Scope

    db = create_engine(gw.db_url)
    lim = RedisLimiter(redis.url, LedgerTotals(db), prefix=prefix, timeout=1.0)
    try:
        deadline = time.monotonic() + 10
        while True:
            kind, scope_id = scope or ("key", key_id)
            c = await lim.counters(Scope(kind, scope_id, Limits()))
            if c["in_flight"] == 0:
                return c
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await lim.close()
        await db.dispose()


@pytest.fixture
def second_gateway_process(redis_gateway: Gateway, tmp_path: Path) -> Iterator[str]:
    """Another `tollgate serve` process on the same Postgres and Redis as `redis_gateway`."""
    port = free_port()
    env = dict(os.environ)
    env.update(
        DATABASE_URL=redis_gateway.db_url, REDIS_URL=redis_gateway.settings.redis.url or "",
        TOLLGATE_REDIS_PREFIX=redis_gateway.settings.redis.prefix, TOLLGATE_SECRET=SECRET,
        TOLLGATE_PORT=str(port), TOLLGATE_DATA_DIR=str(tmp_path), TOLLGATE_REDIS_TIMEOUT_MS="250",
        TOLLGATE_ADMIN_KEY=redis_gateway.admin_key,
    )
    exe = Path(sys.executable).with_name("tollgate")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(exe), "serve", "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "second gateway did not become ready"
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def test_two_gateway_processes_share_budgets_exactly(
    redis_gateway: Gateway, second_gateway_process: str, client_for: Any
) -> None:
    from dataclasses import replace

    other = replace(redis_gateway, base_url=second_gateway_process)
    per_request = await prompt_tokens(client_for((await redis_gateway.new_key())["key"], redis_gateway)) + 4  # another key
    key = await redis_gateway.new_key()
    budget = 15 * per_request
    await set_limits(redis_gateway, f"/admin/keys/{key['id']}", {"monthly_tokens": budget})
    a, b = await asyncio.gather(fire(client_for(key["key"], redis_gateway), 50), fire(client_for(key["key"], other), 50))
    served = full([r for r in a + b if not isinstance(r, Exception)], per_request)
    assert len(served) == budget // per_request  # exactly, across both processes
    assert all(r.status_code == 429 and r.response.json()["error"]["code"] == "monthly_tokens" for r in a + b if isinstance(r, Exception))
    c = await settled(redis_gateway, "key", key["id"])
    # The other process's rows arrive through its own writer: wait for them before comparing.
    count, tokens = await ledger_tokens(redis_gateway, "key_id", key["id"], rows=len(served))
    assert count == len(served)  # one row per admitted request, across both processes
    assert tokens == budget and c["month_tokens"] == tokens

    # A key revoked through one gateway is refused by both within a second.
    async with redis_gateway.admin_client() as admin:
        assert (await admin.delete(f"/admin/keys/{key['id']}")).status_code == 200
    revoked_at = time.monotonic()
    for gw in (redis_gateway, other):
        while (await post_chat(gw, key["key"])).status_code != 401:
            assert time.monotonic() - revoked_at < 1.5
            await asyncio.sleep(0.05)
    assert time.monotonic() - revoked_at <= 1.5


async def test_redis_restarted_with_requests_in_flight_no_budget_overrun(
    private_redis: RedisServer, engine: Any, fresh_pg_database: Any, tmp_path: Path, client_for: Any
) -> None:
    """Redis keeps nothing on disk here: a restart loses the holds of requests still running. The
    gateway re-registers them before its counters are rebuilt from the ledger (which does not have
    those requests yet), so admissions after the restart cannot spend their budget twice."""
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    srv, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path / "gw", redis={"url": private_redis.url, "prefix": prefix, "timeout": 0.25})
    try:
        count_words = [{"role": "user", "content": "Count from one to fifty in words."}]
        long_tokens = 24
        per_request = await prompt_tokens(client_for((await gw.new_key())["key"], gw), count_words) + long_tokens  # another key
        key = await gw.new_key()
        client = client_for(key["key"], gw)
        budget = 10 * per_request
        await set_limits(gw, f"/admin/keys/{key['id']}", {"monthly_tokens": budget})
        started = asyncio.Event()
        running = 0

        async def long_stream() -> int:
            nonlocal running
            async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=120) as c:
                body = {"model": MODEL, "messages": count_words, "max_tokens": long_tokens, "temperature": 0, "stream": True}
                async with c.stream("POST", "/chat/completions", json=body) as r:
                    running += 1
                    if running == 6:
                        started.set()
                    async for _ in r.aiter_lines():
                        pass
                    return r.status_code

        in_flight = [asyncio.create_task(long_stream()) for _ in range(6)]
        await asyncio.wait_for(started.wait(), 60)
        private_redis.kill()
        private_redis.start()  # empty: every counter and every hold is gone
        after = await fire(client, 10, max_tokens=long_tokens, messages=count_words)
        assert all(s == 200 for s in await asyncio.gather(*in_flight))
        served_after = full([r for r in after if not isinstance(r, Exception)], per_request)
        # Exactly what the budget has left beside the 6 still running (each spends all it reserved).
        assert len(served_after) == (budget - 6 * per_request) // per_request
        assert all(r.status_code == 429 and r.response.json()["error"]["code"] == "monthly_tokens" for r in after if isinstance(r, Exception))
        c = await settled_at(gw, private_redis, prefix, key["id"])
        await gw.flush_ledger()
        count, tokens = await ledger_tokens(gw, "key_id", key["id"])
        assert count == 6 + len(served_after)
        assert tokens == (6 + len(served_after)) * per_request == budget, f"budget {budget}: {tokens} tokens used"
        assert c["month_tokens"] == tokens
    finally:
        stop_server(srv)


async def refuse_writes(redis: RedisServer, refuse: bool) -> None:
    """Out of memory with no eviction (every write refused, nothing lost), or back to normal."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis.url)
    try:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1" if refuse else "0")
    finally:
        await client.aclose()


async def test_a_credit_the_quota_store_does_not_take_is_made_once_and_counted_once_it_answers(
    private_redis: RedisServer, engine: Any, fresh_pg_database: Any, tmp_path: Path
) -> None:
    """An admin's refund while Redis refuses writes: its row is committed, so the answer is 201, not the 503
    that told the admin to retry and so made it twice (a spend audit: two $0.40 refunds, or two
    top-ups, for one). A retry with the same Idempotency-Key gets the first one back (200,
    Idempotent-Replayed) and makes nothing; the same key for another amount is a 409. Redis back
    with its state, the account's counters are rebuilt from the ledger at the next admission, so the
    balance it admits against has the refund (before: the limiter kept $1.00 until a housekeeping
    round, and the refunded $0.40 could be spent)."""
    db_url = fresh_pg_database(migrated=True)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    srv, gw = start_gateway(db_url, engine, tmp_path / "gw", redis={"url": private_redis.url, "prefix": prefix, "timeout": 0.25},
                            credits={"check_seconds": 0})
    try:
        account = await gw.new_account()
        key = await gw.new_key(account["id"])
        credits = f"/admin/accounts/{account['id']}/credits"
        async with gw.admin_client() as admin:
            assert (await admin.put(f"/admin/accounts/{account['id']}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200
            assert (await admin.post(credits, json={"kind": "topup", "amount": "1.00"})).status_code == 201
            assert (await post_chat(gw, key["key"])).status_code == 200  # the balance is in Redis now
            await refuse_writes(private_redis, True)  # OOM: it keeps its state and refuses every write
            made = await admin.post(credits, json={"kind": "refund", "amount": "0.40"}, headers={"Idempotency-Key": "refund-1"})
            assert made.status_code == 201, made.text
            again = await admin.post(credits, json={"kind": "refund", "amount": "0.40"}, headers={"Idempotency-Key": "refund-1"})
            assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
            assert again.json()["id"] == made.json()["id"]
            for other in ({"kind": "refund", "amount": "0.50"}, {"kind": "refund", "amount": "0.40", "reason": "another"}):
                reused = await admin.post(credits, json=other, headers={"Idempotency-Key": "refund-1"})
                assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused", other
            grant = {"kind": "grant", "amount": "0.10", "expires_at": "2030-01-01T00:00:00Z"}
            answers = [(await admin.post(credits, json=body, headers={"Idempotency-Key": "grant-1"})).status_code
                       for body in (grant, grant, {**grant, "expires_at": "2030-01-01T00:00:00+01:00"})]
            assert answers == [201, 200, 409]  # the same instant replays; another expiry is another credit
            entries = (await admin.get(credits)).json()["entries"]
            assert [e["amount_nanos"] for e in entries if e["kind"] == "refund"] == [-400_000_000]
        await refuse_writes(private_redis, False)
        deadline = time.monotonic() + 10
        while (answer := await post_chat(gw, key["key"])).status_code == 503:  # the breaker's cool-down
            assert time.monotonic() < deadline, answer.text
            await asyncio.sleep(0.2)
        assert answer.status_code == 200
        counters = await settled_at(gw, private_redis, prefix, key["id"], scope=("account", account["id"]))
        assert counters["credits_nanos"] == 700_000_000  # $1.00 less the $0.40 refund, and the $0.10 grant
    finally:
        stop_server(srv)
