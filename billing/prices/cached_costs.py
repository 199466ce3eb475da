"""What cached prompt tokens cost, per model, for the dashboards.

A row's cached prompt tokens (the ledger's `cached_tokens`, never more than its prompt) cost the
cached-input price in force for its account and model when it was admitted, or the input price
where that price has none (they were billed as input then). Read from the hourly aggregates
(`usage_hourly.cached_tokens`, by admission hour) priced at each hour's price, so a dashboard never
scans ledger rows; an hour in which the account's price changed is read from its ledger rows
instead, each priced at its own admission instant. Exact: Decimal sums, one rounding (half up to
the nano) per model.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.models import LedgerEntry
from billing.prices.book import EXACT, PriceBook
from billing.ledger.aggregates import HOURLY, hour_of

LEDGER = LedgerEntry.__table__
NANOS_PER_MILLION_USD = Decimal(1000)  # $1 per million tokens = 1,000 nano-USD per token


def _unit(book: PriceBook, account_id: int, model: str, at: datetime) -> Decimal | None:
    price = book.price_for(account_id, model, at)
    if price is None:
        return None
    return price.cached_input_per_million if price.cached_input_per_million is not None else price.input_per_million


async def cached_input_costs(db: AsyncEngine, book: PriceBook, start: datetime, end: datetime,
                             account_id: int | None = None) -> dict[str, int]:
    """model -> nano-USD that its cached prompt tokens cost in [start, end) (whole hours)."""
    await book.refresh()
    query = sa.select(HOURLY.c.hour, HOURLY.c.account_id, HOURLY.c.model, sa.func.sum(HOURLY.c.cached_tokens).label("cached")).where(
        HOURLY.c.hour >= start, HOURLY.c.hour < end, HOURLY.c.cached_tokens > 0)
    if account_id is not None:
        query = query.where(HOURLY.c.account_id == account_id)
    query = query.group_by(HOURLY.c.hour, HOURLY.c.account_id, HOURLY.c.model)
    exact: dict[str, Decimal] = defaultdict(Decimal)
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
        changing: dict[int, set[datetime]] = {}
        for account in {int(r.account_id) for r in rows}:
            changing[account] = {hour_of(t) for t in book.breakpoints(account, start, end)}
        for r in rows:
            hour, account = hour_of(r.hour), int(r.account_id)
            if hour in changing[account]:
                continue  # a price changed within this hour: its rows are priced one by one below
            unit = _unit(book, account, r.model, hour)
            if unit is not None:
                exact[r.model] = EXACT.add(exact[r.model], EXACT.multiply(Decimal(int(r.cached)), unit))
        for account, hours in changing.items():
            for hour in sorted(hours):
                capped = sa.case((LEDGER.c.cached_tokens > LEDGER.c.prompt_tokens, LEDGER.c.prompt_tokens), else_=LEDGER.c.cached_tokens)
                ledger_rows = (await conn.execute(sa.select(LEDGER.c.model, LEDGER.c.admitted_at, capped.label("cached")).where(
                    LEDGER.c.account_id == account, LEDGER.c.admitted_at >= hour, LEDGER.c.admitted_at < hour + timedelta(hours=1),
                    LEDGER.c.cached_tokens > 0))).all()
                for row in ledger_rows:
                    at = row.admitted_at if row.admitted_at.tzinfo else row.admitted_at.replace(tzinfo=timezone.utc)
                    unit = _unit(book, account, row.model, at)
                    if unit is not None:
                        exact[row.model] = EXACT.add(exact[row.model], EXACT.multiply(Decimal(int(row.cached)), unit))
    return {model: int(EXACT.multiply(value, NANOS_PER_MILLION_USD).quantize(Decimal(1), ROUND_HALF_UP, EXACT))
            for model, value in exact.items()}


def with_cached_costs(models: list[dict[str, Any]], costs: dict[str, int]) -> list[dict[str, Any]]:
    """The dashboards' per-model rows with `cached_cost_nanos` added."""
    return [{**m, "cached_cost_nanos": costs.get(m["model"], 0)} for m in models]
