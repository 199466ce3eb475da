"""The usage ledger: one row per admitted request, written idempotently by request_id.

Writers call `LedgerWriter.record()` from a `finally`; it never awaits and never raises, so a
cancelled request task still gets its row. A background task inserts rows in batches with
`ON CONFLICT (request_id, admitted_at) DO NOTHING`, retrying (never dropping) while the database is down.
The same transaction adds the rows it actually inserted to the hourly aggregates
(`billing.ledger.aggregates`), so those stay exact sums of the ledger however often a batch is retried.

With a journal (`billing.ledger.journal`), `admitted()` and `record()` also append to a local file before
they return, and a written batch is acknowledged there: rows outlive a database outage and a crash
of this process, and `recover()` replays them on the next start (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.ledger.journal import JournalLocked, LedgerJournal, Recovered, record_fields
from billing.ledger.pg_copy import CopySession
from billing.ledger.sql import CONFLICT_KEY, LEDGER, PG_BATCH, PG_COLUMNS
from billing.models import utcnow
from billing.quota import Hold
from billing.ledger.records import UsageRecord
from billing.ledger.aggregates import add_to_aggregates, hour_of, latency_bucket

log = logging.getLogger("tollgate.ledger")

# Postgres writes a batch as one array-bound statement (billing/ledger/sql.py's PG_BATCH);
# False: SQLAlchemy's executemany (bench/ledger_writer.py compares the two).
PG_ARRAY_INSERT = True


def insert_ignoring_duplicates(dialect_name: str) -> Any:
    if dialect_name == "postgresql":
        return postgresql.insert(LEDGER).on_conflict_do_nothing(index_elements=CONFLICT_KEY)
    if dialect_name == "sqlite":
        return sqlite.insert(LEDGER).on_conflict_do_nothing(index_elements=CONFLICT_KEY)
    raise ValueError(f"unsupported dialect {dialect_name}")


async def _write_pg(driver: Any, records: list[UsageRecord]) -> int:
    """The batch's rows and what the new ones add to the aggregates: one statement on an asyncpg
    connection (atomic by itself, or inside the caller's transaction). Returns how many rows were new."""
    unique = records
    if len({r.request_id for r in records}) != len(records):  # a request id twice in one batch: its first row counts
        firsts: dict[str, UsageRecord] = {}
        for r in records:
            firsts.setdefault(r.request_id, r)
        unique = list(firsts.values())
    columns = [[getattr(r, name) for r in unique] for name, _ in PG_COLUMNS]
    extra = (
        columns[0],
        [hour_of(r.admitted_at) for r in unique],  # type: ignore[arg-type]
        [latency_bucket(r.total_ms) for r in unique],
        [None if r.ttft_ms is None else latency_bucket(r.ttft_ms) for r in unique],
    )
    return int(await driver.fetchval(PG_BATCH, *columns, *extra))


class PgSession:
    """The ledger writer's own Postgres connection, held between batches (asyncpg under SQLAlchemy's
    pool): a batch is one statement, without the pool checkout, liveness
    ping and SQLAlchemy transaction that cost more CPU than the statements themselves at the batch
    sizes light load makes (docs/performance.md). Any failure drops the connection; the next batch
    takes a fresh one."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._conn: Any = None  # the AsyncConnection held
        self._driver: Any = None

    @staticmethod
    def applies(engine: AsyncEngine) -> bool:
        return PG_ARRAY_INSERT and engine.dialect.name == "postgresql" and engine.dialect.driver == "asyncpg"

    async def write(self, records: list[UsageRecord]) -> int:
        if not records:
            return 0
        if self._driver is None:
            self._conn = await self.engine.connect()
            self._driver = (await self._conn.get_raw_connection()).driver_connection
        try:
            return await _write_pg(self._driver, records)
        except BaseException:
            await self.close(broken=True)
            raise

    async def close(self, *, broken: bool = False) -> None:
        conn, self._conn, self._driver = self._conn, None, None
        if conn is None:
            return
        try:
            if broken:
                await conn.invalidate()  # never handed to anyone again
            await conn.close()
        except Exception as exc:
            log.debug("ledger connection close: %s", type(exc).__name__)


async def write_records(engine: AsyncEngine, records: list[UsageRecord]) -> int:
    """Inserts rows; a request_id already present is left as it is (a repeat is success).
    Returns how many rows were new; only those are added to the hourly aggregates."""
    if not records:
        return 0
    async with engine.begin() as conn:
        if PgSession.applies(engine):
            return await _write_pg((await conn.get_raw_connection()).driver_connection, records)
        stmt = insert_ignoring_duplicates(engine.dialect.name).returning(LEDGER.c.request_id)
        inserted = set((await conn.execute(stmt, [asdict(r) for r in records])).scalars())
        fresh = []
        for r in records:
            if r.request_id in inserted:
                inserted.discard(r.request_id)  # a request_id twice in one batch is inserted once
                fresh.append(r)
        await add_to_aggregates(conn, fresh)
    return len(fresh)


class LedgerWriter:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        batch_size: int = 1000,
        max_backoff: float = 5.0,
        journal: LedgerJournal | None = None,
        max_backlog: int = 0,
        linger: float = 0.0,
        copy_connections: int = 0,
    ) -> None:
        self._engine = engine
        # Seconds the writer waits after the first row of a batch for more to join it (unless the
        # batch is full): under light load one insert per ~linger instead of one per request.
        self._linger = linger
        self.journal = journal
        self.max_backlog = max_backlog  # 0: keep serving whatever the backlog; else refuse above it
        self._batch_size = batch_size
        self._max_backoff = max_backoff
        self._pending: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._submitted = 0
        self._written = 0
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._listeners: list[Callable[[UsageRecord], None]] = []
        self._written_listeners: list[Callable[[list[UsageRecord]], None]] = []
        self.write_errors = 0
        self._session: Any = PgSession(engine) if PgSession.applies(engine) else None
        if copy_connections and self._session is not None:  # binary COPY on several connections (billing/ledger/pg_copy.py)
            self._session = CopySession(engine, copy_connections)

    @property
    def backlog(self) -> int:
        return self._submitted - self._written

    @property
    def lag_seconds(self) -> float:
        """Age of the oldest row not yet in the database (0 when none is waiting)."""
        if not self._pending:
            return 0.0
        return max(0.0, (utcnow() - self._pending[0].created_at).total_seconds())

    @property
    def refusing(self) -> bool:
        """True while the policy says to refuse new requests: the backlog is over `max_backlog`."""
        return self.max_backlog > 0 and self.backlog > self.max_backlog

    def unconfirmed(self) -> list[UsageRecord]:
        """Rows recorded (or replayed from the journal) that the database has not confirmed yet."""
        return list(self._pending)

    def admitted(self, record: UsageRecord, hold: dict[str, Any] | None = None) -> None:
        """Journals an admitted request's provisional row (status `interrupted`) and its quota hold,
        so a crash before its final row still leaves a row and a hold to release. Never raises."""
        if self.journal is not None:
            try:
                self.journal.admitted(record, hold)
            except Exception:
                log.exception("ledger journal: admission not journaled")

    def recover(self) -> Recovered:
        """Opens the journal and queues the rows earlier runs left unwritten (before `start()`)."""
        assert self.journal is not None
        recovered = self.journal.open()
        rows = self.requeue(recovered)
        if rows or recovered.torn_lines:
            log.warning(
                "ledger journal: replaying %d unwritten rows, %d interrupted requests (%d torn lines)",
                len(recovered.replayed), len(recovered.interrupted), recovered.torn_lines,
            )
        return recovered

    def requeue(self, recovered: Recovered) -> list[dict[str, Any]]:
        """Queues the rows a journal's earlier run left unwritten (replayed and interrupted ones)."""
        rows = [*recovered.replayed, *(row for row, _hold in recovered.interrupted)]
        for row in rows:
            self._pending.append(record_fields(row, UsageRecord))
        self._submitted += len(rows)
        self._wake.set()
        return rows

    def add_listener(self, listener: Callable[[UsageRecord], None]) -> None:
        """Calls `listener(record)` synchronously in `record()`; a failing listener is logged, never raised."""
        self._listeners.append(listener)

    def on_written(self, listener: Callable[[list[UsageRecord]], None]) -> None:
        """Calls `listener(rows)` with each batch the database has confirmed; a failing listener is
        logged, never raised."""
        self._written_listeners.append(listener)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-writer")

    def record(self, record: UsageRecord) -> None:
        """Queues a row. Synchronous on purpose: safe inside `finally` of a cancelled task."""
        if self.journal is not None:
            try:
                self.journal.final(record)
            except Exception:
                log.exception("ledger journal: row kept in memory only")
        self._pending.append(record)
        self._submitted += 1
        self._wake.set()
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # observers must not cost a ledger row
                log.exception("ledger listener %r failed", listener)

    async def flush(self, timeout: float | None = None) -> None:
        """Waits until every row recorded before this call is in the database."""
        target = self._submitted
        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(lambda: self._written >= target), timeout)

    async def close(self, timeout: float = 30.0) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except asyncio.TimeoutError:
                log.error("ledger writer: %d rows not written at shutdown (kept in the journal)", self.backlog)
                self._task.cancel()
            self._task = None
        if self._session is not None:
            await self._session.close()
        if self.journal is not None:
            self.journal.close()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._linger and len(self._pending) < self._batch_size and not self._closing:
                await asyncio.sleep(self._linger)
            batch = self._pending[: self._batch_size]
            try:
                if self._session is not None:
                    await self._session.write(batch)
                else:
                    await write_records(self._engine, batch)
            except Exception as exc:  # the database is down or refusing: keep the rows, retry
                self.write_errors += 1
                log.error("ledger write failed (%d rows kept, retrying): %s", len(batch), type(exc).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)
                continue
            backoff = 0.05
            if self.journal is not None:
                self.journal.acknowledged([r.request_id for r in batch])
            del self._pending[: len(batch)]
            for written in self._written_listeners:
                try:
                    written(batch)
                except Exception:
                    log.exception("ledger written-listener %r failed", written)
            async with self._progress:
                self._written += len(batch)
                self._progress.notify_all()


