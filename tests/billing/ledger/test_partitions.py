"""The ledger partitioned by month on Postgres (migration 0012, billing/ledger/partitions.py, `tollgate ledger`):
today's rows move into their months' partitions; a replayed batch is still one row per request with
the aggregates counted once; the server's job creates the months ahead; closed months are archived to
files and detached by the CLI without touching issued invoices, and open months are refused."""

from __future__ import annotations

import csv
import gzip
import hashlib
import os
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from billing import migrate
from billing.ledger import partitions
from billing.db import create_engine
from billing.invoices.close import close_period
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from tests import cli_runner
from tests.billing.invoice_helpers import at, new_account, price_history

BEFORE = "0011_billing_details"  # the revision before partitioning


def record(account_id: int, admitted: datetime, model: str = "alpha", tokens: tuple[int, int] = (10, 5), rid: str | None = None) -> UsageRecord:
    return UsageRecord(request_id=rid or uuid.uuid4().hex, account_id=account_id, key_id=1, model=model, prompt_tokens=tokens[0],
                       completion_tokens=tokens[1], status="completed", finish_reason="stop", total_ms=250.0, cost_nanos=7,
                       created_at=admitted + timedelta(milliseconds=250), admitted_at=admitted)


async def per_partition(db: Any) -> dict[str, int]:
    async with db.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT tableoid::regclass::text, count(*) FROM ledger_entries GROUP BY 1"))).all()
    return {name.removeprefix("ledger_partitions."): int(n) for name, n in rows}


async def aggregates_match_ledger(db: Any) -> None:
    async with db.connect() as conn:
        ledger = (await conn.execute(sa.text(
            "SELECT count(*), sum(prompt_tokens), sum(completion_tokens) FROM ledger_entries"))).one()
        hourly = (await conn.execute(sa.text(
            "SELECT sum(requests), sum(prompt_tokens), sum(completion_tokens) FROM usage_hourly"))).one()
    assert tuple(ledger) == tuple(hourly), (ledger, hourly)


async def test_migration_moves_todays_rows_into_their_months(fresh_pg_database: Any) -> None:
    url = fresh_pg_database()
    migrate.upgrade(url, BEFORE)
    db = create_engine(url)
    try:
        months = {at(9, 30, 23, 59, 59, 999_999): 3, at(10, 1, 0): 2, at(11, 15): 4}  # admitted instants -> rows
        async with db.begin() as conn:  # rows as the writer of revision 0011 left them (SQL: today's models are ahead)
            account = (await conn.execute(sa.text("INSERT INTO accounts (name, created_at) VALUES ('a', now()) RETURNING id"))).scalar()
            for when, n in months.items():
                for _ in range(n):
                    await conn.execute(sa.text(
                        "INSERT INTO ledger_entries (request_id, account_id, key_id, model, prompt_tokens, completion_tokens, status, "
                        "finish_reason, estimated, total_ms, cached, created_at, admitted_at) VALUES (:r, :a, 1, 'alpha', 10, 5, "
                        "'completed', 'stop', false, 250, false, :c, :w)"),
                        {"r": uuid.uuid4().hex, "a": account, "c": when + timedelta(milliseconds=250), "w": when})
        async with db.connect() as conn:
            before = [dict(r._mapping) for r in (await conn.execute(sa.text("SELECT * FROM ledger_entries ORDER BY id"))).all()]
        await db.dispose()  # pooled connections hold statements planned on the table before the migration
        migrate.upgrade(url)
        async with db.connect() as conn:
            assert await partitions.is_partitioned(conn)
            after = [dict(r._mapping) for r in (await conn.execute(sa.text("SELECT * FROM ledger_entries ORDER BY id"))).all()]
        # every row, every column it had, the same ids (later revisions add columns)
        assert [{k: r[k] for k in before[0]} for r in after] == before
        counts = await per_partition(db)
        assert counts == {"ledger_entries_2026_09": 3, "ledger_entries_2026_10": 2, "ledger_entries_2026_11": 4}
        now = Period.containing(datetime.now(timezone.utc))
        names = {p.name for p in await partitions.partitions(db)}
        assert {partitions.partition_name(now.next().next().next()), partitions.DEFAULT} <= names  # three months ahead
        fresh = record(account, at(11, 20))
        await write_records(db, [fresh])  # the id sequence goes on
        async with db.connect() as conn:
            new_id = (await conn.execute(sa.text("SELECT id FROM ledger_entries WHERE request_id = :r"), {"r": fresh.request_id})).scalar()
        assert new_id > max(r["id"] for r in before)
        migrate.downgrade(url, BEFORE)  # and back: one table with every row
        async with db.connect() as conn:
            assert not await partitions.is_partitioned(conn)
            assert (await conn.execute(sa.text("SELECT count(*) FROM ledger_entries"))).scalar() == len(before) + 1
    finally:
        await db.dispose()


