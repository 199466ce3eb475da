"""Invoices and prepaid statements against the ledger's `cost_nanos`, the figure limits, balances
and dashboards use: rows are priced as the gateway prices them (PriceBook.current_for at
admission, EffectivePrice.cost_nanos), summed in SQL for the account and month, and compared with
the documents the monthly close issues, exactly (integers and Decimal):

- invoice: its usage lines hold exactly the billable rows' cost (sum over lines of tokens x unit
  price == sum of cost_nanos, to the nano where each price is a whole number of nano-USD per token;
  with a multiplier each row's cost is rounded half up to the nano, so within half a nano a row);
  each line is its exact cost rounded half up to the cent once (docs/invoices.md), and the subtotal
  is their sum, so within half a cent a line of the ledger's sum;
- statement: usage == the month's cost_nanos (rows that finished since prepaid_since, by
  admission month), each model's cost too, and closing == credits - cost_nanos up to the month's
  end == the account's balance (docs/prepaid.md); the account's postpaid part of the month is on an
  invoice that matches the ledger the same way."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from billing import migrate
from billing.credits import CreditBook
from billing.db import create_engine
from billing.invoices import list_invoices
from billing.invoicing import BILLABLE_STATUSES, close_period
from billing.ledger import UsageRecord, write_records
from billing.periods import Period
from billing.prices import PriceBook
from billing.statements import list_statements
from tests.billing.invoice_helpers import at, new_account, price_history

SEPT = Period.month(2026, 9)
CENT = 10_000_000
NANOS_PER_UNIT_PER_MILLION = 1000  # $1 per 1M tokens = 1,000 nano-USD per token


@pytest.fixture
def db_url(fresh_pg_database: Any) -> str:
    url = fresh_pg_database()
    migrate.upgrade(url)
    return url


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[Any]:
    engine = create_engine(db_url)
    yield engine
    await engine.dispose()


async def priced(db: Any, book: PriceBook, account: int, model: str, prompt: int, completion: int, admitted: datetime,
                 finished: datetime | None = None, *, cached: int = 0, status: str = "completed") -> None:
    """A ledger row costed the way the gateway costs it: the price in force at admission."""
    price = await book.current_for(account, model, admitted)
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model=model, prompt_tokens=prompt,
        completion_tokens=completion, status=status, finish_reason="stop", total_ms=1.0,
        cost_nanos=None if price is None else price.cost_nanos(prompt, completion, cached), cached_tokens=cached,
        created_at=finished or admitted + timedelta(milliseconds=3), admitted_at=admitted)])


async def month_of_usage(db: Any, book: PriceBook, account: int) -> None:
    """Price changes, a row admitted before one and finished after, the month's edges, cached
    prompt tokens at a cached-input price, odd token counts, and rows that are not billed."""
    await priced(db, book, account, "alpha", 1_000_001, 250_003, at(9, 5, 10))
    await priced(db, book, account, "alpha", 33_333, 7_777, at(9, 15, 23, 59, 59, 999_000), at(9, 16, 0, 0, 2))  # old price
    await priced(db, book, account, "alpha", 25_000, 10_001, at(9, 16, 0))
    await priced(db, book, account, "alpha", 2_500_000, 67_776, at(9, 20), status="cancelled")
    await priced(db, book, account, "alpha", 999_999, 999_999, at(9, 21), status="error")  # not billed
    await priced(db, book, account, "beta", 12_345, 6_789, at(9, 25))
    await priced(db, book, account, "delta", 40_001, 1_003, at(9, 26), cached=30_007)
    await priced(db, book, account, "delta", 9_999, 333, at(9, 27), cached=9_999)
    await priced(db, book, account, "alpha", 5_000_000, 0, at(8, 31, 23, 59, 59), at(9, 1, 0, 0, 1))  # August's
    await priced(db, book, account, "beta", 77_777, 0, at(9, 30, 23, 59, 59, 900_000), at(10, 1, 0, 0, 3))  # September's
    await priced(db, book, account, "alpha", 5_000_000, 0, at(10, 1, 0))  # October's


async def ledger_cost(db: Any, account: int, period: Period, *, billable: bool, since: datetime | None = None,
                      before_since: bool = False) -> tuple[int, int]:
    """(sum of cost_nanos, rows) of the account's rows admitted in the period, in SQL."""
    where = ["account_id = :a", "admitted_at >= :start", "admitted_at < :end"]
    if billable:
        where.append("status IN (" + ", ".join(f"'{s}'" for s in BILLABLE_STATUSES) + ")")
    if since is not None:
        where.append("created_at < :since" if before_since else "created_at >= :since")
    async with db.connect() as conn:
        row = (await conn.execute(sa.text(
            f"SELECT coalesce(sum(cost_nanos), 0) AS cost, count(*) AS n FROM ledger_entries WHERE {' AND '.join(where)}"),
            {"a": account, "start": period.start, "end": period.end, "since": since})).one()
    return int(row.cost), int(row.n)


def line_nanos(line: dict[str, Any]) -> Decimal:
    return Decimal(line["tokens"]) * Decimal(line["unit_price_per_million"] or 0) * NANOS_PER_UNIT_PER_MILLION


