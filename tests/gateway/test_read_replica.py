"""DATABASE_READ_URL: /v1/usage, /admin/usage and the dashboards read from the replica, never the
writer. The "replica" is another real database (a copy of the writer's made with CREATE DATABASE ...
TEMPLATE, then given usage the writer does not have) reached as a role that may only SELECT: what
the answers say can only have come from it, and nothing can be written through it."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from billing.db import create_engine
from billing.invoices.views import list_invoices
from billing.invoices.close import close_period
from billing.keys.store import KeyStore
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from gateway.app import create_app
from gateway.config import Settings
from tests.billing.invoice_helpers import usage
from tests.conftest import PG_HOST, PG_PORT, SECRET, ServerThread, _admin_sql, bootstrap, run_coro


def make_replica(writer_db: str) -> tuple[str, str]:
    """A copy of the writer's database and a SELECT-only role on it; returns (name, role)."""
    name, role = f"tollgate_replica_{uuid.uuid4().hex[:10]}", f"tg_reader_{uuid.uuid4().hex[:8]}"
    run_coro(_admin_sql(f'CREATE DATABASE "{name}" TEMPLATE "{writer_db}"'))
    run_coro(_admin_sql(f'CREATE ROLE "{role}" LOGIN'))

    async def grant() -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user="postgres", database=name)
        try:
            await conn.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"; GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"')
        finally:
            await conn.close()

    run_coro(grant())
    return name, role


async def add_replica_usage(name: str, account_id: int, key_id: int, tokens: int) -> None:
    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user="postgres", database=name)
    try:
        hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
        await conn.execute(
            "INSERT INTO usage_hourly (hour, account_id, key_id, model, requests, prompt_tokens, completion_tokens, cost_nanos, "
            "unpriced, errors, cancelled, ttft_count, total_ms_sum, ttft_ms_sum, cached_tokens) "
            "VALUES ($1, $2, $3, 'm', 7, $4, 0, 0, 7, 0, 0, 0, 0, 0, 0)", hour, account_id, key_id, tokens)
    finally:
        await conn.close()


async def test_usage_reads_come_from_the_replica(fresh_pg_database: Any, tmp_path: Path) -> None:
    writer_url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(writer_url, SECRET)
    db = create_engine(writer_url)
    keys = KeyStore(db, SECRET.encode())
    account = await keys.create_account(f"acct-{uuid.uuid4().hex[:8]}")
    key = await keys.create_key(account["id"])
    await db.dispose()
    replica, role = make_replica(writer_url.rsplit("/", 1)[1])
    await add_replica_usage(replica, account["id"], key["id"], 4242)
    read_url = f"postgresql://{role}@{PG_HOST}:{PG_PORT}/{replica}"
    app = create_app(Settings(database_url=writer_url, database_read_url=read_url, server_secret=SECRET, data_dir=tmp_path), engines={})
    try:
        with ServerThread(app) as server:
            base = f"http://127.0.0.1:{server.port}"
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key['key']}"}, timeout=30) as c:
                mine = await c.get("/v1/usage")
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as a:
                overall = await a.get("/v1/usage", params={"account_id": account["id"]})
                created = await a.post("/admin/accounts", json={"name": f"w-{uuid.uuid4().hex[:6]}"})  # writes: the writer
        assert mine.status_code == 200, mine.text
        assert mine.json()["totals"]["prompt_tokens"] == 4242 and mine.json()["totals"]["requests"] == 7  # only the replica has them
        assert overall.json()["totals"]["prompt_tokens"] == 4242
        assert created.status_code == 201, created.text
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user="postgres", database=replica)
        try:
            assert await conn.fetchval("SELECT count(*) FROM accounts WHERE name = $1", created.json()["name"]) == 0
        finally:
            await conn.close()
    finally:
        run_coro(_admin_sql(f'DROP DATABASE IF EXISTS "{replica}" WITH (FORCE)'))
        run_coro(_admin_sql(f'DROP ROLE IF EXISTS "{role}"'))



TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


@contextlib.contextmanager
def dashboard_session(base: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, timeout=30) as session:
        yield _logged_in(session, key)


def _logged_in(session: httpx.Client, key: str) -> httpx.Client:
    form = session.get("/dashboard/login")
    login = session.post("/dashboard/login", data={"csrf_token": TOKEN.search(form.text).group(1), "api_key": key})  # type: ignore[union-attr]
    assert login.status_code == 303, login.text
    return session


async def test_dashboard_invoices_come_from_the_replica(fresh_pg_database: Any, tmp_path: Path) -> None:
    """The dashboards' billing parts (gateway/dashboard/billing.py) read from DATABASE_READ_URL: the
    customer's and the admin's invoice tables, the invoice download and the admin's billing details
    show what only the replica holds (an invoice renumbered there, details written there)."""
    writer_url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(writer_url, SECRET)
    db = create_engine(writer_url)
    try:
        keys = KeyStore(db, SECRET.encode())
        account = await keys.create_account(f"acct-{uuid.uuid4().hex[:8]}")
        key = await keys.create_key(account["id"])
        book = PriceBook(db)
        await book.add("m", "1.000", "2.000", datetime(2026, 9, 1, tzinfo=timezone.utc), backdate=True)
        await usage(db, account["id"], "m", 1_000_000, 500_000, datetime(2026, 10, 5, 12, tzinfo=timezone.utc))
        await close_period(db, book, Period.parse("2026-10"))
        [invoice] = await list_invoices(db, account_id=account["id"])
    finally:
        await db.dispose()
    replica, role = make_replica(writer_url.rsplit("/", 1)[1])
    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user="postgres", database=replica)
    try:
        await conn.execute("UPDATE invoices SET number = 'REPLICA-0001' WHERE id = $1", invoice["id"])
        await conn.execute("INSERT INTO billing_details (account_id, legal_name, country, updated_at) VALUES ($1, 'Replica Only GmbH', 'DE', now())", account["id"])
    finally:
        await conn.close()
    read_url = f"postgresql://{role}@{PG_HOST}:{PG_PORT}/{replica}"
    app = create_app(Settings(database_url=writer_url, database_read_url=read_url, server_secret=SECRET, data_dir=tmp_path), engines={})
    try:
        with ServerThread(app) as server:
            base = f"http://127.0.0.1:{server.port}"
            with dashboard_session(base, key["key"]) as customer:
                page = customer.get("/dashboard/account")
                download = customer.get(f"/dashboard/invoices/{invoice['id']}/html")
            with dashboard_session(base, admin_key) as admin:
                overview = admin.get("/dashboard/admin")
                account_page = admin.get(f"/dashboard/admin/accounts/{account['id']}")
        for response in (page, download, overview, account_page):
            assert response.status_code == 200, response.text
            assert "REPLICA-0001" in response.text and invoice["number"] not in response.text
        assert "Replica Only GmbH" in account_page.text
    finally:
        run_coro(_admin_sql(f'DROP DATABASE IF EXISTS "{replica}" WITH (FORCE)'))
        run_coro(_admin_sql(f'DROP ROLE IF EXISTS "{role}"'))
