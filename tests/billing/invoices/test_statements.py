"""Prepaid statements (issue 25): the monthly close makes, for a prepaid account, a numbered
statement (opening balance, credit rows, usage, closing balance, no amount due) instead of an
invoice; closing twice makes one; late usage shows on the next one; HTML and PDF; over HTTP the
account reads its own only (API and dashboard session), the admin any; nothing goes to Stripe."""

from __future__ import annotations

import io
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pypdf import PdfReader

from billing import migrate
from billing.credits.balance import CreditBook
from billing.db import create_engine
from billing.invoices.close import close_period
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from billing.invoices.render import render_statement_html, render_statement_pdf
from billing.invoices.statements import list_statements
from tests.billing.invoice_helpers import at, new_account, new_key, serve
from tests.conftest import run_coro

CENT = 10_000_000


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, fresh_pg_database: Any, migrated_sqlite: Any, tmp_path: Path) -> str:
    url = fresh_pg_database(migrated=True) if request.param == "postgres" else migrated_sqlite(tmp_path / 's.db')
    migrate.upgrade(url)
    return url


async def spend(db: Any, account: int, nanos: int, admitted: datetime, finished: datetime | None = None, cached: int = 0) -> None:
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="m", prompt_tokens=10, completion_tokens=5,
        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=nanos, cached_tokens=cached,
        created_at=finished or admitted, admitted_at=admitted)])


async def prepaid_months(db: Any) -> tuple[int, PriceBook]:
    """An account prepaid since Sep 10: $1 top-up, $0.50 grant, 3 cents of September usage."""
    book = PriceBook(db)
    await book.add("m", "1.000", "1.000", at(9, 1, 0), backdate=True)
    credits = CreditBook(db)
    a = await new_account(db)
    await spend(db, a, 5 * CENT, at(9, 5))  # postpaid then: invoiced
    await credits.set_mode(a, "prepaid")
    async with db.begin() as conn:
        await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": at(9, 10), "a": a})
    await credits.add(a, "topup", 100 * CENT, now=at(9, 10, 13), external_id="cs_test_sept")
    await credits.add(a, "grant", 50 * CENT, now=at(9, 12), reason="welcome credit")
    await spend(db, a, 2 * CENT, at(9, 20), cached=4)
    await spend(db, a, CENT, at(9, 30, 23, 59, 59, 900_000), finished=at(10, 1, 0, 0, 2))  # admitted in September: September's
    return a, book


