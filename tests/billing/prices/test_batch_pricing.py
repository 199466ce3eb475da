"""The batch price (docs/batches.md): a price version's batch_input / batch_output per million
price a batch line (api = batch); without them the normal price does; an account multiplier scales
them; invoices put batch tokens on lines of their own at the batch price. Postgres and SQLite."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.invoices.models import InvoiceLine
from billing.invoices.close import close_period
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from tests.billing.invoice_helpers import at, new_account

SEPT = Period.parse("2026-09")


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, fresh_pg_database: Any, migrated_sqlite: Any, tmp_path: Path) -> str:
    url = fresh_pg_database(migrated=True) if request.param == "postgres" else migrated_sqlite(tmp_path / 'b.db')
    migrate.upgrade(url)
    return url


async def row(db: Any, account: int, prompt: int, completion: int, when: datetime, api: str | None) -> None:
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="m", prompt_tokens=prompt,
        completion_tokens=completion, status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=7,
        created_at=when, api=api, batch_id="batch_x" if api == "batch" else None, cached_tokens=prompt // 2,
    )])


async def test_the_batch_price_and_its_invoice_lines(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        await book.add("m", "2.000", "4.000", at(9, 1, 0), backdate=True, cached_input_per_million="0.500",
                       batch_input_per_million="1.000", batch_output_per_million="2.000")
        await book.add("plain", "2.000", "4.000", at(9, 1, 0), backdate=True)
        a = await new_account(db)
        price = book.price_for(a, "m", at(9, 5))
        assert price is not None
        batch = price.for_batch()
        assert (batch.input_per_million, batch.output_per_million, batch.cached_input_per_million) == (Decimal("1"), Decimal("2"), None)
        assert batch.cost_nanos(1000, 100, 500) == 1000 * 1000 + 100 * 2000  # cached prompt tokens at the batch input price
        plain = book.price_for(a, "plain", at(9, 5))
        assert plain is not None and plain.for_batch().cost_nanos(10, 10) == plain.cost_nanos(10, 10)  # no batch price: the normal one
        await book.add_override(a, "*", multiplier="0.5", effective_from=at(9, 20), backdate=True)
        await book.refresh(force=True)
        scaled = book.price_for(a, "m", at(9, 21))
        assert scaled is not None and scaled.for_batch().input_per_million == Decimal("0.5")
        await row(db, a, 1_000_000, 100_000, at(9, 5), api="chat")
        await row(db, a, 3_000_000, 500_000, at(9, 6), api="batch")
        await close_period(db, book, SEPT, now=at(10, 2))
        async with db.connect() as conn:
            lines = (await conn.execute(sa.select(InvoiceLine.__table__).order_by(InvoiceLine.__table__.c.position))).all()
        got = [(r.direction, int(r.tokens), Decimal(r.unit_price), int(r.amount_cents)) for r in lines]
        # interactive: 500,000 input x $2 = 100 c, 500,000 cached x $0.5 = 25 c, 100,000 output x $4 = 40 c;
        # batch: 3,000,000 input x $1 = 300 c, 500,000 output x $2 = 100 c
        assert got == [("input", 500_000, Decimal("2"), 100), ("cached", 500_000, Decimal("0.5"), 25), ("output", 100_000, Decimal("4"), 40),
                       ("batch_input", 3_000_000, Decimal("1"), 300), ("batch_output", 500_000, Decimal("2"), 100)]
        assert "m, batch input tokens: 3,000,000 x $1" in lines[3].description
    finally:
        await db.dispose()
