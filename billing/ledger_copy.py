"""The ledger writer's Postgres path for high ingest: binary COPY into a staging table, on several
connections at once (bench/ledger_writer.py measures it beside the one-statement path).

A batch is split into `connections` parts, written concurrently, each in one transaction:

    COPY ledger_stage FROM STDIN (binary)            the rows, with their hour and histogram buckets
    INSERT INTO ledger_entries SELECT ... FROM ledger_stage ON CONFLICT (request_id, admitted_at) DO NOTHING
        RETURNING ...  -> the hourly aggregates upserted from the rows actually inserted (one statement)
    COMMIT                                            the staging table empties itself (ON COMMIT DELETE ROWS)

Exactness is the one-statement path's: a row already in the ledger adds nothing to the aggregates,
so a part that committed before another failed is harmless when the writer retries the whole batch.
Two parts upsert the same aggregate rows in one sorted order, so they wait on each other, never deadlock.
COPY feeds the rows in Postgres' binary format without SQL parameter arrays; the parts keep both
cores busy (one Postgres backend each, while this process prepares the next batch).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from billing import ledger
from billing.usage import hour_of, latency_bucket

log = logging.getLogger("tollgate.ledger")

STAGE = "ledger_stage"
_NAMES = [name for name, _ in ledger._PG_COLUMNS]
_STAGE_COLUMNS = [*_NAMES, "hour", "total_bucket", "ttft_bucket"]
_CREATE_STAGE = (
    f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} ("
    + ", ".join(f"{name} {kind}" for name, kind in ledger._PG_COLUMNS)
    + ", hour timestamptz, total_bucket int2, ttft_bucket int2) ON COMMIT DELETE ROWS"
)
# The same aggregate upserts as the one-statement path (ledger._PG_BATCH from its `usage` CTE on),
# fed by the staging table's hours and buckets instead of parameter arrays.
_AGGREGATES = ledger._PG_BATCH[ledger._PG_BATCH.index("usage AS ("):]
_FROM_STAGE = (
    f"WITH ins AS (INSERT INTO {ledger.LEDGER.name} ({', '.join(_NAMES)}) SELECT {', '.join(_NAMES)} FROM {STAGE} "
    f"ON CONFLICT ({', '.join(ledger.CONFLICT_KEY)}) DO NOTHING "
    "RETURNING request_id, account_id, key_id, model, prompt_tokens, completion_tokens, status, total_ms, ttft_ms, cost_nanos, cached_tokens), "
    f"fresh AS (SELECT ins.*, s.hour, s.total_bucket, s.ttft_bucket FROM ins JOIN {STAGE} AS s USING (request_id)), "
    + _AGGREGATES
)


def _staged(record: Any) -> tuple[Any, ...]:
    ttft = record.ttft_ms
    return (*(getattr(record, name) for name in _NAMES), hour_of(record.admitted_at), latency_bucket(record.total_ms),
            None if ttft is None else latency_bucket(ttft))


class CopySession:
    """`connections` asyncpg connections held between batches (like ledger.PgSession, which it
    replaces when TOLLGATE_LEDGER_COPY is on); any failure drops them all, the next batch reconnects."""

    def __init__(self, engine: AsyncEngine, connections: int = 2) -> None:
        self.engine = engine
        self.connections = max(1, connections)
        self._held: list[tuple[Any, Any]] = []  # (AsyncConnection, asyncpg connection)

    @staticmethod
    def applies(engine: AsyncEngine) -> bool:
        return engine.dialect.name == "postgresql" and engine.dialect.driver == "asyncpg"

    async def _connect(self) -> None:
        while len(self._held) < self.connections:
            conn = await self.engine.connect()
            driver = (await conn.get_raw_connection()).driver_connection
            await driver.execute(_CREATE_STAGE)
            self._held.append((conn, driver))

    async def write(self, records: list[Any]) -> int:
        if not records:
            return 0
        unique = list({r.request_id: r for r in reversed(records)}.values())[::-1]  # a request id twice: its first row
        await self._connect()
        size = -(-len(unique) // self.connections)
        parts = [unique[i:i + size] for i in range(0, len(unique), size)]
        try:
            written = await asyncio.gather(*(self._write_part(driver, part) for (_, driver), part in zip(self._held, parts)))
        except BaseException:
            await self.close(broken=True)
            raise
        return sum(written)

    @staticmethod
    async def _write_part(driver: Any, part: list[Any]) -> int:
        async with driver.transaction():
            await driver.copy_records_to_table(STAGE, records=[_staged(r) for r in part], columns=_STAGE_COLUMNS)
            return int(await driver.fetchval(_FROM_STAGE))

    async def close(self, *, broken: bool = False) -> None:
        held, self._held = self._held, []
        for conn, _driver in held:
            try:
                if broken:
                    await conn.invalidate()
                await conn.close()
            except Exception as exc:
                log.debug("ledger connection close: %s", type(exc).__name__)
