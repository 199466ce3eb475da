"""The ledger writer on real Postgres: idempotent by request_id, batched, never drops rows on errors."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.ledger.writer import LedgerWriter, PgSession, UsageRecord, write_records
from tests.conftest import until


def record(**overrides: Any) -> UsageRecord:
    fields = dict(
        request_id=uuid.uuid4().hex, account_id=1, key_id=1, model="m", prompt_tokens=10,
        completion_tokens=5, status="completed", finish_reason="stop", total_ms=12.5,
    )
    fields.update(overrides)
    return UsageRecord(**fields)  # type: ignore[arg-type]


async def count(db: Any) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(sa.text("SELECT count(*) FROM ledger_entries"))).scalar_one())


async def test_same_request_id_is_written_once(fresh_pg_database: Any) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        first = record()
        await write_records(db, [first])
        await write_records(db, [first, record(request_id=first.request_id, completion_tokens=999)])
        assert await count(db) == 1
        async with db.connect() as conn:
            tokens = (await conn.execute(sa.text("SELECT completion_tokens FROM ledger_entries"))).scalar_one()
        assert tokens == 5  # the first write wins; a repeat is success, not an update

        writer = LedgerWriter(db)
        writer.start()
        records = [record() for _ in range(2500)]
        for r in records:
            writer.record(r)
        writer.record(records[0])  # duplicate in the same stream
        await writer.flush(timeout=30)
        await writer.close()
        assert await count(db) == 2501
    finally:
        await db.dispose()


async def test_writer_keeps_rows_until_the_table_exists(fresh_pg_database: Any) -> None:
    url = fresh_pg_database()
    db = create_engine(url)
    try:
        writer = LedgerWriter(db, max_backoff=0.2)
        writer.start()
        writer.record(record())
        await until(lambda: writer.write_errors >= 2, "the write failed and was tried again")
        assert writer.backlog == 1  # table missing: kept, retried
        await asyncio.to_thread(migrate.upgrade, url)
        await writer.flush(timeout=10)
        await writer.close()
        assert await count(db) == 1
    finally:
        await db.dispose()


async def test_rows_arriving_within_the_linger_share_one_insert(fresh_pg_database: Any, monkeypatch: Any) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    inserts: list[int] = []
    real = PgSession.write  # the writer's path on Postgres: its own held connection

    async def counting(session: Any, batch: list[UsageRecord]) -> Any:
        inserts.append(len(batch))
        return await real(session, batch)

    monkeypatch.setattr(PgSession, "write", counting)
    try:
        linger = 0.5
        writer = LedgerWriter(db, linger=linger)
        writer.start()
        arrived: list[float] = []
        for _ in range(20):  # one row every 5 ms, as a light load sends them (the arrival pattern, not a wait)
            writer.record(record())
            arrived.append(time.monotonic())
            await asyncio.sleep(0.005)
        await writer.flush(timeout=10)
        # Every row recorded within the linger of the first goes in the first insert; a loaded machine may
        # spread the 20 past it (then they take two inserts, as they should), so that is what is counted.
        within = sum(t - arrived[0] < linger for t in arrived)
        assert sum(inserts) == 20 and inserts[0] >= within > 1, (inserts, within)
        inserts.clear()
        eager = LedgerWriter(db)  # linger 0: each row that finds the writer idle goes at once
        eager.start()
        for _ in range(5):
            eager.record(record())
            await eager.flush(timeout=10)
        assert inserts == [1] * 5
        await writer.close()
        await eager.close()
        assert await count(db) == 25
    finally:
        await db.dispose()