async def release_interrupted(
    ledger: LedgerWriter, settle: Callable[[Hold, int, int], Awaitable[bool]], recovered: Recovered, *, wait: float
) -> int:
    """Settles the quota holds of requests a crash interrupted, with what their rows say. The rows
    go first (up to `wait` seconds), so counters rebuilt in between already see them; holds would
    expire by themselves anyway. Returns how many holds were released."""
    if not recovered.interrupted:
        return 0
    try:
        await ledger.flush(timeout=wait)
    except asyncio.TimeoutError:
        log.warning("ledger journal: releasing interrupted holds before their rows reached the database")
    released = 0
    for row, hold in recovered.interrupted:
        if hold is None or not hold.get("scopes"):
            continue
        try:
            released += bool(await settle(Hold.from_json(hold), row["prompt_tokens"] + row["completion_tokens"], row.get("cost_nanos") or 0))
        except Exception as exc:  # the hold expires by itself
            log.warning("could not release the hold of interrupted request %s: %s", row["request_id"], type(exc).__name__)
    log.warning("ledger journal: released %d quota holds of interrupted requests", released)
    return released


async def adopt_journal(
    ledger: LedgerWriter, settle: Callable[[Hold, int, int], Awaitable[bool]], directory: Path, *, wait: float = 30.0
) -> bool:
    """Finishes the journal a process that no longer runs left behind (a worker of a server since
    restarted with fewer workers): its unwritten rows go to the database through `ledger` (exactly
    once, by request_id), its interrupted requests' holds are released, then the directory goes.
    False (and the directory kept for the next start) when it is locked or the rows could not be written."""
    journal = LedgerJournal(directory)
    try:
        recovered = journal.open()
    except JournalLocked:
        return False
    try:
        rows = ledger.requeue(recovered)
        try:
            await ledger.flush(timeout=wait)
        except asyncio.TimeoutError:
            log.warning("ledger journal %s: rows not written yet; kept for the next start", directory)
            return False
        await release_interrupted(ledger, settle, recovered, wait=wait)
        log.warning("ledger journal %s of a worker no longer running: %d rows written", directory, len(rows))
    finally:
        journal.close()
    shutil.rmtree(directory, ignore_errors=True)
    return True


