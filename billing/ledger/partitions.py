"""The ledger's monthly partitions on Postgres (docs/scaling.md: "A ledger for billions of rows").

`ledger_entries` is range-partitioned by `admitted_at` (migration 0012): one partition per UTC
month, `ledger_partitions.ledger_entries_YYYY_MM`, so a month of the ledger is exactly a billing
period, plus a DEFAULT partition that catches a row no month partition takes (it should stay empty).

    ensure_ahead()   creates this month's and the next `ahead` months' partitions (the server's job, hourly)
    partitions()     every partition with its month, its rows and whether it is attached
    archive()        copies closed months' partitions to files, detaches them (and drops them with --drop)

Idempotency with partitioning: a unique key on a partitioned table must contain the partition key,
so the ledger's is `(request_id, admitted_at)`. That is one row per request because every row a
request can get (its final row, the provisional `interrupted` row journaled at admission, a journal
replay) carries the same `admitted_at`: the instant set once at admission and journaled with the row.
SQLite keeps one unpartitioned table with the same key.

Archiving never touches invoices: they live in their own tables, and a month is archived only once
its billing period is closed (`billing_periods.status = 'closed'`). The hourly aggregates stay, so
dashboards and /v1/usage still show archived months.
"""

from __future__ import annotations

import gzip
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.invoices.periods import Period
from billing.periodic import every

log = logging.getLogger("tollgate.partitions")

SCHEMA = "ledger_partitions"
PARENT = "ledger_entries"
DEFAULT = "ledger_entries_default"
AHEAD_MONTHS = 3


def partition_name(period: Period) -> str:
    return f"{PARENT}_{period.year:04d}_{period.month_number:02d}"


