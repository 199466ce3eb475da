"""Durable metering under faults (docs/reliability.md): Postgres down under load, the gateway
SIGKILLed under load (while Postgres is down too), and the backlog policy.

Postgres here is a private cluster on a free port (tests.processes.PrivatePostgres); the shared one
is never touched. The outage lasts TOLLGATE_TEST_PG_OUTAGE_S seconds (default 6; the issue's
30 s: TOLLGATE_TEST_PG_OUTAGE_S=30)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from billing.quota.limits import Limits
from billing.quota import LedgerTotals, RedisLimiter, Scope
from tests.conftest import MODEL, SECRET, bootstrap, start_gateway
from tests.gateway.serving.test_quota_redis_failures import RedisServer, private_redis  # noqa: F401  (fixture)
from tests.processes import GatewayProcess, PrivatePostgres

OUTAGE_S = float(os.environ.get("TOLLGATE_TEST_PG_OUTAGE_S", "6"))
PROMPT = [{"role": "user", "content": "Count from one to twenty in words."}]


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.destroy()


@dataclass
class Outcome:
    stream: bool
    status: int = 0
    request_id: str | None = None
    code: str | None = None
    answered: bool = False  # the final chunk ([DONE]) or the whole JSON body reached us
    usage: dict[str, int] | None = None
    started: float = field(default_factory=time.monotonic)


async def one_request(client: httpx.AsyncClient, stream: bool, max_tokens: int, out: list[Outcome]) -> None:
    o = Outcome(stream)
    out.append(o)
    body: dict[str, Any] = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        o.status, o.request_id = r.status_code, r.headers.get("x-request-id")
        if r.status_code != 200:
            o.code = json.loads(await r.aread())["error"]["code"]
            return
        if not stream:
            o.usage = json.loads(await r.aread())["usage"]
            o.answered = True
            return
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                o.answered = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                o.usage = chunk.get("usage") or o.usage


async def keep_loading(base_url: str, key: str, stop: asyncio.Event, out: list[Outcome], workers: int = 4,
                       max_tokens: tuple[int, int] = (3, 8)) -> None:
    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            while not stop.is_set():
                try:
                    await one_request(c, rng.random() < 0.6, rng.randint(*max_tokens), out)
                except httpx.HTTPError:
                    if stop.is_set():
                        return
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(worker(i) for i in range(workers)))


async def ledger_ids(db_url: str, key_id: int) -> dict[str, dict[str, Any]]:
    """The key's ledger rows by request id, after asserting that no request id has two rows in the
    whole ledger (the table's unique key is (request_id, admitted_at): a second row is possible)."""
    db = create_engine(db_url)
    try:
        async with db.connect() as conn:
            doubled = (await conn.execute(sa.text(
                "SELECT request_id, count(*) AS n FROM ledger_entries GROUP BY request_id HAVING count(*) > 1"))).all()
            assert not doubled, f"requests with more than one ledger row: {[(r.request_id, r.n) for r in doubled][:10]}"
            rows = (await conn.execute(sa.text("SELECT * FROM ledger_entries WHERE key_id = :k"), {"k": key_id})).all()
        return {r.request_id: dict(r._mapping) for r in rows}
    finally:
        await db.dispose()


async def wait_for_ids(db_url: str, key_id: int, ids: set[str], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = await ledger_ids(db_url, key_id)
        if ids <= set(rows) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.25)


async def test_postgres_down_under_load_keep_serving_and_refuse_policies(engine: Any, private_pg: PrivatePostgres, tmp_path: Path) -> None:
    url = private_pg.create_database("tollgate")
    keep_srv, keep = start_gateway(url, engine, tmp_path / "keep")
    refuse_srv, refuse = start_gateway(url, engine, tmp_path / "refuse", ledger={"max_backlog": 2})
    try:
        key = await keep.new_key()
        unused = await keep.new_key()  # never authenticated before the outage: nothing cached
        async with keep.admin_client() as a:
            assert (await a.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": 10_000_000}})).status_code == 200
        warm: list[Outcome] = []
        for gw in (keep, refuse):
            async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
                await one_request(c, True, 2, warm)
        assert all(o.status == 200 for o in warm)

        stop, during = asyncio.Event(), []
        load_out: list[Outcome] = []
        load = asyncio.create_task(keep_loading(keep.base_url, key["key"], stop, load_out))
        await asyncio.sleep(1.5)
        private_pg.stop("immediate")
        down_at = time.monotonic()
        before_outage = len(load_out)
        refused_codes: list[str | None] = []
        async with httpx.AsyncClient(base_url=refuse.base_url, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
            for _ in range(6):  # the refusing gateway: served until its backlog passes 2, then 503
                await one_request(c, False, 2, during)
                refused_codes.append(during[-1].code)
        async with httpx.AsyncClient(base_url=keep.base_url, headers={"Authorization": f"Bearer {unused['key']}"}, timeout=30) as c:
            cold = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": 2})
        async with keep.admin_client() as a:
            admin_call = await a.get("/admin/accounts")  # cached admin key, but the answer needs the database
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        backlog_at_peak = keep.app.state.ledger.backlog
        during_outage = len(load_out) - before_outage
        private_pg.start()
        up_at = time.monotonic()
        await asyncio.sleep(1.5)
        stop.set()
        await load

        # keep-serving: every request was answered, through the outage too.
        assert load_out and all(o.status == 200 and o.answered for o in load_out), [(o.status, o.code) for o in load_out if o.status != 200]
        assert during_outage >= 3 and backlog_at_peak >= 3
        assert cold.status_code == 503 and cold.json()["error"]["code"] == "database_unavailable"  # a clear 503, not a 500
        assert admin_call.status_code == 503 and admin_call.json()["error"]["code"] == "database_unavailable"
        # refuse policy: a 503 with its own code once the backlog is over the limit, never a 500.
        assert "ledger_backlog" in refused_codes and all(o.status in (200, 503) for o in during)
        assert during[0].status == 200  # it served until the backlog passed the limit

        served = {o.request_id for o in [*warm, *load_out, *during] if o.status == 200}
        rows = await wait_for_ids(url, key["id"], served)
        assert set(rows) == served  # every served request exactly once; refused ones none
        assert all(rows[o.request_id]["completion_tokens"] == o.usage["completion_tokens"] for o in load_out if o.usage)
        assert keep.app.state.ledger.backlog == 0 and refuse.app.state.ledger.backlog == 0
        print(f"\npostgres outage {OUTAGE_S:.0f}s: {during_outage} requests served during it, peak backlog {backlog_at_peak} rows, "
              f"{len(load_out)} served in all, rows expected {len(served)} found {len(rows)}, "
              f"refuse policy answered {refused_codes}; caught up {time.monotonic() - up_at:.1f}s after Postgres returned")
    finally:
        refuse_srv.__exit__()
        keep_srv.__exit__()


async def redis_counters(redis_url: str, prefix: str, db_url: str, key_id: int) -> dict[str, int]:
    db = create_engine(db_url)
    lim = RedisLimiter(redis_url, LedgerTotals(db), prefix=prefix, timeout=1.0)
    try:
        return await lim.counters(Scope("key", key_id, Limits()))
    finally:
        await lim.close()
        await db.dispose()


async def test_sigkill_under_load_while_postgres_is_down(
    private_pg: PrivatePostgres, private_redis: RedisServer, tmp_path: Path  # noqa: F811
) -> None:
    url = private_pg.create_database("tollgate")
    admin_key = bootstrap(url, SECRET)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    gw = GatewayProcess(url, tmp_path / "data", admin_key, REDIS_URL=private_redis.url, TOLLGATE_REDIS_PREFIX=prefix).start()
    try:
        key = await gw.new_key()
        async with gw.admin() as a:
            limits = {"monthly_tokens": 10_000_000, "max_concurrent": 64}
            assert (await a.patch(f"/admin/keys/{key['id']}", json={"limits": limits})).status_code == 200
        stop, out = asyncio.Event(), []
        load = asyncio.create_task(keep_loading(gw.base_url, key["key"], stop, out, workers=6, max_tokens=(3, 12)))

        async def until(pred: Any, timeout: float = 120.0) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline and not load.done()
                await asyncio.sleep(0.02)

        await until(lambda: sum(o.answered for o in out) >= 4)
        private_pg.stop("immediate")  # from here rows live only in the journal
        answered_before = sum(o.answered for o in out)
        await until(lambda: sum(o.answered for o in out) >= answered_before + 4)
        await until(lambda: sum(1 for o in out if o.status == 200 and not o.answered) >= 3)  # some mid-stream
        # What the clients saw before the kill (no await between this and the kill: the loop is ours).
        seen_before_kill = [o.status for o in out if o.status]
        gw.kill()  # SIGKILL under load
        stop.set()
        await asyncio.gather(load, return_exceptions=True)
        assert seen_before_kill and set(seen_before_kill) == {200}, sorted(set(seen_before_kill))  # every answer a 200
        assert all(o.status in (0, 200) for o in out)  # after it: bytes already in our buffers, else nothing

        stranded = await redis_counters(private_redis.url, prefix, url, key["id"])
        assert stranded["in_flight"] >= 1  # the dead process's holds are still in Redis
        private_pg.start()
        gw.start()  # same data dir: replays the journal
        deadline = time.monotonic() + 30
        while (c := await redis_counters(private_redis.url, prefix, url, key["id"]))["in_flight"] > 0:
            assert time.monotonic() < deadline, f"holds not released: {c}"  # expiry alone would take 900 s
            await asyncio.sleep(0.2)

        answered = [o for o in out if o.answered]
        cut = [o for o in out if o.status == 200 and not o.answered]
        rows = await wait_for_ids(url, key["id"], {o.request_id for o in [*answered, *cut] if o.request_id})
        for o in answered:  # every request whose end reached its client: its true row
            row = rows[o.request_id]
            assert row["status"] == "completed", row
            assert (row["prompt_tokens"], row["completion_tokens"]) == (o.usage["prompt_tokens"], o.usage["completion_tokens"])
        for o in cut:  # in flight at the kill: interrupted, with the prompt tokens
            assert rows[o.request_id]["status"] == "interrupted" and rows[o.request_id]["prompt_tokens"] > 0
        extra = set(rows) - {o.request_id for o in out if o.status == 200}
        assert all(rows[r]["status"] == "interrupted" for r in extra)  # admitted before any byte reached us
        # A row whose request no client saw answered can only be one of the requests in flight at the
        # kill that never got their response's first byte (each had at most one row).
        no_headers = [o for o in out if o.status == 0]
        assert len(extra) <= len(no_headers), f"{len(extra)} rows of unknown requests, {len(no_headers)} requests unanswered at the kill"
        # The restart rebuilds the account's counters from the ledger (recover.lua): the next admission
        # does it (the dead run's settlements still on their way at the kill are in no counter until
        # then, their holds dropped); after it, the month's counter is what the rows say.
        async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as client:
            after = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                                     "messages": [{"role": "user", "content": "Hi"}]})
        assert after.status_code == 200, after.text
        rows = await wait_for_ids(url, key["id"], {*rows, after.headers["x-request-id"]})
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
        deadline = time.monotonic() + 30  # its settlement runs beside its row's write
        while (c := await redis_counters(private_redis.url, prefix, url, key["id"]))["month_tokens"] != tokens or c["in_flight"]:
            assert time.monotonic() < deadline, (c, tokens)  # settled as the rows say, nothing held
            await asyncio.sleep(0.2)
        log = gw.log_text()
        assert "replaying" in log and "released" in log
        print(f"\nSIGKILL: {len(answered)} answered ({len(answered) - answered_before} while Postgres was down), "
              f"{len(cut)} mid-stream + {len(extra)} of {len(no_headers)} not yet streaming -> {sum(r['status'] == 'interrupted' for r in rows.values())} "
              f"interrupted rows; rows expected {len(answered) + len(cut)}+ found {len(rows)}; holds stranded {stranded['in_flight']} -> 0")
    finally:
        gw.stop()
