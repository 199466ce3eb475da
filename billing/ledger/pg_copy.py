"""The ledger writer's Postgres path for high ingest: binary COPY straight into the month's
partition, on several connections at once (bench/ledger_writer.py measures it beside the
one-statement path).

A batch is split into `connections` parts, written concurrently, each in one transaction. The fast
path, taken by every batch of new rows:

    COPY ledger_partitions.ledger_entries_YYYY_MM FROM STDIN (binary)   the rows, no conflict clause
    INSERT INTO usage_hourly SELECT * FROM unnest(...) ON CONFLICT DO UPDATE   the part's sums, computed
    INSERT INTO latency_hourly ...                                             here (billing.ledger.aggregates.deltas)
    COMMIT

COPY has no ON CONFLICT, so a row already in the ledger (a journal replay, a batch retried after one
of its parts committed) makes the unique key `(request_id, admitted_at)` refuse the COPY: the whole
transaction rolls back, aggregates included, and that part is written again by the exact path:

    COPY ledger_stage FROM STDIN (binary)            a temporary table, not WAL-logged
    INSERT INTO ledger_entries SELECT ... FROM ledger_stage ON CONFLICT (request_id, admitted_at) DO NOTHING
        RETURNING ...  -> the hourly aggregates upserted from the rows actually inserted (one statement)
    COMMIT                                            the staging table empties itself (ON COMMIT DELETE ROWS)

So the aggregates are exact either way: on the fast path every row of the part is new (else it
would have rolled back) and the sums are the part's; on the exact path only inserted rows count.
The month's partition is named directly when the whole part falls in one month (no per-row routing);
a part spanning months, or a month whose partition does not exist, goes through the parent table.
Two parts upsert the same aggregate rows in one sorted order, so they wait on each other, never deadlock.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from typing import Any

import asyncpg

from sqlalchemy.ext.asyncio import AsyncEngine

from billing.ledger.sql import CONFLICT_KEY, LEDGER, PG_BATCH, PG_COLUMNS
from billing.ledger.partitions import PARENT, SCHEMA
from billing.ledger.aggregates import deltas, hour_of, latency_bucket, upsert_deltas_pg

log = logging.getLogger("tollgate.ledger")

STAGE = "ledger_stage"
_NAMES = [name for name, _ in PG_COLUMNS]
_STAGE_COLUMNS = [*_NAMES, "hour", "total_bucket", "ttft_bucket"]
_CREATE_STAGE = (
    f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} ("
    + ", ".join(f"{name} {kind}" for name, kind in PG_COLUMNS)
    + ", hour timestamptz, total_bucket int2, ttft_bucket int2) ON COMMIT DELETE ROWS"
)
# The same aggregate upserts as the one-statement path (PG_BATCH from its `usage` CTE on),
# fed by the staging table's hours and buckets instead of parameter arrays.
_AGGREGATES = PG_BATCH[PG_BATCH.index("usage AS ("):]
_FROM_STAGE = (
    f"WITH ins AS (INSERT INTO {LEDGER.name} ({', '.join(_NAMES)}) SELECT {', '.join(_NAMES)} FROM {STAGE} "
    f"ON CONFLICT ({', '.join(CONFLICT_KEY)}) DO NOTHING "
    "RETURNING request_id, account_id, key_id, model, prompt_tokens, completion_tokens, status, total_ms, ttft_ms, cost_nanos, cached_tokens), "
    f"fresh AS (SELECT ins.*, s.hour, s.total_bucket, s.ttft_bucket FROM ins JOIN {STAGE} AS s USING (request_id)), "
    + _AGGREGATES
)


_ROW = operator.attrgetter(*_NAMES)  # a record's COPY tuple in one C call
MIN_PART_ROWS = 256  # a batch is split over the connections only in parts of at least this many rows
FAST_PATH = True  # False: every part through the staging table (tests and the bench compare)


def _month_partition(usage_rows: list[dict[str, Any]]) -> str | None:
    """The partition's table name when every row of a part falls in one UTC month (its aggregate
    rows' hours, from `deltas`, say so without another pass over the rows), else None."""
    months = {(row["hour"].year, row["hour"].month) for row in usage_rows}
    if len(months) != 1:
        return None
    ((year, month),) = months
    return f"{PARENT}_{year:04d}_{month:02d}"


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
        self._missing: set[str] = set()  # partitions found absent: their months go through the parent
        self.fallbacks = 0  # parts the fast path refused (a row already there) and the exact path wrote

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
        # Parts of at least MIN_PART_ROWS: a small batch (a lightly loaded gateway's: tens of rows per
        # linger) in one part costs one transaction, COPY and aggregate upsert instead of one per connection.
        size = max(-(-len(unique) // self.connections), MIN_PART_ROWS)
        parts = [unique[i:i + size] for i in range(0, len(unique), size)]
        try:
            if len(parts) == 1:  # most batches: one part, written here rather than in a task of its own
                written = [await self._write_part(self._held[0][1], parts[0])]
            else:
                written = await asyncio.gather(*(self._write_part(driver, part) for (_, driver), part in zip(self._held, parts)))
        except BaseException:
            await self.close(broken=True)
            raise
        return sum(written)

    async def _write_part(self, driver: Any, part: list[Any]) -> int:
        if FAST_PATH:
            try:
                return await self._copy_new(driver, part)
            except asyncpg.UniqueViolationError:
                self.fallbacks += 1  # a row already in the ledger: the exact path, by ON CONFLICT
        return await self._write_part_exact(driver, part)

    async def _copy_new(self, driver: Any, part: list[Any]) -> int:
        """The part as new rows: COPY into its month's partition and its own sums added to the
        aggregates, one transaction. Raises UniqueViolationError (nothing written) when a row exists."""
        usage_rows, latency_rows = deltas(part)
        rows = list(map(_ROW, part))
        partition = _month_partition(usage_rows)
        if partition in self._missing:
            partition = None
        while True:
            try:
                async with driver.transaction():
                    if partition is None:
                        await driver.copy_records_to_table(PARENT, records=rows, columns=_NAMES)
                    else:
                        await driver.copy_records_to_table(partition, schema_name=SCHEMA, records=rows, columns=_NAMES)
                    await upsert_deltas_pg(driver, usage_rows, latency_rows)
                return len(part)
            except (asyncpg.UndefinedTableError, asyncpg.CheckViolationError):
                if partition is None:  # the parent refused: not a partition question
                    raise
                # The month has no partition yet (or the rows are not all its): through the parent,
                # which routes each row (to the DEFAULT partition at worst).
                self._missing.add(partition)
                partition = None

    @staticmethod
    async def _write_part_exact(driver: Any, part: list[Any]) -> int:
        async with driver.transaction():
            await driver.copy_records_to_table(STAGE, records=[_staged(r) for r in part], columns=_STAGE_COLUMNS)
            return int(await driver.fetchval(_FROM_STAGE))

    async def close(self, *, broken: bool = False) -> None:
        held, self._held = self._held, []
        self._missing.clear()  # the server's job may have created them since
        for conn, _driver in held:
            try:
                if broken:
                    await conn.invalidate()
                await conn.close()
            except Exception as exc:
                log.debug("ledger connection close: %s", type(exc).__name__)
