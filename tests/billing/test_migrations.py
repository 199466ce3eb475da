"""One Alembic history that upgrades and downgrades cleanly on Postgres and SQLite, and matches the models."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from billing import migrate
from billing.db import create_engine
from billing.models import SQLModel
from tests.conftest import run_coro

TABLES = {
    "accounts", "api_keys", "ledger_entries", "prices", "usage_hourly", "latency_hourly", "dashboard_sessions",
    "price_overrides", "billing_periods", "invoices", "invoice_lines", "billing_accounts", "stripe_events",
    "stored_responses", "credit_entries", "credit_settings", "alert_rules", "alert_events", "alert_deliveries",
    "billing_details", "tax_rates", "document_sequences", "credit_notes",  # issue 22
    "credit_usage_marks", "prepaid_statements",  # issue 25
    "stored_files", "batches", "batch_lines",  # the Batch API
    "invoice_chargebacks",
}


async def _tables_and_diff(url: str) -> tuple[set[str], list[Any]]:
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            def inspect(sync_conn: Any) -> tuple[set[str], list[Any]]:
                names = set(sa.inspect(sync_conn).get_table_names()) - {"alembic_version"}
                diff = compare_metadata(MigrationContext.configure(sync_conn, opts={"compare_type": True}), SQLModel.metadata) if names else []
                return names, diff

            return await conn.run_sync(inspect)
    finally:
        await db.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest, fresh_pg_database: Any, tmp_path: Path) -> str:
    return fresh_pg_database() if request.param == "postgres" else f"sqlite:///{tmp_path / 'm.db'}"


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    migrate.upgrade(database_url)
    tables, diff = run_coro(_tables_and_diff(database_url))
    assert tables == TABLES
    assert diff == [], f"models and migrations differ: {diff}"
    migrate.downgrade(database_url, "base")
    assert run_coro(_tables_and_diff(database_url))[0] == set()
    migrate.upgrade(database_url)
    assert run_coro(_tables_and_diff(database_url))[0] == TABLES


def test_two_processes_migrating_one_database_at_once_both_succeed(database_url: str) -> None:
    """Replicas that start together each run the migrations (`tollgate serve` does before it serves):
    on Postgres they take turns (an advisory lock held for the migration's transaction), on SQLite
    too (BEGIN IMMEDIATE, waiting for the lock), and the later ones find the history applied.
    Before, they failed on the first's half-made tables (Postgres: duplicate key in pg_type /
    relation already exists; SQLite: table accounts already exists, or a revision applied twice)
    and that replica did not start."""
    import subprocess
    import sys

    url = database_url
    code = "import sys; from billing import migrate; migrate.upgrade(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(4)]
    failures = [err.decode()[-600:] for p in procs for _, err in [p.communicate(timeout=120)] if p.returncode != 0]
    assert failures == []
    assert run_coro(_tables_and_diff(url))[0] == TABLES


def _filled(table: sa.Table, **given: Any) -> dict[str, Any]:
    """A row for `table` as this revision has it: `given`, and a plain value for each other column
    that needs one (not null, no default)."""
    row = dict(given)
    for c in table.c:
        if c.name in row or c.primary_key or c.nullable or c.server_default is not None:
            continue
        kind = c.type
        row[c.name] = (datetime(2026, 9, 30, tzinfo=timezone.utc) if isinstance(kind, sa.DateTime) else
                       0 if isinstance(kind, (sa.Integer, sa.Numeric, sa.Boolean)) else "[]" if c.name == "price_versions" else "x")
    return row


async def _write_invoices(url: str) -> None:
    """An account with three paid September invoices of one line each, as 0024 left them: one plain,
    one charged back (dispute du_open), one whose chargeback a person settled (settled:du_old)."""
    db = create_engine(url)
    try:
        async with db.begin() as conn:
            meta = sa.MetaData()
            await conn.run_sync(lambda c: meta.reflect(c, only=["accounts", "invoices", "invoice_lines"]))
            accounts, invoices, lines = (meta.tables[n] for n in ("accounts", "invoices", "invoice_lines"))
            account = (await conn.execute(accounts.insert().values(**_filled(accounts, name="mig")).returning(accounts.c.id))).scalar_one()
            marks = [(None, None), (datetime(2026, 10, 20, tzinfo=timezone.utc), "du_open"), (None, "settled:du_old")]
            for i, (at, dispute) in enumerate(marks):
                invoice = (await conn.execute(invoices.insert().values(**_filled(
                    invoices, account_id=account, number=f"INV-{i}", period=f"2026-0{i + 7}", status="paid", currency="usd",
                    total_cents=1000 + i, charged_back_at=at, chargeback_dispute_id=dispute)).returning(invoices.c.id))).scalar_one()
                await conn.execute(lines.insert().values(**_filled(lines, invoice_id=invoice, position=0, tokens=10, amount_cents=1000 + i)))
    finally:
        await db.dispose()


async def _read(url: str, query: str) -> list[tuple[Any, ...]]:
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            return [tuple(r) for r in (await conn.execute(sa.text(query))).all()]
    finally:
        await db.dispose()


def test_invoices_with_chargebacks_migrate_up_and_down_with_their_lines(database_url: str) -> None:
    """0024 to 0026 and back on a database that has invoices: 0026 moves each dispute into
    invoice_chargebacks (an open one owed in full, a settled one settled) and keeps
    chargeback_dispute_id for the code before it. A batch rebuild of `invoices` (SQLite) failed there:
    invoice_lines' foreign key refused the DROP TABLE, and the database was left half migrated."""
    migrate.upgrade(database_url, "0024_invoice_chargebacks")
    run_coro(_write_invoices(database_url))
    migrate.upgrade(database_url)
    assert run_coro(_read(database_url, "SELECT number, chargeback_cents, chargeback_dispute_id FROM invoices ORDER BY number")) == [
        ("INV-0", 0, None), ("INV-1", 1001, "du_open"), ("INV-2", 0, "settled:du_old")]
    assert run_coro(_read(database_url, "SELECT i.number, c.dispute_id, c.amount_cents, c.settled_at IS NOT NULL FROM invoice_chargebacks c "
                                        "JOIN invoices i ON i.id = c.invoice_id ORDER BY i.number")) == [
        ("INV-1", "du_open", 1001, False), ("INV-2", "du_old", 1002, True)]
    migrate.downgrade(database_url, "0023_batch_lines_admitted_by")
    assert run_coro(_read(database_url, "SELECT count(*) FROM invoices JOIN invoice_lines l ON l.invoice_id = invoices.id")) == [(3,)]
    migrate.upgrade(database_url)
    assert run_coro(_tables_and_diff(database_url)) == (TABLES, [])


