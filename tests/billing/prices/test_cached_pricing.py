"""Cached-input pricing (issue 25): a price version may set a cached-input price per million;
a request's cost is its cached prompt tokens at that price plus the rest of the prompt at the
input price; an engine that does not report cached tokens pays the input price for all of it;
invoices show the cached tokens on their own line. Amounts checked to the nano and the cent."""

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
from billing.prices.book import InvalidPrice, PriceBook
from tests.billing.invoice_helpers import at, new_account

SEPT = Period.parse("2026-09")


async def test_cost_nanos_exact() -> None:
    book_price = dict(model="m", input_per_million=Decimal("1.250"), output_per_million=Decimal("2.500"), currency="USD")
    from billing.prices.book import EffectivePrice, PriceVersion

    version = PriceVersion(id=1, effective_from=at(9, 1), cached_input_per_million=Decimal("0.125"), **book_price)  # type: ignore[arg-type]
    # 400 uncached x 1,250 + 600 cached x 125 + 50 out x 2,500 nano-USD
    assert version.cost_nanos(1000, 50, 600) == 400 * 1250 + 600 * 125 + 50 * 2500 == 700_000
    assert version.cost_nanos(1000, 50, None) == 1000 * 1250 + 50 * 2500 == 1_375_000  # engine said nothing
    assert version.cost_nanos(1000, 50, 5000) == 1000 * 125 + 50 * 2500  # never more cached than prompt
    uncached = PriceVersion(id=2, effective_from=at(9, 1), **book_price)  # type: ignore[arg-type]
    assert uncached.cost_nanos(1000, 50, 600) == 1_375_000  # no cached price: all input at the input price
    # a multiplier leaves fractions of a nano per token: exact Decimal, rounded half up once per request
    scaled = EffectivePrice("m", Decimal("0.416666250"), Decimal("0.833332500"), "USD", None, None, Decimal("0.041666625"))
    # 1 x 416.66625 + 2 x 41.666625 + 1 x 833.3325 = 1,333.33225 -> 1,333
    assert scaled.cost_nanos(3, 1, 2) == 1333
    assert scaled.cost_nanos(3, 1, None) == 2083  # 3 x 416.66625 + 833.3325 = 2,083.33125


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, fresh_pg_database: Any, migrated_sqlite: Any, tmp_path: Path) -> str:
    url = fresh_pg_database(migrated=True) if request.param == "postgres" else migrated_sqlite(tmp_path / 'c.db')
    migrate.upgrade(url)
    return url


async def row(db: Any, account: int, prompt: int, completion: int, cached: int | None, when: datetime) -> None:
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="m", prompt_tokens=prompt,
        completion_tokens=completion, status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=7,
        created_at=when, cached_tokens=cached,
    )])


