"""The chaos run across processes (issue 24; docs/reliability.md): three `tollgate serve` processes on
one Postgres and a local Redis Cluster (3 masters + 3 replicas; private ones: this test stops them),
300 concurrent requests from 5 keys of one account against the account's monthly token budget,
while one gateway is SIGKILLed, Postgres is restarted, the Redis master that owns the account's hash
slot is killed (its replica cut off first, so its last writes are really lost; the replica takes
over) and the killed gateway starts again. After: the ledger's tokens are within the budget, every
answered request has exactly one `completed` row with the usage its client saw, every request cut
mid-stream one `interrupted`/`cancelled` row (`completed` where the SIGKILL fell between journaling
the row and sending the end: docs/reliability.md), no quota hold is left, Redis' counters equal the ledger.

The failover comes while rows served during the Postgres outage may still be in the gateways'
journals, and the killed gateway's are in its own until it starts again: the rebuild counts those
rows once (billing/quota/lua/seed.lua: `pend`, and `unc` for the killed gateway's settled usage the
ledger lacks; recover.lua for the restart)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import MODEL
from tests.billing.quota.test_quota_failover import lag_replica
from tests.gateway.serving.test_chaos import KEYS, KILLED, MAX_TOKENS, PROMPT, REQUESTS, check_the_run, probe_each, refused_once_settled, set_up
from tests.processes import GatewayProcess, PrivatePostgres
from tests.redis_topologies import LocalCluster


@dataclass
class Outcome:
    gateway: int
    stream: bool
    status: int = 0
    request_id: str | None = None
    code: str | None = None
    answered: bool = False
    usage: dict[str, int] | None = None
    retried: int = 0  # 503s retried before this outcome
    earlier: list[tuple[int, str | None, str | None]] = field(default_factory=list)  # those 503s: (status, code, request id)


async def one(client: httpx.AsyncClient, key: str, stream: bool, out: Outcome) -> None:
    """One request, retried as the SDKs retry a 503 (with Retry-After): while a failover is being
    recovered from, the account's admissions wait up to 3 s for every gateway to re-register."""
    for attempt in range(40):
        await attempt_once(client, key, stream, out)
        if out.status != 503:
            return
        out.retried = attempt + 1
        out.earlier.append((out.status, out.code, out.request_id))
        await asyncio.sleep(0.25)  # a client's backoff, not a synchronization


async def attempt_once(client: httpx.AsyncClient, key: str, stream: bool, out: Outcome) -> None:
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


async def test_three_gateways_sigkill_postgres_restart_and_redis_failover_under_a_shared_budget(tmp_path: Path) -> None:
    pg = PrivatePostgres()
    pg.start()
    cluster = LocalCluster(tmp_path / "redis-cluster").start()
    gws: list[GatewayProcess] = []
    try:
        run = await set_up(pg, cluster.url, tmp_path, gws, 150, one, Outcome)
        url, prefix, account, keys, clients, warm, budget = (run.url, run.prefix, run.account, run.keys, run.clients, run.warm, run.budget)

        # Four waves, so that admissions go on through every fault: the first at the start, the second
        # while a gateway is dead and Postgres down, the third (20) once the account's master is cut off
        # from its replica (what it takes then is lost in the failover: the earlier waves may all be
        # done by then), the fourth after the failover; the budget runs out in the fourth (its refusals
        # come from the rebuilt counters: an undercount would overspend).
        rng = random.Random(24)
        out = [Outcome(i % 3, rng.random() < 0.5) for i in range(REQUESTS)]
        waves = [asyncio.Event() for _ in range(4)]
        starts = (0, 60, 120, 140)  # each wave's first request

        async def when(wave: int, i: int, o: Outcome) -> None:
            await waves[wave].wait()
            await one(clients[o.gateway], keys[i % KEYS]["key"], o.stream, o)

        tasks = [asyncio.create_task(when(sum(i >= s for s in starts) - 1, i, o)) for i, o in enumerate(out)]

        async def until(pred: Any, timeout: float = 150.0) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                if time.monotonic() >= deadline:
                    seen = sorted(Counter((o.status, o.code, o.answered) for o in out).items(), key=str)
                    logs = "\n".join(line for g in gws for line in g.log_text().splitlines() if "WARNING" in line or "ERROR" in line)
                    raise AssertionError(f"the run stalled: (status, code, answered) {seen}\n{logs[-3000:]}")
                await asyncio.sleep(0.05)

        def answers() -> int:
            return sum(o.answered for o in out)

        waves[0].set()
        await until(lambda: answers() >= 20)
        pg.stop("immediate")
        stopped_at = answers()
        waves[1].set()
        # Served on while Postgres is down (rows in the journals), by the gateway about to die too.
        await until(lambda: answers() >= stopped_at + 10 and any(o.answered for o in out[60:120] if o.gateway == 1))
        gws[KILLED].kill()  # SIGKILL under load, its rows of the outage in its journal only
        pg.start()
        # The Redis master of the account's slot, with its last writes lost, while the killed gateway
        # is still down and the others' journals may still hold rows of the outage.
        group_key = f"{prefix}{{a{account['id']}}}:epoch"
        victim = cluster.master_of(group_key)
        lag_replica(victim)
        lagged_at = answers()
        waves[2].set()
        await until(lambda: answers() >= lagged_at + 3)
        cluster.kill(victim)
        await asyncio.to_thread(cluster.wait_failover, victim, group_key)
        failed_over_at = answers()
        waves[3].set()
        await until(lambda: answers() >= failed_over_at + 5)  # admitted and served after the failover
        await asyncio.to_thread(gws[KILLED].start, 300.0)  # the same data dir: replays its journal, releases its holds
        await asyncio.gather(*tasks)
        out += await probe_each(clients, keys[0]["key"], one, Outcome)  # the restarted gateway's recovery
        out += await refused_once_settled(clients[0], keys[0]["key"], cluster.url, prefix, url, account["id"], one, Outcome)
        for c in clients:
            await c.aclose()

        figures = await check_the_run(url, cluster.url, prefix, account["id"], [k["id"] for k in keys], warm, out, budget)
        print(f"\nchaos (Redis Cluster, master {victim} killed): {figures}")
    finally:
        for g in gws:
            g.stop()
        cluster.stop()
        pg.destroy()