def create_sql(period: Period) -> str:
    """DDL for one month's partition (IF NOT EXISTS: several servers run the job)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {SCHEMA}.{partition_name(period)} PARTITION OF {PARENT} "
        f"FOR VALUES FROM ('{period.start.isoformat()}') TO ('{period.end.isoformat()}')"
    )


async def is_partitioned(conn: Any) -> bool:
    if conn.dialect.name != "postgresql":
        return False
    found = await conn.execute(sa.text("SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(:t)"), {"t": PARENT})
    return found.first() is not None


async def ensure_ahead(db: AsyncEngine, now: datetime, ahead: int = AHEAD_MONTHS) -> list[str]:
    """Creates the partitions of `now`'s month and the `ahead` months after it that are missing;
    returns their names. Nothing on SQLite or an unpartitioned ledger."""
    made = []
    async with db.begin() as conn:
        if not await is_partitioned(conn):
            return []
        # Several servers run the job: one at a time (CREATE ... IF NOT EXISTS races on the catalog).
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('tollgate-ledger-partitions'))"))
        existing = {p.name for p in await _partitions(conn)}
        month = Period.containing(now)
        for _ in range(ahead + 1):
            if partition_name(month) not in existing:
                await _create(conn, month)
                made.append(partition_name(month))
            month = month.next()
    if made:
        log.info("ledger partitions created: %s", ", ".join(made))
    return made


async def _create(conn: Any, period: Period) -> None:
    """One month's partition. Rows of that month already in the DEFAULT partition (written while the
    month had no partition: the job was down for months, a clock far off) would make a plain CREATE
    fail; they are moved into the new table first, then it is attached (one transaction)."""
    bounds = {"s": period.start, "e": period.end}
    stray = (await conn.execute(sa.text(
        f"SELECT count(*) FROM {SCHEMA}.{DEFAULT} WHERE admitted_at >= :s AND admitted_at < :e"), bounds)).scalar_one()
    if not stray:
        await conn.execute(sa.text(create_sql(period)))
        return
    name = f"{SCHEMA}.{partition_name(period)}"
    await conn.execute(sa.text(f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS)"))
    await conn.execute(sa.text(
        f"WITH moved AS (DELETE FROM {SCHEMA}.{DEFAULT} WHERE admitted_at >= :s AND admitted_at < :e RETURNING *) "
        f"INSERT INTO {name} SELECT * FROM moved"), bounds)
    await conn.execute(sa.text(
        f"ALTER TABLE {PARENT} ATTACH PARTITION {name} FOR VALUES FROM ('{period.start.isoformat()}') TO ('{period.end.isoformat()}')"))
    log.warning("ledger partition %s created with %d rows moved from the default partition", name, stray)


@dataclass(frozen=True)
class Partition:
    name: str
    period: Period | None  # None: the DEFAULT partition
    attached: bool
    rows: int | None = None


async def _partitions(conn: Any) -> list[Partition]:
    rows = (await conn.execute(sa.text(
        "SELECT c.relname, c.relispartition FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = :schema AND c.relkind = 'r' ORDER BY c.relname"), {"schema": SCHEMA})).all()
    out = []
    for name, attached in rows:
        period = None
        if name != DEFAULT:
            year, month = name.removeprefix(PARENT + "_").split("_")
            period = Period.month(int(year), int(month))
        out.append(Partition(name, period, bool(attached)))
    return out


async def partitions(db: AsyncEngine, *, count_rows: bool = False) -> list[Partition]:
    async with db.connect() as conn:
        if not await is_partitioned(conn):
            return []
        found = await _partitions(conn)
        if not count_rows:
            return found
        counted = []
        for p in found:
            n = (await conn.execute(sa.text(f"SELECT count(*) FROM {SCHEMA}.{p.name}"))).scalar_one()
            counted.append(Partition(p.name, p.period, p.attached, int(n)))
        return counted


async def keep_ahead(db: AsyncEngine, clock: Any, interval: float = 3600.0) -> None:
    """The server's job: partitions for this month and the next ones, at start and then hourly
    (several servers: CREATE ... IF NOT EXISTS, and a failure is retried the next hour)."""
    def not_created(exc: Exception) -> None:  # a database outage: the months ahead leave time to retry
        log.warning("ledger partitions not created this time: %s", type(exc).__name__)

    await every(interval, lambda: ensure_ahead(db, clock()), on_error=not_created, first=True)


class ArchiveRefused(Exception):
    pass


@dataclass(frozen=True)
class Archived:
    name: str
    period: Period
    rows: int
    file: Path
    dropped: bool


async def _period_closed(conn: Any, period: Period) -> bool:
    status = (await conn.execute(sa.text("SELECT status FROM billing_periods WHERE period = :p"), {"p": str(period)})).scalar()
    return status == "closed"


async def archive(db: AsyncEngine, before: Period, out_dir: Path, *, drop: bool = False) -> list[Archived]:
    """Every attached month partition before `before`: its rows copied to
    `out_dir/<partition>.csv.gz` (CSV with a header, the ledger's columns), then detached from the
    ledger, and dropped with `drop` (else kept, detached, in the ledger_partitions schema). Refused
    (nothing done) when one of those months' billing period is not closed yet."""
    out_dir.mkdir(parents=True, exist_ok=True)
    async with db.connect() as conn:
        if not await is_partitioned(conn):
            raise ArchiveRefused("the ledger is not partitioned (SQLite, or migration 0012 not applied)")
        due = [p for p in await _partitions(conn) if p.attached and p.period is not None and p.period < before]
        open_months = [str(p.period) for p in due if not await _period_closed(conn, p.period)]  # type: ignore[arg-type]
    if open_months:
        raise ArchiveRefused(f"months not closed yet (close them first: tollgate invoices close): {', '.join(open_months)}")
    done = []
    for p in due:
        assert p.period is not None
        path = out_dir / f"{p.name}.csv.gz"
        rows = await _copy_out(db, p.name, path)
        async with db.begin() as conn:
            await conn.execute(sa.text(f"ALTER TABLE {PARENT} DETACH PARTITION {SCHEMA}.{p.name}"))
            if drop:
                await conn.execute(sa.text(f"DROP TABLE {SCHEMA}.{p.name}"))
        log.info("ledger partition %s archived to %s (%d rows)%s", p.name, path, rows, ", dropped" if drop else "")
        done.append(Archived(p.name, p.period, rows, path, drop))
    return done


async def _copy_out(db: AsyncEngine, name: str, path: Path) -> int:
    """COPY ... TO STDOUT through the asyncpg connection, written gzip'd; returns the rows copied."""
    async with db.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        tmp = path.with_suffix(".part")
        with gzip.open(tmp, "wb") as out:
            status = await driver.copy_from_table(name, schema_name=SCHEMA, output=out, format="csv", header=True)
        tmp.replace(path)
    return int(status.split()[-1])