async def test_price_book_and_multiplier(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        a = await new_account(db)
        v = await book.add("m", "1.250", "2.500", at(9, 1, 0), backdate=True, cached_input_per_million="0.125")
        assert v.view()["cached_input_per_million"] == "0.125"
        with pytest.raises(InvalidPrice, match="cached_input_per_million"):
            await book.add("m", "1", "1", cached_input_per_million="0.0001")
        await book.add_override(a, "*", multiplier="0.5", effective_from=at(9, 2, 0), backdate=True)
        price = book.price_for(a, "m", at(9, 3))
        assert price is not None and price.cached_input_per_million == Decimal("0.0625")
        assert price.cost_nanos(1000, 0, 600) == 400 * 625 + 600 * Decimal("62.5")  # 287,500
        # a custom price for one model without a cached price: its input price for the whole prompt
        await book.add_override(a, "m", input_per_million="1", output_per_million="1", effective_from=at(9, 4, 0), backdate=True)
        custom = book.price_for(a, "m", at(9, 5))
        assert custom is not None and custom.cost_nanos(1000, 0, 600) == 1_000_000
        # ... and with one: 400 x 1,000 + 600 x 100 nano-USD
        o = await book.add_override(a, "m", input_per_million="1", output_per_million="1", cached_input_per_million="0.100",
                                    effective_from=at(9, 6, 0), backdate=True)
        assert o.view()["cached_input_per_million"] == "0.100"
        custom = book.price_for(a, "m", at(9, 7))
        assert custom is not None and custom.cost_nanos(1000, 0, 600) == 460_000
        for bad in ({"multiplier": "2"}, {}):  # a cached price goes with a custom price only
            with pytest.raises(InvalidPrice, match="cached_input_per_million"):
                await book.add_override(a, "m", cached_input_per_million="0.1", effective_from=at(9, 8, 0), backdate=True, **bad)
        with pytest.raises(InvalidPrice, match="cached_input_per_million"):
            await book.add_override(a, "m", input_per_million="1", output_per_million="1", cached_input_per_million="0.0001",
                                    effective_from=at(9, 8, 0), backdate=True)
    finally:
        await db.dispose()


async def test_invoice_has_a_cached_input_line(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        await book.add("m", "1.250", "2.500", at(9, 1, 0), backdate=True, cached_input_per_million="0.125")
        a = await new_account(db)
        await row(db, a, 1_000_000, 100_000, 600_000, at(9, 5))
        await row(db, a, 200_000, 0, None, at(9, 6))  # the engine did not report: all at the input price
        await row(db, a, 30_000, 0, 0, at(9, 7))
        await close_period(db, book, SEPT, now=at(10, 2))
        async with db.connect() as conn:
            lines = (await conn.execute(sa.select(InvoiceLine.__table__).order_by(InvoiceLine.__table__.c.position))).all()
            total = (await conn.execute(sa.text("SELECT total_cents FROM invoices"))).scalar_one()
        got = [(r.direction, int(r.tokens), Decimal(r.unit_price), int(r.amount_cents)) for r in lines]
        # input: 400,000 + 200,000 + 30,000 = 630,000 x $1.25/M = $0.7875 -> 79 cents
        # cached: 600,000 x $0.125/M = $0.075 -> 8 cents; output: 100,000 x $2.5/M = 25 cents
        assert got == [("input", 630_000, Decimal("1.25"), 79), ("cached", 600_000, Decimal("0.125"), 8), ("output", 100_000, Decimal("2.5"), 25)]
        assert total == 79 + 8 + 25
        assert "cached input tokens: 600,000 x $0.125" in lines[1].description
    finally:
        await db.dispose()


async def test_a_custom_account_price_with_a_cached_price_is_invoiced_on_its_own_line(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        await book.add("m", "1.250", "2.500", at(9, 1, 0), backdate=True, cached_input_per_million="0.125")
        a = await new_account(db)
        await book.add_override(a, "m", input_per_million="2.000", output_per_million="4.000", cached_input_per_million="0.500",
                                effective_from=at(9, 1, 0), backdate=True)
        await row(db, a, 1_000_000, 100_000, 600_000, at(9, 5))
        await close_period(db, book, SEPT, now=at(10, 2))
        async with db.connect() as conn:
            lines = (await conn.execute(sa.select(InvoiceLine.__table__).order_by(InvoiceLine.__table__.c.position))).all()
        got = [(r.direction, int(r.tokens), Decimal(r.unit_price), int(r.amount_cents), r.override_id is not None) for r in lines]
        # input 400,000 x $2/M = 80 cents; cached 600,000 x $0.5/M = 30 cents; output 100,000 x $4/M = 40 cents
        assert got == [("input", 400_000, Decimal("2"), 80, True), ("cached", 600_000, Decimal("0.5"), 30, True),
                       ("output", 100_000, Decimal("4"), 40, True)]
        assert "cached input tokens: 600,000 x $0.500 per 1M tokens (account price)" in lines[1].description
    finally:
        await db.dispose()