def check_invoice(invoice: dict[str, Any], cost: int, rows: int, *, whole_nanos: bool) -> None:
    usage = [line for line in invoice["lines"] if line["kind"] == "usage"]
    exact = sum((line_nanos(line) for line in usage), Decimal(0))
    if whole_nanos:
        assert exact == cost, (exact, cost)
    else:  # each row's cost was rounded half up to the nano once
        assert abs(exact - cost) <= Decimal(rows) / 2, (exact, cost, rows)
    for line in usage:  # once per line, half up, from the line's exact cost
        assert line["amount_cents"] == int((line_nanos(line) / CENT).quantize(Decimal(1), ROUND_HALF_UP)), line
    assert invoice["subtotal_cents"] == sum(line["amount_cents"] for line in usage)
    assert abs(Decimal(invoice["subtotal_cents"] * CENT) - exact) <= Decimal(len(usage) * CENT) / 2
    assert invoice["total_cents"] == invoice["subtotal_cents"] + ((invoice.get("tax") or {}).get("amount_cents") or 0)


async def prices(db: Any) -> PriceBook:
    book = PriceBook(db)
    await price_history(book)
    await book.add("delta", "0.400", "1.600", at(8, 1, 0), backdate=True, cached_input_per_million="0.100")
    return book


async def test_invoices_hold_exactly_the_ledgers_cost(db: Any) -> None:
    book = await prices(db)
    plain, scaled = await new_account(db, "plain"), await new_account(db, "scaled")
    await book.add_override(scaled, "*", multiplier="0.85", effective_from=at(8, 1, 0), backdate=True)
    await book.refresh(force=True)
    for account in (plain, scaled):
        await month_of_usage(db, book, account)
    result = await close_period(db, book, SEPT, now=at(11, 1, 2))
    assert len(result.created) == 2
    invoices = {i["account_id"]: i for i in await list_invoices(db, period=str(SEPT))}

    cost, rows = await ledger_cost(db, plain, SEPT, billable=True)
    everything, _ = await ledger_cost(db, plain, SEPT, billable=False)
    assert rows == 8 and everything > cost  # the error row has a cost the invoice does not bill
    check_invoice(invoices[plain], cost, rows, whole_nanos=True)
    cost, rows = await ledger_cost(db, scaled, SEPT, billable=True)
    check_invoice(invoices[scaled], cost, rows, whole_nanos=False)
    assert cost % NANOS_PER_UNIT_PER_MILLION != 0  # the multiplier did leave fractions to round


async def test_statements_hold_exactly_the_ledgers_cost_and_end_at_the_balance(db: Any) -> None:
    book = await prices(db)
    await book.refresh(force=True)
    credits = CreditBook(db)
    account = await new_account(db, "prepaid")
    since = at(9, 10)
    await priced(db, book, account, "alpha", 400_001, 20_001, at(9, 3))  # postpaid then: invoiced
    await priced(db, book, account, "beta", 10_000, 1, at(9, 10, 11, 59, 59, 999_000), at(9, 10, 12, 0, 1))  # finished prepaid
    await credits.set_mode(account, "prepaid")
    async with db.begin() as conn:
        await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": since, "a": account})
    await credits.add(account, "topup", 500 * CENT, now=at(9, 10, 13), external_id=f"cs_{uuid.uuid4().hex}")
    await credits.add(account, "grant", 50 * CENT, now=at(9, 12), reason="welcome")
    await month_of_usage(db, book, account)
    await credits.add(account, "refund", -30 * CENT, now=at(9, 28), external_id=f"re_{uuid.uuid4().hex}")
    await close_period(db, book, SEPT, now=at(11, 1, 2))

    [statement] = await list_statements(db, account_id=account, period=str(SEPT))
    cost, rows = await ledger_cost(db, account, SEPT, billable=False, since=since)
    assert rows == 8 + 1  # September's after Sep 10 12:00 (the error row too: it spent the balance), and the one that finished then
    assert statement["usage_nanos"] == cost == sum(u["cost_nanos"] for u in statement["usage"])
    async with db.connect() as conn:
        per_model = dict((await conn.execute(sa.text(
            "SELECT model, sum(cost_nanos) FROM ledger_entries WHERE account_id = :a AND created_at >= :since AND admitted_at >= :s "
            "AND admitted_at < :e GROUP BY model"), {"a": account, "since": since, "s": SEPT.start, "e": SEPT.end})).all())
        credited = int((await conn.execute(sa.text(
            "SELECT coalesce(sum(amount_nanos), 0) FROM credit_entries WHERE account_id = :a AND kind <> 'usage' AND created_at < :e"),
            {"a": account, "e": SEPT.end})).scalar_one())
        spent = int((await conn.execute(sa.text(
            "SELECT coalesce(sum(cost_nanos), 0) FROM ledger_entries WHERE account_id = :a AND created_at >= :since AND admitted_at < :e"),
            {"a": account, "since": since, "e": SEPT.end})).scalar_one())
    assert {u["model"]: u["cost_nanos"] for u in statement["usage"]} == {m: int(c) for m, c in per_model.items()}
    assert statement["opening_balance_nanos"] == 0 and statement["late_nanos"] == 0
    assert statement["credits_nanos"] == credited == 520 * CENT
    assert statement["closing_balance_nanos"] == credited - spent == credited - cost
    october, _ = await ledger_cost(db, account, SEPT.next(), billable=False, since=since)
    balance = await credits.balance(account)  # what admission and the dashboards read: September's end less October's row
    assert october > 0 and balance is not None and balance["balance_nanos"] == statement["closing_balance_nanos"] - october

    # the month's postpaid part: rows that finished before prepaid_since, on an invoice
    [invoice] = await list_invoices(db, account_id=account, period=str(SEPT))
    cost, rows = await ledger_cost(db, account, SEPT, billable=True, since=since, before_since=True)
    assert rows == 2
    check_invoice(invoice, cost, rows, whole_nanos=True)