async def usage_rows(
    engine: AsyncEngine,
    *,
    account_id: int | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    query = sa.select(LEDGER).order_by(LEDGER.c.id.desc()).limit(limit)
    query = _filtered(query, account_id, start, end)
    async with engine.connect() as conn:
        result = await conn.execute(query)
        return [dict(row._mapping) for row in result]


async def usage_totals(
    engine: AsyncEngine,
    *,
    account_id: int | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
) -> list[dict[str, Any]]:
    """Sums per account and model: requests, prompt and completion tokens."""
    query = sa.select(
        LEDGER.c.account_id,
        LEDGER.c.model,
        sa.func.count().label("requests"),
        sa.func.coalesce(sa.func.sum(LEDGER.c.prompt_tokens), 0).label("prompt_tokens"),
        sa.func.coalesce(sa.func.sum(LEDGER.c.completion_tokens), 0).label("completion_tokens"),
        sa.func.coalesce(sa.func.sum(LEDGER.c.cached_tokens), 0).label("cached_tokens"),
    ).group_by(LEDGER.c.account_id, LEDGER.c.model)
    query = _filtered(query, account_id, start, end).order_by(LEDGER.c.account_id, LEDGER.c.model)
    async with engine.connect() as conn:
        result = await conn.execute(query)
        return [
            {
                "account_id": row.account_id,
                "model": row.model,
                "requests": int(row.requests),
                "prompt_tokens": int(row.prompt_tokens),
                "completion_tokens": int(row.completion_tokens),
                "total_tokens": int(row.prompt_tokens) + int(row.completion_tokens),
                "cached_tokens": int(row.cached_tokens),
            }
            for row in result
        ]


def _filtered(query: Any, account_id: int | None, start: datetime | None, end: datetime | None) -> Any:
    if account_id is not None:
        query = query.where(LEDGER.c.account_id == account_id)
    if start is not None:
        query = query.where(LEDGER.c.admitted_at >= start)
    if end is not None:
        query = query.where(LEDGER.c.admitted_at < end)
    return query