def test_a_downgrade_across_table_rebuilds_keeps_the_rows_it_does_not_drop(database_url: str) -> None:
    """Down to 0010 from head with accounts, invoices and their lines in the database: 0013 rebuilds
    `accounts` and 0011 `invoices` on SQLite (batch: copy, DROP TABLE, rename), which their foreign
    keys refused while enforced (`FOREIGN KEY constraint failed`, the database left between
    revisions). The migrations run with them off and check them after (migrations/env.py)."""
    migrate.upgrade(database_url, "0024_invoice_chargebacks")
    run_coro(_write_invoices(database_url))
    migrate.upgrade(database_url)
    migrate.downgrade(database_url, "0010_admitted_at")
    assert run_coro(_read(database_url, "SELECT count(*) FROM accounts")) == [(1,)]
    assert run_coro(_read(database_url, "SELECT count(*) FROM invoices JOIN invoice_lines l ON l.invoice_id = invoices.id")) == [(3,)]
    migrate.upgrade(database_url)
    assert run_coro(_tables_and_diff(database_url)) == (TABLES, [])


def test_a_chargeback_settled_before_0027_keeps_what_its_settlement_covered(database_url: str) -> None:
    """0027 adds settled_cents (what a settlement outside Stripe covered; the refund due once its
    dispute is won is that less what the dispute still takes back). A row settled before it gets its
    amount_cents, or, its dispute won already (amount 0: the customer paid twice), its disputed_cents.
    Down to 0026 and up again."""
    migrate.upgrade(database_url, "0024_invoice_chargebacks")
    run_coro(_write_invoices(database_url))
    migrate.upgrade(database_url, "0026_invoice_chargeback_disputes")
    run_coro(_read_write(database_url, "UPDATE invoice_chargebacks SET status = 'won', amount_cents = 0, disputed_cents = 700 "
                                       "WHERE dispute_id = 'du_old'"))
    migrate.upgrade(database_url)
    query = "SELECT dispute_id, amount_cents, settled_cents, refunded_cents FROM invoice_chargebacks ORDER BY dispute_id"
    assert run_coro(_read(database_url, query)) == [("du_old", 0, 700, 0), ("du_open", 1001, None, 0)]
    migrate.downgrade(database_url, "0026_invoice_chargeback_disputes")
    assert run_coro(_read(database_url, "SELECT dispute_id, amount_cents FROM invoice_chargebacks ORDER BY dispute_id")) == [
        ("du_old", 0), ("du_open", 1001)]
    migrate.upgrade(database_url)
    assert run_coro(_tables_and_diff(database_url)) == (TABLES, [])


async def _read_write(url: str, statement: str, *, foreign_keys: bool = True) -> None:
    db = create_engine(url, foreign_keys=foreign_keys)
    try:
        async with db.begin() as conn:
            await conn.execute(sa.text(statement))
    finally:
        await db.dispose()


def test_a_sqlite_migration_that_leaves_a_dangling_foreign_key_is_refused_and_rolled_back(tmp_path: Path) -> None:
    """SQLite migrations run with foreign keys off (a table rebuild is a DROP TABLE they would
    refuse); migrations/env.py checks them before committing. A line whose invoice is gone (put
    there with the keys off, as a migration could leave it) fails the next upgrade, which leaves
    the database at the revision it was at."""
    url = f"sqlite:///{tmp_path / 'fk.db'}"
    migrate.upgrade(url, "0027_chargeback_refund_due")
    run_coro(_write_invoices(url))
    run_coro(_read_write(url, "DELETE FROM invoices WHERE number = 'INV-0'", foreign_keys=False))
    with pytest.raises(RuntimeError, match="foreign keys point nowhere.*invoice_lines"):
        migrate.upgrade(url)
    assert run_coro(_read(url, "SELECT version_num FROM alembic_version")) == [("0027_chargeback_refund_due",)]
    assert "carried_in_cents" not in {c["name"] for c in run_coro(_columns(url, "invoices"))}
    run_coro(_read_write(url, "DELETE FROM invoice_lines WHERE invoice_id NOT IN (SELECT id FROM invoices)"))
    migrate.upgrade(url)
    assert run_coro(_read(url, "SELECT version_num FROM alembic_version")) == [("0028_invoice_carried",)]


async def _columns(url: str, table: str) -> list[dict[str, Any]]:
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            return await conn.run_sync(lambda c: sa.inspect(c).get_columns(table))
    finally:
        await db.dispose()
