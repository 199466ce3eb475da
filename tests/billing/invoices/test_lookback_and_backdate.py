"""Two edges of what an invoice bills:

- Late usage of the month exactly TOLLGATE_BILLING_LOOKBACK_MONTHS before the one being closed is
  still billed (as an adjustment): the window is [period - lookback, period). Dropping that month
  would lose its late rows for good, since the next close looks back no further.
- A version added with `backdate` re-prices the rows admitted from its very start until it was added
  (docs/billing.md), though they name the version they were admitted at."""

from __future__ import annotations

import uuid
from datetime import timedelta
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from billing.invoices.close import close_period, priced_usage
from billing.invoices.views import get_invoice
from billing.invoices.periods import Period
from billing.ledger.writer import UsageRecord, write_records
from billing.models import utcnow
from billing.prices.book import PriceBook
from tests.billing.invoice_helpers import at, new_account, usage

SEPT, OCT, NOV, DEC = (Period.month(2026, m) for m in (9, 10, 11, 12))


async def test_late_usage_of_the_month_lookback_months_back_is_billed(db: Any) -> None:
    book = PriceBook(db)
    await book.add("alpha", "1.000", "2.000", at(1, 1, 0), backdate=True)
    account = await new_account(db)
    await usage(db, account, "alpha", 1_000_000, 0, at(9, 5))
    for month, now in ((SEPT, at(10, 1, 2)), (OCT, at(11, 1, 2)), (NOV, at(12, 1, 2))):
        await close_period(db, book, month, now=now)
    await usage(db, account, "alpha", 3_000_000, 0, at(9, 20))  # reaches the ledger after September closed
    result = await close_period(db, book, DEC, now=at(1, 1, 2, year=2027), lookback_months=3)  # Sept = Dec - 3
    assert len(result.created) == 1
    invoice = await get_invoice(db, result.created[0])
    assert invoice is not None
    assert [(l["kind"], l["usage_period"], l["tokens"], l["amount_cents"]) for l in invoice["lines"]] == [
        ("adjustment", "2026-09", 3_000_000, 300)]


async def test_a_backdated_version_prices_rows_from_its_first_instant(db: Any) -> None:
    book = PriceBook(db)
    old = await book.add("alpha", "1.000", "2.000", at(1, 1, 0), backdate=True)
    async with db.begin() as conn:  # added at its start long ago (not a backdated version itself)
        await conn.execute(sa.text("UPDATE prices SET created_at = effective_from WHERE id = :i"), {"i": old.id})
    account = await new_account(db)
    admitted = utcnow().replace(microsecond=0) - timedelta(minutes=10)
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="alpha", prompt_tokens=1_000, completion_tokens=100,
        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=1_200_000, created_at=admitted + timedelta(milliseconds=1),
        admitted_at=admitted, price_version_id=old.id)])  # priced by the gateway at the old version
    book = PriceBook(db)
    await book.add("alpha", "5.000", "9.000", admitted - timedelta(minutes=2), backdate=True)
    async with db.connect() as conn:
        usage_now = await priced_usage(conn, book, account, admitted - timedelta(hours=1), utcnow() + timedelta(minutes=1))
    assert sorted((k.direction, k.unit_price, v.tokens) for k, v in usage_now.items()) == [
        ("input", Decimal(5), 1_000), ("output", Decimal(9), 100)]