async def test_replayed_rows_stay_one_per_request_across_partitions(fresh_pg_database: Any) -> None:
    """The unique key is (request_id, admitted_at): a batch written again (a retry whose first commit
    did land, a journal replay) adds no row and nothing to the aggregates, in any month, because the
    writer keeps the admission instant with the row."""
    url = fresh_pg_database()
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        await partitions.ensure_ahead(db, at(10, 1), ahead=1)  # October and November (the migration made December on)
        account = await new_account(db)
        # Admitted a microsecond before December, finished in December: its month is November's.
        edge = record(account, at(11, 30, 23, 59, 59, 999_999))
        batch = [edge, record(account, at(12, 1, 0)), record(account, at(10, 3))]
        assert await write_records(db, batch) == 3
        replay = [UsageRecord(**{**r.__dict__, "status": "interrupted", "completion_tokens": 0}) for r in batch]
        assert await write_records(db, batch + replay) == 0
        counts = await per_partition(db)
        assert counts == {"ledger_entries_2026_10": 1, "ledger_entries_2026_11": 1, "ledger_entries_2026_12": 1}, counts
        async with db.connect() as conn:
            statuses = set((await conn.execute(sa.text("SELECT status FROM ledger_entries"))).scalars())
        assert statuses == {"completed"}  # the first row stays
        await aggregates_match_ledger(db)
    finally:
        await db.dispose()


async def test_job_creates_months_ahead(fresh_pg_database: Any) -> None:
    url = fresh_pg_database()
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        later = datetime(2027, 11, 10, tzinfo=timezone.utc)
        made = await partitions.ensure_ahead(db, later, ahead=2)
        assert made == ["ledger_entries_2027_11", "ledger_entries_2027_12", "ledger_entries_2028_01"]
        assert await partitions.ensure_ahead(db, later, ahead=2) == []  # idempotent (several servers)
        account = await new_account(db)
        await write_records(db, [record(account, datetime(2028, 1, 31, 23, tzinfo=timezone.utc))])
        assert (await per_partition(db)) == {"ledger_entries_2028_01": 1}  # not the default partition
        # A month the job never made (it was down): its rows wait in the default partition, and
        # are moved into the month's partition when it is made.
        stray = [record(account, datetime(2028, 5, 2, tzinfo=timezone.utc)) for _ in range(3)]
        await write_records(db, stray + [record(account, datetime(2028, 9, 1, tzinfo=timezone.utc))])
        assert (await per_partition(db))["ledger_entries_default"] == 4
        assert await partitions.ensure_ahead(db, datetime(2028, 5, 20, tzinfo=timezone.utc), ahead=0) == ["ledger_entries_2028_05"]
        counts = await per_partition(db)
        assert counts["ledger_entries_2028_05"] == 3 and counts["ledger_entries_default"] == 1, counts
        assert await write_records(db, stray) == 0  # still one row per request after the move
        await aggregates_match_ledger(db)
    finally:
        await db.dispose()


def tollgate(url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return cli_runner.tollgate(["ledger", *argv], {**os.environ, "DATABASE_URL": url})


async def invoices_digest(db: Any) -> str:
    async with db.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT * FROM invoices ORDER BY id"))).all()
        lines = (await conn.execute(sa.text("SELECT * FROM invoice_lines ORDER BY id"))).all()
    return hashlib.sha256(repr((rows, lines)).encode()).hexdigest()


async def test_archive_closed_months_only_and_leave_invoices_alone(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database()
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        await partitions.ensure_ahead(db, at(9, 1), ahead=2)
        book = PriceBook(db)
        await price_history(book)
        account = await new_account(db)
        rows = [record(account, at(9, 20)), record(account, at(10, 5)), record(account, at(10, 6), tokens=(1000, 2000)),
                record(account, at(11, 2))]
        await write_records(db, rows)
        for period in ("2026-09", "2026-10"):
            await close_period(db, book, Period.parse(period))
        issued = await invoices_digest(db)
        async with db.connect() as conn:
            assert (await conn.execute(sa.text("SELECT count(*) FROM invoices"))).scalar() == 2

        refused = tollgate(url, "archive", "--before", "2026-12", "--to", str(tmp_path))
        assert refused.returncode == 1 and "2026-11" in refused.stderr, refused.stderr  # November is not closed
        assert (await per_partition(db))["ledger_entries_2026_09"] == 1  # nothing was done

        done = tollgate(url, "archive", "--before", "2026-11", "--to", str(tmp_path), "--drop")
        assert done.returncode == 0, done.stderr
        assert "ledger_entries_2026_09: 1 rows" in done.stdout and "ledger_entries_2026_10: 2 rows" in done.stdout
        with gzip.open(tmp_path / "ledger_entries_2026_10.csv.gz", "rt") as f:
            archived = list(csv.DictReader(f))
        assert sorted(r["request_id"] for r in archived) == sorted(r.request_id for r in rows[1:3])
        assert sum(int(r["prompt_tokens"]) for r in archived) == 1010
        assert await per_partition(db) == {"ledger_entries_2026_11": 1}
        listed = tollgate(url, "partitions", "--json")
        assert "ledger_entries_2026_10" not in listed.stdout and "ledger_entries_2026_11" in listed.stdout
        assert await invoices_digest(db) == issued  # issued invoices untouched
        # Closing an archived month again answers from its stored invoices, unchanged.
        await close_period(db, book, Period.parse("2026-10"))
        assert await invoices_digest(db) == issued
    finally:
        await db.dispose()


def test_sqlite_is_not_partitioned(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    migrate.upgrade(url)
    out = tollgate(url, "partitions")
    assert out.returncode == 1 and "not partitioned" in out.stderr
