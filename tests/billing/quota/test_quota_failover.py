"""Redis Cluster and Sentinel failovers under load (issue 24): three limiters (three gateway
processes) admit against one account's monthly token budget while the master that holds the
account's hash slot is SIGKILLed and its replica takes over. No overspend (the ledger's tokens <=
the budget, exactly), no hold left behind, and the counters equal the ledger afterwards: the
new master's counters are rebuilt from the ledger, the running requests' holds re-registered.

The replica is made to lag before the kill (its output buffer limit on the master is cut to one
byte, so the master drops it at its next write): the writes it missed are really lost, as in a
failover under a replication lag.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.ledger.writer import UsageRecord, write_records
from billing.quota.limits import Limits
from billing.quota import LedgerTotals, QuotaExceeded, QuotaUnavailable, RedisLimiter, Scope, ScopeTotals
from tests.billing.invoice_helpers import new_account
from tests.redis_topologies import LocalCluster, LocalSentinel

BUDGET = 40_000
WORST = 200  # tokens each request reserves; it uses 1..WORST of them


class CountingTotals(LedgerTotals):
    """The ledger read-back, counting the rebuilds."""

    rebuilds: list[float]

    async def for_scopes(self, scopes: list[Scope], now: float, conn: Any = None) -> dict[str, ScopeTotals]:
        self.rebuilds.append(time.monotonic())
        return await super().for_scopes(scopes, now, conn)


async def ledger_tokens(db: Any, account: int) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(sa.text(
            "SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) FROM ledger_entries WHERE account_id = :a"),
            {"a": account})).scalar_one())


async def until(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def load_through_failover(url: str, db: Any, lag: Any, kill: Any, wait_recovered: Any) -> dict[str, Any]:
    """Runs 24 concurrent requests at a time through three limiters until the budget is spent:
    after 40 are served `lag(key)` cuts the replica off, after 30 more `kill(key)` SIGKILLs the
    master, then `wait_recovered(key)` polls until the failover is done (each in a thread)."""
    account = await new_account(db)
    key_id = 1
    rebuilds: list[float] = []
    limiters = []
    prefix = f"tgfail:{uuid.uuid4().hex[:8]}:"
    for _ in range(3):
        totals = CountingTotals(db)
        totals.rebuilds = rebuilds
        limiters.append(RedisLimiter(url, totals, prefix=prefix, timeout=0.25))
    scopes = [Scope("key", key_id, Limits()), Scope("account", account, Limits(monthly_tokens=BUDGET))]
    stats: Counter[str] = Counter()
    phase = {"killed": False, "recovered": False}
    done = asyncio.Event()

    async def worker(i: int) -> None:
        lim = limiters[i % 3]
        while not done.is_set():
            rid = uuid.uuid4().hex
            try:
                hold = await lim.reserve(rid, scopes, WORST, 0)
            except QuotaExceeded as exc:
                assert exc.limit == "monthly_tokens", exc.limit
                stats["refused"] += 1
                if phase["recovered"]:
                    done.set()  # the budget is spent after the failover: the run is over
                await asyncio.sleep(0.01)
                continue
            except QuotaUnavailable:
                stats["unavailable"] += 1  # fail closed while no master serves the slot
                await asyncio.sleep(0.01)
                continue
            actual = random.randint(1, WORST)
            await write_records(db, [UsageRecord(
                request_id=rid, account_id=account, key_id=key_id, model="m", prompt_tokens=actual, completion_tokens=0,
                status="completed", finish_reason="stop", total_ms=1.0)])
            await lim.settle(hold, actual, 0)
            stats["served"] += 1
            stats["served_after" if phase["recovered"] else "served_before"] += 1

    workers = [asyncio.create_task(worker(i)) for i in range(24)]
    try:
        async def served_some() -> bool:
            assert not any(w.done() for w in workers), [w.exception() for w in workers if w.done()]
            return stats["served"] >= 40
        await until(served_some, "40 requests served")
        group = limiters[0].group(f"a{account}")
        await asyncio.to_thread(lag, group + "epoch")
        lagged_at = stats["served"]

        async def served_while_lagging() -> bool:
            return stats["served"] >= lagged_at + 30
        await until(served_while_lagging, "30 requests served while the replica lags")
        await asyncio.to_thread(kill, group + "epoch")
        killed_at = time.monotonic()
        phase["killed"] = True
        await asyncio.to_thread(wait_recovered, group + "epoch")
        phase["recovered"] = True

        async def finished() -> bool:
            assert not any(w.done() and w.exception() for w in workers), [w.exception() for w in workers if w.done()]
            return done.is_set()
        await until(finished, "the budget spent after the failover", timeout=120)
        await asyncio.gather(*workers)

        spent = await ledger_tokens(db, account)
        account_scope = scopes[1]

        async def released() -> bool:  # holds whose answers were lost in the failover are released by the watch
            c = await limiters[0].counters(account_scope)
            return c["held_tokens"] == 0 and c["in_flight"] == 0
        await until(released, "every hold released", timeout=15)
        counters = await limiters[0].counters(account_scope)
        return {"spent": spent, "counters": counters, "stats": stats, "rebuilds_after_kill": [t for t in rebuilds if t > killed_at]}
    finally:
        done.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        for lim in limiters:
            await lim.close()


def lag_replica(master_port: int) -> None:
    """The master drops its replica at its next write: what follows is lost in the failover."""
    redis.Redis(port=master_port, socket_timeout=2).config_set("client-output-buffer-limit", "replica 1 1 0")


async def test_cluster_master_killed_under_load_no_overspend_counters_rebuilt(
    tmp_path: Path, fresh_pg_database: Any
) -> None:
    cluster = LocalCluster(tmp_path).start()
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    victim: list[int] = []

    def lag(key: str) -> None:
        victim.append(cluster.master_of(key))
        lag_replica(victim[0])

    def recovered(key: str) -> None:
        cluster.wait_failover(victim[0], key)

    try:
        out = await load_through_failover(cluster.url, db, lag, lambda key: cluster.kill(victim[0]), recovered)
    finally:
        cluster.stop()
        await db.dispose()
    stats, counters = out["stats"], out["counters"]
    assert stats["served_before"] >= 40 and stats["served_after"] >= 1 and stats["unavailable"] >= 1, stats
    assert out["spent"] <= BUDGET, f"overspent: {out['spent']} tokens served of a {BUDGET} budget ({stats})"
    assert out["spent"] > BUDGET - 24 * WORST, (out["spent"], stats)  # the budget was really used up
    assert counters["month_tokens"] == out["spent"], (counters, out["spent"])  # Redis == the ledger
    assert out["rebuilds_after_kill"], "the counters were not rebuilt from the ledger after the failover"


async def test_sentinel_promotes_the_replica_and_quotas_keep_working(tmp_path: Path, fresh_pg_database: Any) -> None:
    deployment = LocalSentinel(tmp_path).start()
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)

    def recovered(key: str) -> None:
        deployment.wait_promoted(deployment.master_port)

    try:
        out = await load_through_failover(deployment.url, db, lambda key: lag_replica(deployment.master_port),
                                          lambda key: deployment.kill(deployment.master_port), recovered)
    finally:
        deployment.stop()
        await db.dispose()
    stats, counters = out["stats"], out["counters"]
    assert stats["served_before"] >= 40 and stats["served_after"] >= 1 and stats["unavailable"] >= 1, stats
    assert out["spent"] <= BUDGET, f"overspent: {out['spent']} tokens served of a {BUDGET} budget ({stats})"
    assert out["spent"] > BUDGET - 24 * WORST, (out["spent"], stats)
    assert counters["month_tokens"] == out["spent"], (counters, out["spent"])
    assert out["rebuilds_after_kill"], "the counters were not rebuilt from the ledger after the failover"