async def test_the_close_makes_one_statement_per_prepaid_month_and_late_usage_shows_next(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        a, book = await prepaid_months(db)
        first = await close_period(db, book, Period.parse("2026-09"), now=at(10, 2))
        again = await close_period(db, book, Period.parse("2026-09"), now=at(10, 3))  # closing twice makes one
        assert first.statements == again.statements and len(first.statements) == 1
        [sept] = await list_statements(db, account_id=a)
        assert sept["number"] == "ST-000001" and sept["period"] == "2026-09"
        assert (sept["opening_balance_nanos"], sept["credits_nanos"], sept["usage_nanos"], sept["late_nanos"],
                sept["closing_balance_nanos"]) == (0, 150 * CENT, 3 * CENT, 0, 147 * CENT)
        assert [(c["kind"], c["amount_nanos"]) for c in sept["credits"]] == [("topup", 100 * CENT), ("grant", 50 * CENT)]
        assert [(u["model"], u["requests"], u["prompt_tokens"], u["cached_tokens"], u["cost_nanos"]) for u in sept["usage"]] == [
            ("m", 2, 20, 4, 3 * CENT)]
        assert (sept["amount_due_cents"], sept["amount_due"]) == (0, "0.00")
        async with db.connect() as conn:  # the postpaid row before Sep 10 is invoiced; the prepaid ones are not
            invoiced = (await conn.execute(sa.text(
                "SELECT sum(l.tokens) FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id WHERE i.account_id = :a"), {"a": a})).scalar()
        assert invoiced == 15
        live = await CreditBook(db).statement(a, at(9, 1, 0), at(10, 1, 0))  # GET /v1/billing/statement: the same reading
        assert live is not None and (live["usage_nanos"], live["closing_balance_nanos"]) == (3 * CENT, 147 * CENT)

        # a September row reaching the ledger after September's statement, an October refund and usage
        await spend(db, a, CENT, at(9, 28), finished=at(10, 5))
        await CreditBook(db).add(a, "refund", -10 * CENT, now=at(10, 7), external_id="re_test_1")
        await spend(db, a, 2 * CENT, at(10, 9))
        await close_period(db, book, Period.parse("2026-10"), now=at(11, 2))
        october = (await list_statements(db, account_id=a, period="2026-10"))[0]
        # opening = September's closing; the late cent on its own line; 147 - 1 - 10 - 2 = 134 cents
        assert (october["number"], october["opening_balance_nanos"], october["late_nanos"], october["credits_nanos"],
                october["usage_nanos"], october["closing_balance_nanos"]) == ("ST-000002", 147 * CENT, -CENT, -10 * CENT, 2 * CENT, 134 * CENT)
        async with db.connect() as conn:  # a prepaid month is never an invoice: nothing for Stripe to collect
            octobers = (await conn.execute(sa.text("SELECT count(*) FROM invoices WHERE account_id = :a AND period = '2026-10'"),
                                           {"a": a})).scalar()
        assert octobers == 0
        balance = await CreditBook(db).balance(a)
        assert balance is not None and balance["balance_nanos"] == october["closing_balance_nanos"]  # nothing after October

        page = render_statement_html(october)
        for text in ("Prepaid statement ST-000002", "No amount due", "$1.47", "$1.34", "-$0.01", "-$0.10", "Amount due"):
            assert text in page, text
        pdf = "".join(p.extract_text() for p in PdfReader(io.BytesIO(render_statement_pdf(october))).pages)
        for text in ("Prepaid statement ST-000002", "No amount due", "Opening balance (2026-10-01): $1.47",
                     "Closing balance (2026-11-01): $1.34", "Amount due: $0.00", "Refund"):
            assert text in pdf, text
    finally:
        await db.dispose()


async def test_a_request_admitted_before_the_switch_to_prepaid_is_invoiced_not_spent(db_url: str) -> None:
    """A row is the balance's when it was admitted after `prepaid_since`, however late it finished:
    its quota hold was taken while the account was postpaid (no balance scope), so the limiter never
    counted it against the balance and the balance must not either. Before, the rule was the row's
    finish (`created_at`): a request running across the switch spent a balance that never held for it
    (an audit measured -800,000 nano-USD on a fresh prepaid account), and its tokens left the invoice."""
    from billing.credits.balance import prepaid_totals

    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        await book.add("m", "1.000", "1.000", at(9, 1, 0), backdate=True)
        credits = CreditBook(db)
        a = await new_account(db)
        await credits.set_mode(a, "prepaid")
        async with db.begin() as conn:
            await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": at(9, 10, 0), "a": a})
        await credits.add(a, "topup", 100 * CENT, now=at(9, 10, 1), external_id="cs_test_switch")
        await spend(db, a, 8 * CENT, at(9, 9, 23, 59), finished=at(9, 10, 0, 1))  # running across the switch
        await spend(db, a, 2 * CENT, at(9, 10, 2))  # admitted prepaid
        # A row written before migration 0022 (postpaid NULL) keeps the rule it was posted under then,
        # its finish: it was paid from the balance, so it is not invoiced as well.
        await spend(db, a, 4 * CENT, at(9, 9, 23, 58), finished=at(9, 10, 0, 2))
        async with db.begin() as conn:
            await conn.execute(sa.text("UPDATE ledger_entries SET postpaid = NULL WHERE account_id = :a AND cost_nanos = :c"),
                               {"a": a, "c": 4 * CENT})
        balance = await credits.balance(a)
        assert balance is not None and balance["balance_nanos"] == 94 * CENT, balance
        async with db.connect() as conn:
            _, spent = await prepaid_totals(conn, a)  # what the limiter is seeded with: the same rows
        assert spent == 6 * CENT
        await CreditBook(db, settle_seconds=0).post_usage(a)  # posted to the credit ledger: the same rows
        assert -sum(e["amount_nanos"] for e in await credits.entries(a) if e["kind"] == "usage") == 6 * CENT

        await close_period(db, book, Period.parse("2026-09"), now=at(10, 2))
        [sept] = await list_statements(db, account_id=a)
        assert (sept["usage_nanos"], sept["closing_balance_nanos"]) == (6 * CENT, 94 * CENT)
        async with db.connect() as conn:  # the straddling row's 15 tokens are September's invoice's
            invoiced = (await conn.execute(sa.text(
                "SELECT sum(l.tokens) FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id WHERE i.account_id = :a"), {"a": a})).scalar()
        assert invoiced == 15
    finally:
        await db.dispose()


def test_statements_over_http_and_the_dashboard_are_the_accounts_own(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    with serve(url, tmp_path, TOLLGATE_CREDITS_CHECK_SECONDS="0") as app:
        async def make() -> tuple[int, str, int, str]:
            db = create_engine(url)
            try:
                a, _ = await prepaid_months(db)
                b = await new_account(db)
                return a, await new_key(db, a), b, await new_key(db, b)
            finally:
                await db.dispose()

        a, key_a, b, key_b = run_coro(make())

        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key_a) as mine, app.as_key(key_b) as other:
                closed = await admin.post("/admin/invoices/close", json={"period": "2026-09"})
                assert closed.status_code == 200, closed.text
                [statement_id] = closed.json()["statement_ids"]
                listed = (await mine.get("/v1/statements")).json()["data"]
                assert [s["id"] for s in listed] == [statement_id] and (await other.get("/v1/statements")).json()["data"] == []
                pdf = await mine.get(f"/v1/statements/{statement_id}/pdf")
                assert pdf.status_code == 200 and pdf.headers["content-type"] == "application/pdf"
                assert "ST-000001" in "".join(p.extract_text() for p in PdfReader(io.BytesIO(pdf.content)).pages)
                assert "No amount due" in (await mine.get(f"/v1/statements/{statement_id}/html")).text
                for path in (f"/v1/statements/{statement_id}", f"/v1/statements/{statement_id}/pdf"):
                    refused = await other.get(path)  # another account's: a 404 that names nothing of it
                    assert refused.status_code == 404 and "ST-" not in refused.text, path
                assert (await mine.get("/admin/statements")).status_code == 403
                assert (await admin.get(f"/admin/statements/{statement_id}/html")).status_code == 200
                assert [s["number"] for s in (await admin.get("/admin/statements", params={"account_id": a})).json()["data"]] == ["ST-000001"]
                assert (await admin.get("/admin/statements", params={"period": "2026-13"})).status_code == 400
                assert (await admin.get(f"/admin/statements/{statement_id}/xml")).status_code == 404

        run_coro(scenario())
