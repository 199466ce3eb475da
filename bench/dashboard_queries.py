"""Dashboard queries at a million ledger rows: hourly aggregates against scanning the ledger.

    .venv/bin/python bench/dashboard_queries.py [--rows 1000000] [--database-url postgresql://...]

Fills a fresh Postgres database (made and dropped here, on TOLLGATE_TEST_PG* like the tests,
unless --database-url is given) with N ledger rows over 30 days (50 accounts, 150 keys with a
skew, 2 models) by batched server-side SQL, sums them into the aggregate tables, checks the
sums agree, then times each dashboard query both ways in the same run and prints the ratio.
Last, it times the ledger writer's batch insert with and without the aggregate upsert.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from tqdm import tqdm  # noqa: E402

from billing import migrate  # noqa: E402
from billing.db import create_engine  # noqa: E402
from billing.ledger.writer import UsageRecord, insert_ignoring_duplicates, write_records  # noqa: E402
from billing.ledger.aggregates import Period, latency_percentiles, month_to_date, usage_groups  # noqa: E402

END = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
PERIOD = Period(END - timedelta(days=30), END)

LEDGER_FILL = """
INSERT INTO ledger_entries (request_id, account_id, key_id, model, prompt_tokens, completion_tokens, status,
    finish_reason, estimated, cost_nanos, queue_ms, ttft_ms, total_ms, created_at)
SELECT md5(CAST(:salt AS text) || g::text), 1 + (k % 50), k, CASE WHEN g % 5 = 0 THEN 'big-model' ELSE 'small-model' END,
       p, c, CASE WHEN g % 97 = 0 THEN 'error' WHEN g % 41 = 0 THEN 'cancelled' ELSE 'completed' END,
       'stop', false, (p * 150 + c * 600), 1.0, t / 4, t, CAST(:end AS timestamptz) - (random() * interval '30 days')
FROM (SELECT g, 1 + floor(150 * power(random(), 3))::int AS k, 20 + floor(random() * 900)::int AS p,
             1 + floor(random() * 400)::int AS c, 50 + random() * random() * 5000 AS t
      FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS g) AS s
"""

HOURLY_FILL = """
INSERT INTO usage_hourly (hour, account_id, key_id, model, requests, prompt_tokens, completion_tokens, cost_nanos,
    unpriced, errors, cancelled, total_ms_sum, ttft_ms_sum, ttft_count)
SELECT date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', account_id, key_id, model, count(*),
       sum(prompt_tokens), sum(completion_tokens), coalesce(sum(cost_nanos), 0), count(*) - count(cost_nanos),
       count(*) FILTER (WHERE status = 'error'), count(*) FILTER (WHERE status = 'cancelled'),
       sum(total_ms), coalesce(sum(ttft_ms), 0), count(ttft_ms)
FROM ledger_entries GROUP BY 1, 2, 3, 4
"""

LATENCY_FILL = """
INSERT INTO latency_hourly (hour, model, metric, bucket, count)
SELECT hour, model, metric, bucket, count(*) FROM (
    SELECT date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour, model, 'total' AS metric,
           CASE WHEN total_ms < 1 THEN 0 ELSE floor(log(2, total_ms::numeric) * 4)::int END AS bucket FROM ledger_entries
    UNION ALL
    SELECT date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', model, 'ttft',
           CASE WHEN ttft_ms < 1 THEN 0 ELSE floor(log(2, ttft_ms::numeric) * 4)::int END FROM ledger_entries
    WHERE ttft_ms IS NOT NULL) AS b
GROUP BY 1, 2, 3, 4
"""

RAW = {
    "usage by day and model (all accounts)": """
        SELECT (created_at AT TIME ZONE 'UTC')::date, model, count(*), sum(prompt_tokens), sum(completion_tokens),
               sum(cost_nanos), count(*) FILTER (WHERE status = 'error')
        FROM ledger_entries WHERE created_at >= :s AND created_at < :e GROUP BY 1, 2""",
    "top 10 keys by spend": """
        SELECT key_id, sum(cost_nanos) AS c, sum(prompt_tokens + completion_tokens) FROM ledger_entries
        WHERE created_at >= :s AND created_at < :e GROUP BY key_id ORDER BY c DESC LIMIT 10""",
    "one account by day and key": """
        SELECT (created_at AT TIME ZONE 'UTC')::date, key_id, count(*), sum(prompt_tokens), sum(cost_nanos)
        FROM ledger_entries WHERE account_id = 7 AND created_at >= :s AND created_at < :e GROUP BY 1, 2""",
    "latency and TTFT p50/p90/p99 by model": """
        SELECT model, percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY total_ms),
               percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY ttft_ms)
        FROM ledger_entries WHERE created_at >= :s AND created_at < :e GROUP BY model""",
    "one account, month to date": """
        SELECT sum(prompt_tokens + completion_tokens), sum(cost_nanos) FROM ledger_entries
        WHERE account_id = 7 AND created_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'""",
}


