"""The binary COPY ingest path (billing/ledger/pg_copy.py) into the partitioned ledger on Postgres: every
row once, the hourly aggregates exactly the sums over the ledger, through duplicates in a batch,
replays, a batch retried after part of it committed, and a database restart under the writer."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.ledger.writer import LedgerWriter, UsageRecord
from billing.ledger.pg_copy import CopySession
from tests.processes import PrivatePostgres

START = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)


def rows(n: int, run: str, ttft: bool = True) -> list[UsageRecord]:
    return [UsageRecord(request_id=f"{run}-{i}", account_id=1 + i % 3, key_id=1 + i % 7, model=("a", "b")[i % 2],
                        prompt_tokens=3 + i % 5, completion_tokens=i % 11, status=("completed", "cancelled", "error")[i % 3],
                        finish_reason="stop", total_ms=1.0 + i % 900, ttft_ms=(0.5 + i % 40) if ttft and i % 4 else None,
                        cost_nanos=None if i % 13 == 0 else 1000 + i, admitted_at=START + timedelta(minutes=i % 150))
            for i in range(n)]


async def exact(db: Any) -> tuple[int, int]:
    """(rows, aggregate groups that differ from the ledger's sums): the second must be 0."""
    async with db.connect() as conn:
        n = (await conn.execute(sa.text("SELECT count(*) FROM ledger_entries"))).scalar_one()
        differ = (await conn.execute(sa.text(
            "SELECT count(*) FROM (SELECT date_trunc('hour', admitted_at) AS hour, account_id, key_id, model, count(*) AS requests, "
            "sum(prompt_tokens) AS p, sum(completion_tokens) AS c, coalesce(sum(cost_nanos), 0) AS n, "
            "count(*) FILTER (WHERE cost_nanos IS NULL) AS unpriced, count(*) FILTER (WHERE status IN ('error', 'interrupted')) AS e, "
            "count(*) FILTER (WHERE status = 'cancelled') AS x, count(ttft_ms) AS t FROM ledger_entries GROUP BY 1, 2, 3, 4) l "
            "FULL JOIN usage_hourly u USING (hour, account_id, key_id, model) "
            "WHERE (l.requests, l.p, l.c, l.n, l.unpriced, l.e, l.x, l.t) IS DISTINCT FROM "
            "(u.requests, u.prompt_tokens, u.completion_tokens, u.cost_nanos, u.unpriced, u.errors, u.cancelled, u.ttft_count)"))).scalar_one()
        latency = (await conn.execute(sa.text("SELECT coalesce(sum(count), 0) FROM latency_hourly WHERE metric = 'total'"))).scalar_one()
    assert latency == n  # one total-latency sample per row
    return int(n), int(differ)


async def test_copy_writer_rows_once_and_aggregates_exact(fresh_pg_database: Any) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        session = CopySession(db, connections=2)
        first = rows(6000, "r")
        assert await session.write(first + first[:50]) == 6000  # a request id twice in a batch: once
        assert await session.write(first[:3000]) == 0  # a replay adds nothing
        x, y, z = rows(3, "t")
        assert await session.write([x, x, y, z]) == 3  # the same request twice in one part: one row, counted once
        # A batch retried after one of its parts had committed (the other failed): the rest goes in, once.
        more = rows(4000, "s")
        assert await session.write(more[:2000]) == 2000
        assert await session.write(more) == 2000
        await session.close()
        assert await exact(db) == (10_003, 0)
    finally:
        await db.dispose()


async def test_copy_writer_through_a_postgres_restart(tmp_path: Any) -> None:
    """The LedgerWriter on the COPY path keeps its rows while Postgres is down and writes each once
    after it is back, with the aggregates exact (a private cluster: this test stops it)."""
    pg = PrivatePostgres()
    pg.start()
    try:
        url = pg.create_database("ledger")
        migrate.upgrade(url)
        db = create_engine(url)
        writer = LedgerWriter(db, batch_size=1000, copy_connections=2, max_backoff=0.2)
        writer.start()
        batch = rows(5000, uuid.uuid4().hex[:6])
        for r in batch[:2000]:
            writer.record(r)
        await writer.flush(timeout=60)
        pg.stop("immediate")
        for r in batch[2000:]:
            writer.record(r)
        deadline = asyncio.get_running_loop().time() + 60
        while writer.write_errors == 0:  # until the writer has met the outage
            assert asyncio.get_running_loop().time() < deadline, "the writer never tried during the outage"
            await asyncio.sleep(0.02)
        assert writer.backlog > 0
        pg.start()
        await writer.flush(timeout=120)
        await writer.close()
        assert await exact(db) == (5000, 0)
        await db.dispose()
    finally:
        pg.destroy()


async def test_fast_path_copies_into_the_partition_and_replays_go_the_exact_way(fresh_pg_database: Any) -> None:
    """New rows take the fast path (COPY straight into the month's partition, the part's own sums
    added to the aggregates); a part holding a row already in the ledger rolls back whole, its
    aggregates too, and goes the exact path; a part over two months, or in a month without a
    partition, goes through the parent. The aggregates stay exact through all of it."""
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        session = CopySession(db, connections=2)
        fresh = rows(4000, "p")
        assert await session.write(fresh) == 4000
        assert session.fallbacks == 0  # every part of new rows went the fast way
        month = f"ledger_partitions.ledger_entries_{START.year:04d}_{START.month:02d}"
        async with db.connect() as conn:
            assert (await conn.execute(sa.text(f"SELECT count(*) FROM {month}"))).scalar_one() == 4000
        # A replay mixed with new rows: the part that meets old rows is refused by the unique key and
        # written exactly (its new rows once, its old ones not again).
        mixed = rows(300, "q") + fresh[:700]
        assert await session.write(mixed) == 300
        assert session.fallbacks >= 1
        assert await exact(db) == (4300, 0)
        # Rows in a month with no partition (the DEFAULT one takes them) and rows over two months.
        far = [UsageRecord(request_id=f"far-{i}", account_id=1, key_id=1, model="a", prompt_tokens=1, completion_tokens=2,
                           status="completed", finish_reason="stop", total_ms=5.0,
                           admitted_at=datetime(2099, 1 + i % 2, 28, 23, tzinfo=timezone.utc)) for i in range(40)]
        before = session.fallbacks
        assert await session.write(far) == 40
        assert session.fallbacks == before  # still the fast path, through the parent
        async with db.connect() as conn:
            assert (await conn.execute(sa.text("SELECT count(*) FROM ledger_partitions.ledger_entries_default"))).scalar_one() == 40
        assert await session.write(far) == 0  # and a replay of them adds nothing
        await session.close()
        assert await exact(db) == (4340, 0)
    finally:
        await db.dispose()


async def test_every_write_path_takes_the_aggregate_tables_in_one_order(fresh_pg_database: Any) -> None:
    """The hourly usage table before the latency table, in the one-statement paths (the writer's array
    insert and the COPY exact path) as in the COPY fast path's upserts: two writers taking them in
    opposite orders deadlocked (an audit: 1 to 2 deadlocks in 12 overlapping 4,000-row batches). The
    order is read off row triggers that number each row as its insert takes it."""
    from billing.ledger.writer import write_records

    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        async with db.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE took (seq bigserial, tbl text)"))
            await conn.execute(sa.text(
                "CREATE FUNCTION note_take() RETURNS trigger AS $$ BEGIN INSERT INTO took (tbl) VALUES (TG_TABLE_NAME); RETURN NEW; END $$ "
                "LANGUAGE plpgsql"))
            for table in ("usage_hourly", "latency_hourly"):
                await conn.execute(sa.text(f"CREATE TRIGGER note_{table} BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION note_take()"))

        async def order() -> list[str]:
            async with db.begin() as conn:
                taken = [r for r in (await conn.execute(sa.text("SELECT tbl FROM took ORDER BY seq"))).scalars()]
                await conn.execute(sa.text("DELETE FROM took"))
            return [t for i, t in enumerate(taken) if i == 0 or taken[i - 1] != t]  # runs of one table

        await write_records(db, rows(300, "arrays"))  # the writer's one statement (PG_BATCH)
        assert await order() == ["usage_hourly", "latency_hourly"]
        session = CopySession(db, connections=1)
        staged = rows(300, "staged")
        await session.write(staged[:1])
        await session.write(staged)  # a part with a row already in: the exact path through the stage
        assert session.fallbacks >= 1
        assert await order() == ["usage_hourly", "latency_hourly"] * 2
        await session.close()
    finally:
        await db.dispose()


async def test_a_request_twice_in_a_batch_is_its_first_row_as_on_the_other_write_paths(fresh_pg_database: Any, monkeypatch: Any) -> None:
    """The one-statement and executemany paths keep a request's first row of a batch (tests/billing/
    ledger/test_cached_tokens.py); COPY keeps the same one, on its fast path and its exact path, and
    the aggregates count that row only."""
    from billing.ledger import pg_copy

    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        for fast in (True, False):
            monkeypatch.setattr(pg_copy, "FAST_PATH", fast)
            first, other = rows(2, f"dup-{fast}")
            again = UsageRecord(**{**first.__dict__, "prompt_tokens": 999, "completion_tokens": 99, "cost_nanos": 7,
                                   "status": "error"})  # the same request (and admission instant), other counts
            session = CopySession(db, connections=2)
            assert await session.write([first, other, again]) == 2
            await session.close()
            async with db.connect() as conn:
                kept = (await conn.execute(sa.text("SELECT prompt_tokens, completion_tokens, cost_nanos, status FROM ledger_entries "
                                                   "WHERE request_id = :r"), {"r": first.request_id})).all()
            assert [tuple(r) for r in kept] == [(first.prompt_tokens, first.completion_tokens, first.cost_nanos, first.status)], fast
        assert await exact(db) == (4, 0)
    finally:
        await db.dispose()
