"""One Alembic history that upgrades and downgrades cleanly on Postgres and SQLite, and matches the models."""

from __future__ import annotations

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


def test_two_processes_migrating_one_database_at_once_both_succeed(fresh_pg_database: Any) -> None:
    """Replicas that start together each run the migrations (`tollgate serve` does before it serves):
    on Postgres they take turns (an advisory lock held for the migration's transaction), and the
    second finds the history applied. Before, the second failed on the first's half-made tables
    (duplicate key in pg_type / relation already exists) and that replica did not start."""
    import subprocess
    import sys

    url = fresh_pg_database()
    code = "import sys; from billing import migrate; migrate.upgrade(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(4)]
    failures = [err.decode()[-600:] for p in procs for _, err in [p.communicate(timeout=120)] if p.returncode != 0]
    assert failures == []
    assert run_coro(_tables_and_diff(url))[0] == TABLES
