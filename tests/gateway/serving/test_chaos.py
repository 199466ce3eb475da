"""The chaos run across processes (issue 24; docs/reliability.md): three `tollgate serve` processes on
one Postgres and one Redis (private ones: this test stops them), 300 concurrent requests from 5 keys
of one account against the account's monthly token budget, while one gateway is SIGKILLed and
started again and Postgres is restarted. After: the ledger's tokens are within the budget, every
answered request has exactly one `completed` row with the usage its client saw, every request cut
mid-stream one `interrupted`/`cancelled` row (`completed` where the SIGKILL fell between journaling
the row and sending the end: docs/reliability.md), no quota hold is left, Redis' counters equal the ledger.

The Redis Cluster variant with the account's master killed under it is
tests/gateway/serving/test_chaos_cluster.py; the cluster failover under load is
tests/billing/quota/test_quota_failover.py, a rebuild's exactness tests/billing/quota/test_quota_rebuild.py."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from billing.db import create_engine
from billing.quota.limits import Limits
from billing.quota import LedgerTotals, RedisLimiter, Scope
from tests.conftest import MODEL, SECRET, bootstrap
from tests.gateway.serving.test_durable_metering import ledger_ids
from tests.gateway.serving.test_quota_redis_failures import RedisServer
from tests.processes import GatewayProcess, PrivatePostgres

REQUESTS = 300
KEYS = 5
MAX_TOKENS = 4
KILLED = 1  # the gateway each run SIGKILLs (gws[1])
PROMPT = [{"role": "user", "content": "Say yes."}]


@dataclass
class Outcome:
    gateway: int
    stream: bool
    status: int = 0
    request_id: str | None = None
    code: str | None = None
    answered: bool = False
    usage: dict[str, int] | None = None


async def one(client: httpx.AsyncClient, key: str, stream: bool, out: Outcome) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            out.status, out.request_id = r.status_code, r.headers.get("x-request-id")
            if r.status_code != 200:
                out.code = json.loads(await r.aread())["error"]["code"]
                return
            if not stream:
                out.usage, out.answered = json.loads(await r.aread())["usage"], True
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out.answered = True
                elif line.startswith("data: {"):
                    out.usage = json.loads(line[6:]).get("usage") or out.usage
    except httpx.HTTPError:
        return  # the gateway died under it: status 0 (nothing came) or 200 without the end


async def account_counters(redis_url: str, prefix: str, db_url: str, account_id: int) -> dict[str, Any]:
    db = create_engine(db_url)
    lim = RedisLimiter(redis_url, LedgerTotals(db), prefix=prefix, timeout=1.0)
    try:
        counters: dict[str, Any] = await lim.counters(Scope("account", account_id, Limits()))
        # Settled usage still filed as not written (billing/quota/redis_limiter.py: `unc`).
        counters["unc"] = {str(rid) for rid in await lim._redis.hkeys(lim.group(f"a{account_id}") + "unc")}
        return counters
    finally:
        await lim.close()
        await db.dispose()


async def probe_each(clients: list[httpx.AsyncClient], key: str, one: Callable[..., Awaitable[None]],
                     outcome: Callable[[int, bool], Any]) -> list[Any]:
    """One more request on each gateway once a run is over: a reservation is what finds a group still
    to rebuild (a restarted gateway's recovery, a failover, or a settlement Redis did not take bumps
    the group's epoch, and usage settled after that waits in `pend` until the rebuild); the budget is
    spent, so each ends refused. A 503 while the group recovers is tried again."""
    probes = [outcome(i, False) for i in range(len(clients))]
    for o in probes:
        deadline = time.monotonic() + 60
        while True:
            await one(clients[o.gateway], key, False, o)
            if o.status in (200, 429):
                break
            assert time.monotonic() < deadline, (o.status, o.code)
            await asyncio.sleep(0.5)  # a retry's pause, as the SDKs take
    return probes


async def refused_once_settled(client: httpx.AsyncClient, key: str, redis_url: str, prefix: str, db_url: str, account_id: int,
                               one: Callable[..., Awaitable[None]], outcome: Callable[[int, bool], Any]) -> list[Any]:
    """Requests on one gateway, each once the account holds nothing, until one is refused for the
    budget: a refusal with no hold outstanding says the budget is spent (what is left is less than one
    request's worst case), not merely reserved by requests still settling."""
    probes: list[Any] = []
    for _ in range(20):
        deadline = time.monotonic() + 60
        while (await account_counters(redis_url, prefix, db_url, account_id))["in_flight"]:
            assert time.monotonic() < deadline, "holds outstanding a minute after the run"
            await asyncio.sleep(0.1)
        o = outcome(0, False)
        await one(client, key, False, o)
        probes.append(o)
        if o.status not in (200, 429):  # a 503 while a group recovers: asked again, as probe_each does
            assert time.monotonic() < deadline, (o.status, o.code)
            await asyncio.sleep(0.5)
            continue
        if o.status == 429:
            assert o.code == "monthly_tokens", o.code
            return probes
    raise AssertionError(f"still served after {len(probes)} requests past the run: the budget was not spent")


async def check_the_run(db_url: str, redis_url: str, prefix: str, account_id: int, key_ids: list[int],
                        warm: list[Any], out: list[Any], budget: int) -> str:
    """What every chaos run checks once its requests are done (tests/gateway/serving/test_chaos_cluster.py too);
    returns its figures as one line."""
    answered = [o for o in [*warm, *out] if o.answered]
    cut = [o for o in out if o.status == 200 and not o.answered]
    refused = [o for o in out if o.status not in (0, 200)]
    assert {o.code for o in refused} <= {"monthly_tokens", "database_unavailable", "quota_unavailable"}, {o.code for o in refused}
    deadline = time.monotonic() + 120
    while True:  # rows reach Postgres from the journals and the restarted gateway's replay
        rows: dict[str, dict[str, Any]] = {}
        for key_id in key_ids:
            rows.update(await ledger_ids(db_url, key_id))
        counters = await account_counters(redis_url, prefix, db_url, account_id)
        if {o.request_id for o in answered + cut} <= set(rows) and counters["in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"rows or holds outstanding: {counters}"
        await asyncio.sleep(0.25)

    for o in answered:
        row = rows[o.request_id]
        assert row["status"] == "completed", row
        assert (row["prompt_tokens"], row["completion_tokens"]) == (o.usage["prompt_tokens"], o.usage["completion_tokens"])
    # The row is journaled before the end goes out (docs/reliability.md): a request the SIGKILL cut
    # between the two has a `completed` row its client never saw the end of, on the killed gateway
    # only, and with the whole answer's usage (the prompt is one, at temperature 0: an answered one's).
    whole = {(o.usage["prompt_tokens"], o.usage["completion_tokens"]) for o in answered}

    def unseen_end(row: dict[str, Any]) -> bool:
        return row["status"] == "completed" and (row["prompt_tokens"], row["completion_tokens"]) in whole

    for o in cut:
        row = rows[o.request_id]
        assert row["status"] in ("interrupted", "cancelled") or (unseen_end(row) and o.gateway == KILLED), (o, row, whole)
    extra = set(rows) - {o.request_id for o in [*warm, *out] if o.status == 200}
    odd = sorted((rows[r]["status"], r, rows[r]["prompt_tokens"], rows[r]["completion_tokens"])
                 for r in extra if not (rows[r]["status"] == "interrupted" or unseen_end(rows[r])))
    assert not odd, (f"rows of no request answered 200, neither 'interrupted' nor a whole answer's 'completed' {whole}: {odd}; attempts: "
                     f"{[(o.status, o.code, o.request_id, getattr(o, 'earlier', None)) for o in out if o.status == 0 or getattr(o, 'earlier', None)]}")
    assert len(extra) <= sum(1 for o in out if o.status == 0)
    # a `completed` one: a JSON body whose row was journaled when its gateway died, before the body went out
    unsent = sum(1 for o in out if o.status == 0 and not o.stream and o.gateway == KILLED)
    assert sum(rows[r]["status"] == "completed" for r in extra) <= unsent, sorted((rows[r]["status"], r) for r in extra)
    tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
    allowed = budget + sum(o.usage["total_tokens"] for o in warm)
    assert tokens <= allowed  # the shared budget held
    # ... and was spent: requests were refused for it, the last with nothing held (refused_once_settled),
    # so what is left is less than one request's worst case (its prompt and MAX_TOKENS).
    assert any(o.code == "monthly_tokens" for o in refused), sorted({o.code for o in refused})
    assert out[-1].code == "monthly_tokens", (out[-1].status, out[-1].code)
    worst = max(r["prompt_tokens"] for r in rows.values()) + MAX_TOKENS
    assert allowed - worst < tokens, f"{tokens} tokens spent of {allowed}: more than one request's worst case ({worst}) left unspent"
    assert counters["month_tokens"] == tokens and counters["in_flight"] == 0, (counters, tokens)
    # What `unc` still holds is usage whose row is in the ledger: the live gateways strike theirs off
    # within a second or two; the killed one's strike-offs that never went out stay until the group's
    # next rebuild, which counts such an entry from the ledger, once, and strikes it off.
    assert counters["unc"] <= set(rows), counters["unc"] - set(rows)
    return (f"{len(answered) - len(warm)} answered, {len(cut)} cut mid-stream, {len(refused)} refused "
            f"({sorted({o.code for o in refused})}), {sum(o.status == 0 for o in out)} lost with the killed gateway; "
            f"{len(rows)} rows ({len(extra)} interrupted before their first byte); tokens {tokens} of {allowed}; "
            f"Redis month {counters['month_tokens']}, holds {counters['in_flight']}, unc {len(counters['unc'])} (rows in the ledger)")


@dataclass
class Chaos:
    """A chaos run's set-up: three gateways on one Postgres database and one Redis, an account with
    KEYS keys known to every gateway (a warm-up request each), and its monthly token budget."""

    url: str
    prefix: str
    account: dict[str, Any]
    keys: list[dict[str, Any]]
    clients: list[httpx.AsyncClient]
    warm: list[Any]
    budget: int


async def set_up(pg: PrivatePostgres, redis_url: str, tmp_path: Path, gws: list[GatewayProcess], worst_cases: int,
                 one: Callable[..., Awaitable[None]], outcome: Callable[[int, bool], Any]) -> Chaos:
    """Starts the gateways (appended to `gws`, which the caller stops) and sets a budget of
    `worst_cases` requests at their worst case on top of the warm-up's usage."""
    url = pg.create_database("tollgate")
    admin_key = bootstrap(url, SECRET)
    prefix = f"tgchaos:{uuid.uuid4().hex[:8]}:"
    env = {"REDIS_URL": redis_url, "TOLLGATE_REDIS_PREFIX": prefix, "TOLLGATE_SCHEDULER_CLASSES": "interactive:600,batch:3600"}
    gws += [GatewayProcess(url, tmp_path / f"gw{i}", admin_key, **env) for i in range(3)]
    await asyncio.gather(*(asyncio.to_thread(g.start, 300.0) for g in gws))
    async with gws[0].admin() as a:
        account = (await a.post("/admin/accounts", json={"name": "chaos"})).json()
        keys = [(await a.post("/admin/keys", json={"account_id": account["id"]})).json() for _ in range(KEYS)]
    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    clients = [httpx.AsyncClient(base_url=g.base_url, timeout=300, limits=limits) for g in gws]
    warm = [outcome(i, False) for i in range(3) for _ in range(KEYS)]  # every key known to every gateway
    await asyncio.gather(*(one(clients[o.gateway], keys[n % KEYS]["key"], False, o) for n, o in enumerate(warm)))
    assert all(o.status == 200 for o in warm), [(o.status, o.code) for o in warm]
    budget = worst_cases * (warm[0].usage["prompt_tokens"] + MAX_TOKENS)  # room for fewer than the 300 at their worst case
    async with gws[0].admin() as a:
        r = await a.patch(f"/admin/accounts/{account['id']}", json={"limits": {"monthly_tokens": budget + sum(o.usage["total_tokens"] for o in warm)}})
        assert r.status_code == 200, r.text
    return Chaos(url, prefix, account, keys, clients, warm, budget)


async def test_three_gateways_sigkill_and_postgres_restart_under_a_shared_budget(tmp_path: Path) -> None:
    pg = PrivatePostgres()
    pg.start()
    redis = RedisServer(tmp_path)
    redis.start()
    gws: list[GatewayProcess] = []
    try:
        run = await set_up(pg, redis.url, tmp_path, gws, 120, one, Outcome)
        url, prefix, account, keys, clients, warm, budget = (run.url, run.prefix, run.account, run.keys, run.clients, run.warm, run.budget)

        rng = random.Random(24)
        out = [Outcome(i % 3, rng.random() < 0.5) for i in range(REQUESTS)]
        tasks = [asyncio.create_task(one(clients[o.gateway], keys[i % KEYS]["key"], o.stream, o)) for i, o in enumerate(out)]

        async def until(pred: Any, timeout: float = 300.0) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline, "the run stalled"
                await asyncio.sleep(0.05)

        await until(lambda: sum(o.answered for o in out) >= 20)
        gws[KILLED].kill()  # SIGKILL under load
        killed_at_answered = sum(o.answered for o in out)
        pg.stop("immediate")
        await until(lambda: sum(o.answered for o in out) >= killed_at_answered + 10)  # served on while Postgres is down
        pg.start()
        await asyncio.to_thread(gws[KILLED].start, 300.0)  # the same data dir: replays its journal, releases its holds
        await asyncio.gather(*tasks)
        out += await probe_each(clients, keys[0]["key"], one, Outcome)
        out += await refused_once_settled(clients[0], keys[0]["key"], redis.url, prefix, url, account["id"], one, Outcome)
        for c in clients:
            await c.aclose()

        print("\nchaos: " + await check_the_run(url, redis.url, prefix, account["id"], [k["id"] for k in keys], warm, out, budget))
    finally:
        for g in gws:
            g.stop()
        redis.kill()
        pg.destroy()
