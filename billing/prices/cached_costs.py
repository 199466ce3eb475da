"""What cached prompt tokens cost, per model, for the dashboards.

A row's cached prompt tokens (the ledger's `cached_tokens`, never more than its prompt) cost the
cached-input price its invoice bills it at (`PriceBook.billed`: the price it was admitted at), or
the input price where that price has none (they were billed as input then). Read from the hourly
aggregates (`usage_hourly.cached_tokens`, by admission hour) priced at each hour's price, so a
dashboard never scans ledger rows; an hour in which the account's price changed, or that begins
within PRICE_LAG after a change (a process prices by the book it last loaded, and a version may be
added up to PAST_SLACK after its start), is read from its ledger rows instead, each priced as its
invoice prices it. Exact: Decimal sums, one rounding (half up to the nano) per model. A row priced
by a book stale for longer (its process could not reload it) is shown at its hour's price.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.models import LedgerEntry
from billing.prices.book import EXACT, PAST_SLACK, EffectivePrice, PriceBook
from billing.ledger.aggregates import HOURLY, hour_of

LEDGER = LedgerEntry.__table__
NANOS_PER_MILLION_USD = Decimal(1000)  # $1 per million tokens = 1,000 nano-USD per token
# How long after a price change rows may still name the prices before it: a version added up to
# PAST_SLACK after its start, seen by every process within its book's reload (5 s by default).
PRICE_LAG = PAST_SLACK + timedelta(seconds=10)


def _unit(book: PriceBook, account_id: int, model: str, at: datetime, ids: tuple[int | None, int | None] = (None, None)) -> Decimal | None:
    price: EffectivePrice | None
    try:
        price = book.billed(account_id, model, at, *ids)
    except KeyError:  # a version this book has not loaded yet (added since its last reload)
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
            changed = book.breakpoints(account, start - PRICE_LAG, end)
            changing[account] = {hour_of(t + lag) for t in changed for lag in (timedelta(0), PRICE_LAG) if start <= t + lag < end}
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
                ledger_rows = (await conn.execute(sa.select(
                    LEDGER.c.model, LEDGER.c.admitted_at, capped.label("cached"), LEDGER.c.price_version_id, LEDGER.c.override_id).where(
                    LEDGER.c.account_id == account, LEDGER.c.admitted_at >= hour, LEDGER.c.admitted_at < hour + timedelta(hours=1),
                    LEDGER.c.cached_tokens > 0))).all()
                for row in ledger_rows:
                    at = row.admitted_at if row.admitted_at.tzinfo else row.admitted_at.replace(tzinfo=timezone.utc)
                    unit = _unit(book, account, row.model, at, (row.price_version_id, row.override_id))
                    if unit is not None:
                        exact[row.model] = EXACT.add(exact[row.model], EXACT.multiply(Decimal(int(row.cached)), unit))
    return {model: int(EXACT.multiply(value, NANOS_PER_MILLION_USD).quantize(Decimal(1), ROUND_HALF_UP, EXACT))
            for model, value in exact.items()}


def with_cached_costs(models: list[dict[str, Any]], costs: dict[str, int]) -> list[dict[str, Any]]:
    """The dashboards' per-model rows with `cached_cost_nanos` added."""
    return [{**m, "cached_cost_nanos": costs.get(m["model"], 0)} for m in models]