def aggregated(db: Any) -> dict[str, Callable[[], Awaitable[Any]]]:
    return {
        "usage by day and model (all accounts)": lambda: usage_groups(db, PERIOD, ("day", "model")),
        "top 10 keys by spend": lambda: usage_groups(db, PERIOD, ("key",), order_by=("cost_nanos",), limit=10),
        "one account by day and key": lambda: usage_groups(db, PERIOD, ("day", "key"), account_id=7),
        "latency and TTFT p50/p90/p99 by model": lambda: latency_percentiles(db, PERIOD),
        "one account, month to date": lambda: month_to_date(db, account_id=7),
    }


async def timed(fn: Callable[[], Awaitable[Any]], runs: int) -> float:
    await fn()  # warm the cache once
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000.0


async def fill(db: Any, rows: int) -> None:
    salt = uuid.uuid4().hex
    chunk = 100_000
    with tqdm(total=rows, desc="ledger rows", unit="row", unit_scale=True, file=sys.stderr) as bar:
        for first in range(1, rows + 1, chunk):
            last = min(rows, first + chunk - 1)
            async with db.begin() as conn:
                await conn.execute(sa.text(LEDGER_FILL), {"salt": salt, "first": first, "last": last, "end": END})
            bar.update(last - first + 1)
    started = time.perf_counter()
    async with db.begin() as conn:
        await conn.execute(sa.text(HOURLY_FILL))
        await conn.execute(sa.text(LATENCY_FILL))
        await conn.execute(sa.text("ANALYZE"))
    print(f"aggregated in {time.perf_counter() - started:.1f} s", file=sys.stderr)


async def check_sums(db: Any) -> dict[str, int]:
    async with db.connect() as conn:
        ledger = (await conn.execute(sa.text(
            "SELECT count(*), sum(prompt_tokens), sum(cost_nanos) FROM ledger_entries"))).one()
        hourly = (await conn.execute(sa.text("SELECT count(*) FROM usage_hourly"))).scalar_one()
    [totals] = await usage_groups(db, Period(END - timedelta(days=31), END + timedelta(hours=1)))
    assert (totals["requests"], totals["prompt_tokens"], totals["cost_nanos"]) == tuple(int(v) for v in ledger), "sums differ"
    return {"ledger": int(ledger[0]), "hourly": int(hourly)}


async def write_path(db: Any, rows: int = 20_000, batch: int = 1000) -> tuple[float, float]:
    """Seconds to insert `rows` new ledger rows in batches: plain insert, then with aggregates."""
    def records() -> list[UsageRecord]:
        now = datetime.now(timezone.utc)
        return [UsageRecord(uuid.uuid4().hex, 1 + i % 50, 1 + i % 150, "small-model", 100, 50, "completed", "stop",
                            300.0, 1.0, 60.0, False, 21000, now) for i in range(rows)]

    plain_rows, agg_rows = records(), records()
    stmt = insert_ignoring_duplicates("postgresql")
    start = time.perf_counter()
    for i in range(0, rows, batch):
        async with db.begin() as conn:
            await conn.execute(stmt, [asdict(r) for r in plain_rows[i:i + batch]])
    plain = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, rows, batch):
        await write_records(db, agg_rows[i:i + batch])
    return plain, time.perf_counter() - start


async def main_async(args: argparse.Namespace, url: str) -> None:
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        await fill(db, args.rows)
        sizes = await check_sums(db)
        print(f"\n{sizes['ledger']:,} ledger rows -> {sizes['hourly']:,} hourly rows (sums checked equal)\n")
        print(f"{'dashboard query (30 days)':<42} {'ledger scan':>12} {'aggregates':>12} {'ratio':>8}")
        fast = aggregated(db)
        for name, sql in RAW.items():
            async def raw(sql: str = sql) -> Any:
                async with db.connect() as conn:
                    return (await conn.execute(sa.text(sql), {"s": PERIOD.start, "e": PERIOD.end})).all()

            slow_ms = await timed(raw, args.runs)
            fast_ms = await timed(fast[name], args.runs)
            print(f"{name:<42} {slow_ms:>9.1f} ms {fast_ms:>9.1f} ms {slow_ms / fast_ms:>7.1f}x")
        plain, with_aggregates = await write_path(db)
        print(f"\nledger writer, 20,000 rows in batches of 1,000: plain insert {plain:.2f} s, "
              f"with aggregate upserts {with_aggregates:.2f} s ({with_aggregates / plain:.2f}x)")
    finally:
        await db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="ledger rows to insert (default 1,000,000)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per query; the median is printed")
    parser.add_argument("--database-url", help="an empty Postgres database (default: make one, drop it after)")
    args = parser.parse_args()
    if args.database_url:
        asyncio.run(main_async(args, args.database_url))
        return
    host = os.environ.get("TOLLGATE_TEST_PGHOST", "127.0.0.1")
    port = int(os.environ.get("TOLLGATE_TEST_PGPORT", "5432"))
    user = os.environ.get("TOLLGATE_TEST_PGUSER", "postgres")
    name = f"tollgate_bench_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(host=host, port=port, user=user, database="postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        asyncio.run(main_async(args, f"postgresql://{user}@{host}:{port}/{name}"))
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


if __name__ == "__main__":
    main()
